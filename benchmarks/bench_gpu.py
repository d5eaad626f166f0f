"""GPU benchmark (issue 37): memfit against what users run instead, on one CUDA GPU, in one prepared run.

    python benchmarks/bench_gpu.py --out DIR [--n 2000] [--sections peak,embed,profile,budgets,streamed,nli,train]

Sections (each one's failure is recorded in the JSON and the next one still runs):

- ``peak``: the GPU's measured dense bf16 matrix rate (8192^3 products, mean of 10 after 3 warm-ups), the
  ceiling the FLOP shares below are taken against.
- ``embed``: the long-tail corpus (``corpus.long_tail_corpus``) on all-MiniLM-L6-v2 and on a bert-base-shaped
  encoder (BertModel 768/12/3072, random weights, MiniLM's WordPiece vocabulary: all-mpnet-base-v2's 438 MB do
  not fit the device tool's 64 MiB carry). memfit ``auto`` vs sentence-transformers fp16 and fp32, each at its
  best batch size of a sweep; texts/s, real (unpadded) tokens/s, and for the base model at 512 tokens the
  FLOP/s and its share of the measured bf16 peak.
- ``budgets``: ``memfit embed`` (every token: ``--long chunk``) in a fresh process at three budgets, the CUDA
  caching allocator's peak allocated and reserved bytes against each.
- ``streamed``: the layer-streamed path (``--offload``, issue 34) on CUDA, the base-shaped model at 512 tokens, a
  fresh process each: resident vs streamed at a budget both fit (texts/s, min cosine between their vectors), and at
  a budget below the model's bf16 weights, which the resident path refuses and ``auto`` streams under (peak
  allocated and reserved against it, and the host's peak RSS). The timed pass follows a warm-up of 64 texts, which is
  where a streamed run on CUDA first reads the layers it keeps on the host.
- ``nli``: zero-shot NLI, memfit vs transformers' ``zero-shot-classification`` pipeline in fp16 at its best
  batch size, on a bert-base-shaped NLI classifier (random weights: speed and agreement, not accuracy).
- ``profile``: torch.profiler over memfit on the base-shaped model at 512 tokens: where the time goes; then whole
  embed calls (base at 512, MiniLM at 256) timed stage by stage: which of the two threads holds the other back.
- ``train``: ``memfit train`` of the base-shaped encoder at 512 tokens on real labelled posts (gensim's
  mini_newsgroup, alt.atheism vs sci.space) at two budgets, one epoch each in a fresh process.

Not a test: it prints a table and writes ``DIR/bench_gpu.json``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import functools
import io
import json
import os
import pstats
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402

import _measure  # noqa: E402
import corpus  # noqa: E402

ST_BATCH_SIZES = (32, 64, 128, 256, 512)
PIPELINE_BATCH_SIZES = (16, 64, 256)
# ``cuda`` on the GPU; ``cpu`` only to try the script's own code on a machine without one (``--device cpu``)
DEVICE = "cuda"


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


NLI_LABELS = ["politics", "sport", "science", "business", "weather"]


def base_config(**extra: Any):
    """bert-base's shape: 12 layers of 768, 12 heads, 3,072 inner, 512 positions, MiniLM's 30,522 pieces."""
    from transformers import BertConfig

    return BertConfig(
        vocab_size=30522,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        max_position_embeddings=512,
        **extra,
    )


def build_base_models(minilm: str, root: Path) -> tuple[str, str]:
    """A sentence-transformers bert-base-shaped embedding model and an NLI classifier, random weights, seed 0."""
    from transformers import AutoTokenizer, BertForSequenceClassification, BertModel

    tokenizer = AutoTokenizer.from_pretrained(minilm)
    tokenizer.model_max_length = 512
    embed_dir, nli_dir = root / "bert-base-embed", root / "bert-base-nli"
    torch.manual_seed(0)
    BertModel(base_config()).save_pretrained(embed_dir)
    tokenizer.save_pretrained(embed_dir)
    for name in ("modules.json", "config_sentence_transformers.json"):
        shutil.copy(Path(minilm) / name, embed_dir / name)
    (embed_dir / "1_Pooling").mkdir(exist_ok=True)
    pooling = json.loads((Path(minilm) / "1_Pooling" / "config.json").read_text())
    (embed_dir / "1_Pooling" / "config.json").write_text(json.dumps({**pooling, "word_embedding_dimension": 768}))
    (embed_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    labels = {0: "contradiction", 1: "neutral", 2: "entailment"}
    config = base_config(num_labels=3, id2label=labels, label2id={v: k for k, v in labels.items()})
    BertForSequenceClassification(config).save_pretrained(nli_dir)
    tokenizer.save_pretrained(nli_dir)
    return str(embed_dir), str(nli_dir)


def timed(action: Callable[[], Any], rounds: int = 2) -> float:
    """The best wall time of ``rounds`` runs of ``action`` (after the caller's warm-up), the GPU synchronized."""
    best = float("inf")
    for _ in range(rounds):
        synchronize()
        start = time.perf_counter()
        action()
        synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def best_batch_size(run_at: Callable[[int], Any], sizes: tuple[int, ...]) -> tuple[float, int]:
    """The best batch size of a sweep (one timed run each), and its best time over that run and one more."""
    times = {size: timed(lambda s=size: run_at(s), rounds=1) for size in sizes}
    size = min(times, key=times.get)
    return min(times[size], timed(lambda: run_at(size), rounds=1)), size


def measured_bf16_peak() -> dict:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / 10
    return {"bf16_tflops": 2 * 8192**3 / seconds / 1e12, "device": torch.cuda.get_device_name()}


def fed_lengths(model_dir: str, texts: list[str], limit: int, chunk: bool = False) -> list[int]:
    """The windows' lengths as fed, special tokens included: each text cut at ``limit``, or (``chunk``) every token
    in windows of at most ``limit`` (counted as if they did not overlap: a lower bound on the work)."""
    from transformers import AutoTokenizer

    lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(model_dir)(texts)["input_ids"]]
    if not chunk:
        return [min(n, limit) for n in lengths]
    return [w for n in lengths for w in [limit] * (n // limit) + ([n % limit] if n % limit else [])]


def forward_flops(config, lengths: list[int]) -> float:
    """Forward FLOPs of windows of these lengths: 2 x the encoder's matrix weights a token, plus QK^T and AV
    (4 x length x hidden a token and layer)."""
    h, layers, inner = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    dense = 2 * layers * (4 * h * h + 2 * h * inner)
    return sum(n * dense + 4 * layers * h * n * n for n in lengths)


def embed_rows(model_dir: str, name: str, texts: list[str], limit: int, peak_tflops: float | None) -> list[dict]:
    """memfit auto (truncate and chunk) and sentence-transformers fp32/fp16 at their best batch size."""
    from transformers import AutoConfig

    import memfit

    config = AutoConfig.from_pretrained(model_dir)
    truncated = fed_lengths(model_dir, texts, limit)
    rows = []

    def row(method: str, seconds: float, lengths: list[int], **extra: Any) -> dict:
        tflops = forward_flops(config, lengths) / seconds / 1e12
        out = {
            "model": name,
            "method": method,
            "texts_per_s": len(texts) / seconds,
            "tokens_per_s": sum(lengths) / seconds,
            "tflops": tflops,
        }
        if peak_tflops:
            out["share_of_bf16_peak"] = tflops / peak_tflops
        return {**out, **extra}

    reference = None
    for dtype in ("fp32", "fp16"):
        model = _measure.sentence_transformer(model_dir, max_seq_length=limit, device=DEVICE)
        if dtype == "fp16":
            model.half()
        _measure.st_encode(model, texts[:256], batch_size=64)  # warm-up
        seconds, batch_size = best_batch_size(
            lambda bs, m=model: _measure.st_encode(m, texts, batch_size=bs), ST_BATCH_SIZES
        )
        if dtype == "fp32":
            reference = _measure.st_encode(model, texts, batch_size=batch_size)
        rows.append(row(f"sentence-transformers {dtype}", seconds, truncated, batch_size=batch_size))
        model = None
        empty_cache()

    enc = memfit.Encoder(model_dir, device=DEVICE, max_length=limit)
    enc.embed(texts[:256], long="truncate")  # warm-up; the quality guard measures these texts
    ours = enc.embed(texts, long="truncate")
    seconds = timed(lambda: enc.embed(texts, long="truncate"))
    cos = _measure.min_cosine(ours, reference)
    rows.append(row(f"memfit auto ({enc.dtype}), truncate", seconds, truncated, min_cosine_vs_st_fp32=cos))
    seconds = timed(lambda: enc.embed(texts, long="chunk"), rounds=1)
    every = fed_lengths(model_dir, texts, limit, chunk=True)
    rows.append(row(f"memfit auto ({enc.dtype}), chunk: every token", seconds, every))
    enc = None
    empty_cache()
    return rows


def corpus_long_texts(texts: list[str], lengths: list[int], n: int) -> list[str]:
    """The corpus's texts of at least 512 tokens, repeated up to ``min(n, 1000)``: every window 512 tokens long."""
    long_texts = [t for t, length in zip(texts, lengths) if length >= 512]
    return (long_texts * (1 + n // max(1, len(long_texts))))[: min(n, 1000)]


def section_embed(args, minilm: str, base: str, peak: float | None) -> list[dict]:
    texts = corpus.long_tail_corpus(args.n, seed=0)
    rows = embed_rows(minilm, "all-MiniLM-L6-v2", texts, 256, peak)
    rows += embed_rows(base, "bert-base-shaped", texts, 512, peak)
    # every window exactly 512 tokens: the FLOP share at the model's full length
    long_texts = corpus_long_texts(texts, corpus.token_lengths(texts), args.n)
    rows += [
        {**r, "model": "bert-base-shaped, 512 tokens"}
        for r in embed_rows(base, "bert-base-shaped", long_texts, 512, peak)
    ]
    return rows


BUDGET_RUN = r"""
import json, sys, time
import torch, memfit
memfit.configure_process("cuda")
model, budget, texts = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3]))
enc = memfit.Encoder(model, device="cuda", memory_budget=budget)
start = time.perf_counter()
enc.embed(texts, long="chunk")
seconds = time.perf_counter() - start
free, total = torch.cuda.mem_get_info()
print(json.dumps({"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved(),
                  "device_used_at_end": total - free, "seconds": seconds, "oom_events": enc.budget.oom_events,
                  "batch_tokens": enc.memory.batch_budget.max_batch_tokens, "dtype": enc.dtype}))
"""


def run_child(code: str, argv: list[str], timeout: float = 300) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def section_budgets(args, minilm: str, base: str, work: Path) -> list[dict]:
    from memfit.memory.sizes import parse_size

    texts_file = work / "corpus.json"
    texts_file.write_text(json.dumps(corpus.long_tail_corpus(args.n, seed=0)))
    rows = []
    for name, model, budget in (
        ("all-MiniLM-L6-v2", minilm, "768MiB"),
        ("all-MiniLM-L6-v2", minilm, "4GiB"),
        ("all-MiniLM-L6-v2", minilm, "32GiB"),
        ("bert-base-shaped", base, "1GiB"),
    ):
        seen = run_child(BUDGET_RUN, [model, budget, str(texts_file)])
        limit = parse_size(budget)
        seen.update(model=name, budget=budget, budget_bytes=limit)
        if "error" not in seen:
            seen["within"] = seen["allocated"] <= limit and seen["reserved"] <= limit
        rows.append(seen)
    return rows


STREAMED_RUN = r"""
import json, resource, sys, time
start = time.perf_counter()
import numpy as np, torch, memfit
from memfit.errors import DoesNotFitError
memfit.configure_process("cuda")
model, budget, offload, texts, vectors_file = sys.argv[1:4] + [json.load(open(sys.argv[4])), sys.argv[5]]
try:
    enc = memfit.Encoder(model, device="cuda", memory_budget=budget, offload=offload, max_length=512)
except DoesNotFitError as error:
    print(json.dumps({"refused": str(error).splitlines()[0], "refused_after_s": time.perf_counter() - start}))
    sys.exit(0)
enc.embed(texts[:64], long="truncate")  # warm-up and the quality guard (a streamed run's kept layers are read here)
torch.cuda.synchronize()
start = time.perf_counter()
vectors = enc.embed(texts, long="truncate")
torch.cuda.synchronize()
seconds = time.perf_counter() - start
np.save(vectors_file, vectors)
print(json.dumps({"backend": enc.runtime.backend.name, "dtype": enc.dtype, "seconds": seconds,
                  "texts_per_s": len(texts) / seconds, "allocated": torch.cuda.max_memory_allocated(),
                  "reserved": torch.cuda.max_memory_reserved(), "oom_events": enc.budget.oom_events,
                  "batch_tokens": enc.memory.batch_budget.max_batch_tokens,
                  "host_peak_rss": 1024 * resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "layers_kept_on_host": getattr(enc.runtime.backend, "host_layers", None) is not None}))
"""


def section_streamed(args, base: str, work: Path) -> list[dict]:
    import numpy as np

    from memfit.memory.sizes import parse_size

    texts_file = work / "streamed-corpus.json"
    texts_file.write_text(json.dumps(corpus.long_tail_corpus(args.n, seed=0)))
    rows = []
    # the base shape's bf16 weights are 209 MiB: 160 MiB is below them (the resident path must refuse)
    for budget, offload in (("2GiB", "never"), ("2GiB", "always"), ("160MiB", "never"), ("160MiB", "auto")):
        vectors_file = work / f"streamed-{budget}-{offload}.npy"
        vectors_file.unlink(missing_ok=True)  # never compare with an earlier run's vectors
        seen = run_child(STREAMED_RUN, [base, budget, offload, str(texts_file), str(vectors_file)])
        seen.update(model="bert-base-shaped", budget=budget, offload=offload)
        if "allocated" in seen:
            seen["within"] = max(seen["allocated"], seen["reserved"]) <= parse_size(budget)
            resident = work / "streamed-2GiB-never.npy"
            if offload != "never" and resident.exists():
                seen["min_cosine_vs_resident"] = _measure.min_cosine(np.load(vectors_file), np.load(resident))
        rows.append(seen)
    return rows


def section_nli(args, nli: str) -> list[dict]:
    import memfit
    from transformers import pipeline

    texts = corpus.long_tail_corpus(args.n, seed=0)[:500]
    rows = []
    pipe = pipeline("zero-shot-classification", model=nli, device=0 if DEVICE == "cuda" else -1, dtype=torch.float16)
    pipe(texts[:32], candidate_labels=NLI_LABELS, batch_size=32)  # warm-up
    seconds, batch_size = best_batch_size(
        lambda bs: pipe(texts, candidate_labels=NLI_LABELS, batch_size=bs), PIPELINE_BATCH_SIZES
    )
    reference = pipe(texts, candidate_labels=NLI_LABELS, batch_size=batch_size)
    rows.append({"method": "pipeline fp16", "texts_per_s": len(texts) / seconds, "batch_size": batch_size})
    pipe = None
    empty_cache()
    for dtype in ("auto", "fp16"):
        clf = memfit.Classifier(nli, mode="nli", device=DEVICE, dtype=dtype)
        clf.classify(texts[:32], NLI_LABELS)
        ours = clf.classify(texts, NLI_LABELS)
        seconds = timed(lambda c=clf: c.classify(texts, NLI_LABELS))
        diffs = [
            abs(dict(zip(ref["labels"], ref["scores"]))[label] - score)
            for ref, mine in zip(reference, ours)
            for label, score in zip(mine.labels, mine.scores)
        ]
        rows.append(
            {
                "method": f"memfit nli {dtype} ({clf.runtime.dtype})",
                "texts_per_s": len(texts) / seconds,
                "max_abs_score_diff_vs_pipeline": max(diffs),
            }
        )
        clf = None
        empty_cache()
    return rows


TRAIN_RUN = r"""
import json, sys, time
import torch, memfit
memfit.configure_process("cuda", inference=False)
start = time.perf_counter()
metrics = memfit.train(sys.argv[1], sys.argv[2], model=sys.argv[3], device="cuda", epochs=1, batch_size=32,
                       max_length=512, memory_budget=sys.argv[4])
print(json.dumps({"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved(),
                  "seconds": time.perf_counter() - start, "plan": metrics["plan"], "epoch": metrics["epochs"][0],
                  "oom_events": metrics["oom_events"], "examples": metrics["train_examples"]}))
"""


def section_train(args, base: str, work: Path) -> list[dict]:
    from quality_classify import newsgroups

    from memfit.memory.sizes import parse_size

    data = newsgroups()
    path = work / "newsgroups.jsonl"
    path.write_text("".join(json.dumps({"text": t, "label": g}) + "\n" for t, g in zip(data["texts"], data["gold"])))
    rows = []
    for budget in ("3GiB", "12GiB"):
        out = work / f"train-{budget}"
        shutil.rmtree(out, ignore_errors=True)  # a run cut short by the check's timeout leaves its output behind
        seen = run_child(TRAIN_RUN, [str(path), str(out), base, budget], timeout=400)
        seen.update(budget=budget)
        if "error" not in seen:
            seen["within"] = max(seen["allocated"], seen["reserved"]) <= parse_size(budget)
        rows.append(seen)
    return rows


@contextlib.contextmanager
def stage_clock() -> Iterator[dict[str, float]]:
    """Seconds spent in each stage of the stream loop while the block runs, summed over calls: the preparing
    thread's ``prepare`` (of which ``tokenize``), and the main thread's ``forward`` (padding, the copy, the
    launches; ``head`` is the pooling, which waits for the GPU's result first) and ``finish`` (merging)."""
    from memfit.data import chunking
    from memfit.engine import batches, pooling
    from memfit.jobs import embed_job

    spent: dict[str, float] = collections.defaultdict(float)

    def clocked(name: str, function: Callable) -> Callable:
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start

        return wrapper

    stages = [
        (embed_job.EmbedJob, "prepare", "prepare"),
        (chunking, "tokenize_texts", "tokenize"),
        (batches.CurrentRuntimeEngine, "forward", "forward"),
        (pooling.EmbeddingHead, "__call__", "head"),
        (embed_job.EmbedJob, "finish", "finish"),
    ]
    with contextlib.ExitStack() as patches:
        for owner, attribute, name in stages:
            patches.enter_context(mock.patch.object(owner, attribute, clocked(name, getattr(owner, attribute))))
        yield spent


def stage_times(enc, texts: list[str], label: str) -> dict:
    """One whole ``embed`` call, stage by stage (:func:`stage_clock`): the main thread's wall less its own stages
    is mostly waiting for the next prepared block, so which side holds the other back shows directly."""
    synchronize()
    with stage_clock() as spent:
        start = time.perf_counter()
        enc.embed(texts, long="truncate")
        synchronize()
        wall = time.perf_counter() - start
    main = spent["forward"] + spent["finish"]
    return {"case": label, "texts": len(texts), "wall_s": wall, **spent, "main_waiting_s": wall - main}


def section_profile(args, minilm: str, base: str) -> dict:
    """Where memfit's time goes on the base-shaped model at 512 tokens: torch.profiler's kernels by GPU time, and
    the wall time against the kernels' sum (the gap is host work: tokenizing, padding, copies, Python)."""
    from torch.profiler import ProfilerActivity, profile

    import memfit

    texts = corpus.long_tail_corpus(args.n, seed=0)
    lengths = corpus.token_lengths(texts)
    long_texts = [t for t, n in zip(texts, lengths) if n >= 512][:256]
    enc = memfit.Encoder(base, device=DEVICE, max_length=512)
    enc.embed(long_texts[:64], long="truncate")  # warm-up and the quality guard
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    synchronize()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        enc.embed(long_texts, long="truncate")
        synchronize()
    wall = time.perf_counter() - start
    averages = prof.key_averages()
    table = averages.table(sort_by="cuda_time_total" if DEVICE == "cuda" else "cpu_time_total", row_limit=25)
    on_gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = sum(e.time_range.elapsed_us() for e in on_gpu) / 1e6 if DEVICE == "cuda" else None
    # the host's own view, without torch.profiler's per-op overhead: which Python functions the wall goes to
    host = cProfile.Profile()
    start = time.perf_counter()
    host.enable()
    enc.embed(long_texts, long="truncate")
    synchronize()
    host.disable()
    host_wall = time.perf_counter() - start
    listing = io.StringIO()
    pstats.Stats(host, stream=listing).sort_stats("tottime").print_stats(30)
    long_512 = corpus_long_texts(texts, lengths, args.n)
    steady = [stage_times(enc, long_512, "bert-base-shaped, 512 tokens")]
    minilm_enc = memfit.Encoder(minilm, device=DEVICE, max_length=256)
    minilm_enc.embed(texts[:256], long="truncate")
    steady.append(stage_times(minilm_enc, texts, "all-MiniLM-L6-v2, truncate 256"))
    # the same calls with the interpreter's thread switch interval at 0.5 ms (default 5 ms): how much of the main
    # thread's launching waits for the GIL while the preparing thread runs Python (an experiment, not a setting)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    try:
        steady.append(stage_times(enc, long_512, "bert-base-shaped, 512 tokens, switch interval 0.5 ms"))
        steady.append(stage_times(minilm_enc, texts, "all-MiniLM-L6-v2, truncate 256, switch interval 0.5 ms"))
    finally:
        sys.setswitchinterval(interval)
    return {
        "stages": steady,
        "texts": len(long_texts),
        "wall_s": wall,
        "gpu_kernels_s": kernels,
        "table": table,
        "host_wall_s": host_wall,
        "host_by_own_time": listing.getvalue(),
    }


def print_table(results: dict) -> None:
    if "peak" in results:
        print(f"\n{results['peak']}")
    for row in results.get("embed", []):
        share = f"{100 * row['share_of_bf16_peak']:.1f}%" if "share_of_bf16_peak" in row else ""
        print(
            f"{row['model']:<30} {row['method']:<42} {row['texts_per_s']:>9.1f} texts/s "
            f"{row['tokens_per_s']:>11.0f} tok/s {row['tflops']:>7.1f} TFLOP/s {share:>6} "
            f"{row.get('batch_size', '')} {row.get('min_cosine_vs_st_fp32', '')}"
        )
    if "profile" in results:
        profile = results["profile"]
        kernels = profile["gpu_kernels_s"]
        print(f"\nprofile: {profile['texts']} texts, wall {profile['wall_s']:.2f} s, GPU kernels {kernels} s")
        print(profile["table"])
        print(f"host (cProfile, wall {profile['host_wall_s']:.2f} s):\n{profile['host_by_own_time']}")
        for stage in profile.get("stages", []):
            print(
                "stages: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in stage.items())
            )
    for key in ("budgets", "streamed", "nli", "train"):
        for row in results.get(key, []):
            print(f"{key}: {json.dumps(row)}")
    for key, error in results.get("errors", {}).items():
        print(f"{key} FAILED: {error.splitlines()[-1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--sections", default="peak,embed,profile,budgets,streamed,nli,train")
    parser.add_argument("--device", default="cuda", help="cpu: try the script's code without a GPU (embed, nli)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "memfit-bench-gpu"
    work.mkdir(parents=True, exist_ok=True)
    minilm = corpus.model_path()
    base, nli = build_base_models(minilm, work)
    results: dict[str, Any] = {"errors": {}}
    sections = args.sections.split(",")
    peak = None
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("peak", measured_bf16_peak),
        # the streamed rows first: the newest GPU path
        ("streamed", lambda: section_streamed(args, base, work)),
        ("embed", lambda: section_embed(args, minilm, base, peak)),
        ("profile", lambda: section_profile(args, minilm, base)),
        ("budgets", lambda: section_budgets(args, minilm, base, work)),
        ("nli", lambda: section_nli(args, nli)),
        ("train", lambda: section_train(args, base, work)),
    ]
    for key, step in steps:
        if key not in sections:
            continue
        start = time.perf_counter()
        try:
            results[key] = step()
            if key == "peak":
                peak = results[key]["bf16_tflops"]
        except Exception:  # noqa: BLE001 - a benchmark records a failed section and goes on to the next
            results["errors"][key] = traceback.format_exc()
            print(results["errors"][key], file=sys.stderr, flush=True)
        print(f"[{key}: {time.perf_counter() - start:.1f} s]", flush=True)
        (out / "bench_gpu.json").write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)


if __name__ == "__main__":
    main()
