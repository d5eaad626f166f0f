"""`memfit embed` end to end: outputs, resume after an interruption or `kill -9`, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import memfit
from conftest import kill_after_first_part
import memfit.jobs.runner as runner_module
from memfit.cli import main
from memfit.jobs.runner import source_records

TEXTS = [f"text number {i} about {'cats ' * (i % 7)}and dogs{' and the world' * (i % 13)}" for i in range(40)]


def _run_cli(*argv: str, stdin: bytes | None = None, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "memfit", *argv], input=stdin, capture_output=True, env=env, timeout=300
    )


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_cli_embeds_jsonl_with_ids_equal_to_the_api(tiny_model_dir, tmp_path, capsys):
    src = _write_jsonl(tmp_path / "in.jsonl", [{"doc": f"d{i}", "body": t} for i, t in enumerate(TEXTS)])
    rc = main(
        [
            "embed",
            str(src),
            "-o",
            str(tmp_path / "out"),
            "--model",
            tiny_model_dir,
            "--dtype",
            "fp32",
            "--text-field",
            "body",
            "--id-field",
            "doc",
            "--tokens",
            "--pooling",
            "max",
        ]
    )
    assert rc == 0
    out = memfit.read(tmp_path / "out")
    assert out.ids == [f"d{i}" for i in range(len(TEXTS))]
    api = memfit.Encoder(tiny_model_dir, dtype="fp32")
    np.testing.assert_allclose(out.embeddings, api.embed(TEXTS, pooling="max"), atol=1e-6)
    assert len(out.token_embeddings) == len(TEXTS)
    manifest = out.manifest
    assert manifest["settings"]["pooling"] == "max" and manifest["dim"] == 32 and manifest["complete"]
    assert manifest["memfit_version"] == memfit.__version__
    assert "wrote 40 embeddings" in capsys.readouterr().err


def test_resume_after_an_interruption_equals_an_uninterrupted_run(tiny_model_dir, tmp_path, monkeypatch):
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    enc = memfit.Encoder(tiny_model_dir, dtype="fp32")
    enc.embed_to(str(src), tmp_path / "full", part_size=6)

    def interrupted_at_20(*args, **kwargs):
        for record in source_records(*args, **kwargs):
            if record.row == 20:
                raise KeyboardInterrupt
            yield record

    with monkeypatch.context() as patch:
        patch.setattr(runner_module, "source_records", interrupted_at_20)
        with pytest.raises(KeyboardInterrupt):
            enc.embed_to(str(src), tmp_path / "part", part_size=6)
    partial = json.loads((tmp_path / "part" / "manifest.json").read_text())
    assert not partial["complete"] and 0 < partial["rows"] < len(TEXTS)
    assert memfit.read(tmp_path / "part").ids == list(range(partial["rows"]))  # what is there is valid

    enc.embed_to(str(src), tmp_path / "part", part_size=6, resume=True)
    full, resumed = memfit.read(tmp_path / "full"), memfit.read(tmp_path / "part")
    assert resumed.ids == full.ids == list(range(len(TEXTS)))
    np.testing.assert_array_equal(resumed.embeddings, full.embeddings)


@pytest.mark.slow
def test_kill_9_then_resume_loses_nothing_and_duplicates_nothing(tiny_model_dir, tmp_path):
    many = [f"{t} variant {j}" for j in range(60) for t in TEXTS[:50]]  # 2,400 texts, 2 blocks of 2048 at most
    src = tmp_path / "in.txt"
    src.write_text("\n".join(many) + "\n")
    args = ["embed", str(src), "--model", tiny_model_dir, "--dtype", "fp32", "--tokens", "--part-size", "100"]
    out = tmp_path / "killed"
    kill_after_first_part(args, out)

    resumed = _run_cli(*args, "-o", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr.decode()
    straight = _run_cli(*args, "-o", str(tmp_path / "straight"))
    assert straight.returncode == 0, straight.stderr.decode()

    a, b = memfit.read(out), memfit.read(tmp_path / "straight")
    assert a.ids == b.ids == list(range(len(many)))
    np.testing.assert_array_equal(a.embeddings, b.embeddings)
    assert len(a.token_ids) == len(b.token_ids) == len(many)
    for x_ids, y_ids, x_rows, y_rows in zip(a.token_ids, b.token_ids, a.token_embeddings, b.token_embeddings):
        np.testing.assert_array_equal(x_ids, y_ids)
        np.testing.assert_array_equal(x_rows, y_rows)
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.slow
def test_stdin_input_and_quiet_progress_in_pipes(tiny_model_dir, tmp_path):
    result = _run_cli(
        "embed", "-", "-o", str(tmp_path / "o"), "--model", tiny_model_dir, stdin="\n".join(TEXTS[:5]).encode() + b"\n"
    )
    assert result.returncode == 0, result.stderr.decode()
    assert memfit.read(tmp_path / "o").ids == [0, 1, 2, 3, 4]
    assert b"it/s" not in result.stderr and b"%|" not in result.stderr  # no progress bar when not a terminal


@pytest.mark.parametrize(
    ("content", "extra", "expected"),
    [
        ('{"text": "ok"}\n{"text": "fine"}\n{"text": broken\n', [], r"in.jsonl:3: malformed JSON"),
        ('{"text": "ok"}\n{"body": "no text"}\n', [], r"in.jsonl:2: field 'text'"),
        ('{"text": "ok"}\n{"text": null}\n', [], r"in.jsonl:2: field 'text'"),
        ('{"text": "ok", "id": 1}\n{"text": "x"}\n', ["--id-field", "id"], r"in.jsonl:2: field 'id'"),
    ],
)
@pytest.mark.slow
def test_bad_input_gives_one_line_error_naming_file_line_and_field(tiny_model_dir, tmp_path, content, extra, expected):
    import re

    src = tmp_path / "in.jsonl"
    src.write_text(content)
    result = _run_cli("embed", str(src), "-o", str(tmp_path / "o"), "--model", tiny_model_dir, *extra)
    err = result.stderr.decode().strip()
    assert result.returncode == 2
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert re.search(expected, err), err


@pytest.mark.slow
def test_undecodable_bytes_and_bad_model_path(tiny_model_dir, tmp_path):
    src = tmp_path / "in.txt"
    src.write_bytes(b"good line\n\xff\xfe bad bytes\n")
    result = _run_cli("embed", str(src), "-o", str(tmp_path / "o"), "--model", tiny_model_dir)
    assert result.returncode == 2 and b"in.txt:2" in result.stderr and b"UTF-8" in result.stderr
    assert b"Traceback" not in result.stderr

    result = _run_cli("embed", str(src), "-o", str(tmp_path / "o2"), "--model", str(tmp_path / "nope"))
    assert result.returncode == 3 and b"Traceback" not in result.stderr
    assert b"nope" in result.stderr


def test_error_mid_file_keeps_completed_parts_valid(tiny_model_dir, tmp_path):
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    with src.open("a") as fh:
        fh.write("{not json}\n")
    enc = memfit.Encoder(tiny_model_dir, dtype="fp32")
    with pytest.raises(memfit.InputError, match=r"in.jsonl:41"):
        enc.embed_to(str(src), tmp_path / "o", part_size=8)
    partial = memfit.read(tmp_path / "o")
    assert len(partial.ids) == 40 and partial.ids == list(range(40))
    assert not partial.manifest["complete"]


def test_refuses_to_overwrite_or_mix_settings(tiny_model_dir, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("a\nb\n")
    base = ["embed", str(src), "-o", str(tmp_path / "o"), "--model", tiny_model_dir, "--dtype", "fp32"]
    assert main(base) == 0
    assert main(base) == 2  # exists, no --resume
    assert main([*base, "--resume", "--pooling", "cls"]) == 2  # settings differ
    assert main([*base, "--resume"]) == 0  # already complete: nothing to do
    assert memfit.read(tmp_path / "o").ids == [0, 1]


@pytest.mark.slow
def test_version_and_help():
    result = _run_cli("--version")
    assert result.returncode == 0 and result.stdout.decode().strip() == f"memfit {memfit.__version__}"
    result = _run_cli("embed", "--help")
    assert result.returncode == 0 and b"--memory-budget" in result.stdout and b"--long" in result.stdout


def test_the_command_delivers_its_output_and_runs_exit_handlers_before_it_ends(tiny_model_dir, tmp_path):
    """`memfit` ends without the interpreter's teardown (cli.run): what it printed to a pipe, the files it wrote
    and the exit handlers registered in the process (here by a sitecustomize module) all still happen."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    marker = tmp_path / "exit-handler-ran"
    (hooks / "sitecustomize.py").write_text(
        f"import atexit, pathlib\natexit.register(pathlib.Path({str(marker)!r}).write_text, 'yes')\n"
    )
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    path = os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")]))
    done = _run_cli("plan", "--model", tiny_model_dir, "--dtype", "fp32", "--json", env_extra={"PYTHONPATH": path})
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert json.loads(done.stdout)["backend"]  # the whole JSON document reached the pipe
    assert marker.read_text() == "yes"
    marker.unlink()
    embedded = _run_cli(
        "embed", str(src), "--model", tiny_model_dir, "-o", str(tmp_path / "out"), env_extra={"PYTHONPATH": path}
    )
    assert embedded.returncode == 0, embedded.stderr.decode()[-2000:]
    assert b"wrote 40 embeddings" in embedded.stderr and marker.read_text() == "yes"
    assert len(memfit.read(tmp_path / "out").ids) == 40
    refused = _run_cli("embed", str(tmp_path / "missing.txt"), "--model", tiny_model_dir, "-o", str(tmp_path / "o2"))
    assert refused.returncode == 2 and refused.stderr.decode().startswith("memfit: error:")


def test_executor_is_where_a_job_runs_and_engine_is_its_unlisted_old_name(capsys):
    from memfit.cli import build_parser

    parser = build_parser()
    for command in (["embed", "in.txt", "-o", "out"], ["classify", "in.txt", "--labels", "a,b", "-o", "out"]):
        assert parser.parse_args([*command, "--executor", "ray"]).executor == "ray"
        assert parser.parse_args([*command, "--engine", "ray"]).executor == "ray"  # one release of the old name
        assert parser.parse_args(command).executor == "local"
    with pytest.raises(SystemExit):
        parser.parse_args(["embed", "--help"])
    shown = capsys.readouterr().out
    assert "--executor {local,ray}" in shown and "--engine" not in shown
