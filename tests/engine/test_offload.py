"""Layer-streamed execution (``--offload``, ``engine/streamed.py``) against the resident path.

The reference is the resident PyTorch path on the same weights in the same precision (fp32): pooled vectors,
token rows and chunked long texts of the bundled all-MiniLM-L6-v2 (real weights), and the logits of an NLI
classifier and a cross-encoder (random weights: no such model is bundled) must agree to cos >= 0.99999. Then
the promise: under a budget the resident path refuses, ``--offload auto`` streams and the whole process's
peak (read by ``benchmarks/peak_cli.py``) stays within it; a budget too small even for streaming is refused
with exit 4 naming a budget that then works; a streamed run killed with ``kill -9`` resumes to the output of
an uninterrupted one.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gensim.test.utils import datapath

import memfit
from conftest import kill_after_first_part
from memfit.engine.runtime import load_runtime
from memfit.engine.streamed_floor import (
    FLOOR_TOLERANCE_BYTES,
    StreamedFloor,
    floor_key,
    recall_floor,
    refusal_below_floor,
    remember_floor,
)
from memfit.jobs.classify import Classifier
from memfit.jobs.encoder import Encoder
from memfit.jobs.rerank import Reranker
from memfit.memory.model import CPU_RESIDENT_DRIFT_BYTES
from memfit.memory.planner import BatchBudget
from reference_outputs import fp32_reference, row_cosines

PEAK_CLI = Path(__file__).resolve().parents[2] / "benchmarks" / "peak_cli.py"
MIN_COSINE = 0.99999
MiB = 2**20


def _news(n: int, shortest: int, longest: int) -> list[str]:
    """``n`` spans of real news text, from ``shortest`` to ``longest`` characters, each from another offset."""
    with open(datapath("lee_background.cor"), encoding="utf-8") as fh:
        text = " ".join(fh.read().split())
    sizes = np.linspace(shortest, longest, n).astype(int)
    return [text[i * 211 : i * 211 + int(size)] for i, size in enumerate(sizes)]


def _streamed(runtime, sub_batch_tokens: int):
    """``runtime`` with small sub-batches, so a block runs layer-major over several of them."""
    return dataclasses.replace(runtime, backend=runtime.backend.with_layer_budget(BatchBudget(sub_batch_tokens, 4096)))


@pytest.fixture(scope="module")
def minilm_runtimes(minilm_dir):
    resident = load_runtime(minilm_dir, device="cpu", dtype="fp32", backend="torch", offload="never", calibrate=False)
    streamed = load_runtime(minilm_dir, device="cpu", dtype="fp32", offload="always", calibrate=False)
    assert resident.backend.name == "torch" and streamed.backend.name == "streamed"
    return resident, streamed


NEWS_UP_TO_700_TOKENS = _news(40, 20, 3_000)  # up to ~700 tokens: several windows of 256 in chunk mode


@pytest.fixture(scope="module")
def resident_news_vectors(minilm_runtimes) -> dict[str, np.ndarray]:
    """The resident path's vectors of :data:`NEWS_UP_TO_700_TOKENS` per ``long`` mode, computed once for the
    module (each sub-batch size is compared with the same reference)."""
    resident = Encoder(runtime=minilm_runtimes[0])
    return {long: resident.embed(NEWS_UP_TO_700_TOKENS, long=long) for long in ("chunk", "truncate")}


@pytest.mark.parametrize("sub_batch_tokens", [None, 300])
@pytest.mark.parametrize("long", ["chunk", "truncate"])
def test_streamed_vectors_equal_the_resident_ones(minilm_runtimes, resident_news_vectors, sub_batch_tokens, long):
    streamed = minilm_runtimes[1]
    if sub_batch_tokens is not None:
        streamed = _streamed(streamed, sub_batch_tokens)
    expected = resident_news_vectors[long]
    got = Encoder(runtime=streamed).embed(NEWS_UP_TO_700_TOKENS, long=long)
    assert got.shape == expected.shape
    assert row_cosines(got, expected).min() >= MIN_COSINE


def _keeping_layers(runtime, block_tokens: int, keep: bool = True):
    """``runtime`` with its layers kept on the host once read (CUDA's path where the host has room; ``keep=False``:
    read for every block), in blocks of at most ``block_tokens`` run layer-major in sub-batches of 300 tokens."""
    backend = runtime.backend.with_layer_budget(BatchBudget(300, 4096))
    backend = dataclasses.replace(backend, host_layers={} if keep else None)
    memory = dataclasses.replace(runtime.memory, batch_budget=BatchBudget(block_tokens, 4096))
    return dataclasses.replace(runtime, backend=backend, memory=memory)


def test_a_streamed_run_keeping_its_layers_reads_each_from_the_file_once_for_the_resident_vectors(
    minilm_runtimes, resident_news_vectors, monkeypatch
):
    """CUDA's streamed path keeps each layer on the host once read (``streamed.keeps_layers_on_host``); here with its
    reading ahead, on the CPU: over many blocks the file gives every layer tensor exactly once, and the vectors are
    the resident path's. A CPU run keeps none: there host memory is the budget."""
    from memfit.engine import streamed as streamed_module

    _, streamed = minilm_runtimes
    assert streamed.backend.host_layers is None
    monkeypatch.setattr(streamed_module, "reads_ahead", lambda device: True)
    runtime = _keeping_layers(streamed, 2_000)
    weights = runtime.backend.weights
    reads: collections.Counter[str] = collections.Counter()
    read_into = weights._read_into
    offsets = {entry.offset: name for name, entry in weights.entries.items()}
    monkeypatch.setattr(
        weights, "_read_into", lambda buffer, offset: reads.update([offsets.get(offset)]) or read_into(buffer, offset)
    )
    blocks = []
    run = streamed_module.StreamedBackend.run
    monkeypatch.setattr(
        streamed_module.StreamedBackend, "run", lambda self, *a, **k: blocks.append(1) or run(self, *a, **k)
    )
    got = Encoder(runtime=runtime).embed(NEWS_UP_TO_700_TOKENS, long="chunk")
    assert len(blocks) > 3
    layer_tensors = {name for keys in runtime.backend.skeleton.layer_keys for name in keys.values()}
    assert {name: reads[name] for name in layer_tensors} == dict.fromkeys(layer_tensors, 1)
    assert row_cosines(got, resident_news_vectors["chunk"]).min() >= MIN_COSINE


