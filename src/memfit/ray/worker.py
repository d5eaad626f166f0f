"""What runs inside a Ray worker: one model per worker process, one output part per contiguous run of rows.

The models run through the public API; of memfit's internals a worker uses the record validator
(``data/sources.py``, so rows are checked as a local run checks them) and the output directory's
helpers (``io/storage.py``, ``io/sinks.py``: crash-safe writes on disk or in object storage, the settings
check, count totals). A part is computed by the public streaming call (:meth:`Encoder.embed_to` /
:meth:`Classifier.classify_to`) into a scratch directory, so memfit's own token-budget batching, long-text
chunking, OOM guard and quality guard run on the rows Ray hands the worker. The scratch part is then given
its real ids and input row numbers and written into place (renamed on disk, one upload in object storage)
under a name taken from its first row, so a task that Ray retries (its worker died) rewrites the same files
instead of adding new ones.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memfit.io.sinks import check_same_settings, run_info, total_counts, write_part_file
from memfit.io.storage import OutputLocation
from memfit.io.token_table import TokenFile
from memfit.jobs.runner import INPUT_SETTINGS  # a worker reads in-memory texts: the driver fills these in
from memfit.ray.commit import SCRATCH
from memfit.data.sources import validated_records

PART_NAME = "part-{first_row:05d}.parquet"  # its token file: token_table.TOKEN_FILE_PATTERN, by first row too


def configure_worker(device: str = "auto") -> None:
    """Process-wide settings of a worker process, before its model is built: an actor's constructor is
    its process's entry point, so it does what the CLI does (:func:`memfit.engine.process.configure_process`).
    Threads are left as Ray set them (OMP_NUM_THREADS = the worker's CPUs, read by torch at import)."""
    from memfit.engine.process import configure_process

    configure_process(device)


def validated_rows(
    name: str, first_line: int, first_row: int, table: pa.Table, text_field: str, id_field: str | None
) -> pa.Table:
    """A slice of a Parquet file as ``row, id, text, line`` columns, checked value by value exactly as a
    local run checks them (so a null or non-string text gets the same one-line error)."""
    columns = {
        column: table.column(column).to_pylist()
        for column in dict.fromkeys((text_field, id_field))
        if column is not None
    }
    values: Iterator[tuple[int, dict[str, object]]] = (
        (first_line + i, {column: data[i] for column, data in columns.items()}) for i in range(table.num_rows)
    )
    records = list(validated_records(name, values, text_field, id_field, None, None, 0))
    return rows_table(
        [first_row + r.row for r in records],
        [r.id if id_field else first_row + r.row for r in records],
        [r.text for r in records],
        [r.line for r in records],
        string_ids=id_field is not None,
    )


def rows_table(
    rows: Sequence[int], ids: Sequence, texts: Sequence[str], lines: Sequence[int], string_ids: bool
) -> pa.Table:
    """The columns the job's dataset carries: input row, output id, text, line (for error messages)."""
    return pa.table(
        {
            "row": pa.array(rows, type=pa.int64()),
            "id": pa.array(ids, type=pa.string() if string_ids else pa.int64()),
            "text": pa.array(texts, type=pa.string()),
            "line": pa.array(lines, type=pa.int64()),
        }
    )


def contiguous_runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """``(start, stop)`` index ranges of ``rows`` over which the row numbers go up by one."""
    if len(rows) == 0:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    edges = [0, *breaks.tolist(), len(rows)]
    return list(zip(edges[:-1], edges[1:]))


class PartWorker:
    """The job's map_batches class: builds the model once, then writes one part per contiguous run of a batch.

    ``job`` is ``"embed"`` or ``"classify"``; ``model_kwargs`` go to :class:`memfit.Encoder` /
    :class:`memfit.Classifier`, ``call_kwargs`` to ``embed_to`` / ``classify_to``. ``expected_settings``
    (a resumed output's) make the worker refuse a part computed with other settings before it is put in
    place. Returns one row per part written: its manifest entry and the run's settings, as JSON.
    """

    def __init__(
        self,
        job: str,
        out_dir: str,
        model_kwargs: dict[str, Any],
        call_kwargs: dict[str, Any],
        expected_settings: dict[str, Any] | None = None,
    ):
        configure_worker(model_kwargs.get("device", "auto"))
        if job == "embed":
            from memfit.jobs.encoder import Encoder as model_class
        else:
            from memfit.jobs.classify import Classifier as model_class

        self.job = job
        self.out_dir = out_dir
        self.location = OutputLocation(out_dir)
        self.call_kwargs = call_kwargs
        self.expected_settings = expected_settings
        self.model = model_class(**model_kwargs)

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.column("row").to_numpy()
        entries = [self.write_part(batch.slice(start, stop - start)) for start, stop in contiguous_runs(rows)]
        return pa.table({"entry": [json.dumps(e) for e in entries]})

    def write_part(self, rows: pa.Table) -> dict[str, Any]:
        first_row = int(rows.column("row")[0].as_py())
        scratch = self._scratch(first_row)
        texts = rows.column("text").to_pylist()
        try:
            if self.job == "embed":
                manifest = self.model.embed_to(texts, scratch, progress=False, part_size=len(texts), **self.call_kwargs)
            else:
                manifest = self.model.classify_to(
                    texts, scratch, progress=False, part_size=len(texts), **self.call_kwargs
                )
            settings = {k: v for k, v in manifest["settings"].items() if k not in INPUT_SETTINGS}
            self._check_settings(settings)
            entry = self._put_in_place(scratch, manifest, rows, first_row)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        # all of it: a new key a local run records reaches the driver's manifest too; int8 / uint8 ranges, which a
        # scratch run would fit on its own part, never do (ray/job.py refuses those output dtypes)
        return {"entry": entry, "settings": settings, "info": run_info(manifest)}

    def _scratch(self, first_row: int) -> Path:
        """An empty directory for one part's scratch run: beside a local output (same disk; ``--resume`` removes a
        killed run's), or a new directory of this worker's own in the node's temporary directory (``TMPDIR``) when
        the output is in object storage."""
        if self.location.path is None:
            return Path(tempfile.mkdtemp(prefix=f"memfit-scratch-{first_row}-"))
        scratch = self.location.path / SCRATCH / f"{first_row}-{os.getpid()}"
        shutil.rmtree(scratch, ignore_errors=True)  # a killed task's, from a worker that had this process id
        return scratch

    def _check_settings(self, settings: dict[str, Any]) -> None:
        if self.expected_settings is None:
            return
        expected = {k: v for k, v in self.expected_settings.items() if k not in INPUT_SETTINGS}
        check_same_settings(self.out_dir, expected, settings)

    def _put_in_place(self, scratch: Path, manifest: dict[str, Any], rows: pa.Table, first_row: int) -> dict:
        """Join the scratch parts into one part with the real ids (and token rows with the real row
        numbers), token file first, each put in place whole; return the part's manifest entry."""
        parts = manifest["parts"]
        table = pa.concat_tables([pq.read_table(scratch / p["file"]) for p in parts])
        table = table.set_column(0, "id", rows.column("id"))  # int64 row numbers or string ids, as locally
        entry: dict[str, Any] = {
            "file": PART_NAME.format(first_row=first_row),
            "rows": table.num_rows,
            "first_row": first_row,
        }
        token_files = [scratch / p["tokens"]["file"] for p in parts if "tokens" in p]
        tokens = renumbered_tokens(token_files, first_row, self.location)
        entry["bytes"] = write_part_file(self.location, entry["file"], table)
        entry["counts"] = total_counts(parts)
        if tokens is not None:
            entry["tokens"] = tokens
        return entry


def renumbered_tokens(files: list[Path], first_row: int, location: OutputLocation) -> dict | None:
    """Copy the scratch token rows one row group at a time into the token file named by ``first_row``, their
    ``row`` shifted from the scratch numbering (0 …) to the input's; return the token file's manifest entry
    (None without tokens)."""
    token_file = TokenFile(location, first_row)
    try:
        for piece in _shifted_row_groups(files, first_row):
            token_file.append(piece)
    except BaseException:
        token_file.abandon()  # a scratch file that cannot be read: no half token file under the name
        raise
    return token_file.commit()


def _shifted_row_groups(files: list[Path], first_row: int) -> Iterator[pa.Table]:
    for path in files:
        source = pq.ParquetFile(path)
        for group in range(source.num_row_groups):
            piece = source.read_row_group(group)
            yield piece.set_column(0, "row", pc.add(piece.column("row"), pa.scalar(first_row, pa.int64())))
