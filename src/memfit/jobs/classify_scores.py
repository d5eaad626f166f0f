"""Classification scores: from per-window logits or cosines to one ranked :class:`Classification` per text.

Pure functions of arrays, shared by the classify jobs (``classify_jobs.py``) and ``memfit serve``: NLI
scores as transformers' ``ZeroShotClassificationPipeline`` computes them (:func:`nli_scores`),
embedding-mode scores from cosines (:func:`embedding_scores`), the best-first ranking, label checks,
and the Parquet form of a block of results (written by ``memfit classify``, read by
:func:`read_classifications`).
"""

from __future__ import annotations

import os
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from memfit.data.chunking import Window
from memfit.data.tokenization import check_unicode
from memfit.errors import ConfigError
from memfit.io.sinks import ids_array, read_manifest
from memfit.data.sources import Record

_FORMATTER = string.Formatter()


@dataclass(frozen=True, slots=True)
class Classification:
    """One text's result: every label, best first, with its score (same shape as the pipeline's)."""

    labels: list[str]
    scores: list[float]


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


def check_labels(labels: Sequence[str], template: str) -> list[str]:
    """Labels as a list of distinct non-empty strings, and a template with a label slot (:func:`template_slots`).

    Labels and the template are Unicode text: a lone surrogate is refused here, naming its field, rather than by
    the tokenizer, whose message would blame "a text"."""
    if isinstance(labels, str):
        raise ConfigError(
            "labels must be a list of strings, not one string (the CLI splits --labels on commas)", field="labels"
        )
    labels = list(labels)
    if not labels:
        raise ConfigError("at least one label is needed")
    for label in labels:
        if not isinstance(label, str) or not label.strip():
            what = quoted(label) if isinstance(label, str) else repr(label)
            raise ConfigError(f"labels must be non-empty strings, got {what}", field="labels")
        check_unicode(label, "label", "labels")
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise ConfigError(f"duplicate labels: {', '.join(quoted(label) for label in duplicates)}")
    if not isinstance(template, str):
        raise ConfigError(f"template must be a string with a {{}} slot, got {template!r}", field="template")
    check_unicode(template, "template", "template")
    if template_slots(template)[1] == 0:
        raise ConfigError(f"template {quoted(template)} has no {{}} slot for the label", field="template")
    try:  # plain slots fill alike whatever the label; '{} and {}' numbers its second slot 1, which one cannot fill
        template.format(labels[0])
    except (IndexError, ValueError) as exc:
        raise ConfigError(
            f"template {quoted(template)} cannot be filled with the label {quoted(labels[0])}: {exc}", field="template"
        ) from None
    return labels


def template_slots(template: str) -> tuple[int, int]:
    """``(characters outside the slots, label slots)`` of a hypothesis template, so that the length of a filled
    template is known before it is filled: ``characters + slots * len(label)``.

    A slot is ``{}`` or ``{0}``, the label as it is (``{{`` and ``}}`` are braces). Any other field is refused:
    a format spec pads (``{:>1000000000}`` is a gigabyte per label, and ``{0:{0}}`` takes its width from the
    label), and an attribute, index or conversion (``{0.upper}``, ``{0[3]}``, ``{!r}``) puts something other
    than the label into the hypothesis. The transformers pipeline formats any field; its templates hold
    plain slots."""
    try:
        fields = list(_FORMATTER.parse(template))
    except ValueError as exc:  # a single '{' or '}'
        raise ConfigError(f"template {quoted(template)} is not a format string: {exc}", field="template") from None
    characters = slots = 0
    for literal, name, spec, conversion in fields:
        characters += len(literal)
        if name is None:
            continue
        if name not in ("", "0") or spec or conversion:
            field = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise ConfigError(
                f"template {quoted(template)}: a label slot is written {{}} or {{0}}, and {quoted(field)} is "
                "something else (a format spec, conversion, attribute or index); write literal braces as {{ and }}",
                field="template",
            )
        slots += 1
    return characters, slots


def quoted(value: str) -> str:
    """``repr(value)``, cut to its first 60 characters: a message quotes a long template or label, not all of it."""
    return repr(value) if len(value) <= 60 else f"{value[:60]!r}... ({len(value)} characters)"


