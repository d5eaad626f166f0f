"""Stage 6: write results as Parquet parts plus a manifest, crash-safely, in a bounded writer thread.

An output directory holds ``part-00000.parquet``, ``part-00001.parquet``, … and ``manifest.json``;
with token output also ``tokens-00000.parquet``, … (one per part, see ``token_table.py``).
Each part is written to a temporary name and renamed into place, then the manifest (also written to a
temporary file and renamed) records it. A part exists in the manifest only once it is complete on disk,
so a run killed at any point (Ctrl-C, ``kill -9``) leaves a directory whose manifest lists only
complete parts; ``--resume`` removes anything else and continues after the last listed row. The
manifest also stores the run's settings and a fingerprint of its input, and a resume with different
settings or a changed input is refused rather than mixing two kinds of vectors, or the rows of two
inputs, in one output. Before resuming, every listed file is checked against the size and row count
recorded when it was written; from the first one that fails, the rows are computed again.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from memfit.errors import OutputError
from memfit.atomic import TMP_SUFFIX
from memfit.io.fingerprint import check_same_input
from memfit.io.preflight import MANIFEST, check_output_dir, holds_output
from memfit.io.storage import OutputLocation

log = logging.getLogger("memfit")

FORMAT_VERSION = 2  # 2: token rows in their own tokens-NNNNN.parquet table


def new_manifest(settings: dict[str, Any] | None, input_fingerprint: dict[str, Any] | None) -> dict[str, Any]:
    """The manifest of an output directory before its first part: what every writer (local, Ray) starts from."""
    return {
        "format_version": FORMAT_VERSION,
        "settings": settings,
        "input_fingerprint": input_fingerprint,
        "parts": [],
        "rows": 0,
        "counts": {},
        "complete": False,
    }


def run_info(manifest: dict[str, Any]) -> dict[str, Any]:
    """What a finished run adds to its manifest beyond the parts' layout (memfit's version, the device, the
    dimension, the quality guard's verdict, the backend and why it runs, …): a Ray worker's scratch run hands it
    to the driver's manifest, so that it reads like a local run's."""
    layout = new_manifest(None, None)
    return {key: value for key, value in manifest.items() if key not in layout}


def total_counts(entries: Iterable[dict[str, Any]]) -> dict[str, int]:
    """The sum of the ``counts`` of manifest part entries, key by key (the manifest's ``counts``)."""
    totals: dict[str, int] = {}
    for entry in entries:
        for key, value in entry.get("counts", {}).items():
            totals[key] = totals.get(key, 0) + int(value)
    return totals


def check_same_settings(
    directory: str | os.PathLike, previous: dict[str, Any], current: dict[str, Any], keys: Iterable[str] | None = None
) -> None:
    """Refuse to resume ``directory`` when ``current`` settings differ from the ``previous`` run's in any
    of ``keys`` (default: every key of either). ``current`` is compared as the manifest stores it (JSON)."""
    current = json.loads(json.dumps(current, default=str))
    names = sorted(set(previous) | set(current) if keys is None else keys)
    differing = [k for k in names if previous.get(k) != current.get(k)]
    if differing:
        details = ", ".join(f"{k}: {previous.get(k)!r} → {current.get(k)!r}" for k in differing)
        raise OutputError(f"{directory}: cannot resume, settings differ from the first run ({details})")


def read_manifest(out_dir: str | os.PathLike | OutputLocation) -> dict[str, Any]:
    location = out_dir if isinstance(out_dir, OutputLocation) else OutputLocation(out_dir)
    if location.size(MANIFEST) is None:
        raise OutputError(f"{location}: no {MANIFEST}; not a memfit output directory")
    try:
        return json.loads(location.read_bytes(MANIFEST))
    except (OSError, json.JSONDecodeError) as exc:
        raise OutputError(f"{location.display(MANIFEST)}: cannot read manifest: {exc}") from None


class PartWriter:
    """Appends parts to an output directory and keeps its manifest true after every part.

    ``settings`` describe what the rows mean (model, pooling, …); ``resume`` continues a directory
    written with the same settings from the same input (``input_fingerprint``, see ``fingerprint.py``;
    ``None`` for stdin and in-memory texts, which cannot be resumed), skipping the rows it already
    holds (:attr:`rows_done`). Every listed part is verified first (:meth:`verify_parts`).

    The directory is created with the first part (or at :meth:`finish` for an empty input), so a run
    that stops on its input before writing anything leaves nothing behind.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        settings: dict[str, Any],
        resume: bool = False,
        input_fingerprint: dict[str, Any] | None = None,
    ):
        self.location = OutputLocation(out_dir)
        self.dir = self.location.name
        self.settings = settings
        check_output_dir(out_dir, resume)
        self._created = self.location.size(MANIFEST) is not None
        self.manifest = new_manifest(settings, input_fingerprint)
        if holds_output(out_dir):  # check_output_dir refused it unless resume is set
            previous = read_manifest(self.location)
            check_same_settings(self.dir, previous.get("settings", {}), settings)
            check_same_input(previous.get("input_fingerprint"), input_fingerprint, str(settings.get("input")), self.dir)
            self.manifest = previous
            self.verify_parts()
        if self.location.exists():
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

    @property
    def next_part_index(self) -> int:
        return len(self.manifest["parts"])

    def write_part(self, table: pa.Table, counts: dict[str, int] | None = None, tokens: dict | None = None) -> None:
        """Write one complete part, then record it (and add ``counts`` to the running totals).

        ``tokens``: the manifest entry of the part's token file, already renamed into place
        (:class:`memfit.io.token_table.TokenFile`); it is listed together with the part, so both or neither
        survive an interruption."""
        self._create_dir()
        index = self.next_part_index
        name = f"part-{index:05d}.parquet"
        size = write_part_file(self.location, name, table)
        entry = {
            "file": name,
            "rows": table.num_rows,
            "first_row": self.rows_done,
            "bytes": size,
            "counts": {key: int(value) for key, value in (counts or {}).items()},
        }
        if tokens is not None:
            entry["tokens"] = tokens
        self.manifest["parts"].append(entry)
        self.manifest["rows"] = self.rows_done + table.num_rows
        self.manifest["counts"] = total_counts(self.manifest["parts"])
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
            problem = part_problem(self.location, entry)
            if problem is None:
                continue
            log.warning(
                "%s; recomputing from row %d (%d of %d parts kept)", problem, entry["first_row"], index, len(parts)
            )
            del parts[index:]
            self.manifest["rows"] = entry["first_row"]
            self.manifest["complete"] = False
            self.manifest["counts"] = total_counts(parts)
            self._save()
            return

    def _create_dir(self) -> None:
        if self._created:
            return
        self.location.make()
        self._created = True

    def _save(self) -> None:
        self._create_dir()
        self.location.write_bytes(MANIFEST, json.dumps(self.manifest, indent=2, default=str).encode())

    def _remove_unlisted_files(self) -> None:
        """Drop temporary files and parts written after the last manifest update (an interrupted run)."""
        listed = {MANIFEST} | {name for entry in self.manifest["parts"] for name, _, _ in listed_files(entry)}
        for name in self.location.names():
            if name not in listed and name.endswith((TMP_SUFFIX, ".parquet")):
                self.location.delete(name)


def write_part_file(location: OutputLocation, name: str, table: pa.Table) -> int:
    """Write one part's table under ``name``, whole or not at all (:meth:`OutputLocation.writing`); its size in
    bytes. Used by a local run's :class:`PartWriter` and by Ray's workers, so both write the same files."""
    with location.writing(name) as pending:
        # Dictionary encoding and min/max statistics are useless on float vectors and cost memory.
        pq.write_table(table, pending.target, compression="zstd", use_dictionary=False, write_statistics=["id"])
        return pending.commit()


def part_problem(directory: Path | OutputLocation, entry: dict[str, Any]) -> str | None:
    """What is wrong with the files a manifest part entry lists (missing, another size than when it was
    written, unreadable Parquet, another row count), or ``None`` when every one is sound. ``directory``:
    a local directory or any output location (object storage: the same checks, on the objects)."""
    location = directory if isinstance(directory, OutputLocation) else OutputLocation(directory)
    for name, rows, size in listed_files(entry):
        path = location.display(name)
        actual = location.size(name)
        if actual is None:
            return f"{path}: listed in {MANIFEST} but missing"
        if size is not None and actual != size:
            return f"{path}: {actual} bytes on disk, {size} when it was written (truncated or overwritten)"
        try:
            with location.open_input(name) as handle:
                found = pq.ParquetFile(handle).metadata.num_rows
        except (pa.ArrowException, OSError) as exc:
            return f"{path}: not readable Parquet ({' '.join(str(exc).split())})"
        if found != rows:
            return f"{path}: holds {found} rows, {rows} when it was written"
    return None


def listed_files(entry: dict[str, Any]) -> Iterator[tuple[str, int, int | None]]:
    """``(file, rows, bytes)`` of every file a manifest part entry lists: its own, and that of any
    sub-entry that names a file of its own (e.g. a separate token table)."""
    yield entry["file"], int(entry["rows"]), entry.get("bytes")
    for value in entry.values():
        if isinstance(value, dict) and "file" in value:
            yield value["file"], int(value["rows"]), value.get("bytes")


def numpy_column(values: np.ndarray, value_type: pa.DataType | None = None) -> pa.Array:
    """A 1-D NumPy array of numbers or booleans as an Arrow array (``value_type``: cast to it first).

    ``pa.array`` would do the same, but its first call imports pandas to check for pandas types: ~0.2 s of a
    short ``memfit embed`` run that nothing else there needs. Arrow's own buffers take NumPy's memory as is."""
    if value_type is not None:
        values = values.astype(value_type.to_pandas_dtype(), copy=False)  # a NumPy type; pandas is not imported
    if values.dtype == np.bool_:
        bits = np.packbits(values, bitorder="little")
        return pa.Array.from_buffers(pa.bool_(), len(values), [None, pa.py_buffer(bits)])
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


def vectors_array(matrix: np.ndarray, value_type: pa.DataType = pa.float32()) -> pa.FixedSizeListArray:
    """An (N, d) matrix as a Parquet-friendly fixed-size-list column."""
    n, dim = matrix.shape
    return pa.FixedSizeListArray.from_arrays(numpy_column(matrix.reshape(-1), value_type), dim)


def ids_array(ids: Sequence[int | str]) -> pa.Array:
    """Row numbers as int64, user ids (from ``--id-field``) as strings (see :func:`numpy_column` for why not
    ``pa.array``)."""
    if not (ids and isinstance(ids[0], str)):
        return numpy_column(np.asarray(ids, dtype=np.int64))
    encoded = [str(value).encode("utf-8") for value in ids]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(value) for value in encoded], out=offsets[1:])
    return pa.Array.from_buffers(
        pa.large_string(), len(encoded), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))]
    ).cast(pa.string())


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

    def busy(self) -> bool:
        """Whether a submitted task has not finished yet (the memory guard keeps its reserve while one runs)."""
        return self._tasks.unfinished_tasks > 0

    def wait_idle(self) -> None:
        """Wait until every task submitted so far has run (the memory guard's way to free the queue)."""
        self._tasks.join()

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
            self._tasks.task_done()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error
