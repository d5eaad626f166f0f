"""Crash-safe file writes: write under a temporary name, flush it to disk, rename it into place.

A reader (or a ``--resume``) then sees either the old file or the complete new one, never a part
of it, even after ``kill -9`` or a power cut: ``os.replace`` is atomic within a directory, and the
``fsync`` before it makes sure the renamed file holds its data. The temporary name is the final
name plus :data:`TMP_SUFFIX`, which the output directory's clean-up (``io/sinks.py``, ``ray/commit.py``)
recognises as an unfinished write and removes. A file that several processes may write at once (the
caches: memory calibrations, OpenVINO graphs) takes a ``private`` temporary name of the writing process's
own, so that no process renames another's half-written file.

It sits at the bottom of the layers (beside ``errors`` and ``defaults``, docs/architecture.md): every
layer that writes a file uses it.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

TMP_SUFFIX = ".tmp"

_PRIVATE_NAME = re.compile(rf"^\..+\.(\d+){re.escape(TMP_SUFFIX)}(\..+)?$")
"""A private temporary name (:func:`temporary_path`), and anything a writer derives from it by adding a suffix
(OpenVINO's ``.bin`` beside its ``.xml``, the ONNX export's ``.classic`` trace): group 1 is the writer's pid."""


def temporary_path(final: Path, private: bool = False) -> Path:
    """Where ``final`` is written before it is renamed into place. ``private``: a hidden name of this
    process's own that keeps ``final``'s suffix (``.model.1234.tmp.xml``), for files other processes may
    write at the same time (and for writers, like OpenVINO's, that need the suffix)."""
    if private:
        return final.with_name(f".{final.stem}.{os.getpid()}{TMP_SUFFIX}{final.suffix}")
    return final.with_name(final.name + TMP_SUFFIX)


def private_files(directory: Path) -> list[tuple[Path, int]]:
    """The private temporary files (:func:`temporary_path`) in ``directory``, each with its writer's pid."""
    found = []
    for path in directory.iterdir() if directory.is_dir() else ():
        match = _PRIVATE_NAME.match(path.name)
        if match is not None and path.is_file():
            found.append((path, int(match.group(1))))
    return found


def abandoned_private_files(directory: Path, untouched_for_s: float) -> list[Path]:
    """The private temporary files in ``directory`` whose writer is not running on this machine and that nothing
    has written for ``untouched_for_s`` seconds.

    Why: a process killed while it writes a private file (a graph conversion child stopped by the kernel's
    out-of-memory killer) leaves it behind under a name no other process will ever rename or remove, and a graph's
    is the size of the model's weights. A pid is only this machine's: a writer in another container that shares the
    folder is not seen running, so a file is also left alone while it is recent."""
    now = time.time()
    abandoned = []
    for path, pid in private_files(directory):
        with contextlib.suppress(OSError):  # gone meanwhile
            if not _is_running(pid) and now - path.stat().st_mtime >= untouched_for_s:
                abandoned.append(path)
    return abandoned


def _is_running(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (one of another user's counts: signal 0 is only refused)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):  # not a pid at all
        return False
    return True


def replace_durably(tmp: Path, final: Path) -> None:
    """Flush the finished ``tmp`` to disk, then rename it to ``final`` in one step."""
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)


@contextmanager
def written_atomically(final: Path, private: bool = False) -> Iterator[Path]:
    """The path to write ``final``'s content to; renamed into place when the block ends without error
    (``private``: see :func:`temporary_path`).

    On an error the temporary file stays behind, as after a kill, for the directory's clean-up."""
    tmp = temporary_path(final, private)
    yield tmp
    replace_durably(tmp, final)


def write_bytes_atomically(path: Path, data: bytes, private: bool = False) -> None:
    """Replace ``path``'s content with ``data`` crash-safely (``private``: see :func:`temporary_path`)."""
    with written_atomically(path, private) as tmp:
        tmp.write_bytes(data)
