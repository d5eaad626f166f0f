"""The memory model: bytes of weights and activations → a token budget for the planner.

The only place where memfit thinks in bytes. It turns the user's budget ("4GiB", "500MB", "80%" of the
device's *total* memory; default: what the process already holds plus 90% of the *free* memory) into
bytes, finds how much memory the device has free, and predicts the peak of one forward pass as

    baseline + batch_tokens x bytes_per_token + batch x length^2 x bytes_per_attention_cell

``baseline`` is what the process already holds on the device (runtime, weights, kernel caches).
Inference keeps about one layer's activations alive at a time, so ``bytes_per_token`` is a small
multiple of (hidden + intermediate) size; the attention term exists only for attention kernels that
materialise the scores (eager attention), not for flash or memory-efficient SDPA.

The coefficients are *measured* by ``calibration.py`` (an explicit step that returns a
:class:`~memfit.memory.calibration.MemoryCalibration`); :func:`plan_from_calibration` is the pure planner
that consumes it. A first-principles estimate is the floor under the measurement: a probe can only
under-measure (memory that another allocation left resident), never invent bytes.

Measured on torch 2.13's CPU SDPA with a padding mask: no length^2 term (the fused kernel does not
materialise batch x heads x length^2 scores), so only ``eager`` counts as materialised.

Process-wide settings that keep the resident set close to this model on the CPU (oneDNN's kernel
cache, glibc's mmap threshold) are not made here: ``process.configure_process`` sets them.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from memfit.memory.calibration import MemoryCalibration, Network, Source
from memfit.errors import DoesNotFitError
from memfit.memory.peak import PeakMeter, process_peak_rss_bytes, trim_host_heap
from memfit.memory.planner import BatchBudget
from memfit.memory.sizes import cgroup_memory_limit, check_budget_fits_device, parse_size
from memfit.memory.device import DTYPE_BYTES, Device, DtypeName

# re-exported: older imports (training, benchmarks) name them here
__all__ = ["PeakMeter", "process_peak_rss_bytes", "trim_host_heap", "parse_size"]

log = logging.getLogger("memfit")

# Batches larger than this stop paying off and only add latency and memory; the budget may still be
# lower. On the CPU larger batches are *slower*: their activations fall out of cache and every batch's
# large buffers are fresh mmap'd pages. Measured with all-MiniLM-L6-v2 at max_length 512, 600 long-tail
# texts, 2-core AMD EPYC (avx512_bf16): fp32 5.8k / 5.5k / 5.1k / 4.6k tok/s at 2k / 4k / 8k / 16k
# tokens per batch, bf16 8.7k / 8.8k / 9.0k / 8.2k. fp32 peaks at the smallest batch (its 4-byte
# activations leave the cache first); bf16 is flat up to 8k, so 4k keeps its memory low for ~2%.
# On CUDA throughput keeps growing with the batch until the GPU is saturated.
CPU_MAX_USEFUL_BATCH_TOKENS = {"fp32": 2_048}
CPU_MAX_USEFUL_BATCH_TOKENS_DEFAULT = 4_096
CUDA_MAX_USEFUL_BATCH_TOKENS = 262_144


def max_useful_batch_tokens(device: Device, dtype: DtypeName) -> int:
    """The padded-token batch size past which a bigger batch buys no speed on this device and dtype."""
    if device.type == "cpu":
        return CPU_MAX_USEFUL_BATCH_TOKENS.get(dtype, CPU_MAX_USEFUL_BATCH_TOKENS_DEFAULT)
    return CUDA_MAX_USEFUL_BATCH_TOKENS


# Part of the room above the baseline kept free on the CPU: glibc keeps freed blocks resident and
# batches of changing shapes fragment the heap, so the resident set drifts a little above
# "baseline + one batch" over a long run.
CPU_FRAGMENTATION_MARGIN = 0.10
# ...and never less than this: code pages of shared libraries (torch's kernels for shapes and paths
# first taken after calibration, Arrow's Parquet encoder) enter the resident set during the run, more of
# them where the libraries sit in the page cache (a fresh install): measured 3-8 MiB over a 0.6 GiB
# budget whose room above the baseline was ~50 MiB, where 10% of the room alone was not enough; and
# 21 MiB in a fresh clone's test run (`embed --tokens` of a 65k-token document at 768 MiB: peak 768.2
# MiB with 21 MiB kept free; 753 MiB when run alone), so the floor is that and half again.
CPU_RESIDENT_DRIFT_BYTES = 16 * 2**20


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """Memory of the device as memfit sees it, in bytes."""

    total_bytes: int
    free_bytes: int
    used_by_process_bytes: int  # what this process already holds there (weights included)


def device_memory(device: Device) -> DeviceMemory:
    """Total and free memory of ``device``; for the CPU, RAM respecting a cgroup limit."""
    if device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(total, free, torch.cuda.memory_allocated(device))
    vm = psutil.virtual_memory()
    rss = psutil.Process(os.getpid()).memory_info().rss
    total, free = vm.total, vm.available
    limit = cgroup_memory_limit()
    if limit is not None:
        total = min(total, limit)
        free = min(free, max(0, limit - _cgroup_usage(default=rss)))
    return DeviceMemory(total, free, rss)


def _cgroup_usage(default: int) -> int:
    for path in ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes"):
        try:
            return int(Path(path).read_text().strip())
        except (OSError, ValueError):
            continue
    return default


@dataclass(frozen=True, slots=True)
class ActivationModel:
    """Bytes one forward pass needs beyond the weights, as a function of the batch shape.

    A streamed block (``--offload``) holds its hidden states between layers while one layer runs over it in
    sub-batches: ``sub_batch`` is that layer's cost, paid once for the largest sub-batch that ``sub_batch_budget``
    cuts from the block, whatever the block's size (:func:`plan_streamed`)."""

    bytes_per_token: float
    bytes_per_attention_cell: float  # per (sequence, position, position); 0 for O(n)-memory attention
    fixed_bytes: float = 0.0
    sub_batch: "ActivationModel | None" = None
    sub_batch_budget: BatchBudget | None = None

    def predict(self, batch_size: int, padded_length: int) -> float:
        tokens = batch_size * padded_length
        own = (
            self.fixed_bytes
            + tokens * self.bytes_per_token
            + batch_size * padded_length * padded_length * self.bytes_per_attention_cell
        )
        if self.sub_batch is None or self.sub_batch_budget is None:
            return own
        rows = min(batch_size, max(1, self.sub_batch_budget.capacity(padded_length)))  # a window runs whole
        return own + self.sub_batch.predict(rows, padded_length)

    def largest_batch_bytes(self, budget: BatchBudget) -> float:
        """The bytes of the largest batch ``budget`` admits, at its token and attention-cell limits together (an
        upper bound: no one shape reaches both)."""
        total = self.fixed_bytes + budget.max_batch_tokens * self.bytes_per_token
        if budget.max_attention_cells is not None:
            total += budget.max_attention_cells * self.bytes_per_attention_cell
        if self.sub_batch is not None and self.sub_batch_budget is not None:
            total += self.sub_batch.largest_batch_bytes(self.sub_batch_budget)
        return total

    def scaled(self, factor: float) -> "ActivationModel":
        """The same forward at ``factor`` times the cost (an fp32 copy beside a bf16 model): every term scales,
        the per-forward one too (its scratch space and mask are in the wider dtype as well)."""
        return ActivationModel(
            self.bytes_per_token * factor,
            self.bytes_per_attention_cell * factor,
            self.fixed_bytes * factor,
            None if self.sub_batch is None else self.sub_batch.scaled(factor),
            self.sub_batch_budget,
        )


