"""What an input file looked like when a run started, so ``--resume`` can tell it is still the same file.

Resume continues after the rows already written, so it is only right when the input's first rows are
the ones the interrupted run read. Comparing the path alone let an edited file mix old and new rows.
The fingerprint is the file's size and modification time plus a SHA-256 of its content: all of it
for files up to 8 MiB (milliseconds), the first and last MiB of larger ones (a fixed cost, however
large the corpus; an edit that keeps size, head and tail and restores the modification time would
go unnoticed there, and only there). Stdin and in-memory texts cannot be read twice, so they have no
fingerprint and cannot be resumed.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from memfit.errors import InputError, OutputError

FULL_HASH_MAX_BYTES = 8 * 2**20
EDGE_BYTES = 2**20
_READ_BYTES = 2**20


def input_fingerprint(source: object) -> dict[str, Any] | None:
    """The fingerprint of an input file; ``None`` for stdin (``-``) and in-memory texts."""
    if not isinstance(source, (str, os.PathLike)) or os.fspath(source) == "-":
        return None
    path = os.fspath(source)
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            mtime_ns = os.fstat(fh.fileno()).st_mtime_ns
            if size <= FULL_HASH_MAX_BYTES:
                while chunk := fh.read(_READ_BYTES):
                    digest.update(chunk)
                hashed = "whole file"
            else:
                digest.update(fh.read(EDGE_BYTES))
                fh.seek(size - EDGE_BYTES)
                digest.update(fh.read(EDGE_BYTES))
                hashed = "first and last MiB"
    except OSError as exc:
        raise InputError(path, f"cannot read: {exc.strerror or exc}") from None
    return {"size": size, "mtime_ns": mtime_ns, "sha256": digest.hexdigest(), "hashed": hashed}


def check_same_input(recorded: dict[str, Any] | None, current: dict[str, Any] | None, input_name: str,
                     out_dir: os.PathLike | str) -> None:
    """Refuse to resume unless ``current`` is the input ``recorded`` when the output was started.

    The modification time counts only where part of the file was not hashed: a fully hashed file
    that was merely touched or copied is still the same input.
    """
    fresh = "or write to a new output directory without --resume"
    if current is None:
        what = "stdin" if input_name == "-" else "in-memory texts"
        raise OutputError(f"{out_dir}: cannot resume from {what}: memfit cannot check that they are the input of "
                          f"the interrupted run; save the input to a file and run again, {fresh}")
    if recorded is None:
        raise OutputError(f"{out_dir}: the manifest records no fingerprint of its input (written from stdin or by "
                          f"an older memfit), so resuming cannot check that {input_name} is unchanged; write to a new "
                          "output directory without --resume")
    changes = []
    if recorded.get("size") != current["size"]:
        changes.append(f"size {recorded.get('size')} -> {current['size']} bytes")
    elif recorded.get("sha256") != current["sha256"]:
        changes.append(f"content differs ({current['hashed']} hashed)")
    elif current["hashed"] != "whole file" and recorded.get("mtime_ns") != current["mtime_ns"]:
        changes.append("modification time differs")
    if changes:
        raise OutputError(f"{input_name}: changed since the run in {out_dir} started ({changes[0]}); resuming would "
                          f"mix rows of two inputs: restore the original file, {fresh}")
