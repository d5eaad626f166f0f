"""The rerank job's public face: :class:`Reranker` scores (query, document) pairs with a cross-encoder.

``rank(query, documents)`` orders documents by relevance to one query, ``score(pairs)`` scores pairs in
input order, and ``rerank_to`` streams the scores of a file (one query and a file of documents, or a file
of pairs) to Parquet with the budget and ``resume`` of every job. The windows and scores are those of
:class:`~memfit.jobs.rerank_job.RerankJob` (long documents: the maximum over windows, see there).
"""

from __future__ import annotations

import logging
import numbers
import os
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from memfit.data.chunking import LongMode
from memfit.data.sources import Record, display_name
from memfit.engine.batches import Engine
from memfit.engine.models import resolve_model_name
from memfit.jobs.hosted import RuntimeHost
from memfit.engine.runtime import Runtime, load_runtime, model_config
from memfit.errors import ConfigError
from memfit.jobs.rerank_job import RerankJob, relevance_class
from memfit.jobs.runner import Manifest, StreamInput, records_from_texts, run_job, stream_to, text_list

log = logging.getLogger("memfit")

__all__ = ["RankedDocument", "Reranker"]


@dataclass(frozen=True, slots=True)
class RankedDocument:
    """One document of a ranking: its position in the caller's list and its relevance score."""

    index: int
    score: float


