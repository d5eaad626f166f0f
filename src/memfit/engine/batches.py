"""Stage 4: run planned batches of windows on the device, with the out-of-memory guard.

Two pieces:

- :class:`TorchEngine` runs one padded batch through a model under ``torch.inference_mode`` and hands
  the model output to a *head* that reduces it on the device and copies only what is needed to host
  memory (pooled partial sums, owned token rows, logits), so outputs never pile up on the GPU.
- :func:`run_windows` is the one place where out-of-memory is handled: it plans batches with the current
  :class:`AdaptiveBudget`, and when a batch fails with an out-of-memory error it frees cached memory,
  splits the batch, lowers the budget for the rest of the run and grows it back carefully after a run of
  successes. Order is kept and every window runs exactly once; non-memory errors propagate untouched.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import numpy as np

from memfit.data.chunking import Window
from memfit.memory.guard import ResidentSetGuard
from memfit.memory.model import trim_host_heap
from memfit.memory.planner import PAD_MULTIPLE, BatchBudget, padded_length, plan_batches
from memfit.memory.device import Device

if TYPE_CHECKING:
    import torch

log = logging.getLogger("memfit")

Head = Callable[[Any, Any, Sequence[Window]], list]
"""Reduces a model output for a batch to one host-side result per window: (output, attention_mask, windows). The
output's fields and the mask are tensors from a PyTorch model, numpy arrays from a compiled graph."""


class Engine(Protocol):
    """Runs one batch of windows; returns one result per window, in the given order."""

    def forward(self, windows: Sequence[Window]) -> list: ...


class TorchEngine:
    """A Hugging Face model on one device, fed padded batches of windows."""

    def __init__(self, model: torch.nn.Module, device: Device, pad_token_id: int, head: Head):
        self.model = model
        self.device = device
        self.pad_token_id = pad_token_id
        self.head = head

    def forward(self, windows: Sequence[Window]) -> list:
        import torch

        inputs = pad_windows(windows, self.pad_token_id, self.device, multiple=inference_pad_multiple(self.device))
        with torch.inference_mode():
            output = self.model(**inputs)
            return self.head(output, inputs["attention_mask"], windows)


class CurrentRuntimeEngine:
    """The engine of whatever runtime ``current()`` returns when a batch runs: a job that is handed its engine
    before the quality guard has looked at its texts keeps working when the guard moves it to another precision
    (``Encoder`` under ``dtype=auto``)."""

    def __init__(self, current: Callable[[], Any], head: Head):
        self.current = current
        self.head = head
        self._runtime: Any = None
        self._engine: Engine | None = None

    def forward(self, windows: Sequence[Window]) -> list:
        runtime = self.current()
        if runtime is not self._runtime:
            self._runtime, self._engine = runtime, runtime.engine(self.head)
        return self._engine.forward(windows)


def inference_pad_multiple(device: Device) -> int:
    """What an inference batch's width is rounded up to: :data:`~memfit.memory.planner.PAD_MULTIPLE` on a GPU
    (tensor-core tiles), 1 on the CPU, where the rounding buys nothing and costs compute: two one-thread
    workers ran batches of 25 short sentences 7% faster at their exact width (159.5-160.4 vs 148.4-149.5
    texts/s, docs/benchmarks.md). The planner still counts the rounded width, so a batch never holds
    more than the plan allowed."""
    return 1 if device.type == "cpu" else PAD_MULTIPLE


def pad_windows(
    windows: Sequence[Window], pad_token_id: int, device: Device, multiple: int = PAD_MULTIPLE
) -> dict[str, torch.Tensor]:
    """:func:`pad_arrays` as tensors on ``device``."""
    arrays = pad_arrays(windows, pad_token_id, multiple)
    return {name: _to_device(array, device) for name, array in arrays.items()}


class GraphResult:
    """What a head reads from a compiled graph's output (``last_hidden_state`` or ``logits``), a numpy array: the
    attribute a transformers model output would have."""

    def __init__(self, name: str, value: np.ndarray):
        setattr(self, name, value)


