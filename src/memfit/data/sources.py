"""Sources: the first pipeline stage, which reads texts from an input file or stdin.

Every later stage (chunking, planning, encoding, writing) works on a stream of :class:`Record` objects,
so this module is where input formats end and where user mistakes in the input are caught. Two rules
shape it:

- **It streams.** Corpora can be far larger than memory, so files are read line by line (Parquet: in
  small batches of only the needed columns) and everything is a generator; memory does not grow with
  the file size.
- **Input mistakes are :class:`~memfit.errors.InputError`, never tracebacks.** A user who feeds a
  malformed file must get one line naming the file, the line (Parquet: the row) and the field, so
  decoding, JSON, CSV, Parquet and OS errors are all converted here.

Text formats are read as bytes and decoded one line at a time, so an undecodable byte is reported at
its own line instead of failing the whole file, and line numbers stay exact. (pyarrow's JSON and CSV
readers parse whole blocks and report errors by block, not by line, so memfit's own line reader stays;
the bytes come through ``shards.py``, which opens local files, URLs and compressed files alike.)

An input may be many files (a directory or glob of shards, a Hugging Face dataset's Arrow files, see
``shards.py``): they are read in name order, each in its own format, with row numbers counting on
across files, while errors name the shard and its own line.

Argument mistakes (unknown format, fields that a format cannot have) are raised when the function is
called; file errors are raised on first iteration, since nothing is opened before then.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from memfit.data.shards import STDIN, compression, expand, is_url, one_line, open_file, open_stream, without_compression
from memfit.defaults import INPUT_FORMATS
from memfit.data.tokenization import lone_surrogate
from memfit.errors import ConfigError, InputError

FORMATS = INPUT_FORMATS

_EXTENSIONS = {
    ".txt": "txt",
    ".text": "txt",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".csv": "csv",
    ".tsv": "tsv",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".arrow": "arrow",
}

# Name used for stdin in error messages: "-:3: ..." would be cryptic.
_STDIN_NAME = "<stdin>"

# Rows per Parquet batch: small enough that a batch of long documents stays a few MB, large enough that
# the per-batch overhead of pyarrow is negligible.
_PARQUET_BATCH_ROWS = 1024

# csv refuses fields over 128 KiB by default, but one document can be much longer. The limit is a C long,
# which is 32 bits on Windows, hence the min().
_CSV_FIELD_LIMIT = min(sys.maxsize, 2**31 - 1)


@dataclass(frozen=True, slots=True)
class Record:
    """One input text with the position it came from, so outputs can be aligned with inputs.

    ``row`` is the 0-based index of the data row (header excluded, skipped blank JSONL lines not
    counted): it is the key outputs and ``--resume`` use. ``line`` is the 1-based physical line where the
    record starts (Parquet: the 1-based row) and only serves error messages. ``id`` is the value of the
    id field as a string when one was asked for, else the row index.
    """

    row: int
    id: int | str
    text: str
    line: int
    text_pair: str | None = None
    label: str | None = None


def detect_format(path: str, input_format: str | None = None) -> str:
    """Return the input format: ``input_format`` when given, else guessed from the file extension.

    Stdin ("-") has no extension and defaults to ``txt``, the one format that needs no declaration. A
    compression ending is looked through: ``texts.jsonl.gz`` is ``jsonl``.
    """
    if input_format is not None:
        if input_format not in FORMATS:
            raise ConfigError(f"unknown input format {input_format!r}; supported: {', '.join(FORMATS)}")
        return input_format
    if path == STDIN:
        return "txt"
    extension = os.path.splitext(without_compression(path))[1].lower()
    if extension in _EXTENSIONS:
        return _EXTENSIONS[extension]
    supported = ", ".join(_EXTENSIONS)
    shown = repr(extension) if extension else "no extension"
    raise InputError(
        path,
        f"cannot tell the input format from {shown}; supported extensions are {supported}; "
        f"otherwise pass --input-format ({', '.join(FORMATS)})",
    )


def iter_rows(
    path: str, input_format: str | None = None, columns: Sequence[str] | None = None
) -> Iterator[tuple[int, dict[str, object]]]:
    """Yield ``(line, row)`` pairs: the 1-based line where a row starts (Parquet: the row) and its fields.

    This is the format layer without the text/id/pair/label interpretation, for jobs that read fields
    of their own (for example relation spans for training). For ``txt`` each line is the row
    ``{"text": line}``. Values are as the format gives them: JSON values for jsonl, strings for csv/tsv,
    Python values for Parquet.

    ``columns`` names the fields the caller needs. A missing one is an error at the header (csv/tsv),
    on opening (Parquet) or at the row (jsonl, or a csv/tsv row with too few cells), so callers can
    index rows without checks; Parquet then reads only those columns. ``None`` reads everything.
    """
    fmt = detect_format(path, input_format)
    needed = list(dict.fromkeys(columns)) if columns is not None else None
    others = [name for name in needed or () if name != "text"]
    if fmt == "txt" and others:
        message = "plain-text input has one text per line and no fields; use jsonl, csv, tsv or parquet"
        raise InputError(display_name(path), message, field=others[0])
    if fmt in ("parquet", "arrow") and path == STDIN:
        raise InputError(
            _STDIN_NAME, "Parquet and Arrow cannot be read from stdin (they need seeking); pass a file path"
        )
    if fmt == "txt":
        return _txt_rows(path)
    if fmt == "jsonl":
        return _jsonl_rows(path, needed)
    if fmt == "parquet":
        return _parquet_rows(path, needed)
    if fmt == "arrow":
        return _arrow_rows(path, needed)
    return _delimited_rows(path, "\t" if fmt == "tsv" else ",", needed)


def read_records(
    path: str,
    text_field: str = "text",
    id_field: str | None = None,
    pair_field: str | None = None,
    label_field: str | None = None,
    input_format: str | None = None,
    skip: int = 0,
) -> Iterator[Record]:
    """Yield the :class:`Record` of every input row, in input order.

    ``path`` is a file, stdin (``-``), a URL, or many files (a directory, a glob, a Hugging Face
    dataset directory: ``shards.expand``), read one after the other with rows numbered on across them;
    ``input_format`` applies to each, else each shard's format comes from its own name. The shards
    are listed when this is called, so a pattern that matches nothing fails here.

    ``skip`` leaves out the first ``skip`` records, which is how ``--resume`` continues after the rows
    already written. They are still parsed, so a resumed run rejects the same inputs as a fresh one and
    row numbers stay those of the input.

    ``text_field`` is ignored for ``txt`` (a line is the text); ``id_field``, ``pair_field`` and
    ``label_field`` are an error with ``txt``, which has no fields.
    """
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")
    shards = [(shard, detect_format(shard, input_format)) for shard in expand(path)]
    return _shard_records(shards, text_field, id_field, pair_field, label_field, skip)


def _shard_records(
    shards: list[tuple[str, str]],
    text_field: str,
    id_field: str | None,
    pair_field: str | None,
    label_field: str | None,
    skip: int,
) -> Iterator[Record]:
    """The records of every shard in turn; a shard's first row follows the last row of the one before."""
    readers = []
    for shard, fmt in shards:  # iter_rows refuses wrong arguments here, before anything is read
        field = "text" if fmt == "txt" else text_field  # a line is the text
        fields = [field, id_field, pair_field, label_field]
        readers.append((shard, field, iter_rows(shard, fmt, [name for name in fields if name is not None])))
    return _records_of(readers, id_field, pair_field, label_field, skip)


