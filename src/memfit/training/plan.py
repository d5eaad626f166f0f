"""The training memory model: how much of the budget activations may take, calibrated on the model.

:func:`plan_training` predicts the peak as

    baseline (process + fp32 master weights) + gradients (4 B/param) + AdamW moments (8 B/param)
    + scratch (2 x 4 B x the largest parameter: AdamW temporaries, the embeddings' dense gradient)
    [+ a bf16/fp16 copy of the weights under autocast (2 B/param)] + micro_batch_tokens x bytes_per_token

``bytes_per_token`` is calibrated on the model itself (:func:`calibrate_and_plan`), with probes small
enough to fit any budget that training fits: forwards on 1 and 2 copies of 32- and 64-token slices of
the longest example count the bytes autograd saves for backward; the 2-minus-1 differences are the cost
of one more sequence at two lengths, which separates a per-token term from the attention's length^2
term, and both are extrapolated to the longest example (times a safety factor for backward's working
memory; on the CPU a further 20% of the room is left for heap fragmentation). With gradient
checkpointing only each layer's input is kept plus one layer's activations while that layer is
recomputed. Checkpointing turns on only when a single longest example does not fit without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import asdict, dataclass
from collections.abc import Callable
from typing import TypedDict, TypeVar, cast

import torch

from memfit.data.chunking import Window
from memfit.engine.batches import free_cached_memory, pad_windows
from memfit.defaults import CHECKPOINTING_CHOICES
from memfit.errors import ConfigError, DoesNotFitError
from memfit.memory.model import (
    ActivationModel,
    PeakMeter,
    budget_from_bytes,
    device_memory,
    hold_allocator_to_budget,
    resolve_budget_bytes,
)
from memfit.memory.peak import release_host_memory
from memfit.memory.planner import BatchBudget, padded_length
from memfit.data.relation import Examples
from memfit.memory.device import Device, torch_dtype

GRAD_BYTES_PER_PARAM = 4  # fp32 gradients of the fp32 master weights
ADAMW_BYTES_PER_PARAM = 8  # exp_avg + exp_avg_sq, fp32
AUTOCAST_BYTES_PER_PARAM = 2  # autocast's cached bf16/fp16 copy of each weight
CPU_TRAINING_MARGIN = 0.2
"""Part of the activation room kept free on the CPU. Training's micro-batches come in many shapes, and
the resident set drifts up with them (oneDNN's per-shape kernel cache, glibc heap fragmentation:
measured +0.2 GiB over 4 epochs of MiniLM at a 1.25 GiB budget, heap trimmed after each step); the
per-step re-fit follows the drift, this margin absorbs what one step adds before it is seen."""
LARGEST_PARAM_SCRATCH_COPIES = 2
"""Temporaries of the largest parameter's size that a step holds on top of the gradients. The
single-tensor AdamW step computes ``exp_avg_sq.sqrt() / bias_correction`` (two such tensors alive at
once) for one parameter at a time; and every micro-batch after the first builds the word embeddings'
dense gradient next to the accumulated one, while the heap still holds that micro-batch's freed
activations. Measured on all-MiniLM-L6-v2 (45 MiB embeddings), AMD EPYC: the optimizer step raised the
resident set by 86 MiB over the gradients, a later micro-batch's backward by ~45 MiB over its
activations; with one copy counted a run at an 880 MiB budget peaked at 923 MiB (issue 12)."""
ACTIVATION_SAFETY = 1.3
"""Saved tensors are most of a step's peak, not all of it: backward holds the gradient of one layer's
activations next to them, and the allocator keeps some slack. Measured peaks stay under this factor."""


class MicroBudgetDict(TypedDict):
    """A micro-batch's :class:`~memfit.memory.planner.BatchBudget` as ``metrics.json`` stores it."""

    max_batch_tokens: int
    max_batch_seqs: int
    max_attention_cells: int | None


class TrainPlanDict(TypedDict):
    """:meth:`TrainPlan.as_dict`: the plan's fields and the figures derived from them, as ``metrics.json``
    stores them under ``plan``."""

    budget_bytes: int
    baseline_bytes: int
    state_bytes: int
    optimizer_bytes: int
    full_bytes_per_token: float
    checkpointed_bytes_per_token: float
    gradient_checkpointing: bool
    checkpointing: str
    dtype: str
    batch_size: int
    max_length: int
    longest_padded: int
    micro_budget: MicroBudgetDict
    measured_bytes_per_token: float | None
    micro_batch_at_longest: int
    bytes_per_token: float


