"""The compiled graph: a cached OpenVINO graph compiled for the CPU in one precision, and run.

- :func:`compile_graph` compiles it for the CPU in the asked precision (``INFERENCE_PRECISION_HINT``; the one it
  computes in is read back, :func:`computed_precision`), with a bounded shape cache (:data:`RUNTIME_CACHE_ENTRIES`):
  length-sorted batches rarely repeat a shape, and the plugin's default cache of 5,000 compiled shapes grew the
  resident set by ~25 MiB over 120 shapes on MiniLM with no speed gained (docs/memory.md).
- :func:`load_graph` compiles the graph from the cache (``cache.py``), converted (and quantized) first in a child
  process when it is not there (``conversion.py``); :func:`recompiled` compiles it again in another precision
  (the quality guard's fp32 reference).

Inference requests are not thread-safe: each calling thread gets its own (``memfit serve`` runs several model
workers on one compiled model, as OpenVINO streams).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from memfit.engine.graph_cache import (
    GraphOutput,
    cached_or_converted,
    converting,
    graph_input_names,
    remove_abandoned_files,
)
from memfit.engine.openvino.conversion import convert_in_child
from memfit.engine.openvino.cache import cached_graph, graph_file, import_openvino, int8_graph_file, openvino_version
from memfit.errors import ConfigError, GraphCompileError, UnsafeGraphError
from memfit.memory.calibration import read_cache_entry, write_cache_entry

log = logging.getLogger("memfit")

RUNTIME_CACHE_ENTRIES = 16
"""Compiled shapes the CPU plugin keeps (``CPU_RUNTIME_CACHE_CAPACITY``). Measured on all-MiniLM-L6-v2 over
~120 batch shapes (2-core AMD EPYC, AVX-512 BF16): the default 5,000 ended 25 MiB higher than 16, at the same
speed; 0 (no cache) rebuilt kernels for every batch and ended 180 MiB higher."""

UNSAFE_TO_RELEASE_LAYERS = frozenset({"RoPE"})
"""CPU-plugin layers whose buffers, once ``release_memory`` has freed them, a later batch of the shape the layer last
ran uses again: measured with OpenVINO 2026.4.1 on ModernBERT's graph (rotary position embeddings, which the plugin
fuses into ``RoPE`` layers once the graph is read from its cache file), where a calibration probe's second forward of
one shape aborted the process ("corrupted double-linked list", a segmentation fault) in every run; the same graph
without the release, over 300 forwards of random shapes, never did. memfit releases the buffers to measure what a
batch costs from nothing and to make room under the budget (:meth:`CompiledGraph.infer_fresh`), so such a graph is
not run on OpenVINO. BERT-family graphs have no such layer."""

OPENVINO_PRECISION = {"fp32": "f32", "bf16": "bf16"}
"""memfit's dtype names → OpenVINO's inference precision. fp16 is not a CPU precision here."""


@dataclass(frozen=True)
class CompiledGraph:
    """A graph compiled for the CPU in one precision; ``infer`` may be called from several threads."""

    compiled: Any  # openvino.CompiledModel
    source_graph: Any  # what it was compiled from: the cache file's path, or the in-memory openvino.Model
    fp32_weights_bytes: int  # bytes of the unquantized graph's constants as stored (fp32)
    stored_weights_bytes: int  # bytes of this graph's constants as stored (an int8 copy's: mostly int8)
    input_names: tuple[str, ...]
    precision: str  # memfit's name for the float parts: fp32 | bf16
    threads: int
    streams: int
    source: Literal["cache", "converted"]
    _local: threading.local
    fp32_graph: Any = None  # for an int8 copy (quantize_graph): the unquantized graph, the guard's fp32 reference

    @property
    def int8(self) -> bool:
        return self.fp32_graph is not None

    @property
    def directory(self) -> Path | None:
        """The cache directory of the graph file it was compiled from (None: compiled from memory)."""
        return Path(self.source_graph).parent if isinstance(self.source_graph, (str, Path)) else None

    def infer(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """The graph's one output for a padded batch, as a NumPy array that is the caller's to keep."""
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self.compiled.create_infer_request()
        result = request.infer(
            {name: inputs[name] for name in self.input_names}, share_inputs=True, share_outputs=False
        )
        return result[0]

    def infer_fresh(self, inputs: dict[str, np.ndarray]) -> None:
        """One forward on a new inference request, then the compiled model's intermediate buffers released: what a
        batch of this shape costs from nothing. A request reuses the buffers of the largest batch it has run, and the
        compiled model keeps them after the request is gone until ``release_memory``. Kept, a calibration probe's
        measured run grew nothing and its unmeasured first run left its buffers held (MiniLM bf16, 2-core AMD EPYC:
        a first 8 x 256 forward left 26.8 MiB, a second grew 0.0). So the fit saw no cost per token, a 2,048-token
        probe was predicted to cost nothing when a tight budget asked whether it fits, and the buffers it left raised
        the baseline: a budget named by a run that had left the large probes out was then refused by one that ran
        them. Released, the same forward peaks 34.8 MiB above where it started and leaves 2.8 MiB."""
        request = self.compiled.create_infer_request()
        request.infer({name: inputs[name] for name in self.input_names}, share_inputs=True, share_outputs=True)
        del request
        self.release_buffers()

    def release_buffers(self) -> None:
        """Free the intermediate buffers the compiled model keeps for its largest batch so far, every stream's. A
        best effort, safe while another thread runs a batch: the CPU plugin try-locks each stream's graph in turn,
        and where one is running a batch (a server's other model worker) it stops with an error ("busy state"),
        leaving that stream's buffers and the ones after it as they are."""
        try:
            self.compiled.release_memory()
        except RuntimeError as exc:  # what was not released stays held, and the guard reads it so
            log.debug("OpenVINO kept its buffers: %s", str(exc).strip().splitlines()[-1])


def compile_graph(
    graph_or_path: Any,
    input_names: tuple[str, ...],
    precision: str,
    threads: int,
    streams: int,
    source: Literal["cache", "converted"],
    fp32_graph: Path | None = None,
) -> CompiledGraph:
    """Compile for the CPU: ``precision`` (fp32 | bf16), ``threads`` in all, split over ``streams`` requests that
    run at once (one per model worker). ``fp32_graph``: the unquantized graph's file when ``graph_or_path`` is its
    int8 copy."""
    openvino = import_openvino()

    if precision not in OPENVINO_PRECISION:
        raise ConfigError(f"--backend openvino runs fp32 or bf16 on the CPU, not {precision}")
    config = {
        "INFERENCE_PRECISION_HINT": OPENVINO_PRECISION[precision],
        "INFERENCE_NUM_THREADS": max(1, threads),
        "NUM_STREAMS": max(1, streams),
        "CPU_RUNTIME_CACHE_CAPACITY": RUNTIME_CACHE_ENTRIES,
    }
    core = openvino.Core()
    graph = core.read_model(str(graph_or_path)) if isinstance(graph_or_path, (str, Path)) else graph_or_path
    weights = sum(int(op.get_byte_size()) for op in graph.get_ordered_ops() if op.get_type_name() == "Constant")
    # an int8 copy's fp32 constants (what the guard's copy holds) are its fp32 graph's .bin file, as stored
    fp32_weights = weights if fp32_graph is None else fp32_graph.with_suffix(".bin").stat().st_size
    try:
        compiled = core.compile_model(graph, "CPU", config)
    except RuntimeError as exc:  # a kernel missing for this precision on this CPU (or the ISA it is held to)
        reason = [line.strip() for line in str(exc).splitlines() if line.strip()][-1:] or [type(exc).__name__]
        raise GraphCompileError(
            f"OpenVINO cannot compile the graph in {precision} on this CPU: {reason[0]}; use --backend torch"
        ) from None
    unsafe = unsafe_to_release(compiled)
    if unsafe:
        raise unsafe_graph_error(unsafe)
    precision = computed_precision(compiled, precision)
    # The read graph is not kept: recompiling (the quality guard's fp32 reference) reads the file again. Keeping
    # it measured the same resident set (the plugin holds the constants' mapping either way, 127 MiB of clean
    # file pages with OpenVINO's libraries on MiniLM); what the guard leaves resident (~80 MiB) is the plugin's.
    del graph
    return CompiledGraph(
        compiled,
        graph_or_path,
        fp32_weights,
        weights,
        input_names,
        precision,
        threads,
        streams,
        source,
        threading.local(),
        fp32_graph=fp32_graph,
    )


UNSAFE_RECORD = "unsafe-to-release.json"
"""Beside a cached graph: the layers that made it unsafe on this OpenVINO, so a later load refuses it before it
compiles (a compile in the job's own process leaves the plugin's memory behind for the backend that runs instead)."""


def unsafe_graph_error(layers: list[str]) -> UnsafeGraphError:
    return UnsafeGraphError(
        f"OpenVINO's CPU plugin runs this model's {', '.join(layers)} layers, which reuse buffers memfit must be able "
        "to release (the process would crash); use --backend onnxruntime or --backend torch",
        layers,
    )


def recorded_unsafe_layers(directory: Path) -> list[str]:
    """The layers :data:`UNSAFE_RECORD` names for the OpenVINO installed now; none where it is absent, unreadable or
    of another version (whose plugin may fuse otherwise)."""
    layers = read_cache_entry(directory / UNSAFE_RECORD, _unsafe_record_key(), "unsafe", lambda layers: layers)
    return list(layers or [])


def record_unsafe_layers(directory: Path, layers: list[str]) -> None:
    """Write :data:`UNSAFE_RECORD` (best effort: without it, a later load only compiles to find the same)."""
    write_cache_entry(
        directory / UNSAFE_RECORD, _unsafe_record_key(), "unsafe", {"layers": layers}, "the graph's unsafe layers"
    )


def _unsafe_record_key() -> dict[str, str | None]:
    return {"openvino": openvino_version()}


def unsafe_to_release(compiled: Any) -> list[str]:
    """The layers of ``compiled`` (its runtime graph, after the plugin's fusions) that are unsafe to release."""
    kinds = {str(op.get_rt_info()["layerType"].astype(str)) for op in compiled.get_runtime_model().get_ordered_ops()}
    return sorted(kinds & UNSAFE_TO_RELEASE_LAYERS)


def computed_precision(compiled: Any, asked: str) -> str:
    """The precision the compiled graph computes in, read back from the plugin: on a CPU without its bf16 kernels
    (an AVX2-only EPYC: its CPU plugin wants ``avx512_core`` or ``avx2_vnni_2``) OpenVINO takes a bf16 hint and
    computes in f32, and a run that called that bf16 would guard fp32 against itself with a second compiled copy and
    write bf16 in its manifest."""
    computed = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
    if asked == "bf16" and computed == OPENVINO_PRECISION["fp32"]:
        log.warning("OpenVINO computes bf16 in fp32 on this CPU: running fp32")
        return "fp32"
    return asked


def recompiled(graph: CompiledGraph, precision: str) -> CompiledGraph:
    """The same graph compiled again in ``precision``; an int8 copy's unquantized graph (the guard's fp32 reference)."""
    source = graph.fp32_graph if graph.fp32_graph is not None else graph.source_graph
    return compile_graph(source, graph.input_names, precision, graph.threads, graph.streams, graph.source)


def load_graph(
    model_name: str,
    output: GraphOutput,
    with_token_types: bool,
    precision: str,
    threads: int,
    streams: int,
    int8: bool = False,
) -> CompiledGraph:
    """The compiled graph of ``model_name`` (its int8 copy with ``int8``): from the cache, else converted (and
    quantized) first (:func:`convert_in_child`), once however many processes ask at the same time
    (:func:`~memfit.engine.graph_cache.cached_or_converted`, and :func:`~memfit.engine.graph_cache.converting` for
    the int8 copy)."""
    names = graph_input_names(with_token_types)
    path, converted = cached_or_converted(
        "openvino",
        "OpenVINO",
        model_name,
        output,
        lambda: graph_file(model_name, output),
        lambda folder: convert_in_child(model_name, output, with_token_types, False, folder),
    )
    source: Literal["cache", "converted"] = "converted" if converted else "cache"
    if converted:
        log.info("OpenVINO graph converted and cached: %s", path)
    graph_path = int8_graph_file(path) if int8 else path
    if not graph_path.is_file():
        with converting("openvino", model_name, output, path):
            if not graph_path.is_file():  # quantized from the cached fp32 graph, in a child of its own (its own peak)
                remove_abandoned_files(path.parent)
                convert_in_child(model_name, output, with_token_types, True, path.parent)
                graph_path = cached_graph(graph_path, model_name)
                log.info("OpenVINO graph quantized to int8 and cached: %s", graph_path)
                source = "converted"
    if source == "cache":
        log.info("OpenVINO graph from the cache: %s", graph_path)
    recorded = recorded_unsafe_layers(path.parent)
    if recorded:
        raise unsafe_graph_error(recorded)
    try:
        return compile_graph(graph_path, names, precision, threads, streams, source, fp32_graph=path if int8 else None)
    except UnsafeGraphError as exc:
        record_unsafe_layers(path.parent, exc.layers)
        raise
