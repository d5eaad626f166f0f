"""Corpora as users keep them (issue #28): directories and globs of shards, compressed text, Hugging
Face datasets saved with ``save_to_disk``. Each must give the output of the same corpus in one local
JSONL file: the same ids exactly once, the same vectors. Compressed files are written with Python's own
gzip / bz2 and pyarrow's zstd codec, the dataset with the ``datasets`` library itself, so the readers
are checked against the tools users write them with.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import os
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import memfit
from memfit.data.shards import expand
from memfit.data.sources import read_records
from memfit.errors import InputError, OutputError

WORDS = "a quiet river runs past old stone mills and green fields under a wide grey sky".split()
BUDGET = "4GiB"


def _rows(n: int) -> list[dict]:
    """Texts of varied length (some over the tiny model's window), string ids, one empty text."""
    rows = [
        {"doc": f"d{i}", "body": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(2 + (i * 29) % 70))}
        for i in range(n)
    ]
    rows[4]["body"] = ""
    return rows


ROWS = _rows(61)
SPLITS = [(0, 20), (20, 41), (41, 61)]  # three shards of uneven size


def _jsonl_bytes(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _delimited_bytes(rows: list[dict], delimiter: str) -> bytes:
    text = io.StringIO()
    writer = csv.writer(text, delimiter=delimiter, lineterminator="\n")
    writer.writerow(["doc", "body"])
    writer.writerows([r["doc"], r["body"]] for r in rows)
    return text.getvalue().encode()


def _zstd(data: bytes) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, "zstd") as out:
        out.write(data)
    return sink.getvalue().to_pybytes()


def _shards(folder: Path, pattern: str, encode) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for index, (start, stop) in enumerate(SPLITS):
        (folder / pattern.format(index)).write_bytes(encode(ROWS[start:stop]))


def _embed(source: str | Path, out: Path, **options) -> memfit.EmbeddingOutput:
    memfit.Encoder(options.pop("model"), dtype="fp32", memory_budget=BUDGET).embed_to(
        source, out, text_field="body", id_field="doc", part_size=16, progress=False, **options
    )
    return memfit.read(out)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory) -> memfit.EmbeddingOutput:
    folder = tmp_path_factory.mktemp("reference")
    (folder / "all.jsonl").write_bytes(_jsonl_bytes(ROWS))
    return _embed(folder / "all.jsonl", folder / "out", model=tiny_model_dir)


def _assert_same(got: memfit.EmbeddingOutput, reference: memfit.EmbeddingOutput) -> None:
    assert got.ids == reference.ids == [r["doc"] for r in ROWS]
    np.testing.assert_array_equal(got.embeddings, reference.embeddings)


def _hf_dataset(folder: Path) -> str:
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_list(ROWS)
    dataset.save_to_disk(str(folder), num_shards=3)  # three Arrow files, as a large dataset has
    return str(folder)


INPUTS = {
    "directory of jsonl.gz": lambda d: (
        _shards(d / "s", "part-{:05d}.jsonl.gz", lambda r: gzip.compress(_jsonl_bytes(r))),
        str(d / "s"),
    )[1],
    "glob of jsonl.zst": lambda d: (
        _shards(d / "s", "part-{:05d}.jsonl.zst", lambda r: _zstd(_jsonl_bytes(r))),
        str(d / "s" / "part-*.jsonl.zst"),
    )[1],
    "csv.bz2": lambda d: (
        d.joinpath("all.csv.bz2").write_bytes(bz2.compress(_delimited_bytes(ROWS, ","))),
        str(d / "all.csv.bz2"),
    )[1],
    "tsv.gz": lambda d: (
        d.joinpath("all.tsv.gz").write_bytes(gzip.compress(_delimited_bytes(ROWS, "\t"))),
        str(d / "all.tsv.gz"),
    )[1],
    "directory of parquet": lambda d: (_parquet_shards(d / "p"), str(d / "p"))[1],
    "datasets save_to_disk": lambda d: _hf_dataset(d / "hf"),
}


def _parquet_shards(folder: Path) -> None:
    folder.mkdir()
    for index, (start, stop) in enumerate(SPLITS):
        pq.write_table(pa.Table.from_pylist(ROWS[start:stop]), folder / f"part-{index}.parquet", row_group_size=7)
    (folder / "_SUCCESS").write_text("")  # a marker file, as Spark writes: not a shard


@pytest.mark.parametrize("kind", list(INPUTS))
def test_every_input_kind_equals_the_same_corpus_in_one_jsonl(kind, reference, tiny_model_dir, tmp_path):
    source = INPUTS[kind](tmp_path)
    _assert_same(_embed(source, tmp_path / "out", model=tiny_model_dir), reference)


def test_rows_count_on_across_shards_and_errors_name_the_shard_and_its_line(tmp_path):
    folder = tmp_path / "s"
    _shards(folder, "part-{}.jsonl.gz", lambda r: gzip.compress(_jsonl_bytes(r)))
    records = list(read_records(str(folder), text_field="body", id_field="doc"))
    assert [r.row for r in records] == list(range(len(ROWS)))
    assert [r.line for r in records[20:22]] == [1, 2]  # lines are the shard's own
    broken = _jsonl_bytes(ROWS[20:22]).replace(b'"body"', b'"body":', 1)
    (folder / "part-1.jsonl.gz").write_bytes(gzip.compress(broken))
    with pytest.raises(InputError) as error:
        list(read_records(str(folder), text_field="body", id_field="doc"))
    assert str(error.value).startswith(f"{folder / 'part-1.jsonl.gz'}:1: malformed JSON")


