"""Windows and ownership against a brute-force reference; special-token templates against the tokenizers.

Token ids in the property tests are unique (``1000 + position``), so a window's content tells which
text positions it holds without trusting any of the chunker's bookkeeping.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.data.chunking import (
    SpecialTokens,
    TokenizedText,
    check_window_options,
    default_stride,
    make_pair_window,
    make_windows,
    merged_token_rows,
    tokenize_texts,
    window_starts,
)
from memfit.errors import ConfigError

ID_BASE = 1000


def _specials(prefix: tuple[int, ...] = (1,), suffix: tuple[int, ...] = (2,)) -> SpecialTokens:
    return SpecialTokens(
        prefix=prefix,
        suffix=suffix,
        pair_prefix=prefix,
        pair_middle=suffix,
        pair_suffix=suffix,
        first_type_id=0,
        second_type_id=1,
    )


def _text(n: int) -> TokenizedText:
    ids = np.arange(ID_BASE, ID_BASE + n, dtype=np.int64)
    offsets = np.stack([np.arange(n) * 2, np.arange(n) * 2 + 1], axis=1).astype(np.int32)
    return TokenizedText(ids=ids, offsets=offsets)


def _content_positions(window, special: SpecialTokens) -> np.ndarray:
    """Text positions a window holds, read from its (unique) ids."""
    ids = window.input_ids
    content = ids[len(special.prefix) : len(ids) - len(special.suffix)]
    return content - ID_BASE


def _reference_owner(p: int, spans: list[tuple[int, int]]) -> int:
    """Brute force: among the windows holding position p (``first <= p <= last``), the one whose
    centre is nearest; ties go to the earlier window."""
    best, best_distance = -1, float("inf")
    for w, (first, last) in enumerate(spans):
        if first <= p <= last:
            distance = abs(p - (first + last) / 2)
            if distance < best_distance:
                best, best_distance = w, distance
    return best


cases = st.integers(min_value=1, max_value=40).flatmap(
    lambda content: st.tuples(
        st.integers(min_value=0, max_value=300),  # n tokens
        st.just(content),
        st.integers(min_value=0, max_value=content - 1),  # stride
        st.sampled_from([((1,), (2,)), ((1, 5), (2,)), ((), ()), ((1,), (2, 2))]),
    )
)


@settings(max_examples=300, deadline=None)
@given(case=cases)
def test_windows_cover_every_token_and_each_is_owned_once_by_its_most_central_window(case):
    n, content, stride, (prefix, suffix) = case
    special = _specials(prefix, suffix)
    max_length = content + special.single_overhead
    windows = make_windows(0, _text(n), special, max_length, "chunk", stride)
    spans = [_content_positions(w, special) for w in windows]

    for w, positions in enumerate(spans):
        assert len(windows[w]) <= max_length
        if n:  # contiguous slices of the text
            assert np.array_equal(positions, np.arange(positions[0], positions[0] + len(positions)))
        if n > content:
            assert len(positions) == content, "every window of a long text is full"
    if n > content:
        assert spans[0][0] == 0 and spans[-1][-1] == n - 1
        for a, b in zip(spans, spans[1:]):
            assert b[0] - a[0] <= content - stride, "windows advance by at most content - stride"
            assert b[0] > a[0]

    owner = np.full(n, -1)
    for w, window in enumerate(windows):
        for position in range(window.own_start, window.own_end):
            p = int(window.input_ids[position]) - ID_BASE
            if p < 0:
                continue  # a special token
            assert owner[p] == -1, f"token {p} owned twice"
            owner[p] = w
    assert (owner >= 0).all(), "every token owned"
    bounds = [(int(s[0]), int(s[-1])) for s in spans] if n else []
    assert [int(owner[p]) for p in range(n)] == [_reference_owner(p, bounds) for p in range(n)]

    # specials: the first window owns the leading ones, the last the trailing ones, nobody else any
    for w, window in enumerate(windows):
        owned = window.input_ids[window.own_start : window.own_end]
        n_special = int((owned < ID_BASE).sum())
        expected = (len(prefix) if w == 0 else 0) + (len(suffix) if w == len(windows) - 1 else 0)
        assert n_special == expected

    # the owned rows, concatenated, are the merged sequence
    merged = np.concatenate([w.input_ids[w.own_start : w.own_end] for w in windows])
    ids, offsets = merged_token_rows(_text(n), special, "chunk", max_length)
    assert np.array_equal(merged, ids)
    assert np.array_equal(ids, np.concatenate([prefix, np.arange(ID_BASE, ID_BASE + n), suffix]).astype(np.int64))
    assert len(offsets) == len(ids)


@pytest.mark.parametrize("n", [0, 1, 9, 10])
def test_a_text_that_fits_is_one_window_in_both_modes(n):
    special = _specials()
    for long in ("chunk", "truncate"):
        (window,) = make_windows(3, _text(n), special, 12, long, stride=4)
        assert window.item == 3 and window.index == 0
        assert (window.own_start, window.own_end) == (0, n + 2)
        assert list(window.input_ids) == [1, *range(ID_BASE, ID_BASE + n), 2]


def test_truncate_keeps_the_head_only():
    special = _specials()
    (window,) = make_windows(0, _text(50), special, 12, "truncate", stride=4)
    assert list(window.input_ids) == [1, *range(ID_BASE, ID_BASE + 10), 2]
    ids, offsets = merged_token_rows(_text(50), special, "truncate", 12)
    assert np.array_equal(ids, window.input_ids) and len(offsets) == 12


def test_stride_zero_gives_adjacent_windows_and_an_end_aligned_last_one():
    assert window_starts(25, 10, 0) == [0, 10, 15]
    assert window_starts(30, 10, 0) == [0, 10, 20]
    assert window_starts(10, 10, 0) == [0]


def test_maximal_stride_advances_one_token_at_a_time():
    assert window_starts(13, 10, 9) == [0, 1, 2, 3]


def test_stride_bounds_are_checked():
    special = _specials()
    assert check_window_options(12, special, 0) == 10
    assert check_window_options(12, special, 9) == 10
    for bad in (-1, 10, 11):
        with pytest.raises(ConfigError):
            check_window_options(12, special, bad)
    with pytest.raises(ConfigError):
        check_window_options(2, special, 0)


@pytest.mark.parametrize("max_length", [3, 4, 16, 128, 256, 512])
def test_default_stride_is_a_quarter_window_and_valid(max_length):
    assert default_stride(max_length) == max_length // 4
    check_window_options(max_length, _specials(), default_stride(max_length))


# -- real tokenizers ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bert_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _roberta_tokenizer(add_prefix_space: bool):
    """A tiny byte-level BPE RobertaTokenizer (fast) from a vocab and merges written here."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import RobertaTokenizer

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "c"), ("Ġc", "a"), ("Ġca", "t")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<mask>"] = len(vocab)
    tokenizer = RobertaTokenizer(vocab=vocab, merges=merges, add_prefix_space=add_prefix_space)
    assert tokenizer.is_fast
    return tokenizer


