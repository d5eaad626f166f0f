"""The step loop: accumulate micro-batch gradients into one optimizer step, within the budget, surviving OOM.

``batch_size`` is the *effective* batch: every optimizer step sees exactly that many examples, whatever
the budget. :class:`Trainer` splits each batch into length-aware micro-batches with the inference
planner (``planner.plan_batches``, padded tokens under a token budget) and accumulates their gradients,
with the loss normalised so that the sum over micro-batches is the full batch's mean loss; the update
is then the same as one full-batch step (tested to float tolerance).

Before every step the micro-batch budget is re-fitted to the memory the process really holds (the
CPU's resident set drifts up during training), scaled by the worst measured-to-predicted step cost seen
so far. An out-of-memory error during a step shrinks the micro-batch budget (the engine's
:class:`~memfit.engine.batches.AdaptiveBudget`) and *redoes* the step with the same examples, so no example is
skipped and the effective batch is kept. Prediction (evaluation) runs through the engine's
:func:`~memfit.engine.batches.run_windows`, the inference guard, under the same budget. Dropout masks are keyed
by example and step (:mod:`memfit.training.dropout`), so neither the split nor a redo changes them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from memfit.data.chunking import Window
from memfit.engine.batches import (
    AdaptiveBudget,
    SequenceDoesNotFit,
    TorchEngine,
    free_cached_memory,
    pad_windows,
    run_windows,
    unless_out_of_memory,
)
from memfit.errors import DoesNotFitError
from memfit.memory.guard import ResidentSetGuard
from memfit.memory.model import ActivationModel, PeakMeter, device_memory, trim_host_heap
from memfit.memory.peak import release_host_memory
from memfit.engine.models import enable_activation_checkpointing
from memfit.memory.planner import BatchBudget, padded_length, plan_batches
from memfit.data.relation import Examples
from memfit.training.dropout import DropoutKeys
from memfit.training.plan import TrainPlan, autocast, usable_fraction
from memfit.memory.device import Device

log = logging.getLogger("memfit")


@dataclass(frozen=True, slots=True)
class Schedule:
    """AdamW learning rates and their schedule: linear warmup from 0, then linear decay to 0.

    ``head_lr`` applies to the parameters outside the model's encoder (``model.base_model``): a new
    classification head starts from random weights and needs larger steps than the pretrained encoder."""

    lr: float
    head_lr: float
    warmup_steps: int
    total_steps: int

    def factor(self, step: int) -> float:
        """Multiplier of the peak rates before optimizer step ``step + 1``."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        return max(0.0, (self.total_steps - step) / max(1, self.total_steps - self.warmup_steps))


def parameter_groups(model, schedule: Schedule) -> list[dict[str, Any]]:
    """The encoder's parameters at ``lr``, the rest (the head) at ``head_lr``."""
    encoder = {id(p) for p in model.base_model.parameters()}
    body = [p for p in model.parameters() if id(p) in encoder]
    head = [p for p in model.parameters() if id(p) not in encoder]
    return [{"params": body, "lr": schedule.lr}, {"params": head, "lr": schedule.head_lr}]