def _records_of(
    readers: list[tuple[str, str, Iterator[tuple[int, dict[str, object]]]]],
    id_field: str | None,
    pair_field: str | None,
    label_field: str | None,
    skip: int,
) -> Iterator[Record]:
    first_row = 0
    for shard, text_field, shard_rows in readers:
        rows = _Counted(shard_rows)
        yield from validated_records(
            display_name(shard), rows, text_field, id_field, pair_field, label_field, skip, first_row=first_row
        )
        first_row += rows.count


class _Counted:
    """An iterator that counts what it hands on (a shard's rows, for the next shard's first row)."""

    def __init__(self, items: Iterator[tuple[int, dict[str, object]]]):
        self.items, self.count = items, 0

    def __iter__(self) -> "_Counted":
        return self

    def __next__(self) -> tuple[int, dict[str, object]]:
        item = next(self.items)
        self.count += 1
        return item


def validated_records(
    name: str,
    rows: Iterable[tuple[int, dict[str, object]]],
    text_field: str,
    id_field: str | None,
    pair_field: str | None,
    label_field: str | None,
    skip: int,
    first_row: int = 0,
) -> Iterator[Record]:
    """Turn rows into validated records, numbered from ``first_row``; the generator behind :func:`read_records`."""
    for row, (line, values) in enumerate(rows, start=first_row):
        text = _string(name, values[text_field], line, text_field)
        record_id = row if id_field is None else _scalar(name, values[id_field], line, id_field, booleans=False)
        pair = None if pair_field is None else _string(name, values[pair_field], line, pair_field)
        label = None if label_field is None else _scalar(name, values[label_field], line, label_field)
        if row >= skip:
            yield Record(row=row, id=record_id, text=text, line=line, text_pair=pair, label=label)


