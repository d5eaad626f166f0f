"""What the compiled backends (OpenVINO, ONNX Runtime) share of their on-disk graph caches.

- :func:`graph_entry` names a cached graph's folder, ``<cache>/<runtime>/<key>/``: the key a hash of the model's
  files (:func:`files_digest`: their SHA-256, remembered per path, size and mtime so a cached start does not
  re-read the weights), what the graph computes and the versions of the libraries that made it.
- :func:`cached_or_converted` finds a cached graph or makes it, holding :func:`converting` while it converts:
  processes that start on the same model at once (Ray's workers on one node, two jobs) convert it once, the others
  wait and read the cache.

Nothing here imports torch or a runtime: a run that finds its graph cached reads only what it needs.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import subprocess
from pathlib import Path
from typing import Callable, Iterator, Literal, Sequence

try:
    import fcntl
except ImportError:  # not POSIX: no lock, each process converts for itself as before
    fcntl = None  # type: ignore[assignment]

from memfit.atomic import abandoned_private_files, private_files, write_bytes_atomically
from memfit.errors import ModelLoadError
from memfit.memory.calibration import cache_dir

log = logging.getLogger("memfit")

GraphOutput = Literal["last_hidden_state", "logits"]
"""What a compiled graph computes: the base model's token states, or a sequence classifier's logits."""


def graph_output(task: str) -> GraphOutput:
    """What the graph of a task (``embedding``, ``classification``) computes."""
    return "last_hidden_state" if task == "embedding" else "logits"


_WEIGHT_SUFFIXES = (".json", ".safetensors", ".bin", ".txt", ".model")


def model_files(model_dir: Path) -> list[Path]:
    """The files whose content decides the graph: configs, weights, vocabularies (a memfit pooled classifier's
    head in ``2_Dense/`` included), in a stable order. A ``.cache`` folder inside the model's directory (where
    ``hf download --local-dir`` keeps its download records) is left out; a ``.cache`` above it is not: Hugging Face
    keeps hub models under ``~/.cache/huggingface/hub``, and leaving out every file whose path passed through one gave
    every such model the same key, so a second model ran the first one's graph."""
    return sorted(
        p
        for p in model_dir.rglob("*")
        if p.is_file() and p.suffix in _WEIGHT_SUFFIXES and ".cache" not in p.relative_to(model_dir).parts
    )


def _hash_index_path() -> Path:
    return cache_dir() / "model-file-hashes.json"


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
        write_cache_bytes(index_path, json.dumps(index).encode())
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


def graph_entry(runtime: str, model_name: str, output: GraphOutput, versions: dict[str, object]) -> Path | None:
    """The cache folder of ``model_name``'s graph computing ``output`` for ``runtime`` (``openvino``,
    ``onnxruntime``), made by the libraries at ``versions`` (and the graph format they write); None without local
    files."""
    model_dir = local_model_dir(model_name)
    if model_dir is None:
        return None
    key = {"files": files_digest(model_files(model_dir)), "output": output, **versions}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / runtime / digest


@contextlib.contextmanager
def converting(runtime: str, model_name: str, output: GraphOutput, graph: Path | None) -> Iterator[None]:
    """Held (an exclusive ``flock`` in ``runtime``'s cache) while this process converts or quantizes
    ``model_name``'s graph.

    Without it, processes that start on one model at once, such as Ray's workers on one node on a fresh cache,
    each ran a conversion child beside the others (each with its own peak, ~0.56 GiB for MiniLM) and wrote the
    same files at the same time. The caller looks in the cache again once it holds the lock: a graph another
    process converted meanwhile is read, not converted again. The lock is the graph's cache entry where the model's
    files are local (``graph``, a file in :func:`graph_entry`: named by their contents, so two copies of one model
    in two folders convert once too), else the model's name and output. Where the cache cannot be written,
    nothing is locked and the conversion reports that itself."""
    local = os.path.abspath(model_name) if os.path.isdir(model_name) else model_name
    name = graph.parent.name if graph is not None else hashlib.sha256(f"{local}|{output}".encode()).hexdigest()[:24]
    with cache_lock(cache_dir() / runtime / f"converting-{name}.lock"):
        yield


