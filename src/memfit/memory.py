"""The memory model: bytes of weights and activations → a token budget for the planner.

The only place where memfit thinks in bytes. It parses the user's budget ("4GiB", "500MB", "80%"),
finds how much memory the device has free, and predicts the peak of one forward pass as

    weights + batch_tokens x bytes_per_token + batch x heads x length^2 x bytes_per_attention_cell

Inference keeps about one layer's activations alive at a time, so ``bytes_per_token`` is a small
multiple of (hidden + intermediate) size; the attention term exists only for attention kernels that
materialise the scores (eager / math SDPA), not for flash or memory-efficient SDPA.
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from memfit.errors import ConfigError, DoesNotFitError
from memfit.planner import BatchBudget

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}

# Batches larger than this stop paying off (measured throughput plateaus) and only add latency and
# memory; the budget may still be lower.
MAX_USEFUL_BATCH_TOKENS = {"cpu": 16_384, "cuda": 262_144}


def parse_size(text: str, total_bytes: int | None = None) -> int:
    """Parse "4GiB", "500MB", "1.5G", "123456" or (with ``total_bytes``) "80%" into bytes."""
    raw = str(text).strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(%|[a-zA-Z]*)", raw)
    if not match:
        raise ConfigError(f"cannot read memory size {text!r}; use e.g. 4GiB, 500MB or 80%")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit == "%":
        if total_bytes is None:
            raise ConfigError(f"a percentage budget ({text}) needs a known device memory size")
        if not 0 < number <= 100:
            raise ConfigError(f"a percentage budget must be in (0, 100], got {text}")
        return int(total_bytes * number / 100)
    if unit not in _UNITS:
        raise ConfigError(f"unknown size unit {match.group(2)!r} in {text!r}; use B, KB, MB, GB, KiB, MiB, GiB")
    return int(number * _UNITS[unit])


def cgroup_memory_limit() -> int | None:
    """The container's memory limit (cgroup v2 ``memory.max`` or v1 ``limit_in_bytes``), if any."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            value = Path(path).read_text().strip()
        except OSError:
            continue
        if value.isdigit() and int(value) < 2**60:
            return int(value)
    return None


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


def analytic_activation_model(config, dtype: torch.dtype, attention_materialized: bool,
                              output_bytes_per_token: float) -> ActivationModel:
    """A first-principles estimate, used until calibration replaces it.

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


def budget_from_bytes(activation_bytes: float, model: ActivationModel, device: torch.device) -> BatchBudget:
    """The largest padded-token budget whose predicted activations stay under ``activation_bytes``."""
    room = activation_bytes - model.fixed_bytes
    tokens = int(room // model.bytes_per_token) if room > 0 else 0
    cells = None
    if model.bytes_per_attention_cell > 0:
        cells = max(1, int(room // model.bytes_per_attention_cell)) if room > 0 else 1
    tokens = min(tokens, MAX_USEFUL_BATCH_TOKENS.get(device.type, MAX_USEFUL_BATCH_TOKENS["cuda"]))
    return BatchBudget(max_batch_tokens=max(1, tokens), max_batch_seqs=4096, max_attention_cells=cells)


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers as loaded (in the compute dtype)."""
    return sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """What the planner was told, and why: bytes in, tokens out."""

    budget_bytes: int
    baseline_bytes: int  # what the process already holds on the device (weights, runtime) before a batch
    weights_bytes: int
    activations: ActivationModel
    batch_budget: BatchBudget

    def describe(self) -> str:
        gib = 2**30
        return (
            f"memory budget {self.budget_bytes / gib:.2f} GiB: baseline {self.baseline_bytes / gib:.2f} GiB "
            f"(weights {self.weights_bytes / gib:.2f} GiB), {self.activations.bytes_per_token / 1024:.1f} KiB "
            f"per token -> up to {self.batch_budget.max_batch_tokens} padded tokens per batch"
        )


def plan_memory(model: torch.nn.Module, device: torch.device, memory_budget: str | int | None,
                output_bytes_per_token: float) -> MemoryPlan:
    """Turn the user's budget (default: 90% of free device memory) into a planner budget.

    The budget covers the whole process on the device (peak RSS on the CPU, allocated memory on CUDA), so
    what is already held (weights, runtime) is subtracted before sizing batches.
    """
    memory = device_memory(device)
    if memory_budget is None:
        budget = memory.used_by_process_bytes + int(0.9 * memory.free_bytes)
    elif isinstance(memory_budget, int):
        budget = memory_budget
    else:
        budget = parse_size(memory_budget, total_bytes=memory.total_bytes)
    dtype = next(model.parameters()).dtype
    attention_materialized = getattr(model.config, "_attn_implementation", "eager") == "eager"
    activations = analytic_activation_model(model.config, dtype, attention_materialized, output_bytes_per_token)
    room = budget - memory.used_by_process_bytes
    if room < activations.predict(1, 8):
        raise DoesNotFitError(
            f"the memory budget ({budget / 2**30:.2f} GiB) is used up before the first batch: "
            f"the process already holds {memory.used_by_process_bytes / 2**30:.2f} GiB (model weights "
            f"{weights_bytes(model) / 2**30:.2f} GiB); raise --memory-budget or use --dtype bf16"
        )
    return MemoryPlan(
        budget_bytes=budget,
        baseline_bytes=memory.used_by_process_bytes,
        weights_bytes=weights_bytes(model),
        activations=activations,
        batch_budget=budget_from_bytes(room, activations, device),
    )
