"""The head ``memfit train`` puts on a sentence-transformers model: its own pooling, and a saved model that
plain transformers and sentence-transformers load with the lines of docs/train.md, predicting what
``memfit classify --model OUT`` predicts.

References: the documented plain-transformers lines (copied here from docs/train.md), sentence-transformers'
own ``SentenceTransformer``, and transformers' ``AutoModelForSequenceClassification`` for models without a
sentence-transformers pooling.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from memfit import Classifier
from memfit.training import train
from conftest import sentiment_rows, write_jsonl


def documented_plain_transformers(out: str, texts: list[str]) -> tuple[list[str], torch.Tensor]:
    """The plain-transformers lines of docs/train.md ("Using the model without memfit"), verbatim."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    encoder = AutoModel.from_pretrained(out).eval()
    head = load_file(f"{out}/2_Dense/model.safetensors")  # linear.weight: (labels, hidden), linear.bias
    batch = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        hidden = encoder(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooling = encoder.config.memfit_pooled_head["pooling"]
    if pooling == "mean":
        pooled = (hidden * mask).sum(1) / mask.sum(1)
    elif pooling == "max":
        pooled = hidden.masked_fill(mask == 0, -torch.inf).amax(1)
    else:  # "cls"
        pooled = hidden[:, 0]
    logits = pooled @ head["linear.weight"].T + head["linear.bias"]
    labels = [encoder.config.id2label[i] for i in logits.argmax(-1).tolist()]
    return labels, logits


def documented_sentence_transformers(out: str, texts: list[str]) -> tuple[list[str], torch.Tensor]:
    """The sentence-transformers lines of docs/train.md, verbatim."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoConfig

    model = SentenceTransformer(out, device="cpu")
    logits = model.encode(texts, convert_to_tensor=True)
    id2label = AutoConfig.from_pretrained(out).id2label
    labels = [id2label[i] for i in logits.argmax(-1).tolist()]
    return labels, logits


def _softmax(logits: torch.Tensor) -> np.ndarray:
    return torch.softmax(logits.double(), -1).numpy()


@pytest.mark.parametrize("pooling", ["mean", "cls", "max"])
def test_saved_pooled_classifier_predicts_the_same_without_memfit(tiny_st_dirs, tmp_path, pooling):
    data = write_jsonl(tmp_path / "train.jsonl", sentiment_rows(48))
    out = tmp_path / "out"
    metrics = train(data, out, tiny_st_dirs[pooling], epochs=4, batch_size=8, dtype="fp32", lr=3e-3, head_lr=1e-2)
    assert metrics["head"]["pooling"] == pooling and metrics["head"]["new"]
    config = json.loads((out / "config.json").read_text())
    assert (
        config["memfit_pooled_head"] == {"path": "2_Dense", "pooling": pooling}
        and config["classifier_pooling"] == pooling
    )
    assert config["id2label"] == {"0": "neg", "1": "pos"}

    texts = [r["text"] for r in sentiment_rows(30, seed=5)] + ["a much longer text " * 6 + "good"]
    results = Classifier(str(out), dtype="fp32").classify(texts)
    memfit_labels = [r.labels[0] for r in results]
    memfit_scores = np.asarray([[dict(zip(r.labels, r.scores))[label] for label in ("neg", "pos")] for r in results])

    plain_labels, plain_logits = documented_plain_transformers(str(out), texts)
    assert plain_labels == memfit_labels
    np.testing.assert_allclose(memfit_scores, _softmax(plain_logits), atol=1e-5)
    st_labels, st_logits = documented_sentence_transformers(str(out), texts)
    assert st_labels == memfit_labels
    torch.testing.assert_close(st_logits.cpu(), plain_logits, atol=1e-5, rtol=1e-5)
    assert set(memfit_labels) == {"neg", "pos"}  # not a constant predictor: the label comparison has teeth


def test_pooled_classifier_uses_the_models_own_pooling(tiny_st_dirs, tmp_path):
    """The logits are the head applied to sentence-transformers' pooled vector of the encoder (mean here),
    not to the [CLS] pooler that ``AutoModelForSequenceClassification`` would use."""
    from sentence_transformers import SentenceTransformer
    from safetensors.torch import load_file

    data = write_jsonl(tmp_path / "train.jsonl", sentiment_rows(16))
    out = tmp_path / "out"
    train(data, out, tiny_st_dirs["mean"], epochs=1, batch_size=8, dtype="fp32")
    (out / "modules.json").write_text(
        json.dumps(
            [  # the encoder + pooling alone, as a plain embedding model
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ]
        )
    )
    texts = ["good movie", "bad bad sad film"]
    pooled = SentenceTransformer(str(out), device="cpu").encode(texts, convert_to_tensor=True).cpu()
    head = load_file(str(out / "2_Dense" / "model.safetensors"))
    expected = pooled @ head["linear.weight"].T + head["linear.bias"]
    _, logits = documented_plain_transformers(str(out), texts)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_model_without_sentence_transformers_pooling_gets_the_transformers_head(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    data = write_jsonl(tmp_path / "train.jsonl", sentiment_rows(16))
    out = tmp_path / "out"
    metrics = train(data, out, tiny_model_dir, epochs=1, batch_size=8, dtype="fp32")
    assert metrics["head"]["pooling"] is None
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    texts = ["good movie", "bad bad sad film", "love"]
    with torch.no_grad():
        logits = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits
    results = Classifier(str(out), dtype="fp32").classify(texts)
    assert [r.labels[0] for r in results] == [model.config.id2label[i] for i in logits.argmax(-1).tolist()]


def test_fine_tuning_a_saved_pooled_classifier_keeps_its_head(tiny_st_dirs, tmp_path):
    from safetensors.torch import load_file

    data = write_jsonl(tmp_path / "train.jsonl", sentiment_rows(16))
    first = tmp_path / "first"
    train(data, first, tiny_st_dirs["mean"], epochs=1, batch_size=8, dtype="fp32", lr=1e-3)
    again = train(data, tmp_path / "again", first, epochs=1, batch_size=8, dtype="fp32", lr=1e-9, head_lr=1.0)
    assert again["head"] == {"pooling": "mean", "new": False, "lr": 1e-9}
    before = load_file(str(first / "2_Dense" / "model.safetensors"))
    after = load_file(str(tmp_path / "again" / "2_Dense" / "model.safetensors"))
    for name, value in before.items():  # a kept head trains at the encoder's rate, here next to nothing
        torch.testing.assert_close(after[name], value, atol=1e-6, rtol=0)


def test_checkpointing_the_pooled_head_recomputes_the_encoder_with_the_same_gradients(tiny_model_dir):
    """Turning checkpointing on for memfit's pooled head must reach its encoder's layers (the head has
    none) and change nothing but memory: the gradients equal those of the plain backward."""
    from transformers import AutoModel

    from memfit.engine.models import enable_activation_checkpointing
    from memfit.engine.pooled_classifier import PooledClassifier

    inputs = {
        "input_ids": torch.tensor([[2, 5, 6, 7, 3], [2, 8, 9, 3, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]),
    }
    gradients = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = PooledClassifier(AutoModel.from_pretrained(tiny_model_dir), "mean", num_labels=2).train()
        if checkpointed:
            enable_activation_checkpointing(model)
        layers = model.encoder.encoder.layer
        assert all(layer.gradient_checkpointing == checkpointed for layer in layers)
        loss = torch.nn.functional.cross_entropy(model(**inputs).logits, torch.tensor([0, 1]))
        loss.backward()
        gradients.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    plain, recomputed = gradients
    assert plain.keys() == recomputed.keys() and any(name.startswith("encoder.encoder.layer") for name in plain)
    for name in plain:
        torch.testing.assert_close(recomputed[name], plain[name])