@dataclass(frozen=True, slots=True)
class TrainPlan:
    """The trainer's memory decision, in bytes and tokens (printed and stored in ``metrics.json``)."""

    budget_bytes: int
    baseline_bytes: int  # the process before training state: runtime + fp32 weights
    state_bytes: int  # gradients + AdamW moments (+ autocast weight copies, AdamW scratch)
    optimizer_bytes: int  # the AdamW moments within state_bytes: held from the first step on
    full_bytes_per_token: float  # activations per padded token of a micro-batch, safety factor included
    checkpointed_bytes_per_token: float  # the same with gradient checkpointing
    gradient_checkpointing: bool  # whether the run starts with it on
    checkpointing: str  # what was asked: auto (memfit may turn it on later) | on | off (defaults.CHECKPOINTING_CHOICES)
    dtype: str
    batch_size: int  # effective batch: examples per optimizer step
    max_length: int
    longest_padded: int  # padded length of the longest training example
    micro_budget: BatchBudget
    measured_bytes_per_token: float | None = None  # one longest example's real cost per token (CPU), if measured

    @property
    def auto_checkpointing(self) -> bool:
        """Whether memfit may turn checkpointing on later (not forced off or on)."""
        return self.checkpointing == "auto"

    @property
    def bytes_per_token(self) -> float:
        """Activations per padded token under the chosen checkpointing."""
        return self.bytes_per_token_with(self.gradient_checkpointing)

    def bytes_per_token_with(self, checkpointing: bool) -> float:
        """Activations per padded token with or without checkpointing (the trainer may turn it on later)."""
        return self.checkpointed_bytes_per_token if checkpointing else self.full_bytes_per_token

    @property
    def micro_batch_at_longest(self) -> int:
        """Examples per micro-batch when all are as long as the longest one."""
        return max(1, min(self.batch_size, self.micro_budget.capacity(self.longest_padded)))

    def describe(self) -> str:
        gib = 2**30
        micro = self.micro_batch_at_longest
        steps = -(-self.batch_size // micro)
        return (
            f"training plan: budget {self.budget_bytes / gib:.2f} GiB = baseline {self.baseline_bytes / gib:.2f} "
            f"+ gradients/AdamW {self.state_bytes / gib:.2f} + activations "
            f"({self.bytes_per_token / 1024:.1f} KiB/token, up to {self.micro_budget.max_batch_tokens} padded "
            f"tokens per micro-batch); {self.dtype}, gradient checkpointing "
            f"{'on' if self.gradient_checkpointing else 'off'}; effective batch {self.batch_size} = up to "
            f"{steps} micro-batches of {micro} at the longest length {self.longest_padded}"
        )

    def as_dict(self) -> TrainPlanDict:
        out = asdict(self)
        out["micro_budget"] = asdict(self.micro_budget)
        out["micro_batch_at_longest"] = self.micro_batch_at_longest
        out["bytes_per_token"] = self.bytes_per_token
        return cast(TrainPlanDict, out)  # asdict's keys are the fields; TrainPlanDict names them


def training_state_bytes(n_params: int, largest_param: int, dtype: str) -> int:
    """Bytes of gradients and optimizer state (and autocast's low-precision weight copies).

    ``largest_param`` (elements) adds :data:`LARGEST_PARAM_SCRATCH_COPIES` fp32 copies of the biggest
    parameter (usually the word embeddings), see there.
    """
    per_param = GRAD_BYTES_PER_PARAM + ADAMW_BYTES_PER_PARAM
    if dtype != "fp32":
        per_param += AUTOCAST_BYTES_PER_PARAM
    return n_params * per_param + LARGEST_PARAM_SCRATCH_COPIES * largest_param * GRAD_BYTES_PER_PARAM


def activation_room(budget_bytes: int, baseline_bytes: int, state_bytes: int) -> int:
    """Bytes left for activations; a budget that the fixed training state alone exceeds is refused."""
    room = budget_bytes - baseline_bytes - state_bytes
    if room <= 0:
        gib = 2**30
        raise DoesNotFitError(
            f"the memory budget ({budget_bytes / gib:.2f} GiB) is below what training needs before any "
            f"example: {baseline_bytes / gib:.2f} GiB already held (runtime + weights) + "
            f"{state_bytes / gib:.2f} GiB gradients and AdamW state, so it needs more than "
            f"{(baseline_bytes + state_bytes) / gib:.2f} GiB; raise --memory-budget or use a smaller model"
        )
    return room


def usable_fraction(device: Device) -> float:
    """The part of the activation room micro-batches may fill: all of it on CUDA, less
    :data:`CPU_TRAINING_MARGIN` on the CPU."""
    return 1 - CPU_TRAINING_MARGIN if device.type == "cpu" else 1.0


def plan_training(
    *,
    budget_bytes: int,
    baseline_bytes: int,
    state_bytes: int,
    optimizer_bytes: int,
    full_bytes_per_token: float,
    checkpointed_bytes_per_token: float,
    longest_padded: int,
    batch_size: int,
    dtype: str,
    max_length: int,
    device: Device,
    gradient_checkpointing: str = "auto",
) -> TrainPlan:
    """Choose checkpointing and the micro-batch token budget; pure arithmetic, so it is unit-tested.

    ``gradient_checkpointing="auto"`` decides by itself: on only when one longest example does not fit.
    """
    if gradient_checkpointing not in CHECKPOINTING_CHOICES:
        raise ConfigError(
            f"gradient checkpointing must be one of {', '.join(CHECKPOINTING_CHOICES)}, got {gradient_checkpointing!r}"
        )
    room = activation_room(budget_bytes, baseline_bytes, state_bytes)
    usable = usable_fraction(device)
    room = int(room * usable)
    gib = 2**30
    checkpointing = gradient_checkpointing
    if checkpointing == "auto":
        starts_on = room < full_bytes_per_token * longest_padded
    else:
        starts_on = checkpointing == "on"
    per_token = checkpointed_bytes_per_token if starts_on else full_bytes_per_token
    if room < per_token * longest_padded:
        needed = budget_bytes + (per_token * longest_padded - room) / usable
        raise DoesNotFitError(
            f"one example of {longest_padded} tokens needs {per_token * longest_padded / gib:.2f} GiB of "
            f"activations{' even with gradient checkpointing' if starts_on else ''}, but only "
            f"{room / gib:.2f} GiB of the budget is left (training needs at least {needed / gib:.2f} GiB); "
            "use a smaller --max-length or raise --memory-budget"
        )
    micro_budget = budget_from_bytes(
        room, ActivationModel(bytes_per_token=per_token, bytes_per_attention_cell=0.0), device, dtype
    )
    micro_budget = BatchBudget(max_batch_tokens=micro_budget.max_batch_tokens, max_batch_seqs=batch_size)
    return TrainPlan(
        budget_bytes=budget_bytes,
        baseline_bytes=baseline_bytes,
        state_bytes=state_bytes,
        optimizer_bytes=optimizer_bytes,
        full_bytes_per_token=full_bytes_per_token,
        checkpointed_bytes_per_token=checkpointed_bytes_per_token,
        gradient_checkpointing=starts_on,
        checkpointing=checkpointing,
        dtype=dtype,
        batch_size=batch_size,
        max_length=max_length,
        longest_padded=longest_padded,
        micro_budget=micro_budget,
    )


def autocast(device: Device, dtype: str):
    """Mixed precision for the forward pass (fp32 master weights and optimizer stay untouched)."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch_dtype(dtype))


# -- calibration ------------------------------------------------------------------------------------


def calibrate_and_plan(
    model,
    data: Examples,
    device: Device,
    dtype: str,
    memory_budget: str | int | None,
    batch_size: int,
    max_length: int,
    gradient_checkpointing: str = "auto",
) -> TrainPlan:
    """Measure the model's activation bytes, then plan against the budget.

    The baseline is read *after* calibration and one short backward pass (with freed heap handed back),
    so what the first forward and backward leave behind for good (autograd's worker state, oneDNN kernel
    caches: ~75 MiB on the CPU) is counted, and the probes themselves stay small."""
    memory = device_memory(device)
    budget = resolve_budget_bytes(memory_budget, memory)
    hold_allocator_to_budget(device, budget)
    sizes = [p.numel() for p in model.parameters()]
    state = training_state_bytes(sum(sizes), max(sizes), dtype)
    # refuse before spending time calibrating
    _after_release_if_refused(
        device, lambda: activation_room(budget, device_memory(device).used_by_process_bytes, state)
    )
    longest = max(data.windows, key=len)
    longest_padded = padded_length(len(longest))
    per_token, per_cell = saved_bytes_coefficients(model, longest, device, dtype)
    _first_backward(model, longest, device, dtype)
    # the length^2 term folded in at the longest length: exact there, conservative for shorter batches
    full = (per_token + per_cell * longest_padded) * ACTIVATION_SAFETY
    layers = int(getattr(model.config, "num_hidden_layers", 1))
    # checkpointing keeps each layer's fp32 input and recomputes one layer at a time; while that layer's
    # backward runs, its recomputed activations and the gradients with respect to them are both alive,
    # hence two layers' worth (measured on bert-base at 512 tokens: 186 MiB per sequence; one layer's
    # worth predicted 96 MiB and a 3 GiB run peaked at 3.32 GiB)
    checkpointed = layers * int(model.config.hidden_size) * 4 * ACTIVATION_SAFETY + 2 * full / layers
    free_cached_memory(device)
    options = dict(
        budget_bytes=budget,
        state_bytes=state,
        optimizer_bytes=ADAMW_BYTES_PER_PARAM * sum(sizes),
        checkpointed_bytes_per_token=checkpointed,
        longest_padded=longest_padded,
        batch_size=batch_size,
        dtype=dtype,
        max_length=max_length,
        device=device,
        gradient_checkpointing=gradient_checkpointing,
    )
    plan = _after_release_if_refused(
        device,
        lambda: plan_training(
            baseline_bytes=device_memory(device).used_by_process_bytes, full_bytes_per_token=full, **options
        ),
    )
    if plan.gradient_checkpointing or not PeakMeter(device).available or device.type != "cpu":
        return plan
    # The first step runs before the trainer has measured any step: measure its largest part now, one
    # real training example at the longest length, and plan from the larger of that and the estimate
    measured = longest_example_bytes_per_token(model, longest, device, dtype, max(sizes))
    if measured <= full:
        return dataclasses.replace(plan, measured_bytes_per_token=measured)
    replanned = _after_release_if_refused(
        device,
        lambda: plan_training(
            baseline_bytes=device_memory(device).used_by_process_bytes, full_bytes_per_token=measured, **options
        ),
    )
    return dataclasses.replace(replanned, measured_bytes_per_token=measured)


Planned = TypeVar("Planned")


def _after_release_if_refused(device: Device, attempt: Callable[[], Planned]) -> Planned:
    """``attempt()``, and on the CPU once more after handing back what the process can read again (clean
    file pages, freed heap) if it refused: after a fresh install those pages are well over 100 MiB of the
    resident set the plan starts from (docs/memory.md), and they are not the model's to pay for."""
    try:
        return attempt()
    except DoesNotFitError:
        if device.type != "cpu":
            raise
        release_host_memory()
        return attempt()


def longest_example_bytes_per_token(model, window: Window, device: Device, dtype: str, largest_param: int) -> float:
    """What a training micro-batch of the longest example really costs per padded token (CPU): the growth
    of the resident set's high-water mark over its forward and backward, gradients already allocated.

    The estimate from saved tensors (x :data:`ACTIVATION_SAFETY`) was measured 5-22% short of this on
    the first step at 512 tokens without checkpointing (docs/train.md), before any step could be re-fitted.
    Run after the plan says one such example fits: the first, unmeasured pass allocates the gradients
    (held by every step anyway), the second is measured. Its backward builds the largest parameter's dense
    gradient beside the accumulated one, which the state already counts (:data:`LARGEST_PARAM_SCRATCH_COPIES`),
    so that copy is taken out."""
    meter = PeakMeter(device)
    inputs = pad_windows([window], 0, device)
    with _training_mode(model):
        for measured in (False, True):
            start = meter.start() if measured else 0
            with autocast(device, dtype):
                loss = model(**inputs).logits.float().sum()
            loss.backward()
            del loss
    peak = meter.peak()
    model.zero_grad(set_to_none=True)
    free_cached_memory(device)
    return max(0, peak - start - GRAD_BYTES_PER_PARAM * largest_param) / padded_length(len(window))


PROBE_LENGTHS = (32, 64)
"""Tokens of the two calibration slices: short, so calibration fits any budget that training fits
(bert-base at 64 tokens saves ~10 MiB per sequence); two lengths separate the per-token and the
length^2 (attention scores) terms."""


def saved_bytes_coefficients(model, window: Window, device: Device, dtype: str) -> tuple[float, float]:
    """Bytes autograd saves for backward per padded token and per attention cell (sequence x length^2).

    Per probe length ``L`` (a slice of ``window``), forwards on 1 and 2 copies give the bytes of one
    more sequence, ``s(L)``; their difference cancels what does not grow with the batch (autocast's
    weight copies). ``s(L) = a L + c L^2`` is fitted through the two lengths. The ``c`` term is real
    in training even with SDPA: with attention dropout on, torch 2.13's CPU SDPA falls back to the math
    kernel, which saves the batch x heads x L^2 probabilities and dropout mask (measured: bert-base
    saves 144 B per cell and layer in fp32, as eager does).
    """
    lengths = sorted({min(length, len(window)) for length in PROBE_LENGTHS})
    per_sequence = []
    for length in lengths:
        piece = _head(window, length)
        saved = [_saved_bytes(model, pad_windows([piece] * copies, 0, device), device, dtype) for copies in (1, 2)]
        per_sequence.append((padded_length(length), max(saved[1] - saved[0], 1)))
    if len(per_sequence) == 1:  # the longest example is at most the shortest probe: nothing to extrapolate
        length, saved = per_sequence[0]
        return saved / length, 0.0
    (l1, s1), (l2, s2) = per_sequence
    # per-token cost s(L)/L = a + c L is a line through the two probes
    c = max(0.0, (s2 / l2 - s1 / l1) / (l2 - l1))
    a = max(1.0, s1 / l1 - c * l1)
    return a, c


def _head(window: Window, length: int) -> Window:
    """The first ``length`` tokens of ``window``: a calibration probe cut from a real example."""
    return dataclasses.replace(
        window,
        input_ids=window.input_ids[:length],
        own_end=min(window.own_end, length),
        token_type_ids=None if window.token_type_ids is None else window.token_type_ids[:length],
    )


@contextlib.contextmanager
def _training_mode(model):
    """Training-mode forwards (dropout on, as in a real step) for calibration; the model's mode is restored."""
    was_training = model.training
    model.train()
    try:
        yield
    finally:
        model.train(was_training)


def _first_backward(model, window: Window, device: Device, dtype: str) -> None:
    """One forward + backward on a short slice of ``window``, gradients dropped: the runtime's one-time
    allocations of a first backward then happen before the baseline is read, not during training."""
    piece = _head(window, PROBE_LENGTHS[0])
    with _training_mode(model), autocast(device, dtype):
        logits = model(**pad_windows([piece], 0, device)).logits
    logits.float().sum().backward()
    model.zero_grad(set_to_none=True)


def _saved_bytes(model, inputs: dict[str, torch.Tensor], device: Device, dtype: str) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one training-mode forward.

    The pack hook keeps the tensors in a local list and hands autograd a placeholder: a pack hook that
    returns the tensor itself makes a reference cycle through the graph that Python cannot collect
    (measured: each probe leaked its activations and autocast's weight copies, ~200 MiB on bert-base).
    The list keeps every storage alive until the count is done, so no address is reused and counted twice.
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: list[torch.Tensor] = []
    seen: set[int] = set()
    total = 0

    def pack(tensor: torch.Tensor) -> None:
        nonlocal total
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen and storage.data_ptr() not in params:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        kept.append(tensor)

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda placeholder: placeholder)
    with _training_mode(model), hooks, autocast(device, dtype):
        model(**inputs).logits.float().sum()
    kept.clear()
    return total
