"""The smallest budget a streamed load needed, remembered, so that a budget far below it is refused at once.

Finding that a budget cannot hold even the streamed plan takes the whole load: the tokenizer, the model's
skeleton (transformers' modeling code, ~2 s of imports), a probe forward and the calibration, then a bisection
over the planner. Measured on the bundled MiniLM (2-core AMD EPYC with AVX-512 BF16): 4.0 s with a warm
calibration, 8.7 s cold, and the process passes a small budget while it loads (the tokenizer alone holds ~360
MiB for a 250k-piece vocabulary, docs/benchmarks.md). Each streamed load therefore records the smallest budget
its plan fitted and what the process held when the load began; a later load with the same model file and
settings, on the same CPU and versions, in a like process (one that holds about as much when its load begins: the
CLI, a fresh interpreter), refuses a budget below that smallest one (less :data:`FLOOR_TOLERANCE_BYTES`) before it
loads anything, naming a budget that works. A process that holds much more or less at the start is not like it
(one that has imported transformers already adds less while it loads, so its floor would understate a fresh one's),
nor are budgets near the floor, a changed model file, other settings or an unreadable record: they take the full
load.

Within the tolerance, what a process holds at the start does not say what it will hold before its first block: two
ways of starting the same ``memfit embed`` on all-mpnet-base-v2 held 38 MiB apart at the start of their loads and
355-356 MiB each before the first block (docs/benchmarks.md, "Session 23: long, train and the 10,000-text offload
run"), because what the one had already imported the other imports while it loads. So the difference only ever
errs one way: a process that holds less at the start lowers the floor that refuses, and one that holds more raises
the budget the refusal names, never the floor that refuses. A refusal from the record is then one the full load
would also give, and the budget it names is one the full load keeps.
Only the CPU, where the floor is the whole process's resident set: on CUDA the load measures device memory.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from memfit.defaults import VERSION
from memfit.engine.models import cpu_identity
from memfit.engine.checkpoint import weights_file
from memfit.engine.graph_cache import package_version
from memfit.memory.calibration import cache_dir, read_cache_entry, write_cache_entry
from memfit.memory.model import CPU_RESIDENT_DRIFT_BYTES
from memfit.memory.device import Device

FLOOR_FORMAT = 2

FLOOR_TOLERANCE_BYTES = 2 * CPU_RESIDENT_DRIFT_BYTES
"""How far below the recorded floor a budget must be to be refused without a load, and how far what a process
holds at the start may differ from the recording one's for the floor to apply. The floor moves between runs with
what the process holds (measured on MiniLM, four refusals in a row: the process held 342-346 MiB before the first
block and the named budget was 453-454 MiB); budgets within this of it take the full load and its own answer."""


@dataclass(frozen=True, slots=True)
class StreamedFloor:
    """What a streamed load of one model and settings needed: the smallest budget its plan fitted (the planner's
    bisection, before the drift allowance a refusal adds), what the process held when the load began (before the
    tokenizer), what it held when ``--offload auto`` weighed the resident plan against the streamed one (the tokenizer
    loaded, and with it whatever that imports: torch, where transformers loads it), and, for the refusal's message,
    what it held before the first block and the weights among that."""

    smallest_bytes: int
    held_at_start_bytes: int
    held_when_chosen_bytes: int
    baseline_bytes: int
    weights_bytes: int


def floor_key(
    model_dir: str, task: str, dtype: str, max_length: int | None, device: Device, calibrated: bool
) -> dict[str, object] | None:
    """What a recorded floor holds for: the weights file (path, size and modification time), the task, precision
    and window asked for, whether the plan was calibrated (the analytic model plans otherwise), the CPU and the
    versions; None where nothing would stream (no single local safetensors file) or off the CPU."""
    path = weights_file(model_dir)
    if path is None or device.type != "cpu":
        return None
    try:
        stat = path.stat()
    except OSError:
        return None
    return {
        "format": FLOOR_FORMAT,
        "weights": str(path.resolve()),
        "size": stat.st_size,
        "modified_ns": stat.st_mtime_ns,
        "task": task,
        "dtype": dtype,
        "max_length": max_length,
        "calibrated": calibrated,
        "cpu": cpu_identity(),
        "memfit": VERSION,
        "torch": package_version("torch"),
    }


def _floor_path(key: dict[str, object]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "streamed-floor" / f"{digest}.json"


def recall_floor(key: dict[str, object]) -> StreamedFloor | None:
    """The floor recorded for ``key``, or None (none yet, unreadable, or recorded for another key)."""
    return read_cache_entry(_floor_path(key), key, "floor", StreamedFloor)


def remember_floor(key: dict[str, object], floor: StreamedFloor) -> None:
    """Record ``floor`` for ``key``; a read-only cache directory only costs a later refusal its load."""
    write_cache_entry(_floor_path(key), key, "floor", asdict(floor), "the streamed plan's smallest budget")


def refusal_below_floor(floor: StreamedFloor, budget_bytes: int, held_now_bytes: int) -> str | None:
    """The refusal of ``budget_bytes`` when it is far below ``floor``; None when the full load must decide (the
    budget is near the floor, or the process is not like the recording one). What the process holds now beyond what
    the recording one held raises only the budget named, and what it holds less lowers only the floor that refuses
    (the module's docstring says why)."""
    moved = held_now_bytes - floor.held_at_start_bytes
    if abs(moved) > FLOOR_TOLERANCE_BYTES:
        return None
    if budget_bytes >= floor.smallest_bytes + min(moved, 0) - FLOOR_TOLERANCE_BYTES:
        return None
    more = max(moved, 0)
    works = floor.smallest_bytes + more + CPU_RESIDENT_DRIFT_BYTES
    return streamed_refusal(budget_bytes, floor.baseline_bytes + more, floor.weights_bytes, works, recorded=True)


def streamed_refusal(
    budget_bytes: int, baseline_bytes: int, weights_bytes: int, works_bytes: int, recorded: bool
) -> str:
    """The refusal of a budget that cannot hold even the streamed plan, naming ``works_bytes``: from this load's plan,
    or (``recorded``) from the floor an earlier load recorded."""
    held = "when this model was last loaded with these settings the process held" if recorded else "the process holds"
    return (
        f"the memory budget ({budget_bytes / 2**20:,.0f} MiB) cannot hold even the streamed plan: {held} "
        f"{baseline_bytes / 2**20:,.0f} MiB before the first block (runtime, the model's small parts and the layers "
        f"held at once, weights: {weights_bytes / 2**20:,.0f} MiB); raise --memory-budget to "
        f"{works_bytes / 2**20:,.0f} MiB, which works"
    )
