"""Memory-budget sweep: every job and output mode on real long texts at several budgets, plus one
1,000,000-character document with token output, each row the ``memfit`` CLI in a fresh process.

    python benchmarks/bench_memory.py [--n 120] [--budgets 0.75GiB,1GiB,2GiB] [--device cpu]
                                      [--jobs embed,embed-tokens,classify-embedding,classify-nli]
                                      [--skip-huge] [--guard-ab] [--out benchmarks/results/memory.json]

Corpus: ``--n`` spans of real news text (gensim's Lee corpus) of 1,000 to 22,000 characters (lognormal,
median ~4,500), chunked at 512 tokens (every token covered). Jobs:

- ``embed``: pooled embeddings; ``embed-tokens``: plus one vector per token (the token table);
- ``classify-embedding``: zero-shot in embedding mode, 4 labels, long texts chunked;
- ``classify-nli``: zero-shot NLI, 4 labels (one model input per text x label), on a cross-encoder of
  all-MiniLM-L6-v2's shape and weights with a 3-class head (random head: its scores mean nothing,
  its memory and speed are those of a MiniLM-sized NLI model; no NLI model ships offline);
- ``huge-tokens``: one 1,000,000-character document with ``--tokens``.

Each job runs without a budget (memfit's default, 90% of free memory) and at each budget. Peak: the
whole process's ``VmHWM``, read by the worker itself at the end and before each of memfit's own resets
(model loading included; ``peak_cli.py``) -- the quantity the budget bounds. ``kept``: peak <= budget. Time: the whole
CLI run (load included); ``x free``: speed relative to the same job without a budget, same run.
``--guard-ab``: every budgeted row runs twice, with memfit's closed-loop guard and without it
(``peak_cli_unguarded.py``), in alternating order; ``x guard`` is the guarded row's speed over the other's.
Training has its own benchmark (``bench_train.py``). Not a test: prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _measure  # noqa: E402

GiB = 2**30
LABELS = "politics,sports,weather,economy"

JOBS = {
    "embed": ["embed", "{corpus}", "--max-length", "512"],
    "embed-tokens": ["embed", "{corpus}", "--max-length", "512", "--tokens"],
    "classify-embedding": ["classify", "{corpus}", "--max-length", "512", "--labels", LABELS, "--long", "chunk"],
    "classify-nli": [
        "classify",
        "{corpus}",
        "--model",
        "{nli}",
        "--mode",
        "nli",
        "--max-length",
        "512",
        "--labels",
        LABELS,
        "--long",
        "chunk",
    ],
    "huge-tokens": ["embed", "{huge}", "--tokens"],
}


def write_corpus(workdir: str, n: int, seed: int) -> tuple[str, str, dict]:
    from gensim.test.utils import datapath

    with open(datapath("lee_background.cor"), encoding="utf-8") as fh:
        text = " ".join(fh.read().split())
    rng = random.Random(seed)
    lengths = [int(min(22_000, max(1_000, rng.lognormvariate(8.4, 0.6)))) for _ in range(n)]
    corpus = os.path.join(workdir, "long.jsonl")
    with open(corpus, "w") as fh:
        for length in lengths:
            start = rng.randrange(0, len(text) - length)
            fh.write(json.dumps({"text": text[start : start + length]}) + "\n")
    huge = os.path.join(workdir, "huge.jsonl")
    with open(huge, "w") as fh:
        fh.write(json.dumps({"text": ((text + " ") * (1_000_000 // len(text) + 1))[:1_000_000]}) + "\n")
    return (
        corpus,
        huge,
        {
            "texts": n,
            "chars": sum(lengths),
            "median_chars": sorted(lengths)[n // 2],
            "max_chars": max(lengths),
            "huge_chars": 1_000_000,
        },
    )


def write_nli_model(workdir: str) -> str:
    """all-MiniLM-L6-v2's encoder under a 3-class NLI head (entailment / neutral / contradiction)."""
    import torch
    from corpus import model_path
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    labels = {0: "entailment", 1: "neutral", 2: "contradiction"}
    config = AutoConfig.from_pretrained(
        model_path(), num_labels=3, id2label=labels, label2id={v: k for k, v in labels.items()}
    )
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(model_path(), config=config)
    out = os.path.join(workdir, "nli-minilm")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_path()).save_pretrained(out)
    return out


