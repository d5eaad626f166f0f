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
which are then exactly the whole text's first ones. Tokenizing is most of the host's work per text, and
on a GPU the host is what the model waits for (docs/benchmarks.md, "On a GPU").
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

TOKENIZE_PIECE_CHARS = 32_768
# Characters per tokenizer call where host memory is not the budget (a CUDA job): the fast tokenizer spreads
# one call's texts over its threads, and calls of a few long heads each left a 16-core host mostly idle
# while the GPU waited on it. ~800 bytes a token, ~4 characters a token of English: ~100 MB per call.
TOKENIZE_CALL_CHARS_UNBOUNDED = 524_288
SEAM_CONTEXT = 256
SEAM_TRIES = 16
# Where a truncating job first cuts a long text: this many characters per token it needs. English runs
# 4-5 characters a WordPiece or BPE token, CJK text 1-2; a head that still holds too few tokens (long
# numbers, URLs) is tokenized again whole.
HEAD_CHARS_PER_TOKEN = 8
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
    ends = [_head_end(tokenizer, text, max_tokens) for text in texts]
    heads = [text[:end] for text, end in zip(texts, ends)]
    tokenized = _tokenize_whole(tokenizer, heads, piece_chars, call_chars, offsets)
    short = [
        i for i, (text, end) in enumerate(zip(texts, ends)) if end < len(text) and len(tokenized[i].ids) < max_tokens
    ]
    wholes = _tokenize_whole(tokenizer, [texts[i] for i in short], piece_chars, call_chars, offsets)
    for i, whole in zip(short, wholes):
        tokenized[i] = whole
    return tokenized


def _head_end(tokenizer, text: str, max_tokens: int) -> int:
    """Where to stop tokenizing ``text`` when only its first ``max_tokens`` tokens are needed: a checked seam
    about :data:`HEAD_CHARS_PER_TOKEN` characters a token in, or the end (a short text, or no seam found)."""
    head = max_tokens * HEAD_CHARS_PER_TOKEN
    if len(text) <= 2 * head:
        return len(text)  # finding and checking a seam would cost more than tokenizing the rest
    seam = _find_seam(tokenizer, text, head, head + SEAM_CONTEXT)
    return len(text) if seam is None else seam


def _tokenize_whole(
    tokenizer, texts: Sequence[str], piece_chars: int, call_chars: int, with_offsets: bool
) -> list[TokenizedText]:
    pieces = [
        (i, start, end)
        for i, text in enumerate(texts)
        for start, end in _pairs(piece_bounds(tokenizer, text, piece_chars))
    ]
    ids: list[list[np.ndarray]] = [[] for _ in texts]
    offsets: list[list[np.ndarray]] = [[] for _ in texts]
    for group in _groups(pieces, call_chars):
        encoded = _encode(tokenizer, [texts[i][start:end] for i, start, end in group], with_offsets)
        for (i, start, _), (piece_ids, piece_offsets) in zip(group, encoded):
            ids[i].append(piece_ids)
            if piece_offsets is not None:
                offsets[i].append(piece_offsets + start)
    return [
        TokenizedText(ids=np.concatenate(i), offsets=np.concatenate(o) if with_offsets else None)
        for i, o in zip(ids, offsets)
    ]


def piece_bounds(tokenizer, text: str, piece_chars: int) -> list[int]:
    """``[0, seam, seam, ..., len(text)]``: pieces of at most ``piece_chars`` characters where seams exist."""
    bounds = [0]
    while len(text) - bounds[-1] > piece_chars:
        seam = _find_seam(tokenizer, text, bounds[-1] + piece_chars // 2, bounds[-1] + piece_chars)
        if seam is None:
            break  # no safe place to cut: the rest is tokenized whole
        bounds.append(seam)
    bounds.append(len(text))
    return bounds


def _find_seam(tokenizer, text: str, low: int, high: int) -> int | None:
    """The last checked seam in ``(low, high]``: whitespace first, then any character boundary (texts
    without spaces, such as Chinese, where character-level tokenizers cut anywhere)."""
    spaces = [m.start() for m in _SEAM_CANDIDATE.finditer(text, low, high)][::-1]
    boundaries = range(high, low, -1)
    for position in [*spaces[:SEAM_TRIES], *list(boundaries)[:SEAM_TRIES]]:
        if _is_seam(tokenizer, text, position):
            return position
    return None


def _is_seam(tokenizer, text: str, position: int) -> bool:
    start, end = max(0, position - SEAM_CONTEXT), min(len(text), position + SEAM_CONTEXT)
    (whole_ids, whole_offsets), (left_ids, left_offsets), (right_ids, right_offsets) = _encode(
        tokenizer, [text[start:end], text[start:position], text[position:end]]
    )
    return np.array_equal(whole_ids, np.concatenate([left_ids, right_ids])) and np.array_equal(
        whole_offsets, np.concatenate([left_offsets, right_offsets + (position - start)])
    )


def _encode(tokenizer, texts: list[str], with_offsets: bool = True) -> list[tuple[np.ndarray, np.ndarray | None]]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.truncation is None and backend.padding is None:
        # the Rust tokenizer's own batch call, as transformers makes it for these arguments, without the dicts of
        # Python lists transformers builds from its result: on a GPU host most of the tokenizing time went there.
        # A backend still holding truncation or padding (from tokenizer.json, or another caller) goes through
        # transformers, which clears both for a call without them.
        return [
            (np.array(encoding.ids, dtype=np.int64), _offsets_array(encoding) if with_offsets else None)
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
        return [(np.asarray(ids, dtype=np.int64), None) for ids in encoded["input_ids"]]
    return [
        (np.asarray(ids, dtype=np.int64), np.asarray(offsets, dtype=np.int32).reshape(-1, 2))
        for ids, offsets in zip(encoded["input_ids"], encoded["offset_mapping"])
    ]


def _offsets_array(encoding) -> np.ndarray:
    return np.fromiter(itertools.chain.from_iterable(encoding.offsets), np.int32, 2 * len(encoding.ids)).reshape(-1, 2)


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
