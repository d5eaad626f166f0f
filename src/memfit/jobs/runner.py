"""The streaming loop every job shares: blocks of records → windows → planned batches → results.

Input is cut into *blocks* (bounded in texts and characters); each block is tokenized and windowed in
a background thread while the previous block runs on the device (the fast tokenizer releases the GIL),
its windows are batched by the token-budget planner and run through the engine's OOM guard, and the
job merges the window results back into one result per record in input order (a job's ``keep`` hook
may take each batch's outputs as they are computed: the embed job streams token rows to disk there).
Memory is bounded by the block size, never by the corpus size: a block larger than ``max_chars`` (one
very long text) is prepared alone, after the previous block has finished, and the next block waits
until it has run. Jobs (embed, classify, rerank) differ only in the :class:`Job` they plug in.

:func:`stream_to` is the one driver that writes a job's results to an output directory: it owns the
source's records, skip-on-resume, the pre-checks before anything is created, the writer thread, the
progress bar and the typed :class:`Counts`; a :class:`StreamJob` adds how a block's result becomes a
table, and the file it writes beside the part (the token table), committed with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, ContextManager, Iterable, Iterator, Protocol, Sequence, TypedDict, TypeVar

import numpy as np
import pyarrow as pa

from memfit.data.chunking import Window
from memfit.engine.batches import AdaptiveBudget, Engine, SequenceDoesNotFit, run_windows
from memfit.errors import ConfigError, DoesNotFitError
from memfit.io.fingerprint import input_fingerprint
from memfit.io.preflight import check_input, check_options, check_output_dir
from memfit.jobs.progress import Progress
from memfit.memory.guard import ResidentSetGuard
from memfit.memory.host_budget import BlockLimits
from memfit.io.sinks import BackgroundWriter, PartWriter
from memfit.data.shards import is_url
from memfit.data.sources import Record, estimate_rows, read_records
from memfit.memory.device import Device

Result = TypeVar("Result")


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


def run_job(
    job: Job[Result],
    records: Iterable[Record],
    engine: Engine,
    budget: AdaptiveBudget,
    device: Device,
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


def _run_blocks(
    job: Job[Result],
    records: Iterable[Record],
    engine: Engine,
    budget: AdaptiveBudget,
    device: Device,
    limits: BlockLimits,
    progress: Progress,
) -> Iterator[tuple[list[Record], Result]]:
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
        # the preparing thread may allocate until the next block is ready: the guard keeps the reserve till then
        with tracking(budget.guard, lambda: not upcoming.done(), lambda: futures.wait([upcoming])):
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


def text_list(texts: Iterable[str], name: str = "texts") -> list[str]:
    """``texts`` as a list of strings, checked before any work: one string (which ``list()`` would cut into
    characters), None, or an item that is not a string is a :class:`ConfigError` naming ``name``."""
    if isinstance(texts, (str, bytes)):
        raise ConfigError(f"{name} must be a list of strings, not one {type(texts).__name__} (wrap it: [text])")
    try:
        items = list(texts)
    except TypeError:
        raise ConfigError(f"{name} must be a list of strings, got {type(texts).__name__}") from None
    for i, text in enumerate(items):
        if not isinstance(text, str):
            raise ConfigError(f"{name}[{i}] is {type(text).__name__}, expected str")
    return items


def records_from_texts(texts: Iterable[str]) -> Iterator[Record]:
    """In-memory texts as records (row number as id); anything but a string is refused, by index."""
    for i, text in zip(itertools.count(), texts):
        if not isinstance(text, str):
            raise ConfigError(f"texts[{i}] is {type(text).__name__}, expected str")
        yield Record(row=i, id=i, text=text, line=i + 1)


def source_label(source: str | os.PathLike | Iterable[str]) -> str:
    """How an output manifest names its input: an absolute path, a URL, ``-`` (stdin) or ``<iterable>``."""
    if not isinstance(source, (str, os.PathLike)):
        return "<iterable>"
    path = os.fspath(source)
    return path if path == "-" or is_url(path) else os.path.abspath(path)


def source_records(
    source: str | os.PathLike | Iterable[str],
    text_field: str,
    id_field: str | None,
    input_format: str | None,
    skip: int = 0,
    pair_field: str | None = None,
) -> Iterator[Record]:
    """Records of a file, stdin (``-``) or in-memory texts, leaving out the first ``skip`` (resume).
    ``pair_field``: a second text per record (``Record.text_pair``), read from files only."""
    if isinstance(source, (str, os.PathLike)):
        return read_records(
            os.fspath(source),
            text_field=text_field,
            id_field=id_field,
            input_format=input_format,
            skip=skip,
            pair_field=pair_field,
        )
    return (r for r in records_from_texts(source) if r.row >= skip)


# -- writing a job's results: the one driver -------------------------------------------------------


@dataclass(slots=True)
class Counts:
    """What a block (and, summed in the manifest, a run) held: the figures the CLI reports."""

    texts: int = 0
    empty_texts: int = 0
    inputs: int = 0  # model inputs: windows, or (window, label) pairs in NLI
    tokens: int = 0
    truncated_texts: int = 0

    @classmethod
    def of_block(cls, records: Sequence[Record], windows: Sequence[Window], truncated_texts: int) -> "Counts":
        return cls(
            texts=len(records),
            empty_texts=sum(1 for r in records if not r.text.strip()),
            inputs=len(windows),
            tokens=sum(len(w) for w in windows),
            truncated_texts=truncated_texts,
        )

    def as_manifest(self, inputs_key: str | None) -> dict[str, int]:
        """The manifest's ``counts`` entry; ``inputs_key`` names the model inputs (None: not listed)."""
        counts = asdict(self)
        inputs = counts.pop("inputs")
        if inputs_key is not None:
            counts[inputs_key] = inputs
        return counts


