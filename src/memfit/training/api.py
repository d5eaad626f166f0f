"""``memfit.train``: read labelled data, build the classifier, plan the memory, run the epochs, save.

The pieces: :mod:`memfit.training.model` (which head), :mod:`memfit.training.plan` (the memory model and
its calibration), :mod:`memfit.training.trainer` (the accumulate-then-step loop and its OOM guard),
:mod:`memfit.training.checkpoint` (output directory, checkpoints, resume).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.data.chunking import SpecialTokens
from memfit.defaults import DEFAULT_BATCH_SIZE, DEFAULT_EPOCHS, DEFAULT_LR, WARMUP_FRACTION
from memfit.engine.batches import pad_windows
from memfit.errors import ConfigError, InputError
from memfit.memory.model import process_peak_rss_bytes
from memfit.memory.peak import start_peak_window
from memfit.engine.models import (
    load_tokenizer,
    read_sentence_transformer_defaults,
    resolve_dtype,
    resolve_max_length,
    resolve_model_name,
    warn_of_slow_precision,
)
from memfit.io.preflight import check_training_labels
from memfit.data.relation import Examples, RowReader, add_marker_tokens, build_examples
from memfit.jobs.runner import Progress
from memfit.training import checkpoint as ckpt
from memfit.training.config import TrainConfig, TrainSettings
from memfit.training.model import Head, build_classifier
from memfit.training.dropout import install_seeded_dropout
from memfit.training.probe_init import initialise_head_as_probe
from memfit.training.plan import calibrate_and_plan
from memfit.training.result import EpochMetrics, EvalScores, TrainResult
from memfit.training.trainer import Schedule, Trainer
from memfit.memory.device import Device, resolve_device

log = logging.getLogger("memfit")


# Over 80 lines for its public signature (27 arguments), their docstring and the TrainConfig built from them;
# the rest is the named steps below.
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
    epochs: int = DEFAULT_EPOCHS,
    lr: float = DEFAULT_LR,
    head_lr: float | None = None,
    head_init: str = "probe",
    warmup: float = WARMUP_FRACTION,
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_length: int | None = None,
    memory_budget: str | int | None = None,
    device: str = "auto",
    dtype: str = "auto",
    gradient_checkpointing: str = "auto",
    seed: int = 0,
    input_format: str | None = None,
    resume: bool = False,
    checkpoint_every: int | None = None,
    progress: bool | None = False,
    echo: Callable[[str], None] | None = None,
) -> TrainResult:
    """Fine-tune ``model`` as a classifier of ``label_field`` and save it to ``output_dir``; return the metrics.

    ``data`` / ``eval_data``: jsonl, csv/tsv or parquet with a text and a label per record (and a second
    text with ``text_pair_field``). ``relation=True`` reads head/tail entity spans (or inline markers) and
    adds entity marker tokens; see docs/train.md for the record format. ``batch_size`` is the effective
    batch; micro-batches, gradient checkpointing (``auto``: when needed; or ``on`` / ``off``) and precision
    (``dtype``, as for inference) are chosen to fit ``memory_budget``. A new head starts as the linear probe on
    the frozen encoder (``head_init="probe"``, see :mod:`memfit.training.probe_init`) or random (``"random"``).
    ``lr`` is the encoder's peak learning rate, ``head_lr`` a new head's (``None``: ``lr`` for a probe
    start, :data:`RANDOM_HEAD_LR` for a random one), reached after the ``warmup`` fraction of the steps
    and decayed linearly to 0. With
    ``eval_data`` the best epoch's model is kept. A checkpoint is written every ``checkpoint_every``
    optimizer steps (``None``: every 10 minutes) and after every epoch; ``resume=True`` continues from the
    last one. ``echo`` receives the plan and one line per epoch. The options become one
    :class:`~memfit.training.config.TrainConfig`, which refuses bad values (:class:`ConfigError`) before
    anything is read; the result is a :class:`~memfit.training.result.TrainResult`.
    """
    say = echo or log.info
    config = TrainConfig(
        text_field=text_field,
        text_pair_field=text_pair_field,
        label_field=label_field,
        relation=relation,
        head_field=head_field,
        tail_field=tail_field,
        epochs=epochs,
        lr=lr,
        head_lr=head_lr,
        head_init=head_init,
        warmup=warmup,
        batch_size=batch_size,
        max_length=max_length,
        memory_budget=memory_budget,
        device=device,
        dtype=dtype,
        gradient_checkpointing=gradient_checkpointing,
        seed=seed,
        input_format=input_format,
        checkpoint_every=checkpoint_every,
    )
    check_training_labels(os.fspath(data), config.label_field, config.input_format)
    out = Path(output_dir)
    settings = config.settings(data, eval_data, resolve_model_name(model))
    checkpoint = ckpt.prepare_output(out, settings, resume)
    if checkpoint is None and (out / "metrics.json").is_file():
        return json.loads((out / "metrics.json").read_text())  # resumed a run that had finished
    start_peak_window()  # the peak reported is this run's, not an earlier job's in this process
    device_ = resolve_device(config.device)
    dtype_name = resolve_dtype(config.dtype, device_)
    if dtype_name == "fp16" and device_.type != "cuda":
        raise ConfigError("fp16 training needs CUDA; use --dtype bf16 or fp32 on the CPU")
    run = _load(out, config, settings, checkpoint, data, eval_data, device_, say)
    trainer, schedule, position = _plan_trainer(run, device_, dtype_name, say)
    warn_of_slow_precision(dtype_name, device_)  # after any refusal: that one prints its line alone
    _run_epochs(run, trainer, position, progress, say)
    return _save_results(run, trainer, schedule, position, device_, say)


@dataclass
class _Run:
    """What one training run works on, from :func:`_load` to :func:`_save_results`."""

    out: Path
    config: TrainConfig
    settings: TrainSettings
    checkpoint: Path | None  # the checkpoint resumed from
    state: dict[str, Any] | None  # its trainer state
    tokenizer: Any
    net: torch.nn.Module
    labels: list[str]
    head: Head
    window: int  # tokens per example
    train_set: Examples
    eval_set: Examples | None

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def save_checkpoint(self, trainer: Trainer, position: ckpt.Position) -> None:
        ckpt.save_checkpoint(
            self.out,
            self.net,
            self.tokenizer,
            self.window,
            position,
            {**trainer.state(), "head": asdict(self.head)},
            self.settings,
        )


def _load(
    out: Path,
    config: TrainConfig,
    settings: TrainSettings,
    checkpoint: Path | None,
    data: str | os.PathLike,
    eval_data: str | os.PathLike | None,
    device: Device,
    say: Callable[[str], None],
) -> _Run:
    """Read the records, build the classifier (from the checkpoint when resuming) and tokenize the examples."""
    source = str(checkpoint) if checkpoint else settings["model"]
    tokenizer = load_tokenizer(source)
    marker_ids = add_marker_tokens(tokenizer) if config.relation else []
    reader = RowReader(
        config.text_field,
        config.text_pair_field,
        config.label_field,
        config.relation,
        config.head_field,
        config.tail_field,
        config.input_format,
    )
    texts, pairs, raw_labels, lines = reader.read(os.fspath(data))
    if not texts:
        raise InputError(os.fspath(data), "no training records")
    eval_rows = reader.read(os.fspath(eval_data)) if eval_data is not None else None
    if eval_rows is not None and not eval_rows[0]:  # no epoch could be scored: the "best" would be NaN's pick
        raise InputError(os.fspath(eval_data), "no evaluation records")

    torch.manual_seed(config.seed)  # the new classifier head's initialisation
    net, labels, head = build_classifier(source, settings["model"], raw_labels, device)
    state = ckpt.load_state(checkpoint) if checkpoint is not None else None
    if state is not None:
        head = Head(**state["head"])  # the checkpoint's head is this run's, not one kept from the start model
    elif head.new:
        say(f"{head.describe()} for {len(labels)} labels: {', '.join(labels[:10])}{' …' if len(labels) > 10 else ''}")
    if net.get_input_embeddings().num_embeddings < len(tokenizer):
        net.resize_token_embeddings(len(tokenizer))  # room for the entity markers
    st_defaults = read_sentence_transformer_defaults(settings["model"])
    window = resolve_max_length(config.max_length, net.config, tokenizer, st_defaults)
    special = SpecialTokens.from_tokenizer(tokenizer)
    label_ids = {label: i for i, label in enumerate(labels)}
    label_field = config.label_field
    train_set = build_examples(
        tokenizer, special, window, marker_ids, texts, pairs, raw_labels, label_ids, os.fspath(data), lines, label_field
    )
    eval_set = None
    if eval_rows is not None:
        eval_set = build_examples(
            tokenizer,
            special,
            window,
            marker_ids,
            *eval_rows[:3],
            label_ids,
            os.fspath(eval_data),
            eval_rows[3],
            label_field,
        )
    return _Run(
        out=out,
        config=config,
        settings=settings,
        checkpoint=checkpoint,
        state=state,
        tokenizer=tokenizer,
        net=net,
        labels=labels,
        head=head,
        window=window,
        train_set=train_set,
        eval_set=eval_set,
    )


def _plan_trainer(
    run: _Run, device: Device, dtype_name: str, say: Callable[[str], None]
) -> tuple[Trainer, Schedule, ckpt.Position]:
    """Plan the memory, build the trainer and its learning-rate schedule, start the head (probe) or load
    the checkpoint's state; return them with the position training starts from."""
    config, net, train_set, pad_id = run.config, run.net, run.train_set, run.pad_id
    # before calibration, so that it measures the dropout that training runs
    dropout_keys = install_seeded_dropout(net, config.seed, pad_windows(train_set.windows[:1], pad_id, device))
    plan = calibrate_and_plan(
        net,
        train_set,
        device,
        dtype_name,
        config.memory_budget,
        config.batch_size,
        run.window,
        config.gradient_checkpointing,
    )
    say(plan.describe())
    steps_per_epoch = -(-len(train_set) // config.batch_size)
    total_steps = config.epochs * steps_per_epoch
    schedule = Schedule(
        lr=config.lr,
        head_lr=config.new_head_lr if run.head.new else config.lr,
        warmup_steps=int(config.warmup * total_steps),
        total_steps=total_steps,
    )
    trainer = Trainer(net, device, plan, pad_id, schedule, dropout_keys)
    position = ckpt.Position()
    if run.state is None and run.head.new and config.head_init == "probe":
        if initialise_head_as_probe(net, train_set, trainer.budget, device, pad_id, trainer.autocast):
            say("the head starts as the linear probe on the frozen encoder's vectors of the training data")
    if run.state is not None:
        trainer.load_state(run.state)
        position = ckpt.position_of(run.state)
        say(
            f"resuming at epoch {position.epoch}, batch {position.batches_done} of {steps_per_epoch}, "
            f"from {run.checkpoint}"
        )
    return trainer, schedule, position


def _run_epochs(
    run: _Run, trainer: Trainer, position: ckpt.Position, progress: bool | None, say: Callable[[str], None]
) -> None:
    """Train from ``position`` to the last epoch: a checkpoint when one is due and after every epoch, the
    best epoch's model kept aside when there is evaluation data."""
    train_set, batch_size, checkpoint_every = run.train_set, run.config.batch_size, run.config.checkpoint_every
    last_saved = time.monotonic()
    for epoch in range(position.epoch, run.config.epochs + 1):
        order = np.random.default_rng([run.config.seed, epoch]).permutation(len(train_set))
        batches = [order[start : start + batch_size].tolist() for start in range(0, len(order), batch_size)]
        bar = Progress(len(order), progress, unit="example")
        bar.add_texts(sum(len(b) for b in batches[: position.batches_done]))
        started = time.perf_counter() - position.seconds
        try:
            for index in range(position.batches_done, len(batches)):
                batch = batches[index]
                loss = trainer.step([train_set.windows[i] for i in batch], train_set.labels[batch], batch)
                position.loss_sum += loss * len(batch)
                position.batches_done, position.step = index + 1, position.step + 1
                position.seconds = time.perf_counter() - started
                bar.add_texts(len(batch))
                due = (
                    position.step % checkpoint_every == 0
                    if checkpoint_every is not None
                    else time.monotonic() - last_saved >= ckpt.CHECKPOINT_MINUTES * 60
                )
                if due and index + 1 < len(batches):  # the epoch's end saves below, after evaluation
                    run.save_checkpoint(trainer, position)
                    last_saved = time.monotonic()
        finally:
            bar.close()
        row = _epoch_row(epoch, position, len(train_set))
        if run.eval_set is not None:
            row.update(_evaluate(trainer, run.eval_set))
            if position.best_epoch is None or _score(row) > _score(position.history[position.best_epoch - 1]):
                position.best_epoch = epoch
                ckpt.save_best(run.out, run.net, run.tokenizer, run.window)
        position.history.append(row)
        position.epoch, position.batches_done, position.loss_sum, position.seconds = epoch + 1, 0, 0.0, 0.0
        run.save_checkpoint(trainer, position)
        last_saved = time.monotonic()
        say(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))


