"""Tokenize texts of any length in bounded memory, with the same tokens as one call on the whole text.

The fast tokenizer's own memory grows with the tokens of one call: measured with all-MiniLM-L6-v2's
tokenizer, ~800 bytes per token (its Encoding objects and the Python lists transformers turns them
into), i.e. ~160 MiB for a 1,000,000-character English text and ~220 MiB for 300,000 characters of
Chinese. memfit therefore never hands the tokenizer more than ``piece_chars`` characters at once:
short texts are tokenized in groups that add up to at most that, and a longer text is cut into pieces
at *seams* and its pieces' tokens are concatenated (offsets shifted back to the whole text).

A seam is a place where cutting changes nothing: the text around it, tokenized whole, gives exactly
the tokens (and offsets) of its two halves tokenized apart. Candidates are whitespace positions (the
space goes to the second piece, where byte-level BPE and SentencePiece attach it to the next word);
each is checked by tokenizing ``SEAM_CONTEXT`` characters on both sides, both ways. A text without a
checked seam in reach is tokenized whole, never cut at a place that could change its tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

TOKENIZE_PIECE_CHARS = 32_768
SEAM_CONTEXT = 256
SEAM_TRIES = 16
_SEAM_CANDIDATE = re.compile(r"\s(?=\S)")


@dataclass(frozen=True, slots=True)
class TokenizedText:
    """One text's content tokens (no special tokens) and their character offsets."""

    ids: np.ndarray  # (n,) int64
    offsets: np.ndarray  # (n, 2) int32, character [start, end) of each token


def tokenize_texts(tokenizer, texts: Sequence[str], piece_chars: int = TOKENIZE_PIECE_CHARS) -> list[TokenizedText]:
    """Tokenize a block of texts in calls of at most ``piece_chars`` characters (see the module doc).

    Each call is batched, so the fast (Rust) tokenizer still works on several texts in parallel."""
    pieces = [
        (i, start, end)
        for i, text in enumerate(texts)
        for start, end in _pairs(piece_bounds(tokenizer, text, piece_chars))
    ]
    ids: list[list[np.ndarray]] = [[] for _ in texts]
    offsets: list[list[np.ndarray]] = [[] for _ in texts]
    for group in _groups(pieces, piece_chars):
        encoded = _encode(tokenizer, [texts[i][start:end] for i, start, end in group])
        for (i, start, _), (piece_ids, piece_offsets) in zip(group, encoded):
            ids[i].append(piece_ids)
            offsets[i].append(piece_offsets + start)
    return [TokenizedText(ids=np.concatenate(i), offsets=np.concatenate(o)) for i, o in zip(ids, offsets)]


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


def _encode(tokenizer, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    encoded = tokenizer(
        texts,
        add_special_tokens=False,
        truncation=False,
        return_offsets_mapping=True,
        return_attention_mask=False,
        return_token_type_ids=False,
    )
    return [
        (np.asarray(ids, dtype=np.int64), np.asarray(offsets, dtype=np.int32).reshape(-1, 2))
        for ids, offsets in zip(encoded["input_ids"], encoded["offset_mapping"])
    ]


def _groups(pieces: list[tuple[int, int, int]], piece_chars: int) -> Iterator[list[tuple[int, int, int]]]:
    group: list[tuple[int, int, int]] = []
    chars = 0
    for piece in pieces:
        size = piece[2] - piece[1]
        if group and chars + size > piece_chars:
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