def test_a_damaged_compressed_stream_is_a_one_line_input_error(tmp_path):
    data = gzip.compress(_jsonl_bytes(ROWS))
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(data[: len(data) // 2])  # truncated mid-stream
    with pytest.raises(InputError) as error:
        list(read_records(str(path), text_field="body"))
    assert str(error.value).startswith(f"{path}:") and "\n" not in str(error.value)
    # the stream is decompressed ahead of the lines read: no line is named as the bad one ("cut.jsonl.gz:1" was)
    assert error.value.line is None and re.fullmatch(
        r"cannot read( past line \d+)?: .+", str(error.value)[len(f"{path}: ") :]
    )


def test_a_pattern_matching_nothing_and_a_dataset_dict_are_refused_by_name(tmp_path):
    with pytest.raises(InputError, match="no file matches this pattern"):
        read_records(str(tmp_path / "part-*.jsonl"))
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:3]), "test": datasets.Dataset.from_list(ROWS[3:6])}
    ).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(InputError) as error:
        read_records(str(tmp_path / "dd"))
    assert f"{tmp_path / 'dd' / 'train'}" in str(error.value) and "several splits" in str(error.value)


def test_resume_of_a_sharded_input_refuses_a_changed_shard_by_name(tiny_model_dir, tmp_path):
    folder = tmp_path / "s"
    _shards(folder, "part-{}.jsonl", _jsonl_bytes)
    out = tmp_path / "out"
    _embed(folder, out, model=tiny_model_dir)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest.update(complete=False)  # as if it had been interrupted
    (out / "manifest.json").write_text(json.dumps(manifest))
    (folder / "part-2.jsonl").write_bytes(_jsonl_bytes(ROWS[41:60]))
    with pytest.raises(OutputError, match=r"changed since the run .* \(shard part-2.jsonl: size"):
        _embed(folder, out, model=tiny_model_dir, resume=True)


def test_resume_of_a_dataset_whose_shards_are_listed_in_another_order_is_refused(tiny_model_dir, tmp_path):
    """A Hugging Face dataset is read in its state.json's order: with every file the same and that order changed, a
    resume passed the input check and wrote some rows twice and others never."""
    folder = Path(_hf_dataset(tmp_path / "hf"))
    out = tmp_path / "out"
    _embed(folder, out, model=tiny_model_dir)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest.update(complete=False)  # as if it had been interrupted
    (out / "manifest.json").write_text(json.dumps(manifest))
    state = json.loads((folder / "state.json").read_text())
    names = [entry["filename"] for entry in state["_data_files"]]
    state["_data_files"] = state["_data_files"][::-1]
    (folder / "state.json").write_text(json.dumps(state))
    reordered = f"shards read in another order: {', '.join(names)} -> {', '.join(names[::-1])}"
    with pytest.raises(OutputError, match=re.escape(f"({reordered})")):
        _embed(folder, out, model=tiny_model_dir, resume=True)


def test_a_file_whose_name_has_glob_characters_is_that_file_and_a_glob_matches_visible_files_only(tmp_path):
    """``corpus[2024].jsonl`` was read as a pattern: it matched ``corpus2.jsonl`` (other rows, silently) or nothing.
    A glob matched directories and hidden files, which a directory input leaves out."""
    folder = tmp_path / "g"
    folder.mkdir()
    (folder / "x[1].txt").write_text("the real file\n")
    (folder / "x1.txt").write_text("another\nfile\n")
    (folder / "why?.txt").write_text("q\n")
    (folder / "whys.txt").write_text("w\n")
    (folder / "xdir.txt").mkdir()
    (folder / ".x2.txt").write_text("hidden\n")
    for name, texts in (("x[1].txt", ["the real file"]), ("why?.txt", ["q"])):
        assert [record.text for record in read_records(str(folder / name))] == texts
    assert [os.path.basename(shard) for shard in expand(str(folder / "x*.txt"))] == ["x1.txt", "x[1].txt"]
    (tmp_path / "data[1]").mkdir()  # a directory is itself too, not a pattern matching data1
    (tmp_path / "data[1]" / "a.txt").write_text("in the directory\n")
    (tmp_path / "data1").mkdir()
    assert [record.text for record in read_records(str(tmp_path / "data[1]"))] == ["in the directory"]
    assert [os.path.basename(shard) for shard in expand(str(folder / ".x*.txt"))] == [".x2.txt"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a FIFO")
def test_a_pipe_given_as_the_input_path_is_refused_in_one_line_before_it_is_read(tiny_model_dir, tmp_path, capsys):
    """``/dev/stdin``, ``<(...)`` or a FIFO was read up by the checks before the run: 0 rows and exit 0, or a hang."""
    from memfit.cli import main

    fifo = tmp_path / "texts.txt"
    os.mkfifo(fifo)  # no writer: opening it would block, so a hang here means it was opened
    assert main(["embed", str(fifo), "--model", tiny_model_dir, "-o", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"memfit: error: {fifo}: is a pipe or a device, not a file: memfit reads its input more than once (to check "
        "it, and to resume it), which a pipe cannot give; pipe it into stdin and pass - as the input instead"
    )
    assert not (tmp_path / "out").exists()
