"""Long texts end to end: chunked token rows and pooled merges against a plain transformers forward pass
of windows built here from the tokenizer, and the windows of a huge text going through the planner."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import memfit
from memfit.engine.batches import AdaptiveBudget, pad_windows
from memfit.errors import ConfigError
from memfit.memory.planner import BatchBudget

MAX_LENGTH = 24  # tiny windows: a few hundred characters already make many of them
STRIDE = 6

WORDS = (
    "the cat sat on the mat and the dog was happy . hello world , a great movie story about love "
    "and hate ; science space government market music 42 zebra quokka"
).split()


def _text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


SHORT = [_text(n, seed) for seed, n in enumerate([0, 1, 3, 8, 12])]
LONG = [_text(n, 100 + seed) for seed, n in enumerate([40, 90, 250, 31])]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return memfit.Encoder(tiny_model_dir, device="cpu", dtype="fp32", max_length=MAX_LENGTH)


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir):
    from transformers import AutoModel

    return AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _reference_windows(tokenizer, text: str, max_length: int, stride: int):
    """Independent window layout: ``[CLS] ids[s:s+C] [SEP]`` with s = 0, C-stride, 2(C-stride), ...
    and a last window that ends at the text's end. Returns (content ids, starts, C)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    content = max_length - 2
    starts = [0]
    while starts[-1] + content < len(ids):
        starts.append(min(starts[-1] + content - stride, len(ids) - content))
    return ids, starts, content


def _forward(model, tokenizer, ids: list[int]) -> np.ndarray:
    """A plain, unbatched transformers forward pass of one window: (L, d)."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out.last_hidden_state[0].numpy()


def _reference_tokens(model, tokenizer, text: str, max_length: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """Each token's vector from the window whose content centre is nearest (ties: earlier window);
    [CLS] from the first window, [SEP] from the last. Also returns the windows' CLS vectors."""
    ids, starts, content = _reference_windows(tokenizer, text, max_length, stride)
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    hidden = [_forward(model, tokenizer, [cls, *ids[s : s + content], sep]) for s in starts]
    rows = [hidden[0][0]]
    for p in range(len(ids)):
        holding = [w for w, s in enumerate(starts) if s <= p < s + content]
        w = min(holding, key=lambda w: (abs(p - (starts[w] + min(content, len(ids)) / 2 - 0.5)), w))
        rows.append(hidden[w][1 + p - starts[w]])
    rows.append(hidden[-1][1 + min(content, len(ids))])
    return np.stack(rows), np.stack([h[0] for h in hidden])


def test_texts_that_fit_one_window_are_identical_in_chunk_and_truncate(tiny):
    assert all(len(tiny.tokenizer(t)["input_ids"]) <= MAX_LENGTH for t in SHORT)
    for pooling in ("mean", "max", "cls"):
        chunked = tiny.embed(SHORT, pooling=pooling, long="chunk")
        truncated = tiny.embed(SHORT, pooling=pooling, long="truncate")
        assert np.array_equal(chunked, truncated)
    for a, b in zip(tiny.embed_tokens(SHORT, long="chunk"), tiny.embed_tokens(SHORT, long="truncate")):
        assert np.array_equal(a.token_ids, b.token_ids) and np.array_equal(a.offsets, b.offsets)
        assert np.array_equal(a.embeddings, b.embeddings)


def test_long_texts_get_one_row_per_token_aligned_with_the_tokenizer(tiny):
    out = tiny.embed_tokens(LONG, stride=STRIDE)
    for text, t in zip(LONG, out):
        reference = tiny.tokenizer(text, return_offsets_mapping=True, return_special_tokens_mask=True)
        assert len(reference["input_ids"]) > MAX_LENGTH
        assert t.embeddings.shape == (len(reference["input_ids"]), tiny.dim)
        assert t.token_ids.tolist() == reference["input_ids"]
        assert [tuple(o) for o in t.offsets.tolist()] == [tuple(o) for o in reference["offset_mapping"]]
        assert t.special_mask.tolist() == [bool(m) for m in reference["special_tokens_mask"]]


