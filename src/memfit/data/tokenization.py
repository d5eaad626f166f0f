"""Tokenize texts of any length in bounded memory, with the same tokens as one call on the whole text.

The fast tokenizer's own memory grows with the tokens of one call: measured with all-MiniLM-L6-v2's
tokenizer, ~800 bytes per token (its Encoding objects and the Python lists transformers turns them
into), i.e. ~160 MiB for a 1,000,000-character English text and ~220 MiB for 300,000 characters of
Chinese. memfit therefore never hands the tokenizer more than ``call_chars`` characters at once (on
the CPU, where the budget bounds host memory, ``piece_chars``): short texts are tokenized in groups
that add up to at most that, and a text longer than ``piece_chars`` is cut into pieces at *seams* and
its pieces' tokens are concatenated (offsets shifted back to the whole text).

A seam is a place where cutting changes nothing: the text around it, tokenized whole, gives exactly
the tokens (and offsets) of its two halves tokenized apart. Candidates are whitespace positions (the
space goes to the second piece, where byte-level BPE and SentencePiece attach it to the next word);
each is checked by tokenizing ``SEAM_CONTEXT`` characters on both sides, both ways. A text without a
checked seam in reach is tokenized whole, never cut at a place that could change its tokens.

A job that truncates needs only each text's first tokens, so seams also let it stop early
(``max_tokens``): a long text is tokenized up to a seam past which it has at least that many tokens,
which are then exactly the whole text's first ones. The first head is cut at :data:`HEAD_CHARS_PER_TOKEN`
characters a token; a head that holds too few tokens is tokenized again from a seam twice as far in, and
so on until the whole text. The seams of a block's heads are checked in one tokenizer call. Tokenizing is
most of the host's work per text, and on a GPU the host is what the model waits for (docs/benchmarks.md,
"On a GPU").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from memfit.errors import ConfigError

TOKENIZE_PIECE_CHARS = 32_768
# Characters per tokenizer call where host memory is not the budget (a CUDA job): the fast tokenizer spreads
# one call's texts over its threads, and calls of a few long heads each left a 16-core host mostly idle
# while the GPU waited on it. ~800 bytes a token, ~4 characters a token of English: ~100 MB per call.
TOKENIZE_CALL_CHARS_UNBOUNDED = 524_288
SEAM_CONTEXT = 256
SEAM_TRIES = 16
# Where a truncating job first cuts a long text: this many characters per token it needs. English prose runs
# 4-5.5 characters a WordPiece or BPE token (the long-tail benchmark corpus: 4.9 at the median, 5.8 at most, at
# 255 and 511 tokens), CJK text 1-2; a head that still holds too few tokens (long numbers, URLs) is tokenized
# again from twice as far in.
HEAD_CHARS_PER_TOKEN = 6
# A text at most this many characters past its head is tokenized whole: checking a seam tokenizes 4 x
# SEAM_CONTEXT characters (the context whole, then its two halves), about what cutting there would save.
HEAD_CUT_MIN_SAVING = 4 * SEAM_CONTEXT
_SEAM_CANDIDATE = re.compile(r"\s(?=\S)")


@dataclass(frozen=True, slots=True)
class TokenizedText:
    """One text's content tokens (no special tokens) and their character offsets."""

    ids: np.ndarray  # (n,) int64
    offsets: np.ndarray | None  # (n, 2) int32, character [start, end) of each token; None: not asked for


def tokenize_texts(
    tokenizer,
    texts: Sequence[str],
    piece_chars: int = TOKENIZE_PIECE_CHARS,
    max_tokens: int | None = None,
    call_chars: int | None = None,
    offsets: bool = True,
) -> list[TokenizedText]:
    """Tokenize a block of texts in calls of at most ``call_chars`` characters (by default ``piece_chars``), a
    longer text cut into pieces of at most ``piece_chars`` at seams (see the module doc).

    Each call is batched, so the fast (Rust) tokenizer still works on several texts in parallel.
    ``max_tokens``: the caller keeps only each text's first ``max_tokens`` tokens (or needs to know only
    that there are more): a long text's :class:`TokenizedText` may then end early, at a seam, but never
    holds fewer than ``max_tokens`` tokens unless the whole text has fewer.
    ``offsets=False``: ids only (``TokenizedText.offsets`` is None), for jobs that write no token rows: turning
    the tokenizer's offsets into arrays took about a sixth of a GPU host's tokenizing time (docs/benchmarks.md)."""
    call_chars = max(piece_chars, call_chars or piece_chars)
    if max_tokens is None:
        return _tokenize_whole(tokenizer, texts, piece_chars, call_chars, offsets)
    tokenized: list[TokenizedText | None] = [None] * len(texts)
    pending = list(range(len(texts)))
    head_chars = max(1, max_tokens) * HEAD_CHARS_PER_TOKEN
    while pending:  # each round's heads reach twice as far: the last round tokenizes the rest whole
        ends = _head_ends(tokenizer, [texts[i] for i in pending], head_chars, offsets)
        heads = _tokenize_whole(
            tokenizer, [texts[i][:end] for i, end in zip(pending, ends)], piece_chars, call_chars, offsets
        )
        retry = []
        for i, end, head in zip(pending, ends, heads):
            if end < len(texts[i]) and len(head.ids) < max_tokens:
                retry.append(i)
            else:
                tokenized[i] = head
        pending, head_chars = retry, 2 * head_chars
    return tokenized  # type: ignore[return-value]  # every index was filled: the loop ends when none is pending


