"""Crash-safe file writes: write under a temporary name, flush it to disk, rename it into place.

A reader (or a ``--resume``) then sees either the old file or the complete new one, never a part
of it, even after ``kill -9`` or a power cut: ``os.replace`` is atomic within a directory, and the
``fsync`` before it makes sure the renamed file holds its data. The temporary name is the final
name plus :data:`TMP_SUFFIX`, which the output directory's clean-up (``sinks.py``, ``ray/commit.py``)
recognises as an unfinished write and removes.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

TMP_SUFFIX = ".tmp"


def temporary_path(final: Path) -> Path:
    """Where ``final`` is written before it is renamed into place."""
    return final.with_name(final.name + TMP_SUFFIX)


def replace_durably(tmp: Path, final: Path) -> None:
    """Flush the finished ``tmp`` to disk, then rename it to ``final`` in one step."""
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)


@contextmanager
def written_atomically(final: Path) -> Iterator[Path]:
    """The path to write ``final``'s content to; renamed into place when the block ends without error.

    On an error the temporary file stays behind, as after a kill, for the directory's clean-up."""
    tmp = temporary_path(final)
    yield tmp
    replace_durably(tmp, final)


def write_bytes_atomically(path: Path, data: bytes) -> None:
    """Replace ``path``'s content with ``data`` crash-safely."""
    with written_atomically(path) as tmp:
        tmp.write_bytes(data)