class StreamJob(Job[Result], Protocol):
    """A job that :func:`stream_to` writes to disk: :class:`Job` plus its output table.

    ``finish`` returns a result with a ``counts: Counts`` attribute; ``inputs_key`` names the model
    inputs in the manifest's counts (``windows``, ``pairs``) or None."""

    inputs_key: str | None

    def table(self, records: Sequence[Record], result: Result) -> pa.Table:
        """One output part: a block's result in record order."""

    def end_part(self) -> Any:
        """Close a file written beside the part (the token table), or None; called once per block,
        after ``finish``. What it returns is committed with the part (its ``commit()`` gives the entry)."""


INPUT_SETTINGS = ("input", "text_field", "id_field", "input_format", "pair_field")
"""The manifest's settings that name the input (:meth:`StreamInput.settings`): a Ray driver, which knows the input
but not the model's settings, checks these on resume."""


@dataclass(frozen=True, slots=True)
class StreamInput:
    """Where a job's records come from: a file, ``"-"`` (stdin) or in-memory texts, and which fields
    (``pair_field``: a second text per record, e.g. the query of a rerank pair)."""

    source: str | os.PathLike | Iterable[str]
    text_field: str = "text"
    id_field: str | None = None
    input_format: str | None = None
    pair_field: str | None = None

    @property
    def path(self) -> str | None:
        """The file path (``-`` for stdin), or None for in-memory texts."""
        return os.fspath(self.source) if isinstance(self.source, (str, os.PathLike)) else None

    def records(self, skip: int = 0) -> Iterator[Record]:
        return source_records(
            self.source, self.text_field, self.id_field, self.input_format, skip=skip, pair_field=self.pair_field
        )

    def settings(self) -> dict[str, Any]:
        """How the manifest names the input (resume checks that it stays the same); ``input_format`` and
        ``pair_field`` only when set, so the manifests of runs without them are as they were. The format counts:
        a .jsonl read as txt embeds whole lines, and its blank lines number the rows another way."""
        named = {"input": source_label(self.source), "text_field": self.text_field, "id_field": self.id_field}
        if self.input_format is not None:
            named["input_format"] = self.input_format
        return named if self.pair_field is None else {**named, "pair_field": self.pair_field}


class Manifest(TypedDict, total=False):
    """``manifest.json`` of an output directory, as :func:`stream_to` returns it (``sinks.PartWriter`` writes it)."""

    format_version: int
    settings: dict[str, Any]  # the job's options and the input's name: a resume must repeat them
    input_fingerprint: dict[str, Any] | None  # size, mtime, SHA-256 of the input file (None: stdin / in memory)
    parts: list[dict[str, Any]]  # file, rows, first_row, bytes, counts (+ tokens: the part's token file)
    rows: int
    counts: dict[str, int]  # Counts.as_manifest, summed over the parts
    complete: bool
    memfit_version: str
    device: str
    dim: int  # embed: vector length
    quality: dict[str, Any] | None  # the precision guard's QualityReport, when it ran
    quantization: dict[str, Any]  # embed: the output dtype's codec (VectorCodec.as_manifest), int8 ranges included
    backend_choice: str  # why the backend ran: measured on this CPU, the order set by hand, or asked for by name


