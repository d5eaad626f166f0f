"""How pooled vectors are stored on disk: float32, float16, or quantized as sentence-transformers'
``quantize_embeddings`` quantizes them, for search indexes that take integer or bit vectors.

- ``int8`` / ``uint8``: per dimension, the range ``[min, max]`` of *calibration embeddings* is cut into 255
  steps; a value becomes ``floor((x - min) / step)`` clipped to ``0 … 255`` (``uint8``), minus 128 (``int8``).
  A streamed job calibrates on its first part's vectors (up to ``--part-size`` texts, 2,048 by default) and
  keeps those ranges for every later part and for ``--resume``; the manifest records them
  (``quantization.calibration.ranges``) and so does each part's Parquet schema.
- ``binary`` / ``ubinary``: one bit per dimension, ``x > 0``, packed eight to a byte, most significant bit
  first (``numpy.packbits``); ``binary`` stores each byte minus 128 as int8. A vector of ``d`` dimensions
  takes ``ceil(d / 8)`` bytes. No calibration.

:func:`memfit.read` gives the vectors back as they are stored (int8, uint8 or the packed bytes).
:func:`read_calibration` gives a recorded calibration to another process (``memfit serve
--quantization-ranges``), so that vectors made there are quantized as the stored ones were.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa

from memfit.defaults import OUTPUT_DTYPE_CHOICES
from memfit.errors import ConfigError
from memfit.io.preflight import MANIFEST
from memfit.io.sinks import read_manifest, vectors_array
from memfit.errors import OutputError

CALIBRATED = ("int8", "uint8")
"""Output dtypes whose ranges come from calibration embeddings (the first part's vectors)."""
_ARROW = {
    "float32": pa.float32(),
    "float16": pa.float16(),
    "int8": pa.int8(),
    "uint8": pa.uint8(),
    "binary": pa.int8(),
    "ubinary": pa.uint8(),
}
_MEANING = {
    "float32": "float32 vector",
    "float16": "float16 vector",
    "int8": "int8 scalar quantization: floor((x - ranges[0]) / ((ranges[1] - ranges[0]) / 255)) clipped to 0..255, "
    "minus 128 (sentence-transformers quantize_embeddings)",
    "uint8": "uint8 scalar quantization: floor((x - ranges[0]) / ((ranges[1] - ranges[0]) / 255)) clipped to 0..255 "
    "(sentence-transformers quantize_embeddings)",
    "binary": "sign bits (x > 0) packed 8 per byte, most significant first (numpy.packbits), minus 128 as int8",
    "ubinary": "sign bits (x > 0) packed 8 per byte, most significant first (numpy.packbits), as uint8",
}


def check_output_dtype(output_dtype: str) -> None:
    if output_dtype not in OUTPUT_DTYPE_CHOICES:
        raise ConfigError(
            f"unknown --output-dtype {output_dtype!r}; choose one of {', '.join(OUTPUT_DTYPE_CHOICES)}",
            field="output_dtype",
        )


@dataclass
class VectorCodec:
    """Turns a block's float32 vectors into what ``output_dtype`` stores. Calibrates once (int8 / uint8): on the
    first block it sees, unless ``ranges`` were given (a resumed run's); ``on_calibrated`` hears the result."""

    output_dtype: str
    ranges: np.ndarray | None = None  # (2, d) float32: per-dimension min and max of the calibration embeddings
    calibration_rows: int = 0
    on_calibrated: Callable[[dict], None] | None = None

    def __post_init__(self) -> None:
        check_output_dtype(self.output_dtype)

    @property
    def quantized(self) -> bool:
        return self.output_dtype not in ("float32", "float16")

    @property
    def arrow_type(self) -> pa.DataType:
        return _ARROW[self.output_dtype]

    def encode(self, vectors: np.ndarray) -> np.ndarray:
        """``vectors`` (n, d) float32 as stored (module docstring for each dtype)."""
        kind = self.output_dtype
        if kind in ("float32", "float16"):
            return vectors
        if kind in ("binary", "ubinary"):
            packed = np.packbits(vectors > 0, axis=-1)
            return packed if kind == "ubinary" else (packed - 128).astype(np.int8)
        if self.ranges is None:
            self._calibrate(vectors)
        starts = self.ranges[0]
        steps = (self.ranges[1] - starts) / 255
        steps = np.where(steps == 0, 1, steps)
        levels = np.clip(np.floor((vectors - starts) / steps), 0, 255)
        return levels.astype(np.uint8) if kind == "uint8" else (levels - 128).astype(np.int8)

    def column(self, vectors: np.ndarray) -> tuple[pa.Field, pa.FixedSizeListArray]:
        """The part's ``embedding`` field (its metadata says what the values are) and column."""
        array = vectors_array(self.encode(vectors), self.arrow_type)
        metadata = {"memfit.output_dtype": self.output_dtype, "memfit.meaning": _MEANING[self.output_dtype]}
        if self.ranges is not None:
            metadata["memfit.ranges"] = json.dumps(self.ranges.tolist())
        return pa.field("embedding", array.type, metadata=metadata), array

    def as_manifest(self) -> dict | None:
        """What the manifest records: the dtype and, once calibrated, the ranges and how many vectors gave them."""
        if not self.quantized:
            return None
        calibration = None if self.ranges is None else {"ranges": self.ranges.tolist(), "rows": self.calibration_rows}
        return {"output_dtype": self.output_dtype, "calibration": calibration}

    def _calibrate(self, vectors: np.ndarray) -> None:
        if len(vectors) < 2:
            raise ConfigError(
                f"--output-dtype {self.output_dtype} calibrates its ranges on the first part's vectors, and it "
                f"holds {len(vectors)}; give more texts (or a larger --part-size)",
                field="output_dtype",
            )
        self.ranges = np.vstack([vectors.min(axis=0), vectors.max(axis=0)]).astype(np.float32)
        self.calibration_rows = len(vectors)
        if self.on_calibrated is not None:
            self.on_calibrated(self.as_manifest())


def resume_calibration(codec: VectorCodec, out_dir: str | os.PathLike) -> None:
    """Give ``codec`` the calibration an earlier run of ``out_dir`` recorded (if it got that far), so that a
    resumed run quantizes its parts as the first run did."""
    try:
        calibration = (read_manifest(out_dir).get("quantization") or {}).get("calibration")
    except OutputError:  # nothing written yet
        return
    if calibration is not None:
        codec.ranges = np.asarray(calibration["ranges"], dtype=np.float32)
        codec.calibration_rows = int(calibration["rows"])


@dataclass(frozen=True)
class RecordedCalibration:
    """The int8 / uint8 ranges a ``memfit embed --output-dtype int8 | uint8`` run calibrated on its corpus, with the
    settings its vectors were made by: ranges only describe vectors made the same way, so whoever quantizes new
    vectors with them (a server's queries, for an index of those documents) checks them first
    (:meth:`check_vectors`)."""

    source: str  # the output directory, as given: what messages name
    ranges: np.ndarray  # (2, width) float32
    rows: int  # the calibration embeddings they came from
    model: str  # as the manifest names it: an absolute directory or a hub id (memfit's model resolution)
    pooling: str
    normalize: bool
    dimensions: int | None  # the leading dimensions kept (Matryoshka), None: the model's whole width

    @property
    def width(self) -> int:
        """The dimension of the vectors the ranges are for."""
        return int(self.ranges.shape[1])

    def codec(self, output_dtype: str) -> VectorCodec:
        """An encoder that quantizes with these ranges (it never calibrates again, so threads may share it)."""
        return VectorCodec(output_dtype, ranges=self.ranges, calibration_rows=self.rows)

    def check_vectors(self, model: str, pooling: str, normalize: bool, dim: int) -> None:
        """Refuse (:class:`ConfigError`) unless vectors of ``model`` (resolved as memfit resolves it), pooled by
        ``pooling``, normalized or not, ``dim`` wide, are those the ranges were calibrated on. The prompt is not
        compared: a search index quantizes its queries (a query prompt) with its documents' ranges (a document
        prompt), as sentence-transformers' quantized search does."""
        where = f"--quantization-ranges {self.source}"
        if model != self.model:
            raise ConfigError(
                f"{where}: its ranges were calibrated on vectors of {self.model}, and this server serves {model}; "
                "serve that model, or embed the corpus again with this one",
                field="quantization_ranges",
            )
        if self.width > dim or self.width != (self.dimensions or dim):
            kept = "" if self.dimensions is None else f" (the run kept the first {self.dimensions})"
            raise ConfigError(
                f"{where}: its ranges cover {self.width} dimensions{kept}, and the served model's vectors have {dim}",
                field="quantization_ranges",
            )
        if pooling != self.pooling:
            raise ConfigError(
                f"{where}: its ranges were calibrated on {self.pooling}-pooled vectors, and this server pools by "
                f"{pooling} (the model's default); embed the corpus again without --pooling",
                field="quantization_ranges",
            )
        if normalize != self.normalize:
            if self.normalize:
                mismatch = "normalized vectors, and this server answers unnormalized ones; serve without --no-normalize"
            else:
                mismatch = "unnormalized vectors, and this server answers normalized ones; serve with --no-normalize"
            raise ConfigError(
                f"{where}: its ranges were calibrated on {mismatch}, or embed the corpus again "
                f"{'without' if self.normalize else 'with'} --normalize",
                field="quantization_ranges",
            )


def read_calibration(path: str | os.PathLike[str]) -> RecordedCalibration:
    """The calibration recorded in the manifest of ``path``: an output directory of ``memfit embed --output-dtype
    int8 | uint8`` (local or a URL), or its ``manifest.json``. :class:`ConfigError` where there is none."""
    source = os.fspath(path)
    out_dir = (os.path.dirname(source) or ".") if os.path.basename(source) == MANIFEST else source
    made_by = "the output directory of a 'memfit embed --output-dtype int8' (or uint8) run has them"
    try:
        manifest = read_manifest(out_dir)
    except OutputError as exc:
        raise ConfigError(f"--quantization-ranges {source}: {exc}; {made_by}", field="quantization_ranges") from None
    quantization = manifest.get("quantization") or {}
    calibration = quantization.get("calibration")
    if calibration is None:
        stored = (manifest.get("settings") or {}).get("output_dtype")
        why = "" if stored is None else f" (output dtype {stored})"
        if stored in CALIBRATED:
            why = f" (output dtype {stored}, but the run stopped before its first part)"
        raise ConfigError(
            f"--quantization-ranges {source}: its manifest records no int8 / uint8 calibration ranges{why}; {made_by}",
            field="quantization_ranges",
        )
    ranges = np.asarray(calibration["ranges"], dtype=np.float32)
    if ranges.ndim != 2 or ranges.shape[0] != 2:
        raise ConfigError(
            f"--quantization-ranges {source}: its calibration ranges have shape {ranges.shape}, not (2, dimensions)",
            field="quantization_ranges",
        )
    settings = manifest["settings"]
    return RecordedCalibration(
        source=source,
        ranges=ranges,
        rows=int(calibration["rows"]),
        model=settings["model"],
        pooling=settings["pooling"],
        normalize=bool(settings["normalize"]),
        dimensions=settings.get("dimensions"),
    )
