"""Tokenizing in bounded pieces gives exactly the tokens and offsets of one call on the whole text.

References: the tokenizer's own call on the whole text, for the three tokenizer families memfit's models
use: WordPiece (BERT, MiniLM), byte-level BPE (RoBERTa) and SentencePiece-style Unigram with Metaspace
(XLM-R, ALBERT), the last two trained here on real text so no download is needed."""

from __future__ import annotations

import numpy as np
import pytest
from gensim.test.utils import datapath
from tokenizers import SentencePieceUnigramTokenizer
from tokenizers.implementations import ByteLevelBPETokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from memfit.data.tokenization import piece_bounds, tokenize_texts


def _real_text() -> str:
    with open(datapath("lee_background.cor"), encoding="utf-8") as fh:
        english = fh.read()
    with open(datapath("crime-and-punishment.txt"), encoding="utf-8") as fh:
        russian = fh.read()
    return english[:30_000] + "\n\n  " + russian + "\tend  of   text "


TEXT = _real_text()
# Chinese without spaces (a line of a classical poem, repeated) and text that is all whitespace
CHINESE = "床前明月光，疑是地上霜。举头望明月，低头思故乡。" * 200


@pytest.fixture(scope="module", params=["wordpiece", "bpe", "unigram"])
def tokenizer(request, tiny_model_dir):
    if request.param == "wordpiece":
        return AutoTokenizer.from_pretrained(tiny_model_dir)
    if request.param == "bpe":
        trained = ByteLevelBPETokenizer()
        trained.train_from_iterator([TEXT], vocab_size=600, min_frequency=2)
    else:
        trained = SentencePieceUnigramTokenizer()
        trained.train_from_iterator([TEXT, CHINESE], vocab_size=600)
    return PreTrainedTokenizerFast(tokenizer_object=trained._tokenizer)


@pytest.mark.parametrize("call_chars", [None, 1_000_000])  # calls of one piece (CPU) or of many texts (CUDA)
def test_pieces_give_the_tokens_of_the_whole_text(tokenizer, call_chars):
    texts = [TEXT, "", "   ", "short text", CHINESE, TEXT[:999]]
    assert len(piece_bounds(tokenizer, TEXT, 1_000)) > 20  # the long text really is cut
    pieces = tokenize_texts(tokenizer, texts, piece_chars=1_000, call_chars=call_chars)
    for text, got in zip(texts, pieces):
        whole = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        np.testing.assert_array_equal(got.ids, whole["input_ids"])
        np.testing.assert_array_equal(got.offsets, np.asarray(whole["offset_mapping"]).reshape(-1, 2))


@pytest.mark.parametrize("max_tokens", [None, 40])
def test_ids_only_are_the_tokenizers_ids(tokenizer, max_tokens):
    texts = [TEXT, "", "short text", CHINESE, TEXT[:999]]
    got = tokenize_texts(tokenizer, texts, piece_chars=1_000, max_tokens=max_tokens, offsets=False)
    for text, tokens in zip(texts, got):
        whole = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokens.offsets is None
        np.testing.assert_array_equal(tokens.ids, whole[: len(tokens.ids)])
        assert len(tokens.ids) == len(whole) if max_tokens is None else len(tokens.ids) >= min(max_tokens, len(whole))


def test_a_text_without_any_safe_seam_is_tokenized_whole(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # one "word" of 5,000 letters: WordPiece cannot cut it anywhere without changing its tokens
    word = "abcdefghij" * 500
    assert piece_bounds(tokenizer, word, 1_000) == [0, len(word)]
    got = tokenize_texts(tokenizer, [word], piece_chars=1_000)[0]
    assert got.ids.tolist() == tokenizer(word, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("call_chars", [None, 1_000_000])
@pytest.mark.parametrize("max_tokens", [1, 40, 300])
def test_a_truncating_caller_gets_the_whole_texts_first_tokens_from_a_head(tokenizer, max_tokens, call_chars):
    # a digit string (few characters a token) and one 5,000-letter word (no seam: tokenized whole)
    digits = " ".join(str(n) for n in range(3_000))
    texts = [TEXT, "", "short text", CHINESE, TEXT[:999], digits, "abcdefghij" * 500]
    heads = tokenize_texts(tokenizer, texts, piece_chars=1_000, max_tokens=max_tokens, call_chars=call_chars)
    for text, got in zip(texts, heads):
        whole = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        n = len(got.ids)
        assert n >= min(max_tokens, len(whole["input_ids"]))
        np.testing.assert_array_equal(got.ids, whole["input_ids"][:n])
        np.testing.assert_array_equal(got.offsets, np.asarray(whole["offset_mapping"]).reshape(-1, 2)[:n])
    assert len(heads[0].ids) < len(tokenizer(TEXT, add_special_tokens=False)["input_ids"])  # it did stop early


@pytest.mark.parametrize("offsets", [True, False])
def test_a_head_with_too_few_tokens_is_cut_again_further_in(tokenizer, offsets):
    # words of 120 letters: WordPiece makes each one [UNK] (more than 100 characters), ~121 characters a token,
    # so heads cut at a few characters a token hold too few and are cut again, further in each time
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 120)) for _ in range(200)]
    text = " ".join(words)
    whole = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    got = tokenize_texts(tokenizer, [text, TEXT], piece_chars=1_000, max_tokens=40, offsets=offsets)[0]
    n = len(got.ids)
    assert 40 <= n < len(whole["input_ids"])  # enough tokens, and still not the whole text
    np.testing.assert_array_equal(got.ids, whole["input_ids"][:n])
    if offsets:
        np.testing.assert_array_equal(got.offsets, np.asarray(whole["offset_mapping"]).reshape(-1, 2)[:n])


def test_truncated_windows_equal_the_tokenizers_own_truncation(tiny_model_dir):
    from memfit.data.chunking import SpecialTokens, window_texts

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = [TEXT, TEXT[5_000:], CHINESE, "short text", TEXT[:999]]
    tokenized, windows = window_texts(tokenizer, texts, SpecialTokens.from_tokenizer(tokenizer), 128, "truncate", 0)
    reference = tokenizer(texts, truncation=True, max_length=128)["input_ids"]
    assert [w.input_ids.tolist() for w in windows] == reference
    # a text longer than its window keeps at least one token past it: the job counts it as truncated
    assert [len(t.ids) > 126 for t in tokenized] == [len(r) == 128 for r in reference]
