"""Stage 3: cut a block of sequences into batches that fit a token budget.

A pure function of integers (sequence lengths and a :class:`BatchBudget`): no torch, no model, so it is
unit- and property-tested on its own. The memory model (``memory/model.py``) turns bytes into tokens once;
from there on the planner thinks only in tokens.

Rule (as in text-embeddings-inference's queue): a padded backend costs ``batch_size x padded_length``
tokens; sequences are sorted by length so batches pad little, and a batch closes as soon as adding the
next sequence would exceed ``max_batch_tokens`` padded tokens, ``max_batch_seqs`` sequences or, for
attention implementations that materialise the scores, ``max_attention_cells`` (``batch x length^2``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

PAD_MULTIPLE = 8
"""Padded lengths are counted rounded up to a multiple of 8: tensor cores work on such shapes, and it
keeps the number of distinct shapes (and so allocator fragmentation) small. Inference on the CPU runs
its tensors at the exact width (:func:`memfit.engine.batches.inference_pad_multiple`), within this count."""


@dataclass(frozen=True, slots=True)
class BatchBudget:
    """How much one forward pass may hold, in tokens (derived from bytes by the memory model)."""

    max_batch_tokens: int  # batch_size x padded_length
    max_batch_seqs: int = 1024
    max_attention_cells: int | None = None  # batch_size x padded_length^2; None when attention is O(n)

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1 or self.max_batch_seqs < 1:
            raise ValueError(f"a budget must allow at least one token and one sequence: {self}")

    def capacity(self, padded_length: int) -> int:
        """How many sequences padded to ``padded_length`` one batch holds (0: not even one). Every batch cutter
        asks this: :func:`plan_batches` (the jobs' batches, the streamed path's sub-batches), the server's run
        selection (``serve/batcher.py``), the plan's largest batch and training's micro-batches."""
        size = min(self.max_batch_seqs, self.max_batch_tokens // padded_length)
        if self.max_attention_cells is not None:
            size = min(size, self.max_attention_cells // (padded_length * padded_length))
        return size

    def fits(self, batch_size: int, padded_length: int) -> bool:
        """Whether ``batch_size`` sequences padded to ``padded_length`` fit this budget."""
        return batch_size <= self.capacity(padded_length)

    def scaled(self, factor: float) -> "BatchBudget":
        """The same budget shrunk (or grown) by ``factor``, never below one token and one sequence."""
        cells = self.max_attention_cells
        return BatchBudget(
            max_batch_tokens=max(1, int(self.max_batch_tokens * factor)),
            max_batch_seqs=max(1, int(self.max_batch_seqs * factor)) if factor < 1 else self.max_batch_seqs,
            max_attention_cells=None if cells is None else max(1, int(cells * factor)),
        )


def padded_length(length: int, multiple: int = PAD_MULTIPLE) -> int:
    """``length`` rounded up to ``multiple`` (by default :data:`PAD_MULTIPLE`, as the planner counts)."""
    return -(-length // multiple) * multiple


def plan_batches(lengths: Sequence[int], budget: BatchBudget) -> list[list[int]]:
    """Group sequence indices into batches that each fit ``budget``.

    Returns lists of indices into ``lengths``; every index appears in exactly one batch. Sequences are
    taken longest first so the largest (riskiest) batch runs first and a too-small budget shows at once.
    A sequence that alone exceeds the budget still gets a batch of its own: whether it fits the device
    is the engine's OOM guard's call, not the planner's.
    """
    order = np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable")
    batches: list[list[int]] = []
    current: list[int] = []
    current_pad = 0
    for idx in order.tolist():
        pad = padded_length(int(lengths[idx]))
        # sorted descending: the first sequence of a batch sets its padded length
        width = current_pad if current else pad
        if current and not budget.fits(len(current) + 1, width):
            batches.append(current)
            current, width = [], pad
        current.append(idx)
        current_pad = width
    if current:
        batches.append(current)
    return batches
