"""Memory-budget benchmark: memfit's peak memory and throughput at budgets of 1 / 2 / 4 GiB, next to
memfit without a budget and the tutorial approach (pad to 512, keep every last_hidden_state).

    python benchmarks/bench_memory.py [--n 2000] [--seed 0] [--dtype auto] [--device cpu|cuda]
                                      [--budgets 1GiB,2GiB,4GiB] [--out benchmarks/results/memory.json]

Same data for every row (``corpus.long_tail_corpus(n, seed)``, truncated at 512 tokens), each row in
its own fresh subprocess. Peak memory: on the CPU the worker's whole-process peak RSS (``VmHWM``, load
included) -- the quantity the budget bounds; on CUDA ``torch.cuda.max_memory_allocated``. The timed
part is the embedding of all texts; model load, calibration and a warm-up call are timed separately.
A row is ``under budget`` when its measured peak is at most its budget. Not a test: it prints a table
and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _measure  # noqa: E402

MAX_LEN = 512
GiB = 2**30


def _peak_mib(device: str) -> dict:
    if device.startswith("cuda"):
        import torch

        return {"peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1), "peak_kind": "max_memory_allocated"}
    return {"peak_mib": _measure.peak_rss()["peak_rss_mib"], "peak_kind": "peak RSS (VmHWM)"}


def _load_tutorial(device: str, dtype: str, budget: str | None):
    """The approach of many tutorials: pad everything to 512, batch 16, keep all hidden states."""
    import torch
    from corpus import model_path
    from transformers import AutoModel, AutoTokenizer

    from memfit.models import DTYPES, resolve_dtype

    torch_dtype = DTYPES[resolve_dtype(dtype, torch.device(device))]
    tokenizer = AutoTokenizer.from_pretrained(model_path())
    model = AutoModel.from_pretrained(model_path(), dtype=torch_dtype).to(device).eval()

    def encode(texts):
        enc = tokenizer(texts, padding="max_length", max_length=MAX_LEN, truncation=True, return_tensors="pt")
        hidden, masks = [], []
        with torch.no_grad():
            for i in range(0, len(texts), 16):
                batch = {k: v[i:i + 16].to(device) for k, v in enc.items()}
                hidden.append(model(**batch).last_hidden_state)
                masks.append(batch["attention_mask"])
        states = torch.cat(hidden).float()
        mask = torch.cat(masks).unsqueeze(-1).to(states.dtype)
        return ((states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)).cpu().numpy()

    return encode, {}


def _load_memfit(device: str, dtype: str, budget: str | None):
    import memfit

    encoder = memfit.Encoder(device=device, dtype=dtype, max_length=MAX_LEN, memory_budget=budget)

    def encode(texts):
        return encoder.embed(texts, long="truncate")

    return encode, {"max_batch_tokens": encoder.memory.batch_budget.max_batch_tokens,
                    "budget_bytes": encoder.memory.budget_bytes, "calibration": encoder.memory.source,
                    "oom_events": lambda: encoder.budget.oom_events}


def run_worker(method: str, budget: str | None, device: str, dtype: str, corpus_path: str, report_path: str) -> None:
    import torch

    with open(corpus_path) as f:
        texts = json.load(f)["texts"]
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    with _measure.Stopwatch() as load_sw:
        encode, info = (_load_tutorial if method == "tutorial" else _load_memfit)(device, dtype, budget)
        encode(["A short warm-up sentence.", "Another one."])
    with _measure.Stopwatch() as sw:
        result = encode(texts)
    if len(result) != len(texts):
        raise RuntimeError(f"{method}: {len(result)} embeddings for {len(texts)} texts")
    info = {k: (v() if callable(v) else v) for k, v in info.items()}
    _measure.worker_report(report_path, seconds=round(sw.seconds, 3), load_seconds=round(load_sw.seconds, 3),
                           torch_threads=torch.get_num_threads(), **_peak_mib(device), **info)


COLUMNS = [
    ("method", "method", ""),
    ("budget_mib", "budget MiB", ",.0f"),
    ("max_batch_tokens", "batch tok", ","),
    ("peak_mib", "peak MiB", ",.0f"),
    ("under_budget", "under", ""),
    ("seconds", "embed s", ".1f"),
    ("tokens_per_s", "tok/s", ",.0f"),
    ("vs_unconstrained", "x free", ".2f"),
    ("oom_events", "OOMs", ""),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="memfit memory-budget benchmark (not a test)")
    ap.add_argument("--n", type=int, default=2000, help="number of texts (default 2000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (peak = max_memory_allocated)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--budgets", default="1GiB,2GiB,4GiB")
    ap.add_argument("--skip-tutorial", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "memory.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--budget", help=argparse.SUPPRESS)
    ap.add_argument("--prepare-corpus", help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--report", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.prepare_corpus:
        import corpus

        corpus.write_corpus(args.prepare_corpus, args.n, args.seed)
        return 0
    if args.worker:
        run_worker(args.worker, args.budget, args.device, args.dtype, args.corpus, args.report)
        return 0

    workdir = tempfile.mkdtemp(prefix="memfit-bench-memory-")
    corpus_path = os.path.join(workdir, "corpus.json")
    subprocess.run([sys.executable, __file__, "--prepare-corpus", corpus_path, "--n", str(args.n),
                    "--seed", str(args.seed)], check=True)
    with open(corpus_path) as f:
        data = json.load(f)
    lengths, stats = data["lengths"], data["stats"]
    real = sum(min(n, MAX_LEN) for n in lengths)
    print(f"corpus: {stats['n']} texts, {real:,} tokens after truncation at {MAX_LEN}", flush=True)

    from memfit.memory import parse_size

    tutorial = ("tutorial", "tutorial: pad to 512, batch 16, keep hidden states", None)
    runs: list[tuple[str, str, str | None]] = [] if args.skip_tutorial else [tutorial]
    runs.append(("memfit", "memfit, no budget (90% of free)", None))
    runs += [("memfit", f"memfit, budget {b}", b) for b in args.budgets.split(",") if b]
    rows = []
    for method, label, budget in runs:
        report_path = os.path.join(workdir, f"report-{len(rows)}.json")
        print(f"running: {label} ...", flush=True)
        argv = [sys.executable, __file__, "--worker", method, "--corpus", corpus_path, "--report", report_path,
                "--device", args.device, "--dtype", args.dtype]
        if budget:
            argv += ["--budget", budget]
        report = _measure.run_in_subprocess(argv, report_path)
        row = _measure.throughput_row(label, report, texts=len(lengths), real_tokens=real, total_tokens=sum(lengths))
        if budget:
            row["budget_mib"] = parse_size(budget) / 2**20
            row["under_budget"] = "yes" if row.get("peak_mib", float("inf")) <= row["budget_mib"] else "NO"
        rows.append(row)
    free = next((r for r in rows if r["method"].startswith("memfit, no budget") and r.get("tokens_per_s")), None)
    for r in rows:
        if free and r.get("tokens_per_s"):
            r["vs_unconstrained"] = round(r["tokens_per_s"] / free["tokens_per_s"], 3)
    print()
    _measure.print_table(rows, COLUMNS)
    out = _measure.write_json(args.out, {
        "benchmark": "memory",
        "args": {"n": args.n, "seed": args.seed, "device": args.device, "dtype": args.dtype,
                 "budgets": args.budgets, "max_length": MAX_LEN},
        "corpus": {"generator": "benchmarks/corpus.py:long_tail_corpus", **stats},
        "rows": rows,
    })
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
