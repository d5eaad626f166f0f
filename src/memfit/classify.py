"""The classify job: zero-shot classification into labels named at run time, on the budgeted engine.

Two modes share the streaming loop of ``runner.py`` (blocks → windows → planned batches → OOM guard):

- **nli** — a cross-encoder trained on natural-language inference (MNLI-style BERT, StructBERT,
  bart-large-mnli). Every (text, label) pair becomes one model input, premise = text and hypothesis =
  ``template.format(label)``, and the entailment logit says how well the label fits. Scores are those of
  transformers' ``ZeroShotClassificationPipeline``: single-label = softmax of the entailment logits
  across labels; multi-label (or a single label) = per label, softmax over (contradiction, entailment).
  Unlike the pipeline, each text is tokenized once, pairs are built per block (texts x labels never
  exist for the whole corpus) and batched by length under the memory budget, so padding is small.
- **embedding** — a bi-encoder (the bundled MiniLM by default): each label is embedded once through the
  template, each text once, and the score is the cosine similarity turned into a probability
  (softmax over labels with a temperature; multi-label: an independent sigmoid per label around a
  similarity threshold). One forward pass per text instead of one per (text, label).

- **supervised** — a sequence classifier with its own labels, such as the output of ``memfit train``:
  each text runs once and the score of each of the model's labels is its softmax probability
  (``labels`` may select a subset; the probabilities are still those over all the model's classes).

Long texts: ``long="truncate"`` keeps the head of the text (as the pipeline and sentence-transformers
do). ``long="chunk"`` covers the whole text with overlapping windows; NLI scores each (window, label)
pair and keeps, per label, the window with the *highest entailment* (see :func:`nli_scores`);
embedding mode mean-pools the windows as ``memfit embed`` does; supervised mode averages the windows'
class probabilities.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from memfit.chunking import (
    LONG_MODES,
    LongMode,
    SpecialTokens,
    Window,
    check_window_options,
    default_stride,
    make_pair_window,
    make_windows,
    tokenize_texts,
    window_starts,
)
from memfit.defaults import CLASSIFY_MODES as MODES
from memfit.defaults import DEFAULT_SIMILARITY_THRESHOLD, DEFAULT_TEMPERATURE, DEFAULT_TEMPLATE
from memfit.encoder import EmbedJob, Encoder, _memfit_version
from memfit.engine import AdaptiveBudget, Head, TorchEngine
from memfit.errors import ConfigError, ModelLoadError
from memfit.fingerprint import input_fingerprint
from memfit.host_budget import HostBudget, fitted_to_plan, host_budget
from memfit.memory import MemoryPlan, device_memory, plan_memory, resolve_budget_bytes
from memfit.models import (
    SentenceTransformerDefaults,
    describe_load_failure,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_max_length,
    resolve_model_name,
)
from memfit.pooled_classifier import is_pooled_classifier, load_sequence_classifier
from memfit.pooling import EmbeddingHead
from memfit.preflight import check_input, check_options, check_output_dir
from memfit.runner import (
    PreparedBlock,
    records_from_texts,
    run_job,
    source_label,
    source_records,
)
from memfit.sinks import PartWriter, ids_array, read_manifest
from memfit.sources import Record

log = logging.getLogger("memfit")

Mode = Literal["auto", "nli", "embedding", "supervised"]


@dataclass(frozen=True, slots=True)
class Classification:
    """One text's result: every label, best first, with its score (same shape as the pipeline's)."""

    labels: list[str]
    scores: list[float]


@dataclass
class ClassifyBlock:
    """One block's scores, ``(texts, labels)`` in the caller's label order, plus counts for the manifest."""

    scores: np.ndarray  # (n, k) float32
    counts: dict[str, int]


def entailment_ids(config) -> tuple[int | None, int | None]:
    """The entailment and contradiction class ids from ``config.label2id``, or None where absent.

    Labels are matched case-insensitively by prefix ("entail…", "contra…"), as the transformers
    pipeline does. A two-class model without a "contra…" label (``entailment`` / ``not_entailment``)
    uses its other class as the contradiction, which is also what the pipeline ends up using.
    """
    label2id = {str(k).lower(): int(v) for k, v in (getattr(config, "label2id", None) or {}).items()}
    entail = next((i for name, i in label2id.items() if name.startswith("entail")), None)
    contra = next((i for name, i in label2id.items() if name.startswith("contra")), None)
    if contra is None and entail is not None and len(label2id) == 2:
        contra = next(i for i in label2id.values() if i != entail)
    return entail, contra


def resolve_mode(mode: str, config) -> Literal["nli", "embedding", "supervised"]:
    """``auto`` → ``nli`` when the model's config has an entailment class, ``supervised`` for another
    sequence classifier (e.g. the output of ``memfit train``), else ``embedding``."""
    if mode not in MODES:
        raise ConfigError(f"unknown classify mode {mode!r}; choose one of {', '.join(MODES)}")
    has_entailment = entailment_ids(config)[0] is not None
    is_classifier = (any(a.endswith("ForSequenceClassification") for a in getattr(config, "architectures", None) or [])
                     or is_pooled_classifier(config))
    if mode == "auto":
        return "nli" if has_entailment else "supervised" if is_classifier else "embedding"
    if mode == "nli" and not has_entailment:
        labels = dict(getattr(config, "label2id", None) or {})
        raise ConfigError(
            f"this model has no entailment class in its config (label2id: {labels}); NLI zero-shot needs an "
            "MNLI-style model, or use --mode embedding"
        )
    if mode == "supervised" and not is_classifier:
        raise ConfigError("supervised mode needs a sequence-classification model (e.g. the output of memfit train)")
    return mode  # type: ignore[return-value]


def check_labels(labels: Sequence[str], template: str) -> list[str]:
    """Labels as a list of distinct non-empty strings, and a template with a ``{}`` slot."""
    if isinstance(labels, str):
        raise ConfigError("labels must be a list of strings, not one string (the CLI splits --labels on commas)")
    labels = list(labels)
    if not labels:
        raise ConfigError("at least one label is needed")
    for label in labels:
        if not isinstance(label, str) or not label.strip():
            raise ConfigError(f"labels must be non-empty strings, got {label!r}")
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise ConfigError(f"duplicate labels: {', '.join(duplicates)}")
    try:
        filled = template.format(labels[0])
    except (IndexError, KeyError, ValueError) as exc:
        raise ConfigError(f"template {template!r} cannot be filled with a label: {exc}") from None
    if filled == template:
        raise ConfigError(f"template {template!r} has no {{}} slot for the label")
    return labels


def nli_scores(logits: np.ndarray, items: np.ndarray, label_of: np.ndarray, n_texts: int, n_labels: int,
               entail: int, contra: int | None, independent: bool) -> np.ndarray:
    """Per-text label scores from per-window NLI logits, ``(n_texts, n_labels)`` float32.

    ``logits``: ``(windows, classes)``; ``items`` / ``label_of``: each window's text and label.
    Several windows of one (text, label) pair (``long="chunk"``) are reduced to the *maximum* before
    normalisation: the best entailment logit (single-label) or the best per-label probability
    (independent), i.e. a label fits a long text if it fits any part of it.
    """
    logits = logits.astype(np.float64)
    if independent:
        if contra is None:
            raise ConfigError("multi-label NLI scores need a contradiction class in the model config")
        # softmax over (contradiction, entailment) = sigmoid of their difference
        per_window = 1.0 / (1.0 + np.exp(logits[:, contra] - logits[:, entail]))
    else:
        per_window = logits[:, entail]
    best = np.full((n_texts, n_labels), -np.inf)
    np.maximum.at(best, (items, label_of), per_window)
    if independent:
        return best.astype(np.float32)
    best -= best.max(axis=1, keepdims=True)
    exp = np.exp(best)
    return (exp / exp.sum(axis=1, keepdims=True)).astype(np.float32)


def logits_head(output: Any, attention_mask: torch.Tensor, windows: Sequence[Window]) -> list:
    """Engine head for sequence classifiers: one float32 logits row per window, on the host."""
    return list(output.logits.float().cpu().numpy())


def ranked(labels: Sequence[str], scores: np.ndarray) -> Classification:
    """Labels sorted best first (ties in the pipeline's order: ``reversed(argsort)``)."""
    order = np.argsort(scores)[::-1]
    return Classification(labels=[labels[i] for i in order], scores=[float(scores[i]) for i in order])


class Classifier:
    """Zero-shot classification of texts of any number and length within a memory budget.

    ``model``: ``None`` for the bundled all-MiniLM-L6-v2 (embedding mode), a local directory or a hub id.
    ``mode``: ``auto`` (NLI when the model's config has an entailment class, supervised for another
    sequence classifier, else embedding), ``nli``, ``embedding``, ``supervised``. ``device``, ``dtype``,
    ``max_length`` and ``memory_budget`` are as for
    :class:`~memfit.Encoder`; in NLI mode the default ``max_length`` is the tokenizer's
    ``model_max_length`` (capped by the position embeddings), the length the pipeline truncates to.
    ``temperature`` and ``threshold`` shape embedding-mode scores (see the module docstring).
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        mode: Mode = "auto",
        device: str = "auto",
        dtype: str = "auto",
        max_length: int | None = None,
        memory_budget: str | int | None = None,
        temperature: float = DEFAULT_TEMPERATURE,
        threshold: float = DEFAULT_SIMILARITY_THRESHOLD,
    ):
        if not temperature > 0:
            raise ConfigError(f"temperature must be > 0, got {temperature}")
        self.model_name = resolve_model_name(model)
        self.mode = resolve_mode(mode, _load_config(self.model_name))
        self.temperature = float(temperature)
        self.threshold = float(threshold)
        if self.mode == "embedding":
            self.encoder: Encoder | None = Encoder(self.model_name, device=device, dtype=dtype,
                                                   max_length=max_length, memory_budget=memory_budget)
            self.device, self.dtype, self.max_length = self.encoder.device, self.encoder.dtype, self.encoder.max_length
            return
        self.encoder = None
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.tokenizer = load_tokenizer(self.model_name)
        self.model = load_sequence_classifier(self.model_name, self.device, self.dtype)
        self.entailment_id, self.contradiction_id = entailment_ids(self.model.config)
        id2label = self.model.config.id2label
        self.model_labels = [str(id2label[i]) for i in range(self.model.config.num_labels)]
        # no sentence-transformers defaults: the pipeline truncates at tokenizer.model_max_length
        self.max_length = resolve_max_length(max_length, self.model.config, self.tokenizer,
                                             SentenceTransformerDefaults())
        self.special = SpecialTokens.from_tokenizer(self.tokenizer)
        # models without segment embeddings (RoBERTa, BART) take no token_type_ids
        self.uses_token_types = "token_type_ids" in self.tokenizer.model_input_names
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        budget_bytes = resolve_budget_bytes(memory_budget, device_memory(self.device))
        self.host: HostBudget = host_budget(budget_bytes, self.device)
        self.memory: MemoryPlan = plan_memory(self.model, self.device, budget_bytes, output_bytes_per_token=0,
                                              reserved_bytes=self.host.reserved_bytes)
        self.host = fitted_to_plan(self.host, self.memory)
        self.budget = AdaptiveBudget(self.memory.batch_budget)
        log.info("model %s (%s) on %s in %s, window %d tokens", self.model_name, self.mode, self.device,
                 self.dtype, self.max_length)
        log.info(self.memory.describe())

    # -- public API -------------------------------------------------------------------------------

    def classify(
        self,
        texts: Iterable[str],
        labels: Sequence[str] | None = None,
        template: str = DEFAULT_TEMPLATE,
        multi_label: bool = False,
        long: LongMode = "truncate",
        stride: int | None = None,
        progress: bool | None = False,
    ) -> list[Classification]:
        """Per text: every label, best first, and its score, in input order.

        Single-label scores sum to 1 over the labels; with ``multi_label`` each label is scored on its
        own in [0, 1] (NLI with one label does the same, as the pipeline does). ``labels`` is required
        in the zero-shot modes; in supervised mode it defaults to all of the model's labels.
        """
        texts = list(texts)
        job = self._job(labels, template, multi_label, long, stride)
        out: list[Classification] = []
        for _, block in self._run(job, records_from_texts(texts), progress, len(texts)):
            out.extend(ranked(job.labels, row) for row in block.scores)
        return out

    def classify_to(
        self,
        source: str | os.PathLike | Iterable[str],
        out_dir: str | os.PathLike,
        labels: Sequence[str] | None = None,
        template: str = DEFAULT_TEMPLATE,
        multi_label: bool = False,
        long: LongMode = "truncate",
        stride: int | None = None,
        text_field: str = "text",
        id_field: str | None = None,
        input_format: str | None = None,
        resume: bool = False,
        progress: bool | None = None,
        part_size: int | None = None,
    ) -> dict[str, Any]:
        """Stream classifications of ``source`` to ``out_dir`` (Parquet parts + manifest.json).

        Columns: ``id``, ``labels`` (list of strings, best first) and ``scores`` (list of float32, same
        order). ``source`` and ``resume`` work as in :meth:`Encoder.embed_to`. ``part_size``: texts per
        part (default 2048, fewer with many NLI labels); an interrupted run keeps every finished part.
        Returns the manifest.
        """
        check_options(part_size=part_size)
        check_output_dir(out_dir, resume)
        job = self._job(labels, template, multi_label, long, stride)
        from_file = isinstance(source, (str, os.PathLike))
        settings = {
            "job": "classify",
            "model": self.model_name,
            "mode": self.mode,
            "labels": job.labels,
            "template": template,
            "multi_label": multi_label,
            "dtype": self.dtype,
            "max_length": self.max_length,
            "long": long,
            "stride": job.stride,
            "temperature": self.temperature if self.mode == "embedding" else None,
            "threshold": self.threshold if self.mode == "embedding" and multi_label else None,
            "input": source_label(source),
            "text_field": text_field,
            "id_field": id_field,
        }
        if from_file:
            # fail on an unreadable file or a missing field before anything is created in out_dir
            check_input(os.fspath(source), input_format, text_field, id_field)
        writer = PartWriter(out_dir, settings, resume=resume, input_fingerprint=input_fingerprint(source))
        if writer.complete:
            return writer.manifest
        writer.update_info(memfit_version=_memfit_version(), device=str(self.device))
        records = source_records(source, text_field, id_field, input_format, skip=writer.rows_done)
        for records_block, block in self._run(job, records, progress, None, part_size):
            writer.write_part(_classify_table(records_block, job.labels, block.scores), block.counts)
        writer.finish()
        return writer.manifest

    def job(self, labels: Sequence[str] | None = None, template: str = DEFAULT_TEMPLATE, multi_label: bool = False,
            long: LongMode = "truncate", stride: int | None = None) -> "NliJob | SupervisedJob":
        """The prepare/finish job of one classify call, for front ends that batch windows themselves
        (``memfit serve``). NLI and supervised modes only: building an embedding-mode job runs the model."""
        if self.mode == "embedding":
            raise ConfigError("embedding mode has no model-free job; use the Encoder (classifier.encoder)")
        return self._job(labels, template, multi_label, long, stride)

    # -- internals --------------------------------------------------------------------------------

    def _job(self, labels: Sequence[str] | None, template: str, multi_label: bool, long: LongMode,
             stride: int | None) -> "NliJob | EmbeddingJob | SupervisedJob":
        if long not in LONG_MODES:
            raise ConfigError(f"unknown long-text mode {long!r}; choose truncate or chunk")
        if self.mode == "supervised":
            return SupervisedJob(self, self._supervised_labels(labels), long, stride)
        if labels is None:
            raise ConfigError(f"{self.mode} mode classifies into labels you name: pass labels (--labels a,b,c)")
        labels = check_labels(labels, template)
        if self.mode == "embedding" and len(labels) == 1 and not multi_label:
            raise ConfigError(f"one label ({labels[0]!r}) in embedding mode would score every text 1.0 (a softmax "
                              "over one label); name two or more labels, or pass --multi-label to score the label "
                              "on its own against --threshold")
        if self.mode == "embedding":
            return EmbeddingJob(self, labels, template, multi_label, long, stride)
        return NliJob(self, labels, template, multi_label, long, stride)

    def _supervised_labels(self, labels: Sequence[str] | None) -> list[str]:
        """The model's own labels, or the requested subset of them."""
        if labels is None:
            return list(self.model_labels)
        unknown = [label for label in labels if label not in self.model_labels]
        if unknown or not labels:
            raise ConfigError(f"supervised mode scores the model's own labels {self.model_labels}; "
                              f"unknown: {unknown or 'none given'}")
        return list(dict.fromkeys(labels))

    def _run(self, job: "NliJob | EmbeddingJob | SupervisedJob", records: Iterable[Record], progress: bool | None,
             total: int | None, part_size: int | None = None):
        engine = TorchEngine(job.model, self.device, job.pad_token_id, job.head)
        # blocks (= output parts) hold about the same number of model inputs whatever the number of labels
        host = self.encoder.host if self.encoder is not None else self.host
        limits = host.block_limits(part_size, pairs_per_text=len(job.labels) if isinstance(job, NliJob) else 1)
        return run_job(job, records, engine, job.budget, self.device, limits, progress, total)


class NliJob:
    """Build (text window, hypothesis) pairs per block (prepare); turn their logits into scores (finish)."""

    def __init__(self, clf: Classifier, labels: list[str], template: str, multi_label: bool, long: LongMode,
                 stride: int | None):
        self.clf = clf
        self.labels = labels
        self.long = long
        self.independent = multi_label or len(labels) == 1  # the pipeline's rule
        if self.independent and clf.contradiction_id is None:
            raise ConfigError(
                "multi-label (or single-label) NLI scores need a contradiction class in the model config "
                f"(label2id: {dict(clf.model.config.label2id)})"
            )
        self.model, self.budget, self.pad_token_id, self.head = clf.model, clf.budget, clf.pad_token_id, logits_head
        hypotheses = clf.tokenizer([template.format(label) for label in labels], add_special_tokens=False)
        self.hypothesis_ids = [np.asarray(ids, dtype=np.int64) for ids in hypotheses["input_ids"]]
        # premise tokens per window, per label: what the hypothesis and special tokens leave free
        self.room = [clf.max_length - clf.special.pair_overhead - len(h) for h in self.hypothesis_ids]
        too_long = [label for label, room in zip(labels, self.room) if room < 1]
        if too_long:
            raise ConfigError(f"the hypothesis for label {too_long[0]!r} leaves no room for the text in "
                              f"max_length {clf.max_length}; use a shorter template or label")
        self.stride = None
        if long == "chunk":
            self.stride = default_stride(min(self.room)) if stride is None else stride
            if not 0 <= self.stride < min(self.room):
                raise ConfigError(f"stride must be between 0 and {min(self.room) - 1} for these labels and "
                                  f"max_length {clf.max_length}, got {self.stride}")

    def prepare(self, records: Sequence[Record]) -> PreparedBlock:
        clf = self.clf
        tokenized = tokenize_texts(clf.tokenizer, [r.text for r in records])
        windows: list[Window] = []
        label_of: list[int] = []
        for item, text in enumerate(tokenized):
            for label, (hypothesis, room) in enumerate(zip(self.hypothesis_ids, self.room)):
                starts = [0] if self.long == "truncate" else window_starts(len(text.ids), room, self.stride)
                for index, start in enumerate(starts):
                    window = make_pair_window(item, text.ids[start:], hypothesis, clf.special, clf.max_length)
                    if index or not clf.uses_token_types:
                        types = window.token_type_ids if clf.uses_token_types else None
                        window = dataclasses.replace(window, index=index, token_type_ids=types)
                    windows.append(window)
                    label_of.append(label)
        lengths = [len(t.ids) for t in tokenized]
        return PreparedBlock(windows=windows, context=(np.asarray(label_of, dtype=np.int64), lengths))

    def finish(self, records: Sequence[Record], prepared: PreparedBlock, outputs: list) -> ClassifyBlock:
        label_of, lengths = prepared.context
        items = np.asarray([w.item for w in prepared.windows], dtype=np.int64)
        scores = nli_scores(np.stack(outputs), items, label_of, len(records), len(self.labels),
                            self.clf.entailment_id, self.clf.contradiction_id, self.independent)
        counts = {
            "texts": len(records),
            "empty_texts": sum(1 for r in records if not r.text.strip()),
            "pairs": len(prepared.windows),
            "tokens": sum(len(w) for w in prepared.windows),
            "truncated_texts": sum(1 for n in lengths if self.long == "truncate" and n > min(self.room)),
        }
        return ClassifyBlock(scores=scores, counts=counts)


class SupervisedJob:
    """Run each text (its windows) through a trained classifier; softmax over the model's classes."""

    def __init__(self, clf: Classifier, labels: list[str], long: LongMode, stride: int | None):
        self.clf = clf
        self.labels = labels
        self.long = long
        self.stride = default_stride(clf.max_length) if stride is None else stride
        check_window_options(clf.max_length, clf.special, self.stride)
        self.columns = np.asarray([clf.model_labels.index(label) for label in labels])
        self.model, self.budget, self.pad_token_id, self.head = clf.model, clf.budget, clf.pad_token_id, logits_head

    def prepare(self, records: Sequence[Record]) -> PreparedBlock:
        clf = self.clf
        tokenized = tokenize_texts(clf.tokenizer, [r.text for r in records])
        windows = [window for item, tokens in enumerate(tokenized)
                   for window in make_windows(item, tokens, clf.special, clf.max_length, self.long, self.stride)]
        return PreparedBlock(windows=windows, context=[len(t.ids) for t in tokenized])

    def finish(self, records: Sequence[Record], prepared: PreparedBlock, outputs: list) -> ClassifyBlock:
        logits = np.stack(outputs).astype(np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        probabilities = np.exp(logits)
        probabilities /= probabilities.sum(axis=1, keepdims=True)
        items = np.asarray([w.item for w in prepared.windows])
        # a long text's windows each vote with their class probabilities; the text gets their mean
        totals = np.zeros((len(records), probabilities.shape[1]))
        np.add.at(totals, items, probabilities)
        totals /= np.bincount(items, minlength=len(records))[:, None]
        content = self.clf.max_length - self.clf.special.single_overhead
        counts = {
            "texts": len(records),
            "empty_texts": sum(1 for r in records if not r.text.strip()),
            "windows": len(prepared.windows),
            "tokens": sum(len(w) for w in prepared.windows),
            "truncated_texts": sum(1 for n in prepared.context if self.long == "truncate" and n > content),
        }
        return ClassifyBlock(scores=totals[:, self.columns].astype(np.float32), counts=counts)


class EmbeddingJob:
    """Embed texts with the embed job's windows and pooling; score them against label embeddings."""

    def __init__(self, clf: Classifier, labels: list[str], template: str, multi_label: bool, long: LongMode,
                 stride: int | None):
        encoder = clf.encoder
        self.clf = clf
        self.labels = labels
        self.multi_label = multi_label
        window_stride = default_stride(encoder.max_length) if stride is None else stride
        check_window_options(encoder.max_length, encoder.special, window_stride)
        self.stride = window_stride if long == "chunk" else None
        self.embed = EmbedJob(encoder, encoder.default_pooling, normalize=True, keep_tokens=False, long=long,
                              stride=window_stride)
        self.model, self.budget, self.pad_token_id = encoder.model, encoder.budget, encoder.pad_token_id
        self.head: Head = EmbeddingHead(encoder.default_pooling, False)
        # each label through the template once; (k, d), unit length
        self.label_vectors = encoder.embed([template.format(label) for label in labels], normalize=True,
                                           long="truncate")

    def prepare(self, records: Sequence[Record]) -> PreparedBlock:
        return self.embed.prepare(records)

    def finish(self, records: Sequence[Record], prepared: PreparedBlock, outputs: list) -> ClassifyBlock:
        block = self.embed.finish(records, prepared, outputs)
        cosine = block.pooled.astype(np.float64) @ self.label_vectors.T.astype(np.float64)  # (n, k)
        scores = embedding_scores(cosine, self.clf.temperature, self.clf.threshold, self.multi_label)
        counts = {k: v for k, v in block.counts.items() if k != "windows"}
        return ClassifyBlock(scores=scores, counts=counts)


def embedding_scores(cosine: np.ndarray, temperature: float, threshold: float, multi_label: bool) -> np.ndarray:
    """Cosine similarities ``(n, k)`` → scores: ``softmax(cos / T)`` over labels, or per label
    ``sigmoid((cos - threshold) / T)`` (above 0.5 exactly when the cosine is above ``threshold``)."""
    if multi_label:
        return (1.0 / (1.0 + np.exp(-(cosine - threshold) / temperature))).astype(np.float32)
    logits = cosine / temperature
    logits -= logits.max(axis=1, keepdims=True)
    exp = np.exp(logits)
    return (exp / exp.sum(axis=1, keepdims=True)).astype(np.float32)


def _load_config(model_name: str):
    """The model's config alone, to pick the mode before loading weights."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_name)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(describe_load_failure(model_name, exc)) from exc


def _classify_table(records: Sequence[Record], labels: Sequence[str], scores: np.ndarray) -> pa.Table:
    """One part: ``id``, ``labels`` (best first) and ``scores`` (same order) per text."""
    order = np.argsort(scores, axis=1)[:, ::-1]  # best first, ties as in ranked()
    n, k = scores.shape
    offsets = pa.array(np.arange(0, (n + 1) * k, k, dtype=np.int32))
    names = pa.array(np.asarray(labels, dtype=object)[order].reshape(-1), type=pa.string())
    values = pa.array(np.take_along_axis(scores, order, axis=1).reshape(-1), type=pa.float32())
    return pa.table({
        "id": ids_array([r.id for r in records]),
        "labels": pa.ListArray.from_arrays(offsets, names),
        "scores": pa.ListArray.from_arrays(offsets, values),
    })


def read_classifications(out_dir: str | os.PathLike) -> tuple[list, list[Classification]]:
    """Load a ``memfit classify`` output directory: ids and results in input order (listed parts only)."""
    manifest = read_manifest(out_dir)
    ids: list = []
    results: list[Classification] = []
    for part in manifest["parts"]:
        table = pq.read_table(Path(out_dir) / part["file"])
        ids.extend(table.column("id").to_pylist())
        results.extend(Classification(labels=labels, scores=scores)
                       for labels, scores in zip(table.column("labels").to_pylist(),
                                                 table.column("scores").to_pylist()))
    return ids, results
