"""Where the test suite's time goes: the README's pytest command, every process it starts accounted for.

    python benchmarks/bench_suite.py [--workers 2] [--out benchmarks/results/suite.json] [-- PYTEST_ARGS ...]

Issue 33 holds the suite to 12 minutes on the slowest CPU drawn. On two cores the suite is bound by the CPU (both
cores stay busy while it runs), so what a change saves is CPU time, and wall time moves with the host's pace by
more than most changes save (docs/benchmarks.md, "The test suite's time"). This script shows the CPU time by what
spends it:

- **processes**: a ``sitecustomize`` on ``PYTHONPATH`` records, as each Python process the suite starts exits, its
  command, wall time, CPU time (its own, user + system) and whether it imported torch and transformers' models,
  with the test that started it. What writes no such record (a process killed by a kill -9 test, Ray's C++
  daemons, ``benchmarks/first_run.py``'s fresh install, which replaces ``PYTHONPATH``) is seen by a sampler that
  reads ``/proc/PID/stat`` of every process started since the run began, twice a second: its CPU time as last seen
  (the ``sampled`` column counts those processes). The table's last rows are this script's own CPU time (the
  sampling) and the machine's busy CPU time (``/proc/stat``) less all that: processes from before the run, a
  process's exit after its record, processes too short for the sampler.
- **tests**: a pytest plugin (``-p``) records each test's wall time, its worker's CPU time and its reaped
  children's.

Run it with nothing else on the machine (the runner waits for the CPUs to be quiet). The probe's ``sitecustomize``
stands in for any other one on the path during the run. Prints the tables; writes JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _measure import cpu_ticks, print_table, wait_for_quiet_cpu, write_json

ROOT = Path(__file__).resolve().parents[1]

PROCESS_TRACE = r"""
import atexit, json, os, sys, time

_started = time.time()


