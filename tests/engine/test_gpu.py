"""The CUDA path on a real GPU (issue 37): skipped without one, run by ``scripts/gpu-check.sh`` on a lent GPU.

Each test checks the GPU path against an independent reference: sentence-transformers on the same device for the
vectors, a clean run for out-of-memory recovery, the CUDA caching allocator's own statistics (read in a fresh
process, so no other test's tensors count) for the budget.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import memfit
from memfit.engine import batches
from memfit.memory.sizes import parse_size
from conftest import write_jsonl
from reference_outputs import row_cosines

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

SRC = str(Path(__file__).resolve().parents[2] / "src")


def news_texts(n: int) -> list[str]:
    """``n`` real news documents (the Lee background corpus, 300 documents of 100-700 words), cycled."""
    from gensim.test.utils import datapath

    lines = open(datapath("lee_background.cor"), "rb").read().decode("latin-1").splitlines()
    docs = [" ".join(line.split()) for line in lines if line.strip()]
    return [docs[i % len(docs)] for i in range(n)]


def run_isolated(code: str, *argv: str, timeout: float = 300) -> dict:
    """Run ``code`` with ``argv`` in a fresh Python process (its own CUDA context and allocator) and return the JSON
    it prints last, so no tensor another test left on the GPU counts in its figures."""
    done = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=timeout, env=_child_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child_env() -> dict:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    return env


def test_cuda_fp32_vectors_equal_sentence_transformers_on_the_same_gpu(minilm_dir):
    from sentence_transformers import SentenceTransformer

    texts = news_texts(64)
    reference = SentenceTransformer(minilm_dir, device="cuda").encode(texts, batch_size=16)
    enc = memfit.Encoder(minilm_dir, device="cuda", dtype="fp32")
    ours = enc.embed(texts, long="truncate")  # sentence-transformers truncates at the same max_seq_length
    assert ours.shape == reference.shape
    assert row_cosines(ours, reference).min() >= 0.99999


@pytest.mark.parametrize("taken_by", ["another process", "the budget"])
def test_a_real_cuda_out_of_memory_mid_run_is_recovered_by_splitting(minilm_dir, taken_by, monkeypatch, caplog):
    """Mid-run, a forced allocation leaves the next batches 64 MiB: of the whole device (what another process
    taking the GPU's memory does: the driver refuses) or of the budget (the caching allocator's limit refuses)."""
    texts = news_texts(800)  # ~200k tokens at 256 a text: several batches under 1 GiB
    budget = parse_size("1GiB")
    clean = memfit.Encoder(minilm_dir, device="cuda", dtype="fp32", memory_budget=budget).embed(texts, long="truncate")
    torch.cuda.empty_cache()

    enc = memfit.Encoder(minilm_dir, device="cuda", dtype="fp32", memory_budget=budget)
    ballast: list[torch.Tensor] = []
    sizes: list[int] = []
    real_forward = batches.TorchEngine.forward

    def forward_then_fill_the_device(self, windows):
        sizes.append(len(windows))
        if len(sizes) == 2:
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info()
            if taken_by == "another process":
                torch.cuda.set_per_process_memory_fraction(1.0)  # only the driver stands in the way
                room = free
            else:
                room = min(free, budget - torch.cuda.memory_reserved())
            ballast.append(torch.empty(room - 64 * 2**20, dtype=torch.uint8, device="cuda"))
        return real_forward(self, windows)

    monkeypatch.setattr(batches.TorchEngine, "forward", forward_then_fill_the_device)
    try:
        with caplog.at_level(logging.WARNING, logger="memfit"):
            recovered = enc.embed(texts, long="truncate")
    finally:
        ballast.clear()
        torch.cuda.empty_cache()
    assert len(sizes) > 2 and sizes[0] > 1, f"batches {sizes}: too few to fail one mid-run and split it"
    assert enc.budget.oom_events >= 1 and "out of memory" in caplog.text
    assert max(sizes[2:]) < sizes[1], sizes  # the failed batch ran again in smaller pieces
    # nothing lost, nothing duplicated, nothing moved: each row is its own text's vector from the clean run
    assert recovered.shape == clean.shape
    assert row_cosines(recovered, clean).min() >= 0.99999
    assert np.abs(recovered - clean).max() < 1e-4


BUDGET_RUN = r"""
import json, sys, threading, time
import torch, memfit
memfit.configure_process("cuda")
texts, budget = json.load(open(sys.argv[1])), sys.argv[2]
torch.cuda.init()
free0, total = torch.cuda.mem_get_info()
enc = memfit.Encoder(sys.argv[3], device="cuda", memory_budget=budget)
enc.embed(texts, long="chunk")
print(json.dumps({
    "allocated": torch.cuda.max_memory_allocated(),
    "reserved": torch.cuda.max_memory_reserved(),
    "oom_events": enc.budget.oom_events,
    "batch_tokens": enc.memory.batch_budget.max_batch_tokens,
}))
"""


@pytest.mark.parametrize("budget", ["1GiB", "3GiB"])
def test_the_cuda_budget_holds_in_allocated_and_reserved_memory(minilm_dir, budget, tmp_path):
    texts = news_texts(400)
    long_docs = [" ".join(texts[i : i + 8]) for i in range(0, 64, 8)]  # ~3,000-token documents, chunked
    (tmp_path / "texts.json").write_text(json.dumps(texts + long_docs))
    seen = run_isolated(BUDGET_RUN, str(tmp_path / "texts.json"), budget, minilm_dir)
    limit = parse_size(budget)
    assert seen["allocated"] <= limit, seen
    # the caching allocator's reserve is what the device gives up: it must fit too
    assert seen["reserved"] <= limit, seen


TRAIN_RUN = r"""
import json, sys
import torch, memfit
memfit.configure_process("cuda", inference=False)
metrics = memfit.train(sys.argv[1], sys.argv[2], model=sys.argv[3], device="cuda", epochs=1, batch_size=32,
                       max_length=128, memory_budget=sys.argv[4])