def run_row(
    job: str, budget: str | None, paths: dict, device: str, workdir: str, index: int, guard: bool = True
) -> dict:
    report = os.path.join(workdir, f"report-{index}.json")
    out = os.path.join(workdir, f"out-{index}")
    argv = [a.format(**paths) for a in JOBS[job]] + ["-o", out, "--device", device]
    if budget:
        argv += ["--memory-budget", budget]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    cli = "peak_cli.py" if guard else "peak_cli_unguarded.py"
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, cli), report, *argv], capture_output=True, text=True, env=env
    )
    row = {
        "job": job,
        "budget": budget or "none (90% free)",
        "guard": "on" if guard else "off",
        "wall_s": round(time.perf_counter() - start, 1),
    }
    if proc.returncode != 0 or not os.path.exists(report):
        row["error"] = f"exit {proc.returncode}: " + " | ".join(proc.stderr.strip().splitlines()[-3:])
        return row
    with open(report) as fh:
        measured = json.load(fh)
    row.update(seconds=round(measured["seconds"], 2), peak_mib=round(measured["peak_bytes"] / 2**20, 1))
    with open(os.path.join(out, "manifest.json")) as fh:
        counts = json.load(fh).get("counts", {})
    row["tokens"] = counts.get("tokens")
    row["rows_written"] = counts.get("texts")
    return row


COLUMNS = [
    ("job", "job", ""),
    ("budget", "budget", ""),
    ("guard", "guard", ""),
    ("peak_mib", "peak MiB", ".1f"),
    ("kept", "kept", ""),
    ("seconds", "run s", ".1f"),
    ("tokens_per_s", "tok/s", ",.0f"),
    ("vs_unconstrained", "x free", ".2f"),
    ("guard_speed", "x guard", ".3f"),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="memfit memory-budget sweep (not a test)")
    ap.add_argument("--n", type=int, default=120, help="number of long texts (default 120)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--budgets", default="0.75GiB,1GiB,2GiB")
    ap.add_argument("--jobs", default="embed,embed-tokens,classify-embedding,classify-nli")
    ap.add_argument("--skip-huge", action="store_true", help="leave out the 1,000,000-character document")
    ap.add_argument("--guard-ab", action="store_true", help="each budgeted row with and without the guard")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "memory.json"))
    args = ap.parse_args(argv)

    from memfit.memory.model import parse_size

    workdir = tempfile.mkdtemp(prefix="memfit-bench-memory-")
    corpus, huge, stats = write_corpus(workdir, args.n, args.seed)
    paths = {"corpus": corpus, "huge": huge, "nli": write_nli_model(workdir)}
    print(f"corpus: {stats}", flush=True)
    budgets = [b for b in args.budgets.split(",") if b]
    plan = [(job, budget) for job in args.jobs.split(",") for budget in [None, *budgets]]
    if not args.skip_huge:
        plan += [("huge-tokens", None), ("huge-tokens", "1GiB")]
    runs = []
    for job, budget in plan:
        if budget and args.guard_ab:  # alternate which side runs first, so drift in load hits both alike
            sides = (True, False) if sum(1 for _, b in runs if b) % 2 == 0 else (False, True)
            runs += [((job, budget), side) for side in sides]
        else:
            runs.append(((job, budget), True))
    rows = []
    for (job, budget), guard in runs:
        print(f"running: {job} at {budget or 'no budget'}, guard {'on' if guard else 'off'} ...", flush=True)
        row = run_row(job, budget, paths, args.device, workdir, len(rows), guard=guard)
        if budget and "peak_mib" in row:
            row["budget_mib"] = parse_size(budget) / 2**20
            row["kept"] = "yes" if row["peak_mib"] <= row["budget_mib"] else "NO"
        if row.get("tokens") and row.get("seconds"):
            row["tokens_per_s"] = round(row["tokens"] / row["seconds"], 1)
        rows.append(row)
    for row in rows:
        other = next(
            (r for r in rows if r["job"] == row["job"] and r["budget"] == row["budget"] and r["guard"] == "off"), None
        )
        if row["guard"] == "on" and other and other.get("tokens_per_s") and row.get("tokens_per_s"):
            row["guard_speed"] = round(row["tokens_per_s"] / other["tokens_per_s"], 3)
    for row in rows:
        free = next(
            (r for r in rows if r["job"] == row["job"] and r["budget"].startswith("none") and r["guard"] == "on"), None
        )
        if free and free.get("tokens_per_s") and row.get("tokens_per_s"):
            row["vs_unconstrained"] = round(row["tokens_per_s"] / free["tokens_per_s"], 3)
    print()
    _measure.print_table(rows, COLUMNS)
    out = _measure.write_json(
        args.out,
        {
            "benchmark": "memory",
            "args": vars(args),
            "corpus": {"source": "gensim lee_background.cor spans", **stats},
            "rows": rows,
        },
    )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
