"""The embed job against independent references: sentence-transformers and a plain transformers forward."""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import memfit
from memfit.engine.batches import AdaptiveBudget
from memfit.io.sinks import BackgroundWriter
from memfit.memory.planner import BatchBudget
from reference_outputs import row_cosines

SENTENCES = [
    "The cat sat on the mat.",
    "Space exploration has given us satellites, weather forecasts and a view of our own planet.",
    "",
    "   ",
    "A short one.",
    "Atheism and religion were debated at length in the newsgroup, with long replies quoting each other.",
]


def _mixed_texts(n: int, seed: int = 0) -> list[str]:
    """Texts from a few tokens to several windows long, in random order."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = rng.choice(SENTENCES[:2] + SENTENCES[4:])
        out.append(" ".join([base] * rng.choice([1, 1, 2, 5, 12, 30])))
    return out + SENTENCES


@pytest.fixture(scope="module")
def minilm_fp32(minilm_dir):
    return memfit.Encoder(minilm_dir, dtype="fp32")


@pytest.fixture(scope="module")
def tiny_fp32(tiny_model_dir):
    return memfit.Encoder(tiny_model_dir, dtype="fp32")


def test_texts_that_are_not_a_list_of_strings_are_refused_before_any_work(tiny_fp32):
    """One string was cut into characters (one vector each), None and a NaN from a pandas column were TypeErrors
    from deep inside (under a quality guard, before the check that names the item), and a float stride failed in
    range() on the first text longer than a window."""
    with pytest.raises(memfit.ConfigError, match=r"texts must be a list of strings, not one str \(wrap it"):
        tiny_fp32.embed("one string")
    with pytest.raises(memfit.ConfigError, match="texts must be a list of strings, not one str"):
        tiny_fp32.embed_tokens("one string")
    with pytest.raises(memfit.ConfigError, match="texts must be a list of strings, got NoneType"):
        tiny_fp32.embed(None)
    with pytest.raises(memfit.ConfigError, match=r"texts\[1\] is float, expected str"):
        tiny_fp32.embed(["a", float("nan")])
    with pytest.raises(memfit.ConfigError, match="stride must be a whole number of tokens, got 16.0"):
        tiny_fp32.embed(["the cat " * 100], stride=16.0)
    assert tiny_fp32.embed(("a", "b")).shape == (2, 32)  # any iterable of strings stays welcome


def test_defaults_come_from_the_models_sentence_transformers_config(minilm_fp32):
    assert minilm_fp32.default_pooling == "mean"
    assert minilm_fp32.max_length == 256  # sentence_bert_config.json, not the tokenizer's 512
    assert minilm_fp32.dim == 384


def test_pooled_equals_sentence_transformers_encode(minilm_fp32, minilm_dir):
    from sentence_transformers import SentenceTransformer

    texts = _mixed_texts(40)
    reference = SentenceTransformer(minilm_dir, device="cpu").encode(texts, batch_size=8, convert_to_numpy=True)
    ours = minilm_fp32.embed(texts, long="truncate")  # sentence-transformers truncates at max_seq_length
    assert ours.shape == reference.shape and ours.dtype == np.float32
    assert row_cosines(ours, reference).min() >= 0.99999
    # the model's own pipeline ends with Normalize: with normalize=True the vectors themselves match
    normalized = minilm_fp32.embed(texts, long="truncate", normalize=True)
    np.testing.assert_allclose(normalized, reference, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_fp32_torch(tiny_model_dir):
    return memfit.Encoder(tiny_model_dir, dtype="fp32", backend="torch")


@pytest.mark.parametrize("backend", ["openvino", "torch"])
@pytest.mark.parametrize("pooling", ["cls", "max", "mean"])
def test_pooling_modes_equal_sentence_transformers(tiny_fp32, tiny_fp32_torch, tiny_model_dir, pooling, backend):
    """The embedding head reduces a compiled graph's output in numpy and a PyTorch model's on its device."""
    from sentence_transformers import SentenceTransformer, models

    encoder = tiny_fp32 if backend == "openvino" else tiny_fp32_torch
    assert encoder.runtime.backend.name == backend
    transformer = models.Transformer(tiny_model_dir, max_seq_length=encoder.max_length)
    st = SentenceTransformer(modules=[transformer, models.Pooling(32, pooling_mode=pooling)], device="cpu")
    texts = _mixed_texts(20, seed=1)
    reference = st.encode(texts, batch_size=4, convert_to_numpy=True)
    ours = encoder.embed(texts, pooling=pooling, long="truncate")
    np.testing.assert_allclose(ours, reference, atol=1e-5)


def test_the_length_sorted_blocks_of_a_gpu_host_give_sentence_transformers_vectors_in_input_order(
    tiny_model_dir,
):
    """On CUDA an in-memory call runs shortest first in small blocks (HostBudget.in_memory_block_texts); here the
    CPU host is given the CUDA host's settings, with blocks of 3 texts, so that most texts move."""
    import dataclasses

    from sentence_transformers import SentenceTransformer, models

    encoder = memfit.Encoder(tiny_model_dir, dtype="fp32")
    encoder.host = dataclasses.replace(encoder.host, in_memory_block_texts=3, tokenize_call_chars=1_000_000)
    transformer = models.Transformer(tiny_model_dir, max_seq_length=encoder.max_length)
    st = SentenceTransformer(modules=[transformer, models.Pooling(32, pooling_mode="mean")], device="cpu")
    texts = _mixed_texts(20, seed=2)
    assert sorted(texts, key=len) != texts  # the blocks really reorder the input
    reference = st.encode(texts, batch_size=4, convert_to_numpy=True)
    np.testing.assert_allclose(encoder.embed(texts, pooling="mean", long="truncate"), reference, atol=1e-5)
    assert encoder.embed([]).shape == (0, 32)


