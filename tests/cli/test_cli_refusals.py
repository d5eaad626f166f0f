"""Bad input and options are refused with one line, before the model loads, and leave no output behind.

Each refusal is checked for its exit code, a single stderr line naming the file/line/field or the
option, no traceback, and an output path that is untouched (not created, or a file left as it was).
"Before the model loads" is checked directly: the refusing process never imported torch.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import memfit
import memfit.jobs.runner as runner_module
from memfit.cli import main
from memfit.jobs.runner import source_records

# Runs the CLI in a fresh interpreter and reports on stdout whether torch was ever imported.
_CLI_THEN_REPORT_TORCH = (
    "import sys; from memfit.cli import main; rc = main(sys.argv[1:]); print('torch' in sys.modules); sys.exit(rc)"
)


def _cli(*argv: str, env_extra: dict | None = None, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-c", _CLI_THEN_REPORT_TORCH, *argv], capture_output=True, env=env, input=stdin, timeout=300
    )


def _one_line(stderr: bytes) -> str:
    text = stderr.decode().strip()
    assert "Traceback" not in text, text
    assert len(text.splitlines()) == 1, text
    return text


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, Path]:
    txt = tmp_path / "in.txt"
    txt.write_text("a text\nanother text\n")
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text('{"text": "a text"}\n')
    labelled = {
        "one_class": ['{"text": "good", "label": "pos"}', '{"text": "fine", "label": "pos"}'],
        "mixed": ['{"text": "good", "label": 1}', '{"text": "bad", "label": "1"}', '{"text": "so so", "label": 0}'],
        "int_and_float": ['{"text": "good", "label": 1}', '{"text": "bad", "label": 0.0}'],
        "fraction": ['{"text": "good", "label": 1.0}', '{"text": "bad", "label": 0.5}'],
    }
    paths = {"txt": txt, "jsonl": jsonl, "dir": tmp_path, "out": tmp_path / "out"}
    for name, rows in labelled.items():
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text("\n".join(rows) + "\n")
    return paths


EARLY_REFUSALS = [
    (["embed", "{dir}/nope.txt", "-o", "{out}"], 2, r"nope\.txt: cannot read: No such file"),
    (["embed", "{dir}/in.docx", "-o", "{out}"], 2, r"in\.docx: cannot tell the input format from '\.docx'"),
    (["embed", "{jsonl}", "-o", "{out}", "--text-field", "body"], 2, r"in\.jsonl:1: field 'body': missing"),
    (["embed", "{txt}", "-o", "{out}", "--memory-budget", "abc"], 2, r"cannot read memory size 'abc'; use e\.g\."),
    (
        ["embed", "{txt}", "-o", "{out}", "--memory-budget", "100TB", "--device", "cpu"],
        2,
        r"--memory-budget 100TB is more than this device's memory \([\d.]+ GiB\); give at most \d+GiB",
    ),
    (["embed", "{txt}", "-o", "{out}", "--part-size", "0"], 2, r"--part-size must be a positive number.*got 0"),
    (["embed", "{txt}", "-o", "{out}", "--part-size", "-3"], 2, r"--part-size must be a positive number.*got -3"),
    (["classify", "{txt}", "-o", "{out}", "--labels", "a,b", "--part-size", "0"], 2, r"--part-size must be"),
    (["embed", "{txt}", "-o", "{out}", "--max-length", "2"], 2, r"--max-length must be at least 3 tokens .* got 2"),
    (["embed", "{txt}", "-o", "{out}", "--stride", "-1"], 2, r"--stride must be 0 or more .* got -1"),
    (["embed", "{txt}", "-o", "{txt}"], 2, r"in\.txt: is a file; -o names the directory"),
    (["classify", "{txt}", "-o", "{txt}", "--labels", "a,b"], 2, r"in\.txt: is a file; -o names the directory"),
    (["embed", "{txt}", "-o", "{txt}/sub"], 2, r"sub: cannot be created, \S+in\.txt is a file"),
    (
        ["embed", "{txt}", "-o", "{out}", "--model", "models/typo/x"],
        3,
        r"model 'models/typo/x': no such directory, and not a Hugging Face hub id",
    ),
    (["embed", "{txt}", "-o", "{out}", "--model", "{dir}"], 3, r"has no config\.json; a model directory holds"),
    (
        ["train", "{one_class}", "-o", "{out}"],
        2,
        r"one_class\.jsonl: field 'label': only 'pos': a classifier needs at least two classes",
    ),
    (
        ["train", "{mixed}", "-o", "{out}"],
        2,
        r"mixed\.jsonl:2: field 'label': label '1' is a string but line 1 has an integer",
    ),
    (
        ["train", "{int_and_float}", "-o", "{out}"],
        2,
        r"int_and_float\.jsonl:2: field 'label': label 0\.0 is a float but line 1 has an integer",
    ),
    (["train", "{fraction}", "-o", "{out}"], 2, r"fraction\.jsonl:2: field 'label': label 0\.5 is a fractional number"),
    (["train", "{txt}", "-o", "{out}"], 2, r"in\.txt: field 'label': plain-text input has one text per line"),
    (["plan", "--memory-budget", "1000TB", "--device", "cpu"], 2, r"--memory-budget 1000TB is more than"),
]


@pytest.mark.parametrize(
    ("argv", "code", "expected"),
    EARLY_REFUSALS,
    ids=lambda value: " ".join(value[:1] + value[3:]) if isinstance(value, list) else None,
)
@pytest.mark.slow
def test_refused_in_one_line_before_torch_loads_and_nothing_written(inputs, argv, code, expected):
    before = inputs["txt"].read_bytes()
    result = _cli(*[a.format(**inputs) for a in argv])
    message = _one_line(result.stderr)
    assert result.returncode == code, message
    assert re.search(expected, message), message
    assert result.stdout.decode().strip() == "False", "torch was imported: the error came after loading started"
    assert not inputs["out"].exists()
    assert inputs["txt"].read_bytes() == before  # -o naming the input file leaves it alone


def test_max_length_range_message_is_true(tiny_model_dir, inputs, capsys):
    base = ["embed", str(inputs["txt"]), "--model", tiny_model_dir, "--dtype", "fp32"]
    assert main([*base, "-o", str(inputs["out"]), "--max-length", "1000"]) == 2
    message = capsys.readouterr().err
    low, high = map(int, re.search(r"--max-length must be between (\d+) and (\d+) for this model", message).groups())
    assert (low, high) == (3, 128)  # [CLS] + one token + [SEP]; the tiny model's 128 positions
    assert not inputs["out"].exists()
    assert main([*base, "-o", str(inputs["dir"] / "shortest"), "--max-length", str(low)]) == 0
    assert main([*base, "-o", str(inputs["dir"] / "longest"), "--max-length", str(high)]) == 0


@pytest.mark.slow
def test_an_input_error_in_the_first_part_leaves_no_output_and_the_fixed_command_runs(tiny_model_dir, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "ok"}\n{"text": "fine"}\n{"text": broken\n')
    argv = ["embed", str(src), "-o", str(tmp_path / "out"), "--model", tiny_model_dir]
    result = _cli(*argv)
    assert result.returncode == 2 and "in.jsonl:3: malformed JSON" in _one_line(result.stderr)
    assert not (tmp_path / "out").exists()
    src.write_text('{"text": "ok"}\n{"text": "fine"}\n{"text": "mended"}\n')
    assert main(argv) == 0  # no "already holds memfit output; pass --resume"
    assert memfit.read(tmp_path / "out").ids == [0, 1, 2]


@pytest.mark.slow
def test_a_hub_id_typo_without_network_says_so(tmp_path, inputs):
    result = _cli(
        "embed",
        str(inputs["txt"]),
        "-o",
        str(inputs["out"]),
        "--model",
        "minilm-typo",
        env_extra={"HF_HUB_OFFLINE": "1"},
    )
    message = _one_line(result.stderr)
    assert result.returncode == 3
    assert "'minilm-typo': no such directory, and no network to look it up on the Hugging Face hub" in message
    assert not inputs["out"].exists()


@pytest.mark.slow
def test_loading_a_classifier_for_embedding_prints_no_load_report(tiny_nli_dir, inputs):
    result = _cli("embed", str(inputs["txt"]), "-o", str(inputs["out"]), "--model", tiny_nli_dir)
    assert result.returncode == 0, result.stderr.decode()
    err = result.stderr.decode()
    assert "\x1b[" not in err and "LOAD REPORT" not in err and "UNEXPECTED" not in err, err
    assert all(line.startswith("memfit: ") for line in err.strip().splitlines()), err


# ``python -m memfit ARGS`` that stops inside main() when it starts importing the tokenizer's library (every run
# does while it starts, on a cached graph, which needs no torch, or not; long before any output exists): it prints a
# readiness line on stdout and sleeps there, so the test's SIGINT lands at that point on any machine load, as a
# Ctrl-C during start-up would.
_PAUSE_AT_TOKENIZERS_IMPORT = """
import importlib.abc, runpy, sys, time

