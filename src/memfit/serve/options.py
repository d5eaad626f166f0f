"""What ``memfit serve`` is configured with, and the limits it derives from the memory budget.

After the model is loaded and warmed up, the room left beside the process's resident set and the largest batch
is shared out as limits (:func:`derive_limits`): one tokenization at a time (the fast tokenizer holds up to ~400
bytes per input character while it runs, measured on all-MiniLM-L6-v2's tokenizer: 168 B/char on English text,
391 B/char on one-letter words), request bodies in flight, and the admitted queue in tokens, with a fifth kept
free for what the estimates miss. A request that does not fit is refused (413, or 429 with ``Retry-After``)
instead of pushing the process over.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from memfit.data.chunking import LongMode
from memfit.defaults import DEFAULT_MAX_ITEMS
from memfit.engine.process import configure_process
from memfit.errors import ConfigError, DoesNotFitError
from memfit.jobs.classify import DEFAULT_SIMILARITY_THRESHOLD, DEFAULT_TEMPERATURE
from memfit.memory.model import MemoryPlan, host_room
from memfit.memory.planner import padded_length
from memfit.serve.batcher import BatchingOptions
from memfit.memory.device import resolve_device

# Host bytes per unit, for the limits (see the module docstring and docs/serve.md).
TOKENIZE_BYTES_PER_CHAR = 400  # the fast tokenizer's peak while it runs, worst case measured
BODY_BYTES_PER_BYTE = 4  # raw body + parsed JSON + validated strings (+ wider str for non-ASCII)
QUEUE_BYTES_PER_TOKEN = 64  # a queued token: its text, ids, offsets and window copy
# Share of the room for each: tokenization, request bodies, the admitted queue. The fifth left over is
# for what the estimates miss: glibc keeps freed memory in per-thread arenas, and threads come and go.
ROOM_SHARES = (0.3, 0.2, 0.3)
DEFAULT_MAX_BODY_BYTES = 2 * 2**20  # what text-embeddings-inference allows; lowered when the budget is small
DEFAULT_MAX_CONCURRENT = 256
MIN_BODY_BYTES = 16 * 2**10


@dataclass(frozen=True)
class ServeOptions:
    """Everything ``memfit serve`` is configured with (``None`` limits are derived from the budget)."""

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    backend: str = "auto"
    offload: str = "auto"
    max_length: int | None = None
    memory_budget: str | int | None = None
    long: LongMode = "chunk"
    stride: int | None = None
    normalize: bool = True
    classify_mode: str = "auto"
    temperature: float = DEFAULT_TEMPERATURE
    threshold: float = DEFAULT_SIMILARITY_THRESHOLD
    served_model_name: str | None = None
    max_items: int = DEFAULT_MAX_ITEMS
    max_body_bytes: int | None = None
    max_concurrent_requests: int | None = None
    max_queue_tokens: int | None = None
    batching: BatchingOptions = field(default_factory=BatchingOptions)
    threads: int | None = None  # CPU threads per model worker; None: 1 (the workers use the cores)
    body_timeout: float = 60.0  # seconds a request's body may take to arrive (then 408)
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # Bearer tokens every route but the probes needs
    public_metrics_and_docs: bool = False  # /metrics, /docs and /openapi.json open without a key
    # a `memfit embed --output-dtype int8|uint8` output (or its manifest.json): /v1/embeddings' int8 and uint8
    # embedding_types quantize with the ranges it calibrated on its corpus, so queries match its stored vectors
    quantization_ranges: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        # the limits a user may set: each counts something, so below 1 it would refuse every request (or divide the
        # budget's room by zero)
        for flag, value in (
            ("--max-items", self.max_items),
            ("--max-body-bytes", self.max_body_bytes),
            ("--max-concurrent-requests", self.max_concurrent_requests),
            ("--max-queue-tokens", self.max_queue_tokens),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{flag} must be a whole number of at least 1, got {value!r}")


def model_threads(requested: int | None) -> int:
    """CPU threads per model worker (torch's intra-op threads, process-wide): 1 by default, the cores
    being used by the workers side by side (:func:`model_workers`). An OpenMP team of several threads
    stalls at every parallel region when any member is preempted (by the event loop or another process:
    measured on 2 busy cores, ~700 ms instead of ~25 ms for one text); one-thread workers just slow down."""
    if requested is not None:
        if requested < 1:
            raise ConfigError(f"--threads must be at least 1, got {requested}")
        return requested
    return 1


def model_workers(requested: int | None, on_cpu: bool, threads: int, batch_tokens: int, window_tokens: int) -> int:
    """Batches run at once: on the CPU one per core (``threads`` each), on a GPU 1. They share the
    token budget, so no more than the budget holds a longest window each."""
    room = max(1, batch_tokens // padded_length(window_tokens))
    if requested is not None:
        if requested < 1 or requested > room:
            raise ConfigError(
                f"--model-workers must be between 1 and {room} (the batch budget, {batch_tokens} tokens, "
                f"holds {room} windows of {window_tokens}), got {requested}"
            )
        return requested
    if not on_cpu:
        return 1
    return min(max(1, len(os.sched_getaffinity(0)) // threads), room)


@dataclass(frozen=True)
class Limits:
    """The limits in force (what /info reports)."""

    max_items: int
    max_body_bytes: int
    max_concurrent_requests: int
    max_queue_tokens: int


def derive_limits(options: ServeOptions, plan: MemoryPlan, held_bytes: int, window: int) -> Limits:
    """Share the budget's room beside ``held_bytes`` (the process now) and the largest batch among
    tokenization, request bodies and the queue; limits the user set are kept, and checked to fit.

    The largest batch is the one of ``window``-token windows: at a given number of tokens, longer windows
    cost more where attention grows with length squared (a compiled graph's attention does)."""
    longest = padded_length(window)
    batch_bytes = plan.activations.predict(max(1, plan.largest_batch(longest)), longest)
    room = host_room(plan.budget_bytes, max(held_bytes, plan.baseline_bytes) + batch_bytes)
    tokenize_room, body_room, queue_room = (room * share for share in ROOM_SHARES)
    max_body = options.max_body_bytes
    if max_body is None:
        max_body = DEFAULT_MAX_BODY_BYTES
        while max_body > MIN_BODY_BYTES and max_body * TOKENIZE_BYTES_PER_CHAR > tokenize_room:
            max_body //= 2
    concurrent = options.max_concurrent_requests
    if concurrent is None:
        concurrent = int(min(DEFAULT_MAX_CONCURRENT, body_room // (BODY_BYTES_PER_BYTE * max_body)))
    queue_tokens = options.max_queue_tokens
    if queue_tokens is None:
        queue_tokens = int(queue_room // QUEUE_BYTES_PER_TOKEN)
    limits = Limits(options.max_items, max_body, concurrent, queue_tokens)
    needed = (
        max_body * (TOKENIZE_BYTES_PER_CHAR + concurrent * BODY_BYTES_PER_BYTE) + queue_tokens * QUEUE_BYTES_PER_TOKEN
    )
    if concurrent < 1 or queue_tokens < plan.batch_budget.max_batch_tokens or needed > max(room, 0):
        gib = 2**30
        raise DoesNotFitError(
            f"the memory budget ({plan.budget_bytes / gib:.2f} GiB) leaves {max(room, 0) / gib:.2f} GiB beside the "
            f"model ({held_bytes / gib:.2f} GiB held) and one batch; these limits need {needed / gib:.2f} GiB "
            f"(max body {max_body} B, {concurrent} concurrent requests, {queue_tokens} queue tokens): raise "
            "--memory-budget or lower --max-body-bytes / --max-concurrent-requests / --max-queue-tokens"
        )
    return limits


def compiled_streams(options: ServeOptions) -> int:
    """Batches a compiled backend must be able to run at once: as many as the model workers may be (one per
    :func:`model_threads` threads on the cores), each with its own share of the threads."""
    return options.batching.workers or max(1, len(os.sched_getaffinity(0)) // model_threads(options.threads))


def configure_server_process(options: ServeOptions) -> None:
    """The server's process-wide settings (:func:`memfit.engine.process.configure_process`), before its model
    loads: the inference allocator settings, and on the CPU :func:`model_threads` torch threads (one per model
    worker unless ``--threads`` says otherwise)."""
    threads = model_threads(options.threads) if resolve_device(options.device).type == "cpu" else None
    configure_process(options.device, threads=threads)
