"""The trainer under failure: an out-of-memory error mid-step, ``kill -9`` mid-epoch, a tight memory budget.

References: a run of the same training without the failure (same seed, fp32), and the peak resident set
of the whole ``memfit train`` process against the budget it was given.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import memfit.training.plan as plan_module
from memfit.memory.model import parse_size
from memfit.engine.pooled_classifier import PooledClassifier
from memfit.training import train
from conftest import FAKE_BASELINE_BYTES, SENTIMENT_WORDS, recorded_training_rows, sentiment_rows, write_jsonl


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """All saved weights of a pooled classifier: the encoder's and the head's."""
    weights = load_file(str(model_dir / "model.safetensors"))
    weights.update({f"head.{k}": v for k, v in load_file(str(model_dir / "2_Dense" / "model.safetensors")).items()})
    return weights


def _assert_same_weights(left: Path, right: Path, atol: float) -> None:
    a, b = _weights(left), _weights(right)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=name)


@pytest.fixture
def dropout_st_dir(tiny_st_dirs) -> str:
    """The tiny mean-pooling model with hidden dropout on: a redone step must draw the same masks (they are
    keyed by example, not by micro-batch) to compute exactly the same gradient."""
    return tiny_st_dirs["mean"]


def test_out_of_memory_mid_step_is_redone_with_smaller_micro_batches(
    dropout_st_dir, tmp_path, fixed_baseline, monkeypatch
):
    rows = sentiment_rows(24, seed=2)
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    settings = {"epochs": 2, "batch_size": 12, "dtype": "fp32", "lr": 1e-3, "eval_data": data}
    probe = train(data, tmp_path / "probe", dropout_st_dir, epochs=1, batch_size=12, dtype="fp32")
    plan = probe["plan"]
    # room for about four of the longest examples per micro-batch: each step runs three or more of them
    activations = plan["bytes_per_token"] * plan["longest_padded"] * 4.5
    budget = int(FAKE_BASELINE_BYTES + plan["state_bytes"] + activations / (1 - plan_module.CPU_TRAINING_MARGIN))
    with recorded_training_rows(monkeypatch) as rows:
        clean = train(data, tmp_path / "clean", dropout_st_dir, memory_budget=budget, **settings)
    # seen by the model, not read from the plan: every step of 12 was cut, into micro-batches of more than the
    # one or two sequences a calibration probe runs (which the failing forward below tells apart by that)
    assert clean["oom_events"] == 0 and 2 < max(rows) < 12

    forward = PooledClassifier.forward
    calls = {"training": 0, "probe": 0, "eval": 0, "raised": 0}

    def failing_forward(self, input_ids, attention_mask, **inputs):
        """Raise what the CPU allocator raises: once in the head's linear-probe pass over the training data,
        once on the second micro-batch of the first step (its first micro-batch's gradients are already
        accumulated) and once in the first evaluation batch."""
        if torch.is_inference_mode_enabled():
            phase = "eval" if calls["training"] else "probe"
            calls[phase] += 1
            if calls[phase] == 1:
                calls["raised"] += 1
                raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 1 bytes.")
        elif input_ids.shape[0] > 2:  # calibration forwards run 1 or 2 sequences
            calls["training"] += 1
            if calls["training"] == 2:
                calls["raised"] += 1
                raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] out of memory: tried to allocate 1 bytes")
        return forward(self, input_ids, attention_mask, **inputs)

    monkeypatch.setattr(PooledClassifier, "forward", failing_forward)
    failed = train(data, tmp_path / "failed", dropout_st_dir, memory_budget=budget, **settings)
    # every injected error was survived; a batch of one that fails is retried alone without counting
    assert calls["raised"] == 3 and failed["oom_events"] >= 2
    assert [e["train_loss"] for e in failed["epochs"]] == pytest.approx(
        [e["train_loss"] for e in clean["epochs"]], rel=1e-5
    )
    assert [e["eval_accuracy"] for e in failed["epochs"]] == [e["eval_accuracy"] for e in clean["epochs"]]
    _assert_same_weights(tmp_path / "clean", tmp_path / "failed", atol=1e-6)
    initial = load_file(str(Path(dropout_st_dir) / "model.safetensors"))
    trained = _weights(tmp_path / "failed")
    assert sum(not torch.equal(trained[k], v) for k, v in initial.items()) > 10  # the steps did move the weights


PEAK_CLI = Path(__file__).resolve().parents[2] / "benchmarks" / "peak_cli.py"


def _memfit(*args: str) -> list[str]:
    return [sys.executable, "-m", "memfit", "train", *args]


def _env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[2] / "src")
    return {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.mark.slow
def test_killed_run_resumes_from_its_last_checkpoint_to_the_same_model(tiny_st_dirs, tmp_path):
    """``kill -9`` once a mid-epoch checkpoint exists; ``--resume`` ends with the uninterrupted run's model
    (dropout on: the RNG state and the data order are restored too)."""
    data = write_jsonl(tmp_path / "train.jsonl", sentiment_rows(96, seed=3))
    common = [
        "--model",
        tiny_st_dirs["mean"],
        "--epochs",
        "2",
        "--batch-size",
        "4",
        "--dtype",
        "fp32",
        "--checkpoint-every",
        "5",
        "--eval",
        data,
    ]
    straight = subprocess.run(
        _memfit(data, "-o", str(tmp_path / "straight"), *common),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert straight.returncode == 0, straight.stderr

    out = tmp_path / "killed"
    process = subprocess.Popen(
        _memfit(data, "-o", str(out), *common), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 300
    while not any(p.parent.name != "step-24" for p in (out / "checkpoints").glob("step-*/trainer_state.pt")):
        assert process.poll() is None, "the run ended before a checkpoint was seen"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL
    assert not (out / "metrics.json").exists()

    resumed = subprocess.run(
        _memfit(data, "-o", str(out), *common, "--resume"), env=_env(), capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming at epoch" in resumed.stderr
    _assert_same_weights(tmp_path / "straight", out, atol=1e-6)
    metrics = [json.loads((d / "metrics.json").read_text()) for d in (tmp_path / "straight", out)]
    assert [e["eval_accuracy"] for e in metrics[0]["epochs"]] == [e["eval_accuracy"] for e in metrics[1]["epochs"]]
    assert not (out / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the peak is read from /proc")
def test_training_long_texts_keeps_the_whole_process_under_a_small_budget(tmp_path):
    """A 4-layer, 512-position model on ~500-token texts, budget small enough to force accumulation; the
    process's peak resident set, read from the kernel by ``benchmarks/peak_cli.py`` over the whole run
    (model loading, checkpoints and evaluation included), stays under it."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    model_dir = tmp_path / "model"
    words = sorted({w for ws in SENTIMENT_WORDS.values() for w in ws} | {"movie"})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    torch.manual_seed(0)
    BertModel(
        BertConfig(
            vocab_size=len(vocab),
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=1024,
            max_position_embeddings=512,
        )
    ).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = write_jsonl(tmp_path / "train.jsonl", sentiment_rows(16, seed=4, longest=600))
    budget = "900MiB"
    report = tmp_path / "peak.json"
    done = subprocess.run(
        [
            sys.executable,
            str(PEAK_CLI),
            str(report),
            "train",
            data,
            "-o",
            str(tmp_path / "out"),
            "--model",
            str(model_dir),
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--max-length",
            "512",
            "--dtype",
            "fp32",
            "--memory-budget",
            budget,
            "--eval",
            data,
            "--checkpoint-every",
            "1",
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["plan"]["longest_padded"] == 512
    assert metrics["plan"]["micro_batch_at_longest"] < 8  # the budget forced accumulation
    peak = json.loads(report.read_text())["peak_bytes"]  # the kernel's figure, not memfit's own
    limit = parse_size(budget, total_bytes=0)
    assert peak <= limit, f"peak {peak / 2**20:.0f} MiB over the {limit / 2**20:.0f} MiB budget"
    assert np.isfinite(metrics["epochs"][0]["train_loss"])
