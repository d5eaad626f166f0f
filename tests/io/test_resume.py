"""`--resume` verifies before it trusts: a changed input is refused, damaged parts are recomputed, and an
interrupted `memfit classify` (kill -9) resumes to the output of an uninterrupted run."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import memfit
from conftest import kill_after_first_part, kill_at_a_moment
import memfit.jobs.runner as runner_module
from memfit.jobs.classify import read_classifications
from memfit.cli import main
from memfit.io.fingerprint import EDGE_BYTES, FULL_HASH_MAX_BYTES, check_same_input, input_fingerprint
from memfit.jobs.runner import source_records

TEXTS = [f"text number {i} about {'cats ' * (i % 7)}and dogs{' and the world' * (i % 13)}" for i in range(40)]


def _embed_args(src: Path, out: Path, model: str) -> list[str]:
    return ["embed", str(src), "-o", str(out), "--model", model, "--dtype", "fp32", "--part-size", "6"]


def _interrupt_at_row(monkeypatch: pytest.MonkeyPatch, row: int) -> None:
    """Make the embed job's input raise KeyboardInterrupt (Ctrl-C) when it reaches ``row``."""

    def interrupted(*args, **kwargs):
        for record in source_records(*args, **kwargs):
            if record.row == row:
                raise KeyboardInterrupt
            yield record

    monkeypatch.setattr(runner_module, "source_records", interrupted)


@pytest.fixture
def interrupted_run(tiny_model_dir, tmp_path, monkeypatch) -> tuple[Path, Path]:
    """An input file and an output directory holding its first 18 rows (3 parts) from a Ctrl-C'd run."""
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        _interrupt_at_row(patch, 20)
        assert main(_embed_args(src, out, tiny_model_dir)) == 130
    assert json.loads((out / "manifest.json").read_text())["rows"] == 18
    return src, out


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda texts: texts[1:], r"size \d+ -> \d+ bytes"),  # a line removed: every row shifts
        (lambda texts: [texts[0].replace("text", "TEXT")] + texts[1:], r"content differs \(whole file hashed\)"),
    ],
)
def test_resume_refuses_a_changed_input_and_touches_nothing(interrupted_run, tiny_model_dir, capsys, edit, reason):
    src, out = interrupted_run
    before = _snapshot(out)
    src.write_text("\n".join(edit(TEXTS)) + "\n")
    assert main([*_embed_args(src, out, tiny_model_dir), "--resume"]) == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith(f"memfit: error: {src}: changed since the run in {out} started (")
    assert re.search(reason, message), message
    assert "restore the original file, or write to a new output directory without --resume" in message
    assert _snapshot(out) == before