def _save_results(
    run: _Run,
    trainer: Trainer,
    schedule: Schedule,
    position: ckpt.Position,
    device: Device,
    say: Callable[[str], None],
) -> TrainResult:
    """Put the final (or best) model in the output directory, write metrics.json, drop the checkpoints."""
    out = run.out
    if position.best_epoch is not None:
        ckpt.publish_best(out)
        if position.best_epoch != run.config.epochs:
            say(f"kept the model of epoch {position.best_epoch}, the best on the evaluation data")
    else:
        ckpt.save_model(out, run.net, run.tokenizer, run.window)
    metrics: TrainResult = {
        "labels": run.labels,
        "settings": run.settings,
        "device": str(device),
        "head": {"pooling": run.head.pooling, "new": run.head.new, "lr": schedule.head_lr},
        "schedule": {"warmup_steps": schedule.warmup_steps, "total_steps": schedule.total_steps},
        # checkpointing as it ended: "auto" may have turned it on mid-run
        "plan": {**trainer.plan.as_dict(), "gradient_checkpointing": trainer.checkpointing},
        "epochs": position.history,
        "best_epoch": position.best_epoch,
        "oom_events": trainer.budget.oom_events,
        "peak_memory_bytes": peak_memory_bytes(device),
        "train_examples": len(run.train_set),
        "eval_examples": None if run.eval_set is None else len(run.eval_set),
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    shutil.rmtree(ckpt.checkpoints_dir(out), ignore_errors=True)
    return metrics


def _epoch_row(epoch: int, position: ckpt.Position, examples: int) -> EpochMetrics:
    return {
        "epoch": epoch,
        "train_loss": position.loss_sum / examples,
        "seconds": round(position.seconds, 2),
        "examples_per_s": round(examples / max(position.seconds, 1e-9), 2),
    }


def _evaluate(trainer: Trainer, data: Examples) -> EvalScores:
    predicted = trainer.predict(data)
    return {
        "eval_accuracy": float(np.mean(predicted == data.labels)),
        "eval_macro_f1": macro_f1(data.labels, predicted),
    }


def _score(row: EpochMetrics) -> tuple[float, float]:
    """What makes an epoch the best: accuracy, then macro-F1 (the earlier epoch wins a tie)."""
    return row["eval_accuracy"], row["eval_macro_f1"]


def macro_f1(gold: np.ndarray, predicted: np.ndarray) -> float:
    """Unweighted mean of per-class F1 over the classes that occur in ``gold`` or ``predicted``."""
    scores = []
    for label in np.union1d(gold, predicted):
        tp = np.sum((predicted == label) & (gold == label))
        fp = np.sum((predicted == label) & (gold != label))
        fn = np.sum((predicted != label) & (gold == label))
        scores.append(0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn))
    return float(np.mean(scores)) if scores else 0.0


def peak_memory_bytes(device: Device) -> int:
    """Peak of what the budget covers: allocated memory on CUDA, the process's peak RSS on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if sys.platform.startswith("linux"):
        return process_peak_rss_bytes()  # survives the per-step resets of VmHWM
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB elsewhere