def _head_ends(tokenizer, texts: Sequence[str], head_chars: int, offsets: bool) -> list[int]:
    """Where to stop tokenizing each text for a head of about ``head_chars`` characters: the last checked seam
    within :data:`SEAM_CONTEXT` past it, or the end (a text no more than :data:`HEAD_CUT_MIN_SAVING` longer, or
    no seam found)."""
    ends = [len(text) for text in texts]
    cut = [i for i, text in enumerate(texts) if len(text) > head_chars + HEAD_CUT_MIN_SAVING]
    seams = _find_seams(tokenizer, [(texts[i], head_chars, head_chars + SEAM_CONTEXT) for i in cut], offsets)
    for i, seam in zip(cut, seams):
        if seam is not None:
            ends[i] = seam
    return ends


def _tokenize_whole(
    tokenizer, texts: Sequence[str], piece_chars: int, call_chars: int, with_offsets: bool
) -> list[TokenizedText]:
    pieces = [
        (i, start, end)
        for i, text in enumerate(texts)
        for start, end in _pairs(piece_bounds(tokenizer, text, piece_chars, with_offsets))
    ]
    ids: list[list[np.ndarray]] = [[] for _ in texts]
    offsets: list[list[np.ndarray]] = [[] for _ in texts]
    for group in _groups(pieces, call_chars):
        encoded = _encode(tokenizer, [texts[i][start:end] for i, start, end in group], with_offsets)
        for (i, start, _), (piece_ids, piece_offsets) in zip(group, encoded):
            ids[i].append(piece_ids)
            if piece_offsets is not None:
                offsets[i].append(piece_offsets + start)
    return [TokenizedText(ids=_joined(i), offsets=_joined(o) if with_offsets else None) for i, o in zip(ids, offsets)]


def _joined(pieces: list[np.ndarray]) -> np.ndarray:
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)  # most texts are one piece: no copy


