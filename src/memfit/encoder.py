"""The embed job: :class:`Encoder` wires the stages together for pooled and token-level embeddings.

sources → chunking → planner → engine → pooling → sinks. The Encoder owns a loaded model, its
tokenizer, its window size and a memory plan; each call builds an :class:`EmbedJob` for the shared
streaming loop in ``runner.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Sequence

import numpy as np
import pyarrow as pa

from memfit.chunking import (
    LONG_MODES,
    LongMode,
    SpecialTokens,
    TokenizedText,
    Window,
    check_window_options,
    default_stride,
    make_windows,
    merged_token_rows,
    tokenize_texts,
)
from memfit.engine import AdaptiveBudget, TorchEngine
from memfit.errors import ConfigError
from memfit.fingerprint import input_fingerprint
from memfit.host_budget import HostBudget, fitted_to_plan, host_budget
from memfit.memory import MemoryPlan, device_memory, plan_memory, resolve_budget_bytes
from memfit.models import (
    load_tokenizer,
    read_sentence_transformer_defaults,
    resolve_device,
    resolve_max_length,
    resolve_model_name,
)
from memfit.pooling import EmbeddingHead, Pooling, check_pooling, l2_normalize, merge_pooled, merge_tokens
from memfit.precision import (
    CALIBRATION_TEXTS,
    QualityReport,
    default_min_cosine,
    enforce,
    load_precision_model,
    measure_quality,
    resolve_precision,
)
from memfit.preflight import check_options, check_output_dir
from memfit.runner import (
    BlockLimits,
    PreparedBlock,
    Progress,
    records_from_texts,
    run_job,
    source_label,
    source_records,
)
from memfit.sinks import BackgroundWriter, PartWriter, ids_array, vectors_array
from memfit.token_table import TokenFile, TokenPieces, TokenStream
from memfit.sources import Record, estimate_rows, read_records

log = logging.getLogger("memfit")

OutputDtype = Literal["float32", "float16"]
_ARROW_OUTPUT = {"float32": pa.float32(), "float16": pa.float16()}


@dataclass(frozen=True, slots=True)
class TokenEmbedding:
    """Token-level output for one text: one row per token, no padding, in text order."""

    token_ids: np.ndarray  # (n,) int64
    offsets: np.ndarray  # (n, 2) int32 character [start, end); (0, 0) for special tokens
    embeddings: np.ndarray  # (n, d) float32
    special_mask: np.ndarray  # (n,) bool, True for the model's special tokens ([CLS], [SEP], …)


@dataclass
class EmbedBlock:
    """One block's merged results, in record order."""

    pooled: np.ndarray | None  # (n, d) float32
    tokens: list[TokenEmbedding] | None
    counts: dict[str, int]


def _memfit_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("memfit")
    except PackageNotFoundError:
        return "0.0.0+unknown"