def cached_or_converted(
    runtime: str,
    graph: str,
    model_name: str,
    output: GraphOutput,
    locate: Callable[[], Path | None],
    convert: Callable[[Path | None], None],
) -> tuple[Path, bool]:
    """The cached ``graph`` file (``OpenVINO``, ``ONNX``) of ``model_name`` for ``runtime``, and whether this call made
    it. ``locate`` says where it is or will be (None without local files); ``convert`` makes it (a child process)
    when it is missing, given the folder it goes in (None where ``locate`` is), once however many processes ask at
    the same time (:func:`converting`): the path is looked up again under the lock, and after the conversion, when a
    hub model's files are local. Before converting, it removes what a conversion killed mid-way left in the graph's
    folder (:func:`remove_abandoned_files`)."""
    path = locate()
    if path is not None and path.is_file():
        return path, False
    with converting(runtime, model_name, output, path):
        path = locate()  # another process may have converted it while this one waited
        if path is not None and path.is_file():
            return path, False
        folder = None if path is None else path.parent
        if folder is not None:
            remove_abandoned_files(folder)
        convert(folder)
        path = locate()
        if path is None or not path.is_file():
            raise not_cached_error(graph, model_name)
        return path, True


ABANDONED_AFTER_S = 3600.0
"""A half-written file in a graph's folder is removed once its writer is not running here and it has not been
written for an hour: a writer in another container sharing the cache is not seen running (its pid is its own
machine's), but it writes its file while it converts."""


def remove_abandoned_files(entry: Path) -> None:
    """Remove the half-written files that killed conversions left in a graph's cache folder ``entry``
    (:data:`ABANDONED_AFTER_S`): a conversion child stopped by the out-of-memory killer leaves its private temporary
    graph (MiniLM's is 90 MB, multilingual-e5-small's 470 MB), and every later attempt that is killed adds one.
    Held under :func:`converting`'s lock. A child this process saw killed is cleaned up at once
    (:func:`run_conversion_child`)."""
    _remove(abandoned_private_files(entry, ABANDONED_AFTER_S))


def _remove(leftovers: list[Path]) -> None:
    for leftover in leftovers:
        with contextlib.suppress(OSError):
            size = leftover.stat().st_size
            leftover.unlink()
            log.info("removed %s (%.1f MB), left by a conversion that did not finish", leftover, size / 1e6)


@contextlib.contextmanager
def cache_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (made if missing) while the block runs: one process at a time makes what
    the others then read from the cache. Where the cache cannot be written, nothing is locked."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")
    except OSError:
        handle = None
    with handle if handle is not None else contextlib.nullcontext():
        if handle is not None and fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)  # let go when the file closes, or when the process dies
        yield


def run_conversion_child(
    command: list[str], failed: str, after_a_signal: list[str] | None = None, writes_in: Path | None = None
) -> None:
    """Run a conversion child (``command``) to its end; its last line of stderr (a one-line ``memfit: ...`` error)
    as a :class:`ModelLoadError` when it fails, else ``failed`` with its exit code. ``after_a_signal``: the command
    run instead, once, when the child was killed by a signal (the kernel's out-of-memory killer, for a conversion
    whose optional steps need more memory than the plain one). ``writes_in``: the folder the child writes its
    graph in, where a killed child's half-written files are removed."""
    returncode, stderr = _run_child(command, writes_in)
    if returncode < 0 and after_a_signal is not None:
        log.warning(
            "the conversion child was killed by signal %d; converting again without its optional steps", -returncode
        )
        returncode, stderr = _run_child(after_a_signal, writes_in)
    if returncode != 0:
        lines = [line for line in stderr.strip().splitlines() if line.strip()]
        raise ModelLoadError(lines[-1].removeprefix("memfit: ") if lines else f"{failed} (exit {returncode})")


def _run_child(command: list[str], writes_in: Path | None) -> tuple[int, str]:
    """A child's exit code and stderr; the private files it left in ``writes_in`` removed when a signal killed it."""
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as child:
        _, stderr = child.communicate()
    if child.returncode < 0 and writes_in is not None:
        _remove([path for path, writer in private_files(writes_in) if writer == child.pid])
    return child.returncode, stderr


def package_version(name: str) -> str | None:
    """An installed package's version without importing it (a cache key names the libraries that made a graph),
    or None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def not_cached_error(graph: str, model_name: str) -> ModelLoadError:
    """The error of a conversion whose ``graph`` (``OpenVINO``, ``ONNX``) the cache could not keep."""
    return ModelLoadError(
        f"the {graph} graph of {model_name!r} could not be cached in {cache_dir()}; "
        "make it writable (or set MEMFIT_CACHE_DIR), or use --backend torch"
    )


def write_cache_bytes(path: Path, data: bytes) -> None:
    """Best effort: a cache that cannot be written only costs the next run its conversion."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomically(path, data, private=True)
    except OSError as exc:
        log.info("could not write the cache file %s: %s", path, exc)


def graph_input_names(with_token_types: bool) -> tuple[str, ...]:
    """The inputs a traced graph takes, in order: segment ids only for a model that has them."""
    return ("input_ids", "attention_mask", "token_type_ids") if with_token_types else ("input_ids", "attention_mask")