def _string(name: str, value: object, line: int, field: str) -> str:
    """Return a text value; anything but a string is an error (str(None) would embed "None")."""
    if isinstance(value, str):
        return _unicode(name, value, line, field)
    raise InputError(name, f"expected a string, got {_type_name(value)}", line, field)


def _scalar(name: str, value: object, line: int, field: str, booleans: bool = True) -> str:
    """Return an id or label as a string: numbers are common ids and labels, null and containers are mistakes, and so
    is a boolean id (``booleans=False``: JSON's ``true`` would become the id "True"; training refuses boolean labels
    with its own reason, ``preflight.check_training_labels``)."""
    if isinstance(value, str):
        return _unicode(name, value, line, field)
    if isinstance(value, (int, float)) and (booleans or not isinstance(value, bool)):
        return str(value)
    raise InputError(name, f"expected a string or number, got {_type_name(value)}", line, field)


def _unicode(name: str, value: str, line: int, field: str) -> str:
    """``value`` unless it holds a lone surrogate (JSON's ``"\\ud800"`` decodes to one), which no tokenizer or
    Parquet file takes."""
    if (where := lone_surrogate(value)) is not None:
        message = f"a lone surrogate at character {where} (an unpaired \\ud800-\\udfff escape)"
        raise InputError(name, message, line, field)
    return value


def _type_name(value: object) -> str:
    """Name a value's type the way JSON does, since that is how most users will think of it."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def display_name(path: str) -> str:
    """The name errors use for ``path`` (``<stdin>`` for ``-``)."""
    return _STDIN_NAME if path == STDIN else path


_one_line = one_line


@contextlib.contextmanager
def _open_binary(path: str) -> Iterator[BinaryIO]:
    """Open ``path`` (or stdin for "-") for binary reading, decompressing as its name says; errors are
    InputErrors (``shards.open_stream``)."""
    if path == STDIN:
        # Not closed: stdin belongs to the process.
        yield sys.stdin.buffer
        return
    with open_stream(path) as handle:
        yield handle


def _lines(path: str) -> Iterator[tuple[int, str]]:
    """Yield ``(line number, decoded line)`` with the terminator kept, decoding one line at a time.

    Keeping the terminator lets csv see the real line structure (quoted fields may span lines); a UTF-8
    BOM on the first line is dropped since editors on Windows add it.
    """
    name = display_name(path)
    with _open_binary(path) as handle:
        number = 0
        try:
            for number, raw in enumerate(handle, start=1):
                if number == 1 and raw.startswith(codecs.BOM_UTF8):
                    raw = raw[len(codecs.BOM_UTF8) :]
                yield number, _decode(name, raw, number)
        except (OSError, _arrow_error()) as error:  # a damaged compressed stream fails in pyarrow's codec
            reason = getattr(error, "strerror", None) or _one_line(error)
            # no line of its own: a compressed stream is decompressed ahead of the lines read (a cut .gz failed "at
            # line 1" with 1,977 good lines before the cut), so only the lines already read are known to be good
            where = f" past line {number}" if number else ""
            raise InputError(name, f"cannot read{where}: {reason}") from error


def _arrow_error() -> type[Exception]:
    """pyarrow's error base class, imported only once a compressed or remote input is being read."""
    pyarrow = sys.modules.get("pyarrow")
    return pyarrow.ArrowException if pyarrow is not None else OSError


