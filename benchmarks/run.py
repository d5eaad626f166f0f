"""One runner for the benchmarks: run the scenarios of ``scenarios.toml`` and say which figures of
docs/benchmarks.md they reproduce.

    python benchmarks/run.py                    # list the scenarios
    python benchmarks/run.py backends refusals  # run these, one after another
    python benchmarks/run.py --all              # every scenario whose --set values are given
    python benchmarks/run.py --compare refusals # only compare the JSON an earlier run left
    python benchmarks/run.py prompts --set e5=DIR   # a scenario that needs a model path

Each scenario is a benchmark script's command line (run as a fresh process, its output JSON in
``benchmarks/results/run/NAME.json``) and the figures it measured for the docs, each with the noise within which
a new measurement counts as the same figure. The runner holds the benchmark lock (``/tmp/memfit-bench.lock``)
for the whole run, so no two benchmarks share the cores, and waits for the CPUs to be quiet before each
scenario. It prints one table, figure by figure (the docs' value, the new one, their ratio, within noise or
not), writes it to ``benchmarks/results/run/summary.json`` with the machine's facts, and exits 1 when a
scenario failed or a figure fell outside its noise. Not a test: the figures are machine-bound.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib
from dataclasses import dataclass, field
from typing import Any, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _measure  # noqa: E402

SCENARIOS = os.path.join(HERE, "scenarios.toml")
RESULTS = os.path.join(HERE, "results", "run")
LOCK = "/tmp/memfit-bench.lock"


@dataclass(frozen=True)
class Figure:
    """A figure of the docs and where the scenario's JSON holds its new measurement."""

    what: str
    select: str
    docs: float
    noise: float


@dataclass(frozen=True)
class Scenario:
    name: str
    about: str
    docs: str
    command: list[str]
    figures: list[Figure]
    needs: dict[str, str] = field(default_factory=dict)

    @property
    def result_path(self) -> str:
        return os.path.join(RESULTS, f"{self.name}.json")

    def command_line(self, values: dict[str, str]) -> list[str]:
        """The script's path and arguments with each ``{NAME}`` of :attr:`needs` filled from ``values`` (``--set``);
        ValueError names what is missing and where to get it."""
        missing = [f"--set {name}=... ({what})" for name, what in self.needs.items() if name not in values]
        if missing:
            raise ValueError(f"{self.name} needs {'; '.join(missing)}")
        script, *arguments = self.command
        return [os.path.join(HERE, script), *(argument.format(**values) for argument in arguments)]


def load_scenarios(path: str = SCENARIOS) -> dict[str, Scenario]:
    with open(path, "rb") as fh:
        entries = tomllib.load(fh)["scenario"]
    scenarios = {}
    for entry in entries:
        figures = [Figure(**figure) for figure in entry.pop("figures")]
        scenario = Scenario(figures=figures, **entry)
        if scenario.name in scenarios:
            raise SystemExit(f"{path}: two scenarios are called {scenario.name!r}")
        scenarios[scenario.name] = scenario
    return scenarios


def select(payload: Any, path: str) -> Any:
    """The value at ``path`` in a benchmark's JSON: keys joined by "."; in a list, a segment ``key=value`` picks
    the first element whose ``key`` is ``value`` (compared as text) and a number picks by position (a list of
    figures, one per worker). KeyError names the segment that found nothing."""
    value = payload
    for segment in path.split("."):
        if isinstance(value, list) and segment.isdigit():
            value = value[int(segment)] if int(segment) < len(value) else None
        elif isinstance(value, list):
            key, _, wanted = segment.partition("=")
            value = next((item for item in value if isinstance(item, dict) and str(item.get(key)) == wanted), None)
        elif isinstance(value, dict):
            value = value.get(segment)
        else:
            value = None
        if value is None:
            raise KeyError(f"{path}: nothing at {segment!r}")
    return value


def compare(scenario: Scenario, payload: dict) -> list[dict]:
    """One row per figure: the docs' value, the measured one, their ratio and whether it is within noise."""
    rows = []
    for figure in scenario.figures:
        row: dict[str, Any] = {"scenario": scenario.name, "figure": figure.what, "docs": figure.docs}
        try:
            measured = float(select(payload, figure.select))
        except (KeyError, TypeError, ValueError) as missing:
            rows.append({**row, "error": str(missing), "within_noise": False})
            continue
        ratio = measured / figure.docs if figure.docs else None
        difference = abs(measured - figure.docs) / abs(figure.docs) if figure.docs else abs(measured)
        rows.append(
            {
                **row,
                "measured": measured,
                "ratio": ratio,
                "noise": figure.noise,
                "within_noise": difference <= figure.noise + 1e-12,
            }
        )
    return rows


