"""The memory model: bytes of weights and activations → a token budget for the planner.

The only place where memfit thinks in bytes. It parses the user's budget ("4GiB", "500MB", "80%"),
finds how much memory the device has free, and predicts the peak of one forward pass as

    baseline + batch_tokens x bytes_per_token + batch x length^2 x bytes_per_attention_cell

``baseline`` is what the process already holds on the device (runtime, weights, kernel caches).
Inference keeps about one layer's activations alive at a time, so ``bytes_per_token`` is a small
multiple of (hidden + intermediate) size; the attention term exists only for attention kernels that
materialise the scores (eager attention), not for flash or memory-efficient SDPA.

The coefficients are *measured*: at start-up a few short probe forwards (same number of tokens at
different lengths, so the token and the length^2 terms separate) record the peak growth of device
memory — ``max_memory_allocated`` on CUDA, the resident-set high-water mark on the CPU (``VmHWM``,
reset through ``/proc/self/clear_refs`` before each probe, with freed heap handed back to the kernel
first so a probe is not hidden in memory a previous one left resident). The fit is cached per
(model shape, device, dtype, attention implementation, torch version) in the user cache directory
(``$MEMFIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/memfit``, else ``~/.cache/memfit``), so later runs
start at once. A first-principles estimate is the floor under the fit: a probe can only under-measure
(memory that another allocation left resident), never invent bytes.

Measured on torch 2.13's CPU SDPA with a padding mask: no length^2 term (the fused kernel does not
materialise batch x heads x length^2 scores), so only ``eager`` counts as materialised.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import json
import logging
import os
import sys
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np
import psutil
import torch

from memfit.errors import DoesNotFitError
from memfit.planner import BatchBudget
from memfit.sizes import cgroup_memory_limit, check_budget_fits_device, parse_size

log = logging.getLogger("memfit")

# Batches larger than this stop paying off and only add latency and memory; the budget may still be
# lower. On the CPU larger batches are *slower*: their activations fall out of cache and every batch's
# large buffers are fresh mmap'd pages. Measured with all-MiniLM-L6-v2 at max_length 512, 600 long-tail
# texts, 2-core AMD EPYC (avx512_bf16): fp32 5.8k / 5.5k / 5.1k / 4.6k tok/s at 2k / 4k / 8k / 16k
# tokens per batch, bf16 8.7k / 8.8k / 9.0k / 8.2k. fp32 peaks at the smallest batch (its 4-byte
# activations leave the cache first); bf16 is flat up to 8k, so 4k keeps its memory low for ~2%.
# On CUDA throughput keeps growing with the batch until the GPU is saturated.
CPU_MAX_USEFUL_BATCH_TOKENS = {torch.float32: 2_048}
CPU_MAX_USEFUL_BATCH_TOKENS_DEFAULT = 4_096
CUDA_MAX_USEFUL_BATCH_TOKENS = 262_144


def max_useful_batch_tokens(device: torch.device, dtype: torch.dtype) -> int:
    """The padded-token batch size past which a bigger batch buys no speed on this device and dtype."""
    if device.type == "cpu":
        return CPU_MAX_USEFUL_BATCH_TOKENS.get(dtype, CPU_MAX_USEFUL_BATCH_TOKENS_DEFAULT)
    return CUDA_MAX_USEFUL_BATCH_TOKENS


# Part of the room above the baseline kept free on the CPU: glibc keeps freed blocks resident and
# batches of changing shapes fragment the heap, so the resident set drifts a little above
# "baseline + one batch" over a long run.
CPU_FRAGMENTATION_MARGIN = 0.10

# Probe shapes (batch, padded length): the same number of tokens at three lengths, so bytes per
# token and bytes per attention cell (batch x length^2) separate. Lengths are capped at the model's
# position limit. Small on purpose: calibration costs well under a second for a MiniLM-sized model.
PROBE_TOKENS = 512
PROBE_LENGTHS = (64, 256, 512)

CACHE_FORMAT = 2
Source = Literal["probes", "cache", "analytic"]


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """Memory of the device as memfit sees it, in bytes."""

    total_bytes: int
    free_bytes: int
    used_by_process_bytes: int  # what this process already holds there (weights included)


def device_memory(device: torch.device) -> DeviceMemory:
    """Total and free memory of ``device``; for the CPU, RAM respecting a cgroup limit."""
    if device.type == "cuda":
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
    """Bytes one forward pass needs beyond the weights, as a function of the batch shape."""

    bytes_per_token: float
    bytes_per_attention_cell: float  # per (sequence, position, position); 0 for O(n)-memory attention
    fixed_bytes: float = 0.0

    def predict(self, batch_size: int, padded_length: int) -> float:
        tokens = batch_size * padded_length
        return (self.fixed_bytes + tokens * self.bytes_per_token
                + batch_size * padded_length * padded_length * self.bytes_per_attention_cell)


def attention_implementation(model: torch.nn.Module) -> str:
    """The attention kernel transformers chose for ``model`` ("eager", "sdpa", "flash_attention_2"...)."""
    return str(getattr(model.config, "_attn_implementation", None) or "eager")


def attention_materialized(model: torch.nn.Module) -> bool:
    """Whether attention holds batch x heads x length^2 scores: only eager does (see module docstring)."""
    return attention_implementation(model) == "eager"


def analytic_activation_model(config, dtype: torch.dtype, attention_materialized: bool,
                              output_bytes_per_token: float) -> ActivationModel:
    """A first-principles estimate: the floor under the calibrated model, and the fallback without it.

    Per token and layer, inference holds the layer input, Q, K, V, the attention output, the residual
    sum and layer-norm output (~8 x hidden) and the feed-forward intermediate before and after the
    activation (2 x intermediate), in the compute dtype; plus the fp32 copy the pooling reads.
    """
    elem = torch.finfo(dtype).bits // 8
    hidden = int(config.hidden_size)
    inter = int(getattr(config, "intermediate_size", 4 * hidden))
    heads = int(config.num_attention_heads)
    per_token = elem * (8 * hidden + 2 * inter) + output_bytes_per_token
    per_cell = elem * heads * 3 if attention_materialized else 0.0  # scores, softmax, dropout-free copy
    return ActivationModel(bytes_per_token=per_token, bytes_per_attention_cell=per_cell)


def budget_from_bytes(activation_bytes: float, model: ActivationModel, device: torch.device,
                      dtype: torch.dtype) -> BatchBudget:
    """The largest padded-token budget whose predicted activations stay under ``activation_bytes``,
    capped where bigger batches stop being faster (:func:`max_useful_batch_tokens`).

    The planner checks tokens and attention cells as separate limits, so with an attention term each
    gets half the room: a batch at both limits then still predicts no more than the room."""
    room = activation_bytes - model.fixed_bytes
    cells = None
    if model.bytes_per_attention_cell > 0:
        room /= 2
        cells = max(1, int(room // model.bytes_per_attention_cell)) if room > 0 else 1
    tokens = int(room // model.bytes_per_token) if room > 0 else 0
    tokens = min(tokens, max_useful_batch_tokens(device, dtype))
    return BatchBudget(max_batch_tokens=max(1, tokens), max_batch_seqs=4096, max_attention_cells=cells)


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers as loaded (in the compute dtype)."""
    return sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))


