"""``memfit plan``: the memory plan of one model on one device against a budget, as a report.

Loads the model as :class:`~memfit.Encoder` would, calibrates it (or reads the cached calibration) and
reports weights, activation bytes per token, the attention term and the largest batch with its predicted
peak at a few lengths. Nothing is embedded.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass

from memfit.memory.calibration import Source
from memfit.engine.runtime import build_memory_plan
from memfit.memory.model import device_memory, resolve_budget_bytes

log = logging.getLogger("memfit")

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

    def to_dict(self) -> dict:
        return asdict(self)


def plan(model: str | os.PathLike | None = None, max_length: int | None = None,
         memory_budget: str | int | None = None, dtype: str = "auto", device: str = "auto",
         calibrate: bool = True) -> PlanReport:
    """Load ``model`` as :class:`~memfit.Encoder` would and report its memory plan against the budget:
    weights, activation bytes per token, the attention term, and the largest batch (with its predicted
    peak) at 128 / 256 / 512 tokens, for the lengths the window allows."""
    from transformers import AutoModel

    from memfit.memory.host_budget import host_budget
    from memfit.engine.models import (load_model, load_tokenizer, read_sentence_transformer_defaults, resolve_device,
                               resolve_dtype, resolve_max_length, resolve_model_name)
    from memfit.memory.planner import padded_length

    name = resolve_model_name(model)
    torch_device = resolve_device(device)
    dtype_name = resolve_dtype(dtype, torch_device)
    tokenizer = load_tokenizer(name)
    loaded = load_model(name, AutoModel, torch_device, dtype_name)
    window = resolve_max_length(max_length, loaded.config, tokenizer, read_sentence_transformer_defaults(name))
    # the same allowances as the embed job: token rows leave the device as float32, and input and output
    # in flight are reserved beside the batches
    budget_bytes = resolve_budget_bytes(memory_budget, device_memory(torch_device))
    memory = build_memory_plan(loaded, torch_device, budget_bytes,
                               output_bytes_per_token=4 * int(loaded.config.hidden_size), calibrate=calibrate,
                               reserved_bytes=host_budget(budget_bytes, torch_device).reserved_bytes)
    log.info(memory.describe())
    lengths = tuple(
        LengthPlan(length, memory.largest_batch(length),
                   int(memory.predicted_peak_bytes(max(1, memory.largest_batch(length)), length)
                       + memory.reserved_bytes))
        for length in PLAN_LENGTHS if length <= window
    )
    return PlanReport(
        model=name, device=str(torch_device), dtype=dtype_name, max_length=window, attention=memory.attention,
        source=memory.source, budget_bytes=memory.budget_bytes, baseline_bytes=memory.baseline_bytes,
        weights_bytes=memory.weights_bytes, bytes_per_token=memory.activations.bytes_per_token,
        bytes_per_attention_cell=memory.activations.bytes_per_attention_cell,
        max_batch_tokens=memory.batch_budget.max_batch_tokens, lengths=lengths,
        fits=memory.largest_batch(padded_length(window)) >= 1,
    )
