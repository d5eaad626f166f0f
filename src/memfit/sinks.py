"""Stage 6: write results as Parquet parts plus a manifest, crash-safely, in a bounded writer thread.

An output directory holds ``part-00000.parquet``, ``part-00001.parquet``, … and ``manifest.json``;
with token output also ``tokens-00000.parquet``, … (one per part, see ``token_table.py``).
Each part is written to a temporary name and renamed into place, then the manifest (also written to a
temporary file and renamed) records it. A part exists in the manifest only once it is complete on disk,
so a run killed at any point (Ctrl-C, ``kill -9``) leaves a directory whose manifest lists only
complete parts; ``--resume`` removes anything else and continues after the last listed row. The
manifest also stores the run's settings, and a resume with different settings is refused rather than
mixing two kinds of vectors in one output.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from memfit.errors import OutputError

MANIFEST = "manifest.json"
FORMAT_VERSION = 2  # 2: token rows in their own tokens-NNNNN.parquet table


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
    written with the same settings, skipping the rows it already holds (:attr:`rows_done`).
    """

    def __init__(self, out_dir: str | os.PathLike, settings: dict[str, Any], resume: bool = False):
        self.dir = Path(out_dir)
        self.settings = settings
        manifest_path = self.dir / MANIFEST
        if manifest_path.exists():
            if not resume:
                raise OutputError(
                    f"{self.dir}: already holds memfit output; pass --resume to continue it or choose another directory"
                )
            self.manifest = read_manifest(self.dir)
            self._check_same_settings(self.manifest.get("settings", {}))
            self._remove_unlisted_files()
        else:
            if self.dir.exists() and any(self.dir.iterdir()):
                raise OutputError(f"{self.dir}: exists and is not empty (and holds no memfit manifest)")
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise OutputError(f"{self.dir}: cannot create output directory: {exc.strerror}") from None
            self.manifest = {
                "format_version": FORMAT_VERSION,
                "settings": settings,
                "parts": [],
                "rows": 0,
                "counts": {},
                "complete": False,
            }
            self._save()

    @property
    def rows_done(self) -> int:
        return int(self.manifest["rows"])

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    def update_info(self, **info: Any) -> None:
        """Record facts learned during the run (dimension, measured quality, …) in the manifest."""
        self.manifest.update(info)
        self._save()

    @property
    def next_part_index(self) -> int:
        return len(self.manifest["parts"])

    def write_part(self, table: pa.Table, counts: dict[str, int] | None = None, tokens: dict | None = None) -> None:
        """Write one complete part, then record it (and add ``counts`` to the running totals).

        ``tokens``: the manifest entry of the part's token file, already renamed into place
        (:class:`memfit.token_table.TokenFile`); it is listed together with the part, so both or neither
        survive an interruption."""
        index = self.next_part_index
        name = f"part-{index:05d}.parquet"
        tmp = self.dir / (name + ".tmp")
        # Dictionary encoding and min/max statistics are useless on float vectors and cost memory.
        pq.write_table(table, tmp, compression="zstd", use_dictionary=False, write_statistics=["id"])
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, self.dir / name)
        entry = {"file": name, "rows": table.num_rows, "first_row": self.rows_done,
                 "bytes": (self.dir / name).stat().st_size}
        if tokens is not None:
            entry["tokens"] = tokens
        self.manifest["parts"].append(entry)
        self.manifest["rows"] = self.rows_done + table.num_rows
        totals = self.manifest.setdefault("counts", {})
        for key, value in (counts or {}).items():
            totals[key] = totals.get(key, 0) + int(value)
        self._save()

    def finish(self) -> None:
        self.manifest["complete"] = True
        self._save()

    def _save(self) -> None:
        _atomic_write_bytes(self.dir / MANIFEST, json.dumps(self.manifest, indent=2, default=str).encode())

    def _check_same_settings(self, previous: dict[str, Any]) -> None:
        current = json.loads(json.dumps(self.settings, default=str))
        differing = sorted(k for k in set(previous) | set(current) if previous.get(k) != current.get(k))
        if differing:
            details = ", ".join(f"{k}: {previous.get(k)!r} → {current.get(k)!r}" for k in differing)
            raise OutputError(f"{self.dir}: cannot resume, settings differ from the first run ({details})")

    def _remove_unlisted_files(self) -> None:
        """Drop temporary files and parts written after the last manifest update (an interrupted run)."""
        listed = {MANIFEST} | {p["file"] for p in self.manifest["parts"]} | {
            p["tokens"]["file"] for p in self.manifest["parts"] if "tokens" in p}
        for path in self.dir.iterdir():
            if path.name not in listed and (path.suffix in (".tmp", ".parquet")):
                path.unlink()


def vectors_array(matrix: np.ndarray, value_type: pa.DataType = pa.float32()) -> pa.FixedSizeListArray:
    """An (N, d) matrix as a Parquet-friendly fixed-size-list column."""
    n, dim = matrix.shape
    values = pa.array(np.ascontiguousarray(matrix).reshape(-1), type=value_type)
    return pa.FixedSizeListArray.from_arrays(values, dim)


def ids_array(ids: Sequence[int | str]) -> pa.Array:
    """Row numbers as int64, user ids (from ``--id-field``) as strings."""
    if ids and isinstance(ids[0], str):
        return pa.array(ids, type=pa.string())
    return pa.array(ids, type=pa.int64())


class BackgroundWriter:
    """Runs write tasks (Parquet encoding, compression, renames) in one thread, in submission order.

    At most ``capacity`` tasks wait in the queue: :meth:`submit` blocks when it is full, so results
    never pile up in memory faster than the disk takes them (back-pressure), and the memory plan can
    count what is in flight (``capacity`` waiting + one being written). The first error of a task is
    raised by the next :meth:`submit` or by :meth:`close`; later tasks are then skipped.
    """

    def __init__(self, capacity: int = 2):
        self._tasks: queue.Queue = queue.Queue(maxsize=capacity)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="memfit-write", daemon=True)
        self._thread.start()

    def submit(self, task: Callable[..., Any], *args: Any) -> None:
        self._raise_error()
        self._tasks.put((task, args))

    def close(self) -> None:
        """Wait until every submitted task has run; raise the first task error, if any."""
        self._tasks.put(None)
        self._thread.join()
        self._raise_error()

    def __enter__(self) -> "BackgroundWriter":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if exc_info[0] is None:
            self.close()
        else:  # the job failed: finish what is queued (complete parts stay valid), keep the job's error
            self._tasks.put(None)
            self._thread.join()

    def _work(self) -> None:
        while (item := self._tasks.get()) is not None:
            task, args = item
            if self._error is None:
                try:
                    task(*args)
                except BaseException as exc:  # noqa: BLE001 - handed to the submitting thread
                    self._error = exc

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error