def memfit_version() -> str:
    try:
        return version("memfit")
    except PackageNotFoundError:
        return "0.0.0+unknown"


def stream_to(
    open_job: Callable[[PartWriter, BackgroundWriter], StreamJob],
    stream: StreamInput,
    out_dir: str | os.PathLike,
    settings: dict[str, Any],
    *,
    engine: Engine,
    budget: AdaptiveBudget,
    device: Device,
    limits: BlockLimits,
    writes_in_flight: int = 2,
    resume: bool = False,
    progress: bool | None = None,
    part_size: int | None = None,
    check_sample: Callable[[list[str]], None] | None = None,
    sample_size: int = 1,
    info: Callable[[], dict[str, Any]] = dict,
) -> Manifest:
    """Run a job over ``stream`` and write its results to ``out_dir`` (Parquet parts + manifest.json).

    Before anything is created in ``out_dir``: the options, the output directory and the input (its
    first record, its fields) are checked, and ``check_sample`` (the precision guard) sees the first
    ``sample_size`` texts of the input, from stdin too. ``open_job`` builds the job once the output is
    open (a job may stream side files into it); ``info()`` adds to the manifest (after the check).
    Parts are encoded and written by a writer thread with a bounded queue, so the device is not idle
    while a part is written and results cannot pile up faster than the disk takes them. With
    ``resume`` the records already written are skipped. Returns the manifest.
    """
    check_options(part_size=part_size)
    check_output_dir(out_dir, resume)
    path = stream.path
    if path is not None:
        check_input(path, stream.input_format, stream.text_field, stream.id_field, pair_field=stream.pair_field)
    source = stream.source
    if check_sample is not None and path is not None and path != "-":
        head = itertools.islice(
            read_records(
                path, text_field=stream.text_field, id_field=stream.id_field, input_format=stream.input_format
            ),
            sample_size,
        )
        check_sample([r.text for r in head])
    elif check_sample is not None and path is None:
        source = iter(source)
        sample = list(itertools.islice(source, sample_size))
        source = itertools.chain(sample, source)
        stream = dataclasses.replace(stream, source=source)
        check_sample([r.text for r in records_from_texts(sample)])
    writer = PartWriter(
        out_dir, {**settings, **stream.settings()}, resume=resume, input_fingerprint=input_fingerprint(source)
    )
    if writer.complete:
        return Manifest(**writer.manifest)
    writer.update_info(memfit_version=memfit_version(), device=str(device))
    total = None
    if path is not None and Progress.shown(progress):
        total = estimate_rows(path, stream.input_format)
        total = None if total is None else max(0, total - writer.rows_done)
    records = stream.records(skip=writer.rows_done)
    if check_sample is not None and path == "-":  # stdin: sample the stream itself
        sample_records = list(itertools.islice(records, sample_size))
        records = itertools.chain(sample_records, records)
        check_sample([r.text for r in sample_records])
    writer.update_info(**info())
    with (
        BackgroundWriter(writes_in_flight) as background,
        tracking(budget.guard, background.busy, background.wait_idle),
    ):
        job = open_job(writer, background)
        for block, result in run_job(job, records, engine, budget, device, limits, progress, total):
            side_file = job.end_part()
            background.submit(
                _commit_part, writer, job.table(block, result), result.counts.as_manifest(job.inputs_key), side_file
            )
    writer.finish()
    return Manifest(**writer.manifest)


def tracking(
    guard: ResidentSetGuard | None, busy: Callable[[], bool], wait_idle: Callable[[], None]
) -> ContextManager[None]:
    """A thread the host reserve is for, told to the memory guard (nothing without one): whether it may still
    allocate, and how to wait until it is done (the writer's wait frees its queue before a refusal)."""
    return contextlib.nullcontext() if guard is None else guard.tracking(busy, wait_idle)


def _commit_part(writer: PartWriter, table: pa.Table, counts: dict[str, int], side_file: Any) -> None:
    """Writer-thread task: put a block's side file (token table) and then its part in place, then list both."""
    writer.write_part(table, counts, tokens=None if side_file is None else side_file.commit())
