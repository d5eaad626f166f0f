"""Tests of memfit.data.sources: every format round-trips, positions are exact, input mistakes are one-line
InputErrors naming file, line and field, and reading streams."""

from __future__ import annotations

import collections
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from memfit.errors import ConfigError, InputError
from memfit.data.sources import FORMATS, Record, detect_format, iter_rows, read_records


def write(path: Path, content: str | bytes) -> str:
    path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return str(path)


def write_parquet(path: Path, columns: dict[str, object], **options: object) -> str:
    pq.write_table(pa.table(columns), path, **options)
    return str(path)


def check_error(error: pytest.ExceptionInfo[InputError], path: str, line: int | None, field: str | None) -> str:
    """Assert the message names file, line and field on one line, and return it."""
    message = str(error.value)
    assert "\n" not in message
    where = path if line is None else f"{path}:{line}:"
    assert message.startswith(where), message
    assert error.value.line == line
    assert error.value.field == field
    if field is not None:
        assert f"field {field!r}" in message
    return message


def stdin_with(monkeypatch: pytest.MonkeyPatch, data: bytes) -> io.BytesIO:
    buffer = io.BytesIO(data)
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(buffer=buffer))
    return buffer


# --- detect_format ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("a.txt", "txt"),
        ("a.text", "txt"),
        ("dir.v2/a.jsonl", "jsonl"),
        ("a.NDJSON", "jsonl"),
        ("a.csv", "csv"),
        ("a.tsv", "tsv"),
        ("a.parquet", "parquet"),
        ("a.pq", "parquet"),
        ("-", "txt"),
    ],
)
def test_detect_format_by_extension(name: str, expected: str) -> None:
    assert detect_format(name) == expected


def test_detect_format_explicit_wins() -> None:
    assert detect_format("-", "jsonl") == "jsonl"
    assert detect_format("data.dat", "csv") == "csv"
    assert set(FORMATS) == {"txt", "jsonl", "csv", "tsv", "parquet", "arrow"}


def test_detect_format_unknown_extension() -> None:
    with pytest.raises(InputError) as error:
        detect_format("corpus.json.gz")
    message = check_error(error, "corpus.json.gz", None, None)
    assert "--input-format" in message and ".jsonl" in message and ".parquet" in message


def test_detect_format_rejects_unknown_format_name() -> None:
    with pytest.raises(ConfigError, match="xml"):
        detect_format("a.txt", "xml")


# --- round trips ------------------------------------------------------------------------------------


def test_txt_keeps_blank_lines_and_whitespace(tmp_path: Path) -> None:
    path = write(tmp_path / "in.txt", "\ufefffirst\n\n  spaced\t \r\nlast without newline")
    records = list(read_records(path, text_field="ignored"))
    assert records == [
        Record(row=0, id=0, text="first", line=1),
        Record(row=1, id=1, text="", line=2),
        Record(row=2, id=2, text="  spaced\t ", line=3),
        Record(row=3, id=3, text="last without newline", line=4),
    ]


def test_jsonl_fields_rows_and_blank_lines(tmp_path: Path) -> None:
    lines = [
        json.dumps({"t": "héllo", "id": 7, "p": "pair one", "y": 1, "extra": [1]}),
        "   ",
        json.dumps({"t": "", "id": "doc-b", "p": "pair two", "y": "neg"}),
        "",
        json.dumps({"t": "third", "id": 2.5, "p": "x", "y": True}),
    ]
    path = write(tmp_path / "in.jsonl", "\r\n".join(lines) + "\n\n")
    records = list(read_records(path, text_field="t", id_field="id", pair_field="p", label_field="y"))
    assert records == [
        Record(row=0, id="7", text="héllo", line=1, text_pair="pair one", label="1"),
        Record(row=1, id="doc-b", text="", line=3, text_pair="pair two", label="neg"),
        Record(row=2, id="2.5", text="third", line=5, text_pair="x", label="True"),
    ]


def test_csv_multiline_quoted_field_keeps_line_numbers(tmp_path: Path) -> None:
    content = (
        "\ufeffid,text,label,pair\r\n"
        '1,"line one\r\nline two, with comma",pos,a\r\n'
        "\r\n"
        '2,"say ""hi""",neg,b\r\n'
        "3,,neg,c\r\n"
    )
    path = write(tmp_path / "in.csv", content)
    records = list(read_records(path, id_field="id", pair_field="pair", label_field="label"))
    assert records == [
        Record(row=0, id="1", text="line one\r\nline two, with comma", line=2, text_pair="a", label="pos"),
        Record(row=1, id="2", text='say "hi"', line=5, text_pair="b", label="neg"),
        Record(row=2, id="3", text="", line=6, text_pair="c", label="neg"),
    ]


