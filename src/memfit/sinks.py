"""Stage 6: write results as Parquet parts plus a manifest, crash-safely, and read them back.

An output directory holds ``part-00000.parquet``, ``part-00001.parquet``, … and ``manifest.json``.
Each part is written to a temporary name and renamed into place, then the manifest (also written to a
temporary file and renamed) records it. A part exists in the manifest only once it is complete on disk,
so a run killed at any point (Ctrl-C, ``kill -9``) leaves a directory whose manifest lists only
complete parts; ``--resume`` removes anything else and continues after the last listed row. The
manifest also stores the run's settings, and a resume with different settings is refused rather than
mixing two kinds of vectors in one output.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from memfit.errors import OutputError
from memfit.fingerprint import check_same_input
from memfit.preflight import MANIFEST, check_output_dir, holds_output

log = logging.getLogger("memfit")

FORMAT_VERSION = 1


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_manifest(out_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(out_dir) / MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise OutputError(f"{out_dir}: no {MANIFEST}; not a memfit output directory") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise OutputError(f"{path}: cannot read manifest: {exc}") from None


class PartWriter:
    """Appends parts to an output directory and keeps its manifest true after every part.

    ``settings`` describe what the rows mean (model, pooling, …); ``resume`` continues a directory
    written with the same settings from the same input (``input_fingerprint``, see ``fingerprint.py``;
    ``None`` for stdin and in-memory texts, which cannot be resumed), skipping the rows it already
    holds (:attr:`rows_done`). Every listed part is verified first (:meth:`verify_parts`).

    The directory is created with the first part (or at :meth:`finish` for an empty input), so a run
    that stops on its input before writing anything leaves nothing behind.
    """

    def __init__(self, out_dir: str | os.PathLike, settings: dict[str, Any], resume: bool = False,
                 input_fingerprint: dict[str, Any] | None = None):
        self.dir = Path(out_dir)
        self.settings = settings
        check_output_dir(self.dir, resume)
        self._created = (self.dir / MANIFEST).is_file()
        self.manifest = {
            "format_version": FORMAT_VERSION,
            "settings": settings,
            "input_fingerprint": input_fingerprint,
            "parts": [],
            "rows": 0,
            "counts": {},
            "complete": False,
        }
        if holds_output(self.dir):  # check_output_dir refused it unless resume is set
            previous = read_manifest(self.dir)
            self._check_same_settings(previous.get("settings", {}))
            check_same_input(previous.get("input_fingerprint"), input_fingerprint, str(settings.get("input")),
                             self.dir)
            self.manifest = previous
            self.verify_parts()
        if self._created:
            self._remove_unlisted_files()

    @property
    def rows_done(self) -> int:
        return int(self.manifest["rows"])

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    def update_info(self, **info: Any) -> None:
        """Record facts learned during the run (dimension, measured quality, …) in the manifest."""
        self.manifest.update(info)
        if self._created:
            self._save()

    def write_part(self, table: pa.Table, counts: dict[str, int] | None = None) -> None:
        """Write one complete part, then record it (and add ``counts`` to the running totals)."""
        self._create_dir()
        index = len(self.manifest["parts"])
        name = f"part-{index:05d}.parquet"
        tmp = self.dir / (name + ".tmp")
        # Dictionary encoding and min/max statistics are useless on float vectors and cost memory: with
        # them, writing a 300 MiB token matrix peaked 2.7 GiB above it, without them 1.3 GiB (measured).
        # Row groups of 256 rows bound the writer's buffers for parts of many texts.
        pq.write_table(table, tmp, compression="zstd", use_dictionary=False, write_statistics=["id"],
                       row_group_size=256)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, self.dir / name)
        self.manifest["parts"].append({"file": name, "rows": table.num_rows, "first_row": self.rows_done,
                                       "bytes": (self.dir / name).stat().st_size,
                                       "counts": {key: int(value) for key, value in (counts or {}).items()}})
        self.manifest["rows"] = self.rows_done + table.num_rows
        self._total_counts()
        self._save()

    def finish(self) -> None:
        self.manifest["complete"] = True
        self._save()

    def verify_parts(self) -> None:
        """Check every file of every listed part against what the manifest recorded when it was committed.

        A part is sound when its file exists, has the recorded size in bytes and a readable Parquet
        footer giving the recorded row count. Parts are written in row order, so from the first
        unsound part on nothing is kept: the manifest is cut back to the rows before it (and says so
        on stderr), the later files are removed, and the resumed run computes those rows again.
        """
        parts = self.manifest["parts"]
        for index, entry in enumerate(parts):
            problem = next(filter(None, (self._file_problem(*listed) for listed in _listed_files(entry))), None)
            if problem is None:
                continue
            log.warning("%s; recomputing from row %d (%d of %d parts kept)", problem, entry["first_row"], index,
                        len(parts))
            del parts[index:]
            self.manifest["rows"] = entry["first_row"]
            self.manifest["complete"] = False
            self._total_counts()
            self._save()
            return

    def _file_problem(self, name: str, rows: int, size: int | None) -> str | None:
        """What is wrong with one listed file, or ``None``."""
        path = self.dir / name
        if not path.is_file():
            return f"{path}: listed in {MANIFEST} but missing"
        actual = path.stat().st_size
        if size is not None and actual != size:
            return f"{path}: {actual} bytes on disk, {size} when it was written (truncated or overwritten)"
        try:
            found = pq.ParquetFile(path).metadata.num_rows
        except (pa.ArrowException, OSError) as exc:
            return f"{path}: not readable Parquet ({' '.join(str(exc).split())})"
        if found != rows:
            return f"{path}: holds {found} rows, {rows} when it was written"
        return None

    def _total_counts(self) -> None:
        totals: dict[str, int] = {}
        for entry in self.manifest["parts"]:
            for key, value in entry.get("counts", {}).items():
                totals[key] = totals.get(key, 0) + value
        self.manifest["counts"] = totals

    def _create_dir(self) -> None:
        if self._created:
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"{self.dir}: cannot create output directory: {exc.strerror}") from None
        self._created = True

    def _save(self) -> None:
        self._create_dir()
        _atomic_write_bytes(self.dir / MANIFEST, json.dumps(self.manifest, indent=2, default=str).encode())

    def _check_same_settings(self, previous: dict[str, Any]) -> None:
        current = json.loads(json.dumps(self.settings, default=str))
        differing = sorted(k for k in set(previous) | set(current) if previous.get(k) != current.get(k))
        if differing:
            details = ", ".join(f"{k}: {previous.get(k)!r} → {current.get(k)!r}" for k in differing)
            raise OutputError(f"{self.dir}: cannot resume, settings differ from the first run ({details})")

    def _remove_unlisted_files(self) -> None:
        """Drop temporary files and parts written after the last manifest update (an interrupted run)."""
        listed = {p["file"] for p in self.manifest["parts"]} | {MANIFEST}
        for path in self.dir.iterdir():
            if path.name not in listed and (path.suffix in (".tmp", ".parquet")):
                path.unlink()


def _listed_files(entry: dict[str, Any]) -> Iterator[tuple[str, int, int | None]]:
    """``(file, rows, bytes)`` of every file a manifest part entry lists: its own, and that of any
    sub-entry that names a file of its own (e.g. a separate token table)."""
    yield entry["file"], int(entry["rows"]), entry.get("bytes")
    for value in entry.values():
        if isinstance(value, dict) and "file" in value:
            yield value["file"], int(value["rows"]), value.get("bytes")


def vectors_array(matrix: np.ndarray, value_type: pa.DataType = pa.float32()) -> pa.FixedSizeListArray:
    """An (N, d) matrix as a Parquet-friendly fixed-size-list column."""
    n, dim = matrix.shape
    values = pa.array(np.ascontiguousarray(matrix).reshape(-1), type=value_type)
    return pa.FixedSizeListArray.from_arrays(values, dim)


def ragged_vectors_array(rows: Sequence[np.ndarray], value_type: pa.DataType = pa.float32()) -> pa.ListArray:
    """A list of (n_i, d) matrices as a list-of-fixed-size-list column (one list per text)."""
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(r) for r in rows])
    values = vectors_array(np.concatenate(rows, axis=0), value_type)
    return pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), values)


def ragged_array(rows: Sequence[np.ndarray], value_type: pa.DataType) -> pa.ListArray:
    """A list of 1-d arrays as a list column."""
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(r) for r in rows])
    values = pa.array(np.concatenate(rows) if rows else np.zeros(0), type=value_type)
    return pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), values)


def ids_array(ids: Sequence[int | str]) -> pa.Array:
    """Row numbers as int64, user ids (from ``--id-field``) as strings."""
    if ids and isinstance(ids[0], str):
        return pa.array(ids, type=pa.string())
    return pa.array(ids, type=pa.int64())


@dataclass
class EmbeddingOutput:
    """What :func:`read` returns: ids in input order, the pooled matrix and, if written, token arrays."""

    ids: list
    embeddings: np.ndarray  # (N, d) float32
    token_ids: list[np.ndarray] | None = None
    token_offsets: list[np.ndarray] | None = None
    token_embeddings: list[np.ndarray] | None = None
    manifest: dict[str, Any] = field(default_factory=dict)


def read(out_dir: str | os.PathLike) -> EmbeddingOutput:
    """Load a memfit embedding output directory (only parts listed in its manifest)."""
    manifest = read_manifest(out_dir)
    files = [Path(out_dir) / p["file"] for p in manifest["parts"]]
    if not files:
        return EmbeddingOutput(ids=[], embeddings=np.zeros((0, int(manifest.get("dim") or 0)), np.float32),
                               manifest=manifest)
    table = pa.concat_tables([pq.read_table(f) for f in files])
    dim = table.schema.field("embedding").type.list_size
    embeddings = table.column("embedding").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    out = EmbeddingOutput(
        ids=table.column("id").to_pylist(),
        embeddings=embeddings.reshape(-1, dim).astype(np.float32, copy=False),
        manifest=manifest,
    )
    if "token_embeddings" in table.column_names:
        out.token_ids = _ragged_to_numpy(table.column("token_ids"))
        out.token_offsets = [a.reshape(-1, 2) for a in _ragged_to_numpy(table.column("token_offsets"), nested=True)]
        out.token_embeddings = [
            a.reshape(-1, dim).astype(np.float32, copy=False)
            for a in _ragged_to_numpy(table.column("token_embeddings"), nested=True)
        ]
    return out


def _ragged_to_numpy(column: pa.ChunkedArray, nested: bool = False) -> list[np.ndarray]:
    array = column.combine_chunks()
    offsets = array.offsets.to_numpy()
    values = array.values.flatten() if nested else array.values
    flat = values.to_numpy(zero_copy_only=False)
    width = array.values.type.list_size if nested else 1
    return [flat[offsets[i] * width: offsets[i + 1] * width] for i in range(len(array))]
