"""A classifier on the encoder's own sentence pooling: what ``memfit train`` builds for sentence-transformers models.

Sentence-transformers models (the bundled all-MiniLM-L6-v2 among them) were trained to be read through
their pooling (mean, [CLS] or max over the tokens, from ``1_Pooling/config.json``); their [CLS] vector
and BERT pooler carry little. ``AutoModelForSequenceClassification`` would classify from that pooler,
so ``memfit train`` puts a linear layer on the model's own pooling instead
(:class:`PooledClassifier`).

The saved directory is an ordinary model directory plus the sentence-transformers layout:

- ``config.json`` / weights / tokenizer: the fine-tuned encoder (``AutoModel`` loads it), with
  ``id2label`` / ``label2id`` and ``memfit_pooled_head`` (the head's folder and the pooling: ``mean``, ``cls`` or
  ``max``), the field that marks the directory as a pooled classifier (``models.is_pooled_classifier``), and the
  pooling in ``classifier_pooling`` too where the architecture has no such field of its own;
- ``1_Pooling/config.json`` and ``sentence_bert_config.json`` (the window ``max_seq_length``);
- ``2_Dense/``: the head, a sentence-transformers ``Dense`` layer with identity activation
  (``linear.weight``: labels x hidden, ``linear.bias``), and ``modules.json`` chaining the three.

So ``SentenceTransformer(OUT).encode(texts)`` returns the logits, and plain transformers needs a few
lines (docs/train.md, tested in tests/training/test_train_head.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from memfit.engine.models import (
    HEAD_FIELD,
    POOLING_FIELD,
    declares_field,
    enable_activation_checkpointing,
    is_pooled_classifier,
    pooled_classifier_pooling,
)
from memfit.engine.pooling import Pooling, check_pooling
from memfit.memory.device import Device

HEAD_DIR = "2_Dense"
POOLING_DIR = "1_Pooling"
HEAD_WEIGHTS = "model.safetensors"


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """Sentence vectors ``(B, d)`` from token vectors, over the unmasked tokens, as sentence-transformers' Pooling."""
    if pooling == "cls":
        return hidden[:, 0]
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    if pooling == "max":
        return hidden.masked_fill(mask == 0, torch.finfo(hidden.dtype).min).amax(dim=1)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


class PooledClassifier(torch.nn.Module):
    """``encoder`` (an ``AutoModel``) + ``pooling`` + a linear layer; ``forward`` returns ``.logits`` as
    transformers' sequence classifiers do, so the trainer and ``memfit classify`` treat both alike."""

    def __init__(self, encoder, pooling: Pooling, num_labels: int):
        super().__init__()
        self.encoder = encoder
        self.pooling = check_pooling(pooling)
        self.classifier = torch.nn.Linear(
            encoder.config.hidden_size, num_labels, dtype=encoder.dtype, device=encoder.device
        )

    @property
    def config(self):
        return self.encoder.config

    @property
    def base_model(self):
        """The encoder, as transformers names it on its task models (the head is everything else)."""
        return self.encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **inputs: Any):
        from transformers.modeling_outputs import SequenceClassifierOutput

        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **inputs).last_hidden_state
        pooled = pool(hidden, attention_mask, self.pooling)
        return SequenceClassifierOutput(logits=self.classifier(pooled.to(self.classifier.weight.dtype)))

    def activation_checkpointing_enable(self, **_: Any) -> None:
        """Checkpoint the encoder's layers (the head has none); see ``enable_activation_checkpointing``."""
        enable_activation_checkpointing(self.encoder)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.encoder.get_input_embeddings()

    def resize_token_embeddings(self, size: int) -> None:
        self.encoder.resize_token_embeddings(size)

    def save_pretrained(self, directory: str | os.PathLike, max_seq_length: int | None = None) -> None:
        """Write the encoder, the head and the sentence-transformers files (module docstring)."""
        from safetensors.torch import save_file

        root = Path(directory)
        setattr(self.encoder.config, HEAD_FIELD, {"path": HEAD_DIR, "pooling": self.pooling})
        if not declares_field(self.encoder.config, POOLING_FIELD):
            setattr(self.encoder.config, POOLING_FIELD, self.pooling)
        self.encoder.save_pretrained(root)
        hidden, labels = self.config.hidden_size, self.classifier.out_features
        (root / POOLING_DIR).mkdir(parents=True, exist_ok=True)
        _write_json(
            root / POOLING_DIR / "config.json",
            {
                "word_embedding_dimension": hidden,
                "pooling_mode_cls_token": self.pooling == "cls",
                "pooling_mode_mean_tokens": self.pooling == "mean",
                "pooling_mode_max_tokens": self.pooling == "max",
                "pooling_mode_mean_sqrt_len_tokens": False,
            },
        )
        (root / HEAD_DIR).mkdir(exist_ok=True)
        _write_json(
            root / HEAD_DIR / "config.json",
            {
                "in_features": hidden,
                "out_features": labels,
                "bias": True,
                "activation_function": "torch.nn.modules.linear.Identity",
            },
        )
        save_file(
            {
                "linear.weight": self.classifier.weight.detach().contiguous(),
                "linear.bias": self.classifier.bias.detach().contiguous(),
            },
            str(root / HEAD_DIR / HEAD_WEIGHTS),
        )
        _write_json(
            root / "modules.json",
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": POOLING_DIR, "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": HEAD_DIR, "type": "sentence_transformers.models.Dense"},
            ],
        )
        if max_seq_length is not None:
            _write_json(root / "sentence_bert_config.json", {"max_seq_length": max_seq_length, "do_lower_case": False})

    def load_head(self, directory: str | os.PathLike) -> None:
        """Take the head weights of a saved pooled classifier (same number of labels)."""
        from safetensors.torch import load_file

        weights = load_file(str(Path(directory) / HEAD_DIR / HEAD_WEIGHTS))
        with torch.no_grad():
            self.classifier.weight.copy_(weights["linear.weight"])
            self.classifier.bias.copy_(weights["linear.bias"])


def load_pooled_classifier(model: str, device: Device, dtype: str, **kwargs: Any) -> PooledClassifier:
    """A saved pooled classifier, in eval mode, weights in ``dtype``."""
    from transformers import AutoModel

    from memfit.engine.models import load_model

    encoder = load_model(model, AutoModel, device, dtype, **kwargs)
    pooling = pooled_classifier_pooling(encoder.config)
    assert pooling is not None  # load_sequence_classifier asked is_pooled_classifier
    classifier = PooledClassifier(encoder, pooling, encoder.config.num_labels)
    classifier.load_head(model)
    return classifier.eval()


def load_sequence_classifier(model: str, device: Device, dtype: str):
    """What ``memfit classify`` runs in supervised mode: a pooled classifier from ``memfit train``, or any
    transformers ``AutoModelForSequenceClassification``."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from memfit.engine.models import load_model

    if os.path.isdir(model) and is_pooled_classifier(AutoConfig.from_pretrained(model)):
        return load_pooled_classifier(model, device, dtype)
    return load_model(model, AutoModelForSequenceClassification, device, dtype)


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
