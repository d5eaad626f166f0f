"""``memfit plan``: the memory plan of one model on one device against a budget, as a report.

Loads the model as :class:`~memfit.Encoder` would, calibrates it (or reads the cached calibration) and
reports weights, activation bytes per token, the attention term and the largest batch with its predicted
peak at a few lengths. Nothing is embedded.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from memfit.memory.calibration import Source

PLAN_LENGTHS = (128, 256, 512)


@dataclass(frozen=True, slots=True)
class LengthPlan:
    """The largest batch at one padded length and the peak it is predicted to reach."""

    padded_length: int
    max_batch_size: int  # 0: not even one sequence of this length fits the budget
    predicted_peak_bytes: int


@dataclass(frozen=True, slots=True)
class PlanReport:
    """What ``memfit plan`` prints: the memory model of one model on one device, against a budget."""

    model: str
    device: str
    dtype: str
    backend: str
    max_length: int
    attention: str
    source: Source
    budget_bytes: int
    baseline_bytes: int
    weights_bytes: int
    bytes_per_token: float
    bytes_per_attention_cell: float
    max_batch_tokens: int
    lengths: tuple[LengthPlan, ...]
    fits: bool  # one window of max_length fits the budget at batch size 1
    execution: str = "resident"  # or "streamed": the layers read from the weights file (--offload)
    layer_batch_tokens: int | None = None  # streamed: the sub-batches one layer runs; max_batch_tokens is the block
    resident_needs_bytes: int | None = None  # about the least budget each way runs in (None: it cannot run so)
    streamed_needs_bytes: int | None = None
    backend_choice: str = ""  # why ``backend`` runs (``auto``: measured on this CPU, or its order)

    def to_dict(self) -> dict:
        return asdict(self)


def plan(
    model: str | os.PathLike | None = None,
    max_length: int | None = None,
    memory_budget: str | int | None = None,
    dtype: str = "auto",
    device: str = "auto",
    calibrate: bool = True,
    backend: str = "auto",
    offload: str = "auto",
) -> PlanReport:
    """Load ``model`` as :class:`~memfit.Encoder` would and report its memory plan against the budget:
    weights, activation bytes per token, the attention term, and the largest batch (with its predicted
    peak) at 128 / 256 / 512 tokens, for the lengths the window allows; ``offload`` as for
    :class:`~memfit.Encoder`. Beside the plan that runs, about the least budget the other one (resident or
    streamed) would need, from the checkpoint's sizes."""
    from memfit.engine.runtime import load_runtime
    from memfit.engine.checkpoint import checkpoint_sizes
    from memfit.engine.streamed import layers_held
    from memfit.memory.model import CPU_RESIDENT_DRIFT_BYTES
    from memfit.memory.planner import padded_length

    runtime = load_runtime(
        model,
        device=device,
        dtype=dtype,
        memory_budget=memory_budget,
        max_length=max_length,
        calibrate=calibrate,
        backend=backend,
        refuse=False,
        offload=offload,
    )
    memory, window = runtime.memory, runtime.max_length
    sizes = checkpoint_sizes(runtime.model_name, runtime.dtype) if runtime.quantize == "none" else None
    this_needs = memory.smallest_budget_bytes or _needs_bytes(
        memory.baseline_bytes + memory.reserved_bytes, memory.activations.predict(1, window)
    )  # streamed: the refusal's own figure (a block's fixed cost depends on the budget it is planned under)
    streamed = memory.layer_budget is not None
    other_needs = None
    if sizes is not None:
        beside = memory.baseline_bytes - memory.weights_bytes + memory.reserved_bytes + CPU_RESIDENT_DRIFT_BYTES
        other_weights = 2 * sizes.weights_bytes if streamed else sizes.streamed_bytes(layers_held(runtime.device))
        other_needs = beside + other_weights
    lengths = tuple(
        LengthPlan(
            length,
            memory.largest_batch(length),
            int(memory.predicted_peak_bytes(max(1, memory.largest_batch(length)), length) + memory.reserved_bytes),
        )
        for length in PLAN_LENGTHS
        if length <= window
    )
    return PlanReport(
        model=runtime.model_name,
        device=str(runtime.device),
        dtype=runtime.dtype,
        backend=runtime.backend.name,
        max_length=window,
        attention=memory.attention,
        source=memory.source,
        budget_bytes=memory.budget_bytes,
        baseline_bytes=memory.baseline_bytes,
        weights_bytes=memory.weights_bytes,
        bytes_per_token=memory.activations.bytes_per_token,
        bytes_per_attention_cell=memory.activations.bytes_per_attention_cell,
        max_batch_tokens=memory.batch_budget.max_batch_tokens,
        lengths=lengths,
        fits=memory.largest_batch(padded_length(window)) >= 1,
        execution="streamed" if streamed else "resident",
        layer_batch_tokens=memory.layer_budget.max_batch_tokens if memory.layer_budget is not None else None,
        resident_needs_bytes=other_needs if streamed else this_needs,
        streamed_needs_bytes=this_needs if streamed else other_needs,
        backend_choice=runtime.backend_choice,
    )


def _needs_bytes(held_bytes: float, batch_bytes: float) -> int:
    """The least budget whose room beside ``held_bytes`` (less the CPU's margin, ``memory.model.host_room``) holds
    ``batch_bytes``."""
    from memfit.memory.model import CPU_FRAGMENTATION_MARGIN, CPU_RESIDENT_DRIFT_BYTES

    return int(held_bytes + max(batch_bytes / (1 - CPU_FRAGMENTATION_MARGIN), batch_bytes + CPU_RESIDENT_DRIFT_BYTES))
