"""The classify jobs: what ``prepare`` and ``finish`` do in each mode, over a :class:`~memfit.engine.runtime.Runtime`.

- :class:`NliJob`: (text window, hypothesis) pairs per block; entailment logits → pipeline scores.
- :class:`SupervisedJob`: each text's windows through a trained classifier; mean class probabilities.
- :class:`EmbeddingJob`: the embed job's windows and pooling; cosines to label embeddings → scores.

The stream loop (``runner.py``) and ``memfit serve`` run them; ``classify.py`` builds them.
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
    resolve_stride,
    tokenize_texts,
    truncated_count,
    window_starts,
    window_texts,
)
from memfit.jobs.classify_scores import (
    class_activation,
    classify_table,
    embedding_scores,
    entailment_ids,
    logits_head,
    nli_scores,
    quoted,
    sigmoid,
    softmax_rows,
)
from memfit.jobs.embed_job import EmbedJob
from memfit.engine.batches import Head
from memfit.errors import ConfigError
from memfit.engine.pooling import EmbeddingHead
from memfit.jobs.runner import Counts, PreparedBlock
from memfit.engine.runtime import Runtime
from memfit.data.sources import Record


@dataclass
class ClassifyBlock:
    """One block's scores, ``(texts, labels)`` in the caller's label order, plus counts for the manifest."""

    scores: np.ndarray  # (n, k) float32
    counts: Counts


class _ClassifyOutput:
    """What every classify job writes: one part of ids, labels best first and scores; no side file."""

    labels: list[str]
    inputs_key: str | None = "windows"

    def table(self, records: Sequence[Record], block: ClassifyBlock) -> pa.Table:
        return classify_table(records, self.labels, block.scores)

    def end_part(self) -> None:
        return None


class NliJob(_ClassifyOutput):
    """Build (text window, hypothesis) pairs per block (prepare); turn their logits into scores (finish)."""

    inputs_key = "pairs"
    head: Head = staticmethod(logits_head)

    def __init__(
        self, runtime: Runtime, labels: list[str], template: str, multi_label: bool, long: LongMode, stride: int | None
    ):
        check_long_mode(long)
        self.runtime = runtime
        self.labels = labels
        self.long = long
        self.entailment_id, self.contradiction_id = entailment_ids(runtime.config)
        self.independent = multi_label or len(labels) == 1  # the pipeline's rule
        if self.independent and self.contradiction_id is None:
            raise ConfigError(
                "multi-label (or single-label) NLI scores need a contradiction class in the model config "
                f"(label2id: {dict(runtime.config.label2id)})"
            )
        hypotheses = [template.format(label) for label in labels]
        self.hypothesis_ids = [t.ids for t in tokenize_texts(runtime.tokenizer, hypotheses, offsets=False)]
        # premise tokens per window, per label: what the hypothesis and special tokens leave free
        self.room = [runtime.max_length - runtime.special.pair_overhead - len(h) for h in self.hypothesis_ids]
        too_long = [label for label, room in zip(labels, self.room) if room < 1]
        if too_long:
            raise ConfigError(
                f"the hypothesis for label {quoted(too_long[0])} leaves no room for the text in "
                f"max_length {runtime.max_length}; use a shorter template or label"
            )
        self.stride = None
        check_stride_type(stride)
        if long == "chunk":
            self.stride = default_stride(min(self.room)) if stride is None else stride
            if not 0 <= self.stride < min(self.room):
                raise ConfigError(
                    f"stride must be between 0 and {min(self.room) - 1} for these labels and "
                    f"max_length {runtime.max_length}, got {self.stride}"
                )

    def prepare(self, records: Sequence[Record]) -> PreparedBlock:
        rt = self.runtime
        # truncating, a premise needs at most a window's tokens (and one more, to count it as truncated)
        head = rt.max_length + 1 if self.long == "truncate" else None
        tokenized = tokenize_texts(
            rt.tokenizer,
            [r.text for r in records],
            max_tokens=head,
            call_chars=rt.host.tokenize_call_chars,
            offsets=False,
        )
        windows: list[Window] = []
        label_of: list[int] = []
        for item, text in enumerate(tokenized):
            for label, (hypothesis, room) in enumerate(zip(self.hypothesis_ids, self.room)):
                starts = [0] if self.long == "truncate" else window_starts(len(text.ids), room, self.stride)
                for index, start in enumerate(starts):
                    window = make_pair_window(item, text.ids[start:], hypothesis, rt.special, rt.max_length)
                    if index or not rt.uses_token_types:
                        types = window.token_type_ids if rt.uses_token_types else None
                        window = dataclasses.replace(window, index=index, token_type_ids=types)
                    windows.append(window)
                    label_of.append(label)
        lengths = [len(t.ids) for t in tokenized]
        return PreparedBlock(windows=windows, context=(np.asarray(label_of, dtype=np.int64), lengths))

    def finish(self, records: Sequence[Record], prepared: PreparedBlock, outputs: list) -> ClassifyBlock:
        label_of, lengths = prepared.context
        items = np.asarray([w.item for w in prepared.windows], dtype=np.int64)
        scores = nli_scores(
            np.stack(outputs),
            items,
            label_of,
            len(records),
            len(self.labels),
            self.entailment_id,
            self.contradiction_id,
            self.independent,
        )
        truncated = truncated_count(lengths, self.long, min(self.room))
        return ClassifyBlock(scores=scores, counts=Counts.of_block(records, prepared.windows, truncated))


class SupervisedJob(_ClassifyOutput):
    """Run each text (its windows) through a trained classifier; its classes' probabilities as the text-classification
    pipeline computes them (``activation``: :func:`class_activation`)."""

    head: Head = staticmethod(logits_head)

    def __init__(
        self, runtime: Runtime, labels: list[str], model_labels: list[str], long: LongMode, stride: int | None
    ):
        self.runtime = runtime
        self.labels = labels
        self.long = long
        self.stride = resolve_stride(long, stride, runtime.max_length, runtime.special)
        self.columns = np.asarray([model_labels.index(label) for label in labels])
        self.activation = class_activation(runtime.config)

    def prepare(self, records: Sequence[Record]) -> PreparedBlock:
        rt = self.runtime
        tokenized, windows = window_texts(
            rt.tokenizer,
            [r.text for r in records],
            rt.special,
            rt.max_length,
            self.long,
            self.stride,
            call_chars=rt.host.tokenize_call_chars,
            offsets=False,
        )
        return PreparedBlock(windows=windows, context=[len(t.ids) for t in tokenized])

    def finish(self, records: Sequence[Record], prepared: PreparedBlock, outputs: list) -> ClassifyBlock:
        logits = np.stack(outputs).astype(np.float64)
        probabilities = sigmoid(logits) if self.activation == "sigmoid" else softmax_rows(logits)
        items = np.asarray([w.item for w in prepared.windows])
        # a long text's windows each vote with their class probabilities; the text gets their mean
        totals = np.zeros((len(records), probabilities.shape[1]))
        np.add.at(totals, items, probabilities)
        totals /= np.bincount(items, minlength=len(records))[:, None]
        content = self.runtime.max_length - self.runtime.special.single_overhead
        truncated = truncated_count(prepared.context, self.long, content)
        return ClassifyBlock(
            scores=totals[:, self.columns].astype(np.float32),
            counts=Counts.of_block(records, prepared.windows, truncated),
        )


class EmbeddingJob(_ClassifyOutput):
    """Embed texts with the embed job's windows and pooling; score them against label embeddings.

    ``label_vectors``: each label through the template, embedded by the caller (unit length, ``(k, d)``)."""

    inputs_key = None

    def __init__(
        self,
        embed: EmbedJob,
        labels: list[str],
        label_vectors: np.ndarray,
        multi_label: bool,
        temperature: float,
        threshold: float,
    ):
        self.embed = embed
        self.labels = labels
        self.label_vectors = label_vectors
        self.multi_label = multi_label
        self.temperature, self.threshold = temperature, threshold
        self.stride = embed.stride if embed.long == "chunk" else None
        self.head: Head = EmbeddingHead(embed.pooling, False)

    def prepare(self, records: Sequence[Record]) -> PreparedBlock:
        return self.embed.prepare(records)

    def finish(self, records: Sequence[Record], prepared: PreparedBlock, outputs: list) -> ClassifyBlock:
        block = self.embed.finish(records, prepared, outputs)
        cosine = block.pooled.astype(np.float64) @ self.label_vectors.T.astype(np.float64)  # (n, k)
        scores = embedding_scores(cosine, self.temperature, self.threshold, self.multi_label)
        return ClassifyBlock(scores=scores, counts=block.counts)


ClassifyJob = NliJob | SupervisedJob | EmbeddingJob
