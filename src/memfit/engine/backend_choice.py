"""``--backend auto`` between the compiled CPU runtimes: which one is fastest here is measured, once per CPU.

Why measured: which runtime is fastest depends on the CPU, and not in a way a table of flags would say. On the
AVX2-only AMD EPYC (Zen 3) ONNX Runtime ran all-MiniLM-L6-v2 at 203 texts/s where OpenVINO's fp32 graph ran 166
(issue 32); on the AVX-512 BF16 EPYC OpenVINO's bf16 graph ran 277.8 against ONNX Runtime's 183.4
(docs/benchmarks.md, "ONNX Runtime").

How: when ``auto``'s candidates for a request include more than one measured runtime (a :class:`BackendKind` with
a ``runtime_version``), the first such load on a CPU runs a probe in a child process
(``python -m memfit.engine.backend_choice``): it loads the model on each of them and runs the same forwards on
each, alternating, :data:`PROBE_ROUNDS` times (random ids: :data:`PROBE_SHAPE`), and keeps each one's best time.
A runtime later in ``auto``'s order runs first only when it was at least :data:`MARGIN` faster, so the host's
noise does not flip the order. The verdict is cached (``<cache>/backend-choice/``) for the CPU (its model name and
instruction sets), the threads, the precision and every candidate's version, as the quality guard's passes are;
later loads read it. Where a runtime could not load the model (OpenVINO refuses ModernBERT's graph), the verdict is
kept for that model alone: it says nothing of which runtime is faster on this CPU. In a child because two runtimes
loaded one after the other in the job's own process leave the first one's memory behind, outside the budget; the
child gives everything back when it exits. It costs the first such run on a CPU the other runtime's conversion and
~5 s of probing (docs/precision.md).

``MEMFIT_BACKEND_ORDER`` (backend names, comma-separated) sets the order instead, without measuring: for a
deployment that must run the same backend on every machine, and for memfit's own test suite, whose tests pin a
backend where they depend on one.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from memfit.engine.backend import BackendKind, LoadRequest
from memfit.engine.graph_cache import cache_lock
from memfit.engine.models import cpu_identity
from memfit.engine.process import compute_threads, set_compute_threads
from memfit.errors import MemfitError
from memfit.memory.calibration import cache_dir, read_cache_entry, write_cache_entry
from memfit.memory.device import Device

CHOICE_FORMAT = 3
"""Bump when what a verdict measured no longer stands (2: ONNX Runtime's graph fuses its attention; 3: a verdict in
which a runtime could not load its model was kept for every model), so every CPU measures again."""

PROBE_SHAPE = (16, 64)
"""Windows and tokens of one timed forward: short texts, where the runtimes' fixed costs show as well as their
matmuls (MiniLM: ~45 GFLOP a forward; all-mpnet-base-v2: ~0.17 TFLOP)."""

PROBE_ROUNDS = 3

MARGIN = 1.05
"""How much faster a runtime later in ``auto``'s order must measure to run first."""

ORDER_VARIABLE = "MEMFIT_BACKEND_ORDER"

BY_NAME = "asked for by name"
"""Why a backend runs that ``--backend`` named (nothing is measured then)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the probe measured: tokens per second on each measured runtime (None: it did not load), and the order
    ``auto`` takes them in from now on."""

    tokens_per_s: dict[str, float | None]
    order: list[str]
    measured_on: str  # the model the probe ran

    def reason(self) -> str:
        """Why the first of :attr:`order` runs, for ``memfit plan``, the manifest and ``/info``."""
        rates = ", ".join(
            f"{name} {rate:,.0f}" if rate is not None else f"{name} did not load"
            for name, rate in self.tokens_per_s.items()
        )
        return f"auto: the fastest measured on this CPU (tokens/s: {rates}; measured on {self.measured_on})"


def measured_kinds(candidates: Sequence[BackendKind]) -> list[BackendKind]:
    return [kind for kind in candidates if kind.runtime_version is not None]


def choice_key(candidates: Sequence[BackendKind], dtype: str, quantize: str) -> dict[str, object]:
    """What a verdict holds for: the CPU, the threads, the precision, and each measured runtime's version."""
    return {
        "format": CHOICE_FORMAT,
        "cpu": cpu_identity(),
        "threads": compute_threads(),
        "dtype": dtype,
        "quantize": quantize,
        "runtimes": {kind.name: kind.runtime_version() for kind in measured_kinds(candidates)},  # type: ignore[misc]
    }


