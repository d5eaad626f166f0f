"""The token table: one Parquet row per token, written in bounded pieces while a block still runs.

A text's token vectors can be larger than the whole memory budget (a 1,000,000-character text is
~230k tokens x 384 floats = ~350 MB). They therefore never exist in one piece: each batch's owned
token rows (see ``chunking.py``) leave the engine, are appended to a :class:`TokenPieces` buffer, and
every ``piece_bytes`` the buffer becomes one Arrow table that the background writer appends to the
part's ``tokens-NNNNN.parquet`` as one row group. Rows are keyed by the input ``row`` (0-based, the
same numbering as the pooled table) and the token's ``position`` in the text's merged sequence, so a
text may span many row groups and the rows of one file need not be in text order; readers sort by
``(row, position)``.

Columns: ``row`` int64, ``position`` int32, ``token_id`` int32, ``start`` / ``end`` int32 (character
offsets, ``0, 0`` for special tokens), ``special`` bool, ``embedding`` fixed-size list of float32 (or
float16).
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from memfit.io.sinks import BackgroundWriter, numpy_column, vectors_array
from memfit.io.storage import OutputLocation, PendingFile

TOKEN_FILE_PATTERN = "tokens-{index:05d}.parquet"


class TokenPieces:
    """Collects token rows from the engine's batches and cuts them into tables of about ``piece_bytes``."""

    def __init__(self, value_type: pa.DataType, piece_bytes: int):
        self.value_type = value_type
        self.numpy_type = value_type.to_pandas_dtype()
        self.piece_bytes = piece_bytes
        self._columns: list[tuple[np.ndarray, ...]] = []
        self._bytes = 0

    def add(
        self,
        row: int,
        position: int,
        token_ids: np.ndarray,
        offsets: np.ndarray,
        special: np.ndarray,
        vectors: np.ndarray,
    ) -> pa.Table | None:
        """Append one window's owned rows (positions ``position ...``); return a full piece when one is ready."""
        n = len(vectors)
        self._columns.append(
            (
                np.full(n, row, dtype=np.int64),
                np.arange(position, position + n, dtype=np.int32),
                token_ids.astype(np.int32, copy=False),
                offsets.astype(np.int32, copy=False),
                special,
                vectors.astype(self.numpy_type, copy=False),
            )
        )
        self._bytes += sum(column.nbytes for column in self._columns[-1])
        return self.take() if self._bytes >= self.piece_bytes else None

    def take(self) -> pa.Table | None:
        """The rows collected so far as one table (None when there are none); the buffer starts empty."""
        if not self._columns:
            return None
        rows, positions, ids, offsets, special, vectors = (np.concatenate(c) for c in zip(*self._columns))
        self._columns, self._bytes = [], 0
        return pa.table(
            {
                "row": numpy_column(rows),
                "position": numpy_column(positions),
                "token_id": numpy_column(ids),
                "start": numpy_column(offsets[:, 0]),
                "end": numpy_column(offsets[:, 1]),
                "special": numpy_column(special),
                "embedding": vectors_array(vectors, self.value_type),
            }
        )


class TokenFile:
    """One part's token file, appended to one piece (row group) at a time, then put in place whole.

    Used by one thread at a time (a local run's background writer, a Ray worker); the temporary file is what a
    killed run leaves behind, and ``--resume`` deletes it (it is not listed in the manifest)."""

    def __init__(self, out_dir: OutputLocation, index: int):
        self.index = index
        self.name = TOKEN_FILE_PATTERN.format(index=index)
        self.location = out_dir
        self._pending: PendingFile | None = None
        self._writer: pq.ParquetWriter | None = None
        self.rows = 0

    def append(self, table: pa.Table) -> None:
        try:
            if self._writer is None:
                self.location.make()  # PartWriter creates it with the first part only
                self._pending = self.location.pending(self.name)
                # no dictionary encoding or statistics on float vectors: both cost memory and buy nothing
                self._writer = pq.ParquetWriter(
                    self._pending.target,
                    table.schema,
                    compression="zstd",
                    use_dictionary=False,
                    write_statistics=["row"],
                )
            self._writer.write_table(table, row_group_size=table.num_rows)
        except BaseException as exc:
            self.abandon()
            self.location.raise_failed_write(self.name, exc)
        self.rows += table.num_rows

    def abandon(self) -> None:
        """Drop the file after a failure, so nothing of it appears under its name (:meth:`PendingFile.abandon`)."""
        if self._pending is not None:
            self._pending.abandon()
            self._pending = self._writer = None

    def commit(self) -> dict | None:
        """Close and rename the file into place; its manifest entry (None when the part has no tokens)."""
        if self._writer is None or self._pending is None:
            return None
        try:
            self._writer.close()
            size = self._pending.commit()
        except BaseException as exc:
            self.abandon()
            self.location.raise_failed_write(self.name, exc)
        return {"file": self.name, "rows": self.rows, "bytes": size}


def read_token_table(
    files: Sequence[Path | BinaryIO], dim: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """All token rows of ``files`` sorted by (row, position): rows, token ids, offsets (n, 2), vectors (n, d);
    ``dim`` is the width of the empty result when there are no files."""
    if not files:
        return (
            np.zeros(0, np.int64),
            np.zeros(0, np.int64),
            np.zeros((0, 2), np.int32),
            np.zeros((0, dim), np.float32),
        )
    table = pa.concat_tables([pq.read_table(f) for f in files])
    dim = table.schema.field("embedding").type.list_size  # the model's width, even where pooled vectors are shortened
    rows = table.column("row").to_numpy()
    order = np.lexsort((table.column("position").to_numpy(), rows))
    vectors = table.column("embedding").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    offsets = np.stack([table.column("start").to_numpy(), table.column("end").to_numpy()], axis=1)
    return (
        rows[order],
        table.column("token_id").to_numpy()[order].astype(np.int64),
        offsets[order],
        vectors.reshape(-1, dim)[order].astype(np.float32, copy=False),
    )


class TokenStream:
    """The main thread's end of the token output: rows in, pieces queued on the background writer.

    One :class:`TokenFile` per part: :meth:`end_part` flushes the last piece of the current part and
    returns its file, which the part's commit task (queued after the pieces) closes and renames."""

    def __init__(
        self, out_dir: OutputLocation, first_part_index: int, background: BackgroundWriter, pieces: TokenPieces
    ):
        self.out_dir = out_dir
        self.background = background
        self.pieces = pieces
        self.file = TokenFile(out_dir, first_part_index)

    def add(
        self,
        row: int,
        position: int,
        token_ids: np.ndarray,
        offsets: np.ndarray,
        special: np.ndarray,
        vectors: np.ndarray,
    ) -> None:
        piece = self.pieces.add(row, position, token_ids, offsets, special, vectors)
        if piece is not None:
            self.background.submit(self.file.append, piece)

    def end_part(self) -> TokenFile:
        piece = self.pieces.take()
        if piece is not None:
            self.background.submit(self.file.append, piece)
        finished, self.file = self.file, TokenFile(self.out_dir, self.file.index + 1)
        return finished
