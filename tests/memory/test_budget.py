"""The memory budget holds for every job and output mode: the whole process's peak resident set, read
from the kernel by the test itself, stays under ``--memory-budget`` on real long texts; what cannot fit
is refused up front with exit code 4.

Each run is the CLI in a fresh process inside ``benchmarks/peak_cli.py``, which reads ``VmHWM`` from
``/proc/self/status`` at the end and just before each of memfit's own resets of it (memfit resets the
high-water mark to measure its calibration probes), so the figure covers the whole run, model loading
included.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gensim.test.utils import datapath
from transformers import AutoTokenizer

import memfit

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

GiB = 2**30

PEAK_CLI = Path(__file__).resolve().parents[2] / "benchmarks" / "peak_cli.py"


def _real_text() -> str:
    with open(datapath("lee_background.cor"), encoding="utf-8") as fh:
        return " ".join(fh.read().split())


def _long_texts(n: int, chars: int) -> list[str]:
    """``n`` spans of real news text of about ``chars`` characters, each from another offset."""
    text = _real_text()
    step = (len(text) - chars) // n
    return [text[i * step : i * step + chars] for i in range(n)]


def _write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _run_with_peak(tmp_path: Path, *argv: str) -> tuple[subprocess.CompletedProcess, int]:
    report = tmp_path / "peak.json"
    result = subprocess.run([sys.executable, str(PEAK_CLI), str(report), *argv], capture_output=True, timeout=600)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    return result, json.loads(report.read_text())["peak_bytes"]


def test_embed_tokens_of_a_huge_document_stay_under_the_budget(minilm_dir, tmp_path):
    # ~300k characters of real text in one document: ~65k tokens x 384 floats of token vectors (100 MB),
    # which memfit held several times over in memory before streaming them
    text = (_real_text() + " ") * 2
    source = _write_jsonl(tmp_path / "doc.jsonl", [text[:300_000]])
    # token vectors held even twice (+200 MB) fail here; the drift right after an install is the guard's
    # to follow (tests/cli/test_first_run.py runs this job on freshly installed libraries)
    budget = 0.75 * GiB
    _, peak = _run_with_peak(
        tmp_path,
        "embed",
        str(source),
        "--model",
        minilm_dir,
        "--dtype",
        "fp32",
        "--tokens",
        "--backend",
        "torch",
        "--memory-budget",
        str(int(budget)),
        "-o",
        str(tmp_path / "out"),
    )
    assert peak <= budget, f"peak {peak / 2**20:.0f} MiB over the {budget / 2**20:.0f} MiB budget"
    out = memfit.read(tmp_path / "out")
    reference = AutoTokenizer.from_pretrained(minilm_dir)(text[:300_000])["input_ids"]  # transformers' own tokenizer
    assert out.token_ids[0].tolist() == reference  # every token exactly once, in order
    assert out.token_embeddings[0].shape == (len(reference), 384)
    assert np.isfinite(out.token_embeddings[0]).all()


@pytest.mark.parametrize(
    "job",
    [
        ["embed"],
        ["embed", "--tokens", "--backend", "torch"],
        ["embed", "--tokens", "--backend", "openvino"],
        ["embed", "--tokens", "--backend", "onnxruntime"],
        ["classify", "--labels", "politics,sports,weather", "--long", "chunk"],
    ],
)
def test_jobs_on_long_texts_stay_under_the_budget(job, minilm_dir, tmp_path):
    source = _write_jsonl(tmp_path / "in.jsonl", _long_texts(24, 6_000))
    budget = 0.75 * GiB
    _, peak = _run_with_peak(
        tmp_path,
        *job[:1],
        str(source),
        "--model",
        minilm_dir,
        "--dtype",
        "fp32",
        "--max-length",
        "512",
        "--memory-budget",
        str(int(budget)),
        "-o",
        str(tmp_path / "out"),
        *job[1:],
    )
    assert peak <= budget, f"{job}: peak {peak / 2**20:.0f} MiB over the {budget / 2**20:.0f} MiB budget"


def test_nli_classify_on_long_texts_stays_under_the_budget(tiny_nli_dir, tmp_path):
    source = _write_jsonl(tmp_path / "in.jsonl", _long_texts(30, 8_000))
    budget = 0.6 * GiB  # the process holds ~0.5 GiB of runtime (torch, transformers) before any model
    _, peak = _run_with_peak(
        tmp_path,
        "classify",
        str(source),
        "--model",
        tiny_nli_dir,
        "--mode",
        "nli",
        "--labels",
        "politics,sports,weather,science",
        "--long",
        "chunk",
        "--dtype",
        "fp32",
        "--memory-budget",
        str(int(budget)),
        "-o",
        str(tmp_path / "out"),
    )
    assert peak <= budget, f"peak {peak / 2**20:.0f} MiB over the {budget / 2**20:.0f} MiB budget"


def test_rerank_of_long_documents_stays_under_the_budget(tiny_cross_encoder_dirs, tmp_path):
    """Every window repeats the query, so a long document's pairs hold more tokens than the document."""
    source = _write_jsonl(tmp_path / "in.jsonl", _long_texts(30, 8_000))
    budget = 0.7 * GiB  # the runtime's 0.5-0.55 GiB, then long pairs (query + window) in batches
    query = "what did the government say about the fires near sydney and the people who lost their homes"
    _, peak = _run_with_peak(
        tmp_path,
        "rerank",
        str(source),
        "--query",
        query,
        "--model",
        tiny_cross_encoder_dirs["one_logit"],
        "--dtype",
        "fp32",
        "--memory-budget",
        str(int(budget)),
        "-o",
        str(tmp_path / "out"),
    )
    assert peak <= budget, f"peak {peak / 2**20:.0f} MiB over the {budget / 2**20:.0f} MiB budget"
    assert memfit_rows(tmp_path / "out") == 30