def analytic_activation_model(
    config, dtype: DtypeName, attention_materialized: bool, output_bytes_per_token: float
) -> ActivationModel:
    """A first-principles estimate: the floor under the calibrated model, and the fallback without it.

    Inference keeps one layer's tensors alive at a time, and a layer's largest moment is its feed-forward
    activation: the intermediate before and after it (2 x intermediate) beside the layer's input kept for
    the residual and the attention block's output (2 x hidden), in the compute dtype; plus what the caller
    keeps per token (``output_bytes_per_token``). It must stay a floor: counting every tensor of the layer
    at once (8 x hidden + 2 x intermediate) predicted all-MiniLM-L6-v2's fp32 batches at 1.5-1.9x their
    measured growth in a configured process (24 KiB a token against a fitted 14-15 KiB, 2-core AMD EPYC), so
    the estimate, not the measurement, set every CPU plan.
    """
    elem = DTYPE_BYTES[dtype]
    hidden = int(config.hidden_size)
    inter = int(getattr(config, "intermediate_size", 4 * hidden))
    heads = int(config.num_attention_heads)
    per_token = elem * (2 * inter + 2 * hidden) + output_bytes_per_token
    per_cell = elem * heads * 3 if attention_materialized else 0.0  # scores, softmax, dropout-free copy
    return ActivationModel(bytes_per_token=per_token, bytes_per_attention_cell=per_cell)