def _plain_forward_tokens(model_dir: str, text: str, max_length: int) -> np.ndarray:
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    enc = tok(text, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).last_hidden_state[0].numpy()


def test_token_embeddings_equal_plain_forward_whatever_the_batching(tiny_fp32, tiny_model_dir):
    texts = _mixed_texts(30, seed=2)
    references = [_plain_forward_tokens(tiny_model_dir, t, tiny_fp32.max_length) for t in texts]

    together = tiny_fp32.embed_tokens(texts, long="truncate")
    shuffled_order = list(range(len(texts)))
    random.Random(3).shuffle(shuffled_order)
    shuffled = tiny_fp32.embed_tokens([texts[i] for i in shuffled_order], long="truncate")
    original_budget = tiny_fp32.budget
    try:  # a tiny budget: many small batches with different neighbours and padding
        tiny_fp32.budget = AdaptiveBudget(BatchBudget(max_batch_tokens=150))
        small_batches = tiny_fp32.embed_tokens(texts, long="truncate")
    finally:
        tiny_fp32.budget = original_budget

    for i, ref in enumerate(references):
        for result in (together[i], small_batches[i], shuffled[shuffled_order.index(i)]):
            assert result.embeddings.shape == ref.shape
            assert np.abs(result.embeddings - ref).max() <= 1e-4


def test_token_ids_offsets_and_special_flags_match_the_tokenizer(tiny_fp32):
    text = "Hello world, the cat sat."
    result = tiny_fp32.embed_tokens([text])[0]
    enc = tiny_fp32.tokenizer(text, return_offsets_mapping=True, return_special_tokens_mask=True)
    assert result.token_ids.tolist() == enc["input_ids"]
    assert [tuple(o) for o in result.offsets.tolist()] == [tuple(o) for o in enc["offset_mapping"]]
    assert result.special_mask.tolist() == [bool(m) for m in enc["special_tokens_mask"]]
    dropped = tiny_fp32.embed_tokens([text], drop_special=True)[0]
    assert dropped.token_ids.tolist() == [i for i, m in zip(enc["input_ids"], enc["special_tokens_mask"]) if not m]
    np.testing.assert_array_equal(dropped.embeddings, result.embeddings[~result.special_mask])


def test_embed_to_round_trips_through_read(tiny_fp32, tmp_path):
    texts = _mixed_texts(25, seed=4)
    manifest = tiny_fp32.embed_to(texts, tmp_path / "out", tokens=True, part_size=7)
    assert manifest["complete"] and manifest["rows"] == len(texts) and len(manifest["parts"]) == 5
    out = memfit.read(tmp_path / "out")
    assert out.ids == list(range(len(texts)))
    np.testing.assert_allclose(out.embeddings, tiny_fp32.embed(texts), atol=1e-6)
    expected_tokens = tiny_fp32.embed_tokens(texts)
    for got_ids, got_offsets, got_rows, want in zip(
        out.token_ids, out.token_offsets, out.token_embeddings, expected_tokens
    ):
        np.testing.assert_array_equal(got_ids, want.token_ids)
        np.testing.assert_array_equal(got_offsets, want.offsets)
        np.testing.assert_allclose(got_rows, want.embeddings, atol=1e-6)


def test_read_names_a_listed_part_that_is_gone_or_cut_short(tiny_fp32, tmp_path):
    """A copy of a running job's output, or a partial sync: FileNotFoundError or pyarrow's ArrowInvalid before."""
    tiny_fp32.embed_to(["a cat", "a dog", "space"], tmp_path / "out", part_size=2)
    first, second = sorted((tmp_path / "out").glob("part-*.parquet"))
    second.write_bytes(second.read_bytes()[:40])
    with pytest.raises(memfit.OutputError, match=rf"{second.name}, listed in the manifest, is missing or damaged"):
        memfit.read(tmp_path / "out")
    first.unlink()
    with pytest.raises(memfit.OutputError, match=rf"{first.name}, listed in the manifest, is missing or damaged"):
        memfit.read(tmp_path / "out")


