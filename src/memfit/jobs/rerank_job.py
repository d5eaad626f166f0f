"""The rerank job: (query, document) relevance from a cross-encoder, for documents of any length.

What ``prepare`` and ``finish`` do, over a :class:`~memfit.engine.runtime.Runtime` loaded for classification;
:class:`~memfit.jobs.rerank.Reranker` builds it, and the stream loop (``runner.py``) and ``memfit serve``
run it.

**Windows.** The query and each document are tokenized once. A document is cut into chunks with the NLI
job's pair machinery (``window_starts`` + ``make_pair_window``): every window is ``query + chunk`` in the
model's pair template (``[CLS] query [SEP] chunk [SEP]`` for BERT), the query repeated whole in each, the
chunks overlapping by ``stride`` tokens (default a quarter of the room the query leaves). A pair that fits
one window is exactly the tokenizer's ``tokenizer(query, document)``, so short inputs score as
sentence-transformers' ``CrossEncoder.predict`` scores them. ``long="truncate"`` keeps the first chunk.

**Score of a long document: the maximum over its windows.** A cross-encoder judges whether a passage
answers the query; a long document is relevant when some passage of it is, however much else it holds,
so its score is that of its best window (MaxP, as in Dai & Callan, SIGIR 2019). A mean would dilute one
relevant passage with every unrelated one, so the score of a document would fall as it grows.

**Scores.** A cross-encoder with one logit: the logit, through a sigmoid unless ``raw`` (as
``CrossEncoder.predict`` and text-embeddings-inference's ``raw_scores``). With two classes (or more, with a
named relevant class): the softmax probability of the relevant class, class 1 unless named; ``raw`` gives
its log-odds, ``logit(p) = l_pos - logsumexp(l_other)`` (``l_1 - l_0`` for two classes), so raw and
normalised scores order documents alike. The maximum over windows is taken on log-odds; as the sigmoid
is increasing, it is the maximum of the scores too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow as pa

from memfit.data.chunking import (
    LongMode,
    Window,
    check_long_mode,
    check_stride_type,
    default_stride,
    make_pair_window,
    truncated_count,
    window_starts,
)
from memfit.data.sources import Record
from memfit.data.tokenization import check_unicode, tokenize_texts
from memfit.engine.batches import Head
from memfit.engine.models import is_pooled_classifier
from memfit.engine.runtime import Runtime
from memfit.errors import ConfigError, InputError
from memfit.io.sinks import ids_array
from memfit.jobs.classify_scores import logits_head, sigmoid
from memfit.jobs.runner import Counts, PreparedBlock


def relevance_class(config, positive_label: str | None = None) -> int | None:
    """Which output of a cross-encoder means "relevant": None for a one-logit model (the logit itself),
    else a class index (class 1 of two, unless ``positive_label`` names another).

    Raises :class:`ConfigError` for a model that is not a sequence classifier (an embedding model), and for
    one with more than two classes when no class is named."""
    architectures = list(getattr(config, "architectures", None) or [])
    if not (any(a.endswith("ForSequenceClassification") for a in architectures) or is_pooled_classifier(config)):
        raise ConfigError(
            f"this model is not a cross-encoder (architectures: {architectures or 'none'}): reranking needs a "
            "sequence-classification model that reads a (query, document) pair, with one relevance logit or "
            "two classes (e.g. a sentence-transformers CrossEncoder, or memfit train on text pairs)"
        )
    n = int(config.num_labels)
    names = [str(config.id2label[i]) for i in range(n)]
    if positive_label is not None:
        if n == 1:
            raise ConfigError(
                f"this cross-encoder has one relevance logit and no classes to choose from; "
                f"drop the relevant-class name ({positive_label!r})"
            )
        if positive_label not in names:
            raise ConfigError(f"relevant class {positive_label!r} is not one of the model's classes {names}")
        return names.index(positive_label)
    if n == 1:
        return None
    if n == 2:
        return 1
    raise ConfigError(
        f"this model has {n} classes {names}; a reranker has one relevance logit or two classes: "
        "name the class that means relevant (positive_label, --positive-label)"
    )


def log_odds(logits: np.ndarray, positive: int | None) -> np.ndarray:
    """Per-row relevance log-odds ``(n,)`` float64 from logits ``(n, classes)`` (see the module docstring)."""
    logits = np.asarray(logits, dtype=np.float64)
    if positive is None:
        return logits[:, 0]
    others = np.delete(logits, positive, axis=1)
    top = others.max(axis=1)
    return logits[:, positive] - (top + np.log(np.exp(others - top[:, None]).sum(axis=1)))


@dataclass
class RerankBlock:
    """One block's relevance scores, one per (query, document) record, and counts for the manifest."""

    scores: np.ndarray  # (n,) float32
    counts: Counts