class GraphEngine:
    """Runs padded batches of windows through a compiled graph (OpenVINO's, ONNX Runtime's): ``infer`` maps padded
    inputs (those of ``input_names``) to the graph's one output; the job's head reduces it as it reduces a PyTorch
    module's."""

    def __init__(
        self,
        infer: Callable[[dict[str, np.ndarray]], np.ndarray],
        input_names: Sequence[str],
        output: str,
        pad_token_id: int,
        head: Head,
    ):
        self.infer = infer
        self.with_types = "token_type_ids" in input_names
        self.output = output
        self.pad_token_id = pad_token_id
        self.head = head

    def forward(self, windows: Sequence[Window]) -> list:
        # exact width: the CPU gains nothing from rounding (inference_pad_multiple)
        inputs = pad_arrays(windows, self.pad_token_id, multiple=1, token_types=self.with_types)
        return self.head(GraphResult(self.output, self.infer(inputs)), inputs["attention_mask"], windows)


def graph_probe_inputs(
    generator: np.random.Generator, vocab_size: int, batch: int, length: int
) -> dict[str, np.ndarray]:
    """Random ids of shape (``batch``, ``length``), the last row half padding: what a calibration probe (or the
    backend choice's timing) feeds a compiled graph."""
    ids = generator.integers(min(5, vocab_size - 1), vocab_size, (batch, length), dtype=np.int64)
    mask = np.ones((batch, length), dtype=np.int64)
    mask[-1, max(1, length // 2) :] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


def pad_arrays(
    windows: Sequence[Window], pad_token_id: int, multiple: int = PAD_MULTIPLE, token_types: bool | None = None
) -> dict[str, np.ndarray]:
    """Right-padded (B, L) int64 model inputs, L the longest window rounded up to ``multiple`` (by default as
    the planner counts it; training and calibration measure at that width).

    ``token_type_ids``: by default only for text pairs (models without segment embeddings get none); a compiled
    graph that has the input gets it always (``token_types=True``: zeros for single texts, as the model's
    default)."""
    width = padded_length(max(len(w) for w in windows), multiple)
    ids = np.full((len(windows), width), pad_token_id, dtype=np.int64)
    mask = np.zeros((len(windows), width), dtype=np.int64)
    if token_types is None:
        token_types = windows[0].token_type_ids is not None
    types = np.zeros((len(windows), width), dtype=np.int64) if token_types else None
    for row, window in enumerate(windows):
        n = len(window)
        ids[row, :n] = window.input_ids
        mask[row, :n] = 1
        if types is not None and window.token_type_ids is not None:
            types[row, :n] = window.token_type_ids
    inputs = {"input_ids": ids, "attention_mask": mask}
    if types is not None:
        inputs["token_type_ids"] = types
    return inputs


def _to_device(array: np.ndarray, device: Device) -> torch.Tensor:
    import torch

    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        # pinned host memory lets the copy overlap with the previous batch's compute
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA's ``OutOfMemoryError``, Python's ``MemoryError`` and the CPU allocator's failures."""
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")  # a run that never imported torch cannot have raised its error
    if torch is not None and isinstance(exc, torch.OutOfMemoryError):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)
        return any(
            s in text
            for s in ("can't allocate memory", "not enough memory", "out of memory", "CUDA error: out of memory")
        )
    return False


def free_cached_memory(device: Device) -> None:
    """Give the allocator's cached blocks back after an out-of-memory error (CUDA's caching allocator;
    on the CPU, the freed heap glibc keeps resident), so the retry starts from a clean device."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    else:
        trim_host_heap()


def unless_out_of_memory(action: Callable[[], Any]) -> tuple[bool, Any]:
    """``(True, action())``, or ``(False, None)`` if it ran out of memory; any other error propagates.

    The one out-of-memory test for every guarded call (inference batches, training micro-batches, the
    probe pass). The caller frees memory and retries smaller *after* this returns, when the failed
    attempt's tensors (held by the traceback inside the ``except`` block) are already released."""
    try:
        return True, action()
    except Exception as exc:  # noqa: BLE001 - everything but out-of-memory is re-raised
        if is_out_of_memory(exc):
            return False, None
        raise


class SequenceDoesNotFit(Exception):
    """Internal: one window failed alone at batch size 1. The job maps it to a DoesNotFitError naming the text."""

    def __init__(self, window: Window):
        super().__init__(f"a window of {len(window)} tokens does not fit at batch size 1")
        self.window = window


@dataclass
class AdaptiveBudget:
    """The planner's budget, lowered after an out-of-memory error and regrown after successes.

    It lives for a whole run (across blocks), so one failure does not repeat on every block. ``guard``
    (the CPU's closed loop, ``memory/guard.py``) cuts each batch to the room the resident set leaves now.
    """

    base: BatchBudget
    guard: ResidentSetGuard | None = None
    factor: float = 1.0
    shrink: float = 0.5
    regrow: float = 1.25
    successes_before_regrow: int = 16
    _streak: int = field(default=0, repr=False)
    oom_events: int = 0

    @property
    def current(self) -> BatchBudget:
        return self.base if self.factor >= 1.0 else self.base.scaled(self.factor)

    def record_oom(self) -> None:
        self.oom_events += 1
        self.factor *= self.shrink
        self._streak = 0
        log.warning("out of memory: lowering the batch budget to %.0f%% for now", 100 * self.factor)

    def record_success(self) -> None:
        if self.factor >= 1.0:
            return
        self._streak += 1
        if self._streak >= self.successes_before_regrow:
            self.factor = min(1.0, self.factor * self.regrow)
            self._streak = 0


def run_windows(
    engine: Engine,
    windows: Sequence[Window],
    budget: AdaptiveBudget,
    device: Device,
    on_batch: Callable[[Sequence[Window]], None] | None = None,
    keep: Callable[[Sequence[Window], list], list] | None = None,
) -> list:
    """Run every window once, in batches that fit ``budget``; return the results in window order.

    ``keep(windows, outputs)`` sees each batch's outputs as soon as they exist and returns what is
    kept of them for the caller (a job streaming token rows to disk keeps only the pooled parts)."""
    results: list[Any] = [None] * len(windows)
    lengths = [len(w) for w in windows]
    pending = [list(b) for b in reversed(plan_batches(lengths, budget.current))]
    while pending:
        batch = pending.pop()
        width = padded_length(max(lengths[i] for i in batch))
        if len(batch) > 1 and not budget.current.fits(len(batch), width):
            # the budget was lowered after this batch was planned: re-cut it under the current one
            parts = plan_batches([lengths[i] for i in batch], budget.current)
            pending.extend(reversed([[batch[j] for j in part] for part in parts]))
            continue
        if budget.guard is not None:
            admission = budget.guard.admit(len(batch), width)  # what the resident set leaves room for now
            if admission.batch_size < len(batch):
                pending.append(batch[admission.batch_size :])
                batch = batch[: admission.batch_size]
        chosen = [windows[i] for i in batch]
        try:
            ran, outputs = unless_out_of_memory(partial(engine.forward, chosen))
        finally:
            if budget.guard is not None:
                budget.guard.done(admission)
        if not ran:
            # Handled outside the except block so the failed batch's tensors (held by the traceback)
            # are already released when the cache is emptied.
            free_cached_memory(device)
            if len(batch) > 1:
                budget.record_oom()
                half = len(batch) // 2
                pending.append(batch[half:])
                pending.append(batch[:half])
                continue
            ran, outputs = unless_out_of_memory(partial(engine.forward, chosen))  # once more alone, clean cache
            if not ran:
                free_cached_memory(device)
                raise SequenceDoesNotFit(chosen[0])
        budget.record_success()
        if keep is not None:
            outputs = keep(chosen, outputs)
        for i, out in zip(batch, outputs):
            results[i] = out
        if on_batch is not None:
            on_batch(chosen)
    return results
