"""The embed job: tokenize and window a block of texts, then pool and merge each text's window results.

:class:`EmbedJob` is what the stream loop (``runner.py``) and ``memfit serve`` run for embeddings, over
a :class:`~memfit.engine.runtime.Runtime`: ``prepare`` cuts windows (each carrying the prompt, if any),
``finish`` merges the engine's per-window outputs into one pooled vector (shortened to ``dimensions``, then
normalized when asked, as sentence-transformers' ``truncate_dim`` does; and, when asked, one row per token)
per text, ``table`` writes a part.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pyarrow as pa

from memfit.data.chunking import (
    LongMode,
    TokenizedText,
    Window,
    merged_token_rows,
    prompt_token_count,
    truncated_count,
    window_texts,
)
from memfit.data.prompts import Prompt
from memfit.engine.pooling import Pooling, l2_normalize, merge_pooled, merge_tokens
from memfit.jobs.runner import Counts, PreparedBlock
from memfit.engine.runtime import Runtime
from memfit.io.sinks import ids_array
from memfit.io.vector_codec import VectorCodec
from memfit.data.sources import Record
from memfit.io.token_table import TokenFile, TokenStream


@dataclass(frozen=True, slots=True)
class TokenEmbedding:
    """Token-level output for one text: one row per token, no padding, in text order."""

    token_ids: np.ndarray  # (n,) int64
    offsets: np.ndarray  # (n, 2) int32 character [start, end); (0, 0) for special tokens
    embeddings: np.ndarray  # (n, d) float32
    special_mask: np.ndarray  # (n,) bool, True for the model's special tokens ([CLS], [SEP], …)


@dataclass
class EmbedBlock:
    """One block's merged results, in record order."""

    pooled: np.ndarray | None  # (n, d) float32
    tokens: list[TokenEmbedding] | None
    counts: Counts


@dataclass(frozen=True)
class EmbedJob:
    """Tokenize + window a block (prepare), then merge window results per text (finish).

    With ``tokens_out`` the token rows are streamed to the output's token table batch by batch (the
    block's results keep only the pooled parts); without it, :meth:`finish` merges them per text in
    memory (for :meth:`memfit.Encoder.embed_tokens`, whose caller asked for them in memory).
    """

    runtime: Runtime
    pooling: Pooling | None
    normalize: bool
    keep_tokens: bool
    long: LongMode
    stride: int
    tokens_out: TokenStream | None = None
    codec: VectorCodec = field(default_factory=lambda: VectorCodec("float32"))  # how pooled vectors are stored
    inputs_key: str | None = "windows"
    prompt: Prompt | None = None  # put before every text, in every window
    dimensions: int | None = None  # the leading dimensions of each pooled vector kept (Matryoshka)

    def prepare(self, records: Sequence[Record]) -> PreparedBlock:
        rt = self.runtime
        tokenized, windows = window_texts(
            rt.tokenizer,
            [r.text for r in records],
            rt.special,
            rt.max_length,
            self.long,
            self.stride,
            self.prompt,
            call_chars=rt.host.tokenize_call_chars,
            offsets=self.keep_tokens,  # only token rows carry character offsets
        )
        keep = None
        if self.tokens_out is not None:
            keep = functools.partial(self._stream_tokens, self._token_keys(records, tokenized, windows))
        return PreparedBlock(windows=windows, context=tokenized, keep=keep)

    def finish(self, records: Sequence[Record], prepared: PreparedBlock, outputs: list) -> EmbedBlock:
        per_text: list[list] = [[] for _ in records]
        for window, output in zip(prepared.windows, outputs):
            per_text[window.item].append(output)
        pooled = None
        if self.pooling is not None:
            pooled = np.stack([merge_pooled(parts, self.pooling) for parts in per_text])
            if self.dimensions is not None:
                pooled = np.ascontiguousarray(pooled[:, : self.dimensions])
            if self.normalize:
                pooled = l2_normalize(pooled)
        tokens = None
        tokenized: list[TokenizedText] = prepared.context
        if self.keep_tokens and self.tokens_out is None:
            tokens = [self._token_embedding(t, parts) for t, parts in zip(tokenized, per_text)]
        content = self.runtime.max_length - self.runtime.special.single_overhead - prompt_token_count(self.prompt)
        truncated = truncated_count((len(t.ids) for t in tokenized), self.long, content)
        return EmbedBlock(pooled=pooled, tokens=tokens, counts=Counts.of_block(records, prepared.windows, truncated))

    def table(self, records: Sequence[Record], block: EmbedBlock) -> pa.Table:
        """One output part: ``id`` and the pooled ``embedding``, stored as :attr:`codec` says (and the field's
        metadata says how)."""
        ids = ids_array([r.id for r in records])
        embedding, column = self.codec.column(block.pooled)
        return pa.Table.from_arrays([ids, column], schema=pa.schema([pa.field("id", ids.type), embedding]))

    def end_part(self) -> TokenFile | None:
        """The block's token file, when token rows are streamed to disk."""
        return None if self.tokens_out is None else self.tokens_out.end_part()

    def _token_rows(self, tokens: TokenizedText) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The ids, character offsets and special-token flags of a text's merged token sequence."""
        enc = self.runtime
        ids, offsets = merged_token_rows(
            tokens, enc.special, self.long, enc.max_length, prompt_token_count(self.prompt)
        )
        special = np.zeros(len(ids), dtype=bool)
        special[: len(enc.special.prefix)] = True
        special[len(ids) - len(enc.special.suffix) :] = True
        return ids, offsets, special

    def _token_embedding(self, tokens: TokenizedText, parts: list) -> TokenEmbedding:
        ids, offsets, special = self._token_rows(tokens)
        rows = merge_tokens(parts)
        if len(rows) != len(ids):
            raise AssertionError(f"merged {len(rows)} token rows for {len(ids)} tokens; this is a bug")
        return TokenEmbedding(token_ids=ids, offsets=offsets, embeddings=rows, special_mask=special)

    def _token_keys(
        self, records: Sequence[Record], tokenized: list[TokenizedText], windows: list[Window]
    ) -> dict[tuple[int, int], tuple]:
        """Per window ``(item, index)``: its text's input row, the merged position of its first owned
        row, and its text's merged ids / offsets / special flags (shared by the text's windows)."""
        rows = [self._token_rows(t) for t in tokenized]
        next_position = [0] * len(records)
        keys = {}
        for w in windows:  # a text's windows come in order and own consecutive runs of its tokens
            keys[(w.item, w.index)] = (records[w.item].row, next_position[w.item], rows[w.item])
            next_position[w.item] += w.token_count
        for item, (ids, _, _) in enumerate(rows):
            if next_position[item] != len(ids):
                raise AssertionError(f"windows own {next_position[item]} of {len(ids)} tokens; this is a bug")
        return keys

    def _stream_tokens(self, keys: dict, windows: Sequence[Window], outputs: list) -> list:
        """Send a batch's owned token rows to the token table; keep only what pooling needs."""
        for window, output in zip(windows, outputs):
            row, position, (ids, offsets, special) = keys[(window.item, window.index)]
            end = position + window.token_count
            self.tokens_out.add(
                row, position, ids[position:end], offsets[position:end], special[position:end], output.tokens
            )
        return [dataclasses.replace(output, tokens=None) for output in outputs]


def without_specials(t: TokenEmbedding) -> TokenEmbedding:
    keep = ~t.special_mask
    return TokenEmbedding(t.token_ids[keep], t.offsets[keep], t.embeddings[keep], t.special_mask[keep])