def nli_scores(
    logits: np.ndarray,
    items: np.ndarray,
    label_of: np.ndarray,
    n_texts: int,
    n_labels: int,
    entail: int,
    contra: int | None,
    independent: bool,
) -> np.ndarray:
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
        per_window = sigmoid(logits[:, entail] - logits[:, contra])
    else:
        per_window = logits[:, entail]
    best = np.full((n_texts, n_labels), -np.inf)
    np.maximum.at(best, (items, label_of), per_window)
    if independent:
        return best.astype(np.float32)
    return softmax_rows(best).astype(np.float32)


def class_activation(config: Any) -> Literal["sigmoid", "softmax"]:
    """How a trained classifier's logits become the probabilities ``transformers.pipeline("text-classification")``
    gives by default: each class's sigmoid for a model with one output (a relevance or regression logit) or one
    trained multi-label (``problem_type`` ``multi_label_classification``), else the softmax across its classes. A
    softmax over one output would score every text 1.0."""
    if getattr(config, "problem_type", None) == "multi_label_classification" or config.num_labels == 1:
        return "sigmoid"
    return "softmax"


def softmax_rows(logits: np.ndarray) -> np.ndarray:
    """Softmax of each row of ``(n, k)`` logits (shifted by the row maximum, so large logits do not overflow)."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-x))`` elementwise; where ``exp(-x)`` overflows (``x`` below about -709) the result is
    the 0 it tends to, without a warning."""
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def logits_head(output: Any, attention_mask: Any, windows: Sequence[Window]) -> list:
    """Engine head for sequence classifiers: one float32 logits row per window, on the host (a compiled graph's are
    there already)."""
    logits = output.logits
    if not isinstance(logits, np.ndarray):
        logits = logits.float().cpu().numpy()
    return list(logits.astype(np.float32, copy=False))


def ranked(labels: Sequence[str], scores: np.ndarray) -> Classification:
    """Labels sorted best first (ties in the pipeline's order: ``reversed(argsort)``)."""
    order = np.argsort(scores)[::-1]
    return Classification(labels=[labels[i] for i in order], scores=[float(scores[i]) for i in order])


def embedding_scores(cosine: np.ndarray, temperature: float, threshold: float, multi_label: bool) -> np.ndarray:
    """Cosine similarities ``(n, k)`` → scores: ``softmax(cos / T)`` over labels, or per label
    ``sigmoid((cos - threshold) / T)`` (above 0.5 exactly when the cosine is above ``threshold``)."""
    if multi_label:
        return sigmoid((cosine - threshold) / temperature).astype(np.float32)
    return softmax_rows(cosine / temperature).astype(np.float32)


def classify_table(records: Sequence[Record], labels: Sequence[str], scores: np.ndarray) -> pa.Table:
    """One part: ``id``, ``labels`` (best first) and ``scores`` (same order) per text."""
    order = np.argsort(scores, axis=1)[:, ::-1]  # best first, ties as in ranked()
    n, k = scores.shape
    offsets = pa.array(np.arange(0, (n + 1) * k, k, dtype=np.int32))
    names = pa.array(np.asarray(labels, dtype=object)[order].reshape(-1), type=pa.string())
    values = pa.array(np.take_along_axis(scores, order, axis=1).reshape(-1), type=pa.float32())
    return pa.table(
        {
            "id": ids_array([r.id for r in records]),
            "labels": pa.ListArray.from_arrays(offsets, names),
            "scores": pa.ListArray.from_arrays(offsets, values),
        }
    )


def read_classifications(out_dir: str | os.PathLike) -> tuple[list, list[Classification]]:
    """Load a ``memfit classify`` output directory: ids and results in input order (listed parts only)."""
    manifest = read_manifest(out_dir)
    ids: list = []
    results: list[Classification] = []
    for part in manifest["parts"]:
        table = pq.read_table(Path(out_dir) / part["file"])
        ids.extend(table.column("id").to_pylist())
        results.extend(
            Classification(labels=labels, scores=scores)
            for labels, scores in zip(table.column("labels").to_pylist(), table.column("scores").to_pylist())
        )
    return ids, results