class Encoder:
    """A BERT-family encoder that embeds texts of any number and length within a memory budget.

    ``model``: ``None`` for the bundled all-MiniLM-L6-v2, a local directory or a Hugging Face hub id.
    ``device``: ``auto`` (CUDA when present), ``cpu``, ``cuda``, ``cuda:1``.
    ``dtype``: ``auto`` (bf16 where the hardware runs it fast, else fp32), ``fp32``, ``bf16``, ``fp16``.
    ``max_length``: window size in tokens, special tokens included (default: the model's
    sentence-transformers ``max_seq_length``, else its position limit).
    ``memory_budget``: "4GiB", "500MB", "80%" or bytes; default 90% of free device memory.
    ``quantize``: ``none`` or ``int8`` (see ``precision.py``).
    ``min_cosine``: the quality guard's threshold for reduced precision (default 0.999 for bf16/fp16,
    0.99 for int8); ``quality_check=False`` skips the guard. The guard runs once, on the first call's texts.
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
    ):
        from transformers import AutoModel

        self.model_name = resolve_model_name(model)
        self.device = resolve_device(device)
        self.dtype, self.quantize = resolve_precision(dtype, quantize, self.device)
        self.tokenizer = load_tokenizer(self.model_name)
        self.model = load_precision_model(self.model_name, AutoModel, self.device, self.dtype, self.quantize)
        default_threshold = default_min_cosine(self.dtype, self.quantize)
        # None: fp32 (nothing to guard) or the user opted out
        self.min_cosine = None if not quality_check or default_threshold is None else (
            default_threshold if min_cosine is None else min_cosine)
        self.quality: QualityReport | None = None
        st_defaults = read_sentence_transformer_defaults(self.model_name)
        self.default_pooling: Pooling = check_pooling(st_defaults.pooling or "mean")
        self.max_length = resolve_max_length(max_length, self.model.config, self.tokenizer, st_defaults)
        self.special = SpecialTokens.from_tokenizer(self.tokenizer)
        self.dim = int(self.model.config.hidden_size)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        budget_bytes = resolve_budget_bytes(memory_budget, device_memory(self.device))
        self.host: HostBudget = host_budget(budget_bytes, self.device)
        # token rows are copied out as float32: count them as in-flight output per token
        self.memory: MemoryPlan = plan_memory(self.model, self.device, budget_bytes,
                                              output_bytes_per_token=4 * self.dim,
                                              reserved_bytes=self.host.reserved_bytes)
        self.host = fitted_to_plan(self.host, self.memory)
        self.budget = AdaptiveBudget(self.memory.batch_budget)
        log.info("model %s on %s in %s%s, window %d tokens", self.model_name, self.device, self.dtype,
                 " + int8" if self.quantize == "int8" else "", self.max_length)
        log.info(self.memory.describe())

    # -- public API -------------------------------------------------------------------------------

    def embed(
        self,
        texts: Iterable[str],
        pooling: Pooling | None = None,
        normalize: bool = False,
        long: LongMode = "chunk",
        stride: int | None = None,
        progress: bool | None = False,
    ) -> np.ndarray:
        """Pooled embeddings ``[N, d]`` float32, in input order."""
        texts = list(texts)
        job = self._job(pooling or self.default_pooling, normalize, keep_tokens=False, long=long, stride=stride)
        self._check_quality(texts[:CALIBRATION_TEXTS], job.pooling)
        blocks = [b.pooled for _, b in self._run(job, records_from_texts(texts), progress, len(texts))]
        return np.concatenate(blocks) if blocks else np.zeros((0, self.dim), np.float32)

    def embed_tokens(
        self,
        texts: Iterable[str],
        drop_special: bool = False,
        long: LongMode = "chunk",
        stride: int | None = None,
        progress: bool | None = False,
    ) -> list[TokenEmbedding]:
        """Token-level embeddings per text: ids, character offsets and an ``[n_tokens, d]`` array.

        With ``long="chunk"`` (default) every token of a long text gets exactly one vector, from the
        window in which it sits most centrally. ``drop_special`` removes [CLS]/[SEP]-like rows.
        """
        texts = list(texts)
        job = self._job(None, False, keep_tokens=True, long=long, stride=stride)
        self._check_quality(texts[:CALIBRATION_TEXTS], self.default_pooling)
        out: list[TokenEmbedding] = []
        for _, block in self._run(job, records_from_texts(texts), progress, len(texts)):
            out.extend(block.tokens)
        if drop_special:
            out = [_without_specials(t) for t in out]
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
        block_texts: int | None = None,
    ) -> dict[str, Any]:
        """Stream embeddings of ``source`` to ``out_dir`` (Parquet parts + manifest.json).

        ``source``: a file path (txt, jsonl, csv, tsv, parquet), ``"-"`` for stdin, or an iterable of
        strings. Memory does not grow with the number of texts. With ``resume=True`` an interrupted run
        continues after its last complete part. Returns the manifest.
        """
        pooling = pooling or self.default_pooling
        if output_dtype not in _ARROW_OUTPUT:
            raise ConfigError(f"unknown output dtype {output_dtype!r}; choose float32 or float16")
        job = self._job(pooling, normalize, keep_tokens=tokens, long=long, stride=stride)
        from_file = isinstance(source, (str, os.PathLike))
        settings = {
            "job": "embed",
            "model": self.model_name,
            "pooling": pooling,
            "normalize": normalize,
            "tokens": tokens,
            "dtype": self.dtype,
            "quantize": self.quantize,
            "max_length": self.max_length,
            "long": long,
            "stride": job.stride,
            "output_dtype": output_dtype,
            "input": source_label(source),
            "text_field": text_field,
            "id_field": id_field,
        }
        # Before anything is created in out_dir: fail on an unusable output directory, an unreadable file
        # or a missing field, and run the quality guard on the first records.
        check_options(part_size=block_texts)
        check_output_dir(out_dir, resume)
        guard_pending = self.min_cosine is not None and self.quality is None
        if from_file and os.fspath(source) != "-":
            head = itertools.islice(read_records(os.fspath(source), text_field=text_field, id_field=id_field,
                                                 input_format=input_format), CALIBRATION_TEXTS if guard_pending else 1)
            self._check_quality([r.text for r in head], pooling)
        elif not from_file and guard_pending:
            source = iter(source)
            sample = list(itertools.islice(source, CALIBRATION_TEXTS))
            source = itertools.chain(sample, source)
            self._check_quality([r.text for r in records_from_texts(sample)], pooling)
        writer = PartWriter(out_dir, settings, resume=resume, input_fingerprint=input_fingerprint(source))
        if writer.complete:
            return writer.manifest
        writer.update_info(memfit_version=_memfit_version(), dim=self.dim, device=str(self.device))
        total = None
        if from_file and Progress.shown(progress):
            total = estimate_rows(os.fspath(source), input_format)
            total = None if total is None else max(0, total - writer.rows_done)
        records = source_records(source, text_field, id_field, input_format, skip=writer.rows_done)
        if self.min_cosine is not None and self.quality is None:  # stdin: sample the stream itself
            sample_records = list(itertools.islice(records, CALIBRATION_TEXTS))
            records = itertools.chain(sample_records, records)
            self._check_quality([r.text for r in sample_records], pooling)
        writer.update_info(quality=None if self.quality is None else self.quality.as_manifest())
        value_type = _ARROW_OUTPUT[output_dtype]
        limits = self.host.block_limits(block_texts)
        # Parquet encoding and compression run in a writer thread whose queue is bounded, so the device
        # is not idle while a part is written and results cannot pile up faster than the disk takes them.
        with BackgroundWriter(self.host.writes_in_flight) as background:
            tokens_out = None
            if tokens:
                tokens_out = TokenStream(writer.dir, writer.next_part_index, background,
                                         TokenPieces(value_type, self.host.piece_bytes))
            job = dataclasses.replace(job, tokens_out=tokens_out)
            for records_block, result in self._run(job, records, progress, total, limits):
                token_file = None if tokens_out is None else tokens_out.end_part()
                background.submit(_commit_part, writer, _embed_table(records_block, result, value_type),
                                  result.counts, token_file)
        writer.finish()
        return writer.manifest

    # -- internals --------------------------------------------------------------------------------

    def _check_quality(self, sample: Sequence[str], pooling: Pooling) -> None:
        """Run the quality guard once per Encoder, on the first call's texts (see ``precision.py``)."""
        if self.min_cosine is None or self.quality is not None or not sample:
            return
        report = measure_quality(self, sample, pooling, self.min_cosine)
        if report is None:  # the fp32 copy does not fit the budget (warned): the guard is off for this Encoder
            self.min_cosine = None
            return
        enforce(report)
        self.quality = report

    def _job(self, pooling: Pooling | None, normalize: bool, keep_tokens: bool, long: LongMode,
             stride: int | None) -> "EmbedJob":
        if long not in LONG_MODES:
            raise ConfigError(f"unknown long-text mode {long!r}; choose truncate or chunk")
        if pooling is not None:
            check_pooling(pooling)
        stride = default_stride(self.max_length) if stride is None else stride
        check_window_options(self.max_length, self.special, stride)
        return EmbedJob(self, pooling, normalize, keep_tokens, long, stride)

    def _run(self, job: "EmbedJob", records: Iterable[Record], progress: bool | None, total: int | None,
             limits: BlockLimits | None = None):
        limits = limits or self.host.block_limits()
        engine = TorchEngine(self.model, self.device, self.pad_token_id,
                             EmbeddingHead(job.pooling, job.keep_tokens))
        return run_job(job, records, engine, self.budget, self.device, limits, progress, total)