class Reranker(RuntimeHost):
    """Relevance of documents of any length to queries, by a cross-encoder, within a memory budget.

    ``model``: a local directory or hub id of a sequence-classification cross-encoder (one relevance logit,
    as sentence-transformers' ``CrossEncoder`` models, or two classes, as a ``memfit train`` pair
    classifier); a model that is not one is refused (:class:`~memfit.ConfigError`) before its weights load.
    ``positive_label``: the class that means relevant, for a model whose relevant class is not class 1 of
    two (or that has more classes). ``device``, ``dtype``, ``max_length``, ``memory_budget``, ``backend`` and
    ``offload`` are as for :class:`~memfit.Classifier` (the default window is the tokenizer's ``model_max_length``).
    ``runtime``: an already loaded :class:`~memfit.engine.runtime.Runtime` (the loading arguments are then
    unused; it must be loaded for classification).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        device: str = "auto",
        dtype: str = "auto",
        max_length: int | None = None,
        memory_budget: str | int | None = None,
        positive_label: str | None = None,
        *,
        backend: str = "auto",
        offload: str = "auto",
        runtime: Runtime | None = None,
    ):
        if runtime is None:
            name = resolve_model_name(model)
            self.positive = relevance_class(model_config(name, backend), positive_label)
            runtime = load_runtime(
                name,
                device=device,
                dtype=dtype,
                memory_budget=memory_budget,
                max_length=max_length,
                task="classification",
                backend=backend,
                offload=offload,
            )
        else:
            self.positive = relevance_class(runtime.config, positive_label)
            if runtime.task != "classification":
                raise ConfigError(f"a Reranker needs a runtime loaded for classification, not for {runtime.task}")
        self.runtime = runtime
        self.positive_label = positive_label
        # per Reranker (never shared between runs): the OOM-adaptive budget
        self.budget = runtime.adaptive_budget()

    # -- public API -------------------------------------------------------------------------------

    def rank(
        self,
        query: str,
        documents: Iterable[str],
        top_n: int | None = None,
        long: LongMode = "chunk",
        stride: int | None = None,
        raw: bool = False,
        progress: bool | None = False,
    ) -> list[RankedDocument]:
        """``documents`` best first (ties: the earlier document first), the first ``top_n`` of them (all by
        default). Scores as :meth:`score` gives them."""
        if not isinstance(query, str):
            raise ConfigError(f"query must be a string, got {type(query).__name__}")
        check_top_n(top_n)
        documents = text_list(documents, "documents")
        job = self.job(query=query, long=long, stride=stride, raw=raw)
        scores = self._scores(job, records_from_texts(documents), len(documents), progress)
        return [RankedDocument(int(i), float(scores[i])) for i in ranking(scores, top_n)]

    def score(
        self,
        pairs: Iterable[Sequence[str]],
        long: LongMode = "chunk",
        stride: int | None = None,
        raw: bool = False,
        progress: bool | None = False,
    ) -> np.ndarray:
        """Relevance of each ``(query, document)`` pair, ``(N,)`` float32 in input order: a probability (the
        sigmoid of a one-logit model, the softmax of the relevant class), or with ``raw`` its log-odds."""
        records = [_pair_record(i, pair) for i, pair in enumerate(pairs)]
        job = self.job(long=long, stride=stride, raw=raw)
        return self._scores(job, iter(records), len(records), progress)

    def rerank_to(
        self,
        source: str | os.PathLike | Iterable[str],
        out_dir: str | os.PathLike,
        query: str | None = None,
        query_field: str = "query",
        document_field: str = "text",
        id_field: str | None = None,
        input_format: str | None = None,
        long: LongMode = "chunk",
        stride: int | None = None,
        raw: bool = False,
        resume: bool = False,
        progress: bool | None = None,
        part_size: int | None = None,
    ) -> Manifest:
        """Stream the scores of ``source`` to ``out_dir`` (Parquet parts + manifest.json): with ``query``,
        every document of ``source`` against it; without, each record's own pair (``query_field``,
        ``document_field``). Columns: ``id`` and ``score`` (float32), in input order. ``source``, ``resume``
        and ``part_size`` work as in :meth:`memfit.Encoder.embed_to`. Returns the manifest."""
        if query is None and not isinstance(source, (str, os.PathLike)):
            raise ConfigError("pairs come from a file (query and document fields); for in-memory pairs use score()")
        # records' own queries come from a file (checked above), which their errors name
        where = display_name(os.fspath(source)) if query is None else "pairs"
        job = self.job(query=query, long=long, stride=stride, raw=raw, query_field=query_field, source=where)
        settings = {
            "job": "rerank",
            "model": self.model_name,
            "query": query,
            "positive_label": self.positive_label,
            "raw_scores": raw,
            "dtype": self.dtype,
            "backend": self.runtime.backend.name,
            "max_length": self.max_length,
            "long": long,
            "stride": stride,
        }
        stream = StreamInput(
            source, document_field, id_field, input_format, pair_field=None if query is not None else query_field
        )
        return stream_to(
            lambda writer, background: job,
            stream,
            out_dir,
            settings,
            engine=self._engine(job),
            budget=self.budget,
            device=self.device,
            limits=self.runtime.host.block_limits(part_size),
            writes_in_flight=self.runtime.host.writes_in_flight,
            resume=resume,
            progress=progress,
            part_size=part_size,
            info=lambda: {"backend_choice": self.runtime.backend_choice},
        )

    def job(
        self,
        query: str | None = None,
        long: LongMode = "chunk",
        stride: int | None = None,
        raw: bool = False,
        query_field: str = "query",
        source: str = "pairs",
    ) -> RerankJob:
        """The prepare/finish job of one rerank call (options checked), for front ends that batch windows
        themselves (``memfit serve``): one ``query`` for every document, or None for records' own queries
        (``source``: where those records come from, named in their errors)."""
        return RerankJob(self.runtime, self.positive, query, long, stride, raw, query_field, source)

    # -- internals --------------------------------------------------------------------------------

    def _engine(self, job: RerankJob) -> Engine:
        return self.runtime.engine(job.head)

    def _scores(self, job: RerankJob, records: Iterable[Record], total: int, progress: bool | None) -> np.ndarray:
        blocks = [
            block.scores
            for _, block in run_job(
                job,
                records,
                self._engine(job),
                self.budget,
                self.device,
                self.runtime.host.block_limits(),
                progress,
                total,
            )
        ]
        return np.concatenate(blocks) if blocks else np.zeros(0, np.float32)


def check_top_n(top_n: int | None) -> None:
    """``top_n`` is None (every document) or a positive whole number."""
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, numbers.Integral) or top_n < 1):
        raise ConfigError(f"top_n must be a positive whole number, got {top_n!r}")


def ranking(scores: np.ndarray, top_n: int | None = None) -> list[int]:
    """Indices of ``scores`` best first, ties in input order, the first ``top_n`` (all when None)."""
    order = np.lexsort((np.arange(len(scores)), -np.asarray(scores, dtype=np.float64)))
    return [int(i) for i in order[:top_n]]


def _pair_record(index: int, pair: Any) -> Record:
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(isinstance(text, str) for text in pair):
        raise ConfigError(f"pairs[{index}] must be a (query, document) pair of strings, got {pair!r:.80}")
    return Record(row=index, id=index, text=pair[1], line=index + 1, text_pair=pair[0])
