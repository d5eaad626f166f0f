"""Run a command in this process and write its whole-run peak resident set, exit code and time as JSON.

    python benchmarks/peak_cli.py REPORT.json embed in.jsonl -o out/ --memory-budget 1GiB ...
    python benchmarks/peak_cli.py REPORT.json SCRIPT.py ARGS ...

The first form runs the ``memfit`` CLI and ends the process as the ``memfit`` command does (no interpreter
teardown); the second runs a Python script as ``python SCRIPT.py ARGS`` would (a baseline's worker, also in a
peers' venv without memfit). The peak is read here, from the kernel (``VmHWM`` in ``/proc/self/status``), at the
end and, for memfit, just before each of memfit's own resets of the high-water mark (memfit resets it to measure
its calibration probes), so it covers the whole run, model loading included: the quantity ``--memory-budget``
bounds. Used by the budget tests (``tests/memory/test_budget.py``) and by ``bench_memory.py``, ``bench_guard.py``,
``bench_offload.py``, ``bench_s3_memory.py``, ``first_run.py`` and ``bench_backends.py``. Linux only.

It imports nothing from beside it: ``first_run.py`` copies this one file next to a fresh install.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback
from typing import Callable


def vmhwm_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def _run_script(argv: list[str]) -> int:
    """``python SCRIPT ARGS`` in this process: the exit code ``python`` would give (a message in ``SystemExit`` and
    an uncaught exception's traceback go to stderr, as there)."""
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except Exception:
        traceback.print_exc()
        return 1
    return 0


def _memfit_main(peaks: list[int]) -> Callable[[list[str]], int]:
    """The ``memfit`` CLI's ``main``, imported (torch with it) before anything is timed, as before
    ``peak_cli_unguarded.py`` calls :func:`main`; the peak before each of memfit's resets of VmHWM goes to ``peaks``."""
    import memfit.memory.peak

    reset = memfit.memory.peak.reset_rss_peak

    def remember_then_reset() -> None:
        peaks.append(vmhwm_bytes())
        reset()

    memfit.memory.peak.reset_rss_peak = remember_then_reset
    from memfit.cli import main as memfit_main

    return memfit_main


def main() -> int:
    report, command = sys.argv[1], sys.argv[2:]
    peaks: list[int] = []
    script = bool(command) and command[0].endswith(".py")
    run = _run_script if script else _memfit_main(peaks)
    start = time.perf_counter()
    code = run(command)
    seconds = time.perf_counter() - start
    with open(report, "w") as fh:
        json.dump({"code": code, "seconds": seconds, "peak_bytes": max([vmhwm_bytes(), *peaks])}, fh)
    if script:
        return code
    from memfit.cli import exit_now

    exit_now(code)


if __name__ == "__main__":
    sys.exit(main())