def memfit_rows(out: Path) -> int:
    return json.loads((out / "manifest.json").read_text())["rows"]


def test_a_budget_below_the_model_is_refused_up_front_with_exit_4(minilm_dir, tmp_path):
    source = _write_jsonl(tmp_path / "in.jsonl", _long_texts(3, 1_000))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "memfit",
            "embed",
            str(source),
            "--model",
            minilm_dir,
            "--memory-budget",
            # below what the process holds with the model loaded on any backend: a run on MiniLM's cached graph,
            # which imports no torch, completed within 300 MB
            "150MB",
            "-o",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        timeout=300,
    )
    assert result.returncode == 4
    message = result.stderr.decode().strip().splitlines()[-1]
    assert "memory budget" in message and "raise --memory-budget" in message
    assert not (tmp_path / "out" / "part-00000.parquet").exists()


@pytest.mark.parametrize("backend", ["torch", "openvino"])
def test_a_resident_refusal_names_a_budget_under_which_the_same_run_completes(backend, minilm_dir, tmp_path):
    """The resident path (``--offload never``) refuses a budget below what it holds with exit 4, naming the least
    budget that holds one full window beside it; the same command at that budget completes, every text written, its
    whole peak within it."""
    source = _write_jsonl(tmp_path / "in.jsonl", _long_texts(12, 1_500))
    argv = ["embed", str(source), "--model", minilm_dir, "--offload", "never", "--backend", backend]
    refused = subprocess.run(
        # below what either backend holds (OpenVINO's cached graph runs without torch in under 300 MiB)
        [sys.executable, "-m", "memfit", *argv, "--memory-budget", "150MiB", "-o", str(tmp_path / "no")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode == 4, refused.stderr[-2000:]
    named = re.search(r"raise --memory-budget to ([\d,]+) MiB, which works", refused.stderr)
    assert named is not None, refused.stderr[-2000:]
    works_mib = int(named.group(1).replace(",", ""))
    assert works_mib > 150
    _, peak = _run_with_peak(tmp_path, *argv, "--memory-budget", f"{works_mib}MiB", "-o", str(tmp_path / "yes"))
    assert peak <= works_mib * 2**20, f"peak {peak / 2**20:.0f} MiB over the {works_mib} MiB it named"
    assert memfit_rows(tmp_path / "yes") == 12


def test_a_long_window_is_planned_with_its_length_squared_term_and_the_budget_holds(tmp_path):
    """A ModernBERT with an 8,192-token window on PyTorch: its sliding-window layers hold their scores (16 B a cell in
    fp32), which 512-token probes barely show. Fitted from them alone, a window was planned at 30 MiB, and the first
    one took the process 330 MiB past a 1 GiB budget before the guard refused the next. Now the whole run stays
    within the budget, or is refused naming one under which it completes."""
    from conftest import tiny_modernbert

    model = tiny_modernbert(tmp_path / "model", positions=8192)
    source = _write_jsonl(tmp_path / "in.jsonl", _long_texts(2, 30_000))  # ~6,500 tokens each: a window apiece
    argv = ["embed", str(source), "--model", model, "--backend", "torch", "--dtype", "fp32"]
    report = tmp_path / "peak.json"

    def run(budget_mib: int, out: str) -> tuple[int, int, str]:
        done = subprocess.run(
            [sys.executable, str(PEAK_CLI), str(report), *argv, "--memory-budget", f"{budget_mib}MiB", "-o", out],
            capture_output=True,
            text=True,
            timeout=600,
        )
        result = json.loads(report.read_text())
        return result["code"], result["peak_bytes"], done.stderr

    code, peak, stderr = run(1024, str(tmp_path / "a"))
    assert peak <= GiB, f"peak {peak / 2**20:.0f} MiB over the 1,024 MiB budget: {stderr[-1500:]}"
    if code == 4:
        named = re.search(r"--memory-budget ([\d,]+)MiB would work|raise --memory-budget to ([\d,]+) MiB", stderr)
        assert named is not None, stderr[-2000:]
        works_mib = int((named.group(1) or named.group(2)).replace(",", ""))
        code, peak, stderr = run(works_mib, str(tmp_path / "b"))
        assert peak <= works_mib * 2**20, f"peak {peak / 2**20:.0f} MiB over the {works_mib} MiB it named"
        assert code == 0 and memfit_rows(tmp_path / "b") == 2, stderr[-2000:]
    else:
        assert code == 0 and memfit_rows(tmp_path / "a") == 2, stderr[-2000:]
