"""Where an input lives: one file, a directory or glob of shards, or a Hugging Face dataset saved with
``save_to_disk``, on the local disk or behind a URL (``s3://bucket/prefix/…``), compressed or not.

``sources.py`` parses records; this module only finds and opens the bytes, through pyarrow's own
filesystems (``pyarrow.fs.FileSystem.from_uri``: ``s3://``, ``gs://``, ``hdfs://``, ``file://``) and its
decompressing streams (``.gz``, ``.bz2``, ``.zst``, detected from the name), so every format reads the
same way from every place. Nothing is downloaded first: text formats stream, Parquet and Arrow read the
columns and row groups they need with ranged reads.

Object stores take their credentials and endpoint from the AWS SDK's standard environment variables
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ``AWS_REGION``), which
pyarrow's S3 filesystem reads itself, so one command works against AWS, MinIO or any S3-compatible store.

Shards are taken in name order (byte order of their names, as ``sorted`` gives it), so the rows of
``part-00000`` come before those of ``part-00001`` and row numbers count on across files.
"""

from __future__ import annotations

import fnmatch
import io
import json
import os
import posixpath
import re
from dataclasses import dataclass
from typing import BinaryIO

from memfit.errors import InputError

STDIN = "-"

COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd"}
"""Name endings of compressed text inputs and pyarrow's codec for each (decompressed as they stream)."""

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_WILDCARDS = re.compile(r"[*?\[]")
# What a Hugging Face dataset directory holds (datasets' save_to_disk): the list of its Arrow files, and
# for a DatasetDict the names of its splits, each a dataset directory of its own.
HF_STATE = "state.json"
HF_DATASET_DICT = "dataset_dict.json"


def is_url(path: str) -> bool:
    """Whether ``path`` names a place by URL (``s3://…``) rather than a local path."""
    return bool(_URL.match(path))


def one_line(message: object) -> str:
    """A third-party error message squeezed onto one line, since memfit's messages are one line."""
    return " ".join(str(message).split())


def filesystem(path: str):
    """``(pyarrow filesystem, path within it)`` for a local path or a URL.

    A URL's filesystem is built by pyarrow (``FileSystem.from_uri``); a malformed or unsupported URL
    raises ``ValueError`` or ``pyarrow.ArrowException``, which callers turn into their own typed error.
    """
    import pyarrow.fs as pafs

    if is_url(path):
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), os.path.abspath(path)


def compression(path: str) -> str | None:
    """pyarrow's codec name for a compressed input (from its name's ending), else ``None``."""
    return COMPRESSIONS.get(os.path.splitext(path)[1].lower())


def without_compression(path: str) -> str:
    """``path`` without a compression ending, so ``texts.jsonl.gz`` shows its format (``.jsonl``)."""
    return path[: -len(os.path.splitext(path)[1])] if compression(path) else path


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """A shard's name within its input (for fingerprints and messages), its size and modification time."""

    name: str
    size: int
    mtime_ns: int | None


def expand(source: str) -> list[str]:
    """The files ``source`` stands for, in reading order.

    - a file (or stdin, ``-``): itself;
    - a glob (``corpus/*.parquet``, ``s3://b/shards/part-*.jsonl.gz``; wildcards in the last name only):
      the matching files in name order (not directories; hidden files only for a pattern that starts with a
      dot); a local file or directory whose name has glob characters is that file or directory;
    - a Hugging Face dataset directory (``state.json``): its Arrow files in the dataset's order;
    - any other directory: its files in name order, leaving out hidden (``.``) and marker (``_SUCCESS``)
      files.

    Raises :class:`InputError` when ``source`` matches no file, cannot be listed, or is a pipe or a device
    (``/dev/stdin``, ``<(...)``, a FIFO), which the checks before a run would read up.
    """
    if source == STDIN:
        return [source]
    local = not is_url(source)
    local_dir = local and os.path.isdir(source)  # itself, even named data[1]
    if local:
        local_file = os.path.isfile(source)
        if not (local_file or local_dir) and os.path.exists(source):
            raise InputError(
                source,
                "is a pipe or a device, not a file: memfit reads its input more than once (to check it, and to "
                "resume it), which a pipe cannot give; pipe it into stdin and pass - as the input instead",
            )
        if local_file or not (local_dir or _WILDCARDS.search(os.path.basename(source))):
            # a plain local file, even one whose name has glob characters (``corpus[2024].jsonl``: read as a pattern
            # it matched other files); opening a missing one reports it, as for any input
            return [source]
    fs, base = _filesystem_or_error(source)
    import pyarrow.fs as pafs

    parent, last = posixpath.split(base.rstrip("/")) if not local else os.path.split(base)
    try:
        if _WILDCARDS.search(last) and not local_dir:
            # files only, and hidden ones only for a pattern that starts with a dot, as the shell matches
            names = [
                info.base_name
                for info in _listing(fs, parent)
                if info.type == pafs.FileType.File
                and fnmatch.fnmatchcase(info.base_name, last)
                and (last.startswith(".") or not info.base_name.startswith("."))
            ]
            if not names:
                raise InputError(source, "no file matches this pattern")
            return [_join(source, name, glob=True) for name in sorted(names)]
        info = fs.get_file_info(base)
        if info.type == pafs.FileType.NotFound:
            raise InputError(source, "no such file or directory")
        if info.type != pafs.FileType.Directory:
            return [source]
        return _directory_files(source, fs, base)
    except OSError as error:
        raise InputError(source, f"cannot list: {one_line(error)}") from error