def piece_bounds(tokenizer, text: str, piece_chars: int, offsets: bool = True) -> list[int]:
    """``[0, seam, seam, ..., len(text)]``: pieces of at most ``piece_chars`` characters where seams exist (seams
    for the ids alone where ``offsets`` is false)."""
    bounds = [0]
    while len(text) - bounds[-1] > piece_chars:
        seam = _find_seam(tokenizer, text, bounds[-1] + piece_chars // 2, bounds[-1] + piece_chars, offsets)
        if seam is None:
            break  # no safe place to cut: the rest is tokenized whole
        bounds.append(seam)
    bounds.append(len(text))
    return bounds


def _find_seam(tokenizer, text: str, low: int, high: int, offsets: bool = True) -> int | None:
    """The last checked seam in ``(low, high]``: whitespace first, then any character boundary (texts
    without spaces, such as Chinese, where character-level tokenizers cut anywhere)."""
    return _find_seams(tokenizer, [(text, low, high)], offsets)[0]


def _find_seams(tokenizer, ranges: Sequence[tuple[str, int, int]], offsets: bool = True) -> list[int | None]:
    """:func:`_find_seam` for each ``(text, low, high)``, the texts' candidates checked in rounds of one a text,
    each round in one tokenizer call (the first candidate is nearly always a seam: one call for a whole block)."""
    candidates = [_seam_candidates(text, low, high) for text, low, high in ranges]
    found: list[int | None] = [None] * len(ranges)
    pending = [i for i, positions in enumerate(candidates) if positions]
    attempt = 0
    while pending:
        checked = _are_seams(tokenizer, [(ranges[i][0], candidates[i][attempt]) for i in pending], offsets)
        for i, is_seam in zip(pending, checked):
            if is_seam:
                found[i] = candidates[i][attempt]
        attempt += 1
        pending = [i for i, is_seam in zip(pending, checked) if not is_seam and attempt < len(candidates[i])]
    return found


def _seam_candidates(text: str, low: int, high: int) -> list[int]:
    spaces = [m.start() for m in _SEAM_CANDIDATE.finditer(text, low, high)][::-1]
    return [*spaces[:SEAM_TRIES], *range(high, max(low, high - SEAM_TRIES), -1)]


def _are_seams(tokenizer, positions: Sequence[tuple[str, int]], offsets: bool = True) -> list[bool]:
    """Whether cutting each text at its position changes nothing within :data:`SEAM_CONTEXT` on both sides: the
    ids, and with ``offsets`` the character offsets too (a caller that keeps no offsets needs only the ids).
    Compared as the tokenizer's own lists: a block's checks are a few hundred short encodings, where arrays would
    cost more than the comparisons."""
    spans = [
        (text, max(0, position - SEAM_CONTEXT), position, min(len(text), position + SEAM_CONTEXT))
        for text, position in positions
    ]
    encoded = _encode_lists(
        tokenizer,
        [
            piece
            for text, start, position, end in spans
            for piece in (text[start:end], text[start:position], text[position:end])
        ],
        with_offsets=offsets,
    )
    return [
        whole_ids == left_ids + right_ids
        and (
            not offsets
            or whole_offsets == left_offsets + [(a + position - start, b + position - start) for a, b in right_offsets]
        )
        for (_, start, position, _), (whole_ids, whole_offsets), (left_ids, left_offsets), (
            right_ids,
            right_offsets,
        ) in zip(spans, encoded[0::3], encoded[1::3], encoded[2::3])
    ]


def _encode(tokenizer, texts: list[str], with_offsets: bool = True) -> list[tuple[np.ndarray, np.ndarray | None]]:
    return [
        (
            np.array(ids, dtype=np.int64),
            np.array(offsets, dtype=np.int32).reshape(-1, 2) if offsets is not None else None,
        )
        for ids, offsets in _encode_lists(tokenizer, texts, with_offsets)
    ]


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> int | None:
    """Where ``text`` holds a UTF-16 surrogate code point on its own (JSON's ``"\\ud800"`` decodes to one), or
    None. Such a string is not Unicode text: it cannot be encoded as UTF-8, and the tokenizer refuses it."""
    found = _LONE_SURROGATE.search(text)
    return None if found is None else found.start()


def check_unicode(text: str, what: str, field: str) -> None:
    """Refuse ``text`` (``what``: "label", "query"...) if it holds a lone surrogate, naming ``field``: checked where a
    string is tokenized apart from the texts, whose tokenizer refusal would blame "a text"."""
    at = lone_surrogate(text)
    if at is not None:
        raise ConfigError(
            f"the {what} holds a lone surrogate (an unpaired \\ud800-\\udfff escape) at character {at}, so it "
            "is not Unicode text",
            field=field,
        )


def _encode_lists(
    tokenizer, texts: list[str], with_offsets: bool
) -> list[tuple[list[int], list[tuple[int, int]] | None]]:
    """Each text's content-token ids, and with ``with_offsets`` their ``(start, end)`` character offsets."""
    try:
        return _encode_valid_lists(tokenizer, texts, with_offsets)
    except TypeError:  # the Rust tokenizer's answer to a string that is not Unicode text
        if any(isinstance(text, str) and lone_surrogate(text) is not None for text in texts):
            raise ConfigError(
                "a text holds a lone surrogate (an unpaired \\ud800-\\udfff escape), so it is not Unicode text"
            ) from None
        raise


def _encode_valid_lists(
    tokenizer, texts: list[str], with_offsets: bool
) -> list[tuple[list[int], list[tuple[int, int]] | None]]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.truncation is None and backend.padding is None:
        # the Rust tokenizer's own batch call, as transformers makes it for these arguments, without the dicts of
        # Python lists transformers builds from its result: on a GPU host most of the tokenizing time went there.
        # Without offsets, its call that does not track them (a fifth faster on MiniLM's tokenizer). A backend
        # still holding truncation or padding (from tokenizer.json, or another caller) goes through transformers,
        # which clears both for a call without them.
        if not with_offsets and hasattr(backend, "encode_batch_fast"):
            return [(encoding.ids, None) for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)]
        return [
            (encoding.ids, encoding.offsets if with_offsets else None)
            for encoding in backend.encode_batch(texts, add_special_tokens=False)
        ]
    encoded = tokenizer(
        texts,
        add_special_tokens=False,
        truncation=False,
        return_offsets_mapping=with_offsets,
        return_attention_mask=False,
        return_token_type_ids=False,
    )
    if not with_offsets:
        return [(ids, None) for ids in encoded["input_ids"]]
    return [
        (ids, [(start, end) for start, end in offsets])
        for ids, offsets in zip(encoded["input_ids"], encoded["offset_mapping"])
    ]


def _groups(pieces: list[tuple[int, int, int]], call_chars: int) -> Iterator[list[tuple[int, int, int]]]:
    group: list[tuple[int, int, int]] = []
    chars = 0
    for piece in pieces:
        size = piece[2] - piece[1]
        if group and chars + size > call_chars:
            yield group
            group, chars = [], 0
        group.append(piece)
        chars += size
    if group:
        yield group


def _pairs(bounds: list[int]) -> list[tuple[int, int]]:
    return list(zip(bounds[:-1], bounds[1:]))


def clear_tokenizer_caches(tokenizer) -> None:
    """Drop what the fast tokenizer caches between calls (BPE models keep a word → pieces cache;
    WordPiece keeps none): one of the things the memory guard releases before it refuses a batch."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    clear = getattr(model, "_clear_cache", None)  # tokenizers' own API for it, BPE / Unigram models only
    if clear is not None:
        clear()
