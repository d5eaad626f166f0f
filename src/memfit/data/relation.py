"""Training inputs: labelled records → model inputs; relation records get entity marker tokens.

Text and text-pair records are read with ``sources.read_records`` and cut with the chunking stage
(``truncate`` windows, ``make_pair_window``), so training sees exactly the inputs inference builds.

Relation classification follows the DeepKE / "matching the blanks" setup (Baldini Soares et al., 2019):
the head entity is wrapped in ``[E1] … [/E1]`` and the tail entity in ``[E2] … [/E2]``, the markers are
added to the tokenizer as special tokens (so they are never split or lower-cased) and to the embedding
matrix, and the model classifies the marked sentence. Classification reads the standard ``[CLS]`` pooled
output: the saved model is then a plain ``AutoModelForSequenceClassification`` that transformers (and
``memfit classify``) load without custom code; the markers give the encoder the entity positions, which
is what entity-start pooling would add on top.

A record gives the entities either as character spans (``{"start": s, "end": e}`` objects or
``[s, end]`` pairs, ``end`` exclusive, like Python slices) or inline, with the markers already in the
text. A text longer than the window is cut around the entities rather than at its end, so the markers
(and what lies between them) survive truncation.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from memfit.data.chunking import (
    SpecialTokens,
    TokenizedText,
    Window,
    make_pair_window,
    make_windows,
    tokenize_texts,
)
from memfit.errors import ConfigError, InputError
from memfit.data.sources import detect_format, iter_rows, read_records

_TOKENIZE_BLOCK = 2048  # texts per batched tokenizer call

HEAD_START, HEAD_END, TAIL_START, TAIL_END = "[E1]", "[/E1]", "[E2]", "[/E2]"
MARKERS: tuple[str, ...] = (HEAD_START, HEAD_END, TAIL_START, TAIL_END)


@dataclass(frozen=True, slots=True)
class Span:
    """A character range ``[start, end)`` of the text."""

    start: int
    end: int


def add_marker_tokens(tokenizer) -> list[int]:
    """Add the four markers as special tokens (never split, never lower-cased); return their ids.

    Idempotent: a tokenizer saved by an earlier run already has them. The model's embedding matrix must
    then grow to ``len(tokenizer)`` (``resize_token_embeddings``).
    """
    missing = [m for m in MARKERS if m not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
    return tokenizer.convert_tokens_to_ids(list(MARKERS))


def marked_text(path: str, line: int, row: dict[str, Any], text_field: str, head_field: str, tail_field: str) -> str:
    """The record's text with entity markers: inserted at the head/tail spans, or validated when inline."""
    text = row[text_field]
    if not isinstance(text, str):
        raise InputError(path, f"expected a string, got {type(text).__name__}", line, text_field)
    has_head, has_tail = row.get(head_field) is not None, row.get(tail_field) is not None
    if has_head != has_tail:
        absent = tail_field if has_head else head_field
        raise InputError(path, "missing: a relation needs both a head and a tail span", line, absent)
    if not has_head:
        _check_inline_markers(path, line, text, text_field)
        return text
    head = _span(path, line, row[head_field], head_field, len(text))
    tail = _span(path, line, row[tail_field], tail_field, len(text))
    if head.start < tail.end and tail.start < head.end:
        raise InputError(
            path, f"head {head.start}:{head.end} and tail {tail.start}:{tail.end} overlap", line, tail_field
        )
    # Insert from the end so earlier offsets stay valid; spaces keep BPE tokenizers' word boundaries.
    cuts = sorted(
        [
            (head.start, f"{HEAD_START} "),
            (head.end, f" {HEAD_END}"),
            (tail.start, f"{TAIL_START} "),
            (tail.end, f" {TAIL_END}"),
        ],
        key=lambda c: c[0],
        reverse=True,
    )
    for offset, marker in cuts:
        text = text[:offset] + marker + text[offset:]
    return text


