"""Stage 5: pool token vectors into sentence vectors, and merge the windows of long texts.

On the device, the embedding head reduces each window to what the pooling needs over the positions
the window *owns* (see ``chunking.py``): the sum and count of its owned rows (``mean``), their
elementwise max (``max``), its ``[CLS]`` row (``cls``), and, when token embeddings are asked for, the
owned rows themselves. Only these small arrays cross to host memory.

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
from typing import Literal, Sequence

import numpy as np
import torch

from memfit.data.chunking import Window
from memfit.defaults import POOLING_CHOICES
from memfit.errors import ConfigError

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
    """Reduces ``last_hidden_state`` of a batch to :class:`WindowEmbedding` per window (see module doc)."""

    def __init__(self, pooling: Pooling | None, keep_tokens: bool):
        self.pooling = pooling
        self.keep_tokens = keep_tokens

    def __call__(self, output, attention_mask: torch.Tensor, windows: Sequence[Window]) -> list[WindowEmbedding]:
        hidden = output.last_hidden_state  # (B, L, d), compute dtype
        batch, length, _ = hidden.shape
        positions = torch.arange(length, device=hidden.device)
        own_start = torch.tensor([w.own_start for w in windows], device=hidden.device)
        own_end = torch.tensor([w.own_end for w in windows], device=hidden.device)
        owned = (positions[None, :] >= own_start[:, None]) & (positions[None, :] < own_end[:, None])  # (B, L)
        pooled_mask, token_mask, first = owned, owned, torch.zeros(batch, dtype=torch.long, device=hidden.device)
        pooled_counts = [w.own_end - w.own_start for w in windows]
        if any(w.prompt_end for w in windows):  # prompted windows: the prompt pools (or not) but is no token row
            pool_start = torch.tensor([w.pool_start for w in windows], device=hidden.device)
            prompt_start = torch.tensor([w.prompt_start for w in windows], device=hidden.device)
            prompt_end = torch.tensor([w.prompt_end for w in windows], device=hidden.device)
            pooled_mask = owned & (positions[None, :] >= pool_start[:, None])
            in_prompt = (positions[None, :] >= prompt_start[:, None]) & (positions[None, :] < prompt_end[:, None])
            token_mask = owned & ~in_prompt
            first = pool_start
            pooled_counts = pooled_mask.sum(dim=1).tolist()

        pooled = None
        if self.pooling == "mean":
            pooled = torch.where(pooled_mask[..., None], hidden, 0).sum(dim=1, dtype=torch.float32)
        elif self.pooling == "max":
            pooled = hidden.masked_fill(~pooled_mask[..., None], float("-inf")).amax(dim=1).float()
        elif self.pooling == "cls":
            pooled = hidden[torch.arange(batch, device=hidden.device), first].float()
        pooled_host = None if pooled is None else pooled.cpu().numpy()

        token_rows: list[np.ndarray | None] = [None] * batch
        if self.keep_tokens:
            # one gather and one device→host copy for the whole batch, split on the host
            rows = hidden[token_mask].float().cpu().numpy()  # row-major by (window, position)
            token_rows = np.split(rows, np.cumsum([w.token_count for w in windows])[:-1])
        return [
            WindowEmbedding(
                pooled=None if pooled_host is None else pooled_host[b],
                pooled_count=pooled_counts[b],
                tokens=token_rows[b],
            )
            for b in range(batch)
        ]


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
