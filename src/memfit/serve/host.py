"""The model a server hosts and the path of a request: texts → windows → ticket → result.

The model is loaded once through the library's own objects: :class:`~memfit.Classifier` picks the mode
as ``memfit classify`` does; in embedding mode its :class:`~memfit.Encoder` (tokenizer, windows, pooling,
memory plan) serves the embedding routes too. Requests are tokenized and windowed by the same jobs the
CLI runs (``EmbedJob``, the classifier's NLI / supervised jobs), their windows batched by
:class:`~memfit.serve.batcher.Batcher`, and merged by the same jobs' ``finish``, so a server's vector
is the CLI's vector.

**Memory.** The budget covers the whole server process: the limits derived from it (``options.py``) bound what
requests may hold, and admission (``admission.py``) counts the queue tokens they do hold.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import math
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Awaitable, Callable, Sequence, TypeVar

import numpy as np

from memfit.data.chunking import LongMode, resolve_stride, tokenize_texts
from memfit.jobs.classify import (
    Classification,
    Classifier,
    ranked,
)
from memfit.jobs.classify_scores import template_slots
from memfit.jobs.embed_job import EmbedBlock, EmbedJob
from memfit.jobs.encoder import Encoder, warn_of_fp32_instead
from memfit.jobs.rerank import Reranker
from memfit.jobs.classify_jobs import NliJob, SupervisedJob
from memfit.jobs.rerank_job import RerankBlock, RerankJob
from memfit.errors import ConfigError, QualityError
from memfit.io.vector_codec import RecordedCalibration, read_calibration
from memfit.memory.model import MemoryPlan, process_peak_rss_bytes, trim_host_heap
from memfit.engine.pooling import EmbeddingHead
from memfit.engine.process import compute_threads
from memfit.jobs.runner import PreparedBlock, records_from_texts
from memfit.engine.runtime import Runtime
from memfit.serve.admission import TRIM_AFTER_TOKENS, Admission, ClientGone, Lease, QueueFull
from memfit.serve.batcher import Batcher, Lane, Ticket
from memfit.serve.metrics import ServerMetrics
from memfit.serve.options import (
    QUEUE_BYTES_PER_TOKEN,
    ServeOptions,
    compiled_streams,
    derive_limits,
    model_workers,
)

log = logging.getLogger("memfit")

OUTPUT_BYTES_PER_FLOAT = 80  # a float on its way out: float32, Python float in a list, JSON text
TOKENIZE_OUTPUT_BYTES_PER_TOKEN = 512  # a /tokenize entry: a dict of five fields, then its JSON
LABEL_CACHE_SIZE = 4096
# A label text is cached only up to this length: the cache lives outside the budget, and a request may fill a
# template to --max-body-bytes characters, so 4,096 keys of any length could hold gigabytes. Real label texts
# ("This example is about sports.") are far shorter, and a longer one is embedded again each time.
LABEL_CACHE_MAX_CHARS = 1024
BUNDLED_MODEL_NAME = "all-MiniLM-L6-v2"
WARMUP_TEXTS = ("memfit serve warms up its model with this sentence.", "")


Disconnected = Callable[[], Awaitable[bool]]
Job = TypeVar("Job")


class ServerHost:
    """The hosted model, its batcher, limits and metrics (built once, before the server is ready).

    ``model_runtime``: a :class:`memfit.engine.runtime.Runtime` already loaded (e.g. by a host process); by
    default one is loaded from ``options`` (through :class:`~memfit.Classifier`, which picks the mode).
    ``calibration``: the ranges of ``options.quantization_ranges`` where the caller read them already
    (:func:`~memfit.serve.create_app` does, to refuse a wrong path before it listens); else they are read here,
    before the model loads. Either way they are checked against the loaded model before it warms up."""

    def __init__(
        self,
        options: ServeOptions,
        model_runtime: Runtime | None = None,
        calibration: RecordedCalibration | None = None,
    ):
        self.options = options
        if calibration is None and options.quantization_ranges is not None:
            calibration = read_calibration(options.quantization_ranges)
        self.classifier = self._classifier(options.dtype, model_runtime)
        guarded = self.classifier.encoder
        if model_runtime is None and guarded is not None and guarded.runs_fp32_after_a_failed_guard():
            # as `memfit embed` does under dtype=auto: a reduced precision that fails the guard runs fp32 instead
            try:
                guarded.check_quality(list(WARMUP_TEXTS), None, can_accept=False)
            except QualityError as failed:
                warn_of_fp32_instead(failed.report)
                self.classifier = guarded = None  # type: ignore[assignment]  # freed before fp32 loads
                gc.collect()
                self.classifier = self._classifier("fp32", None)
        self.model_runtime: Runtime = self.classifier.runtime
        self.encoder: Encoder | None = self.classifier.encoder
        host = self.encoder or self.classifier
        self.memory: MemoryPlan = host.memory
        self.model_name = self.classifier.model_name
        self.served_name = options.served_model_name or _served_name(options.model, self.model_name)
        self.max_length = host.max_length
        self.calibration = calibration
        if calibration is not None:
            self._check_calibration(calibration)
        if self.encoder is not None:
            self.stride = resolve_stride(options.long, options.stride, self.max_length, self.encoder.special)
            self.encoder.embed(list(WARMUP_TEXTS))  # first forward (and the precision guard) before /ready
        else:
            self.stride = options.stride
            labels = None if self.classifier.mode == "supervised" else ["yes", "no"]
            self.classifier.classify(list(WARMUP_TEXTS), labels=labels)
        # a cross-encoder also answers /rerank; any other model is told why not, in the CLI's words
        self.reranker: Reranker | None = None
        self.rerank_refusal: ConfigError | None = None
        try:
            self.reranker = Reranker(self.model_name, runtime=self.model_runtime)
        except ConfigError as exc:
            self.rerank_refusal = exc
        if options.stride is not None and self.encoder is None:
            # --stride is the server's for every request: refused now, not as every request's 400 later
            self.classifier.job(labels, long="chunk", stride=options.stride)
            if self.reranker is not None:
                self.reranker.job(query="a query", long="chunk", stride=options.stride)
        self.metrics = ServerMetrics(self.memory.budget_bytes)
        self.limits = derive_limits(options, self.memory, process_peak_rss_bytes(), self.max_length)
        self.admission = Admission(self.limits.max_queue_tokens, self.metrics)
        self.tokenize_lock = threading.Lock()
        self._labels: OrderedDict[str, np.ndarray] = OrderedDict()  # label text → unit vector
        budget = self.encoder.budget if self.encoder else self.classifier.budget
        workers = model_workers(
            options.batching.workers,
            host.device.type == "cpu",
            compute_threads(),
            budget.base.max_batch_tokens,
            self.max_length,
        )
        batching = dataclasses.replace(options.batching, workers=workers)
        self.batcher = Batcher(self.model_runtime.engine, host.device, budget, batching, self.metrics)
        self.batcher.start(warmup=self._warmup_batch())  # every worker's first batch, before /ready
        log.info("limits: %s", self.limits)

    def close(self) -> None:
        self.batcher.stop()

    def _classifier(self, dtype: str, model_runtime: Runtime | None) -> Classifier:
        """The hosted model (through :class:`~memfit.Classifier`, which picks the mode) in ``dtype``, or on
        ``model_runtime`` where the caller loaded one."""
        options = self.options
        return Classifier(
            options.model,
            mode=options.classify_mode,
            device=options.device,
            dtype=dtype,
            max_length=options.max_length,
            memory_budget=options.memory_budget,
            temperature=options.temperature,
            threshold=options.threshold,
            backend=options.backend,
            offload=options.offload,
            streams=compiled_streams(options),
            runtime=model_runtime,
        )

    def _check_calibration(self, calibration: RecordedCalibration) -> None:
        """The recorded ranges must describe the vectors /v1/embeddings answers: this model's, pooled by its
        default, normalized as the server normalizes (a mismatch would quantize every query into wrong levels)."""
        if self.encoder is None:
            raise ConfigError(
                f"--quantization-ranges quantizes embeddings, and this server hosts a {self.classifier.mode} "
                "classifier, which answers none",
                field="quantization_ranges",
            )
        calibration.check_vectors(
            model=self.encoder.model_name,
            pooling=self.encoder.job().pooling,  # what the embedding routes pool by
            normalize=self.options.normalize,
            dim=self.encoder.dim,
        )

    def _warmup_batch(self) -> tuple[Lane, list]:
        """The windows each model worker runs once before the server is ready: the warm-up texts, by the job
        (and so the lane and head) of the model's main route (/embed, or /classify for a classifier)."""
        records = list(records_from_texts(WARMUP_TEXTS))
        if self.encoder is not None:
            job = self.encoder.job(normalize=self.options.normalize, long=self.options.long, stride=self.options.stride)
            lane = _embed_lane(job)
        else:
            labels = None if self.classifier.mode == "supervised" else ["yes", "no"]
            job = self.classifier.job(labels)
            lane = self._logits_lane(job)
        return lane, job.prepare(records).windows

    # -- what a route calls -----------------------------------------------------------------------

    async def embed(
        self,
        texts: Sequence[str],
        *,
        normalize: bool,
        long: LongMode,
        tokens: bool,
        disconnected: Disconnected,
        prompt_name: str | None = None,
        dimensions: int | None = None,
    ) -> tuple[EmbedBlock, Lease]:
        """Pooled vectors (or, with ``tokens``, one row per token) of ``texts``: ``memfit embed``'s job, with the
        model's default prompt unless ``prompt_name`` names another, shortened to ``dimensions`` when asked."""
        encoder = self._need_encoder()
        job = await asyncio.to_thread(  # the job tokenizes the model's prompt as it is built
            self._tokenizing,
            encoder.job,
            normalize=normalize,
            keep_tokens=tokens,
            long=long,
            stride=self.options.stride,
            pooled=not tokens,
            prompt_name=prompt_name,
            dimensions=dimensions,
        )
        return await self._run(
            job,
            _embed_lane(job),
            texts,
            output_floats_per_token=encoder.dim if tokens else 0,
            output_floats_per_text=0 if tokens else encoder.dim,
            disconnected=disconnected,
        )

    async def classify(
        self,
        texts: Sequence[str],
        labels: Sequence[str] | None,
        *,
        template: str,
        multi_label: bool,
        long: LongMode,
        disconnected: Disconnected,
    ) -> tuple[list[Classification], Lease]:
        """Scores of ``memfit classify``'s job in the hosted model's mode; in embedding mode the label vectors
        come through the batcher (cached), the rest of the job is the classifier's own."""
        clf = self.classifier
        if labels is not None and clf.mode != "supervised":  # a supervised classifier fills no template
            self._check_filled_length(labels, template)
        if clf.mode == "embedding":  # its embed jobs tokenize the model's prompt as they are built
            inputs = await asyncio.to_thread(
                self._tokenizing, clf.label_inputs, labels, template, multi_label, long, self.options.stride
            )
            label_vectors = await self._label_vectors(inputs.label_job, inputs.label_texts, disconnected)
            job = clf.embedding_job(inputs, label_vectors)
            lane = _embed_lane(job.embed)
        else:  # an NLI job tokenizes its hypotheses as it is built: off the event loop, one request at a time
            job = await asyncio.to_thread(
                self._tokenizing, clf.job, labels, template, multi_label, long, self.options.stride
            )
            lane = self._logits_lane(job)
        block, lease = await self._run(job, lane, texts, 0, len(job.labels), disconnected)
        return [ranked(job.labels, row) for row in block.scores], lease

    async def rerank(
        self, query: str, texts: Sequence[str], *, raw: bool, long: LongMode, disconnected: Disconnected
    ) -> tuple[RerankBlock, Lease]:
        """Relevance of each text to ``query``, in request order: ``memfit rerank``'s job."""
        if self.reranker is None:
            raise self.rerank_refusal or ConfigError("this server hosts no cross-encoder")
        job = await asyncio.to_thread(  # the job tokenizes the query as it is built
            self._tokenizing, self.reranker.job, query=query, long=long, stride=self.options.stride, raw=raw
        )
        return await self._run(job, self._logits_lane(job), texts, 0, 1, disconnected)

    async def tokenize(
        self, texts: Sequence[str], prompt_name: str | None = None
    ) -> tuple[list[str], list[tuple[np.ndarray, np.ndarray, int, int]], Lease]:
        """The texts as the model sees them (its default prompt before each, or the one ``prompt_name`` names, as
        the embedding routes and TEI's ``/tokenize`` put it), and per text: all token ids with the special tokens,
        their character offsets in that text, and how many of the ids are leading / trailing special tokens."""
        encoder = self._need_encoder()
        _, prompt = encoder.runtime.prompts.resolve(prompt_name)
        texts = [prompt + text for text in texts] if prompt else list(texts)
        tokenized = await asyncio.to_thread(self._tokenize, encoder, texts)
        special = encoder.special
        tokens = sum(len(t.ids) + special.single_overhead for t in tokenized)
        lease = self._admit(tokens + math.ceil(tokens * TOKENIZE_OUTPUT_BYTES_PER_TOKEN / QUEUE_BYTES_PER_TOKEN))
        out = []
        for t in tokenized:
            ids = np.concatenate([np.asarray(special.prefix, np.int64), t.ids, np.asarray(special.suffix, np.int64)])
            offsets = np.concatenate(
                [np.zeros((len(special.prefix), 2), np.int32), t.offsets, np.zeros((len(special.suffix), 2), np.int32)]
            )
            out.append((ids, offsets, len(special.prefix), len(special.suffix)))
        return texts, out, lease

    def _tokenizing(self, build: Callable[..., Job], *args, **kwargs) -> Job:
        """``build(*args, **kwargs)`` under the tokenize lock: a job that tokenizes as it is built (NLI hypotheses,
        a rerank query, a prompt) holds the tokenizer's transient memory as a request's texts do, budgeted once, and
        does not share the tokenizer with a worker's call or stall the event loop."""
        with self.tokenize_lock:
            return build(*args, **kwargs)

    def _check_filled_length(self, labels: Sequence[str], template: str) -> None:
        """Refuse labels that fill the template past a request body's size before any is filled: slots multiply a
        label (``{}`` repeated), so a small body could otherwise ask for gigabytes of hypotheses."""
        characters, slots = template_slots(template)
        filled = sum(characters + slots * len(label) for label in labels)
        if filled > self.limits.max_body_bytes:
            raise ConfigError(
                f"the template filled with the labels holds {filled} characters; at most "
                f"{self.limits.max_body_bytes} (--max-body-bytes)",
                field="template",
            )

    def _tokenize(self, encoder: Encoder, texts: Sequence[str]):
        with self.tokenize_lock:
            tokenized = tokenize_texts(encoder.tokenizer, list(texts))
            if sum(len(t) for t in texts) >= TRIM_AFTER_TOKENS:
                trim_host_heap()
            return tokenized

    def retry_after(self) -> int:
        """Seconds until the admitted queue has likely drained, by the recent model throughput."""
        rate = self.batcher.tokens_per_second or 1000.0
        return max(1, math.ceil(self.batcher.queued_tokens / rate))

    # -- internals --------------------------------------------------------------------------------

    def _need_encoder(self) -> Encoder:
        if self.encoder is None:
            served = "/classify and /rerank" if self.reranker is not None else "/classify"
            raise ConfigError(
                f"this server hosts a {self.classifier.mode} classifier: it answers {served}, not embedding routes"
            )
        return self.encoder

    def _logits_lane(self, job: NliJob | SupervisedJob | RerankJob) -> Lane:
        """Classifier windows batch together when they agree on carrying token types (pairs do, when the
        model takes them); the head is the job's own."""
        types = not isinstance(job, SupervisedJob) and self.model_runtime.uses_token_types
        return Lane(f"logits-{types}", job.head)

    async def _run(
        self,
        job,
        lane: Lane,
        texts: Sequence[str],
        output_floats_per_token: int,
        output_floats_per_text: int,
        disconnected: Disconnected,
    ):
        records = list(records_from_texts(texts))
        prepared: PreparedBlock = await asyncio.to_thread(self._prepare, job, records)
        tokens = sum(len(w) for w in prepared.windows)
        output_bytes = OUTPUT_BYTES_PER_FLOAT * (output_floats_per_token * tokens + output_floats_per_text * len(texts))
        lease = self._admit(tokens + math.ceil(output_bytes / QUEUE_BYTES_PER_TOKEN))
        try:
            ticket = self.batcher.submit(lane, prepared.windows)
            outputs = await _wait(self.batcher, ticket, disconnected)
            result = await asyncio.to_thread(job.finish, records, prepared, outputs)
        except BaseException:
            lease.release()
            raise
        return result, lease

    def _admit(self, cost: int) -> Lease:
        """Hold ``cost`` queue tokens, or refuse: 400 if more than the whole queue, 429 if full now."""
        if cost > self.admission.capacity:
            raise ConfigError(
                f"this request needs {cost} queue tokens; the server holds at most "
                f"{self.admission.capacity} (--max-queue-tokens)"
            )
        if not self.admission.try_acquire(cost):
            self.metrics.rejected.labels("queue_full").inc()
            raise QueueFull(
                self.retry_after(),
                f"the queue is full ({self.admission.held} of {self.admission.capacity} tokens held); retry later",
            )
        return Lease(self.admission, cost)

    def _prepare(self, job, records) -> PreparedBlock:
        """Tokenize and window, one request at a time (the tokenizer's transient memory is budgeted once)."""
        with self.tokenize_lock:
            prepared = job.prepare(records)
            if sum(len(r.text) for r in records) >= TRIM_AFTER_TOKENS:
                trim_host_heap()  # the tokenizer's working memory, freed but still resident
            return prepared

    async def _label_vectors(
        self, label_job: EmbedJob, label_texts: list[str], disconnected: Disconnected
    ) -> np.ndarray:
        """The vectors of ``label_texts`` by ``label_job`` (the classifier's), through the batcher; cached per
        text, as a label's text always gets the same vector. The hits are taken before anything is embedded: this
        request's new texts, or another request's while this one waits, may evict them from the cache."""
        vectors = {}
        for text in dict.fromkeys(label_texts):
            if text in self._labels:
                self._labels.move_to_end(text)  # least recently used goes first
                vectors[text] = self._labels[text]
        missing = [text for text in dict.fromkeys(label_texts) if text not in vectors]
        if missing:
            block, lease = await self._run(
                label_job, _embed_lane(label_job), missing, 0, self.encoder.dim, disconnected
            )
            lease.release()
            for text, vector in zip(missing, block.pooled):
                vectors[text] = vector
                if len(text) <= LABEL_CACHE_MAX_CHARS:
                    self._labels[text] = vector
                while len(self._labels) > LABEL_CACHE_SIZE:
                    self._labels.popitem(last=False)
        return np.stack([vectors[text] for text in label_texts])


def _embed_lane(job: EmbedJob) -> Lane:
    """Embedding windows batch together when they are pooled the same way (and keep token rows alike)."""
    return Lane(f"embed-{job.pooling}-{job.keep_tokens}", EmbeddingHead(job.pooling, job.keep_tokens))


async def _wait(batcher: Batcher, ticket: Ticket, disconnected: Disconnected) -> list:
    """The ticket's outputs; if the client goes away first, its windows are dropped."""
    future = asyncio.wrap_future(ticket.future)
    while True:
        done, _ = await asyncio.wait({future}, timeout=0.25)
        if done:
            return future.result()
        if await disconnected():
            batcher.cancel(ticket)
            raise ClientGone()


def _served_name(model: str | None, model_name: str) -> str:
    """The id /v1/models lists: the bundled model's own name, a hub id as is, a directory by its name."""
    if model is None:
        return BUNDLED_MODEL_NAME
    path = Path(model_name)
    return path.name if path.is_dir() else model_name
