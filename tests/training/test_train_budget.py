"""``memfit train`` keeps the whole process under ``--memory-budget`` in every phase: the probe pass,
micro-batched steps, the optimizer step, evaluation, and checkpoint saving (issue 12).

The CLI runs in a fresh process inside ``benchmarks/peak_cli.py``, which reads the kernel's ``VmHWM`` at
the end and just before each of memfit's own resets of it, so the figure covers the whole run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gensim.test.utils import datapath

from memfit.memory.model import parse_size
from conftest import write_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

PEAK_CLI = Path(__file__).resolve().parents[2] / "benchmarks" / "peak_cli.py"


def _polarity_rows(n: int, offset: int) -> list[dict]:
    """``n`` real movie-review sentences with their polarity, alternating classes, from ``offset``."""
    rows = {"__label__pos": [], "__label__neg": []}
    for line in open(datapath("pang_lee_polarity.cor"), encoding="latin-1"):
        if line.strip():
            tag, text = line.split(" ", 1)
            rows[tag].append({"text": text.strip(), "label": tag.removeprefix("__label__")})
    half = n // 2
    return [
        row
        for pair in zip(rows["__label__pos"][offset : offset + half], rows["__label__neg"][offset : offset + half])
        for row in pair
    ]


def test_a_train_run_forcing_accumulation_stays_under_the_budget_in_every_phase(minilm_dir, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", _polarity_rows(48, 0))
    dev = write_jsonl(tmp_path / "dev.jsonl", _polarity_rows(24, 40))
    # MiniLM's runtime + weights (~0.45 GiB) + gradients/AdamW/scratch (~0.34 GiB) leave room for a few
    # 64-token examples, not the batch of 16: the run must accumulate micro-batches
    budget = "950MiB"
    report = tmp_path / "peak.json"
    done = subprocess.run(
        [
            sys.executable,
            str(PEAK_CLI),
            str(report),
            "train",
            train,
            "-o",
            str(tmp_path / "out"),
            "--model",
            minilm_dir,
            "--eval",
            dev,
            "--epochs",
            "1",
            "--batch-size",
            "16",
            "--max-length",
            "64",
            "--dtype",
            "fp32",
            "--checkpoint-every",
            "1",
            "--memory-budget",
            budget,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["plan"]["micro_batch_at_longest"] < 16  # accumulation forced
    assert metrics["best_epoch"] == 1  # evaluation ran and the best model was saved
    peak = json.loads(report.read_text())["peak_bytes"]
    limit = parse_size(budget, total_bytes=0)
    assert peak <= limit, f"peak {peak / 2**20:.0f} MiB over the {limit / 2**20:.0f} MiB budget"