def test_layers_kept_in_bf16_give_the_vectors_of_layers_read_for_every_block(minilm_dir, monkeypatch):
    """The kept layers converted from the file's fp32 into one buffer per layer: bit for bit what reading and
    converting them again for every block gives."""
    from memfit.engine import streamed as streamed_module

    streamed = load_runtime(minilm_dir, device="cpu", dtype="bf16", offload="always", calibrate=False)
    texts = _news(12, 50, 1_500)
    every_block = Encoder(runtime=_keeping_layers(streamed, 1_000, keep=False), quality_check=False).embed(texts)
    monkeypatch.setattr(streamed_module, "reads_ahead", lambda device: True)
    kept = Encoder(runtime=_keeping_layers(streamed, 1_000), quality_check=False).embed(texts)
    np.testing.assert_array_equal(kept, every_block)


def test_layers_are_kept_on_the_host_only_on_a_gpu_and_where_the_host_has_room_for_them_pinned(monkeypatch):
    """The pinned allocator rounds each buffer up to a power of two: 16 layers of 20 MiB hold 512 MiB there, over half
    of 1,000 MiB free, though their 320 MiB are under it."""
    from memfit.engine import streamed as streamed_module
    from memfit.memory.model import DeviceMemory

    monkeypatch.setattr(streamed_module, "device_memory", lambda device: DeviceMemory(2_000 * MiB, 1_000 * MiB, 0))
    cuda = torch.device("cuda")
    assert streamed_module.keeps_layers_on_host(cuda, [20 * MiB] * 12)  # 384 MiB pinned
    assert not streamed_module.keeps_layers_on_host(cuda, [20 * MiB] * 16)
    assert not streamed_module.keeps_layers_on_host(torch.device("cpu"), [MiB])


def test_streamed_token_rows_equal_the_resident_ones(minilm_runtimes):
    resident, streamed = minilm_runtimes
    texts = _news(12, 50, 2_500)
    expected = Encoder(runtime=resident).embed_tokens(texts)
    got = Encoder(runtime=_streamed(streamed, 300)).embed_tokens(texts)
    for mine, theirs in zip(got, expected):
        np.testing.assert_array_equal(mine.token_ids, theirs.token_ids)
        assert row_cosines(mine.embeddings, theirs.embeddings).min() >= MIN_COSINE


