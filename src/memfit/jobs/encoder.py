"""The embed job's public face: :class:`Encoder` embeds texts in memory or streams them to Parquet.

An Encoder is a thin layer over a :class:`~memfit.engine.runtime.Runtime` (the model, tokenizer and memory
plan, loaded once by :func:`~memfit.engine.runtime.load_runtime`): each call validates its options, runs the
precision guard on the caller's first texts, and hands an :class:`~memfit.jobs.embed_job.EmbedJob` to the
shared loop in ``runner.py`` (``run_job`` in memory, ``stream_to`` for an output directory).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import numbers
import os
from typing import Any, Iterable, Literal, Sequence

import numpy as np

from memfit.data.chunking import LongMode, resolve_stride
from memfit.data.prompts import measure_prompt
from memfit.jobs.embed_job import EmbedJob, TokenEmbedding, without_specials
from memfit.engine.batches import CurrentRuntimeEngine, Engine
from memfit.engine.models import cpu_identity
from memfit.errors import ConfigError
from memfit.memory.host_budget import BlockLimits, HostBudget
from memfit.memory.model import MemoryPlan
from memfit.engine.pooling import EmbeddingHead, Pooling, check_pooling
from memfit.engine.precision import (
    CALIBRATION_TEXTS,
    QualityReport,
    cached_pass,
    calibration_windows,
    default_min_cosine,
    enforce,
    measure_quality,
    precision_name,
    remember_pass,
)
from memfit.jobs.runner import StreamInput, records_from_texts, run_job, stream_to, text_list
from memfit.jobs.hosted import RuntimeHost
from memfit.engine.runtime import Runtime, load_runtime
from memfit.io.sinks import BackgroundWriter, PartWriter
from memfit.data.sources import Record
from memfit.io.token_table import TokenPieces, TokenStream
from memfit.io.vector_codec import CALIBRATED, VectorCodec, resume_calibration

__all__ = ["Encoder", "TokenEmbedding"]

log = logging.getLogger("memfit")

OutputDtype = Literal["float32", "float16", "int8", "uint8", "binary", "ubinary"]


@functools.lru_cache(maxsize=None)
def _note_not_matryoshka(model_name: str) -> None:
    """Say once per model that its shortened vectors are untested by its authors (they still work)."""
    log.warning(
        "note: %s names no Matryoshka training in its model card; its first dimensions may keep less of its "
        "quality than a Matryoshka model's do",
        model_name,
    )


def warn_of_fp32_instead(report: QualityReport) -> None:
    """One line where ``dtype=auto``'s reduced precision failed the guard and fp32 runs instead of a refusal: by an
    Encoder that loaded its runtime (:meth:`Encoder.check_quality`), or by a host that loads it again
    (``memfit serve``)."""
    log.warning(
        "dtype auto: %s measured min cosine %.5f < %s against fp32 on the first %d texts; running fp32 instead",
        report.precision,
        report.min_cosine,
        report.threshold,
        report.texts,
    )


class Encoder(RuntimeHost):
    """A BERT-family encoder that embeds texts of any number and length within a memory budget.

    ``model``: ``None`` for the bundled all-MiniLM-L6-v2, a local directory or a Hugging Face hub id.
    ``device``: ``auto`` (CUDA when present), ``cpu``, ``cuda``, ``cuda:1``.
    ``dtype``: ``auto`` (bf16 where the hardware runs it fast, else fp32), ``fp32``, ``bf16``, ``fp16``.
    ``max_length``: window size in tokens, special tokens included (default: the model's
    sentence-transformers ``max_seq_length``, else its position limit).
    ``memory_budget``: "4GiB", "500MB", "80%" (of the device's total memory) or bytes; default: what the
    process holds plus 90% of the free device memory. The budget is a promise for the whole process
    only after :func:`memfit.configure_process` (the ``memfit`` command calls it; see docs/memory.md).
    ``quantize``: ``none`` or ``int8`` (see ``precision.py``).
    ``min_cosine``: the quality guard's threshold for reduced precision (default 0.999 for bf16/fp16,
    0.99 for int8); ``quality_check=False`` skips the guard. The guard runs once, on the first call's texts.
    ``backend``: ``auto`` (OpenVINO on the CPU when installed, else PyTorch), ``torch``, ``openvino``.
    ``offload``: ``auto`` (stream the layers from the weights file only when the whole model cannot fit
    ``memory_budget``), ``never``, ``always`` (docs/memory.md).
    ``runtime``: an already loaded :class:`~memfit.engine.runtime.Runtime` (then the loading arguments are unused).
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        device: str = "auto",
        dtype: str = "auto",
        max_length: int | None = None,
        memory_budget: str | int | None = None,
        quantize: str = "none",
        min_cosine: float | None = None,
        quality_check: bool = True,
        *,
        backend: str = "auto",
        offload: str = "auto",
        runtime: Runtime | None = None,
    ):
        load: dict[str, Any] | None = None
        if runtime is None:
            load = dict(
                model=model,
                device=device,
                quantize=quantize,
                memory_budget=memory_budget,
                max_length=max_length,
                task="embedding",
                backend=backend,
                offload=offload,
            )
            runtime = load_runtime(dtype=dtype, **load)
        elif runtime.task != "embedding":
            raise ConfigError(f"an Encoder needs a runtime loaded for embedding, not for {runtime.task}")
        self.runtime = runtime
        # dtype=auto chose the precision, the guard's threshold is the default and no int8 was asked for (int8 the
        # guard refuses rather than run fp32): a cached pass may stand (_verdict_key), and an automatic bf16 that
        # fails the guard may run fp32 instead, by loading again where this Encoder loaded (see check_quality)
        self._auto_precision = runtime.dtype_was_auto and min_cosine is None and runtime.quantize == "none"
        self._fp32_fallback: dict[str, Any] | None = None
        if load is not None and self._auto_precision and runtime.dtype == "bf16" and runtime.backend.retries_fp32:
            self._fp32_fallback = {**load, "backend": runtime.backend.name, "dtype": "fp32"}
        default_threshold = default_min_cosine(runtime.dtype, runtime.quantize)
        # None: fp32 (nothing to guard) or the user opted out
        self.min_cosine = (
            None
            if not quality_check or default_threshold is None
            else (default_threshold if min_cosine is None else min_cosine)
        )
        self.quality: QualityReport | None = None
        # per Encoder (never shared between runs): the plan in force, host limits, the OOM-adaptive budget
        self.memory: MemoryPlan = runtime.memory
        self.host: HostBudget = runtime.host
        self.budget = runtime.adaptive_budget()

    # what the runtime fixed at load time beyond RuntimeHost's
    model = property(lambda self: self.runtime.model)
    quantize = property(lambda self: self.runtime.quantize)
    dim = property(lambda self: self.runtime.dim)
    default_pooling = property(lambda self: self.runtime.default_pooling)

    # -- public API -------------------------------------------------------------------------------

    def embed(
        self,
        texts: Iterable[str],
        pooling: Pooling | None = None,
        normalize: bool = False,
        long: LongMode = "chunk",
        stride: int | None = None,
        progress: bool | None = False,
        *,
        prompt_name: str | None = None,
        prompt: str | None = None,
        dimensions: int | None = None,
    ) -> np.ndarray:
        """Pooled embeddings ``[N, d]`` float32, in input order. ``pooling=None``: the model's default.

        ``prompt_name`` / ``prompt``: the prompt put before every text, as ``SentenceTransformer.encode`` takes
        them (default: the model's ``default_prompt_name``, if it has one; ``prompt=""`` for none).
        ``dimensions``: keep the first ``dimensions`` of each vector (before ``normalize``), as
        sentence-transformers' ``truncate_dim``."""
        texts = text_list(texts)
        job = self.job(
            pooling,
            normalize,
            keep_tokens=False,
            long=long,
            stride=stride,
            prompt_name=prompt_name,
            prompt=prompt,
            dimensions=dimensions,
        )
        self.check_quality(texts[:CALIBRATION_TEXTS], job.pooling)
        return self.pooled(job, texts, progress)

    def embed_tokens(
        self,
        texts: Iterable[str],
        drop_special: bool = False,
        long: LongMode = "chunk",
        stride: int | None = None,
        progress: bool | None = False,
        *,
        prompt_name: str | None = None,
        prompt: str | None = None,
    ) -> list[TokenEmbedding]:
        """Token-level embeddings per text: ids, character offsets and an ``[n_tokens, d]`` array.

        With ``long="chunk"`` (default) every token of a long text gets exactly one vector, from the
        window in which it sits most centrally. ``drop_special`` removes [CLS]/[SEP]-like rows. A prompt
        (as for :meth:`embed`) is read by the model but gives no rows; offsets are in the text.
        """
        texts = text_list(texts)
        job = self.job(keep_tokens=True, pooled=False, long=long, stride=stride, prompt_name=prompt_name, prompt=prompt)
        self.check_quality(texts[:CALIBRATION_TEXTS], self.default_pooling)
        out: list[TokenEmbedding] = []
        for _, block in self._run(job, records_from_texts(texts), progress, len(texts)):
            out.extend(block.tokens)
        if drop_special:
            out = [without_specials(t) for t in out]
        return out

    def embed_to(
        self,
        source: str | os.PathLike | Iterable[str],
        out_dir: str | os.PathLike,
        pooling: Pooling | None = None,
        normalize: bool = False,
        tokens: bool = False,
        long: LongMode = "chunk",
        stride: int | None = None,
        text_field: str = "text",
        id_field: str | None = None,
        input_format: str | None = None,
        output_dtype: OutputDtype = "float32",
        resume: bool = False,
        progress: bool | None = None,
        part_size: int | None = None,
        *,
        prompt_name: str | None = None,
        prompt: str | None = None,
        dimensions: int | None = None,
    ) -> dict[str, Any]:
        """Stream embeddings of ``source`` to ``out_dir`` (Parquet parts + manifest.json).

        ``source``: a file path (txt, jsonl, csv, tsv, parquet), ``"-"`` for stdin, or an iterable of
        strings. Memory does not grow with the number of texts. With ``resume=True`` an interrupted run
        continues after its last complete part. ``part_size``: texts per part (default 2048; the same setting as
        :meth:`~memfit.Classifier.classify_to`'s and ``--part-size``). ``prompt_name`` / ``prompt`` /
        ``dimensions``: as for :meth:`embed` (``dimensions`` shortens the pooled vectors, not the token rows).
        Returns the manifest.
        """
        codec = VectorCodec(output_dtype)
        if codec.quantized and tokens:
            raise ConfigError(
                f"--output-dtype {output_dtype} applies to pooled vectors; --tokens writes float32 or float16 rows",
                field="output_dtype",
            )
        if resume and output_dtype in CALIBRATED:
            resume_calibration(codec, out_dir)  # the parts already written were quantized with its ranges
        job = self.job(
            pooling,
            normalize,
            keep_tokens=tokens,
            long=long,
            stride=stride,
            prompt_name=prompt_name,
            prompt=prompt,
            dimensions=dimensions,
        )
        job = dataclasses.replace(job, codec=codec)
        settings = {
            "job": "embed",
            "model": self.model_name,
            "pooling": job.pooling,
            "normalize": normalize,
            "tokens": tokens,
            "dtype": self.dtype,
            "backend": self.runtime.backend.name,
            "quantize": self.quantize,
            "max_length": self.max_length,
            "long": long,
            "stride": job.stride,
            "output_dtype": output_dtype,
            "prompt": None if job.prompt is None else job.prompt.as_manifest(),
            "dimensions": dimensions,
        }

        def open_job(writer: PartWriter, background: BackgroundWriter) -> EmbedJob:
            # the first part's calibration is listed with the first part (it is computed before that part is queued)
            codec.on_calibrated = lambda quantization: writer.update_info(quantization=quantization)
            if not tokens:
                return job
            pieces = TokenPieces(codec.arrow_type, self.host.piece_bytes)
            return dataclasses.replace(
                job, tokens_out=TokenStream(writer.location, writer.next_part_index, background, pieces)
            )

        guard_pending = self.min_cosine is not None and self.quality is None
        return stream_to(
            open_job,
            StreamInput(source, text_field, id_field, input_format),
            out_dir,
            settings,
            engine=self._engine(job),
            budget=self.budget,
            device=self.device,
            limits=self.host.block_limits(part_size),
            writes_in_flight=self.host.writes_in_flight,
            resume=resume,
            progress=progress,
            part_size=part_size,
            check_sample=functools.partial(self.check_quality, pooling=job.pooling) if guard_pending else None,
            sample_size=CALIBRATION_TEXTS,
            info=lambda: {
                "dim": dimensions or self.dim,
                "quality": None if self.quality is None else self.quality.as_manifest(),
                "quantization": codec.as_manifest(),
                "backend_choice": self.runtime.backend_choice,
            },
        )

    def job(
        self,
        pooling: Pooling | None = None,
        normalize: bool = False,
        keep_tokens: bool = False,
        long: LongMode = "chunk",
        stride: int | None = None,
        pooled: bool = True,
        prompt_name: str | None = None,
        prompt: str | None = None,
        dimensions: int | None = None,
    ) -> EmbedJob:
        """The prepare/finish job of one embed call (options checked), for front ends that batch windows
        themselves (``memfit serve``). ``pooling=None`` means the model's default pooling (as everywhere in
        the API); ``pooled=False`` pools nothing (token rows only, with ``keep_tokens``). ``prompt_name`` /
        ``prompt`` / ``dimensions``: as for :meth:`embed`."""
        if not pooled and not keep_tokens:
            raise ConfigError("a job that pools nothing must keep the token rows")
        pooling = check_pooling(pooling or self.default_pooling) if pooled else None
        applied = measure_prompt(self.tokenizer, self.runtime.prompts, prompt_name, prompt)
        return EmbedJob(
            self.runtime,
            pooling,
            normalize,
            keep_tokens,
            long,
            resolve_stride(long, stride, self.max_length, self.special, applied),
            prompt=applied,
            dimensions=self.check_dimensions(dimensions),
        )

    def check_dimensions(self, dimensions: int | None) -> int | None:
        """``dimensions`` within the model's width; a model not trained for shortened vectors (its model card
        names no Matryoshka loss) still gets them, with a note once per model."""
        if dimensions is None:
            return None
        if isinstance(dimensions, bool) or not isinstance(dimensions, numbers.Integral):  # NumPy's integers are
            raise ConfigError(f"--dimensions must be a whole number, got {dimensions!r}", field="dimensions")
        if not 1 <= dimensions <= self.dim:
            raise ConfigError(
                f"--dimensions must be between 1 and the model's {self.dim}, got {dimensions}", field="dimensions"
            )
        if not self.runtime.matryoshka and dimensions < self.dim:
            _note_not_matryoshka(self.model_name)
        return int(dimensions)  # a plain int: the manifest is JSON

    def check_quality(self, sample: Sequence[str], pooling: Pooling | None, can_accept: bool = True) -> None:
        """Run the quality guard once per Encoder, on the first texts of the caller's job (``precision.py``).

        ``can_accept``: whether the caller takes a lower ``--min-cosine`` (the refusal offers it only then)."""
        if self.min_cosine is None or self.quality is not None or not sample:
            return
        verdict_key = self._verdict_key(pooling or self.default_pooling)
        cached = cached_pass(verdict_key, self.min_cosine) if verdict_key is not None else None
        if cached is not None:
            log.info("quality guard: %s", cached.describe())
            self.quality = cached
            return
        report = self.measure_quality(sample, pooling, self.min_cosine)
        if report is None:  # the fp32 copy does not fit the budget (warned): the guard is off for this Encoder
            self.min_cosine = None
            return
        if not report.passed and self._fp32_fallback is not None:
            self._fall_back_to_fp32(report)
            return
        enforce(report, can_accept)
        self.quality = report
        if verdict_key is not None:
            remember_pass(verdict_key, report)

    def runs_fp32_after_a_failed_guard(self) -> bool:
        """Whether a failing quality guard means fp32 rather than a refusal: ``dtype=auto`` chose a reduced precision on
        a backend whose fp32 still beats PyTorch's (docs/precision.md). This Encoder loads fp32 itself where it
        loaded its runtime; a host that handed it one (``memfit serve``) loads it again."""
        return self._auto_precision and self.runtime.dtype != "fp32" and self.runtime.backend.retries_fp32

    def _verdict_key(self, pooling: Pooling) -> dict | None:
        """What a pass of the guard holds for when ``dtype=auto`` chose a reduced precision (not int8) at the
        default threshold: what the backend binds a pass to (a compiled graph's cache entry names the model's files
        and the runtime's versions), the precision, the pooling and this CPU. None otherwise: an explicit reduced
        precision, int8 or a threshold of the caller's is measured on every run. The pass stands whether or not this
        Encoder could run fp32 instead (one given a loaded runtime, as classify's embedding mode and ``memfit
        serve`` make it, refuses a failing guard rather than load again): a pass is measured before it is kept."""
        if not self._auto_precision:
            return None
        identity = self.runtime.backend.guard_identity()
        if identity is None:
            return None
        return {
            "backend": f"{self.runtime.backend.name} {identity}",
            "precision": self.runtime.dtype,
            "pooling": pooling,
            "cpu": cpu_identity(),
        }

    def _fall_back_to_fp32(self, report: QualityReport) -> None:
        """``dtype=auto`` picked bf16 on the compiled backend and it failed the guard on the caller's texts: run
        the compiled graph in fp32 instead (still faster than PyTorch fp32, docs/precision.md) rather than
        refuse. The bf16 graph is freed first, so the budget never holds both; the batch budget object that a
        running job holds is updated in place."""
        warn_of_fp32_instead(report)
        load, self._fp32_fallback = self._fp32_fallback, None
        self.runtime = None  # type: ignore[assignment]  # the reduced-precision network goes before the fp32 one loads
        gc.collect()
        runtime = load_runtime(**load)
        self.runtime, self.memory, self.host = runtime, runtime.memory, runtime.host
        self.budget.base = runtime.memory.batch_budget
        if self.budget.guard is not None:  # the same guard object (a running job holds it): the new plan and network
            self.budget.guard.follow(runtime.memory, *runtime.guard_releases())
        self.min_cosine = None  # fp32: nothing left to guard
        self.quality = dataclasses.replace(report, fell_back_to="fp32")

    def measure_quality(self, texts: Sequence[str], pooling: Pooling | None, threshold: float) -> QualityReport | None:
        """This model's pooled embeddings of ``texts`` (truncated) against an fp32 copy's, within the memory
        plan (:func:`memfit.engine.precision.measure_quality`); enforces nothing."""
        runtime = self.runtime
        return measure_quality(
            runtime.engine,
            runtime.fp32_reference(),
            runtime.fp32_copy_bytes(),
            calibration_windows(runtime.tokenizer, runtime.special, runtime.max_length, texts),
            pooling or self.default_pooling,
            threshold,
            precision=precision_name(runtime.dtype, runtime.quantize),
            device=runtime.device,
            memory=self.memory,
            batch_budget=self.budget.current,
            release_buffers=runtime.release_buffers,
        )

    # -- internals --------------------------------------------------------------------------------

    def pooled(self, job: EmbedJob, texts: list[str], progress: bool | None) -> np.ndarray:
        """Run ``job`` over in-memory texts; their pooled vectors, ``[N, d]``, in input order.

        Where the host's memory is not the budget (CUDA), the texts run shortest first in blocks of
        ``HostBudget.in_memory_block_texts``: the next block is tokenized while the GPU runs this one (one block
        of everything left the GPU idle until the whole input was tokenized), and sorting the whole input keeps
        the padding of one global length sort."""
        records: Iterable[Record] = records_from_texts(texts)
        limits = None
        reordered = self.host.in_memory_block_texts is not None
        if reordered:  # elsewhere records stay a stream in input order: no list of them, no second copy of the output
            records = sorted(records, key=lambda record: len(record.text))
            limits = self.host.block_limits(self.host.in_memory_block_texts)
        rows: list[int] = []
        blocks: list[np.ndarray] = []
        for block_records, block in self._run(job, records, progress, len(texts), limits):
            if reordered:
                rows.extend(record.row for record in block_records)
            blocks.append(block.pooled)
        if not blocks:
            return np.zeros((0, self.dim), np.float32)
        pooled = np.concatenate(blocks)
        if not reordered:
            return pooled
        in_order = np.empty_like(pooled)
        in_order[rows] = pooled
        return in_order

    def _engine(self, job: EmbedJob) -> Engine:
        return CurrentRuntimeEngine(lambda: self.runtime, EmbeddingHead(job.pooling, job.keep_tokens))

    def _run(
        self,
        job: EmbedJob,
        records: Iterable[Record],
        progress: bool | None,
        total: int | None,
        limits: BlockLimits | None = None,
    ):
        return run_job(
            job,
            records,
            self._engine(job),
            self.budget,
            self.device,
            limits or self.host.block_limits(),
            progress,
            total,
        )
