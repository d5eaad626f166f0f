"""Independent references that tests in several layers compare memfit with: sentence-transformers' CrossEncoder,
a plain transformers forward, and the cosine they are compared by."""

from __future__ import annotations

import numpy as np
import torch

QUERIES = ["where does the cat sleep", "music and film", "", "the president of the city"]
DOCUMENTS = [
    "the cat sleeps on the mat in the house",
    "a new film with great music",
    "hello",
    "police said the president was in the city",
    "",
    "dogs and cats love the long story of the game",
]


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The cosine of each row of ``a`` with the same row of ``b``, in float64. Written here rather than taken from
    memfit, the code under test. Two zero rows (an empty text's vector) count as equal, a zero row against another
    as 0."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    both_zero = ~a.any(axis=1) & ~b.any(axis=1)
    return np.where(both_zero, 1.0, (a * b).sum(axis=1) / np.where(norms > 0, norms, 1.0))


def crossencoder_scores(model_dir: str, pairs: list[tuple[str, str]]) -> np.ndarray:
    """The reference: sentence-transformers' CrossEncoder.predict, with the score a reranker means
    (sigmoid of one logit; the softmax probability of class 1 of two)."""
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(model_dir, device="cpu")
    if model.num_labels == 1:
        return model.predict(pairs, batch_size=3)
    return model.predict(pairs, batch_size=3, apply_softmax=True)[:, 1]


def fp32_reference(model_dir: str, texts: list[str], max_length: int) -> np.ndarray:
    """Plain transformers fp32 forward, truncated to ``max_length``, mask-aware mean pooling."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    return ((hidden * mask).sum(1) / mask.sum(1)).numpy()