@dataclass(frozen=True)
class EmbedJob:
    """Tokenize + window a block (prepare), then merge window results per text (finish).

    With ``tokens_out`` the token rows are streamed to the output's token table batch by batch (the
    block's results keep only the pooled parts); without it, :meth:`finish` merges them per text in
    memory (for :meth:`Encoder.embed_tokens`, whose caller asked for them in memory).
    """

    encoder: Encoder
    pooling: Pooling | None
    normalize: bool
    keep_tokens: bool
    long: LongMode
    stride: int
    tokens_out: TokenStream | None = None

    def prepare(self, records: Sequence[Record]) -> PreparedBlock:
        enc = self.encoder
        tokenized = tokenize_texts(enc.tokenizer, [r.text for r in records])
        windows = [
            window
            for item, tokens in enumerate(tokenized)
            for window in make_windows(item, tokens, enc.special, enc.max_length, self.long, self.stride)
        ]
        keep = None
        if self.tokens_out is not None:
            keep = functools.partial(self._stream_tokens, self._token_keys(records, tokenized, windows))
        return PreparedBlock(windows=windows, context=tokenized, keep=keep)

    def finish(self, records: Sequence[Record], prepared: PreparedBlock, outputs: list) -> EmbedBlock:
        per_text: list[list] = [[] for _ in records]
        for window, output in zip(prepared.windows, outputs):
            per_text[window.item].append(output)
        pooled = None
        if self.pooling is not None:
            pooled = np.stack([merge_pooled(parts, self.pooling) for parts in per_text])
            if self.normalize:
                pooled = l2_normalize(pooled)
        tokens = None
        tokenized: list[TokenizedText] = prepared.context
        if self.keep_tokens and self.tokens_out is None:
            tokens = [self._token_embedding(t, parts) for t, parts in zip(tokenized, per_text)]
        counts = {
            "texts": len(records),
            "empty_texts": sum(1 for r in records if not r.text.strip()),
            "windows": len(prepared.windows),
            "tokens": sum(len(w) for w in prepared.windows),
            "truncated_texts": sum(1 for t in tokenized
                                   if self.long == "truncate"
                                   and len(t.ids) > self.encoder.max_length - self.encoder.special.single_overhead),
        }
        return EmbedBlock(pooled=pooled, tokens=tokens, counts=counts)

    def _token_rows(self, tokens: TokenizedText) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The ids, character offsets and special-token flags of a text's merged token sequence."""
        enc = self.encoder
        ids, offsets = merged_token_rows(tokens, enc.special, self.long, enc.max_length)
        special = np.zeros(len(ids), dtype=bool)
        special[: len(enc.special.prefix)] = True
        special[len(ids) - len(enc.special.suffix):] = True
        return ids, offsets, special

    def _token_embedding(self, tokens: TokenizedText, parts: list) -> TokenEmbedding:
        ids, offsets, special = self._token_rows(tokens)
        rows = merge_tokens(parts)
        if len(rows) != len(ids):
            raise AssertionError(f"merged {len(rows)} token rows for {len(ids)} tokens; this is a bug")
        return TokenEmbedding(token_ids=ids, offsets=offsets, embeddings=rows, special_mask=special)

    def _token_keys(self, records: Sequence[Record], tokenized: list[TokenizedText],
                    windows: list[Window]) -> dict[tuple[int, int], tuple]:
        """Per window ``(item, index)``: its text's input row, the merged position of its first owned
        row, and its text's merged ids / offsets / special flags (shared by the text's windows)."""
        rows = [self._token_rows(t) for t in tokenized]
        next_position = [0] * len(records)
        keys = {}
        for w in windows:  # a text's windows come in order and own consecutive runs of its tokens
            keys[(w.item, w.index)] = (records[w.item].row, next_position[w.item], rows[w.item])
            next_position[w.item] += w.own_end - w.own_start
        for item, (ids, _, _) in enumerate(rows):
            if next_position[item] != len(ids):
                raise AssertionError(f"windows own {next_position[item]} of {len(ids)} tokens; this is a bug")
        return keys

    def _stream_tokens(self, keys: dict, windows: Sequence[Window], outputs: list) -> list:
        """Send a batch's owned token rows to the token table; keep only what pooling needs."""
        for window, output in zip(windows, outputs):
            row, position, (ids, offsets, special) = keys[(window.item, window.index)]
            end = position + output.owned_count
            self.tokens_out.add(row, position, ids[position:end], offsets[position:end], special[position:end],
                                output.tokens)
        return [dataclasses.replace(output, tokens=None) for output in outputs]


def _without_specials(t: TokenEmbedding) -> TokenEmbedding:
    keep = ~t.special_mask
    return TokenEmbedding(t.token_ids[keep], t.offsets[keep], t.embeddings[keep], t.special_mask[keep])


def _embed_table(records: Sequence[Record], block: EmbedBlock, value_type: pa.DataType) -> pa.Table:
    return pa.table({
        "id": ids_array([r.id for r in records]),
        "embedding": vectors_array(block.pooled.astype(value_type.to_pandas_dtype()), value_type),
    })


def _commit_part(writer: PartWriter, table: pa.Table, counts: dict[str, int], token_file: TokenFile | None) -> None:
    """Writer-thread task: put a block's token file and then its pooled part in place, then list both."""
    writer.write_part(table, counts, tokens=None if token_file is None else token_file.commit())