@pytest.fixture(scope="module", params=[False, True], ids=["roberta", "roberta-prefix-space"])
def roberta_tokenizer(request):
    return _roberta_tokenizer(request.param)


def test_bert_special_tokens(bert_tokenizer):
    special = SpecialTokens.from_tokenizer(bert_tokenizer)
    cls, sep = bert_tokenizer.cls_token_id, bert_tokenizer.sep_token_id
    assert (special.prefix, special.suffix) == ((cls,), (sep,))
    assert (special.pair_prefix, special.pair_middle, special.pair_suffix) == ((cls,), (sep,), (sep,))
    assert (special.first_type_id, special.second_type_id) == (0, 1)


def test_roberta_special_tokens_read_the_double_separator(roberta_tokenizer):
    special = SpecialTokens.from_tokenizer(roberta_tokenizer)
    bos, eos = roberta_tokenizer.bos_token_id, roberta_tokenizer.eos_token_id
    assert (special.prefix, special.suffix) == ((bos,), (eos,))
    # <s> a </s></s> b </s>
    assert (special.pair_prefix, special.pair_middle, special.pair_suffix) == ((bos,), (eos, eos), (eos,))


def test_prefix_space_tokenizer_really_splits_the_placeholder():
    """The 'roberta-prefix-space' case above is only meaningful if "a" takes two tokens there."""
    tokenizer = _roberta_tokenizer(add_prefix_space=True)
    assert len(tokenizer("a", add_special_tokens=False)["input_ids"]) == 2


