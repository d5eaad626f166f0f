"""The compiled CPU backend: the model converted once to an OpenVINO graph, cached on disk, run by OpenVINO;
this module puts the graph (``cache.py``, ``conversion.py``, ``compiled.py``) behind the backend interface.

Why: PyTorch eager runs a BERT-family encoder at well under half of what a 2-core CPU can do (on a 2-core
AMD EPYC with AVX-512 BF16, all-MiniLM-L6-v2 on short reviews: PyTorch fp32 ~104 GFLOP/s, OpenVINO fp32
~170 and bf16 ~280 of a ~170-240 GFLOP/s fp32 / twice that bf16 peak; ../shared/MEASURED.md,
docs/benchmarks.md). OpenVINO's CPU plugin fuses the attention and layer-norm blocks and runs fp32, bf16
(AVX-512 BF16 or AMX) and int8 from one graph; it runs on AMD CPUs too.

:func:`graph_engine` runs a batch of windows (``batches.GraphEngine``) and hands the result, a numpy array, to the
same heads the PyTorch engine feeds, so pooling, token rows and classification scores are computed by one piece of
code whatever the backend; a run on a cached graph never imports torch (``memory/device.py``). :data:`OPENVINO` is
the backend's entry in ``engine/registry.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memfit.engine.backend import BackendKind, LoadRequest
from memfit.engine.batches import GraphEngine, Head, graph_probe_inputs
from memfit.engine.graph_cache import GraphOutput, graph_output
from memfit.engine.graph_snapshot import save_snapshot, snapshot_beside, snapshot_config_beside
from memfit.engine.process import compute_threads
from memfit.engine.openvino.cache import (
    INT8_SCHEME,
    graph_file,
    import_openvino,
    nncf_version,
    openvino_version,
)
from memfit.engine.openvino.compiled import OPENVINO_PRECISION, CompiledGraph, load_graph, recompiled
from memfit.errors import GraphCompileError
from memfit.memory.calibration import Network
from memfit.memory.device import DTYPE_BYTES, Device, DtypeName

log = logging.getLogger("memfit")


def graph_engine(graph: CompiledGraph, output: GraphOutput, pad_token_id: int, head: Head) -> GraphEngine:
    """An engine that runs padded batches of windows through ``graph``."""
    return GraphEngine(graph.infer, graph.input_names, output, pad_token_id, head)


def graph_network(graph: CompiledGraph, config: Any, output: GraphOutput) -> Network:
    """A compiled graph as the memory layer sees it. Its attention materialises batch x heads x length^2 scores
    (measured on MiniLM: 49 B per cell in fp32 at 512 tokens, docs/memory.md), so calibration fits that term."""
    openvino = import_openvino()

    vocab = int(getattr(config, "vocab_size", 1000) or 1000)
    generator = np.random.default_rng(0)

    def probe(batch: int, length: int) -> None:
        graph.infer_fresh(graph_probe_inputs(generator, vocab, batch, length))

    dtype: DtypeName = "bf16" if graph.precision == "bf16" else "fp32"
    return Network(
        config=config,
        compute_dtype=dtype,
        # the float constants in the precision they compute in; an int8 copy's as stored (its kept layers in fp32)
        weights_bytes=(
            graph.stored_weights_bytes if graph.int8 else graph.fp32_weights_bytes * DTYPE_BYTES[dtype] // 4
        ),
        attention="openvino",
        attention_materialized=True,
        runtime=f"openvino {openvino.get_version()}"
        + (f" int8 scheme {INT8_SCHEME} nncf {nncf_version()}" if graph.int8 else ""),
        kind=f"graph:{output}",
        probe=probe,
    )


# -- the backend -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpenVINOBackend:
    """A :class:`CompiledGraph` behind the backend interface (``memfit.engine.backend``)."""

    graph: CompiledGraph
    output: GraphOutput
    pad_token_id: int
    network: Network
    name: str = "openvino"
    module: None = None
    retries_fp32: bool = True  # its fp32 runs faster than PyTorch's fp32 (docs/precision.md)

    @property
    def dtype(self) -> str:
        return self.graph.precision  # auto's bf16 may have become fp32 (a kernel this CPU lacks)

    def engine(self, head: Head) -> GraphEngine:
        return graph_engine(self.graph, self.output, self.pad_token_id, head)

    def fp32_reference(self):
        graph, output, pad = self.graph, self.output, self.pad_token_id
        return lambda head: graph_engine(recompiled(graph, "fp32"), output, pad, head)

    def fp32_copy_bytes(self) -> int:
        # its fp32 constants counted twice: the compiled copy, and the cache file's pages it reads
        return 2 * self.graph.fp32_weights_bytes

    def guard_identity(self) -> str | None:
        if self.graph.directory is None:
            return None
        return f"{self.graph.directory.name}/{Path(self.graph.source_graph).name}"

    def release_buffers(self) -> None:
        self.graph.release_buffers()


def _unavailable(device: Device, dtype: str, quantize: str) -> str | None:
    if device.type != "cpu":
        return f"--backend openvino runs on the CPU; on {device} use --backend torch"
    if quantize != "none" and nncf_version() is None:
        return "--quantize int8 on --backend openvino needs NNCF (pip install 'memfit[int8]')"
    if dtype not in OPENVINO_PRECISION:
        return f"--backend openvino runs fp32 or bf16 on the CPU, not {dtype}"
    if openvino_version() is None:
        return "--backend openvino needs the openvino package (pip install openvino)"
    return None


def _load(request: LoadRequest) -> OpenVINOBackend:
    """The compiled graph (converted once and cached). Under ``dtype=auto`` a bf16 graph this CPU cannot compile is
    compiled in fp32 (still faster than PyTorch's fp32), and ``--quantize int8`` keeps auto's pick for the float
    parts. The model's tokenizer and config are written beside the graph when this run did not read them from there
    (``graph_snapshot.py``), so a later run starts without transformers."""
    from memfit.engine.models import load_model_config, resolve_dtype

    output = graph_output(request.task)
    threads = compute_threads() * request.streams
    int8 = request.quantize == "int8"
    dtype = resolve_dtype("auto", request.device) if int8 and request.dtype_was_auto else request.dtype
    name, types, streams = request.model_name, request.uses_token_types, request.streams
    try:
        graph = load_graph(name, output, types, dtype, threads, streams, int8=int8)
    except GraphCompileError as exc:
        if not (request.dtype_was_auto and dtype != "fp32"):
            raise
        log.warning("%s; running it in fp32", str(exc).removesuffix("; use --backend torch"))
        graph = load_graph(name, output, types, "fp32", threads, streams, int8=int8)
    config = request.config if request.config is not None else load_model_config(name)
    if request.config is None and request.tokenizer is not None and graph.directory is not None:
        save_snapshot(graph.directory, request.tokenizer, config)
    return OpenVINOBackend(graph, output, request.pad_token_id, graph_network(graph, config, output))


def _snapshot(model_name: str, task: str) -> tuple[Any, Any] | None:
    """The tokenizer and config an earlier run wrote beside the model's cached graph for ``task`` (the base model's
    token states, or a sequence classifier's logits), so this run needs no transformers; else None."""
    return snapshot_beside(graph_file(model_name, graph_output(task)), model_name)


def _snapshot_config(model_name: str, task: str) -> Any:
    """:func:`_snapshot`'s config alone, the tokenizer left unbuilt."""
    return snapshot_config_beside(graph_file(model_name, graph_output(task)), model_name)


OPENVINO = BackendKind(
    "openvino", "OpenVINO", _unavailable, _load, _snapshot, _snapshot_config, runtime_version=openvino_version
)