def test_resume_refuses_another_input_format(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A .jsonl read as txt embeds whole lines (and counts blank lines as rows): resumed as jsonl, the first parts
    and the rest would be two readings of the file."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS))
    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        _interrupt_at_row(patch, 20)
        assert main([*_embed_args(src, out, tiny_model_dir), "--input-format", "txt"]) == 130
    before = _snapshot(out)
    assert main([*_embed_args(src, out, tiny_model_dir), "--resume"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"memfit: error: {out}: cannot resume, settings differ from the first run (input_format: 'txt' → None)"
    )
    assert _snapshot(out) == before
    assert main([*_embed_args(src, out, tiny_model_dir), "--input-format", "txt", "--resume"]) == 0


@pytest.mark.parametrize("file", ["part", "tokens"])
def test_a_full_disk_is_one_line_naming_the_file_and_keeps_the_parts_written(file, tiny_model_dir, tmp_path, capsys):
    """The disk's refusal was a traceback (exit 1); the parts before it are kept, and --resume goes on from them. The
    third part's file (or its token file) finds the disk full, leaving what a full disk leaves: a cut temporary file."""
    import pyarrow.parquet as pq

    import memfit.io.sinks as sinks_module
    import memfit.io.token_table as token_table_module

    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "out"
    real_write, real_writer = pq.write_table, pq.ParquetWriter

    def full_at_the_third(where) -> None:
        if Path(where).name.startswith(f"{file}-00002.parquet"):  # its temporary name
            with open(where, "wb") as half:
                half.write(b"PAR1")
            raise OSError(28, "No space left on device")

    def write_part(table, where, **options):
        full_at_the_third(where)
        real_write(table, where, **options)

    class TokenWriter(real_writer):
        def write_table(self, table, **options):
            full_at_the_third(self.where)
            super().write_table(table, **options)

        def __init__(self, where, schema, **options):
            self.where = where
            super().__init__(where, schema, **options)

    with pytest.MonkeyPatch.context() as patch:
        if file == "part":
            patch.setattr(sinks_module.pq, "write_table", write_part)
        else:
            patch.setattr(token_table_module.pq, "ParquetWriter", TokenWriter)
        assert main([*_embed_args(src, out, tiny_model_dir), "--tokens"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"memfit: error: {out / f'{file}-00002.parquet'}: cannot write: No space left on device"
    )
    assert memfit.read(out).ids == list(range(12))  # the two parts before it
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    assert main([*_embed_args(src, out, tiny_model_dir), "--tokens", "--resume"]) == 0
    assert memfit.read(out).ids == list(range(len(TEXTS)))


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root may write in any directory")
def test_an_empty_output_directory_without_write_permission_is_refused_before_the_model_loads(tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("a text\n")
    out = tmp_path / "out"
    out.mkdir(mode=0o555)
    assert main(["embed", str(src), "-o", str(out), "--model", "no-such/model-would-load-later"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"memfit: error: {out}: no permission to write in it; choose a directory you can write in"
    )


def test_resume_accepts_an_unchanged_input_that_was_only_touched(interrupted_run, tiny_model_dir, tmp_path):
    src, out = interrupted_run
    os.utime(src, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))  # same bytes, new mtime
    assert main([*_embed_args(src, out, tiny_model_dir), "--resume"]) == 0
    assert main(_embed_args(src, tmp_path / "straight", tiny_model_dir)) == 0
    resumed, straight = memfit.read(out), memfit.read(tmp_path / "straight")
    assert resumed.ids == straight.ids == list(range(len(TEXTS)))
    np.testing.assert_array_equal(resumed.embeddings, straight.embeddings)


@pytest.mark.slow
def test_stdin_and_in_memory_texts_cannot_be_resumed(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    args = ["embed", "-", "-o", str(out), "--model", tiny_model_dir]
    stdin = "\n".join(TEXTS[:5]).encode() + b"\n"
    first = subprocess.run([sys.executable, "-m", "memfit", *args], input=stdin, capture_output=True, timeout=300)
    assert first.returncode == 0, first.stderr.decode()
    before = _snapshot(out)
    again = subprocess.run(
        [sys.executable, "-m", "memfit", *args, "--resume"], input=stdin, capture_output=True, timeout=300
    )
    err = again.stderr.decode().strip()
    assert again.returncode == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert f"{out}: cannot resume from stdin: memfit cannot check that they are the input" in err
    assert _snapshot(out) == before

    enc = memfit.Encoder(tiny_model_dir, dtype="fp32")
    enc.embed_to(TEXTS[:5], tmp_path / "memory")
    with pytest.raises(memfit.OutputError, match="cannot resume from in-memory texts"):
        enc.embed_to(TEXTS[:5], tmp_path / "memory", resume=True)


def _delete(path: Path) -> None:
    path.unlink()


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _scramble_footer(path: Path) -> None:  # same size, unreadable footer
    data = bytearray(path.read_bytes())
    data[-12:-4] = b"\x00" * 8
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (_delete, "listed in manifest.json but missing"),
        (_truncate, r"\d+ bytes on disk, \d+ when it was written \(truncated or overwritten\)"),
        (_scramble_footer, "not readable Parquet"),
    ],
)
def test_a_damaged_part_is_recomputed_and_never_marked_complete(tiny_model_dir, tmp_path, capsys, damage, problem):
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    straight, out = tmp_path / "straight", tmp_path / "out"
    assert main(_embed_args(src, straight, tiny_model_dir)) == 0
    assert main(_embed_args(src, out, tiny_model_dir)) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert [p["bytes"] for p in manifest["parts"]] == [(out / p["file"]).stat().st_size for p in manifest["parts"]]
    damage(out / "part-00002.parquet")
    capsys.readouterr()

    assert main([*_embed_args(src, out, tiny_model_dir), "--resume"]) == 0
    err = capsys.readouterr().err
    assert re.search(re.escape(f"memfit: {out / 'part-00002.parquet'}: ") + problem, err), err
    assert "recomputing from row 12 (2 of 7 parts kept)" in err
    resumed, expected = memfit.read(out), memfit.read(straight)
    assert resumed.ids == expected.ids == list(range(len(TEXTS)))
    np.testing.assert_array_equal(resumed.embeddings, expected.embeddings)
    assert resumed.manifest["complete"] and resumed.manifest["counts"] == expected.manifest["counts"]


def test_a_damaged_token_file_is_recomputed_with_its_part(tiny_model_dir, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    straight, out = tmp_path / "straight", tmp_path / "out"
    assert main([*_embed_args(src, straight, tiny_model_dir), "--tokens"]) == 0
    assert main([*_embed_args(src, out, tiny_model_dir), "--tokens"]) == 0
    token_file = out / json.loads((out / "manifest.json").read_text())["parts"][3]["tokens"]["file"]
    _truncate(token_file)
    capsys.readouterr()

    assert main([*_embed_args(src, out, tiny_model_dir), "--tokens", "--resume"]) == 0
    assert f"memfit: {token_file}: " in capsys.readouterr().err
    resumed, expected = memfit.read(out), memfit.read(straight)
    assert resumed.ids == expected.ids
    assert all(np.array_equal(a, b) for a, b in zip(resumed.token_embeddings, expected.token_embeddings, strict=True))


def test_fingerprint_hashes_small_files_whole_and_large_files_at_both_ends(tmp_path):
    small = tmp_path / "small.txt"
    small.write_bytes(b"hello\n" * 1000)
    assert input_fingerprint(small)["sha256"] == hashlib.sha256(small.read_bytes()).hexdigest()
    assert input_fingerprint("-") is None and input_fingerprint(["in", "memory"]) is None

    large = tmp_path / "large.txt"
    data = bytearray(os.urandom(FULL_HASH_MAX_BYTES + 3 * EDGE_BYTES))
    large.write_bytes(bytes(data))
    edges = hashlib.sha256(bytes(data[:EDGE_BYTES]) + bytes(data[-EDGE_BYTES:])).hexdigest()
    recorded = input_fingerprint(large)
    assert recorded["sha256"] == edges and recorded["size"] == len(data)

    data[-1] ^= 0xFF  # an edit near the end: same size, same modification time
    large.write_bytes(bytes(data))
    os.utime(large, ns=(recorded["mtime_ns"], recorded["mtime_ns"]))
    with pytest.raises(memfit.OutputError, match=r"content differs \(first and last MiB hashed\)"):
        check_same_input(recorded, input_fingerprint(large), str(large), tmp_path / "out")
    data[-1] ^= 0xFF  # restored content, but touched: in a partly hashed file that may hide an edit
    large.write_bytes(bytes(data))
    with pytest.raises(memfit.OutputError, match="modification time differs"):
        check_same_input(recorded, input_fingerprint(large), str(large), tmp_path / "out")


@pytest.mark.slow
def test_classify_killed_mid_run_resumes_to_the_uninterrupted_output(tiny_model_dir, tmp_path):
    many = [f"{t} variant {j}" for j in range(40) for t in TEXTS]  # 1,600 texts, 16 parts of 100
    src = tmp_path / "in.txt"
    src.write_text("\n".join(many) + "\n")
    args = [
        "classify",
        str(src),
        "--model",
        tiny_model_dir,
        "--dtype",
        "fp32",
        "--labels",
        "cats,dogs,world",
        "--long",
        "chunk",
        "--part-size",
        "100",
    ]
    out = tmp_path / "killed"
    killed_at = kill_after_first_part(args, out)
    manifest_path = out / "manifest.json"
    assert 0 < killed_at["rows"] < len(many)

    resumed = subprocess.run(
        [sys.executable, "-m", "memfit", *args, "-o", str(out), "--resume"], capture_output=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr.decode()
    assert json.loads(manifest_path.read_text())["parts"][: len(killed_at["parts"])] == killed_at["parts"]
    straight = subprocess.run(
        [sys.executable, "-m", "memfit", *args, "-o", str(tmp_path / "straight")], capture_output=True, timeout=300
    )
    assert straight.returncode == 0, straight.stderr.decode()

    ids, results = read_classifications(out)
    expected_ids, expected = read_classifications(tmp_path / "straight")
    assert ids == expected_ids == list(range(len(many)))
    assert [r.labels for r in results] == [r.labels for r in expected]
    np.testing.assert_array_equal([r.scores for r in results], [r.scores for r in expected])
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_a_run_killed_before_its_first_part_is_simply_run_again(tiny_model_dir, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "part-00000.parquet.tmp").write_bytes(b"half a part")  # all a kill -9 that early leaves
    (out / "tokens-00000.parquet.tmp").write_bytes(b"half a token file")
    assert main([*_embed_args(src, out, tiny_model_dir), "--tokens"]) == 0  # no --resume needed
    assert memfit.read(out).ids == list(range(len(TEXTS)))
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_a_run_killed_before_its_first_manifest_resumes_and_a_run_without_resume_says_so(tiny_model_dir, tmp_path):
    """kill -9 between the first part's rename and the first manifest's: the directory holds that part and its
    token file but no manifest. It was refused with and without --resume, and had to be emptied by hand."""
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "killed"
    argv = ["embed", str(src), "--model", tiny_model_dir, "--dtype", "fp32", "--part-size", "6", "--tokens"]
    kill_at_a_moment("first-manifest-write", argv, out)
    assert (out / "tokens-00000.parquet").exists()
    before = _snapshot(out)

    refused = subprocess.run([sys.executable, "-m", "memfit", *argv, "-o", str(out)], capture_output=True, text=True)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        f"memfit: error: {out}: holds part files but no manifest that lists them, as a memfit run killed before it "
        "listed its first part leaves them; pass --resume to replace them, or choose a new or empty directory"
    )
    assert _snapshot(out) == before

    assert main([*argv, "-o", str(out), "--resume"]) == 0
    assert main([*argv, "-o", str(tmp_path / "straight")]) == 0
    ours, reference = memfit.read(out), memfit.read(tmp_path / "straight")
    assert ours.ids == reference.ids == list(range(len(TEXTS)))
    np.testing.assert_array_equal(ours.embeddings, reference.embeddings)
    for got, expected in zip(ours.token_embeddings, reference.token_embeddings, strict=True):
        np.testing.assert_array_equal(got, expected)
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_a_directory_of_someone_elses_files_is_never_taken_even_with_resume(tiny_model_dir, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS[:3]) + "\n")
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "part-00000.parquet").write_bytes(b"a part of theirs")
    (out / "notes.txt").write_text("keep me")
    before = _snapshot(out)
    assert main([*_embed_args(src, out, tiny_model_dir), "--resume"]) == 2
    assert _snapshot(out) == before


@pytest.mark.parametrize("moment", ["start-up", "manifest-write"])
def test_kill_9_at_start_up_or_while_the_manifest_is_written_then_resume_equals_an_uninterrupted_run(
    tiny_model_dir, tmp_path, moment
):
    texts = TEXTS * 5  # 200 texts, parts of 6: the second manifest comes while most rows are still to do
    src = tmp_path / "in.txt"
    src.write_text("\n".join(texts) + "\n")
    out = tmp_path / "killed"
    argv = ["embed", str(src), "--model", tiny_model_dir, "--dtype", "fp32", "--part-size", "6"]
    kill_at_a_moment(moment, argv, out)
    assert main([*argv, "-o", str(out), "--resume"]) == 0
    assert main([*argv, "-o", str(tmp_path / "straight")]) == 0
    ours, reference = memfit.read(out), memfit.read(tmp_path / "straight")
    assert ours.ids == reference.ids == list(range(len(texts)))
    np.testing.assert_array_equal(ours.embeddings, reference.embeddings)
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
