"""What an input file looked like when a run started, so ``--resume`` can tell it is still the same file.

Resume continues after the rows already written, so it is only right when the input's first rows are
the ones the interrupted run read. Comparing the path alone let an edited file mix old and new rows.
The fingerprint is the file's size and modification time plus a SHA-256 of its content: all of it
for files up to 8 MiB (milliseconds), the first and last MiB of larger ones (a fixed cost, however
large the corpus; an edit that keeps size, head and tail and restores the modification time would
go unnoticed there, and only there). Stdin and in-memory texts cannot be read twice, so they have no
fingerprint and cannot be resumed.

An input of many shards (a directory, a glob, a Hugging Face dataset: ``data/shards.py``) is
fingerprinted file by file, keyed by the shard's name, plus the order the shards are read in and one SHA-256
over all of it, so a shard added, removed, changed or moved is named when a resume is refused (a Hugging Face
dataset's order is its ``state.json``'s, which can change while every file stays the same). A file behind a
URL is read through pyarrow's filesystem the same way; its modification time is the object store's LastModified
(an S3 ETag is not exposed by pyarrow; the size, LastModified and the hashed bytes stand for it).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, BinaryIO

from memfit.data.shards import expand, is_url, open_file, shard_info
from memfit.errors import InputError, OutputError

FULL_HASH_MAX_BYTES = 8 * 2**20
EDGE_BYTES = 2**20
_READ_BYTES = 2**20


def input_fingerprint(source: object) -> dict[str, Any] | None:
    """The fingerprint of an input; ``None`` for stdin (``-``) and in-memory texts.

    One local or remote file: ``size``, ``mtime_ns``, ``sha256``, ``hashed``. Many shards: ``files``
    (that record per shard name), ``order`` (the names as the shards are read) and ``sha256`` over both."""
    if not isinstance(source, (str, os.PathLike)) or os.fspath(source) == "-":
        return None
    path = os.fspath(source)
    shards = expand(path)
    if len(shards) == 1 and shards[0] == path:
        return _file_fingerprint(path)
    files = {_shard_name(shard): _file_fingerprint(shard) for shard in shards}
    order = list(files)  # the names as the shards are read (a name is unique: wildcards are in the last name only)
    digest = hashlib.sha256(json.dumps([files, order], sort_keys=True).encode()).hexdigest()
    return {"files": files, "order": order, "sha256": digest}


def _shard_name(shard: str) -> str:
    """A shard's name within its input (a directory's file name; a HF dataset's Arrow file)."""
    return shard.rsplit("/", 1)[-1] if is_url(shard) else os.path.basename(shard)


def _file_fingerprint(path: str) -> dict[str, Any]:
    """One file's record: size and mtime from its filesystem (local ``fstat``, or the object's listing)."""
    try:
        with open_file(path) as fh:
            if is_url(path):
                info = shard_info(path, path)
                size, mtime_ns = info.size, info.mtime_ns
            else:
                size, mtime_ns = os.fstat(fh.fileno()).st_size, os.fstat(fh.fileno()).st_mtime_ns
            sha256, hashed = _content_hash(fh, size)
    except OSError as exc:
        raise InputError(path, f"cannot read: {exc.strerror or exc}") from None
    return {"size": size, "mtime_ns": mtime_ns, "sha256": sha256, "hashed": hashed}


def _content_hash(fh: BinaryIO, size: int) -> tuple[str, str]:
    """SHA-256 of the whole file up to 8 MiB, else of its first and last MiB; and which it was."""
    digest = hashlib.sha256()
    if size <= FULL_HASH_MAX_BYTES:
        while chunk := fh.read(_READ_BYTES):
            digest.update(chunk)
        return digest.hexdigest(), "whole file"
    digest.update(fh.read(EDGE_BYTES))
    fh.seek(size - EDGE_BYTES)
    digest.update(fh.read(EDGE_BYTES))
    return digest.hexdigest(), "first and last MiB"


def check_same_input(
    recorded: dict[str, Any] | None, current: dict[str, Any] | None, input_name: str, out_dir: os.PathLike | str
) -> None:
    """Refuse to resume unless ``current`` is the input ``recorded`` when the output was started.

    The modification time counts only where part of the file was not hashed: a fully hashed file
    that was merely touched or copied is still the same input.
    """
    fresh = "or write to a new output directory without --resume"
    if current is None:
        what = "stdin" if input_name == "-" else "in-memory texts"
        raise OutputError(
            f"{out_dir}: cannot resume from {what}: memfit cannot check that they are the input of "
            f"the interrupted run; save the input to a file and run again, {fresh}"
        )
    if recorded is None:
        raise OutputError(
            f"{out_dir}: the manifest records no fingerprint of its input (written from stdin or by "
            f"an older memfit), so resuming cannot check that {input_name} is unchanged; write to a new "
            "output directory without --resume"
        )
    changes = _changes(recorded, current)
    if changes:
        raise OutputError(
            f"{input_name}: changed since the run in {out_dir} started ({changes[0]}); resuming would "
            f"mix rows of two inputs: restore the original file, {fresh}"
        )


def _changes(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between two fingerprints, shard by shard for a sharded input (empty: the same input)."""
    if "files" in current or "files" in recorded:
        before, now = recorded.get("files") or {}, current.get("files") or {}
        if sorted(before) != sorted(now):
            gone, new = sorted(set(before) - set(now)), sorted(set(now) - set(before))
            return [
                f"shards {'removed: ' + ', '.join(gone) if gone else ''}"
                f"{'; ' if gone and new else ''}{'added: ' + ', '.join(new) if new else ''}"
            ]
        changes = [f"shard {name}: {change}" for name in sorted(now) for change in _changes(before[name], now[name])]
        # the order is recorded since this check was added: an older manifest's shards were read in name order
        # (a directory, a glob) or in its state.json's, which is not known any more
        order_before, order_now = recorded.get("order"), current.get("order")
        if not changes and order_before is not None and order_before != order_now:
            return [f"shards read in another order: {', '.join(order_before)} -> {', '.join(order_now or [])}"]
        return changes
    if recorded.get("size") != current["size"]:
        return [f"size {recorded.get('size')} -> {current['size']} bytes"]
    if recorded.get("sha256") != current["sha256"]:
        return [f"content differs ({current['hashed']} hashed)"]
    if current["hashed"] != "whole file" and recorded.get("mtime_ns") != current["mtime_ns"]:
        return ["modification time differs"]
    return []