# -- calibration ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Calibration:
    """Measured forward-pass memory of one (model shape, device, dtype, attention): what the cache holds."""

    bytes_per_token: float
    bytes_per_attention_cell: float
    warmup_bytes: int  # what the first forward leaves held for good (kernel caches, thread pools)


def cache_dir() -> Path:
    """Where calibrations are cached: ``$MEMFIT_CACHE_DIR``, ``$XDG_CACHE_HOME/memfit`` or ``~/.cache/memfit``."""
    if os.environ.get("MEMFIT_CACHE_DIR"):
        return Path(os.environ["MEMFIT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "memfit"


def calibration_key(model: torch.nn.Module, device: torch.device) -> dict:
    """What the forward's memory depends on: the architecture's shape (not the weights' values), the
    device, the dtype, the attention kernel and the torch version."""
    config = model.config
    shape = {name: getattr(config, name, None) for name in (
        "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
        "vocab_size", "max_position_embeddings")}
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"format": CACHE_FORMAT, "class": type(model).__name__, **shape, "device": device_name,
            "dtype": str(next(model.parameters()).dtype), "attention": attention_implementation(model),
            "torch": torch.__version__}


def _cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / f"calibration-{digest}.json"


def load_calibration(key: dict) -> Calibration | None:
    """The cached calibration for ``key``, or None (missing, unreadable or for another key)."""
    try:
        stored = json.loads(_cache_path(key).read_text())
        if stored.get("key") != key:
            return None
        return Calibration(**stored["calibration"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_calibration(key: dict, calibration: Calibration) -> None:
    """Write atomically; a read-only cache directory only costs the next run its probes."""
    path = _cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "calibration": asdict(calibration)}, indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        log.info("could not cache the memory calibration in %s: %s", path.parent, exc)


class PeakMeter:
    """Peak growth of device memory over a block of code: CUDA allocator stats, or the CPU's VmHWM."""

    def __init__(self, device: torch.device):
        self.device = device

    @property
    def available(self) -> bool:
        return self.device.type == "cuda" or _can_reset_rss_peak()

    def current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return _proc_status_bytes("VmRSS")

    def start(self) -> int:
        """Settle memory and reset the peak; returns the current usage."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            return torch.cuda.memory_allocated(self.device)
        trim_host_heap()  # freed heap back to the kernel, so the next peak is seen in full
        _reset_rss_peak()
        return _proc_status_bytes("VmRSS")

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return _proc_status_bytes("VmHWM")

    def trim(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            trim_host_heap()


def trim_host_heap() -> None:
    """Hand freed heap memory back to the kernel (glibc ``malloc_trim``); a no-op elsewhere."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@lru_cache(maxsize=1)
def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - musl has no malloc_trim
        return libc
    except (OSError, AttributeError):
        return None


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


_peak_before_resets = 0
"""The process's VmHWM just before memfit last reset it: resets are for measuring one block of code,
and must not hide the whole run's peak from :func:`process_peak_rss_bytes`."""


def _reset_rss_peak() -> None:
    global _peak_before_resets
    _peak_before_resets = max(_peak_before_resets, _proc_status_bytes("VmHWM"))
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def process_peak_rss_bytes() -> int:
    """The peak resident set of this whole process (Linux), across memfit's own resets of VmHWM."""
    return max(_peak_before_resets, _proc_status_bytes("VmHWM"))


def _can_reset_rss_peak() -> bool:
    try:
        _reset_rss_peak()
        return True
    except OSError:
        return False


def probe_shapes(length_limit: int) -> list[tuple[int, int]]:
    """(batch, padded length) of the probes: :data:`PROBE_TOKENS` tokens at each of :data:`PROBE_LENGTHS`."""
    lengths = sorted({min(length, length_limit) for length in PROBE_LENGTHS})
    return [(max(1, PROBE_TOKENS // length), length) for length in lengths]


def _probe_inputs(model: torch.nn.Module, device: torch.device, batch: int, length: int) -> dict[str, torch.Tensor]:
    """Random token ids with the last row half padding, so the masked attention path is the one measured."""
    vocab = int(getattr(model.config, "vocab_size", 1000))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(min(5, vocab - 1), vocab, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[-1, max(1, length // 2):] = 0
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def measure_calibration(model: torch.nn.Module, device: torch.device, length_limit: int) -> Calibration | None:
    """Run the probe forwards and fit bytes per token and per attention cell; None where the device's
    peak cannot be measured (no resettable VmHWM)."""
    meter = PeakMeter(device)
    if not meter.available:
        return None
    with torch.inference_mode():
        shapes = probe_shapes(length_limit)
        before = meter.start()
        # one-time set-up (thread pools, kernel caches, scratch space) happens in the first forward of
        # a size: run the first probe shape once unmeasured, so the probes see activations only
        model(**_probe_inputs(model, device, *shapes[0]))
        meter.trim()
        warmup = max(0, meter.current() - before)
        growth = []
        for batch, length in shapes:
            inputs = _probe_inputs(model, device, batch, length)
            start = meter.start()
            model(**inputs)
            growth.append(max(0, meter.peak() - start))
            del inputs
        meter.trim()
    per_token, per_cell = fit_activation_coefficients(shapes, growth, attention_materialized(model))
    return Calibration(bytes_per_token=per_token, bytes_per_attention_cell=per_cell, warmup_bytes=warmup)


def fit_activation_coefficients(shapes: list[tuple[int, int]], growth_bytes: list[int],
                                with_attention: bool) -> tuple[float, float]:
    """Fit ``growth = a x tokens + c x batch x length^2`` (c only ``with_attention``; a, c >= 0), then scale
    up so that no probe is under-predicted (the budget must hold for the worst shape, not the average).

    Without a materialised attention the probes differ only by noise in the length^2 direction, so
    fitting c there would turn noise into a spurious attention budget."""
    tokens = np.array([b * n for b, n in shapes], dtype=np.float64)
    cells = np.array([b * n * n for b, n in shapes], dtype=np.float64)
    growth = np.array(growth_bytes, dtype=np.float64)
    per_token, per_cell = float(np.max(growth / tokens)), 0.0
    if with_attention and len(set(n for _, n in shapes)) >= 2:
        (a, c), *_ = np.linalg.lstsq(np.stack([tokens, cells], axis=1), growth, rcond=None)
        if a > 0 and c > 0:
            per_token, per_cell = float(a), float(c)
    predicted = tokens * per_token + cells * per_cell
    scale = float(np.max(growth / predicted))
    if scale > 1:
        per_token, per_cell = per_token * scale, per_cell * scale
    return per_token, per_cell


def calibrated_activation_model(model: torch.nn.Module, device: torch.device, output_bytes_per_token: float,
                                length_limit: int, calibrate: bool = True) -> tuple[ActivationModel, int, Source]:
    """The activation model for ``model`` on ``device``: cached, else probed, floored by the analytic estimate.

    Returns (model, warm-up bytes not yet in the process's baseline, where the coefficients came from).
    """
    dtype = next(model.parameters()).dtype
    floor = analytic_activation_model(model.config, dtype, attention_materialized(model), output_bytes_per_token)
    if not calibrate:
        return floor, 0, "analytic"
    key = calibration_key(model, device)
    calibration = load_calibration(key)
    source: Source = "cache"
    pending_warmup = 0
    if calibration is None:
        calibration = measure_calibration(model, device, length_limit)
        source = "probes"
        if calibration is None:
            log.info("device peak memory cannot be measured here; using the analytic memory model")
            return floor, 0, "analytic"
        save_calibration(key, calibration)
    else:
        pending_warmup = calibration.warmup_bytes  # the cached run's first forward has not happened yet
    activations = ActivationModel(
        bytes_per_token=max(calibration.bytes_per_token + output_bytes_per_token, floor.bytes_per_token),
        bytes_per_attention_cell=max(calibration.bytes_per_attention_cell, floor.bytes_per_attention_cell),
    )
    return activations, pending_warmup, source


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

    def predicted_peak_bytes(self, batch_size: int, padded_length: int) -> float:
        """Peak device memory of the process while running one batch of this shape (the reserve for input
        and output in flight comes on top: it is an allowance, not what one batch holds)."""
        return self.baseline_bytes + self.activations.predict(batch_size, padded_length)

    def budget_beside(self, extra_held_bytes: float, activation_scale: float, device: torch.device,
                      dtype: torch.dtype) -> BatchBudget:
        """The batch budget while the process holds ``extra_held_bytes`` more than the baseline (a second
        model, say) and activations cost ``activation_scale`` times the calibrated ones (a wider dtype)."""
        scaled = ActivationModel(bytes_per_token=self.activations.bytes_per_token * activation_scale,
                                 bytes_per_attention_cell=self.activations.bytes_per_attention_cell * activation_scale,
                                 fixed_bytes=self.activations.fixed_bytes)
        room = batch_room(self.budget_bytes, self.baseline_bytes + self.reserved_bytes + extra_held_bytes, device)
        return budget_from_bytes(room, scaled, device, dtype)

    def largest_batch(self, padded_length: int) -> int:
        """The most sequences of ``padded_length`` tokens one batch may hold (0: not even one fits)."""
        budget = self.batch_budget
        if self.predicted_peak_bytes(1, padded_length) + self.reserved_bytes > self.budget_bytes:
            return 0
        size = min(budget.max_batch_tokens // padded_length, budget.max_batch_seqs)
        if budget.max_attention_cells is not None:
            size = min(size, budget.max_attention_cells // (padded_length * padded_length))
        return max(1, size)

    def describe(self) -> str:
        gib = 2**30
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


# oneDNN (PyTorch's CPU matmul library) caches up to 1,024 compiled primitives, one per input shape, each
# holding scratch memory sized by its shape. Length-sorted inference batches rarely repeat a shape, so the
# cache only grows: on all-MiniLM-L6-v2 over 1,000 long-tail texts it added 150 MiB (bf16) / 190 MiB (fp32)
# to the peak that no budget saw coming. Four entries still hold one batch's Linear shapes, which every
# layer reuses, and ran as fast as the default or faster (docs/memory.md). Training is left alone: its
# backward needs more shapes per step (4 entries: 0.61 vs 0.69 examples/s on bert-base).
INFERENCE_KERNEL_CACHE_ENTRIES = "4"


def bound_cpu_kernel_cache() -> None:
    """Cap oneDNN's primitive cache for inference, unless the user set ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``.

    oneDNN reads the variable once, when it creates its first primitive, so this must run before the
    process's first CPU matmul; later calls change nothing (a process that trained first keeps 1,024)."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", INFERENCE_KERNEL_CACHE_ENTRIES)


# glibc serves blocks over its mmap threshold with mmap and returns them to the kernel when freed, but
# every such free raises the threshold to the freed size (up to 32 MiB), so after the first batches the
# activation buffers of later batches come from the heap, which fragments and only grows: on
# all-MiniLM-L6-v2 at a 0.75 GiB budget over 150 long texts the resident set climbed 150 MiB past the
# plan during the run (peak 817 MiB). A fixed 1 MiB threshold kept it flat (peak 652 MiB) at the same
# speed (docs/memory.md). Training keeps glibc's default: a fixed threshold cost it speed.
INFERENCE_MMAP_THRESHOLD_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h


def fix_cpu_mmap_threshold() -> None:
    """Fix glibc's mmap threshold for inference, unless the user set ``MALLOC_MMAP_THRESHOLD_``."""
    libc = _glibc()
    if libc is not None and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        libc.mallopt(_M_MMAP_THRESHOLD, INFERENCE_MMAP_THRESHOLD_BYTES)


def build_memory_plan(model: torch.nn.Module, device: torch.device, memory_budget: str | int | None,
                      output_bytes_per_token: float, calibrate: bool = True, reserved_bytes: int = 0) -> MemoryPlan:
    """:func:`plan_memory` without the "does anything fit" check (``memfit plan`` reports it instead).

    ``reserved_bytes``: what the job holds beside its batches (``host_budget.py``), kept out of their room.

    Every inference job plans before its first forward, so the kernel cache is bounded and the mmap
    threshold fixed here."""
    from memfit.models import model_position_limit

    bound_cpu_kernel_cache()
    fix_cpu_mmap_threshold()

    budget = resolve_budget_bytes(memory_budget, device_memory(device))
    activations, pending_warmup, source = calibrated_activation_model(
        model, device, output_bytes_per_token, model_position_limit(model.config), calibrate)
    baseline = device_memory(device).used_by_process_bytes + pending_warmup  # after the probes settled
    dtype = next(model.parameters()).dtype
    return MemoryPlan(
        budget_bytes=budget,
        baseline_bytes=baseline,
        weights_bytes=weights_bytes(model),
        activations=activations,
        batch_budget=budget_from_bytes(batch_room(budget, baseline + reserved_bytes, device), activations, device,
                                       dtype),
        source=source,
        attention=attention_implementation(model),
        reserved_bytes=reserved_bytes,
    )


def batch_room(budget_bytes: float, held_bytes: float, device: torch.device) -> float:
    """Bytes batches may use when the process holds ``held_bytes``: the rest of the budget, less the
    fragmentation margin on the CPU."""
    room = budget_bytes - held_bytes
    return room * (1 - CPU_FRAGMENTATION_MARGIN) if device.type == "cpu" else room


def plan_memory(model: torch.nn.Module, device: torch.device, memory_budget: str | int | None,
                output_bytes_per_token: float, calibrate: bool = True, reserved_bytes: int = 0) -> MemoryPlan:
    """Turn the user's budget (default: 90% of free device memory) into a planner budget.

    The budget covers the whole process on the device (peak RSS on the CPU, allocated memory on CUDA), so
    what is already held (weights, runtime) is subtracted before sizing batches.
    """
    plan = build_memory_plan(model, device, memory_budget, output_bytes_per_token, calibrate, reserved_bytes)
    if plan.budget_bytes - plan.baseline_bytes - plan.reserved_bytes < plan.activations.predict(1, 8):
        raise DoesNotFitError(
            f"the memory budget ({plan.budget_bytes / 2**30:.2f} GiB) is used up before the first batch: "
            f"the process already holds {plan.baseline_bytes / 2**30:.2f} GiB (model weights "
            f"{plan.weights_bytes / 2**30:.2f} GiB) and streaming input and output need "
            f"{plan.reserved_bytes / 2**30:.2f} GiB beside it; raise --memory-budget or use --dtype bf16"
        )
    # loading the weights and calibrating have their own transients (measured on MiniLM: ~0.17 GiB
    # above the settled baseline); a budget they already broke cannot be promised for the run
    peak = process_peak_rss_bytes() if device.type == "cpu" and sys.platform.startswith("linux") else 0
    if peak > plan.budget_bytes:
        raise DoesNotFitError(
            f"the memory budget ({plan.budget_bytes / 2**30:.2f} GiB) was already exceeded while loading the "
            f"model and measuring it (peak {peak / 2**30:.2f} GiB); raise --memory-budget"
        )
    return plan


# -- memfit plan ----------------------------------------------------------------------------------

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

    from memfit.host_budget import host_budget
    from memfit.models import (load_model, load_tokenizer, read_sentence_transformer_defaults, resolve_device,
                               resolve_dtype, resolve_max_length, resolve_model_name)
    from memfit.planner import padded_length

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
