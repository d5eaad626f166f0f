"""The streaming loop every job shares: blocks of records → windows → planned batches → results.

Input is cut into *blocks* (bounded in texts and characters); each block is tokenized and windowed in
a background thread while the previous block runs on the device (the fast tokenizer releases the GIL),
its windows are batched by the token-budget planner and run through the engine's OOM guard, and the
job merges the window results back into one result per record in input order. Memory is bounded by
the block size, never by the corpus size: a block larger than ``max_chars`` (one very long text) is
prepared alone, after the previous block has finished, and the next block waits until it has run.
Jobs (embed, classify) differ only in the :class:`Job` they plug in.
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence, TypeVar

import numpy as np
import torch
from tqdm.auto import tqdm

from memfit.chunking import Window
from memfit.engine import AdaptiveBudget, Engine, SequenceDoesNotFit, run_windows
from memfit.errors import ConfigError, DoesNotFitError
from memfit.sources import Record, read_records

Result = TypeVar("Result")

DEFAULT_BLOCK_TEXTS = 2048
DEFAULT_BLOCK_CHARS = 2_000_000


@dataclass(frozen=True, slots=True)
class PreparedBlock:
    """A block's model inputs, plus whatever the job needs later to merge the results (e.g. offsets).

    ``keep(windows, outputs)``, when set, receives each batch's outputs as soon as they are computed
    and returns what :meth:`Job.finish` gets of them: a job that streams token rows to disk writes them
    there and keeps only the small pooled parts, so a block's output never piles up in memory.
    """

    windows: list[Window]
    context: Any = None
    keep: Callable[[Sequence[Window], list], list] | None = None


class Job(Protocol[Result]):
    """What a job plugs into the shared loop."""

    def prepare(self, records: Sequence[Record]) -> PreparedBlock:
        """Tokenize and window a block of records (runs in a background thread)."""

    def finish(self, records: Sequence[Record], prepared: PreparedBlock, outputs: list) -> Result:
        """Merge the engine's per-window outputs (one per window) into the block's result, in record order."""


@dataclass(frozen=True, slots=True)
class BlockLimits:
    """How much input one block may hold; bounds host memory and sets the sort window.

    ``max_chars`` bounds a block prepared beside a running one; ``max_chars_alone`` (None: no limit)
    bounds a block of one long text, prepared and run with no other block in memory (``host_budget.py``).
    """

    max_texts: int = DEFAULT_BLOCK_TEXTS
    max_chars: int = DEFAULT_BLOCK_CHARS
    max_chars_alone: int | None = None


def blocks(records: Iterable[Record], limits: BlockLimits) -> Iterator[list[Record]]:
    """Group records into blocks of at most ``max_texts`` texts and about ``max_chars`` characters
    (a block closes at the first text that reaches ``max_chars``; a text's windows always stay in one
    block, since they must be merged together)."""
    block: list[Record] = []
    chars = 0
    for record in records:
        block.append(record)
        chars += len(record.text) + len(record.text_pair or "")
        # close the block before reading further, so a bad record later cannot hold this one back
        if len(block) >= limits.max_texts or chars >= limits.max_chars:
            yield block
            block, chars = [], 0
    if block:
        yield block


# texts advance by window shares; show whole numbers rather than tqdm's "12.5/300"
_BAR_FORMAT = "{l_bar}{bar}| {n:.0f}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


class Progress:
    """A progress bar on a terminal (texts, tokens/s, ETA when the total is known); silent in pipes."""

    def __init__(self, total: int | None, enabled: bool | None, unit: str = "text"):
        self.bar = tqdm(total=total, unit=unit, disable=not self.shown(enabled), dynamic_ncols=True,
                        smoothing=0.1, file=sys.stderr,
                        bar_format=None if total is None else _BAR_FORMAT)
        self.tokens = 0
        self.started = time.perf_counter()

    @staticmethod
    def shown(enabled: bool | None) -> bool:
        """``enabled=None`` means: only when stderr is a terminal."""
        return sys.stderr.isatty() if enabled is None else enabled

    def add_batch(self, windows: Sequence[Window], windows_per_item: Sequence[int]) -> None:
        """Advance by the finished windows: each counts as its share of its text, so the bar moves
        with every batch rather than once per block of thousands of texts."""
        if self.bar.disable:
            return
        self.tokens += sum(len(w) for w in windows)
        elapsed = time.perf_counter() - self.started
        if elapsed > 0:
            self.bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tok/s", refresh=False)
        self.bar.update(sum(1.0 / windows_per_item[w.item] for w in windows))

    def add_texts(self, count: int) -> None:
        """For jobs that count whole texts (training)."""
        self.bar.update(count)

    def close(self) -> None:
        self.bar.close()


def run_job(
    job: Job[Result],
    records: Iterable[Record],
    engine: Engine,
    budget: AdaptiveBudget,
    device: torch.device,
    limits: BlockLimits = BlockLimits(),
    progress: bool | None = False,
    total: int | None = None,
) -> Iterator[tuple[list[Record], Result]]:
    """Yield ``(block_records, block_result)`` for each block, in input order.

    The next block is read and prepared in a background thread while the current block computes.
    ``progress``: show a bar (``None``: only on a terminal); ``total``: number of records, for its ETA.
    """
    bar = Progress(total, progress)
    try:
        yield from _run_blocks(job, records, engine, budget, device, limits, bar)
    finally:
        bar.close()


def _run_blocks(job: Job[Result], records: Iterable[Record], engine: Engine, budget: AdaptiveBudget,
                device: torch.device, limits: BlockLimits, progress: Progress) -> Iterator[tuple[list[Record], Result]]:
    block_iter = blocks(records, limits)

    def load_next() -> tuple[list[Record], PreparedBlock | None] | None:
        # Reading and preparing both happen here, so an input error surfaces only once the loop
        # reaches the block that holds it: every block before it is computed and written first.
        block = next(block_iter, None)
        if block is None:
            return None
        if _block_chars(block) > limits.max_chars:
            return block, None  # too large to tokenize beside a running block: prepared alone below
        return block, job.prepare(block)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="memfit-prepare") as pool:
        upcoming: Future = pool.submit(load_next)
        while (loaded := upcoming.result()) is not None:
            block, ready = loaded
            alone = ready is None
            if alone:
                ready = _prepare_alone(job, block, limits)
            else:
                upcoming = pool.submit(load_next)
            windows_per_item = np.bincount([w.item for w in ready.windows], minlength=len(block))
            on_batch = functools.partial(progress.add_batch, windows_per_item=windows_per_item)
            try:
                outputs = run_windows(engine, ready.windows, budget, device, on_batch=on_batch, keep=ready.keep)
            except SequenceDoesNotFit as exc:
                record = block[exc.window.item]
                raise DoesNotFitError(
                    f"text id={record.id} (input line {record.line}): a window of {len(exc.window)} tokens "
                    "does not fit the memory budget even alone; try a smaller --max-length, "
                    "--long chunk, --dtype bf16/fp16 or a larger --memory-budget"
                ) from None
            if alone:  # the next block is read and prepared only now, in the room this one used
                upcoming = pool.submit(load_next)
            yield block, job.finish(block, ready, outputs)


def _block_chars(block: Sequence[Record]) -> int:
    return sum(len(r.text) + len(r.text_pair or "") for r in block)


def _prepare_alone(job: Job, block: Sequence[Record], limits: BlockLimits) -> PreparedBlock:
    """Prepare a block of one very long text while no other block is in memory."""
    if limits.max_chars_alone is not None and _block_chars(block) > limits.max_chars_alone:
        longest = max(block, key=lambda r: len(r.text) + len(r.text_pair or ""))
        raise DoesNotFitError(
            f"text id={longest.id} (input line {longest.line}) has {len(longest.text):,} characters, more than the "
            f"{limits.max_chars_alone:,} that the memory budget leaves room for in one text (the room grows in "
            "proportion to the budget); raise --memory-budget"
        )
    return job.prepare(block)


def records_from_texts(texts: Iterable[str]) -> Iterator[Record]:
    """In-memory texts as records (row number as id); anything but a string is refused, by index."""
    for i, text in zip(itertools.count(), texts):
        if not isinstance(text, str):
            raise ConfigError(f"texts[{i}] is {type(text).__name__}, expected str")
        yield Record(row=i, id=i, text=text, line=i + 1)


def source_label(source: str | os.PathLike | Iterable[str]) -> str:
    """How an output manifest names its input: an absolute path, ``-`` (stdin) or ``<iterable>``."""
    if not isinstance(source, (str, os.PathLike)):
        return "<iterable>"
    return "-" if os.fspath(source) == "-" else os.path.abspath(source)


def source_records(source: str | os.PathLike | Iterable[str], text_field: str, id_field: str | None,
                   input_format: str | None, skip: int = 0) -> Iterator[Record]:
    """Records of a file, stdin (``-``) or in-memory texts, leaving out the first ``skip`` (resume)."""
    if isinstance(source, (str, os.PathLike)):
        return read_records(os.fspath(source), text_field=text_field, id_field=id_field,
                            input_format=input_format, skip=skip)
    return (r for r in records_from_texts(source) if r.row >= skip)