PAIR_TEXTS = [("the cat sat", "a cat"), ("", "the"), ("the " * 40, "cat cat")]


@pytest.mark.parametrize("first,second", PAIR_TEXTS)
def test_pair_window_equals_the_tokenizers_pair_encoding(bert_tokenizer, first, second):
    for tokenizer in (bert_tokenizer, _roberta_tokenizer(False)):
        special = SpecialTokens.from_tokenizer(tokenizer)
        a, b = tokenize_texts(tokenizer, [first, second])
        max_length = 24
        window = make_pair_window(5, a.ids, b.ids, special, max_length)
        reference = tokenizer(first, second, truncation="only_first", max_length=max_length, return_token_type_ids=True)
        assert list(window.input_ids) == reference["input_ids"]
        assert list(window.token_type_ids) == reference["token_type_ids"]
        assert (window.item, window.own_start, window.own_end) == (5, 0, len(window))


def test_pair_window_refuses_a_second_text_that_cannot_fit(bert_tokenizer):
    special = SpecialTokens.from_tokenizer(bert_tokenizer)
    a, b = tokenize_texts(bert_tokenizer, ["the", "the " * 30])
    with pytest.raises(ConfigError):
        make_pair_window(0, a.ids, b.ids, special, 16)
    # a second text that fills the window exactly would drop the first whole, where the tokenizer's own
    # truncation="only_first" cannot truncate it either: refused too; an empty first text still fits
    exact = special.pair_overhead + len(b.ids)
    with pytest.raises(ConfigError, match="leaves no room for the first"):
        make_pair_window(0, a.ids, b.ids, special, exact)
    empty = tokenize_texts(bert_tokenizer, [""])[0]
    assert len(make_pair_window(0, empty.ids, b.ids, special, exact)) == exact


TEXTS = ["the cat", "", "hello, world! the movie was great", "the " * 70 + "end"]


@pytest.mark.parametrize("which", ["bert", "roberta"])
def test_windows_and_merged_rows_reproduce_the_tokenizers_encoding(bert_tokenizer, which):
    tokenizer = bert_tokenizer if which == "bert" else _roberta_tokenizer(False)
    special = SpecialTokens.from_tokenizer(tokenizer)
    for text, tokens in zip(TEXTS, tokenize_texts(tokenizer, TEXTS)):
        reference = tokenizer(text, return_offsets_mapping=True)
        ids, offsets = merged_token_rows(tokens, special, "chunk", 16)
        assert list(ids) == reference["input_ids"]
        assert [tuple(o) for o in offsets] == [tuple(o) for o in reference["offset_mapping"]]
        windows = make_windows(0, tokens, special, 16, "chunk", stride=4)
        merged = np.concatenate([w.input_ids[w.own_start : w.own_end] for w in windows])
        assert list(merged) == reference["input_ids"]
        if len(reference["input_ids"]) <= 16:
            assert [list(w.input_ids) for w in windows] == [reference["input_ids"]]
        for window in windows:  # every window is a well-formed single-sequence input
            assert tuple(window.input_ids[:1]) == special.prefix
            assert tuple(window.input_ids[-1:]) == special.suffix