def test_tsv_round_trip(tmp_path: Path) -> None:
    path = write(tmp_path / "in.tsv", 'sentence\tkey\nhas, commas\tk1\n"tab\tinside"\tk2\n')
    records = list(read_records(path, text_field="sentence", id_field="key"))
    assert [(r.row, r.id, r.text, r.line) for r in records] == [
        (0, "k1", "has, commas", 2),
        (1, "k2", "tab\tinside", 3),
    ]


def test_csv_long_field(tmp_path: Path) -> None:
    long_text = "word " * 100_000  # over csv's default 128 KiB field limit
    path = write(tmp_path / "in.csv", f"text\n{long_text}\n")
    assert next(read_records(path)).text == long_text


def test_parquet_round_trip(tmp_path: Path) -> None:
    path = write_parquet(
        tmp_path / "in.parquet",
        {
            "doc": ["alpha", "", "gamma"],
            "key": [10, 11, 12],
            "second": ["p0", "p1", "p2"],
            "cls": pa.array(["a", "b", "a"]).dictionary_encode(),
            "unused": [[1], [2], [3]],
        },
        row_group_size=2,
    )
    records = list(read_records(path, text_field="doc", id_field="key", pair_field="second", label_field="cls"))
    assert records == [
        Record(row=0, id="10", text="alpha", line=1, text_pair="p0", label="a"),
        Record(row=1, id="11", text="", line=2, text_pair="p1", label="b"),
        Record(row=2, id="12", text="gamma", line=3, text_pair="p2", label="a"),
    ]


def test_input_format_overrides_extension(tmp_path: Path) -> None:
    path = write(tmp_path / "data.dat", '{"text": "x"}\n')
    assert [r.text for r in read_records(path, input_format="jsonl")] == ["x"]


# --- skip -------------------------------------------------------------------------------------------


def _five_rows(tmp_path: Path, fmt: str) -> str:
    texts = [f"text {i}" for i in range(5)]
    if fmt == "txt":
        return write(tmp_path / "in.txt", "\n".join(texts) + "\n")
    if fmt == "jsonl":
        return write(tmp_path / "in.jsonl", "".join(json.dumps({"text": t}) + "\n\n" for t in texts))
    if fmt == "parquet":
        return write_parquet(tmp_path / "in.parquet", {"text": texts})
    if fmt == "arrow":  # an Arrow IPC stream, as Hugging Face datasets' save_to_disk writes
        table = pa.table({"text": texts})
        with pa.ipc.new_stream(tmp_path / "in.arrow", table.schema) as stream:
            stream.write_table(table, max_chunksize=2)
        return str(tmp_path / "in.arrow")
    separator = "," if fmt == "csv" else "\t"
    return write(
        tmp_path / f"in.{fmt}", f"n{separator}text\n" + "".join(f"{i}{separator}{t}\n" for i, t in enumerate(texts))
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_skip_leaves_out_leading_records_but_keeps_rows(tmp_path: Path, fmt: str) -> None:
    path = _five_rows(tmp_path, fmt)
    full = list(read_records(path))
    assert [r.text for r in full] == [f"text {i}" for i in range(5)]
    resumed = list(read_records(path, skip=3))
    assert resumed == full[3:]
    assert [r.row for r in resumed] == [3, 4]
    assert list(read_records(path, skip=10)) == []


def test_skipped_records_are_still_validated(tmp_path: Path) -> None:
    path = write(tmp_path / "in.jsonl", '{"text": null}\n{"text": "ok"}\n')
    with pytest.raises(InputError) as error:
        list(read_records(path, skip=1))
    check_error(error, path, 1, "text")


def test_negative_skip_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="skip"):
        read_records(write(tmp_path / "in.txt", "a\n"), skip=-1)


# --- stdin ------------------------------------------------------------------------------------------


def test_stdin_txt(monkeypatch: pytest.MonkeyPatch) -> None:
    stdin_with(monkeypatch, b"one\r\n\ntwo\n")
    assert [(r.row, r.text, r.line) for r in read_records("-")] == [(0, "one", 1), (1, "", 2), (2, "two", 3)]


def test_stdin_jsonl(monkeypatch: pytest.MonkeyPatch) -> None:
    stdin_with(monkeypatch, b'{"text": "a", "id": 1}\n\n{"text": "b", "id": 2}\n')
    records = list(read_records("-", id_field="id", input_format="jsonl"))
    assert [(r.id, r.text, r.line) for r in records] == [("1", "a", 1), ("2", "b", 3)]