class RerankJob:
    """(query, document chunk) windows per block (prepare); the best window's score per document (finish).

    ``query``: one query for every record (``rank``), or None to take each record's own query from its
    ``text_pair`` (a file of pairs, ``score``). ``query_field`` names that field in messages."""

    inputs_key = "pairs"
    head: Head = staticmethod(logits_head)

    def __init__(
        self,
        runtime: Runtime,
        positive: int | None,
        query: str | None,
        long: LongMode,
        stride: int | None,
        raw: bool,
        query_field: str = "query",
        source: str = "pairs",
    ):
        check_long_mode(long)
        self.runtime = runtime
        self.positive = positive
        self.long = long
        self.raw = raw
        self.query_field = query_field
        self.source = source  # where records' own queries come from, for their errors: a file, <stdin>, "pairs"
        # pair content: what the pair template's special tokens leave of a window; a query may take half
        self.content = runtime.max_length - runtime.special.pair_overhead
        self.max_query_tokens = self.content // 2
        if self.max_query_tokens < 1:
            raise ConfigError(f"max_length {runtime.max_length} leaves no room for a query and a document")
        check_stride_type(stride)
        self.stride = stride
        if long == "chunk" and stride is not None and not 0 <= stride < self.content - self.max_query_tokens:
            raise ConfigError(
                f"stride must be between 0 and {self.content - self.max_query_tokens - 1} for "
                f"max_length {runtime.max_length} (a query may take half the window), got {stride}"
            )
        self.query = query
        self.query_ids = None
        if query is not None:
            check_unicode(query, "query", "query")
            # tokenized only as far as a refusal needs: a query of a megabyte is refused after its first tokens
            self.query_ids = self._query_ids(self._tokenize([query], max_tokens=self.max_query_tokens + 1)[0], query)

    def prepare(self, records: Sequence[Record]) -> PreparedBlock:
        rt = self.runtime
        documents = self._tokenize([r.text for r in records])
        if self.query_ids is not None:
            queries = [self.query_ids] * len(records)
        else:
            missing = next((r for r in records if r.text_pair is None), None)
            if missing is not None:
                raise InputError(self.source, f"record {missing.id} has no query", missing.line, self.query_field)
            tokenized = self._tokenize([r.text_pair for r in records])
            queries = [self._query_ids(ids, r) for ids, r in zip(tokenized, records)]
        windows: list[Window] = []
        for item, (query, document) in enumerate(zip(queries, documents)):
            room = self.content - len(query)
            stride = default_stride(room) if self.stride is None else self.stride
            starts = [0] if self.long == "truncate" else window_starts(len(document), room, stride)
            for index, start in enumerate(starts):
                window = make_pair_window(item, query, document[start : start + room], rt.special, rt.max_length)
                if index or not rt.uses_token_types:
                    types = window.token_type_ids if rt.uses_token_types else None
                    window = dataclasses.replace(window, index=index, token_type_ids=types)
                windows.append(window)
        # a document is cut when it and its query overflow the window's content
        pair_lengths = (len(query) + len(document) for query, document in zip(queries, documents))
        return PreparedBlock(windows=windows, context=truncated_count(pair_lengths, self.long, self.content))

    def finish(self, records: Sequence[Record], prepared: PreparedBlock, outputs: list) -> RerankBlock:
        per_window = log_odds(np.stack(outputs), self.positive) if outputs else np.zeros(0)
        best = np.full(len(records), -np.inf)
        np.maximum.at(best, np.asarray([w.item for w in prepared.windows], dtype=np.int64), per_window)
        scores = best if self.raw else sigmoid(best)
        return RerankBlock(
            scores=scores.astype(np.float32), counts=Counts.of_block(records, prepared.windows, prepared.context)
        )

    def table(self, records: Sequence[Record], block: RerankBlock) -> pa.Table:
        """One part: ``id`` and ``score`` per (query, document), in input order."""
        return pa.table({"id": ids_array([r.id for r in records]), "score": pa.array(block.scores, pa.float32())})

    def end_part(self) -> None:
        return None

    # -- internals --------------------------------------------------------------------------------

    def _tokenize(self, texts: list[str], max_tokens: int | None = None) -> list[np.ndarray]:
        return [t.ids for t in tokenize_texts(self.runtime.tokenizer, texts, max_tokens=max_tokens, offsets=False)]

    def _query_ids(self, ids: np.ndarray, origin: Record | str) -> np.ndarray:
        """The query's ids, refused when it would leave a document chunk less than half the window. The one query
        of a ``rank`` (``origin`` a string) is tokenized only to a few tokens past the limit, hence "more than"."""
        if len(ids) <= self.max_query_tokens:
            return ids
        count = f"more than {self.max_query_tokens}" if isinstance(origin, str) else str(len(ids))
        why = (
            f"has {count} tokens; at most {self.max_query_tokens} fit (half of max_length "
            f"{self.runtime.max_length} less the special tokens), so that each window keeps room for "
            "the document: shorten the query or raise --max-length"
        )
        if isinstance(origin, str):
            raise ConfigError(f"the query {why}")
        raise InputError(self.source, f"record {origin.id}: the query {why}", origin.line, self.query_field)
