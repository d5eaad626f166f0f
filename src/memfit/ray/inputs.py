"""A job's input as a Ray Dataset of ``row, id, text, line`` rows, leaving out rows already written.

The input is named as for a local run (a file, a directory or glob of shards, a Hugging Face dataset
directory, locally or by URL) and listed by the same layer (``memfit.data.shards``). When every shard
is Parquet, the shards are read by Ray tasks in parallel, one row group per task, each row numbered
from the file metadata the driver reads first (rows count on across the files); a task opens its file
itself (by URL, straight from object storage) and hands its row group on in blocks of ``part_texts``
rows, so the workers share even a file of one large row group. Every other input (txt, jsonl, csv,
tsv, Arrow, compressed, stdin) is read on the driver by memfit's own reader, so its errors are a local
run's one-line errors, and handed to Ray as Arrow tables of ``part_texts`` rows.
"""

from __future__ import annotations

import bisect
from typing import Any, Iterator, Sequence

import pyarrow as pa

from memfit.data.shards import STDIN, expand, open_file
from memfit.data.sources import detect_format, read_records
from memfit.io.preflight import check_input

READ_CPUS = 0.1
"""CPUs a read task asks for: workers ask for 0.9 each, so reads still find room beside them."""


def parquet_files(source: str, input_format: str | None = None) -> list[str] | None:
    """The shards of ``source`` when every one is Parquet (Ray tasks read those in parallel), else None."""
    if source == STDIN:
        return None
    shards = expand(source)
    if all(detect_format(shard, input_format) == "parquet" for shard in shards):
        return shards
    return None


class Remaining:
    """Which rows still need computing, given the ``(first, stop)`` row ranges already written."""

    def __init__(self, done: Sequence[tuple[int, int]]):
        self.starts = [a for a, _ in done]
        self.stops = [b for _, b in done]

    def __contains__(self, row: int) -> bool:
        i = bisect.bisect_right(self.starts, row) - 1
        return not (i >= 0 and row < self.stops[i])

    def covers_all(self, first: int, stop: int) -> bool:
        """Whether rows ``first … stop - 1`` are all written already."""
        i = bisect.bisect_right(self.starts, first) - 1
        while i >= 0 and i < len(self.starts) and self.starts[i] <= first:
            if self.stops[i] >= stop:
                return True
            first = self.stops[i]
            i += 1
        return first >= stop


def input_dataset(
    source: str, text_field: str, id_field: str | None, input_format: str | None, part_texts: int, remaining: Remaining
) -> tuple[Any, int]:
    """The rows of ``source`` still to compute, as a Ray Dataset, and the input's total row count."""
    import ray.data

    shards = parquet_files(source, input_format)
    if shards is not None:
        return _parquet_dataset(shards, text_field, id_field, part_texts, remaining)
    from memfit.ray.worker import rows_table

    refs, total = [], 0
    columns: tuple[list, list, list, list] = ([], [], [], [])
    for record in read_records(source, text_field=text_field, id_field=id_field, input_format=input_format):
        total = record.row + 1
        if record.row not in remaining:
            continue
        for column, value in zip(columns, (record.row, record.id, record.text, record.line)):
            column.append(value)
        if len(columns[0]) == part_texts:
            refs.append(ray.put(rows_table(*columns, string_ids=id_field is not None)))
            columns = ([], [], [], [])
    if columns[0]:
        refs.append(ray.put(rows_table(*columns, string_ids=id_field is not None)))
    if not refs:
        return ray.data.from_items([]), total
    return ray.data.from_arrow_refs(refs), total


def _parquet_dataset(
    shards: list[str], text_field: str, id_field: str | None, part_texts: int, remaining: Remaining
) -> tuple[Any, int]:
    import pyarrow.parquet as pq
    import ray.data

    groups: list[dict[str, Any]] = []
    total = 0
    for path in shards:
        check_input(path, "parquet", text_field, id_field)  # the local run's errors for a missing column
        with open_file(path) as handle:
            metadata = pq.ParquetFile(handle).metadata
        line = 1
        for group in range(metadata.num_row_groups):
            rows = metadata.row_group(group).num_rows
            if rows and not remaining.covers_all(total, total + rows):
                groups.append({"path": path, "group": group, "first_row": total, "first_line": line})
            total += rows
            line += rows
    if not groups:
        return ray.data.from_items([]), total
    items = ray.data.from_items(groups, override_num_blocks=len(groups))
    dataset = items.map_batches(
        _read_row_groups,
        batch_size=1,
        batch_format="pyarrow",
        num_cpus=READ_CPUS,
        fn_kwargs={
            "text_field": text_field,
            "id_field": id_field,
            "part_texts": part_texts,
            "done": list(zip(remaining.starts, remaining.stops)),
        },
    )
    return dataset, total


def _read_row_groups(
    items: pa.Table, text_field: str, id_field: str | None, done: list, part_texts: int
) -> Iterator[pa.Table]:
    """Ray task: read row groups in slices of ``part_texts`` rows, check their values as a local run
    does, drop rows already written. Each slice is its own block, so the workers share a row group."""
    import pyarrow.parquet as pq

    from memfit.ray.worker import validated_rows

    remaining = Remaining(done)
    columns = [c for c in dict.fromkeys((text_field, id_field)) if c is not None]
    for item in items.to_pylist():
        first_row, first_line = item["first_row"], item["first_line"]
        with open_file(item["path"]) as handle:  # by URL: read by this task, straight from the store
            for data in pq.ParquetFile(handle).iter_batches(
                batch_size=part_texts, row_groups=[item["group"]], columns=columns
            ):
                table = validated_rows(
                    item["path"], first_line, first_row, pa.Table.from_batches([data]), text_field, id_field
                )
                first_row, first_line = first_row + data.num_rows, first_line + data.num_rows
                keep = [row in remaining for row in table.column("row").to_pylist()]
                table = table if all(keep) else table.filter(pa.array(keep))
                if table.num_rows:
                    yield table