def test_stdin_errors_name_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    stdin_with(monkeypatch, b'{"text": "a"}\n{"text": 3}\n')
    with pytest.raises(InputError) as error:
        list(read_records("-", input_format="jsonl"))
    check_error(error, "<stdin>", 2, "text")


def test_stdin_parquet_is_rejected() -> None:
    with pytest.raises(InputError, match="stdin"):
        read_records("-", input_format="parquet")


# --- iter_rows --------------------------------------------------------------------------------------


def test_iter_rows_gives_all_fields(tmp_path: Path) -> None:
    jsonl = write(tmp_path / "in.jsonl", '{"text": "a", "spans": [[0, 1]]}\n\n{"text": "b", "spans": []}\n')
    assert list(iter_rows(jsonl)) == [(1, {"text": "a", "spans": [[0, 1]]}), (3, {"text": "b", "spans": []})]
    csv_path = write(tmp_path / "in.csv", "a,b\n1,2\n")
    assert list(iter_rows(csv_path)) == [(2, {"a": "1", "b": "2"})]
    txt = write(tmp_path / "in.txt", "x\n\n")
    assert list(iter_rows(txt)) == [(1, {"text": "x"}), (2, {"text": ""})]
    parquet = write_parquet(tmp_path / "in.parquet", {"a": [1, 2], "b": ["x", None]})
    assert list(iter_rows(parquet)) == [(1, {"a": 1, "b": "x"}), (2, {"a": 2, "b": None})]
    assert list(iter_rows(parquet, columns=["b"])) == [(1, {"b": "x"}), (2, {"b": None})]


def test_iter_rows_checks_requested_columns(tmp_path: Path) -> None:
    path = write(tmp_path / "in.jsonl", '{"text": "a"}\n')
    with pytest.raises(InputError) as error:
        list(iter_rows(path, columns=["text", "spans"]))
    check_error(error, path, 1, "spans")


# --- errors -----------------------------------------------------------------------------------------


def test_invalid_utf8_names_line_byte_and_column(tmp_path: Path) -> None:
    path = write(tmp_path / "in.txt", b"ok\nalso ok\n\xc3\xa9\xc3\xa9t\xff\n")
    records = read_records(path)
    assert next(records).text == "ok"
    with pytest.raises(InputError) as error:
        list(records)
    message = check_error(error, path, 3, None)
    assert "not valid UTF-8 (byte 0xff at column 4)" in message


@pytest.mark.parametrize(
    ("line", "expect"),
    [
        ('{"text": "a",}', "malformed JSON"),
        ('{"text": "unterminated', "malformed JSON"),
        ('["text"]', "expected a JSON object, got array"),
        ('"just a string"', "expected a JSON object, got string"),
        ('{"text": "a\tb"}', "malformed JSON: Invalid control character at column 12"),  # not "at at column"
        # cut short: the column is the line's end (the terminator made it column 1 of a second line)
        ('{"text": "c"', "malformed JSON: Expecting ',' delimiter at column 13"),
        ('{"text":', "malformed JSON: Expecting value at column 9"),
    ],
)
def test_jsonl_malformed_lines(tmp_path: Path, line: str, expect: str) -> None:
    path = write(tmp_path / "in.jsonl", '{"text": "fine"}\n\n' + line + "\n")
    with pytest.raises(InputError) as error:
        list(read_records(path))
    assert expect in check_error(error, path, 3, None)


@pytest.mark.parametrize(
    ("row", "field", "expect"),
    [
        ({"body": "x"}, "text", "missing"),
        ({"text": None, "id": 1, "pair": "p"}, "text", "expected a string, got null"),
        ({"text": 5, "id": 1, "pair": "p"}, "text", "expected a string, got number"),
        ({"text": ["a"], "id": 1, "pair": "p"}, "text", "expected a string, got array"),
        ({"text": "x", "id": 1, "pair": None}, "pair", "expected a string, got null"),
        ({"text": "x", "pair": "p"}, "id", "missing"),
        ({"text": "x", "id": None, "pair": "p"}, "id", "expected a string or number, got null"),
        ({"text": "x", "id": {"a": 1}, "pair": "p"}, "id", "expected a string or number, got object"),
        ({"text": "x", "id": True, "pair": "p"}, "id", "expected a string or number, got boolean"),  # not "True"
        ({"text": "x", "id": 1, "pair": "p", "label": []}, "label", "got array"),
        # "\ud800" alone is valid JSON and decodes to a str that no tokenizer or Parquet file takes
        ({"text": "a\ud800b", "id": 1, "pair": "p"}, "text", "a lone surrogate at character 1"),
        ({"text": "x", "id": "\udc00", "pair": "p"}, "id", "a lone surrogate at character 0"),
    ],
)
def test_jsonl_field_errors(tmp_path: Path, row: dict[str, object], field: str, expect: str) -> None:
    path = write(tmp_path / "bad.jsonl", '{"text": "a", "id": 0, "pair": "b", "label": 1}\n' + json.dumps(row) + "\n")
    label_field = "label" if "label" in row else None
    with pytest.raises(InputError) as error:
        list(read_records(path, id_field="id", pair_field="pair", label_field=label_field))
    assert expect in check_error(error, path, 2, field)