class PauseAtTokenizers(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "tokenizers":
            sys.meta_path.remove(self)
            print("importing tokenizers", flush=True)
            time.sleep(120)
        return None

sys.meta_path.insert(0, PauseAtTokenizers())
sys.argv = ["memfit", *sys.argv[1:]]
runpy.run_module("memfit", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
def test_ctrl_c_during_start_up_is_one_line_and_claims_no_output(tiny_model_dir, inputs):
    args = ["embed", str(inputs["txt"]), "-o", str(inputs["out"]), "--model", tiny_model_dir]
    proc = subprocess.Popen(
        [sys.executable, "-c", _PAUSE_AT_TOKENIZERS_IMPORT, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout.readline() == b"importing tokenizers\n"  # blocks until the child is there
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    message = _one_line(stderr)
    assert proc.returncode == 130, message
    assert message == "memfit: interrupted; nothing was written"
    assert not inputs["out"].exists()


def test_ctrl_c_mid_run_says_how_many_rows_are_kept(tiny_model_dir, tmp_path, monkeypatch, capsys):
    src = tmp_path / "in.txt"
    src.write_text("".join(f"text {i}\n" for i in range(40)))

    def interrupted_at_20(*args, **kwargs):
        for record in source_records(*args, **kwargs):
            if record.row == 20:
                raise KeyboardInterrupt
            yield record

    monkeypatch.setattr(runner_module, "source_records", interrupted_at_20)
    out = tmp_path / "out"
    assert main(["embed", str(src), "-o", str(out), "--model", tiny_model_dir, "--part-size", "6"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"memfit: interrupted; {out} holds the first 18 rows, complete; run the same command with --resume to continue"
    )
    assert memfit.read(out).ids == list(range(18))


def test_one_label_in_embedding_mode_is_refused(tiny_model_dir, inputs, capsys):
    base = ["classify", str(inputs["txt"]), "--model", tiny_model_dir, "--labels", "sports"]
    assert main([*base, "-o", str(inputs["out"])]) == 2
    message = capsys.readouterr().err.strip()
    assert "one label ('sports') in embedding mode would score every text 1.0" in message
    assert "--multi-label" in message and len(message.splitlines()) == 1
    assert not inputs["out"].exists()
    # scored on its own (a sigmoid around the threshold), one label means something
    assert main([*base, "-o", str(inputs["dir"] / "multi"), "--multi-label"]) == 0


def test_training_api_refuses_degenerate_labels_before_anything_is_written(tiny_model_dir, inputs):
    with pytest.raises(memfit.InputError, match=r"only 'pos': a classifier needs at least two classes"):
        memfit.train(inputs["one_class"], inputs["out"], tiny_model_dir)
    with pytest.raises(memfit.InputError, match=r"mixed\.jsonl:2: field 'label'"):
        memfit.train(inputs["mixed"], inputs["out"], tiny_model_dir)
    assert not inputs["out"].exists()


def test_plan_names_the_baseline_when_it_alone_is_over_the_budget(tiny_model_dir, capsys):
    assert main(["plan", "--model", tiny_model_dir, "--memory-budget", "100MB", "--device", "cpu"]) == 4
    captured = capsys.readouterr()
    message = captured.err.strip()
    baseline = re.search(r"baseline\s+([\d,.]+) MiB held", captured.out).group(1)
    assert f"the process holds {baseline} MiB before the first batch" in message, message
    assert "more than the memory budget of 95.4 MiB" in message and "window" not in message
    assert f"fits: NO: the process holds {baseline} MiB" in captured.out