@pytest.mark.parametrize(
    "stride,texts",
    [(0, LONG), (STRIDE, LONG), (MAX_LENGTH - 3, LONG[:1])],
    ids=["no-overlap", "default-ish", "max-overlap"],
)
def test_every_token_vector_equals_a_direct_forward_pass_of_its_most_central_window(
    tiny, reference_model, stride, texts
):
    for text, t in zip(texts, tiny.embed_tokens(texts, stride=stride)):
        expected, _ = _reference_tokens(reference_model, tiny.tokenizer, text, MAX_LENGTH, stride)
        np.testing.assert_allclose(t.embeddings, expected, atol=1e-5, rtol=0)


def test_truncate_keeps_the_first_window_only(tiny, reference_model):
    for text, t in zip(LONG, tiny.embed_tokens(LONG, long="truncate")):
        ids = tiny.tokenizer(text, truncation=True, max_length=MAX_LENGTH)["input_ids"]
        assert t.token_ids.tolist() == ids
        np.testing.assert_allclose(t.embeddings, _forward(reference_model, tiny.tokenizer, ids), atol=1e-5, rtol=0)


def test_pooled_merges_equal_an_explicit_computation_from_token_rows(tiny, reference_model):
    texts = LONG + SHORT[1:]
    tokens = tiny.embed_tokens(texts, stride=STRIDE)
    mean = np.stack([t.embeddings.mean(axis=0) for t in tokens])  # every token once, specials included
    maxed = np.stack([t.embeddings.max(axis=0) for t in tokens])
    np.testing.assert_allclose(tiny.embed(texts, pooling="mean", stride=STRIDE), mean, atol=1e-5, rtol=0)
    np.testing.assert_allclose(tiny.embed(texts, pooling="max", stride=STRIDE), maxed, atol=1e-5, rtol=0)
    cls = np.stack(
        [_reference_tokens(reference_model, tiny.tokenizer, t, MAX_LENGTH, STRIDE)[1].mean(axis=0) for t in texts]
    )
    np.testing.assert_allclose(tiny.embed(texts, pooling="cls", stride=STRIDE), cls, atol=1e-5, rtol=0)
    normalized = tiny.embed(texts, pooling="mean", stride=STRIDE, normalize=True)
    np.testing.assert_allclose(normalized, mean / np.linalg.norm(mean, axis=1, keepdims=True), atol=1e-5, rtol=0)


def test_results_do_not_depend_on_batch_composition_or_order(tiny):
    texts = LONG + SHORT
    together = tiny.embed(texts, stride=STRIDE)
    order = list(range(len(texts)))
    random.Random(7).shuffle(order)
    shuffled = tiny.embed([texts[i] for i in order], stride=STRIDE)
    alone = np.concatenate([tiny.embed([t], stride=STRIDE) for t in texts])
    assert np.abs(shuffled[np.argsort(order)] - together).max() <= 1e-4
    assert np.abs(alone - together).max() <= 1e-4
    tokens_together = tiny.embed_tokens(texts, stride=STRIDE)
    tokens_alone = [tiny.embed_tokens([t], stride=STRIDE)[0] for t in texts]
    for a, b in zip(tokens_together, tokens_alone):
        assert np.abs(a.embeddings - b.embeddings).max() <= 1e-4


def test_embed_to_streams_the_same_token_rows(tiny, tmp_path, monkeypatch):
    # pieces of ~3 token rows: every long text spans many row groups of its token file
    monkeypatch.setattr(tiny, "host", dataclasses.replace(tiny.host, piece_bytes=3 * 4 * tiny.dim))
    manifest = tiny.embed_to(LONG, tmp_path / "out", tokens=True, stride=STRIDE, part_size=2)
    assert manifest["rows"] == len(LONG)
    assert len(manifest["parts"]) == 2
    pooled_table = pq.read_table([tmp_path / "out" / p["file"] for p in manifest["parts"]])
    token_files = [tmp_path / "out" / p["tokens"]["file"] for p in manifest["parts"]]
    assert sum(pq.ParquetFile(f).metadata.num_row_groups for f in token_files) > 20
    tokens = pq.read_table(token_files).to_pylist()
    direct = tiny.embed_tokens(LONG, stride=STRIDE)
    pooled = tiny.embed(LONG, stride=STRIDE)
    for row, (record, t, vector) in enumerate(zip(pooled_table.to_pylist(), direct, pooled)):
        mine = sorted((r for r in tokens if r["row"] == row), key=lambda r: r["position"])
        assert [r["position"] for r in mine] == list(range(len(t.token_ids)))  # every token exactly once
        assert [r["token_id"] for r in mine] == t.token_ids.tolist()
        assert [[r["start"], r["end"]] for r in mine] == t.offsets.tolist()
        assert [r["special"] for r in mine] == t.special_mask.tolist()
        np.testing.assert_allclose(np.asarray([r["embedding"] for r in mine]), t.embeddings, atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(record["embedding"]), vector, atol=1e-5, rtol=0)
    out = memfit.read(tmp_path / "out")
    for got_ids, got_rows, t in zip(out.token_ids, out.token_embeddings, direct):
        np.testing.assert_array_equal(got_ids, t.token_ids)
        np.testing.assert_allclose(got_rows, t.embeddings, atol=1e-5, rtol=0)


