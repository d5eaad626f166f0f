"""Which classifier ``memfit train`` fine-tunes: a head on the model's own pooling, or transformers' own.

- A sentence-transformers model (``1_Pooling/config.json``: mean, cls or max) gets a linear head on that
  pooling (:class:`~memfit.engine.pooled_classifier.PooledClassifier`): it was trained to be read that way, and
  its [CLS] vector / BERT pooler carry little (measured on all-MiniLM-L6-v2 in issue 13: [CLS] pooler
  0.562, mean pooling 0.688 at the same learning rate, majority class 0.56).
- A model already fine-tuned by ``memfit train`` (``memfit_pooled_head`` in its config) keeps its pooling,
  and its head when the label names are the same.
- Any other model is fine-tuned as ``AutoModelForSequenceClassification`` (BERT: [CLS] + pooler), keeping
  an existing classifier's head when its label names are exactly those of the data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


from memfit.engine.models import (
    is_pooled_classifier,
    load_model,
    pooled_classifier_pooling,
    read_sentence_transformer_defaults,
)
from memfit.engine.pooled_classifier import PooledClassifier
from memfit.training.checkpoint import quiet_transformers
from memfit.memory.device import Device


@dataclass(frozen=True, slots=True)
class Head:
    """How the classifier reads the encoder: ``pooling`` (None: transformers' own head) and whether it is new."""

    pooling: str | None
    new: bool

    def describe(self) -> str:
        kind = (
            f"linear head on {self.pooling} pooling" if self.pooling else "transformers' sequence-classification head"
        )
        return f"{'new ' if self.new else ''}{kind}"


def build_classifier(source: str, original: str, labels_in_data: list[str], device: Device):
    """The model to fine-tune from ``source`` (the starting model, or a checkpoint of this run), its labels
    (kept in the model's order when it already has exactly these) and its :class:`Head`.

    ``original`` is the model the run started from, whose sentence-transformers pooling decides the head."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(source)
    existing = config_labels(source)
    keep = existing is not None and set(existing) == set(labels_in_data)
    labels = existing if keep else sorted(set(labels_in_data))
    label_config = {"id2label": dict(enumerate(labels)), "label2id": {label: i for i, label in enumerate(labels)}}
    is_classifier = any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
    pooling = pooled_classifier_pooling(config)
    if pooling is None and not (keep and is_classifier):
        pooling = read_sentence_transformer_defaults(original).pooling
    with quiet_transformers():
        if pooling is None:
            model = load_model(
                source,
                AutoModelForSequenceClassification,
                device,
                "fp32",
                num_labels=len(labels),
                ignore_mismatched_sizes=True,
                **label_config,
            )
            return model.train(), labels, Head(pooling=None, new=not keep)
        encoder = load_model(source, AutoModel, device, "fp32", **label_config)
    model = PooledClassifier(encoder, pooling, len(labels))
    keep_head = keep and is_pooled_classifier(config)
    if keep_head:
        model.load_head(source)
    return model.train(), labels, Head(pooling=pooling, new=not keep_head)


def config_labels(model: str) -> list[str] | None:
    """The label names a classifier checkpoint already has (so fine-tuning it keeps its head), if any."""
    config_file = Path(model) / "config.json"
    if not config_file.is_file():
        return None
    id2label = json.loads(config_file.read_text()).get("id2label") or {}
    names = [id2label[k] for k in sorted(id2label, key=int)]
    return None if all(n == f"LABEL_{i}" for i, n in enumerate(names)) else names