def run_scenario(scenario: Scenario, values: dict[str, str]) -> dict:
    """Run the scenario's command in a fresh process; what happened (exit code, seconds, the CPU beforehand)."""
    os.makedirs(RESULTS, exist_ok=True)
    if os.path.exists(scenario.result_path):
        os.remove(scenario.result_path)  # a failed run must not be compared with an earlier run's JSON
    quiet = _measure.wait_for_quiet_cpu(300)
    command = [sys.executable, *scenario.command_line(values), "--out", scenario.result_path]
    print(f"\n== {scenario.name}: {scenario.about}\n   {' '.join(command)}", flush=True)
    start = time.perf_counter()
    code = subprocess.run(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}).returncode
    return {"scenario": scenario.name, "exit_code": code, "seconds": round(time.perf_counter() - start, 1), **quiet}


@contextlib.contextmanager
def benchmark_lock() -> Iterator[None]:
    """The lock every benchmark run takes (``flock /tmp/memfit-bench.lock``), held inside the ``with``."""
    with open(LOCK, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for {LOCK}: another benchmark is running", flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def main(argv: list[str] | None = None) -> int:
    scenarios = load_scenarios()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="SCENARIO", help=f"from {', '.join(scenarios)}")
    parser.add_argument("--all", action="store_true", help="every scenario whose --set values are given")
    parser.add_argument("--compare", action="store_true", help="do not run: compare the JSON of an earlier run")
    parser.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="what a scenario needs, e.g. e5=DIR"
    )
    args = parser.parse_args(argv)
    values = {name: value for name, _, value in (item.partition("=") for item in args.set)}
    names = args.names
    if args.all:  # every scenario whose needs are given
        names = [name for name, scenario in scenarios.items() if set(scenario.needs) <= set(values)]
        for name in scenarios.keys() - set(names):
            print(f"skipped {name}: it needs {', '.join(f'--set {need}=...' for need in scenarios[name].needs)}")
    if not names:
        for scenario in scenarios.values():
            print(f"{scenario.name:10s} {scenario.about}\n{'':10s} docs: {scenario.docs}")
            for name, what in scenario.needs.items():
                print(f"{'':10s} needs --set {name}=...: {what}")
        return 0
    unknown = [name for name in names if name not in scenarios]
    if unknown:
        parser.error(f"unknown scenario {', '.join(unknown)}; choose from {', '.join(scenarios)}")
    runs = []
    if not args.compare:
        for name in names:
            try:
                scenarios[name].command_line(values)
            except ValueError as missing:
                parser.error(str(missing))
        with benchmark_lock():
            runs = [run_scenario(scenarios[name], values) for name in names]
    rows = []
    for name in names:
        scenario = scenarios[name]
        if not os.path.exists(scenario.result_path):
            failure = {"scenario": name, "figure": "(all)", "error": "no result: the run failed", "within_noise": False}
            rows.append(failure)
            continue
        with open(scenario.result_path) as fh:
            rows += compare(scenario, json.load(fh))
    facts = _measure.machine_facts()
    print(
        f"\nmachine: {facts['cpu_model']} (family/model/stepping {facts['cpu_family_model_stepping']}), "
        f"{', '.join(facts['cpu_flags_of_interest'])}, {facts['usable_cores']} cores"
    )
    _measure.print_table(
        # print_table names a row with an error by its "method"
        [{**row, "method": f"{row['scenario']}: {row['figure']}"} for row in rows],
        [
            ("scenario", "scenario", ""),
            ("figure", "figure", ""),
            ("docs", "docs", "g"),
            ("measured", "measured", ".5g"),
            ("ratio", "ratio", ".3f"),
            ("noise", "noise ±", ".0%"),
            ("within_noise", "same", lambda ok: "yes" if ok else "NO"),
        ],
    )
    summary = os.path.join(RESULTS, "summary.json")
    print("wrote", _measure.write_json(summary, {"runs": runs, "figures": rows}))
    failed = any(run["exit_code"] != 0 for run in runs) or not all(row["within_noise"] for row in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