def test_numpy_integers_are_whole_numbers_too(tiny_fp32, tiny_cross_encoder_dirs):
    """``dimensions=np.int64(16)`` was refused as out of range, and ``top_n=np.int64(1)`` as not a whole number."""
    short = tiny_fp32.embed(["a cat"], dimensions=np.int64(16))
    assert short.shape == (1, 16)
    np.testing.assert_allclose(short, tiny_fp32.embed(["a cat"], dimensions=16), atol=0)
    with pytest.raises(memfit.ConfigError, match="--dimensions must be a whole number, got 16.0"):
        tiny_fp32.embed(["a cat"], dimensions=16.0)
    reranker = memfit.Reranker(tiny_cross_encoder_dirs["one_logit"], dtype="fp32")
    assert len(reranker.rank("a query", ["one", "two"], top_n=np.int64(1))) == 1


def test_a_stream_tells_the_memory_guard_about_the_threads_its_reserve_is_for(tiny_fp32, tmp_path, monkeypatch):
    """The guard keeps the host reserve only while a tracked thread is at work (``memory/guard.py``): the thread
    reading the next block in every run, and the writer where parts go to disk. One left untracked would have its
    memory go uncounted while the batches run."""
    guard = tiny_fp32.budget.guard
    assert guard is not None and guard.concurrent_bytes > 0
    registered = []
    real_tracking = guard.tracking

    def tracking(busy, wait_idle):
        registered.append(busy)
        return real_tracking(busy, wait_idle)

    monkeypatch.setattr(guard, "tracking", tracking)
    texts = _mixed_texts(25, seed=4)
    tiny_fp32.embed(texts)
    assert len(registered) == 1  # in memory: the reader alone
    registered.clear()
    tiny_fp32.embed_to(texts, tmp_path / "out", part_size=7)
    writers = [busy for busy in registered if isinstance(getattr(busy, "__self__", None), BackgroundWriter)]
    assert len(registered) == 2 and len(writers) == 1
    assert guard.beside_bytes() == guard.concurrent_bytes  # the stream is over: the whole reserve again


def test_the_readmes_recipe_for_token_tables_larger_than_memory_runs_as_written(tiny_fp32, tmp_path, monkeypatch):
    """The README's code block that reads one text's token rows with ``pyarrow.dataset``, run verbatim
    in a directory holding ``out/``, gives that text's tokens as :meth:`Encoder.embed_tokens` does."""
    texts = _mixed_texts(12, seed=5)
    tiny_fp32.embed_to(texts, tmp_path / "out", tokens=True, part_size=5)  # row 7 is in the second part
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    [recipe] = [block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "pyarrow.dataset" in block]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(recipe, namespace)
    want = tiny_fp32.embed_tokens(texts)[7]
    got = namespace["text_7"]
    assert got.column("row").to_pylist() == [7] * len(want.token_ids)
    np.testing.assert_array_equal(got.column("position").to_numpy(), np.arange(len(want.token_ids)))
    np.testing.assert_array_equal(got.column("token_id").to_numpy(), want.token_ids)
    vectors = np.stack(got.column("embedding").to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(vectors, want.embeddings, atol=1e-6)


def test_float16_output_halves_storage_and_stays_close(tiny_fp32, tmp_path):
    texts = _mixed_texts(10, seed=5)
    tiny_fp32.embed_to(texts, tmp_path / "f16", output_dtype="float16")
    out = memfit.read(tmp_path / "f16")
    assert out.embeddings.dtype == np.float32
    np.testing.assert_allclose(out.embeddings, tiny_fp32.embed(texts), atol=2e-3, rtol=2e-3)


def test_empty_and_whitespace_texts_are_embedded_like_sentence_transformers_does(minilm_fp32, minilm_dir):
    from sentence_transformers import SentenceTransformer

    texts = ["", "   ", "not empty"]
    reference = SentenceTransformer(minilm_dir, device="cpu").encode(texts)
    assert row_cosines(minilm_fp32.embed(texts), reference).min() >= 0.99999


def test_non_string_input_is_refused_by_index(tiny_fp32):
    with pytest.raises(memfit.ConfigError, match=r"texts\[1\] is int"):
        tiny_fp32.embed(["fine", 3])


def test_bad_model_path_is_a_model_load_error(tmp_path):
    with pytest.raises(memfit.ModelLoadError, match="missing': no such directory"):
        memfit.Encoder(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(memfit.ModelLoadError, match="empty' has no config.json"):
        memfit.Encoder(tmp_path / "empty")
