"""The options of one training run (:class:`TrainConfig`) and the settings a resume must match.

:func:`memfit.train` takes these options as keyword arguments and builds one :class:`TrainConfig`, which
refuses values no run can use before anything is read; the run's steps take the config, not long
argument lists. :meth:`TrainConfig.settings` is what checkpoints and ``metrics.json`` store and what
``--resume`` compares, so its keys and values must stay those of the runs already on disk.
"""

from __future__ import annotations

import math

import os
from dataclasses import dataclass
from typing import TypedDict

from memfit.defaults import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_EPOCHS,
    DEFAULT_LR,
    HEAD_INITS,
    RANDOM_HEAD_LR,
    WARMUP_FRACTION,
)
from memfit.errors import ConfigError


class TrainSettings(TypedDict):
    """What a resumed run must share with the run it continues (stored in checkpoints and ``metrics.json``)."""

    data: str  # absolute path
    eval_data: str | None  # absolute path
    model: str  # the resolved model name or directory
    text_field: str
    text_pair_field: str | None
    label_field: str
    relation: bool
    head_field: str
    tail_field: str
    epochs: int
    lr: float
    head_lr: float  # the new head's learning rate as resolved (TrainConfig.new_head_lr)
    head_init: str
    warmup: float
    batch_size: int
    max_length: int | None
    seed: int


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """The options of a run, checked on construction (:class:`ConfigError`); see :func:`memfit.train`."""

    text_field: str = "text"
    text_pair_field: str | None = None
    label_field: str = "label"
    relation: bool = False
    head_field: str = "head"
    tail_field: str = "tail"
    epochs: int = DEFAULT_EPOCHS
    lr: float = DEFAULT_LR
    head_lr: float | None = None  # None: the default for head_init, see new_head_lr
    head_init: str = "probe"
    warmup: float = WARMUP_FRACTION
    batch_size: int = DEFAULT_BATCH_SIZE
    max_length: int | None = None
    memory_budget: str | int | None = None
    device: str = "auto"
    dtype: str = "auto"
    gradient_checkpointing: str = "auto"
    seed: int = 0
    input_format: str | None = None
    checkpoint_every: int | None = None

    def __post_init__(self) -> None:
        """Refuse option values no run can use, before anything is read."""
        if self.head_init not in HEAD_INITS:
            raise ConfigError(f"unknown head_init {self.head_init!r}; choose one of {', '.join(HEAD_INITS)}")
        for name, value in (("epochs", self.epochs), ("batch_size", self.batch_size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be a whole number, got {value!r}")
        head_lr = self.new_head_lr
        # written as "not > 0" so that NaN, which compares false with everything, is refused too
        if self.epochs < 1 or self.batch_size < 1 or not self.lr > 0 or not head_lr > 0 or not 0 <= self.warmup < 1:
            raise ConfigError(
                f"epochs and batch_size must be >= 1, lr and head_lr > 0 and 0 <= warmup < 1 (got "
                f"{self.epochs}, {self.batch_size}, {self.lr}, {head_lr}, {self.warmup})"
            )
        if not math.isfinite(self.lr) or not math.isfinite(head_lr):
            raise ConfigError(f"lr and head_lr must be finite, got {self.lr} and {head_lr}")
        if self.seed < 0:  # numpy's seeds are non-negative
            raise ConfigError(f"seed must be >= 0, got {self.seed}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ConfigError(f"checkpoint_every must be >= 1 optimizer steps, got {self.checkpoint_every}")
        if self.relation and self.text_pair_field is not None:
            raise ConfigError("relation classification takes one text with entity spans; drop text_pair_field")

    @property
    def new_head_lr(self) -> float:
        """A new head's peak learning rate: ``head_lr``, else ``lr`` after a probe start and
        :data:`RANDOM_HEAD_LR` after a random one. Resolved on reading rather than stored, so that
        ``dataclasses.replace(config, head_init=...)`` resolves it again."""
        if self.head_lr is not None:
            return self.head_lr
        return self.lr if self.head_init == "probe" else RANDOM_HEAD_LR

    def settings(self, data: str | os.PathLike, eval_data: str | os.PathLike | None, model_name: str) -> TrainSettings:
        """The settings of this run on ``data`` (and ``eval_data``) from ``model_name`` (already resolved).

        Spelled out key by key, not derived from the fields: device, dtype, budget, checkpointing, input
        format and checkpoint cadence may change between a run and its resume, and the keys and values must
        stay those that checkpoints written by earlier versions hold."""
        return {
            "data": os.path.abspath(data),
            "eval_data": None if eval_data is None else os.path.abspath(eval_data),
            "model": model_name,
            "text_field": self.text_field,
            "text_pair_field": self.text_pair_field,
            "label_field": self.label_field,
            "relation": self.relation,
            "head_field": self.head_field,
            "tail_field": self.tail_field,
            "epochs": self.epochs,
            "lr": self.lr,
            "head_lr": self.new_head_lr,
            "head_init": self.head_init,
            "warmup": self.warmup,
            "batch_size": self.batch_size,
            "max_length": self.max_length,
            "seed": self.seed,
        }
