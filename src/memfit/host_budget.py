"""What a job holds in host memory beside its batches, sized from the memory budget.

On the CPU the budget bounds the whole process, so besides the weights (the baseline) and one
batch's activations (the memory model) the plan leaves room for what a streaming job holds at run
time:

- **input on its way in**: the next block is tokenized in a background thread while the current one
  runs. The tokenizer sees at most ``tokenization.TOKENIZE_PIECE_CHARS`` characters per call, whose
  transient memory is at most ``TOKENIZER_BYTES_PER_CHAR`` per character (~800 bytes per token,
  measured, and one token per character in the worst case, Chinese). Prepared blocks (ids, offsets,
  windows) hold ~44 bytes per token; ``PREPARED_BYTES_PER_CHAR`` assumes one token per character.
  Two blocks are prepared at a time (the running one and the next), so blocks are bounded in
  characters from the budget. A block of one text longer than that is prepared alone, and the next
  block waits until it has run: it may use both blocks' room.
- **output on its way out**: token rows leave in pieces of ``piece_bytes``; at most
  ``writes_in_flight`` pieces (or pooled parts) wait for the writer thread, one is being encoded and
  one is being filled.

On CUDA the budget bounds device memory, which none of this touches: the host side keeps the default
block size and no reserve.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memfit.runner import DEFAULT_BLOCK_CHARS, DEFAULT_BLOCK_TEXTS, BlockLimits
from memfit.tokenization import TOKENIZE_PIECE_CHARS

TOKENIZER_BYTES_PER_CHAR = 800
PREPARED_BYTES_PER_CHAR = 48
PREPARED_SHARE = 0.04  # of the budget, for the two prepared blocks
MIN_BLOCK_CHARS = 20_000
PIECE_SHARE = 1 / 128  # of the budget, per piece of output on its way to disk
MIN_PIECE_BYTES, MAX_PIECE_BYTES = 1 << 20, 16 << 20
WRITES_IN_FLIGHT = 2


@dataclass(frozen=True, slots=True)
class HostBudget:
    """Block and output sizes of a job, and the bytes they hold beside the batches."""

    block_chars: int  # characters of input tokenized beside a running block
    block_chars_alone: int | None  # the longest block prepared alone (None: not bounded, CUDA)
    piece_bytes: int  # token rows per piece (one Parquet row group) on their way to disk
    writes_in_flight: int = WRITES_IN_FLIGHT
    reserved_bytes: int = 0  # held beside the batches: a block being tokenized, two prepared, output

    def block_limits(self, max_texts: int | None = None, pairs_per_text: int = 1) -> BlockLimits:
        """Limits for the runner; ``pairs_per_text`` (NLI: one model input per label) shrinks blocks so
        that they hold about the same number of model inputs whatever the number of labels (up to four
        times a block of texts, as pairs are short)."""
        texts = max(1, min(max_texts or DEFAULT_BLOCK_TEXTS, 4 * DEFAULT_BLOCK_TEXTS // pairs_per_text))
        return BlockLimits(max_texts=texts, max_chars=max(1, self.block_chars // pairs_per_text),
                           max_chars_alone=None if self.block_chars_alone is None
                           else self.block_chars_alone // pairs_per_text)


def host_budget(budget_bytes: int, device: torch.device) -> HostBudget:
    """Block and piece sizes for a budget, and the bytes to keep out of the batches' room."""
    piece = int(min(MAX_PIECE_BYTES, max(MIN_PIECE_BYTES, budget_bytes * PIECE_SHARE)))
    if device.type != "cpu":
        return HostBudget(block_chars=DEFAULT_BLOCK_CHARS, block_chars_alone=None, piece_bytes=piece)
    prepared_room = max(budget_bytes * PREPARED_SHARE, 2 * MIN_BLOCK_CHARS * PREPARED_BYTES_PER_CHAR)
    tokenizer_room = TOKENIZE_PIECE_CHARS * TOKENIZER_BYTES_PER_CHAR
    block_chars = int(min(DEFAULT_BLOCK_CHARS, prepared_room / 2 / PREPARED_BYTES_PER_CHAR))
    reserved = int(prepared_room) + tokenizer_room + (WRITES_IN_FLIGHT + 2) * piece
    return HostBudget(block_chars=block_chars,
                      block_chars_alone=int(prepared_room + tokenizer_room) // PREPARED_BYTES_PER_CHAR,
                      piece_bytes=piece, reserved_bytes=reserved)