class Trainer:
    """One model, its AdamW optimizer and schedule, and the accumulate-then-step loop with the OOM guard."""

    def __init__(
        self,
        model,
        device: Device,
        plan: TrainPlan,
        pad_token_id: int,
        schedule: Schedule,
        dropout_keys: DropoutKeys | None = None,
    ):
        self.model = model
        self.dropout_keys = dropout_keys  # set per micro-batch: masks depend on examples, not on the split
        self.device = device
        self.plan = plan
        self.pad_token_id = pad_token_id
        self.budget = AdaptiveBudget(plan.micro_budget)
        self.checkpointing = False
        meter = PeakMeter(device)
        self.meter = meter if device.type == "cpu" and meter.available else None
        self.cost_ratio = 1.0  # measured / predicted cost of a step, the worst seen (CPU)
        self._largest_micro_tokens = 0
        # the closed loop between micro-batches (CPU): each is cut to the room the resident set leaves
        # beside the step's transient state (gradients, scratch)
        self.guard = (
            None
            if self.meter is None
            else ResidentSetGuard(
                plan.budget_bytes,
                self._micro_batch_cost(),
                concurrent_bytes=self._transient_bytes,
                resume_hint="--resume continues from the last checkpoint",
            )
        )
        if plan.gradient_checkpointing:
            self._checkpointing_on()
        # no weight decay and gradient norm clipped at 1, as transformers' Trainer defaults
        self.optimizer = torch.optim.AdamW(parameter_groups(model, schedule), weight_decay=0.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule.factor)
        self.scaler = torch.amp.GradScaler(device.type, enabled=plan.dtype == "fp16")

    def _checkpointing_on(self) -> None:
        enable_activation_checkpointing(self.model)
        self.checkpointing = True

    def autocast(self):
        return autocast(self.device, self.plan.dtype)

    def _inputs(self, windows: Sequence[Window]) -> dict[str, torch.Tensor]:
        return pad_windows(windows, self.pad_token_id, self.device)

    def fit_to_held_memory(self, longest: int) -> int:
        """Re-derive the micro-batch token budget from the memory the process holds now; returns that.

        The plan reads the baseline once, before training. On the CPU the resident set then drifts up:
        oneDNN caches kernels per input shape and glibc's heap fragments (measured on MiniLM with mixed
        lengths: +0.13 GiB over an epoch, heap trimmed after every step), and a step costs a few percent
        more than its saved tensors predict. So before each step the room is re-measured, and each step's
        cost is scaled by the worst ratio of measured to predicted cost seen so far (CPU only; CUDA's
        allocator counts exactly). When one example no longer fits without checkpointing, checkpointing
        turns on (unless the user fixed that choice)."""
        plan = self.plan
        width = padded_length(longest)
        held, room = self._held_and_room()
        if room < plan.full_bytes_per_token * width and self.device.type == "cpu":
            # before checkpointing or refusing, hand back what the process can read again (clean file pages,
            # freed heap): after a fresh install they are well over 100 MiB (docs/memory.md)
            release_host_memory()
            held, room = self._held_and_room()
        if room < plan.full_bytes_per_token * width and not self.checkpointing and plan.auto_checkpointing:
            log.warning(
                "the process now holds %.2f GiB: one example of %d tokens needs gradient checkpointing "
                "to stay within the budget; turning it on",
                held / 2**30,
                width,
            )
            self._checkpointing_on()
        if room < self._bytes_per_token * width:
            # the CPU has no out-of-memory signal to fall back on: running the step would pass the budget.
            # The suggestion adds 10% for the drift the docstring describes (one run need not be refused twice).
            fraction = usable_fraction(self.device)
            needed = held + self.cost_ratio * (self._transient_bytes + self._bytes_per_token * width / fraction)
            raise DoesNotFitError(
                f"the process now holds {held / 2**30:.2f} GiB (runtime, weights, AdamW state), and one training "
                f"example of {width} tokens needs more than the {plan.budget_bytes / 2**30:.2f} GiB budget leaves "
                f"beside it{' even with gradient checkpointing' if self.checkpointing else ''}: "
                f"--memory-budget {math.ceil(1.1 * needed / 2**20 / 10) * 10}MiB would work (or a smaller "
                "--max-length); --resume continues from the last checkpoint"
            )
        tokens = min(plan.micro_budget.max_batch_tokens, max(width, int(room / self._bytes_per_token)))
        self.budget.base = BatchBudget(max_batch_tokens=tokens, max_batch_seqs=plan.batch_size)
        if self.guard is not None:
            self.guard.activations = self._micro_batch_cost()
        return held

    def _held_and_room(self) -> tuple[int, float]:
        """What the process holds now (with AdamW's moments before the first step allocates them), and the
        activation room the budget leaves beside it and the step's transients."""
        plan = self.plan
        held = self.meter.start() if self.meter is not None else device_memory(self.device).used_by_process_bytes
        if not self.optimizer.state:
            held += plan.optimizer_bytes  # the moments are allocated by the first optimizer step
        room = ((plan.budget_bytes - held) / self.cost_ratio - self._transient_bytes) * usable_fraction(self.device)
        return held, room

    def _micro_batch_cost(self) -> ActivationModel:
        """A micro-batch's activations as the guard predicts them: the plan's per-token bytes under the
        checkpointing in force, scaled by the worst measured-to-predicted step cost so far."""
        return ActivationModel(bytes_per_token=self._bytes_per_token * self.cost_ratio, bytes_per_attention_cell=0.0)

    @property
    def _transient_bytes(self) -> int:
        """Held only during a step: gradients, autocast's weight copies, AdamW's scratch."""
        return self.plan.state_bytes - self.plan.optimizer_bytes

    def _not_yet_resident_bytes(self, first_micro_batch: bool) -> int:
        """What a micro-batch's backward may add beside its activations that the resident set does not
        hold yet: a step's first one allocates the gradients (freed after every step) and builds the
        largest parameter's dense gradient; later ones find the gradients resident and only build that
        dense gradient (plus, under autocast, the low-precision weight copies, remade per forward)."""
        if first_micro_batch:
            return self._transient_bytes
        gradients = self.plan.optimizer_bytes // 2  # 4 of AdamW's 8 bytes per parameter
        autocast_copies = self.plan.optimizer_bytes // 4 if self.plan.dtype != "fp32" else 0  # 2 bytes per parameter
        largest_param_copies = self._transient_bytes - gradients - autocast_copies
        return largest_param_copies // 2 + autocast_copies

    @property
    def _bytes_per_token(self) -> float:
        return self.plan.bytes_per_token_with(self.checkpointing)

    def _learn_step_cost(self, held: int) -> None:
        """Compare the step's measured peak with the model's prediction for its largest micro-batch."""
        if self.meter is None or self._largest_micro_tokens == 0:
            return
        predicted = self._transient_bytes + self._largest_micro_tokens * self._bytes_per_token
        measured = self.meter.peak() - held
        if measured > predicted * self.cost_ratio:
            self.cost_ratio = measured / predicted
            log.info(
                "a step cost %.2f GiB, %.0f%% of the estimate: scaling later estimates by that",
                measured / 2**30,
                100 * self.cost_ratio,
            )

    def _make_room(self, next_micro_tokens: int) -> None:
        """Hand the last backward's freed activations back to the kernel if the heap that keeps them plus
        the next micro-batch would pass the budget (CPU).

        glibc keeps freed blocks, and a new micro-batch reuses them only in part: without a trim a step's
        resident set grew with each micro-batch (bert-base, checkpointing, 512 tokens: a step of 11
        micro-batches of 3 peaked 0.24 GiB higher). Trimming every time costs speed instead (the pages
        are faulted back in: 0.58 vs 0.73 examples/s at a 4 GiB budget), so it is done only when needed."""
        if self.meter is None:
            return
        needed = next_micro_tokens * self._bytes_per_token * self.cost_ratio
        if self.meter.current() + needed > self.plan.budget_bytes:
            self.meter.trim()

    def step(self, windows: Sequence[Window], labels: np.ndarray, examples: Sequence[int] | None = None) -> float:
        """One optimizer step on the whole effective batch; redone with smaller micro-batches after an OOM.

        ``examples``: the windows' indices in the training data, which key their dropout masks."""
        held = self.fit_to_held_memory(max(len(w) for w in windows))
        if self.dropout_keys is not None:
            self.dropout_keys.step = self.scheduler.last_epoch  # optimizer steps done, restored on resume
        while True:
            loss, failed_size = self._accumulate(windows, labels, examples)
            if failed_size == 0:
                break
            self.model.zero_grad(set_to_none=True)
            free_cached_memory(self.device)
            if failed_size > 1:
                self.budget.record_oom()
            elif not self.checkpointing:
                log.warning("out of memory at micro-batch 1: turning on gradient checkpointing")
                self._checkpointing_on()
            else:
                raise DoesNotFitError(
                    f"one example of {max(len(w) for w in windows)} tokens does not fit "
                    "the memory budget even with gradient checkpointing"
                )
        if self.device.type == "cpu":
            # the last backward's freed activations go back to the kernel before AdamW's temporaries are
            # allocated beside them (measured: the optimizer step was the step's peak, 43 MiB over budget)
            trim_host_heap()
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.model.zero_grad(set_to_none=True)
        self._learn_step_cost(held)
        if self.device.type == "cpu":
            # the step's freed activations, gradients and AdamW scratch go back to the kernel; without this
            # glibc's heap kept growing through an epoch (measured: +0.3 GiB over 6 steps on MiniLM)
            trim_host_heap()
        self.budget.record_success()
        return loss

    def _accumulate(
        self, windows: Sequence[Window], labels: np.ndarray, examples: Sequence[int] | None
    ) -> tuple[float, int]:
        """Gradients of the batch's mean loss, micro-batch by micro-batch: ``(loss, 0)``, or
        ``(nan, size)`` of the micro-batch that ran out of memory (the engine's out-of-memory test; the
        caller frees memory and redoes the step)."""
        lengths = [len(w) for w in windows]
        total = 0.0
        parts = list(plan_batches(lengths, self.budget.current))
        self._largest_micro_tokens = 0
        k = 0
        while k < len(parts):
            part = parts[k]
            width = padded_length(max(lengths[i] for i in part))
            admission = None
            if self.guard is not None:  # cut to the room the resident set leaves now
                self.guard.concurrent_bytes = self._not_yet_resident_bytes(first_micro_batch=k == 0)
                admission = self.guard.admit(len(part), width)
                if admission.batch_size < len(part):
                    parts[k : k + 1] = [part[: admission.batch_size], part[admission.batch_size :]]
                    part = parts[k]
            self._largest_micro_tokens = max(self._largest_micro_tokens, len(part) * width)
            if self.dropout_keys is not None:
                self.dropout_keys.examples = None if examples is None else [examples[i] for i in part]
            try:
                fitted, loss = unless_out_of_memory(partial(self.micro_batch, windows, labels, part))
            finally:
                if admission is not None:
                    self.guard.done(admission)
            if not fitted:
                return float("nan"), len(part)
            total += loss
            k += 1
            if k < len(parts):
                self._make_room(len(parts[k]) * padded_length(max(lengths[i] for i in parts[k])))
        return total, 0

    def micro_batch(self, windows: Sequence[Window], labels: np.ndarray, part: Sequence[int]) -> float:
        """Forward and backward of the windows ``part``; returns their share of the batch's mean loss.

        The unit :meth:`step` runs once per micro-batch (after the guard has cut it to the room left); public so
        that a caller (a test) can watch the micro-batches a step is cut into."""
        inputs = self._inputs([windows[i] for i in part])
        target = torch.as_tensor(labels[part], device=self.device)
        with self.autocast():
            logits = self.model(**inputs).logits
        # sum over the micro-batch / effective batch: the micro-batches add up to the batch mean
        loss = torch.nn.functional.cross_entropy(logits.float(), target, reduction="sum") / len(windows)
        self.scaler.scale(loss).backward()
        return float(loss.detach())

    def predict(self, data: Examples) -> np.ndarray:
        """Predicted label ids for ``data``: the inference engine's batches and OOM guard, training budget."""
        self.model.eval()
        engine = TorchEngine(self.model, self.device, self.pad_token_id, _argmax_head)
        try:
            with self.autocast():
                predicted = run_windows(engine, data.windows, self.budget, self.device)
        except SequenceDoesNotFit as failed:
            raise DoesNotFitError(
                f"evaluating one example of {len(failed.window)} tokens does not fit the memory budget"
            ) from None
        finally:
            self.model.train()
        return np.asarray(predicted, dtype=np.int64)

    def state(self) -> dict[str, Any]:
        """What a checkpoint needs besides the weights to continue exactly where this step left off."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "torch_rng": torch.get_rng_state(),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["torch_rng"])


def _argmax_head(output: Any, attention_mask: torch.Tensor, windows: Sequence[Window]) -> list[int]:
    """Engine head for evaluation: the predicted class of each window."""
    return output.logits.argmax(-1).tolist()
