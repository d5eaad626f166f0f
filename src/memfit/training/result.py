"""What :func:`memfit.train` returns: :class:`TrainResult`, the metrics it also writes to ``metrics.json``.

Typed dicts rather than classes: the result is the JSON file's content, read back as it is when a
finished run is resumed, so ``result["plan"]["micro_batch_at_longest"]`` is the same lookup on either.
"""

from __future__ import annotations

from typing import TypedDict

from memfit.training.config import TrainSettings
from memfit.training.plan import TrainPlanDict


class EvalScores(TypedDict):
    """One epoch's model on the evaluation data."""

    eval_accuracy: float
    eval_macro_f1: float


class _TrainedEpoch(TypedDict):
    epoch: int
    train_loss: float  # mean per-example loss over the epoch
    seconds: float
    examples_per_s: float


class EpochMetrics(_TrainedEpoch, total=False):
    """One finished epoch; the evaluation scores only when the run has evaluation data."""

    eval_accuracy: float
    eval_macro_f1: float


class HeadMetrics(TypedDict):
    pooling: str | None  # None: transformers' own sequence-classification head
    new: bool  # False when the starting model's classifier head was kept
    lr: float  # the head's peak learning rate (the encoder's when the head was kept)


class ScheduleMetrics(TypedDict):
    warmup_steps: int
    total_steps: int


class TrainResult(TypedDict):
    """The metrics of a finished run (``metrics.json``)."""

    labels: list[str]  # class names, in the model's label order
    settings: TrainSettings
    device: str
    head: HeadMetrics
    schedule: ScheduleMetrics
    plan: TrainPlanDict  # gradient_checkpointing as the run ended: "auto" may turn it on mid-run
    epochs: list[EpochMetrics]
    best_epoch: int | None  # with evaluation data: the epoch whose model was kept
    oom_events: int
    peak_memory_bytes: int
    train_examples: int
    eval_examples: int | None
