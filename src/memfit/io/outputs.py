"""Reading an embedding output directory back: :func:`read` (``memfit.read``).

Only the parts the manifest lists are read, so a directory left by an interrupted run reads as the
rows completed so far. Token rows come from the token table (``token_table.py``), sorted back into
text order. :func:`read` loads everything into memory; for outputs larger than memory, read the
token files the manifest lists with ``pyarrow.dataset``, filtered by ``row`` (the README's recipe,
run as written by ``tests/jobs/test_encoder.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from memfit.errors import OutputError
from memfit.io.sinks import FORMAT_VERSION, read_manifest
from memfit.io.storage import OutputLocation
from memfit.io.token_table import read_token_table


@dataclass
class EmbeddingOutput:
    """What :func:`read` returns: ids in input order, the pooled matrix and, if written, token arrays."""

    ids: list
    embeddings: np.ndarray  # (N, d) float32; as stored for --output-dtype int8 / uint8, (N, ceil(d/8)) for binary
    token_ids: list[np.ndarray] | None = None  # per text, (n_i,) int64
    token_offsets: list[np.ndarray] | None = None  # per text, (n_i, 2) int32 character [start, end)
    token_embeddings: list[np.ndarray] | None = None  # per text, (n_i, d) float32
    manifest: dict[str, Any] = field(default_factory=dict)


def read(out_dir: str | os.PathLike) -> EmbeddingOutput:
    """Load a memfit embedding output directory, local or in object storage (``s3://…``; only parts
    listed in its manifest)."""
    location = OutputLocation(out_dir)
    manifest = read_manifest(location)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise OutputError(
            f"{out_dir}: written in output format {manifest.get('format_version')}, this memfit "
            f"reads format {FORMAT_VERSION}; re-run the job to rewrite it"
        )
    job = manifest.get("settings", {}).get("job", "embed")
    if job != "embed":
        reader = "memfit.jobs.classify.read_classifications" if job == "classify" else "pyarrow (id, score)"
        raise OutputError(f"{out_dir}: a {job} output; memfit.read reads embed outputs (read this one with {reader})")
    parts = manifest["parts"]
    dim = int(manifest.get("dim") or 0)
    if not parts:
        return EmbeddingOutput(ids=[], embeddings=np.zeros((0, dim), np.float32), manifest=manifest)
    table = pa.concat_tables([_read_table(location, p["file"], out_dir) for p in parts])
    dim = table.schema.field("embedding").type.list_size
    embeddings = table.column("embedding").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    if embeddings.dtype.kind == "f":  # quantized vectors (int8, uint8, packed bits) come back as stored
        embeddings = embeddings.astype(np.float32, copy=False)
    out = EmbeddingOutput(
        ids=table.column("id").to_pylist(),
        embeddings=embeddings.reshape(-1, dim),
        manifest=manifest,
    )
    if manifest.get("settings", {}).get("tokens"):
        files = [location.open_input(p["tokens"]["file"]) for p in parts if "tokens" in p]
        try:
            rows, ids, offsets, vectors = read_token_table(files, dim)
        finally:
            for handle in files:
                handle.close()
        # rows are sorted: each text's tokens are one contiguous run, found by binary search
        bounds = np.searchsorted(rows, np.arange(table.num_rows + 1) + parts[0]["first_row"])
        out.token_ids = [ids[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        out.token_offsets = [offsets[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        out.token_embeddings = [vectors[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    return out


def _read_table(location: OutputLocation, name: str, out_dir: str | os.PathLike) -> pa.Table:
    """A part the manifest lists; one that is gone or cut short (a copy of a running job's output, a partial sync) is
    an :class:`OutputError` naming it: ``--resume`` finds such a part and computes it again."""
    try:
        with location.open_input(name) as handle:
            return pq.read_table(handle)
    except (OSError, pa.ArrowException) as exc:
        raise OutputError(
            f"{out_dir}: {name}, listed in the manifest, is missing or damaged ({exc}); run the job again with --resume"
        ) from None
