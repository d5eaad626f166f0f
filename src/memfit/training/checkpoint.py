"""The output directory: saved models, and checkpoints that let a killed run resume to the same model.

A checkpoint is written every ``checkpoint_every`` optimizer steps (by default every
:data:`CHECKPOINT_MINUTES` minutes of training) and at the end of every epoch, to
``OUT/checkpoints/step-N/``: the model and tokenizer, and ``trainer_state.pt`` with the optimizer,
schedule and RNG state and the :class:`Position` in the data. ``trainer_state.pt`` is written last
(to a temporary name, then renamed), so a directory that has it is complete; older checkpoints are
deleted after a new one is complete. The data order of an epoch is a function of the seed and the
epoch, so a resumed run skips the batches already done and then sees exactly what an uninterrupted
run would (tested with ``kill -9`` in a subprocess).

With evaluation data, the best epoch's model (by accuracy, then macro-F1) is kept in
``OUT/checkpoints/best/`` and becomes the final model.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from memfit.errors import OutputError
from memfit.engine.pooled_classifier import PooledClassifier
from memfit.atomic import written_atomically
from memfit.io.sinks import check_same_settings
from memfit.training.result import EpochMetrics

CHECKPOINT_MINUTES = 10.0
"""Default checkpoint cadence in training time: an hour-long run loses at most this much to a kill."""
STATE_FILE = "trainer_state.pt"


@dataclass
class Position:
    """Where training stands: the epoch under way, the batches of it done, and what was measured so far."""

    epoch: int = 1
    batches_done: int = 0
    step: int = 0  # optimizer steps since the start
    loss_sum: float = 0.0  # summed per-example training loss of this epoch so far
    seconds: float = 0.0  # training time of this epoch so far
    history: list[EpochMetrics] = field(default_factory=list)  # finished epochs' metrics
    best_epoch: int | None = None


def checkpoints_dir(out: Path) -> Path:
    return out / "checkpoints"


def best_dir(out: Path) -> Path:
    return checkpoints_dir(out) / "best"


def prepare_output(out: Path, settings: dict[str, Any], resume: bool) -> Path | None:
    """Check ``out`` for a fresh run or a resume; return the checkpoint to resume from, if any."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out} exists and is not a directory")
    if not resume:
        if out.is_dir() and any(out.iterdir()):
            raise OutputError(f"{out} is not empty; choose a new directory or pass --resume")
        _make_directory(out)
        return None
    _make_directory(out)
    latest = latest_checkpoint(out)
    if latest is None:
        if (out / "metrics.json").is_file():
            try:
                previous = json.loads((out / "metrics.json").read_text()).get("settings")
            except (OSError, ValueError, AttributeError) as exc:
                raise OutputError(f"{out / 'metrics.json'} cannot be read to resume from ({exc})") from None
            check_same_settings(out, previous or {}, settings, keys=settings)
        return None
    check_same_settings(out, load_state(latest)["settings"], settings, keys=settings)
    return latest


def _make_directory(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a parent that is a file, no permission, a read-only disk
        raise OutputError(f"{out} cannot be created: {exc.strerror or exc}") from None


def latest_checkpoint(out: Path) -> Path | None:
    """The complete checkpoint with the most optimizer steps, if any."""
    complete = [p for p in checkpoints_dir(out).glob("step-*") if (p / STATE_FILE).is_file()]
    return max(complete, key=lambda p: int(p.name.split("-")[1]), default=None)


def load_state(checkpoint: Path) -> dict[str, Any]:
    return torch.load(checkpoint / STATE_FILE, weights_only=False)


def position_of(state: dict[str, Any]) -> Position:
    return Position(**state["position"])


def save_model(directory: Path, model, tokenizer, window: int) -> None:
    """The model and tokenizer as a loadable model directory; the tokenizer truncates at the training window."""
    tokenizer.model_max_length = window
    with quiet_transformers():
        if isinstance(model, PooledClassifier):
            model.save_pretrained(directory, max_seq_length=window)
        else:
            model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)


def save_checkpoint(
    out: Path,
    model,
    tokenizer,
    window: int,
    position: Position,
    trainer_state: dict[str, Any],
    settings: dict[str, Any],
) -> None:
    """Write ``checkpoints/step-N`` (its state file last, atomically), then drop older checkpoints."""
    target = checkpoints_dir(out) / f"step-{position.step}"
    shutil.rmtree(target, ignore_errors=True)
    save_model(target, model, tokenizer, window)
    state = {**trainer_state, "position": asdict(position), "settings": settings}
    with written_atomically(target / STATE_FILE) as tmp:
        torch.save(state, tmp)
    for older in checkpoints_dir(out).glob("step-*"):
        if older != target:
            shutil.rmtree(older, ignore_errors=True)


def save_best(out: Path, model, tokenizer, window: int) -> None:
    """Replace ``checkpoints/best`` with the current model (written aside first, then renamed)."""
    aside = checkpoints_dir(out) / "best.tmp"
    shutil.rmtree(aside, ignore_errors=True)
    save_model(aside, model, tokenizer, window)
    shutil.rmtree(best_dir(out), ignore_errors=True)
    os.replace(aside, best_dir(out))


def publish_best(out: Path) -> None:
    """Move the best epoch's model files from ``checkpoints/best`` into ``out`` (no copy in memory)."""
    for item in best_dir(out).iterdir():
        target = out / item.name
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(item, target)


@contextlib.contextmanager
def quiet_transformers():
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