def _decode(name: str, raw: bytes, line: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        # Bytes before error.start decode fine, so the column counts characters, as editors show it.
        column = len(raw[: error.start].decode("utf-8")) + 1
        message = f"not valid UTF-8 (byte 0x{raw[error.start]:02x} at column {column})"
        raise InputError(name, message, line) from error


def _strip_terminator(line: str) -> str:
    """Remove only "\\n" or "\\r\\n": other whitespace can be meaningful to a tokenizer."""
    if line.endswith("\r\n"):
        return line[:-2]
    if line.endswith("\n"):
        return line[:-1]
    return line


def _txt_rows(path: str) -> Iterator[tuple[int, dict[str, object]]]:
    """Every line is a row, blank ones included, so row i is always line i + 1 of the input."""
    for number, line in _lines(path):
        yield number, {"text": _strip_terminator(line)}


def _jsonl_rows(path: str, needed: list[str] | None) -> Iterator[tuple[int, dict[str, object]]]:
    """One JSON object per line; whitespace-only lines (often a trailing one) are not rows."""
    name = display_name(path)
    for number, line in _lines(path):
        if not line.strip():
            continue
        try:
            value = json.loads(_strip_terminator(line))  # with it, an error at the line's end counted a second line
        except json.JSONDecodeError as error:
            # some messages end in "at" already ("Invalid control character at")
            message = error.msg.removesuffix(" at")
            raise InputError(name, f"malformed JSON: {message} at column {error.colno}", number) from error
        except (ValueError, RecursionError) as error:  # an integer of over 4,300 digits; nesting deeper than Python's
            raise InputError(name, f"JSON that Python cannot read: {error}", number) from None
        if not isinstance(value, dict):
            raise InputError(name, f"expected a JSON object, got {_type_name(value)}", number)
        for field in needed or ():
            if field not in value:
                raise InputError(name, "missing from this JSON object", number, field)
        yield number, value


def _delimited_rows(path: str, delimiter: str, needed: list[str] | None) -> Iterator[tuple[int, dict[str, object]]]:
    """CSV/TSV with a required header row; values are the cell strings keyed by column name.

    ``strict`` makes csv reject a stray quote instead of silently merging the rest of the file into one
    field. Blank lines are not rows, as with csv.DictReader. A row with more cells than the header is an
    error: it usually means an unquoted delimiter inside a text, which would shift every later column.
    """
    name = display_name(path)
    kind, separator = ("CSV", "comma") if delimiter == "," else ("TSV", "tab")
    csv.field_size_limit(_CSV_FIELD_LIMIT)
    reader = csv.reader((line for _, line in _lines(path)), delimiter=delimiter, strict=True)
    header: list[str] | None = None
    position: dict[str, int] = {}
    while True:
        # A record can span lines (quoted newlines); report the line it starts on.
        start = reader.line_num + 1
        try:
            cells = next(reader)
        except StopIteration:
            break
        except csv.Error as error:
            message = _one_line(str(error).replace("\t", "\\t"))
            raise InputError(name, f"malformed {kind}: {message}", start) from error
        if not cells:
            continue
        if header is None:
            header = cells
            position = {column: index for index, column in enumerate(header)}
            missing = [field for field in needed or () if field not in position]
            if missing:
                available = ", ".join(repr(column) for column in header)
                raise InputError(name, f"no such column; the header has {available}", start, missing[0])
            continue
        if len(cells) > len(header):
            raise InputError(
                name,
                f"row has {len(cells)} cells but the header has {len(header)} (an unquoted {separator} in a value?)",
                start,
            )
        short = [field for field in needed or () if position[field] >= len(cells)]
        if short:
            message = f"missing: row has {len(cells)} cells but the header has {len(header)}"
            raise InputError(name, message, start, short[0])
        # Short rows are fine when no needed column is cut off; their absent cells are absent keys.
        yield start, dict(zip(header, cells, strict=False))
    if header is None and needed:
        raise InputError(name, "empty input: a header row naming the columns is required")


def _parquet_rows(path: str, needed: list[str] | None) -> Iterator[tuple[int, dict[str, object]]]:
    """Parquet rows read in small batches of only the needed columns, so memory stays bounded.

    The row number (1-based) takes the place of the line number.
    """
    # Imported here: pyarrow is heavy and only Parquet input needs it.
    import pyarrow as pa
    import pyarrow.parquet as pq

    with _random_access(path) as handle:
        try:
            parquet = pq.ParquetFile(handle)
        except (pa.ArrowException, OSError) as error:
            raise InputError(path, f"not a readable Parquet file: {_one_line(error)}") from error
        _check_columns(path, parquet.schema_arrow.names, needed)
        batches = parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=needed)
        yield from _batch_rows(path, "Parquet", batches, None)


