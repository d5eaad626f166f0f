"""How soon a bad command is refused: wall time from process start to exit, per refusal.

    python benchmarks/bench_refusals.py [--repeats 5] [--out benchmarks/results/refusals.json]

Each case is a `memfit` command with one mistake (missing input, bad option value, `-o` naming a
file, a model path that does not exist, degenerate training labels); each runs ``--repeats`` times
in a fresh ``python -m memfit`` process. The claim under test: every one is refused (exit 2 or 3,
one stderr line) in well under a second, because nothing heavy (torch, transformers, the model) is
imported before the cheap checks run. "python -c pass" is the floor: the interpreter alone.

One case is a budget too small for any plan (issue 34's "exit 4 within 2 s"): the bundled model under 300 MiB,
which needs torch and the model's header to judge. Its first run (``first s``) loads the model, plans both paths
and records the streamed plan's smallest budget (``engine/streamed_floor.py``); the timed repeats are refused from
that record. All runs use a fresh cache directory, so the first one also calibrates.
Not a test: it prints a table and writes JSON. Run it alone (``flock /tmp/memfit-bench.lock ...``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _measure  # noqa: E402


def cases(tmp: Path) -> list[tuple[str, list[str]]]:
    """(case, the memfit command's arguments): each refused in a fresh process."""
    txt = tmp / "in.txt"
    txt.write_text("a text\nanother text\n")
    one_class = tmp / "one_class.jsonl"
    one_class.write_text('{"text": "good", "label": "pos"}\n{"text": "fine", "label": "pos"}\n')
    out = str(tmp / "out")
    return [
        ("missing input file", ["embed", str(tmp / "nope.txt"), "-o", out]),
        ("unknown input format", ["embed", str(tmp / "in.docx"), "-o", out]),
        ("--memory-budget abc", ["embed", str(txt), "-o", out, "--memory-budget", "abc"]),
        ("--memory-budget 100TB", ["embed", str(txt), "-o", out, "--memory-budget", "100TB", "--device", "cpu"]),
        ("--part-size 0", ["embed", str(txt), "-o", out, "--part-size", "0"]),
        ("-o names a file", ["embed", str(txt), "-o", str(txt)]),
        ("--model path typo", ["embed", str(txt), "-o", out, "--model", "models/typo/x"]),
        ("train: one class", ["train", str(one_class), "-o", out]),
        ("classify: -o names a file", ["classify", str(txt), "-o", str(txt), "--labels", "a,b"]),
        ("--memory-budget 300MiB (no plan fits)", ["embed", str(txt), "-o", out, "--memory-budget", "300MiB"]),
    ]


def wall_seconds(argv: list[str]) -> tuple[float, int, str]:
    start = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, timeout=120)
    return time.perf_counter() - start, result.returncode, result.stderr.decode().strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "refusals.json"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MEMFIT_CACHE_DIR"] = os.path.join(tmp, "cache")  # the first run of each case starts cold
        runs = [("python -c pass (floor)", [sys.executable, "-c", "pass"])]
        runs += [(name, [sys.executable, "-m", "memfit", *argv]) for name, argv in cases(Path(tmp))]
        for name, argv in runs:
            first = wall_seconds(argv)
            measured = [wall_seconds(argv) for _ in range(args.repeats)]
            seconds = [m[0] for m in measured]
            rows.append(
                {
                    "case": name,
                    "exit_code": measured[-1][1],
                    "first_s": first[0],
                    "stderr_lines": len(measured[-1][2].splitlines()),
                    "median_s": statistics.median(seconds),
                    "max_s": max(seconds),
                }
            )
    _measure.print_table(
        rows,
        [
            ("case", "case", ""),
            ("exit_code", "exit", ""),
            ("stderr_lines", "lines", ""),
            ("first_s", "first s", ".3f"),
            ("median_s", "median s", ".3f"),
            ("max_s", "max s", ".3f"),
        ],
    )
    print("wrote", _measure.write_json(args.out, {"repeats": args.repeats, "rows": rows}))


if __name__ == "__main__":
    main()