@pytest.mark.parametrize(
    ("value", "expect"),
    [("1" * 5000, "Exceeds the limit (4300 digits)"), ("[" * 200_000 + "]" * 200_000, "maximum recursion depth")],
)
def test_json_that_python_cannot_read_is_an_input_error(tmp_path: Path, value: str, expect: str) -> None:
    """Valid JSON, but Python's reader raises ValueError or RecursionError, not JSONDecodeError: a traceback before."""
    path = write(tmp_path / "big.jsonl", '{"text": "a"}\n{"text": "b", "n": ' + value + "}\n")
    with pytest.raises(InputError) as error:
        list(read_records(path))
    assert expect in check_error(error, path, 2, None)


def test_txt_rejects_fields(tmp_path: Path) -> None:
    path = write(tmp_path / "in.txt", "a\n")
    with pytest.raises(InputError) as error:
        read_records(path, id_field="doc_id")
    assert "no fields" in check_error(error, path, None, "doc_id")


@pytest.mark.parametrize("fmt", ["csv", "tsv"])
def test_delimited_missing_column_lists_available(tmp_path: Path, fmt: str) -> None:
    separator = "," if fmt == "csv" else "\t"
    path = write(tmp_path / f"in.{fmt}", f"id{separator}body\n1{separator}x\n")
    with pytest.raises(InputError) as error:
        list(read_records(path))
    message = check_error(error, path, 1, "text")
    assert "'id', 'body'" in message


@pytest.mark.parametrize("fmt", ["csv", "tsv"])
def test_delimited_short_row(tmp_path: Path, fmt: str) -> None:
    separator = "," if fmt == "csv" else "\t"
    path = write(tmp_path / f"in.{fmt}", f"id{separator}text\n1{separator}a\n\n2\n")
    with pytest.raises(InputError) as error:
        list(read_records(path))
    assert "1 cells but the header has 2" in check_error(error, path, 4, "text")


def test_csv_too_many_cells(tmp_path: Path) -> None:
    path = write(tmp_path / "in.csv", "id,text\n1,hello, world\n")
    with pytest.raises(InputError) as error:
        list(read_records(path))
    assert "3 cells but the header has 2" in check_error(error, path, 2, None)


def test_csv_unterminated_quote_reports_where_the_record_starts(tmp_path: Path) -> None:
    path = write(tmp_path / "in.csv", 'text\nfine\n"never closed\nmore\nlines\n')
    with pytest.raises(InputError) as error:
        list(read_records(path))
    assert "malformed CSV" in check_error(error, path, 3, None)


def test_tsv_stray_quote(tmp_path: Path) -> None:
    path = write(tmp_path / "in.tsv", 'text\tid\n"Hi," she said\t1\n')
    with pytest.raises(InputError) as error:
        list(read_records(path))
    assert "malformed TSV" in check_error(error, path, 2, None)


def test_csv_empty_file(tmp_path: Path) -> None:
    path = write(tmp_path / "in.csv", "")
    with pytest.raises(InputError) as error:
        list(read_records(path))
    assert "header" in check_error(error, path, None, None)