def _directory_files(source: str, fs, base: str) -> list[str]:
    """The shards of a directory: a datasets directory's Arrow files, or every visible file by name."""
    entries = {info.base_name: info for info in _listing(fs, base)}
    if HF_DATASET_DICT in entries:
        with fs.open_input_stream(_fs_join(base, HF_DATASET_DICT)) as handle:
            splits = json.loads(handle.read()).get("splits", [])
        raise InputError(
            source,
            "a Hugging Face DatasetDict holds several splits; name one of them as the input "
            f"({', '.join(_join(source, split) for split in splits)})",
        )
    if HF_STATE in entries:
        with fs.open_input_stream(_fs_join(base, HF_STATE)) as handle:
            try:
                files = [item["filename"] for item in json.loads(handle.read())["_data_files"]]
            except (ValueError, KeyError, TypeError) as error:
                raise InputError(
                    _join(source, HF_STATE), "not a Hugging Face datasets state.json (no list of _data_files)"
                ) from error
        return [_join(source, name) for name in files]
    import pyarrow.fs as pafs

    names = sorted(
        name for name, info in entries.items() if info.type == pafs.FileType.File and not name.startswith((".", "_"))
    )
    if not names:
        raise InputError(source, "the directory holds no input files")
    return [_join(source, name) for name in names]


def _listing(fs, directory: str):
    import pyarrow.fs as pafs

    return fs.get_file_info(pafs.FileSelector(directory, allow_not_found=False))


def _fs_join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}"


def _join(source: str, name: str, glob: bool = False) -> str:
    """A shard's path as the user would write it: beside the pattern's last name, or inside the directory."""
    if glob:
        source = source[: -len(source.rstrip("/").rsplit("/", 1)[-1])] if is_url(source) else os.path.dirname(source)
    if is_url(source) or not source:
        return f"{source.rstrip('/')}/{name}" if source else name
    return os.path.join(source, name)


def _filesystem_or_error(path: str):
    import pyarrow as pa

    try:
        return filesystem(path)
    except (ValueError, pa.ArrowException, OSError) as error:
        raise InputError(path, f"cannot open: {one_line(error)}") from error


def open_stream(path: str) -> BinaryIO:
    """``path`` opened for streaming reads, decompressed on the fly when its name says it is compressed.

    A local file is opened by Python, so a missing or unreadable one is reported as the shell would;
    a URL through pyarrow's filesystem (pyarrow is imported only then, or for a compressed file: a plain
    local file is read as before, with nothing more imported). Raises :class:`InputError` when it
    cannot be opened."""
    codec = compression(path)
    if not is_url(path):
        try:
            handle = open(path, "rb")  # noqa: SIM115 - the caller closes what this returns
        except OSError as error:
            raise InputError(path, f"cannot read: {_reason(error)}") from error
        if codec is None:
            return handle
        import pyarrow as pa

        return io.BufferedReader(pa.CompressedInputStream(handle, codec), buffer_size=1 << 20)  # type: ignore[arg-type]
    import pyarrow as pa

    fs, inner = _filesystem_or_error(path)
    try:
        stream = fs.open_input_stream(inner, compression=codec)
    except (OSError, pa.ArrowException) as error:
        raise InputError(path, f"cannot read: {_reason(error)}") from error
    return io.BufferedReader(stream, buffer_size=1 << 20)  # type: ignore[arg-type]


def open_file(path: str) -> BinaryIO:
    """``path``'s bytes as stored (not decompressed) for random access (Parquet and Arrow footers, row
    groups, fingerprints): a local file by Python, a URL as a ``pyarrow.NativeFile`` (ranged reads)."""
    if not is_url(path):
        try:
            return open(path, "rb")  # noqa: SIM115 - the caller closes what this returns
        except OSError as error:
            raise InputError(path, f"cannot read: {_reason(error)}") from error
    import pyarrow as pa

    fs, inner = _filesystem_or_error(path)
    try:
        return fs.open_input_file(inner)
    except (OSError, pa.ArrowException) as error:
        raise InputError(path, f"cannot read: {_reason(error)}") from error


def shard_info(path: str, name: str) -> ShardInfo:
    """Size and modification time of one shard (an object store's LastModified stands for mtime)."""
    import pyarrow as pa
    import pyarrow.fs as pafs

    fs, inner = _filesystem_or_error(path)
    try:
        info = fs.get_file_info(inner)
    except (OSError, pa.ArrowException) as error:
        raise InputError(path, f"cannot read: {_reason(error)}") from error
    if info.type != pafs.FileType.File:
        raise InputError(path, "no such file")
    return ShardInfo(name=name, size=int(info.size), mtime_ns=info.mtime_ns)


def _reason(error: BaseException) -> str:
    """An OS error's reason as the shell says it (``No such file or directory``), else pyarrow's message."""
    strerror = getattr(error, "strerror", None)
    if strerror:
        return strerror
    message = one_line(error)
    if "No such file" in message or "Path does not exist" in message:
        return "No such file or directory"
    return message
