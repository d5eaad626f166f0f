"""The graph cache of the compiled backend: where a model's OpenVINO graph is kept on disk, and how it is written.

- :func:`graph_file` finds the cached graph: ``<cache>/openvino/<key>/model.xml`` (+ ``.bin``), the key a hash of
  the model's files (their SHA-256, remembered per path, size and mtime so a cached start does not re-read
  the weights), the task, the transformers and OpenVINO versions.
- :func:`save_graph` writes a graph atomically (the ``.bin`` first, the ``.xml`` last: an ``.xml`` present means
  a whole graph). The graph is stored in fp32; the precision is chosen when it is compiled (``compiled.py``), so
  one file serves both.
- The int8 copy of a graph (``--quantize int8``, made in ``conversion.py``) is cached beside the fp32 graph
  (:func:`int8_graph_file`), named by its scheme and the NNCF that made it.
- :func:`converting` is held while a process converts a model: processes that start on the same model at once
  (Ray's workers on one node, two jobs) convert it once, the others wait and read the cache.

The installed OpenVINO's version is part of the key, so this module also holds how OpenVINO is imported
(:func:`import_openvino`, its usage telemetry declined); every module of the backend imports it from here.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

try:
    import fcntl
except ImportError:  # not POSIX: no lock, each process converts for itself as before
    fcntl = None  # type: ignore[assignment]

from memfit.atomic import replace_durably, temporary_path, write_bytes_atomically
from memfit.errors import ModelLoadError
from memfit.memory.calibration import cache_dir

log = logging.getLogger("memfit")

GraphOutput = Literal["last_hidden_state", "logits"]

GRAPH_FORMAT = 1
"""Bump when what :func:`convert` (``conversion.py``) writes changes, so older cached graphs are not used."""

INT8_SCHEME = 1
"""Bump when what :func:`quantize_graph` (``conversion.py``) makes changes (what it keeps in float, its calibration), so
older cached int8 graphs are not used."""


def import_openvino() -> Any:
    """The ``openvino`` module, imported with its usage telemetry declined.

    Importing ``openvino`` imports its conversion tools, which send a usage event to Google Analytics from a
    worker thread unless the user has opted out with OpenVINO's own tool (a consent file in ``~/intel``); the
    process then waits for that thread when it exits (up to the sender's 3 s time-out on a slow network).
    memfit sends nothing about its users anywhere, so the consent check answers "declined" while the module
    loads. Raises ImportError when OpenVINO is not installed."""
    try:
        from openvino_telemetry.utils.opt_in_checker import ConsentCheckResult, OptInChecker
    except ImportError:  # no telemetry package: nothing to decline
        import openvino

        return openvino
    check = OptInChecker.check
    OptInChecker.check = lambda self, *args, **kwargs: ConsentCheckResult.DECLINED
    try:
        import openvino
    finally:
        OptInChecker.check = check
    return openvino


def openvino_version() -> str | None:
    """The installed OpenVINO's version, or None when it is not installed (importing it costs ~0.2 s)."""
    try:
        openvino = import_openvino()
    except ImportError:
        return None
    return str(openvino.get_version())


# -- the cache key -----------------------------------------------------------------------------------------------------


_WEIGHT_SUFFIXES = (".json", ".safetensors", ".bin", ".txt", ".model")


def model_files(model_dir: Path) -> list[Path]:
    """The files whose content decides the graph: configs, weights, vocabularies (a memfit pooled classifier's
    head in ``2_Dense/`` included), in a stable order."""
    return sorted(
        p for p in model_dir.rglob("*") if p.is_file() and p.suffix in _WEIGHT_SUFFIXES and ".cache" not in p.parts
    )


def _hash_index_path() -> Path:
    return cache_dir() / "openvino" / "file-hashes.json"


def files_digest(files: Sequence[Path]) -> str:
    """SHA-256 over the files' contents. A file's own hash is remembered by (path, size, mtime), so a start that
    finds its graph in the cache does not read the weights again (hashing 440 MB costs ~1 s)."""
    index_path = _hash_index_path()
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    changed = False
    total = hashlib.sha256()
    for path in files:
        stat = path.stat()
        stamp = [stat.st_size, stat.st_mtime_ns]
        key = str(path.resolve())
        entry = index.get(key)
        if entry is None or entry[:2] != stamp:
            digest = hashlib.sha256()
            with open(path, "rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(chunk)
            entry = [*stamp, digest.hexdigest()]
            index[key] = entry
            changed = True
        total.update(f"{path.name}:{entry[2]}\n".encode())
    if changed:
        _write_atomically(index_path, json.dumps(index).encode())
    return total.hexdigest()


def local_model_dir(model_name: str) -> Path | None:
    """The directory holding a model's files: the path itself, or a hub id's snapshot in the Hugging Face cache
    (None when it is not there yet: the first load downloads it)."""
    if os.path.isdir(model_name):
        return Path(model_name)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_name, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, not a hub id, no hub library: no cache key yet
        return None


def graph_file(model_name: str, output: GraphOutput) -> Path | None:
    """Where the graph of ``model_name`` computing ``output`` is (or will be) cached; None without local files."""
    model_dir = local_model_dir(model_name)
    if model_dir is None:
        return None
    key = {
        "format": GRAPH_FORMAT,
        "files": files_digest(model_files(model_dir)),
        "output": output,
        "openvino": openvino_version(),
        "transformers": importlib.metadata.version("transformers"),  # without importing it (graph_snapshot.py)
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "openvino" / digest / "model.xml"


@contextlib.contextmanager
def converting(model_name: str, output: GraphOutput, graph: Path | None) -> Iterator[None]:
    """Held (an exclusive ``flock`` in the cache) while this process converts or quantizes ``model_name``'s graph.

    Without it, processes that start on one model at once, such as Ray's workers on one node on a fresh cache,
    each ran a conversion child beside the others (each with its own peak, ~0.56 GiB for MiniLM) and wrote the
    same files at the same time. The caller looks in the cache again once it holds the lock: a graph another
    process converted meanwhile is read, not converted again. The lock is the graph's cache entry where the model's
    files are local (``graph``, :func:`graph_file`: named by their contents, so two copies of one model in two
    folders convert once too), else the model's name and output. Where the cache cannot be written, nothing is
    locked and the conversion reports that itself."""
    directory = cache_dir() / "openvino"
    local = os.path.abspath(model_name) if os.path.isdir(model_name) else model_name
    name = graph.parent.name if graph is not None else hashlib.sha256(f"{local}|{output}".encode()).hexdigest()[:24]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle = open(directory / f"converting-{name}.lock", "a")
    except OSError:
        handle = None
    with handle if handle is not None else contextlib.nullcontext():
        if handle is not None and fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)  # let go when the file closes, or when the process dies
        yield


def nncf_version() -> str | None:
    """The installed NNCF's version (what ``--quantize int8`` on the compiled backend needs), or None."""
    try:
        return importlib.metadata.version("nncf")
    except importlib.metadata.PackageNotFoundError:
        return None


def int8_graph_file(fp32_graph: Path) -> Path:
    """Where the int8 copy of the graph cached at ``fp32_graph`` is: beside it, named by its scheme and the NNCF
    that made it."""
    return fp32_graph.with_name(f"model-int8-{INT8_SCHEME}-nncf{nncf_version()}.xml")


def _write_atomically(path: Path, data: bytes) -> None:
    """Best effort: a cache that cannot be written only costs the next run its conversion."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomically(path, data, private=True)
    except OSError as exc:
        log.info("could not write the cache file %s: %s", path, exc)


# -- the graph files ---------------------------------------------------------------------------------------------------


def save_graph(graph, path: Path) -> bool:
    """Write ``graph`` to ``path`` (.xml + .bin) so that a reader never sees half of it; False if not writable."""
    openvino = import_openvino()

    tmp = temporary_path(path, private=True)  # its .bin beside it: tmp.with_suffix(".bin")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        openvino.save_model(graph, str(tmp), compress_to_fp16=False)
        replace_durably(tmp.with_suffix(".bin"), path.with_suffix(".bin"))
        replace_durably(tmp, path)
        return True
    except (OSError, RuntimeError) as exc:
        log.info("could not cache the OpenVINO graph in %s: %s", path.parent, exc)
        for leftover in (tmp, tmp.with_suffix(".bin")):
            leftover.unlink(missing_ok=True)
        return False


def cached_graph(path: Path | None, model_name: str) -> Path:
    """``path`` when the child wrote it, else the error that says the cache cannot be written."""
    if path is None or not path.is_file():
        raise not_cached_error(model_name)
    return path


def not_cached_error(model_name: str) -> ModelLoadError:
    return ModelLoadError(
        f"the OpenVINO graph of {model_name!r} could not be cached in {cache_dir()}; "
        "make it writable (or set MEMFIT_CACHE_DIR), or use --backend torch"
    )
