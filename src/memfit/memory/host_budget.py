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
  block waits until it has run: it may use both blocks' room and whatever the batches leave unused.
- **output on its way out**: token rows leave in pieces of ``piece_bytes``; at most
  ``writes_in_flight`` pieces (or pooled parts) wait for the writer thread, one is being encoded and
  one is being filled.

On CUDA the budget bounds device memory, which none of this touches: the host side keeps the default
block size and no reserve, and hands the tokenizer larger calls (``TOKENIZE_CALL_CHARS_UNBOUNDED``) so
that all the host's cores tokenize while the GPU waits. An in-memory call (``Encoder.embed``) runs there in
small length-sorted blocks, so that the next block is tokenized while the GPU runs one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


from memfit.defaults import DEFAULT_BLOCK_TEXTS
from memfit.memory.model import MemoryPlan, host_room
from memfit.data.tokenization import TOKENIZE_CALL_CHARS_UNBOUNDED, TOKENIZE_PIECE_CHARS
from memfit.memory.device import Device

TOKENIZER_BYTES_PER_CHAR = 800
PREPARED_BYTES_PER_CHAR = 48
PREPARED_SHARE = 0.04  # of the budget, for the two prepared blocks
MAX_PREPARED_BYTES = 256 << 20  # enough for two blocks of the largest size (DEFAULT_BLOCK_CHARS)
MIN_BLOCK_CHARS = 20_000
PIECE_SHARE = 1 / 128  # of the budget, per piece of output on its way to disk
MIN_PIECE_BYTES, MAX_PIECE_BYTES = 1 << 20, 16 << 20
WRITES_IN_FLIGHT = 2

DEFAULT_BLOCK_CHARS = 2_000_000
# On CUDA an in-memory call runs in blocks this small, so that tokenizing the next one overlaps the GPU's work
IN_MEMORY_BLOCK_TEXTS_CUDA = 256


@dataclass(frozen=True, slots=True)
class BlockLimits:
    """How much input one block may hold; bounds host memory and sets the sort window.

    ``max_chars`` bounds a block prepared beside a running one; ``max_chars_alone`` (None: no limit)
    bounds a block of one long text, prepared and run with no other block in memory (:meth:`HostBudget.block_limits`).
    """

    max_texts: int = DEFAULT_BLOCK_TEXTS
    max_chars: int = DEFAULT_BLOCK_CHARS
    max_chars_alone: int | None = None


@dataclass(frozen=True, slots=True)
class HostBudget:
    """Block and output sizes of a job, and the bytes they hold beside the batches."""

    block_chars: int  # characters of input tokenized beside a running block
    block_chars_alone: int | None  # the longest block prepared alone (None: not bounded, CUDA)
    piece_bytes: int  # token rows per piece (one Parquet row group) on their way to disk
    writes_in_flight: int = WRITES_IN_FLIGHT
    tokenize_call_chars: int = TOKENIZE_PIECE_CHARS  # characters per tokenizer call (its transient memory)
    # texts per block of an in-memory call (Encoder.embed), sorted by length first; None: blocks as a stream's
    in_memory_block_texts: int | None = None
    prepared_bytes: int = 0  # reserved for two prepared blocks (and the tokenizer's transient)
    reserved_bytes: int = 0  # held beside the batches: prepared blocks, the tokenizer, output in flight

    def block_limits(self, max_texts: int | None = None, pairs_per_text: int = 1) -> BlockLimits:
        """Limits for the runner; ``pairs_per_text`` (NLI: one model input per label) shrinks blocks so
        that they hold about the same number of model inputs whatever the number of labels (up to four
        times a block of texts, as pairs are short)."""
        texts = max(1, min(max_texts or DEFAULT_BLOCK_TEXTS, 4 * DEFAULT_BLOCK_TEXTS // pairs_per_text))
        return BlockLimits(
            max_texts=texts,
            max_chars=max(1, self.block_chars // pairs_per_text),
            max_chars_alone=None if self.block_chars_alone is None else self.block_chars_alone // pairs_per_text,
        )


def host_budget(budget_bytes: int, device: Device) -> HostBudget:
    """Block and piece sizes for a budget, and the bytes to keep out of the batches' room.

    The longest text prepared alone is bounded once the batches are planned (:func:`fitted_to_plan`)."""
    piece = int(min(MAX_PIECE_BYTES, max(MIN_PIECE_BYTES, budget_bytes * PIECE_SHARE)))
    if device.type != "cpu":
        return HostBudget(
            block_chars=DEFAULT_BLOCK_CHARS,
            block_chars_alone=None,
            piece_bytes=piece,
            tokenize_call_chars=TOKENIZE_CALL_CHARS_UNBOUNDED,
            in_memory_block_texts=IN_MEMORY_BLOCK_TEXTS_CUDA,
        )
    blocks_room = min(
        MAX_PREPARED_BYTES, max(budget_bytes * PREPARED_SHARE, 2 * MIN_BLOCK_CHARS * PREPARED_BYTES_PER_CHAR)
    )
    prepared = int(blocks_room) + TOKENIZE_PIECE_CHARS * TOKENIZER_BYTES_PER_CHAR
    return HostBudget(
        block_chars=int(min(DEFAULT_BLOCK_CHARS, blocks_room / 2 / PREPARED_BYTES_PER_CHAR)),
        block_chars_alone=prepared // PREPARED_BYTES_PER_CHAR,
        piece_bytes=piece,
        prepared_bytes=prepared,
        reserved_bytes=prepared + (WRITES_IN_FLIGHT + 2) * piece,
    )


def fitted_to_plan(host: HostBudget, plan: MemoryPlan) -> HostBudget:
    """Let a text prepared alone also use the room the batches leave unused (on the CPU batches are
    capped far below a large budget), so a larger budget always admits a longer text."""
    if host.block_chars_alone is None:
        return host
    batches = plan.activations.largest_batch_bytes(plan.batch_budget)
    room = host_room(plan.budget_bytes, plan.baseline_bytes + plan.reserved_bytes)
    unused = max(0.0, room - batches)
    return dataclasses.replace(host, block_chars_alone=int(host.prepared_bytes + unused) // PREPARED_BYTES_PER_CHAR)