def test_parquet_missing_column(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", {"body": ["x"], "id": [1]})
    with pytest.raises(InputError) as error:
        list(read_records(path))
    assert "'body', 'id'" in check_error(error, path, None, "text")


def test_parquet_null_text_names_row(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", {"text": ["a", "b", None, "d"]}, row_group_size=2)
    with pytest.raises(InputError) as error:
        list(read_records(path))
    assert "got null" in check_error(error, path, 3, "text")


def test_parquet_non_string_text(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", {"text": [1, 2]})
    with pytest.raises(InputError) as error:
        list(read_records(path))
    assert "expected a string" in check_error(error, path, 1, "text")


def test_not_a_parquet_file(tmp_path: Path) -> None:
    path = write(tmp_path / "fake.parquet", "text\nhello\n")
    with pytest.raises(InputError) as error:
        list(read_records(path))
    assert "Parquet" in check_error(error, path, None, None)


@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_file(tmp_path: Path, fmt: str) -> None:
    path = str(tmp_path / f"absent.{fmt}")
    with pytest.raises(InputError) as error:
        list(read_records(path))
    assert "cannot read: No such file or directory" in check_error(error, path, None, None)


def test_an_empty_directory_is_refused(tmp_path: Path) -> None:
    """A directory is a sharded input (tests/data/test_shards.py); one with no files in it is an error."""
    directory = tmp_path / "dir.txt"
    directory.mkdir()
    with pytest.raises(InputError) as error:
        list(read_records(str(directory)))
    assert "the directory holds no input files" in check_error(error, str(directory), None, None)


# Run in a child process: as root (how CI runs) it first drops to ``nobody``, since root reads any file
# whatever its mode. Everything is imported before the switch (the interpreter's own files may be private
# to root). Prints, per path, the records read or the InputError's message, line and field, as JSON.
_READ_AS_NOBODY = """
import json, os, sys
from memfit.data.sources import read_records
from memfit.errors import InputError
if os.geteuid() == 0:
    os.setgid(65534)
    os.setuid(65534)
results = []
for path in sys.argv[1:]:
    try:
        results.append({"texts": [r.text for r in read_records(path)]})
    except InputError as error:
        results.append({"message": str(error), "line": error.line, "field": error.field})
print(json.dumps(results))
"""


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX file modes")
def test_permission_denied() -> None:
    # a directory anyone may enter (tmp_path's parents are private to the user), so that only the mode of
    # the file itself refuses the read; the readable file beside it is the control
    directory = Path(tempfile.mkdtemp())
    try:
        directory.chmod(0o755)
        readable = write(directory / "open.jsonl", '{"text": "a"}\n')
        path = write(directory / "secret.jsonl", '{"text": "a"}\n')
        os.chmod(readable, 0o644)
        os.chmod(path, 0)
        done = subprocess.run(
            [sys.executable, "-c", _READ_AS_NOBODY, readable, path], capture_output=True, text=True, timeout=60
        )
    finally:
        shutil.rmtree(directory)
    assert done.returncode == 0, done.stderr
    control, refused = json.loads(done.stdout)
    assert control == {"texts": ["a"]}
    assert refused == {"message": f"{path}: cannot read: Permission denied", "line": None, "field": None}


# --- streaming --------------------------------------------------------------------------------------

_ROWS = 200_000


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "csv", "tsv"])
def test_text_formats_stream(monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    body = {
        "txt": "".join(f"line {i}\n" for i in range(_ROWS)),
        "jsonl": "".join(f'{{"text": "line {i}"}}\n' for i in range(_ROWS)),
        "csv": "text\n" + "".join(f"line {i}\n" for i in range(_ROWS)),
        "tsv": "text\n" + "".join(f"line {i}\n" for i in range(_ROWS)),
    }[fmt].encode()
    buffer = stdin_with(monkeypatch, body)
    records = read_records("-", input_format=fmt)
    assert isinstance(records, types.GeneratorType)
    assert buffer.tell() == 0  # nothing is read before iteration
    assert next(records).text == "line 0"
    assert buffer.tell() < 100  # only the first line or two, not the 2 MB behind them


def test_file_streams(tmp_path: Path) -> None:
    path = write(tmp_path / "big.txt", "".join(f"line {i}\n" for i in range(_ROWS)))
    records = read_records(path)
    assert isinstance(records, types.GeneratorType)
    assert next(records) == Record(row=0, id=0, text="line 0", line=1)
    (last,) = collections.deque(records, maxlen=1)
    assert last == Record(row=_ROWS - 1, id=_ROWS - 1, text=f"line {_ROWS - 1}", line=_ROWS)


def test_parquet_streams_by_batch(tmp_path: Path) -> None:
    texts = pa.array([f"text number {i:06d} " * 4 for i in range(_ROWS)])
    path = write_parquet(tmp_path / "big.parquet", {"text": texts, "other": texts}, row_group_size=10_000)
    before = pa.total_allocated_bytes()
    records = read_records(path)
    assert isinstance(records, types.GeneratorType)
    assert next(records).text == texts[0].as_py()
    # About one row group of the needed column (~0.8 MB) is in memory, not the whole column (16 MB).
    assert pa.total_allocated_bytes() - before < texts.nbytes // 4
