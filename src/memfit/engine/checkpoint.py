"""A safetensors checkpoint's header: where each tensor lies in the file and what the model takes in memory, read
without importing torch (a run on a cached compiled graph never does, ``memory/device.py``), so ``--offload auto`` can
compare the resident and streamed plans before anything loads. ``streamed.py`` reads the tensors themselves."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from memfit.errors import ModelLoadError
from memfit.memory.device import DTYPE_BYTES, DtypeName

WEIGHTS_FILE = "model.safetensors"

# safetensors' dtype names: bytes per element, and which hold floats (converted to the compute dtype on load)
FILE_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
FLOAT_FILE_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})


@dataclass(frozen=True, slots=True)
class HeaderEntry:
    dtype: str  # safetensors' name: "F32", "BF16", ...
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


def read_header(path: Path) -> dict[str, HeaderEntry]:
    """Every tensor of the file by name (``ModelLoadError`` where the header cannot be read)."""
    try:
        with open(path, "rb") as fh:
            header_bytes = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(header_bytes))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the safetensors header of {path}: {exc}") from exc
    start = 8 + header_bytes
    entries: dict[str, HeaderEntry] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        begin, end = spec["data_offsets"]
        entries[name] = HeaderEntry(spec["dtype"], tuple(spec["shape"]), start + begin, end - begin)
    return entries


def bytes_in_memory(entries: dict[str, HeaderEntry], names: Sequence[str], dtype: DtypeName) -> int:
    """What ``names`` take in memory once converted to ``dtype`` (floats) or as stored (the rest)."""
    total = 0
    for name in names:
        entry = entries[name]
        element = DTYPE_BYTES[dtype] if entry.dtype in FLOAT_FILE_DTYPES else FILE_DTYPE_BYTES[entry.dtype]
        elements = 1
        for size in entry.shape:
            elements *= size
        total += element * elements
    return total


@dataclass(frozen=True, slots=True)
class CheckpointSizes:
    """A checkpoint's weights in a compute dtype, read from its header alone: what ``--offload auto`` compares
    before it loads anything."""

    weights_bytes: int  # the whole model, as the resident path holds it
    layers: int
    layer_bytes: int  # the largest encoder layer
    small_bytes: int  # all but the layers and the word-embedding table: held for the whole of a streamed run

    def streamed_bytes(self, layers_held: int) -> int:
        """The weights a streamed run holds: the small parts and the ``layers_held`` at once
        (``streamed.layers_held``)."""
        return self.small_bytes + layers_held * self.layer_bytes


def checkpoint_sizes(model_dir: str, dtype: DtypeName) -> CheckpointSizes | None:
    """The sizes of ``model_dir``'s safetensors checkpoint, or None where there is none to stream."""
    path = weights_file(model_dir)
    if path is None:
        return None
    entries = read_header(path)
    per_layer: dict[str, list[str]] = {}
    for name in entries:
        parts = name.split(".")
        if "layer" in parts and parts.index("layer") + 1 < len(parts):
            index = parts.index("layer") + 1
            per_layer.setdefault(".".join(parts[: index + 1]), []).append(name)
    layer_bytes = max((bytes_in_memory(entries, group, dtype) for group in per_layer.values()), default=0)
    streamed = [n for n in entries if not n.endswith("word_embeddings.weight")]
    streamed = sorted(set(streamed) - {n for group in per_layer.values() for n in group})
    total = bytes_in_memory(entries, list(entries), dtype)
    return CheckpointSizes(total, len(per_layer), layer_bytes, bytes_in_memory(entries, streamed, dtype))


def weights_file(model: str) -> Path | None:
    """The model's single safetensors file: in its directory, or for a hub id in the Hugging Face cache, where a first
    run or ``hf download`` put it (a model bigger than the budget is named by its hub id as often as by a folder);
    None where there is none (sharded or ``.bin`` checkpoints are not streamed, and a hub model not downloaded yet)."""
    if Path(model).is_dir():
        path = Path(model) / WEIGHTS_FILE
        return path if path.is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, WEIGHTS_FILE)
    except Exception:  # noqa: BLE001 - not a hub id (a mistyped path), or no hub library: nothing to stream from
        return None
    return Path(cached) if isinstance(cached, str) else None