def _arrow_rows(path: str, needed: list[str] | None) -> Iterator[tuple[int, dict[str, object]]]:
    """An Arrow IPC stream (what Hugging Face ``datasets`` writes with ``save_to_disk``) or IPC file, one
    record batch at a time; the 1-based row takes the place of the line number, as for Parquet."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    with _random_access(path) as handle:
        try:
            reader = ipc.open_stream(handle)
        except (pa.ArrowException, OSError):
            try:
                handle.seek(0)
                reader = ipc.open_file(handle)
            except (pa.ArrowException, OSError) as error:
                raise InputError(path, f"not a readable Arrow file: {_one_line(error)}") from error
        _check_columns(path, reader.schema.names, needed)
        batches = (
            iter(reader)
            if isinstance(reader, ipc.RecordBatchStreamReader)
            else (reader.get_batch(i) for i in range(reader.num_record_batches))
        )
        yield from _batch_rows(path, "Arrow", batches, needed)


def _check_columns(path: str, available: list[str], needed: list[str] | None) -> None:
    """A Parquet or Arrow file's schema must hold every needed column; the error lists what it has."""
    missing = [field for field in needed or () if field not in available]
    if missing:
        listed = ", ".join(repr(column) for column in available)
        raise InputError(path, f"no such column; the file has {listed}", field=missing[0])


def _batch_rows(
    path: str, kind: str, batches: Iterator[Any], names: list[str] | None
) -> Iterator[tuple[int, dict[str, object]]]:
    """Rows of Parquet or Arrow record batches, numbered from 1; ``names`` picks the columns (all when
    ``None`` or empty). A batch that fails to decode is an ``InputError`` naming the last good row."""
    import pyarrow as pa

    row = 0
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            break
        except (pa.ArrowException, OSError) as error:
            raise InputError(path, f"cannot read {kind} data after row {row}: {_one_line(error)}") from error
        columns = {column: batch.column(column).to_pylist() for column in names or batch.schema.names}
        for index in range(batch.num_rows):
            row += 1
            yield row, {column: values[index] for column, values in columns.items()}


@contextlib.contextmanager
def _random_access(path: str) -> Iterator[BinaryIO]:
    """A Parquet or Arrow file opened for ranged reads (locally or by URL), closed afterwards."""
    if compression(path):
        raise InputError(
            path,
            "Parquet and Arrow files are read by row group and cannot be read through "
            "compression; their columns are compressed inside the file already",
        )
    handle = open_file(path)
    with handle:
        yield handle


def estimate_rows(path: str, input_format: str | None = None) -> int | None:
    """About how many records ``path`` holds, for a progress bar's ETA; ``None`` when unknown.

    Exact for Parquet (file metadata) and txt; for jsonl/csv/tsv it counts lines, an upper bound when
    there are blank lines or multi-line fields. Counting newlines runs at disk speed, far faster than
    embedding what is counted. Unknown for stdin, Arrow, and text that is compressed or behind a URL
    (counting would read it all once more); a sharded input sums its shards.
    """
    if path == STDIN:
        return None
    try:
        total = 0
        for shard in expand(path):
            count = _shard_rows(shard, detect_format(shard, input_format))
            if count is None:
                return None
            total += count
    except Exception:  # noqa: BLE001 - only an estimate; reading proper reports real errors
        return None
    return total


def _shard_rows(path: str, fmt: str) -> int | None:
    if fmt == "parquet":
        import pyarrow.parquet as pq

        with open_file(path) as handle:
            return pq.ParquetFile(handle).metadata.num_rows
    if fmt == "arrow" or compression(path) or is_url(path):
        return None
    lines = 0
    last = b"\n"
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    lines += last != b"\n"  # a last line without a terminator
    return lines - (1 if fmt in ("csv", "tsv") else 0)