def _span(path: str, line: int, value: Any, field: str, text_chars: int) -> Span:
    """Read ``{"start": s, "end": e}``, ``[s, e]`` or (CSV/TSV cells) the same as a JSON string."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise InputError(
                path, f'cannot read span {value!r}; use {{"start": s, "end": e}} or [s, e]', line, field
            ) from None
    if isinstance(value, dict) and "start" in value and "end" in value:
        start, end = value["start"], value["end"]
    elif isinstance(value, (list, tuple)) and len(value) == 2:
        start, end = value
    else:
        raise InputError(path, 'expected a span {"start": s, "end": e} or [s, e] (character offsets)', line, field)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end)):
        raise InputError(path, "span offsets must be integers", line, field)
    if not 0 <= start < end <= text_chars:
        raise InputError(path, f"span {start}:{end} is not inside the text ({text_chars} characters)", line, field)
    return Span(start, end)


def _check_inline_markers(path: str, line: int, text: str, field: str) -> None:
    for start, end in ((HEAD_START, HEAD_END), (TAIL_START, TAIL_END)):
        if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
            raise InputError(
                path,
                f"no head/tail spans, so the text must contain {start} … {end} exactly once in that order",
                line,
                field,
            )


def entity_window_start(ids: np.ndarray, marker_ids: Sequence[int], content_tokens: int) -> int:
    """First content token of a ``content_tokens`` window that keeps the markers, centred on them.

    When head and tail lie further apart than the window, the window starts at the first marker.
    """
    n = len(ids)
    if n <= content_tokens:
        return 0
    positions = np.flatnonzero(np.isin(ids, np.asarray(marker_ids)))
    if positions.size == 0:
        return 0
    first, last = int(positions[0]), int(positions[-1])
    spare = content_tokens - (last + 1 - first)
    if spare <= 0:
        return first
    return min(max(0, first - spare // 2), n - content_tokens)


@dataclass(frozen=True, slots=True)
class Examples:
    """Tokenized training (or eval) examples: model inputs and integer labels."""

    windows: list[Window]
    labels: np.ndarray  # (n,) int64

    def __len__(self) -> int:
        return len(self.windows)


@dataclass(frozen=True, slots=True)
class RowReader:
    """Reads (texts, pairs, labels, lines) of a file; relation rows get their entity markers here."""

    text_field: str
    pair_field: str | None
    label_field: str
    relation: bool
    head_field: str
    tail_field: str
    input_format: str | None

    def read(self, path: str) -> tuple[list[str], list[str] | None, list[str], list[int]]:
        texts: list[str] = []
        pairs: list[str] | None = [] if self.pair_field else None
        labels: list[str] = []
        lines: list[int] = []
        if not self.relation:
            for record in read_records(
                path,
                text_field=self.text_field,
                pair_field=self.pair_field,
                label_field=self.label_field,
                input_format=self.input_format,
            ):
                texts.append(record.text)
                labels.append(record.label)
                lines.append(record.line)
                if pairs is not None:
                    pairs.append(record.text_pair)
            return texts, pairs, labels, lines
        fmt = detect_format(path, self.input_format)
        for line, row in iter_rows(path, fmt, [self.text_field, self.label_field]):
            texts.append(marked_text(path, line, row, self.text_field, self.head_field, self.tail_field))
            label = row[self.label_field]
            if not isinstance(label, (str, int)) or isinstance(label, bool):
                raise InputError(path, f"expected a string or integer label, got {label!r}", line, self.label_field)
            labels.append(str(label))
            lines.append(line)
        return texts, None, labels, lines


def build_examples(
    tokenizer,
    special: SpecialTokens,
    max_length: int,
    marker_ids: Sequence[int],
    texts: list[str],
    pairs: list[str] | None,
    labels: list[str],
    label_ids: dict[str, int],
    path: str,
    lines: list[int],
    label_field: str,
) -> Examples:
    """Tokenize in blocks and build one model input per record (truncated; relations around the entities)."""
    windows: list[Window] = []
    content = max_length - special.single_overhead
    for start in range(0, len(texts), _TOKENIZE_BLOCK):
        block = tokenize_texts(tokenizer, texts[start : start + _TOKENIZE_BLOCK])
        seconds = tokenize_texts(tokenizer, pairs[start : start + _TOKENIZE_BLOCK]) if pairs is not None else None
        for i, tokens in enumerate(block):
            item = start + i
            if seconds is not None:
                try:
                    windows.append(make_pair_window(item, tokens.ids, seconds[i].ids, special, max_length))
                except ConfigError as exc:  # this record's pair: name where it is
                    raise InputError(path, str(exc), lines[item]) from None
                continue
            if marker_ids:
                cut = entity_window_start(tokens.ids, marker_ids, content)
                tokens = TokenizedText(tokens.ids[cut:], tokens.offsets[cut:])
            windows.append(make_windows(item, tokens, special, max_length, "truncate", 0)[0])
    unknown = [i for i, label in enumerate(labels) if label not in label_ids]
    if unknown:
        raise InputError(
            path, f"label {labels[unknown[0]]!r} does not occur in the training data", lines[unknown[0]], label_field
        )
    return Examples(windows=windows, labels=np.asarray([label_ids[label] for label in labels], dtype=np.int64))