def _record():
    user, system = os.times()[:2]
    line = json.dumps({
        "pid": os.getpid(),
        "argv": [a[-120:] for a in sys.argv[:3]],
        "wall_s": round(time.time() - _started, 2),
        "cpu_s": round(user + system, 2),
        "torch": "torch" in sys.modules,
        "transformers_models": "transformers.modeling_utils" in sys.modules,
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0][:200],
    })
    fd = os.open(os.environ["MEMFIT_SUITE_PROCESSES"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, (line + "\n").encode())  # one write of one short line: whole among concurrent writers
    finally:
        os.close(fd)


if os.environ.get("MEMFIT_SUITE_PROCESSES"):
    atexit.register(_record)
"""

TEST_TIMELINE = r"""
import json, os, resource, time

import pytest


def _children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    started, cpu, children = time.time(), time.process_time(), _children_cpu()
    yield
    line = json.dumps({
        "test": item.nodeid,
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "start": started,
        "wall_s": round(time.time() - started, 3),
        "cpu_s": round(time.process_time() - cpu, 3),
        "children_cpu_s": round(_children_cpu() - children, 3),
    })
    with open(os.environ["MEMFIT_SUITE_TESTS"], "a") as fh:
        fh.write(line + "\n")
"""


class ProcessSampler(threading.Thread):
    """Every ``interval`` seconds, the CPU time of each process started since this sampler was made, from
    ``/proc/PID/stat`` (user + system), and its command line, both as last seen: a child read between its fork and
    its ``exec`` still shows its parent's command line, and Ray's workers retitle themselves (``ray::IDLE``)."""

    def __init__(self, interval: float = 0.5):
        super().__init__(daemon=True)
        self.interval = interval
        self.ticks_per_s = os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as fh:
            self.since_ticks = float(fh.read().split()[0]) * self.ticks_per_s
        self.seen: dict[tuple[int, int], dict] = {}  # (pid, start in ticks since boot): pid, argv, cpu_s
        self.finished = threading.Event()

    def run(self) -> None:
        while not self.finished.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self.finished.set()
        self.join()
        self.sample()

    def sample(self) -> None:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as fh:
                    stat = fh.read()
            except OSError:  # gone since the listing
                continue
            fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": field 3, the state, onwards
            start = int(fields[19])
            if start < self.since_ticks:
                continue
            record = self.seen.setdefault((int(entry.name), start), {"pid": int(entry.name), "argv": []})
            record["ppid"] = int(fields[1])
            record["argv"] = _argv(entry.name) or record["argv"]  # empty once it is a zombie
            record["cpu_s"] = (int(fields[11]) + int(fields[12])) / self.ticks_per_s


def _argv(pid: str) -> list[str]:
    """A process's command line as a traced Python process's ``sys.argv`` reads: the interpreter and its options
    left out, ``-m NAME`` as that module's file."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []
    if argv and Path(argv[0]).name.startswith("python"):
        argv = argv[1:]
        while argv and argv[0].startswith("-") and argv[0] not in ("-m", "-c"):
            argv = argv[1:] if argv[0] != "-X" else argv[2:]
        if argv[:1] == ["-m"] and len(argv) > 1:
            module = argv[1].replace(".", "/")
            argv = [module + ("/__main__.py" if "/" not in module else ".py"), *argv[2:]]
    return argv[:3]


def process_kind(argv: list[str], test: str | None) -> str:
    """What a process was, from its command line: memfit's own commands and children by role, Ray's workers.
    ``test``: the test that started it ("" for none), None where that is not known (a sampled process)."""
    if not argv:
        return "(no command line: a kernel thread, or gone before it was read)"
    first = argv[0].replace("\\", "/")
    if first.endswith("pytest/__main__.py"):
        return "pytest (controller)"
    if first == "-c" and test == "":  # execnet's worker outlives every test it runs
        return "pytest-xdist worker (in-process tests)"
    if first.endswith("memfit/__main__.py"):
        return "memfit command"
    if first.endswith("memfit/engine/openvino/conversion.py"):
        return "OpenVINO conversion child"
    if first.endswith("ray/_private/workers/default_worker.py") or first.startswith("ray::"):
        return "Ray worker"
    if first == "-c":
        return "python -c script of a test"
    name = Path(first.split(" ")[0]).name  # Chromium writes its whole command line into its first argument
    return "Chromium (the /docs browser test)" if "chrom" in name.lower() else name


def summarize(
    processes: list[dict], sampled: list[dict], tests: list[dict], wall_s: float, busy_s: float, sampling_s: float
) -> dict:
    """The tables: ``processes`` (the trace's records) and the ``sampled`` processes that wrote none, by kind, and
    ``sampling_s``, this script's own CPU time."""
    by_kind: dict[str, dict] = collections.defaultdict(
        lambda: {
            "processes": 0,
            "sampled": 0,
            "cpu_s": 0.0,
            "wall_s": 0.0,
            "with_torch": 0,
            "with_transformers_models": 0,
        }
    )
    for record in processes:
        row = by_kind[process_kind(record["argv"], record["test"])]
        row["processes"] += 1
        row["cpu_s"] += record["cpu_s"]
        row["wall_s"] += record["wall_s"]
        row["with_torch"] += record["torch"]
        row["with_transformers_models"] += record["transformers_models"]
    traced_pids = {record["pid"] for record in processes}
    argv_of = {record["pid"]: record["argv"] for record in sampled}  # as the sampler writes them, to compare
    for record in sampled:
        if record["pid"] not in traced_pids:
            kind = process_kind(record["argv"], None)
            if record["argv"] and record["argv"] == argv_of.get(record["ppid"]):  # last seen between fork and exec
                kind = f"{kind}: a child, seen before its exec"
            row = by_kind[kind]
            row["processes"] += 1
            row["sampled"] += 1
            row["cpu_s"] += record["cpu_s"]
    accounted = sum(row["cpu_s"] for row in by_kind.values()) + sampling_s
    kinds = [{"kind": kind, **{k: round(v, 1) for k, v in row.items()}} for kind, row in by_kind.items()]
    kinds.sort(key=lambda row: -row["cpu_s"])
    kinds.append({"kind": "this script's sampling", "cpu_s": round(sampling_s, 1)})
    kinds.append(
        {
            "kind": "other (processes from before the run, exits after their trace, short ones unseen)",
            "cpu_s": round(busy_s - accounted, 1),
        }
    )

    by_file: dict[str, dict] = collections.defaultdict(lambda: {"tests": 0, "wall_s": 0.0, "cpu_s": 0.0})
    for test in tests:
        row = by_file[test["test"].split("::")[0]]
        row["tests"] += 1
        row["wall_s"] += test["wall_s"]
        row["cpu_s"] += test["cpu_s"] + test["children_cpu_s"]
    files = [{"file": name, **{k: round(v, 1) for k, v in row.items()}} for name, row in by_file.items()]
    files.sort(key=lambda row: -row["wall_s"])
    slowest = sorted(tests, key=lambda test: -test["wall_s"])[:25]
    return {
        "wall_s": round(wall_s, 1),
        "busy_cpu_s": round(busy_s, 1),
        "cores_busy": round(busy_s / wall_s, 2),
        "accounted_cpu_s": round(accounted, 1),
        "test_time_s": round(sum(test["wall_s"] for test in tests), 1),
        "conversions": sum(
            process_kind(record["argv"], record["test"]) == "OpenVINO conversion child" for record in processes
        ),
        "processes_by_kind": kinds,
        "files": files,
        "slowest_tests": [
            {k: test[k] for k in ("test", "worker", "wall_s", "cpu_s", "children_cpu_s")} for test in slowest
        ],
        # every test and every traced process, to find where a file's CPU time goes without running the suite again
        "tests_by_cpu": sorted(
            ({k: test[k] for k in ("test", "wall_s", "cpu_s", "children_cpu_s")} for test in tests),
            key=lambda test: -(test["cpu_s"] + test["children_cpu_s"]),
        ),
        "traced_processes": sorted(
            (
                {
                    "kind": process_kind(record["argv"], record["test"]),
                    "test": record["test"],
                    "argv": record["argv"],
                    "cpu_s": record["cpu_s"],
                    "wall_s": record["wall_s"],
                    "torch": record["torch"],
                }
                for record in processes
            ),
            key=lambda record: -record["cpu_s"],
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (scripts/test.sh runs 2)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "suite.json"))
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --), e.g. a folder")
    args = parser.parse_args()

    quiet = wait_for_quiet_cpu(120)
    with tempfile.TemporaryDirectory(prefix="memfit-suite-") as probe:
        Path(probe, "sitecustomize.py").write_text(PROCESS_TRACE)
        Path(probe, "memfit_suite_timeline.py").write_text(TEST_TIMELINE)
        processes_file, tests_file = Path(probe, "processes.jsonl"), Path(probe, "tests.jsonl")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [probe, os.environ.get("PYTHONPATH")])),
            "MEMFIT_SUITE_PROCESSES": str(processes_file),
            "MEMFIT_SUITE_TESTS": str(tests_file),
        }
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "memfit_suite_timeline"]
        if args.workers > 0:
            command += ["-n", str(args.workers), "--dist", "worksteal"]
        sampler = ProcessSampler()
        busy_before, started, own_cpu = cpu_ticks()[0], time.perf_counter(), time.process_time()
        sampler.start()
        done = subprocess.run(command + args.pytest_args, cwd=ROOT, env=env, capture_output=True, text=True)
        sampler.stop()
        wall_s = time.perf_counter() - started
        busy_s = (cpu_ticks()[0] - busy_before) / sampler.ticks_per_s
        read = lambda path: [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []  # noqa: E731
        sampling_s = time.process_time() - own_cpu
        summary = summarize(
            read(processes_file), list(sampler.seen.values()), read(tests_file), wall_s, busy_s, sampling_s
        )
    outcome = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    # pytest's short summary names each test that failed; the rest of its output is not kept, so say them here
    failures = [line for line in done.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    print(f"pytest: exit {done.returncode}, {outcome}")
    for line in failures:
        print(f"  {line}")
    print(
        f"wall {summary['wall_s']:.1f} s, busy CPU {summary['busy_cpu_s']:.1f} s ({summary['cores_busy']:.2f} cores), "
        f"test time {summary['test_time_s']:.1f} s, {summary['conversions']} OpenVINO conversions\n"
    )
    print_table(
        summary["processes_by_kind"],
        [
            ("kind", "process", ""),
            ("processes", "n", "d"),
            ("sampled", "sampled", "d"),
            ("cpu_s", "CPU s", ".1f"),
            ("wall_s", "wall s", ".1f"),
            ("with_torch", "torch", "d"),
            ("with_transformers_models", "transformers models", "d"),
        ],
    )
    print()
    print_table(
        summary["files"][:20],
        [
            ("file", "file", ""),
            ("tests", "tests", "d"),
            ("wall_s", "test time s", ".1f"),
            ("cpu_s", "CPU s (worker + reaped children)", ".1f"),
        ],
    )
    write_json(
        args.out,
        {
            "command": command + args.pytest_args,
            "exit_code": done.returncode,
            "outcome": outcome,
            "failures": failures,
            **quiet,
            **summary,
        },
    )
    print(f"\nwrote {args.out}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