def budget_from_bytes(activation_bytes: float, model: ActivationModel, device: Device, dtype: DtypeName) -> BatchBudget:
    """The largest padded-token budget whose predicted activations stay under ``activation_bytes``,
    capped where bigger batches stop being faster (:func:`max_useful_batch_tokens`).

    The planner checks tokens and attention cells as separate limits, so with an attention term each
    gets half the room: a batch at both limits then still predicts no more than the room. A streamed block's
    model (``sub_batch``) pays one layer's largest sub-batch beside the states it holds, as :func:`plan_streamed`
    sizes its blocks: left out, the budget beside an fp32 copy admitted a block the guard then refused
    (all-mpnet-base-v2 streamed at 560 MiB: the whole job refused at its first batch, not the copy skipped)."""
    room = activation_bytes - model.fixed_bytes
    if model.sub_batch is not None and model.sub_batch_budget is not None:
        room -= model.sub_batch.largest_batch_bytes(model.sub_batch_budget)
    cells = None
    if model.bytes_per_attention_cell > 0:
        room /= 2
        cells = max(1, int(room // model.bytes_per_attention_cell)) if room > 0 else 1
    tokens = int(room // model.bytes_per_token) if room > 0 else 0
    tokens = min(tokens, max_useful_batch_tokens(device, dtype))
    return BatchBudget(max_batch_tokens=max(1, tokens), max_batch_seqs=4096, max_attention_cells=cells)


def calibrated_activation_model(
    network: Network, output_bytes_per_token: float, measured: MemoryCalibration
) -> ActivationModel:
    """The activation model of ``network``: the measured coefficients, floored by the analytic estimate (the
    estimate alone when nothing was measured)."""
    floor = analytic_activation_model(
        network.config, network.compute_dtype, network.attention_materialized, output_bytes_per_token
    )
    calibration = measured.calibration
    if calibration is None:
        return floor
    return ActivationModel(
        bytes_per_token=max(calibration.bytes_per_token + output_bytes_per_token, floor.bytes_per_token),
        bytes_per_attention_cell=max(calibration.bytes_per_attention_cell, floor.bytes_per_attention_cell),
        fixed_bytes=calibration.fixed_bytes,
    )


# -- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """What the planner was told, and why: bytes in, tokens out."""

    budget_bytes: int
    baseline_bytes: int  # what the process holds on the device (weights, runtime) before a batch
    weights_bytes: int
    activations: ActivationModel
    batch_budget: BatchBudget
    source: Source = "analytic"  # where the activation coefficients came from
    attention: str = "eager"  # the attention implementation
    reserved_bytes: int = 0  # held beside the batches: input blocks and output in flight (host_budget.py)
    refault_bytes: int = 0  # file pages a forward faults back in after they are handed back (CPU, at load)
    # streamed (--offload): the batch budget above sizes a *block* held between layers, this one the sub-batches
    # one layer runs at a time; None: the whole model is resident
    layer_budget: BatchBudget | None = None
    smallest_budget_bytes: int | None = None  # streamed: the least budget whose plan holds one full window

    def predicted_peak_bytes(self, batch_size: int, padded_length: int) -> float:
        """Peak device memory of the process while running one batch of this shape (the reserve for input
        and output in flight comes on top: it is an allowance, not what one batch holds)."""
        return self.baseline_bytes + self.activations.predict(batch_size, padded_length)

    def budget_beside(
        self, extra_held_bytes: float, activation_scale: float, device: Device, dtype: DtypeName
    ) -> BatchBudget:
        """The batch budget while the process holds ``extra_held_bytes`` more than the baseline (a second
        model, say) and activations cost ``activation_scale`` times the calibrated ones (a wider dtype)."""
        room = batch_room(self.budget_bytes, self.baseline_bytes + self.reserved_bytes + extra_held_bytes, device)
        return budget_from_bytes(room, self.activations.scaled(activation_scale), device, dtype)

    def largest_batch(self, padded_length: int) -> int:
        """The most sequences of ``padded_length`` tokens one batch may hold (0: not even one fits)."""
        if self.predicted_peak_bytes(1, padded_length) + self.reserved_bytes > self.budget_bytes:
            return 0
        return max(1, self.batch_budget.capacity(padded_length))

    def describe(self) -> str:
        gib = 2**30
        if self.layer_budget is not None:
            return (
                f"memory budget {self.budget_bytes / gib:.2f} GiB, streamed: baseline {self.baseline_bytes / gib:.2f} "
                f"GiB (weights held {self.weights_bytes / gib:.2f} GiB), {self.activations.bytes_per_token / 1024:.1f} "
                f"KiB per token held between layers ({self.source}) -> blocks of up to "
                f"{self.batch_budget.max_batch_tokens} padded tokens, run in sub-batches of up to "
                f"{self.layer_budget.max_batch_tokens}"
            )
        attention = ""
        if self.activations.bytes_per_attention_cell > 0:
            attention = f" + {self.activations.bytes_per_attention_cell:.0f} B per attention cell"
        return (
            f"memory budget {self.budget_bytes / gib:.2f} GiB: baseline {self.baseline_bytes / gib:.2f} GiB "
            f"(weights {self.weights_bytes / gib:.2f} GiB), {self.activations.bytes_per_token / 1024:.1f} KiB "
            f"per token{attention} ({self.source}, {self.attention} attention) -> up to "
            f"{self.batch_budget.max_batch_tokens} padded tokens per batch"
        )


def resolve_budget_bytes(memory_budget: str | int | None, memory: DeviceMemory) -> int:
    """The user's budget in bytes; default 90% of free device memory on top of what the process holds."""
    if memory_budget is None:
        return memory.used_by_process_bytes + int(0.9 * memory.free_bytes)
    budget = memory_budget if isinstance(memory_budget, int) else parse_size(memory_budget, memory.total_bytes)
    return check_budget_fits_device(budget, memory_budget, memory.total_bytes)


def hold_allocator_to_budget(device: Device, budget_bytes: int) -> None:
    """On CUDA, make the budget the caching allocator's own limit (``set_per_process_memory_fraction``).

    The planner sizes batches by allocated bytes, but the device gives up what the allocator *reserves*:
    blocks it keeps cached for reuse, split and rounded, which batches of changing shapes fragment. With the
    limit set, an allocation that would take the reserve past the budget first makes the allocator free its
    cached blocks, and only then fails with an out-of-memory error, which the engine's guard recovers from by
    splitting the batch. So the reserve, not only the allocated bytes, stays within the budget. The limit is
    the process's (one per device): the last model loaded on a device sets it. A no-op on the CPU."""
    if device.type != "cuda":
        return
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()  # "cuda" has none
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), index)


def plan_from_calibration(
    network: Network,
    device: Device,
    budget_bytes: int,
    output_bytes_per_token: float,
    measured: MemoryCalibration,
    reserved_bytes: int = 0,
) -> MemoryPlan:
    """The pure planner: budget, what the process holds now and the measured activations → a memory plan.

    ``reserved_bytes``: what the job holds beside its batches (``host_budget.py``), kept out of their room.
    Reads the device's memory (what the process holds), changes nothing; no "does anything fit" check
    (``memfit plan`` reports it instead, :func:`check_plan_fits` refuses)."""
    activations = calibrated_activation_model(network, output_bytes_per_token, measured)
    baseline = device_memory(device).used_by_process_bytes + measured.pending_warmup_bytes
    return MemoryPlan(
        budget_bytes=budget_bytes,
        baseline_bytes=baseline,
        weights_bytes=network.weights_bytes,
        activations=activations,
        batch_budget=budget_from_bytes(
            batch_room(budget_bytes, baseline + reserved_bytes, device), activations, device, network.compute_dtype
        ),
        source=measured.source,
        attention=network.attention,
        reserved_bytes=reserved_bytes,
    )


# The largest block a streamed forward holds between layers. Reading a layer costs far less than running it over
# a CPU sub-batch (all-mpnet-base-v2: 27 MiB of fp32 weights read from the page cache in 3.5-3.9 ms over the last
# layer's tensors, 19 ms into fresh buffers, against ~0.5 s for 2,048 tokens on 2 cores), so blocks beyond this buy
# the CPU nothing and only delay the first output; a GPU needs larger blocks to hide the weights' transfer, and gets
# them up to this bound.
STREAMED_MAX_BLOCK_TOKENS = 65_536


def plan_streamed(
    network: Network,
    device: Device,
    budget_bytes: int,
    output_bytes_per_token: float,
    measured: MemoryCalibration,
    held_bytes_per_token: float,
    streamed_weight_bytes: int,
    reserved_bytes: int = 0,
) -> MemoryPlan:
    """The pure planner of a streamed run (``--offload``, ``engine/streamed.py``): the room beside the baseline,
    less a sub-batch's fixed cost, is split between one layer's sub-batch (at most half of it, capped where bigger
    batches stop paying, as for a resident plan) and the block of windows whose hidden states are held between layers
    (``held_bytes_per_token``: the states, the block's word-embedding rows and its output in flight).

    The plan's activation model predicts a whole block, so the guard and :func:`check_plan_fits` work unchanged: the
    held states per token, plus one layer's cost for the largest sub-batch the layer budget cuts from a block of that
    shape (its fixed term at least the ``streamed_weight_bytes`` of the layers held at once, one on the CPU and two on
    CUDA, where the next is read while one runs: calibration's probes measure them, the analytic floor does not).
    Priced at the layer budget's largest sub-batch whatever the block, a block of one short window was predicted at
    95.5 MiB where it holds 64.5 (all-mpnet-base-v2 at 547 MiB), and the guard refused a 10,000-text run mid-way for
    room that was there."""
    layer = calibrated_activation_model(network, output_bytes_per_token, measured)
    layer = ActivationModel(
        layer.bytes_per_token, layer.bytes_per_attention_cell, max(layer.fixed_bytes, float(streamed_weight_bytes))
    )
    baseline = device_memory(device).used_by_process_bytes + measured.pending_warmup_bytes
    room = batch_room(budget_bytes, baseline + reserved_bytes, device)
    # the sub-batch pays its fixed cost whatever its size: what is left beyond it is split in halves
    layer_budget = budget_from_bytes(
        layer.fixed_bytes + (room - layer.fixed_bytes) / 2, layer, device, network.compute_dtype
    )
    sub_batch_bytes = layer.largest_batch_bytes(layer_budget)
    block = ActivationModel(
        bytes_per_token=held_bytes_per_token,
        bytes_per_attention_cell=0.0,
        sub_batch=layer,
        sub_batch_budget=layer_budget,
    )
    block_tokens = int((room - sub_batch_bytes) // held_bytes_per_token) if room > sub_batch_bytes else 0
    return MemoryPlan(
        budget_bytes=budget_bytes,
        baseline_bytes=baseline,
        weights_bytes=network.weights_bytes,
        activations=block,
        batch_budget=BatchBudget(
            max_batch_tokens=max(1, min(block_tokens, STREAMED_MAX_BLOCK_TOKENS)), max_batch_seqs=4096
        ),
        source=measured.source,
        attention=network.attention,
        reserved_bytes=reserved_bytes,
        layer_budget=layer_budget,
    )


def resident_needs_bytes(held_bytes: int, weights_bytes: int, reserved_bytes: int) -> int:
    """Before loading: the least budget the resident path can keep, for ``--offload auto``'s choice. Loading
    holds the weights twice for a moment (the checkpoint's pages, mapped, while they are copied into the model's
    tensors), and the run then needs the weights, the reserve for input and output and the resident drift."""
    return held_bytes + 2 * weights_bytes + reserved_bytes + CPU_RESIDENT_DRIFT_BYTES


def batch_room(budget_bytes: float, held_bytes: float, device: Device) -> float:
    """Bytes batches may use when the process holds ``held_bytes``: the rest of the budget, less the
    CPU's margin (:func:`host_room`); a GPU's allocator counts exactly."""
    return host_room(budget_bytes, held_bytes) if device.type == "cpu" else budget_bytes - held_bytes


def host_room(budget_bytes: float, held_bytes: float) -> float:
    """The rest of the budget beside ``held_bytes`` that host-side memory may use: less 10% for heap
    fragmentation and never less than the resident drift (:data:`CPU_RESIDENT_DRIFT_BYTES`)."""
    room = budget_bytes - held_bytes
    return room - max(room * CPU_FRAGMENTATION_MARGIN, CPU_RESIDENT_DRIFT_BYTES)


def least_budget(fits: Callable[[int], bool]) -> int:
    """The least budget, to the MiB, for which ``fits`` (true from some budget on) holds: the bisection behind every
    budget a refusal or a warning names as one that works (2**40 bytes where nothing fits)."""
    low, high = 0, 2**40
    while high - low > 2**20:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle
    return high


def or_use(other_ways: Callable[[], list[str]] | None) -> str:
    """`` (or use A or B)`` for a refusal's other ways, or nothing where there are none."""
    ways = other_ways() if other_ways is not None else []
    return f" (or use {' or '.join(ways)})" if ways else ""


def check_plan_fits(
    plan: MemoryPlan,
    device: Device,
    works_bytes: Callable[[], int] | None = None,
    other_ways: Callable[[], list[str]] | None = None,
) -> MemoryPlan:
    """Refuse (:class:`DoesNotFitError`) a plan whose budget is used up before the first batch, or was
    already broken while the model was loaded and measured. ``works_bytes``: the budget the refusal names as one
    that works (asked only when refusing); without it, the refusal asks for more without a figure. ``other_ways``:
    the options that would hold less at this budget (``--dtype bf16`` where the weights are fp32, ``--offload auto``
    where they could stream), named beside it; asked only when refusing."""

    def raise_it() -> str:
        if works_bytes is None:
            return "raise --memory-budget"
        return f"raise --memory-budget to {works_bytes() / 2**20:,.0f} MiB, which works"

    room = batch_room(plan.budget_bytes, plan.baseline_bytes + plan.reserved_bytes, device)
    if room < plan.activations.predict(1, 8):
        raise DoesNotFitError(
            f"the memory budget ({plan.budget_bytes / 2**30:.2f} GiB) is used up before the first batch: "
            f"the process already holds {plan.baseline_bytes / 2**30:.2f} GiB (model weights "
            f"{plan.weights_bytes / 2**30:.2f} GiB) and streaming input and output need "
            f"{plan.reserved_bytes / 2**30:.2f} GiB beside it; {raise_it()}{or_use(other_ways)}"
        )
    # loading the weights and calibrating have their own transients (measured on MiniLM: ~0.17 GiB
    # above the settled baseline); a budget they already broke cannot be promised for the run
    peak = process_peak_rss_bytes() if device.type == "cpu" and sys.platform.startswith("linux") else 0
    if peak > plan.budget_bytes:
        raise DoesNotFitError(
            f"the memory budget ({plan.budget_bytes / 2**30:.2f} GiB) was already exceeded while loading the "
            f"model and measuring it (peak {peak / 2**30:.2f} GiB); {raise_it()}"
        )
    return plan