print(json.dumps({"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved(),
                  "peak_memory_bytes": metrics["peak_memory_bytes"], "plan": metrics["plan"],
                  "epochs": metrics["epochs"]}))
"""


def test_training_one_epoch_stays_under_a_cuda_budget(minilm_dir, tmp_path):
    from gensim.test.utils import datapath

    rows = []
    for line in open(datapath("pang_lee_polarity.cor"), encoding="latin-1"):
        if line.strip():
            tag, text = line.split(" ", 1)
            rows.append({"text": text.strip(), "label": tag.removeprefix("__label__")})
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    budget = "1GiB"
    seen = run_isolated(TRAIN_RUN, data, str(tmp_path / "model"), minilm_dir, budget)
    assert len(seen["epochs"]) == 1 and np.isfinite(seen["epochs"][0]["train_loss"]), seen
    assert seen["allocated"] <= parse_size(budget) and seen["reserved"] <= parse_size(budget), seen
    # the saved classifier loads with plain transformers and gives finite logits on the GPU
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "model").cuda().eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    with torch.inference_mode():
        logits = model(**tok([r["text"] for r in rows[:4]], padding=True, return_tensors="pt").to("cuda")).logits
    assert torch.isfinite(logits).all() and logits.shape == (4, 2)


def test_the_gpu_path_does_not_import_openvino(minilm_dir):
    code = (
        "import json, sys, memfit\n"
        "memfit.configure_process('cuda')\n"
        f"memfit.Encoder({minilm_dir!r}, device='cuda').embed(['a short text', 'another one'])\n"
        "print(json.dumps({'openvino': 'openvino' in sys.modules}))\n"
    )
    assert run_isolated(code) == {"openvino": False}


def test_the_streamed_path_on_cuda_equals_the_resident_path(minilm_dir):
    """--offload on a GPU: the layers stream from pinned host memory, where they stay once read (the host has room for
    MiniLM's); the vectors are the resident path's, and again from the kept layers."""
    from memfit.engine.runtime import load_runtime

    texts = news_texts(64)
    resident = load_runtime(minilm_dir, device="cuda", dtype="fp32", offload="never")
    expected = memfit.Encoder(runtime=resident).embed(texts, long="chunk")
    streamed = load_runtime(minilm_dir, device="cuda", dtype="fp32", offload="always")
    assert streamed.backend.name == "streamed"
    got = memfit.Encoder(runtime=streamed).embed(texts, long="chunk")
    assert row_cosines(got, expected).min() >= 0.99999
    kept = streamed.backend.host_layers
    assert kept is not None and sorted(kept) == list(range(len(streamed.backend.skeleton.layer_keys)))
    assert all(t.is_pinned() for layer in kept.values() for t in layer.values())
    again = memfit.Encoder(runtime=streamed).embed(texts, long="chunk")
    assert row_cosines(again, expected).min() >= 0.99999
