"""Stage 5: pool token vectors into sentence vectors, and merge the windows of long texts.

Where the hidden states are (the device, or host memory for a compiled graph), the embedding head reduces each
window to what the pooling needs over the positions the window *owns* (see ``chunking.py``): the sum and count of its
owned rows (``mean``), their elementwise max (``max``), its ``[CLS]`` row (``cls``), and, when token embeddings are
asked for, the owned rows themselves. Only these small arrays cross to host memory.

On the host, a text's windows are merged:

- ``mean``: sum of all owned rows / number of owned rows, i.e. the mean over every token of the text
  counted exactly once (not a mean of window means, which would over-weight short last windows);
- ``max``: elementwise max over the owned rows of all windows;
- ``cls``: mean of the windows' ``[CLS]`` vectors (each window's summary of its own span).

For a text that fits one window these are exactly sentence-transformers' mask-aware mean, max and CLS
pooling. Reductions accumulate in fp32 whatever the compute dtype.

A prompt's positions (``chunking.py``) are pooled where the window owns them and its ``pool_start`` allows
(sentence-transformers' ``include_prompt``), and are never token rows; ``cls`` reads the row at
``pool_start``, the first position sentence-transformers' mask leaves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Sequence

import numpy as np

from memfit.data.chunking import Window
from memfit.defaults import POOLING_CHOICES
from memfit.errors import ConfigError

if TYPE_CHECKING:
    import torch

Pooling = Literal["mean", "cls", "max"]
POOLINGS = POOLING_CHOICES


def check_pooling(pooling: str) -> Pooling:
    if pooling not in POOLINGS:
        raise ConfigError(f"unknown pooling {pooling!r}; choose one of {', '.join(POOLINGS)}")
    return pooling  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class WindowEmbedding:
    """One window's contribution to its text, already on the host, float32."""

    pooled: np.ndarray | None  # (d,) sum of pooled owned rows (mean), their max (max) or the CLS row (cls)
    pooled_count: int  # owned rows pooled: what a mean over the text's windows divides by
    tokens: np.ndarray | None  # (Window.token_count, d) owned token rows, when token output is asked for


class EmbeddingHead:
    """Reduces ``last_hidden_state`` of a batch to :class:`WindowEmbedding` per window (see module doc).

    The owned and pooled positions are worked out on the host from the windows; the reduction runs where the
    hidden states are: on the device for a PyTorch model's tensor, in numpy for a compiled graph's array (a run on
    a cached graph never imports torch, ``memory/device.py``)."""

    def __init__(self, pooling: Pooling | None, keep_tokens: bool):
        self.pooling = pooling
        self.keep_tokens = keep_tokens

    def __call__(self, output, attention_mask, windows: Sequence[Window]) -> list[WindowEmbedding]:
        hidden = output.last_hidden_state  # (B, L, d): a tensor in the compute dtype, or a graph's float32 array
        batch, length, _ = hidden.shape
        owned = _within(windows, "own_start", "own_end", length)  # (B, L)
        pooled_mask, token_mask, first = owned, owned, np.zeros(batch, dtype=np.int64)
        if any(w.prompt_end for w in windows):  # prompted windows: the prompt pools (or not) but is no token row
            pool_start = np.array([w.pool_start for w in windows])
            pooled_mask = owned & (np.arange(length)[None, :] >= pool_start[:, None])
            token_mask = owned & ~_within(windows, "prompt_start", "prompt_end", length)
            first = pool_start
        pooled_counts = pooled_mask.sum(axis=1).tolist()
        positions = _BatchPositions(pooled_mask, token_mask, first)
        reduce = _reduce_array if isinstance(hidden, np.ndarray) else _reduce_tensor
        pooled_host, rows = reduce(hidden, positions, self.pooling, self.keep_tokens)
        token_rows: list[np.ndarray | None] = [None] * batch
        if rows is not None:  # row-major by (window, position): one gather for the batch, split on the host
            token_rows = np.split(rows, np.cumsum([w.token_count for w in windows])[:-1])
        return [
            WindowEmbedding(
                pooled=None if pooled_host is None else pooled_host[b],
                pooled_count=pooled_counts[b],
                tokens=token_rows[b],
            )
            for b in range(batch)
        ]


def _within(windows: Sequence[Window], start: str, end: str, length: int) -> np.ndarray:
    """(B, ``length``) bool: the positions of each window from its field ``start`` up to its field ``end``."""
    positions = np.arange(length)[None, :]
    starts = np.array([getattr(w, start) for w in windows])[:, None]
    ends = np.array([getattr(w, end) for w in windows])[:, None]
    return (positions >= starts) & (positions < ends)


@dataclass(frozen=True, slots=True)
class _BatchPositions:
    """Which positions of a batch (B, L) each reduction reads: worked out on the host, from the windows."""

    pooled: np.ndarray  # bool (B, L): the rows mean and max pool
    tokens: np.ndarray  # bool (B, L): the owned token rows (a prompt's left out)
    first: np.ndarray  # int (B,): the row cls reads


def _reduce_array(
    hidden: np.ndarray, positions: _BatchPositions, pooling: Pooling | None, keep_tokens: bool
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The pooled rows and owned token rows of a host array, float32."""
    hidden = hidden.astype(np.float32, copy=False)
    pooled = None
    if pooling == "mean":
        pooled = np.where(positions.pooled[..., None], hidden, 0).sum(axis=1, dtype=np.float32)
    elif pooling == "max":
        pooled = np.where(positions.pooled[..., None], hidden, -np.inf).max(axis=1).astype(np.float32)
    elif pooling == "cls":
        pooled = hidden[np.arange(len(hidden)), positions.first]
    return pooled, hidden[positions.tokens] if keep_tokens else None


def _reduce_tensor(
    hidden: torch.Tensor, positions: _BatchPositions, pooling: Pooling | None, keep_tokens: bool
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The same on the tensor's device, accumulating in float32; only the results cross to the host."""
    import torch

    device = hidden.device
    pooled = None
    if pooling == "mean":
        mask = torch.from_numpy(positions.pooled).to(device)
        pooled = torch.where(mask[..., None], hidden, 0).sum(dim=1, dtype=torch.float32)
    elif pooling == "max":
        mask = torch.from_numpy(positions.pooled).to(device)
        pooled = hidden.masked_fill(~mask[..., None], float("-inf")).amax(dim=1).float()
    elif pooling == "cls":
        pooled = hidden[torch.arange(len(hidden), device=device), torch.from_numpy(positions.first).to(device)].float()
    rows = hidden[torch.from_numpy(positions.tokens).to(device)].float().cpu().numpy() if keep_tokens else None
    return (None if pooled is None else pooled.cpu().numpy()), rows


def merge_pooled(parts: Sequence[WindowEmbedding], pooling: Pooling) -> np.ndarray:
    """One text's pooled vector from its windows (rules in the module docstring)."""
    stacked = np.stack([p.pooled for p in parts]).astype(np.float64)
    if pooling == "mean":
        total = sum(p.pooled_count for p in parts)
        return (stacked.sum(axis=0) / max(total, 1)).astype(np.float32)
    if pooling == "max":
        return stacked.max(axis=0).astype(np.float32)
    return stacked.mean(axis=0).astype(np.float32)


def merge_tokens(parts: Sequence[WindowEmbedding]) -> np.ndarray:
    """One text's token rows, each token exactly once, in text order."""
    return np.concatenate([p.tokens for p in parts], axis=0)


def l2_normalize(vectors: np.ndarray) -> np.ndarray:
    """Unit-length rows (zero rows stay zero), as sentence-transformers' Normalize module."""
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32)
