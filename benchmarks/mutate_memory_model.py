"""Do the tests catch a wrong memory model? Double, then zero, each term of the estimate and run the tests.

    python benchmarks/mutate_memory_model.py [--terms bytes_per_token,...] [--factors 2,0] [--jobs 2]

For each term and factor, ``src/`` is copied to a temporary directory, one exact text substitution is made in
the copy's ``memfit/memory/model.py`` (the script fails if the text is not there exactly once, so a moved line
cannot turn a mutation into a no-op), and the memory tests run against the copy (``PYTHONPATH`` points at it,
so the tests' subprocesses run it too) with ``-x``: the first failing test is what caught the mutation, and a
mutation under which every test passes *survives*. Prints a table and writes
``benchmarks/results/mutate_memory_model.json``. Not a test: it runs the suite's memory tests 2 x terms times.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = Path("memfit") / "memory" / "model.py"
TESTS = [
    "tests/memory/test_memory.py",
    "tests/memory/test_planner.py",
    "tests/engine/test_precision.py",
    "tests/memory/test_guard.py",
]

# term -> (text in model.py, the same text with the factor K applied)
MUTATIONS = {
    "bytes_per_token": (
        "bytes_per_token=max(calibration.bytes_per_token + output_bytes_per_token, floor.bytes_per_token),",
        "bytes_per_token=K * max(calibration.bytes_per_token + output_bytes_per_token, floor.bytes_per_token),",
    ),
    "bytes_per_attention_cell": (
        "bytes_per_attention_cell=max(calibration.bytes_per_attention_cell, floor.bytes_per_attention_cell),",
        "bytes_per_attention_cell=K * max(calibration.bytes_per_attention_cell, floor.bytes_per_attention_cell),",
    ),
    "fixed_bytes": ("fixed_bytes=calibration.fixed_bytes,", "fixed_bytes=K * calibration.fixed_bytes,"),
    "baseline_bytes": (
        "baseline = device_memory(device).used_by_process_bytes + measured.pending_warmup_bytes",
        "baseline = K * (device_memory(device).used_by_process_bytes + measured.pending_warmup_bytes)",
    ),
    "reserved_bytes": (
        "    activations = calibrated_activation_model(network, output_bytes_per_token, measured)\n",
        "    reserved_bytes = int(K * reserved_bytes)\n"
        "    activations = calibrated_activation_model(network, output_bytes_per_token, measured)\n",
    ),
    "fragmentation_margin": ("CPU_FRAGMENTATION_MARGIN = 0.10", "CPU_FRAGMENTATION_MARGIN = K * 0.10"),
    "drift_floor": ("CPU_RESIDENT_DRIFT_BYTES = 16 * 2**20", "CPU_RESIDENT_DRIFT_BYTES = int(K * 16 * 2**20)"),
}


def mutated_copy(term: str, factor: float, into: Path) -> Path:
    """A copy of ``src/`` with ``term`` multiplied by ``factor``; the copy's ``src`` directory."""
    src = into / "src"
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    path = src / MODEL
    text = path.read_text()
    original, mutated = MUTATIONS[term]
    if text.count(original) != 1:
        raise SystemExit(f"{term}: the text to mutate is not in {MODEL} exactly once: {original!r}")
    path.write_text(text.replace(original, mutated.replace("K", repr(factor))))
    return src


def run(term: str, factor: float) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"mutant-{term}-") as tmp:
        src = mutated_copy(term, factor, Path(tmp))
        env = {**os.environ, "PYTHONPATH": str(src), "MEMFIT_CACHE_DIR": str(Path(tmp) / "cache")}
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rf", *TESTS],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
    failed = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("FAILED ")]
    caught = failed[0] if failed else ("error: " + done.stdout.strip().splitlines()[-1] if done.returncode else None)
    row = {"term": term, "factor": factor, "caught_by": caught, "seconds": round(time.perf_counter() - started, 1)}
    print(f"{term} x{factor:g}: {caught or 'SURVIVES'} ({row['seconds']} s)", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--terms", default=",".join(MUTATIONS))
    parser.add_argument("--factors", default="2,0")
    parser.add_argument("--jobs", type=int, default=1, help="mutants tested at once")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "mutate_memory_model.json"))
    args = parser.parse_args()
    cases = [(term, float(f)) for term in args.terms.split(",") for f in args.factors.split(",")]
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda case: run(*case), cases))
    print("\n| term | x2: first failing test | x0: first failing test |\n|---|---|---|")
    for term in dict.fromkeys(row["term"] for row in rows):
        cells = {row["factor"]: row["caught_by"] or "**survives**" for row in rows if row["term"] == term}
        print(f"| `{term}` | {cells.get(2.0, '-')} | {cells.get(0.0, '-')} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"tests": TESTS, "rows": rows}, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
