"""Fine-tuning a sequence classifier under a memory budget: ``memfit train`` and :func:`train`.

``batch_size`` is the *effective* batch: every optimizer step sees exactly that many examples, whatever
the budget. The trainer splits each batch into length-aware micro-batches with the inference planner
(``planner.plan_batches``, padded tokens under a token budget) and accumulates their gradients, with the
loss normalised so that the sum over micro-batches is the full batch's mean loss; the update is then the
same as one full-batch step (tested to float tolerance).

The training memory model (:func:`plan_training`) predicts the peak as

    baseline (process + fp32 master weights) + gradients (4 B/param) + AdamW moments (8 B/param)
    + AdamW scratch (4 B x the largest parameter)
    [+ a bf16/fp16 copy of the weights under autocast (2 B/param)] + micro_batch_tokens x bytes_per_token

``bytes_per_token`` is calibrated on the model itself, with probes small enough to fit any budget that
training fits: forwards on 1 and 2 copies of 32- and 64-token slices of the longest example count the
bytes autograd saves for backward; the 2-minus-1 differences are the cost of one more sequence at two
lengths, which separates a per-token term from the attention's length^2 term, and both are extrapolated
to the longest example (times a safety factor for backward's working memory; on the CPU a further 20% of
the room is left for heap fragmentation). With gradient checkpointing only each layer's input is kept
plus one layer's activations while that layer is recomputed. Checkpointing turns on only when a single
longest example does not fit without it. Before every step the micro-batch budget is re-fitted to the
memory the process really holds (the CPU's resident set drifts up during training), scaled by the
worst measured-to-predicted step cost seen so far. Mixed precision follows the inference ``dtype`` rules (bf16
autocast where fast, fp32 master weights). An out-of-memory error during a step shrinks the micro-batch
budget (the engine's :class:`~memfit.engine.AdaptiveBudget`) and *redoes* the step with the same
examples, so no example is skipped and the effective batch is kept.

Training data is held in memory as token ids (fine-tuning sets are small next to inference corpora).
Each epoch writes a checkpoint (``OUT/checkpoints/epoch-N``); ``resume=True`` continues from the last
one. The final model is a plain Hugging Face ``AutoModelForSequenceClassification`` directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import resource
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.chunking import SpecialTokens, Window
from memfit.engine import AdaptiveBudget, free_cached_memory, is_out_of_memory, pad_windows
from memfit.errors import ConfigError, DoesNotFitError, InputError, OutputError
from memfit.memory import (
    ActivationModel,
    PeakMeter,
    budget_from_bytes,
    device_memory,
    process_peak_rss_bytes,
    resolve_budget_bytes,
    trim_host_heap,
)
from memfit.models import (
    DTYPES,
    load_model,
    load_tokenizer,
    read_sentence_transformer_defaults,
    resolve_device,
    resolve_dtype,
    resolve_max_length,
    resolve_model_name,
)
from memfit.planner import BatchBudget, padded_length, plan_batches
from memfit.preflight import check_training_labels
from memfit.relation import Examples, RowReader, add_marker_tokens, build_examples
from memfit.runner import Progress

log = logging.getLogger("memfit")

GRAD_BYTES_PER_PARAM = 4  # fp32 gradients of the fp32 master weights
ADAMW_BYTES_PER_PARAM = 8  # exp_avg + exp_avg_sq, fp32
AUTOCAST_BYTES_PER_PARAM = 2  # autocast's cached bf16/fp16 copy of each weight
CPU_TRAINING_MARGIN = 0.2
"""Part of the activation room kept free on the CPU. Training's micro-batches come in many shapes, and
the resident set drifts up with them (oneDNN's per-shape kernel cache, glibc heap fragmentation:
measured +0.2 GiB over 4 epochs of MiniLM at a 1.25 GiB budget, heap trimmed after each step); the
per-step re-fit follows the drift, this margin absorbs what one step adds before it is seen."""
ACTIVATION_SAFETY = 1.3
"""Saved tensors are most of a step's peak, not all of it: backward holds the gradient of one layer's
activations next to them, and the allocator keeps some slack. Measured peaks stay under this factor."""


@dataclass(frozen=True, slots=True)
class TrainPlan:
    """The trainer's memory decision, in bytes and tokens (printed and stored in ``metrics.json``)."""

    budget_bytes: int
    baseline_bytes: int  # the process before training state: runtime + fp32 weights
    state_bytes: int  # gradients + AdamW moments (+ autocast weight copies, AdamW scratch)
    optimizer_bytes: int  # the AdamW moments within state_bytes: held from the first step on
    full_bytes_per_token: float  # activations per padded token of a micro-batch, safety factor included
    checkpointed_bytes_per_token: float  # the same with gradient checkpointing
    gradient_checkpointing: bool
    auto_checkpointing: bool  # whether memfit may turn checkpointing on later (not forced off or on)
    dtype: str
    batch_size: int  # effective batch: examples per optimizer step
    max_length: int
    longest_padded: int  # padded length of the longest training example
    micro_budget: BatchBudget

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
        return max(1, min(self.batch_size, self.micro_budget.max_batch_tokens // self.longest_padded))

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

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["micro_budget"] = asdict(self.micro_budget)
        out["micro_batch_at_longest"] = self.micro_batch_at_longest
        out["bytes_per_token"] = self.bytes_per_token
        return out


def training_state_bytes(n_params: int, largest_param: int, dtype: str) -> int:
    """Bytes of gradients and optimizer state (and autocast's low-precision weight copies).

    ``largest_param`` (elements) adds the single-tensor AdamW step's temporaries: it updates one parameter
    at a time with a few scratch tensors of that parameter's size, so the biggest one (usually the word
    embeddings) sets the step's extra peak (measured on MiniLM: +33 MiB over the moments, 45 MiB embeddings).
    """
    per_param = GRAD_BYTES_PER_PARAM + ADAMW_BYTES_PER_PARAM
    if dtype != "fp32":
        per_param += AUTOCAST_BYTES_PER_PARAM
    return n_params * per_param + largest_param * GRAD_BYTES_PER_PARAM


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


def usable_fraction(device: torch.device) -> float:
    """The part of the activation room micro-batches may fill: all of it on CUDA, less
    :data:`CPU_TRAINING_MARGIN` on the CPU."""
    return 1 - CPU_TRAINING_MARGIN if device.type == "cpu" else 1.0


def plan_training(*, budget_bytes: int, baseline_bytes: int, state_bytes: int, optimizer_bytes: int,
                  full_bytes_per_token: float,
                  checkpointed_bytes_per_token: float, longest_padded: int, batch_size: int, dtype: str,
                  max_length: int, device: torch.device, gradient_checkpointing: bool | None = None) -> TrainPlan:
    """Choose checkpointing and the micro-batch token budget; pure arithmetic, so it is unit-tested.

    ``gradient_checkpointing=None`` decides by itself: on only when one longest example does not fit.
    """
    room = activation_room(budget_bytes, baseline_bytes, state_bytes)
    usable = usable_fraction(device)
    room = int(room * usable)
    gib = 2**30
    auto_checkpointing = gradient_checkpointing is None
    if gradient_checkpointing is None:
        gradient_checkpointing = room < full_bytes_per_token * longest_padded
    per_token = checkpointed_bytes_per_token if gradient_checkpointing else full_bytes_per_token
    if room < per_token * longest_padded:
        needed = budget_bytes + (per_token * longest_padded - room) / usable
        raise DoesNotFitError(
            f"one example of {longest_padded} tokens needs {per_token * longest_padded / gib:.2f} GiB of "
            f"activations{' even with gradient checkpointing' if gradient_checkpointing else ''}, but only "
            f"{room / gib:.2f} GiB of the budget is left (training needs at least {needed / gib:.2f} GiB); "
            "use a smaller --max-length or raise --memory-budget"
        )
    micro_budget = budget_from_bytes(room, ActivationModel(bytes_per_token=per_token, bytes_per_attention_cell=0.0),
                                     device, DTYPES[dtype])
    micro_budget = BatchBudget(max_batch_tokens=micro_budget.max_batch_tokens, max_batch_seqs=batch_size)
    return TrainPlan(budget_bytes=budget_bytes, baseline_bytes=baseline_bytes, state_bytes=state_bytes,
                     optimizer_bytes=optimizer_bytes, full_bytes_per_token=full_bytes_per_token,
                     checkpointed_bytes_per_token=checkpointed_bytes_per_token,
                     gradient_checkpointing=gradient_checkpointing, auto_checkpointing=auto_checkpointing, dtype=dtype,
                     batch_size=batch_size, max_length=max_length, longest_padded=longest_padded,
                     micro_budget=micro_budget)


# -- public API -------------------------------------------------------------------------------------


def train(
    data: str | os.PathLike,
    output_dir: str | os.PathLike,
    model: str | os.PathLike | None = None,
    *,
    text_field: str = "text",
    text_pair_field: str | None = None,
    label_field: str = "label",
    relation: bool = False,
    head_field: str = "head",
    tail_field: str = "tail",
    eval_data: str | os.PathLike | None = None,
    epochs: int = 3,
    lr: float = 2e-5,
    batch_size: int = 32,
    max_length: int | None = None,
    memory_budget: str | int | None = None,
    device: str = "auto",
    dtype: str = "auto",
    gradient_checkpointing: bool | None = None,
    seed: int = 0,
    input_format: str | None = None,
    resume: bool = False,
    progress: bool | None = False,
    echo: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Fine-tune ``model`` as a classifier of ``label_field`` and save it to ``output_dir``; return the metrics.

    ``data`` / ``eval_data``: jsonl, csv/tsv or parquet with a text and a label per record (and a second
    text with ``text_pair_field``). ``relation=True`` reads head/tail entity spans (or inline markers) and
    adds entity marker tokens; see docs/train.md for the record format. ``batch_size`` is the effective
    batch; micro-batches, gradient checkpointing (``None``: when needed) and precision (``dtype``, as for
    inference) are chosen to fit ``memory_budget``. ``echo`` receives the plan and one line per epoch.
    """
    from transformers import AutoModelForSequenceClassification

    say = echo or log.info
    if epochs < 1 or batch_size < 1 or lr <= 0:
        raise ConfigError(f"epochs and batch_size must be >= 1 and lr > 0 (got {epochs}, {batch_size}, {lr})")
    if relation and text_pair_field is not None:
        raise ConfigError("relation classification takes one text with entity spans; drop text_pair_field")
    check_training_labels(os.fspath(data), label_field, input_format)
    out = Path(output_dir)
    settings = {
        "data": os.path.abspath(data), "eval_data": None if eval_data is None else os.path.abspath(eval_data),
        "model": resolve_model_name(model), "text_field": text_field, "text_pair_field": text_pair_field,
        "label_field": label_field, "relation": relation, "head_field": head_field, "tail_field": tail_field,
        "epochs": epochs, "lr": lr, "batch_size": batch_size, "max_length": max_length, "seed": seed,
    }
    checkpoint = _prepare_output(out, settings, resume)
    if checkpoint is None and (out / "metrics.json").is_file():
        return json.loads((out / "metrics.json").read_text())  # resumed a run that had finished
    device_ = resolve_device(device)
    dtype_name = resolve_dtype(dtype, device_)
    if dtype_name == "fp16" and device_.type != "cuda":
        raise ConfigError("fp16 training needs CUDA; use --dtype bf16 or fp32 on the CPU")
    source = str(checkpoint) if checkpoint else settings["model"]
    tokenizer = load_tokenizer(source)
    marker_ids = add_marker_tokens(tokenizer) if relation else []
    reader = RowReader(text_field, text_pair_field, label_field, relation, head_field, tail_field, input_format)
    texts, pairs, raw_labels, lines = reader.read(os.fspath(data))
    if not texts:
        raise InputError(os.fspath(data), "no training records")
    eval_rows = reader.read(os.fspath(eval_data)) if eval_data is not None else None

    torch.manual_seed(seed)  # the new classifier head's initialisation
    config_labels = _config_labels(source)
    labels = config_labels if config_labels and set(config_labels) == set(raw_labels) else sorted(set(raw_labels))
    id2label = dict(enumerate(labels))
    with _quiet_transformers():
        net = load_model(source, AutoModelForSequenceClassification, device_, "fp32", num_labels=len(labels),
                         id2label=id2label, label2id={label: i for i, label in enumerate(labels)},
                         ignore_mismatched_sizes=True)
    if labels != config_labels:
        say(f"new classification head for {len(labels)} labels: {', '.join(labels[:10])}"
            f"{' …' if len(labels) > 10 else ''}")
    if net.get_input_embeddings().num_embeddings < len(tokenizer):
        net.resize_token_embeddings(len(tokenizer))  # room for the entity markers
    st_defaults = read_sentence_transformer_defaults(settings["model"])
    window = resolve_max_length(max_length, net.config, tokenizer, st_defaults)
    special = SpecialTokens.from_tokenizer(tokenizer)
    label_ids = {label: i for i, label in enumerate(labels)}
    train_set = build_examples(tokenizer, special, window, marker_ids, texts, pairs, raw_labels, label_ids,
                          os.fspath(data), lines, label_field)
    eval_set = None
    if eval_rows is not None:
        eval_set = build_examples(tokenizer, special, window, marker_ids, *eval_rows[:3], label_ids,
                             os.fspath(eval_data), eval_rows[3], label_field)

    plan = _plan(net, train_set, special, device_, dtype_name, memory_budget, batch_size, window,
                 gradient_checkpointing)
    say(plan.describe())
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    steps_per_epoch = -(-len(train_set) // batch_size)
    trainer = _Trainer(net, device_, plan, pad_id, lr, epochs * steps_per_epoch)
    history: list[dict[str, Any]] = []
    first_epoch = 1
    if checkpoint is not None:
        state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
        trainer.load_state(state)
        history, first_epoch = state["history"], state["epoch"] + 1
        say(f"resuming after epoch {state['epoch']} from {checkpoint}")
    for epoch in range(first_epoch, epochs + 1):
        order = np.random.default_rng([seed, epoch]).permutation(len(train_set))
        started = time.perf_counter()
        loss = trainer.epoch(train_set, order, progress)
        seconds = time.perf_counter() - started
        row: dict[str, Any] = {"epoch": epoch, "train_loss": loss, "seconds": round(seconds, 2),
                               "examples_per_s": round(len(train_set) / seconds, 2)}
        if eval_set is not None:
            predicted = trainer.predict(eval_set)
            row["eval_accuracy"] = float(np.mean(predicted == eval_set.labels))
            row["eval_macro_f1"] = macro_f1(eval_set.labels, predicted)
        history.append(row)
        _save_checkpoint(out, epoch, net, tokenizer, trainer.state(epoch, history, settings))
        say(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))

    with _quiet_transformers():
        net.save_pretrained(out)
        tokenizer.save_pretrained(out)
    metrics = {
        "labels": labels, "settings": settings, "device": str(device_), "plan": plan.as_dict(),
        "epochs": history, "oom_events": trainer.budget.oom_events,
        "peak_memory_bytes": peak_memory_bytes(device_), "train_examples": len(train_set),
        "eval_examples": None if eval_set is None else len(eval_set),
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return metrics


def macro_f1(gold: np.ndarray, predicted: np.ndarray) -> float:
    """Unweighted mean of per-class F1 over the classes that occur in ``gold`` or ``predicted``."""
    scores = []
    for label in np.union1d(gold, predicted):
        tp = np.sum((predicted == label) & (gold == label))
        fp = np.sum((predicted == label) & (gold != label))
        fn = np.sum((predicted != label) & (gold == label))
        scores.append(0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn))
    return float(np.mean(scores)) if scores else 0.0


def peak_memory_bytes(device: torch.device) -> int:
    """Peak of what the budget covers: allocated memory on CUDA, the process's peak RSS on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if sys.platform.startswith("linux"):
        return process_peak_rss_bytes()  # survives the per-step resets of VmHWM
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB elsewhere


# -- the step loop ----------------------------------------------------------------------------------


class _Trainer:
    """One model, its AdamW optimizer and schedule, and the accumulate-then-step loop with the OOM guard."""

    def __init__(self, model, device: torch.device, plan: TrainPlan, pad_token_id: int, lr: float, total_steps: int):
        self.model = model
        self.device = device
        self.plan = plan
        self.pad_token_id = pad_token_id
        self.budget = AdaptiveBudget(plan.micro_budget)
        self.checkpointing = False
        meter = PeakMeter(device)
        self.meter = meter if device.type == "cpu" and meter.available else None
        self.cost_ratio = 1.0  # measured / predicted cost of a step, the worst seen (CPU)
        self._largest_micro_tokens = 0
        if plan.gradient_checkpointing:
            self._checkpointing_on()
        # Trainer's defaults: no weight decay, linear decay to 0, gradient norm clipped at 1
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: max(0.0, 1.0 - step / max(1, total_steps)))
        self.scaler = torch.amp.GradScaler(device.type, enabled=plan.dtype == "fp16")

    def _checkpointing_on(self) -> None:
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.checkpointing = True

    def _autocast(self):
        return autocast(self.device, self.plan.dtype)

    def _inputs(self, windows: Sequence[Window]) -> dict[str, torch.Tensor]:
        return pad_windows(windows, self.pad_token_id, self.device)

    def epoch(self, data: Examples, order: np.ndarray, progress: bool | None) -> float:
        """One pass over ``data`` in ``order``; returns the mean training loss."""
        self.model.train()
        bar = Progress(len(order), progress, unit="example")
        total = 0.0
        try:
            for start in range(0, len(order), self.plan.batch_size):
                batch = order[start:start + self.plan.batch_size].tolist()
                total += self.step([data.windows[i] for i in batch], data.labels[batch]) * len(batch)
                bar.add_texts(len(batch))
        finally:
            bar.close()
        return total / len(order)

    def _fit_to_held_memory(self, longest: int) -> int:
        """Re-derive the micro-batch token budget from the memory the process holds now; returns that.

        The plan reads the baseline once, before training. On the CPU the resident set then drifts up:
        oneDNN caches kernels per input shape and glibc's heap fragments (measured on MiniLM with mixed
        lengths: +0.13 GiB over an epoch, heap trimmed after every step), and a step costs a few percent
        more than its saved tensors predict. So before each step the room is re-measured, and each step's
        cost is scaled by the worst ratio of measured to predicted cost seen so far (CPU only; CUDA's
        allocator counts exactly). When one example no longer fits without checkpointing, checkpointing
        turns on (unless the user fixed that choice)."""
        plan = self.plan
        held = self.meter.start() if self.meter is not None else device_memory(self.device).used_by_process_bytes
        if not self.optimizer.state:
            held += plan.optimizer_bytes  # the moments are allocated by the first optimizer step
        room = ((plan.budget_bytes - held) / self.cost_ratio - self._transient_bytes) * usable_fraction(self.device)
        width = padded_length(longest)
        if room < plan.full_bytes_per_token * width and not self.checkpointing and plan.auto_checkpointing:
            log.warning("the process now holds %.2f GiB: one example of %d tokens needs gradient checkpointing "
                        "to stay within the budget; turning it on", held / 2**30, width)
            self._checkpointing_on()
        # never below one example: if even that does not fit, the OOM guard is the last resort
        tokens = min(plan.micro_budget.max_batch_tokens, max(width, int(room / self._bytes_per_token)))
        self.budget.base = BatchBudget(max_batch_tokens=tokens, max_batch_seqs=plan.batch_size)
        return held

    @property
    def _transient_bytes(self) -> int:
        """Held only during a step: gradients, autocast's weight copies, AdamW's scratch."""
        return self.plan.state_bytes - self.plan.optimizer_bytes

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
            log.info("a step cost %.2f GiB, %.0f%% of the estimate: scaling later estimates by that",
                     measured / 2**30, 100 * self.cost_ratio)

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

    def step(self, windows: Sequence[Window], labels: np.ndarray) -> float:
        """One optimizer step on the whole effective batch; redone with smaller micro-batches after an OOM."""
        held = self._fit_to_held_memory(max(len(w) for w in windows))
        while True:
            loss, failed_size = self._accumulate(windows, labels)
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
                raise DoesNotFitError(f"one example of {max(len(w) for w in windows)} tokens does not fit "
                                      "the memory budget even with gradient checkpointing")
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

    def _accumulate(self, windows: Sequence[Window], labels: np.ndarray) -> tuple[float, int]:
        """Gradients of the batch's mean loss, micro-batch by micro-batch: ``(loss, 0)``, or
        ``(nan, size)`` of the micro-batch that ran out of memory (handled by the caller, outside the
        ``except`` block, so the failed micro-batch's tensors are already released)."""
        lengths = [len(w) for w in windows]
        total = 0.0
        parts = list(plan_batches(lengths, self.budget.current))
        micro_tokens = [len(part) * padded_length(max(lengths[i] for i in part)) for part in parts]
        self._largest_micro_tokens = max(micro_tokens)
        for k, part in enumerate(parts):
            try:
                inputs = self._inputs([windows[i] for i in part])
                target = torch.as_tensor(labels[part], device=self.device)
                with self._autocast():
                    logits = self.model(**inputs).logits
                # sum over the micro-batch / effective batch: the micro-batches add up to the batch mean
                loss = torch.nn.functional.cross_entropy(logits.float(), target, reduction="sum") / len(windows)
                self.scaler.scale(loss).backward()
                total += float(loss.detach())
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                return float("nan"), len(part)
            if k + 1 < len(parts):
                self._make_room(micro_tokens[k + 1])
        return total, 0

    @torch.inference_mode()
    def predict(self, data: Examples) -> np.ndarray:
        """Predicted label ids for ``data``, in micro-batches of the training budget."""
        self.model.eval()
        predicted = np.zeros(len(data), dtype=np.int64)
        for part in plan_batches([len(w) for w in data.windows], self.budget.current):
            with self._autocast():
                logits = self.model(**self._inputs([data.windows[i] for i in part])).logits
            predicted[part] = logits.argmax(-1).cpu().numpy()
        self.model.train()
        return predicted

    def state(self, epoch: int, history: list, settings: dict) -> dict[str, Any]:
        return {"epoch": epoch, "history": history, "settings": settings, "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "torch_rng": torch.get_rng_state()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["torch_rng"])


def autocast(device: torch.device, dtype: str):
    """Mixed precision for the forward pass (fp32 master weights and optimizer stay untouched)."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[dtype])


# -- memory calibration -----------------------------------------------------------------------------


def _plan(model, data: Examples, special: SpecialTokens, device: torch.device, dtype: str,
          memory_budget: str | int | None, batch_size: int, max_length: int,
          gradient_checkpointing: bool | None) -> TrainPlan:
    """Measure the model's activation bytes, then plan against the budget.

    The baseline is read *after* calibration and one short backward pass (with freed heap handed back),
    so what the first forward and backward leave behind for good (autograd's worker state, oneDNN kernel
    caches: ~75 MiB on the CPU) is counted, and the probes themselves stay small."""
    memory = device_memory(device)
    budget = resolve_budget_bytes(memory_budget, memory)
    sizes = [p.numel() for p in model.parameters()]
    state = training_state_bytes(sum(sizes), max(sizes), dtype)
    activation_room(budget, memory.used_by_process_bytes, state)  # refuse before spending time calibrating
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
    return plan_training(
        budget_bytes=budget, baseline_bytes=device_memory(device).used_by_process_bytes,
        state_bytes=state, optimizer_bytes=ADAMW_BYTES_PER_PARAM * sum(sizes),
        full_bytes_per_token=full, checkpointed_bytes_per_token=checkpointed,
        longest_padded=longest_padded, batch_size=batch_size, dtype=dtype, max_length=max_length,
        device=device, gradient_checkpointing=gradient_checkpointing)


PROBE_LENGTHS = (32, 64)
"""Tokens of the two calibration slices: short, so calibration fits any budget that training fits
(bert-base at 64 tokens saves ~10 MiB per sequence); two lengths separate the per-token and the
length^2 (attention scores) terms."""


def saved_bytes_coefficients(model, window: Window, device: torch.device, dtype: str) -> tuple[float, float]:
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
        window, input_ids=window.input_ids[:length], own_end=min(window.own_end, length),
        token_type_ids=None if window.token_type_ids is None else window.token_type_ids[:length])


@contextlib.contextmanager
def _training_mode(model):
    """Training-mode forwards (dropout on, as in a real step) for calibration; the model's mode is restored."""
    was_training = model.training
    model.train()
    try:
        yield
    finally:
        model.train(was_training)


def _first_backward(model, window: Window, device: torch.device, dtype: str) -> None:
    """One forward + backward on a short slice of ``window``, gradients dropped: the runtime's one-time
    allocations of a first backward then happen before the baseline is read, not during training."""
    piece = _head(window, PROBE_LENGTHS[0])
    with _training_mode(model), autocast(device, dtype):
        logits = model(**pad_windows([piece], 0, device)).logits
    logits.float().sum().backward()
    model.zero_grad(set_to_none=True)


def _saved_bytes(model, inputs: dict[str, torch.Tensor], device: torch.device, dtype: str) -> int:
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


def _config_labels(model: str) -> list[str] | None:
    """The label names a classifier checkpoint already has (so fine-tuning it keeps its head), if any."""
    config_file = Path(model) / "config.json"
    if not config_file.is_file():
        return None
    id2label = json.loads(config_file.read_text()).get("id2label") or {}
    names = [id2label[k] for k in sorted(id2label, key=int)]
    return None if all(n == f"LABEL_{i}" for i, n in enumerate(names)) else names


# -- output -----------------------------------------------------------------------------------------


def _prepare_output(out: Path, settings: dict[str, Any], resume: bool) -> Path | None:
    """Check ``out`` for a fresh run or a resume; return the checkpoint to resume from, if any."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out} exists and is not a directory")
    if not resume:
        if out.is_dir() and any(out.iterdir()):
            raise OutputError(f"{out} is not empty; choose a new directory or pass --resume")
        out.mkdir(parents=True, exist_ok=True)
        return None
    out.mkdir(parents=True, exist_ok=True)
    checkpoints = sorted((p for p in (out / "checkpoints").glob("epoch-*") if (p / "trainer_state.pt").is_file()),
                         key=lambda p: int(p.name.split("-")[1]))
    if not checkpoints:
        if (out / "metrics.json").is_file():
            previous = json.loads((out / "metrics.json").read_text()).get("settings")
            _check_settings(previous, settings)
        return None
    state = torch.load(checkpoints[-1] / "trainer_state.pt", weights_only=False)
    _check_settings(state["settings"], settings)
    return checkpoints[-1]


@contextlib.contextmanager
def _quiet_transformers():
    """No transformers progress bars or load reports: memfit prints its own plan and epoch lines."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _check_settings(previous: dict | None, settings: dict[str, Any]) -> None:
    differing = [k for k in settings if previous is None or previous.get(k) != settings[k]]
    if differing:
        raise OutputError(f"cannot resume: settings differ from the interrupted run ({', '.join(differing)})")


def _save_checkpoint(out: Path, epoch: int, model, tokenizer, state: dict[str, Any]) -> None:
    """Write ``checkpoints/epoch-N`` (trainer_state.pt last: its presence marks a complete checkpoint),
    then drop older ones."""
    target = out / "checkpoints" / f"epoch-{epoch}"
    shutil.rmtree(target, ignore_errors=True)
    with _quiet_transformers():
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)
    torch.save(state, target / "trainer_state.pt.tmp")
    os.replace(target / "trainer_state.pt.tmp", target / "trainer_state.pt")
    for older in (out / "checkpoints").glob("epoch-*"):
        if older != target:
            shutil.rmtree(older, ignore_errors=True)
