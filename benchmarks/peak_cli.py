"""Run the ``memfit`` CLI in this process and write its whole-run peak resident set and time as JSON.

    python benchmarks/peak_cli.py REPORT.json embed in.jsonl -o out/ --memory-budget 1GiB ...

The peak is read here, from the kernel (``VmHWM`` in ``/proc/self/status``), at the end and just before
each of memfit's own resets of the high-water mark (memfit resets it to measure its calibration probes),
so it covers the whole run, model loading included: the quantity ``--memory-budget`` bounds. Used by
``bench_memory.py`` and by the budget tests (``tests/memory/test_budget.py``). Linux only.
"""

import json
import sys
import time

import memfit.memory.peak


def vmhwm_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def main() -> int:
    peaks = []
    reset = memfit.memory.peak.reset_rss_peak

    def remember_then_reset() -> None:
        peaks.append(vmhwm_bytes())
        reset()

    memfit.memory.peak.reset_rss_peak = remember_then_reset
    from memfit.cli import main as memfit_main

    start = time.perf_counter()
    code = memfit_main(sys.argv[2:])
    seconds = time.perf_counter() - start
    with open(sys.argv[1], "w") as fh:
        json.dump({"code": code, "seconds": seconds, "peak_bytes": max([vmhwm_bytes(), *peaks])}, fh)
    return code


if __name__ == "__main__":
    sys.exit(main())