def test_bad_long_options_are_config_errors(tiny):
    with pytest.raises(ConfigError):
        tiny.embed(["x"], long="summarize")
    with pytest.raises(ConfigError):
        tiny.embed(["x"], stride=MAX_LENGTH - 2)  # no room to advance
    with pytest.raises(ConfigError):
        tiny.embed(["x"], stride=-1)


def test_a_million_character_text_runs_in_budget_sized_batches(tiny_model_dir, monkeypatch):
    """The windows of one huge text go through the token-budget planner like any other windows: many
    small batches, none over the budget, instead of one giant batch. The model forward is replaced by
    a fake whose "hidden state" of a token is its id, so the real head and merge run at full scale and
    the merged mean / max must equal the mean / max of the tokenizer's ids of the whole text."""
    from memfit.engine.batches import TorchEngine
    from memfit.engine.runtime import Runtime

    batches: list[tuple[int, int]] = []  # (windows, padded tokens) per engine call

    class IdEngine(TorchEngine):
        def forward(self, windows):
            inputs = pad_windows(windows, self.pad_token_id, self.device)
            batches.append((len(windows), inputs["input_ids"].numel()))
            hidden = SimpleNamespace(last_hidden_state=inputs["input_ids"].double()[..., None])  # (B, L, 1)
            return self.head(hidden, inputs["attention_mask"], windows)

    monkeypatch.setattr(Runtime, "engine", lambda self, head: IdEngine(None, self.device, self.pad_token_id, head))
    encoder = memfit.Encoder(tiny_model_dir, device="cpu", dtype="fp32", max_length=128)
    budget = BatchBudget(max_batch_tokens=4096, max_batch_seqs=256)
    encoder.budget = AdaptiveBudget(budget)
    huge = (_text(200_000, seed=1) * 2)[:1_000_000]
    assert len(huge) == 1_000_000
    ids = np.asarray(encoder.tokenizer(huge)["input_ids"], dtype=np.float64)

    mean = encoder.embed([huge, "the cat"], pooling="mean")
    n_windows = sum(n for n, _ in batches)
    content, stride = 126, 128 // 4
    assert n_windows == 1 + 1 + -(-(len(ids) - 2 - content) // (content - stride))  # + the short text
    assert max(tokens for _, tokens in batches) <= budget.max_batch_tokens
    assert len(batches) >= n_windows * 128 // budget.max_batch_tokens
    assert mean[0, 0] == pytest.approx(ids.mean(), rel=1e-6)
    assert encoder.embed([huge], pooling="max")[0, 0] == ids.max()


@pytest.mark.slow
def test_minilm_chunked_tokens_equal_direct_forward_passes(minilm_dir):
    from transformers import AutoModel

    encoder = memfit.Encoder(minilm_dir, device="cpu", dtype="fp32", max_length=128)
    model = AutoModel.from_pretrained(minilm_dir, dtype=torch.float32).eval()
    text = (
        "Long documents are cut into overlapping windows, and every token takes its vector from the "
        "window in which it sits most centrally. "
    ) * 20
    (t,) = encoder.embed_tokens([text])
    expected, cls = _reference_tokens(model, encoder.tokenizer, text, 128, 128 // 4)
    assert len(cls) > 3
    assert t.token_ids.tolist() == encoder.tokenizer(text)["input_ids"]
    np.testing.assert_allclose(t.embeddings, expected, atol=1e-4, rtol=0)
    np.testing.assert_allclose(encoder.embed([text], pooling="mean")[0], expected.mean(axis=0), atol=1e-5, rtol=0)