def test_streamed_classifier_and_cross_encoder_equal_the_resident_ones(tiny_nli_dir, tiny_cross_encoder_dirs):
    texts = _news(20, 20, 600)
    logits = {}
    for offload in ("never", "always"):
        runtime = load_runtime(
            tiny_nli_dir, device="cpu", dtype="fp32", backend="torch", task="classification", offload=offload
        )
        if offload == "always":
            runtime = _streamed(runtime, 200)
        results = Classifier(mode="nli", runtime=runtime).classify(texts, labels=["news", "sport"], long="chunk")
        logits[offload] = np.array([r.scores for r in results])
    np.testing.assert_allclose(logits["always"], logits["never"], atol=1e-5)

    pairs = [("what happened in the fires", text) for text in texts]
    scores = {}
    for offload in ("never", "always"):
        runtime = load_runtime(
            tiny_cross_encoder_dirs["one_logit"], device="cpu", dtype="fp32", backend="torch", task="classification",
            offload=offload,
        )  # fmt: skip
        scores[offload] = Reranker(None, runtime=runtime).score(pairs, raw=True)
    np.testing.assert_allclose(scores["always"], scores["never"], atol=1e-5)


@pytest.fixture(scope="module")
def tiny_mpnet_dir(tmp_path_factory) -> str:
    """A random-weight 2-layer MPNet (relative position bias in every layer) with the tiny WordPiece tokenizer."""
    from transformers import MPNetConfig, MPNetModel

    from conftest import _tokenizer, _write_vocab

    root = tmp_path_factory.mktemp("tiny-mpnet")
    tok = _tokenizer(_write_vocab(root / "vocab.txt"))
    config = MPNetConfig(
        vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=160, pad_token_id=tok.pad_token_id, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, initializer_range=0.5,
    )  # fmt: skip  # weights large enough that attention moves the vectors (at 0.02 the residual hides it)
    torch.manual_seed(2)
    with torch.no_grad():
        model = MPNetModel(config).eval()
        model.encoder.relative_attention_bias.weight.mul_(20)  # a bias that dominates the scores: a wrong one shows
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return str(root)


def test_streamed_mpnet_equals_a_plain_transformers_forward(tiny_mpnet_dir):
    """MPNet's relative position bias is computed inside its encoder, so the streamed path recomputes it for every
    (layer, sub-batch), from one row, broadcast (``engine/streamed._one_row_position_bias``): the mean-pooled
    vectors of texts of many lengths in sub-batches of several rows must be a plain forward's."""
    from transformers import AutoModel, AutoTokenizer

    texts = _news(24, 10, 400)
    tok = AutoTokenizer.from_pretrained(tiny_mpnet_dir)
    model = AutoModel.from_pretrained(tiny_mpnet_dir).eval()
    expected = []
    for text in texts:
        ids = tok(text, truncation=True, max_length=128, return_tensors="pt")
        with torch.no_grad():
            expected.append(model(**ids).last_hidden_state[0].mean(0).numpy())
    runtime = load_runtime(tiny_mpnet_dir, device="cpu", dtype="fp32", offload="always", calibrate=False)
    assert runtime.backend.name == "streamed"
    got = Encoder(runtime=_streamed(runtime, 300)).embed(texts, long="truncate", pooling="mean")
    assert row_cosines(got, np.stack(expected)).min() >= MIN_COSINE


def test_offload_asked_of_what_cannot_stream_is_refused(minilm_dir):
    with pytest.raises(memfit.ConfigError, match="int8"):
        load_runtime(minilm_dir, device="cpu", quantize="int8", offload="always", calibrate=False)
    with pytest.raises(memfit.ConfigError, match="offload"):
        load_runtime(minilm_dir, device="cpu", offload="sometimes", calibrate=False)