def _verdict_path(key: dict[str, object]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "backend-choice" / f"{digest}.json"


def ordered_by_measurement(
    candidates: list[BackendKind], model_name: str, task: str, dtype: str, quantize: str
) -> tuple[list[BackendKind], str]:
    """``candidates`` in the order ``auto`` tries them on this CPU, and why the first runs. With fewer than two
    measured runtimes among them nothing is measured: ``auto``'s own order stands."""
    if os.environ.get(ORDER_VARIABLE):
        order = [name.strip() for name in os.environ[ORDER_VARIABLE].split(",")]
        return _ordered(candidates, order), f"auto: the order {ORDER_VARIABLE} sets ({', '.join(order)})"
    measured = measured_kinds(candidates)
    if len(measured) < 2:
        return candidates, "auto: the first backend that runs this request"
    key = choice_key(candidates, dtype, quantize)
    # a runtime that could not load this model says nothing of the CPU: that verdict holds for this model alone
    model_key = {**key, "model": model_name}
    path, model_path = _verdict_path(key), _verdict_path(model_key)

    def cached() -> Verdict | None:
        return read_cache_entry(model_path, model_key, "verdict", Verdict) or read_cache_entry(
            path, key, "verdict", Verdict
        )

    verdict = cached()
    if verdict is None:
        with cache_lock(path.with_suffix(".lock")):  # processes that start at once (Ray's workers) measure once
            verdict = cached()
            if verdict is None:
                verdict = _measure(measured, model_name, task, dtype, quantize)
                loaded = [rate is not None for rate in verdict.tokens_per_s.values()]
                if all(loaded):
                    write_cache_entry(path, key, "verdict", asdict(verdict), "the backend choice")
                elif any(loaded):  # a failed probe is not kept
                    write_cache_entry(model_path, model_key, "verdict", asdict(verdict), "the backend choice")
    ordered = _ordered(candidates, verdict.order)
    return ordered, verdict.reason()


def _ordered(candidates: list[BackendKind], order: list[str]) -> list[BackendKind]:
    """``candidates`` with those named in ``order`` first, in that order, and the rest after them as they were."""
    rank = {name: i for i, name in enumerate(order)}
    return sorted(candidates, key=lambda kind: (rank.get(kind.name, len(rank)), candidates.index(kind)))


def _measure(measured: list[BackendKind], model_name: str, task: str, dtype: str, quantize: str) -> Verdict:
    """Run the probe child; a probe that fails keeps ``auto``'s own order (and says so in the verdict)."""
    names = [kind.name for kind in measured]
    threads = str(compute_threads())  # the child runs with this process's threads, as the verdict's key says
    command = [sys.executable, "-m", "memfit.engine.backend_choice", model_name, task, dtype, quantize, threads, *names]
    result = subprocess.run(command, capture_output=True, text=True)
    try:
        rates = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        rates = {name: None for name in names}
    return Verdict(rates, order_of(names, rates), model_name)


def order_of(names: list[str], rates: dict[str, float | None]) -> list[str]:
    """``names`` (``auto``'s order) reordered by measured speed: one later in the order goes before an earlier one
    only when it was at least :data:`MARGIN` faster; one that did not load goes last."""
    order: list[str] = []
    for name in names:
        rate = rates.get(name)
        place = len(order)
        while place > 0 and rate is not None and (rates.get(order[place - 1]) or 0.0) * MARGIN <= rate:
            place -= 1
        order.insert(place, name)
    return order


def _probe_main(model_name: str, task: str, dtype: str, quantize: str, threads: int, names: list[str]) -> int:
    """The child of :func:`_measure`: load the model on each runtime, time the same forwards on each, alternating,
    and print ``{name: tokens/s}`` as the last line of stdout."""
    from memfit.engine.models import load_tokenizer
    from memfit.engine.registry import BACKENDS

    set_compute_threads(threads)
    tokenizer = load_tokenizer(model_name)
    request = LoadRequest(
        model_name,
        task,  # type: ignore[arg-type]
        Device("cpu"),
        dtype,  # type: ignore[arg-type]
        quantize,  # type: ignore[arg-type]
        "token_type_ids" in tokenizer.model_input_names,
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        tokenizer=tokenizer,
        dtype_was_auto=True,
    )
    probes = {}
    for name in names:
        try:
            network = BACKENDS[name].load(request).network
        except MemfitError:
            continue
        network.probe(*PROBE_SHAPE)  # warm-up: the first forward builds kernels
        probes[name] = network.probe
    best = {name: float("inf") for name in probes}
    for _ in range(PROBE_ROUNDS):
        for name, probe in probes.items():
            start = time.perf_counter()
            probe(*PROBE_SHAPE)
            best[name] = min(best[name], time.perf_counter() - start)
    tokens = PROBE_SHAPE[0] * PROBE_SHAPE[1]
    print(json.dumps({name: (tokens / best[name] if name in best else None) for name in names}))
    return 0


if __name__ == "__main__":
    sys.exit(_probe_main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6:]))
