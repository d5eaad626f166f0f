"""Resident vs layer-streamed (``--offload``): texts/s and whole-process peak RSS at several budgets, and the
smallest budget each path accepts, each row the ``memfit embed`` CLI in a fresh process.

    python benchmarks/bench_offload.py --model DIR [--n 300] [--chars 200,1500] [--fractions 0.6,0.8]
                                       [--out results.json]

Corpus: ``--n`` spans of real news text (gensim's Lee corpus, ``corpus.py``'s sources) of 200 to 1,500
characters (``--chars``: 40,300 makes issue 34's 10,000 texts a run of minutes, not of an hour).
Rows: the resident path with no budget (memfit's default; its peak is the reference), then at
each fraction of that peak the resident path (``--offload never``: refused with exit 4 when it cannot keep
the budget) and ``--offload auto`` (streams when the resident plan does not fit). Peak: ``VmHWM`` read by
``peak_cli.py`` (model loading included), the quantity the budget bounds; time: the whole CLI run, load
included. Smallest budgets: ``memfit plan --json``'s ``resident_needs_bytes`` / ``streamed_needs_bytes``
(the planned minimum: a budget below it is refused). PyTorch in fp32 on the CPU for both paths, so the only
difference is where the weights live. Not a test: prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from corpus import _documents
from _measure import machine_facts, min_cosine, print_table, write_json

HERE = Path(__file__).resolve().parent
PEAK_CLI = HERE / "peak_cli.py"
MiB = 2**20


def texts(n: int, shortest: int = 200, longest: int = 1_500) -> list[str]:
    """``n`` spans of real text, ``shortest`` to ``longest`` characters, each from another offset of the source
    stream."""
    stream = " ".join(" ".join(doc.split()) for doc in _documents())
    out = []
    for i in range(n):
        size = shortest + (i * 977) % (longest - shortest)
        start = (i * 3_571) % (len(stream) - size)
        out.append(stream[start : start + size])
    return out


def run(workdir: Path, name: str, source: Path, model: str, *extra: str) -> dict:
    report = workdir / f"{name}.json"
    argv = ["embed", str(source), "-o", str(workdir / name), "--model", model, "--device", "cpu"]
    argv += ["--dtype", "fp32", "--backend", "torch", *extra]
    started = time.perf_counter()
    result = subprocess.run([sys.executable, str(PEAK_CLI), str(report), *argv], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    measured = json.loads(report.read_text()) if report.exists() else {"peak_bytes": 0, "seconds": seconds}
    manifest = workdir / name / "manifest.json"
    backend = json.loads(manifest.read_text())["settings"]["backend"] if manifest.exists() else "-"
    return {
        "output": name,  # the run's output directory in the work directory
        "exit": result.returncode,
        "backend": backend,
        "seconds": round(measured["seconds"], 1),
        "peak_mib": round(measured["peak_bytes"] / MiB, 1),
        "message": result.stderr.strip().splitlines()[-1][:160] if result.stderr.strip() else "",
    }


def vectors(output: Path) -> np.ndarray:
    """A run's vectors in input order."""
    import memfit

    result = memfit.read(output)
    return np.asarray(result.embeddings, dtype=np.float64)[np.argsort(np.asarray(result.ids))]


def planned_minimum(model: str, offload: str, budget_bytes: int | None) -> dict:
    argv = [sys.executable, "-m", "memfit", "plan", "--model", model, "--device", "cpu", "--dtype", "fp32"]
    argv += ["--backend", "torch", "--offload", offload, "--json"]
    argv += ["--memory-budget", str(budget_bytes)] if budget_bytes is not None else []
    result = subprocess.run(argv, capture_output=True, text=True)
    report = json.loads(result.stdout)
    return {key: report[key] for key in ("execution", "resident_needs_bytes", "streamed_needs_bytes")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--chars", default="200,1500", help="shortest,longest span in characters")
    parser.add_argument("--fractions", default="0.6,0.8")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-offload-"))
    shortest, longest = (int(c) for c in args.chars.split(","))
    corpus = texts(args.n, shortest, longest)
    source = workdir / "in.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus))

    # calibrations are cached per model shape (docs/memory.md): a deployment runs the probes once, and a cold
    # probe of 2,048 tokens can pass a tight budget before the plan exists (then the run is refused); measure
    # the warm case, as each path runs after its first time
    for offload in ("never", "always"):
        planned_minimum(args.model, offload, None)
    rows = []
    free = run(workdir, "resident-free", source, args.model, "--offload", "never")
    rows.append({"path": "resident", "budget_mib": "none", **free})
    for fraction in [float(f) for f in args.fractions.split(",")]:
        budget = int(free["peak_mib"] * MiB * fraction)
        for offload in ("never", "auto"):
            row = run(
                workdir,
                f"{offload}-{fraction}",
                source,
                args.model,
                "--offload",
                offload,
                "--memory-budget",
                str(budget),
            )
            rows.append({"path": f"--offload {offload}", "budget_mib": f"{budget / MiB:.0f} ({fraction:.0%})", **row})
    resident_vectors = vectors(workdir / free["output"])
    for row in rows:
        row["texts_per_s"] = round(args.n / row["seconds"], 2) if row["exit"] == 0 else None
        row["x_resident"] = round(row["texts_per_s"] / rows[0]["texts_per_s"], 3) if row["exit"] == 0 else None
        row["kept"] = row["budget_mib"] == "none" or (
            row["exit"] == 0 and row["peak_mib"] <= float(row["budget_mib"].split()[0])
        )
        if row["exit"] == 0:
            row["min_cos_vs_resident"] = round(min_cosine(vectors(workdir / row["output"]), resident_vectors), 8)
    smallest = {
        offload: planned_minimum(args.model, offload, int(free["peak_mib"] * MiB)) for offload in ("never", "always")
    }
    print_table(rows)
    print(json.dumps(smallest, indent=1))
    payload = {"model": args.model, "n": args.n, "chars": [shortest, longest], "machine": machine_facts()}
    payload |= {"rows": rows, "smallest": smallest}
    if args.out:
        write_json(args.out, payload)


if __name__ == "__main__":
    main()