def test_a_hub_model_in_the_hugging_face_cache_streams_by_its_id(tiny_model_dir, tmp_path):
    """A model bigger than the budget is named by its hub id as often as by a folder, and ``--offload`` refused every
    hub id ("a local model.safetensors is needed") though its weights were in the Hugging Face cache. A tiny BERT laid
    out as the hub's cache lays out a download (``models--ORG--NAME/snapshots/REVISION``, ``refs/main``), run in a child
    without network: it streams by its id, to the vectors of a plain transformers forward."""
    import shutil

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--memfit-tests--tiny-bert"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    texts = ["a short text", "another one, a little longer than the first"]
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "memfit", "embed", str(tmp_path / "in.txt"), "--model", "memfit-tests/tiny-bert"]
    run = subprocess.run(
        [*command, "--offload", "always", "--dtype", "fp32", "-o", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["settings"]["backend"] == "streamed"
    expected = fp32_reference(tiny_model_dir, texts, max_length=128)
    assert row_cosines(memfit.read(tmp_path / "out").embeddings, expected).min() >= MIN_COSINE


@pytest.mark.parametrize("backend", ["openvino", "onnxruntime"])
def test_offload_on_a_compiled_backend_is_refused_not_run_on_pytorch(tiny_model_dir, backend):
    """The streamed layers run on PyTorch: an explicit compiled backend with ``offload="always"`` is refused in one
    line naming it, where it once streamed on PyTorch anyway (``onnxruntime``) without a word."""
    with pytest.raises(memfit.ConfigError, match=f"not --backend {backend}; use --backend auto or torch"):
        load_runtime(tiny_model_dir, device="cpu", dtype="fp32", backend=backend, offload="always", calibrate=False)


PROBE_PEAK_SCRIPT = r"""
import json, sys
import memfit
memfit.configure_process("cpu")  # as the entry points run calibration
import numpy as np
import torch
from memfit.data.chunking import Window
from memfit.engine.runtime import load_runtime
from memfit.memory.peak import PeakMeter

backend = load_runtime(sys.argv[1], device="cpu", dtype="fp32", offload="always", calibrate=False).backend
meter = PeakMeter(torch.device("cpu"))

def every_layer(batch, length):
    ids = torch.randint(5, 30000, (batch, length), generator=torch.Generator().manual_seed(0)).tolist()
    windows = [Window(row, 0, np.asarray(row_ids), None, 0, length) for row, row_ids in enumerate(ids)]
    backend.run(windows, lambda output, mask, chosen: [None] * len(chosen))

growth = {"probe": [], "every layer": []}
for batch, length in [(8, 64), (4, 512)]:
    for name, forward in (("probe", backend.network.probe), ("every layer", every_layer)):
        forward(batch, length)  # the shape's first run settles what it touches once
        runs = []
        for _ in range(2):
            meter.trim()
            start = meter.start()
            forward(batch, length)
            runs.append(meter.peak() - start)
        growth[name].append(min(runs))
print(json.dumps(growth))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_calibration_probe_grows_the_process_as_a_forward_through_every_layer(minilm_dir):
    """Calibration's streamed probe runs three of MiniLM's six layers (the first, the second and the last); the
    memory it measures must be the peak of a streamed forward through all six, in a configured process, as the
    plan assumes (within a MiB, at two shapes)."""
    ran = subprocess.run(
        [sys.executable, "-c", PROBE_PEAK_SCRIPT, minilm_dir], capture_output=True, text=True, timeout=300
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    growth = json.loads(ran.stdout.strip().splitlines()[-1])
    for probed, full in zip(growth["probe"], growth["every layer"]):
        assert full > 4 * 2**20, growth  # a real forward's growth, not page noise
        assert abs(probed - full) <= 2**20, growth


WEIGHTS_HELD_SCRIPT = r"""
import json, sys
import memfit
memfit.configure_process("cpu")
import numpy as np
import torch
from memfit.data.chunking import Window
from memfit.engine.runtime import load_runtime
from memfit.memory.peak import PeakMeter

backend = load_runtime(sys.argv[1], device="cpu", dtype="fp32", offload="always", calibrate=False).backend
meter = PeakMeter(torch.device("cpu"))
windows = [Window(0, 0, np.arange(5, 9), None, 0, 4)]
backend.run(windows, lambda output, mask, chosen: [None] * len(chosen))  # the first run settles what it touches
runs = []
for _ in range(2):
    meter.trim()
    start = meter.start()
    backend.run(windows, lambda output, mask, chosen: [None] * len(chosen))
    runs.append(meter.peak() - start)
print(json.dumps(min(runs)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_on_the_cpu_a_streamed_forward_holds_one_layers_weights_at_a_time(tmp_path):
    """Reading the next layer while one runs buys the CPU nothing (``streamed.reads_ahead``), so a streamed forward
    there holds one layer's weights at a time. A BERT whose layers are nearly all weights (8 MiB of feed-forward
    matrices each, four tokens of activations) grows the process by about one layer, measured, not two."""
    from safetensors import safe_open
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=32_768
    )
    torch.manual_seed(0)
    BertModel(config).eval().save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as weights:
        layer = sum(weights.get_tensor(name).nbytes for name in weights.keys() if name.startswith("encoder.layer.0."))
    ran = subprocess.run(
        [sys.executable, "-c", WEIGHTS_HELD_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    growth = json.loads(ran.stdout.strip().splitlines()[-1])
    assert 0.9 * layer <= growth <= 1.5 * layer, (
        f"a forward grew {growth / 2**20:.1f} MiB; a layer is {layer / 2**20:.1f}"
    )


def _run(
    tmp_path: Path, name: str, *argv: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess, int]:
    report = tmp_path / f"{name}.json"
    result = subprocess.run(
        [sys.executable, str(PEAK_CLI), str(report), *argv], capture_output=True, timeout=900, text=True, env=env
    )
    return result, json.loads(report.read_text())["peak_bytes"] if report.exists() else 0


def _named_budget_mib(refusal: str) -> int:
    return int(refusal.split("raise --memory-budget to ")[1].split(" MiB, which works")[0].replace(",", ""))


def _embed_argv(source: Path, out: Path, *extra: str) -> list[str]:
    return ["embed", str(source), "-o", str(out), "--device", "cpu", "--dtype", "fp32", "--backend", "torch", *extra]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_auto_streams_under_a_budget_the_resident_path_refuses_and_keeps_it(minilm_dir, minilm_runtimes, tmp_path):
    # all-MiniLM-L6-v2 in fp32 on PyTorch: the resident plan needs ~550 MiB (weights 87 MiB beside a ~390 MiB
    # runtime), the streamed one ~495 MiB (2-core AMD EPYC); a fresh install's runtime holds ~30 MiB more (its
    # libraries' pages), so the budget is the one the streamed path itself names as working on this machine
    texts = _news(60, 200, 4_000)
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    asked, _ = _run(
        tmp_path, "asked", *_embed_argv(source, tmp_path / "a", "--offload", "always"), "--memory-budget", "64MiB"
    )
    assert asked.returncode == 4, asked.stderr[-2000:]
    works = re.search(r"raise --memory-budget to ([\d,]+) MiB, which works", asked.stderr)
    assert works is not None, asked.stderr[-2000:]
    budget_mib = int(works.group(1).replace(",", ""))
    budget = f"{budget_mib}MiB"
    resident, _ = _run(
        tmp_path, "resident", *_embed_argv(source, tmp_path / "r", "--offload", "never"), "--memory-budget", budget
    )
    assert resident.returncode == 4, resident.stderr[-2000:]  # the resident path cannot keep that budget

    streamed, peak = _run(tmp_path, "auto", *_embed_argv(source, tmp_path / "s", "--memory-budget", budget))
    assert streamed.returncode == 0, streamed.stderr[-2000:]
    assert "stream from the weights file" in streamed.stderr
    assert peak <= budget_mib * 2**20, f"peak {peak / 2**20:.1f} MiB over the {budget} budget"
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["settings"]["backend"] == "streamed"

    # the reference: the resident PyTorch path in fp32 with no budget, as `memfit embed` runs it (--long chunk)
    expected = Encoder(runtime=minilm_runtimes[0]).embed(texts, long="chunk")
    got = memfit.read(tmp_path / "s")
    assert list(got.ids) == list(range(len(texts)))
    assert row_cosines(np.asarray(got.embeddings), expected).min() >= MIN_COSINE


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_budget_too_small_to_stream_is_refused_with_one_that_works(minilm_dir, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in _news(20, 200, 2_000)))
    # a cache of its own: no floor recorded by an earlier test
    env = {**os.environ, "MEMFIT_CACHE_DIR": str(tmp_path / "cache")}
    refused, _ = _run(tmp_path, "refused", *_embed_argv(source, tmp_path / "no", "--memory-budget", "420MB"), env=env)
    assert refused.returncode == 4
    message = refused.stderr.strip().splitlines()[-1]
    assert "streamed plan" in message and "works" in message and "last loaded" not in message
    assert not (tmp_path / "no").exists()
    works = _named_budget_mib(message)

    # again: refused before anything loads, from the smallest budget the first load recorded, naming the same
    # budget (to the few MiB the process's baseline moves by), and this time within the budget it refuses. The
    # record refuses only budgets more than FLOOR_TOLERANCE_BYTES below its floor (the named budget less the drift
    # allowance, and less what the process holds less at the start), so the budget is set that far below, with 24 MiB
    # to spare, on every CPU: a fixed 420 MB was within it on the Intel Xeon with AMX, whose process held 346 MiB
    # before the first block, and took the full load
    below_the_floor = works - (FLOOR_TOLERANCE_BYTES + CPU_RESIDENT_DRIFT_BYTES) // 2**20 - 24
    again, peak_again = _run(
        tmp_path, "again", *_embed_argv(source, tmp_path / "no", "--memory-budget", f"{below_the_floor}MiB"), env=env
    )
    assert again.returncode == 4
    message_again = again.stderr.strip().splitlines()[-1]
    assert "when this model was last loaded with these settings" in message_again, message_again
    works_again = int(
        message_again.split("raise --memory-budget to ")[1].split(" MiB, which works")[0].replace(",", "")
    )
    assert abs(works_again - works) <= 8, (works, works_again)
    assert 0 < peak_again <= below_the_floor * 2**20 and not (tmp_path / "no").exists()

    ran, peak = _run(
        tmp_path, "works", *_embed_argv(source, tmp_path / "yes", "--memory-budget", f"{works_again}MiB"), env=env
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert peak <= works_again * 2**20


def test_a_recorded_floor_refuses_only_far_below_it_in_a_like_process_and_only_for_its_weights(
    tiny_model_dir, tmp_path, monkeypatch
):
    # a cache of its own: the other settings below hold no floor only if no earlier test (a streamed bf16 run of
    # the same tiny model, in this worker) recorded one
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    key = floor_key(tiny_model_dir, "embedding", "fp32", None, torch.device("cpu"), True)
    assert key is not None and floor_key(tiny_model_dir, "embedding", "fp32", None, torch.device("meta"), True) is None
    assert floor_key(str(tmp_path), "embedding", "fp32", None, torch.device("cpu"), True) is None  # nothing to stream
    floor = StreamedFloor(
        smallest_bytes=500 * MiB,
        held_at_start_bytes=300 * MiB,
        held_when_chosen_bytes=360 * MiB,
        baseline_bytes=420 * MiB,
        weights_bytes=9 * MiB,
    )
    remember_floor(key, floor)
    assert recall_floor(key) == floor
    # a like process: within 32 MiB of the 500 MiB floor the load decides, below it the record refuses
    assert refusal_below_floor(floor, 469 * MiB, 300 * MiB) is None
    refusal = refusal_below_floor(floor, 467 * MiB, 300 * MiB)
    assert refusal is not None and "raise --memory-budget to 516 MiB, which works" in refusal
    assert "held 420 MiB before the first block" in refusal and "9 MiB" in refusal
    # one that holds 20 MiB more at the start may hold no more before its first block (what the recording process
    # imported while it loaded, this one may have imported already): the floor that refuses stays at 500 MiB, and the
    # budget named rises by the 20 MiB, in case it does hold them
    assert refusal_below_floor(floor, 469 * MiB, 320 * MiB) is None
    refusal = refusal_below_floor(floor, 467 * MiB, 320 * MiB)
    assert refusal is not None and "raise --memory-budget to 536 MiB, which works" in refusal
    assert "held 440 MiB before the first block" in refusal
    # one that holds 20 MiB less may still hold the 500 MiB before its first block: the budget named stays 516 MiB,
    # and the floor that refuses drops by the 20 MiB, in case it does not
    assert refusal_below_floor(floor, 449 * MiB, 280 * MiB) is None
    refusal = refusal_below_floor(floor, 447 * MiB, 280 * MiB)
    assert refusal is not None and "raise --memory-budget to 516 MiB, which works" in refusal
    # a process that holds 50 MiB less or more at the start is not like the recording one: the load decides
    assert refusal_below_floor(floor, 100 * MiB, 250 * MiB) is None
    assert refusal_below_floor(floor, 100 * MiB, 350 * MiB) is None
    # other settings (a precision, a plan from the analytic model), or a weights file written since, hold no floor
    assert recall_floor(floor_key(tiny_model_dir, "embedding", "bf16", None, torch.device("cpu"), True)) is None
    assert recall_floor(floor_key(tiny_model_dir, "embedding", "fp32", None, torch.device("cpu"), False)) is None
    weights = Path(tiny_model_dir) / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    try:
        assert recall_floor(floor_key(tiny_model_dir, "embedding", "fp32", None, torch.device("cpu"), True)) is None
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.slow
def test_a_streamed_run_killed_mid_run_resumes_to_the_uninterrupted_output(minilm_dir, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in _news(120, 100, 1_500)))
    argv = ["embed", str(source), "--device", "cpu", "--dtype", "fp32", "--offload", "always", "--part-size", "30"]
    out = tmp_path / "killed"
    killed_at = kill_after_first_part(argv, out, timeout=600)
    assert 0 < killed_at["rows"] < 120

    resumed = subprocess.run(
        [sys.executable, "-m", "memfit", *argv, "-o", str(out), "--resume"], capture_output=True, timeout=900
    )
    assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
    straight = subprocess.run(
        [sys.executable, "-m", "memfit", *argv, "-o", str(tmp_path / "straight")], capture_output=True, timeout=900
    )
    assert straight.returncode == 0, straight.stderr.decode()[-2000:]
    got, expected = memfit.read(out), memfit.read(tmp_path / "straight")
    assert list(got.ids) == list(expected.ids) == list(range(120))
    np.testing.assert_allclose(np.asarray(got.embeddings), np.asarray(expected.embeddings), atol=1e-6)


def test_plan_shows_both_plans_and_which_runs(tiny_model_dir, capsys):
    from memfit.cli import main

    argv = ["plan", "--model", tiny_model_dir, "--device", "cpu", "--dtype", "fp32", "--memory-budget", "2GiB"]
    assert main([*argv, "--offload", "always", "--json"]) == 0
    streamed = json.loads(capsys.readouterr().out)
    assert streamed["execution"] == "streamed" and streamed["backend"] == "streamed"
    assert 0 < streamed["layer_batch_tokens"] <= streamed["max_batch_tokens"]
    assert streamed["resident_needs_bytes"] > 0 and 0 < streamed["streamed_needs_bytes"] <= streamed["budget_bytes"]
    assert main([*argv, "--offload", "never", "--backend", "torch"]) == 0
    table = capsys.readouterr().out
    assert "runs         resident: resident needs about" in table and "streamed about" in table


def test_the_weights_file_gives_exactly_the_rows_and_tensors_asked_for(tmp_path):
    import torch
    from safetensors.torch import save_file

    from memfit.engine.streamed import WeightFile

    table = torch.randn(50, 6)
    other = torch.randn(3, 4).to(torch.bfloat16)
    save_file({"embeddings.word_embeddings.weight": table, "other": other}, str(tmp_path / "model.safetensors"))
    weights = WeightFile(tmp_path / "model.safetensors")
    ids = np.array([0, 1, 2, 7, 8, 30, 49])  # runs of consecutive ids and single ones, both ends of the table
    assert torch.equal(weights.rows("embeddings.word_embeddings.weight", ids), table[torch.from_numpy(ids)])
    assert torch.equal(weights.read("other"), other)
    # read over a tensor of the same shape: as stored, or converted through a staging buffer, as torch converts
    over = torch.zeros(50, 6, dtype=torch.bfloat16)
    weights.read_over("embeddings.word_embeddings.weight", over, torch.empty(50 * 6 * 4, dtype=torch.uint8))
    assert torch.equal(over, table.to(torch.bfloat16))
    same = torch.zeros(3, 4, dtype=torch.bfloat16)
    weights.read_over("other", same, None)
    assert torch.equal(same, other)
    weights.close()


def test_a_streamed_forward_keeps_no_weights_after_it(minilm_runtimes):
    _, streamed = minilm_runtimes
    Encoder(runtime=streamed).embed(_news(3, 50, 300))
    skeleton = streamed.backend.skeleton
    assert skeleton.rows.table is None and skeleton.rows.ids is None
    assert all(p.device.type == "meta" for p in skeleton.slot.parameters())
