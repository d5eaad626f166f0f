"""ONNX Runtime on the CPU (``--backend onnxruntime``): the model exported once to ONNX (``onnx_export.py``) and run
by ONNX Runtime's CPU execution provider, in fp32.

Why: on the AVX2-only AMD EPYC (Zen 3, no AVX-512, no VNNI, no bf16) ONNX Runtime ran all-MiniLM-L6-v2 at 203
texts/s where OpenVINO fp32 ran 166 and PyTorch 123, on the same length-sorted batches of 2,000 real reviews
(issue 32). Where the CPU has fast bf16, OpenVINO's bf16 graph is faster still (docs/benchmarks.md, "ONNX
Runtime"). So ``--backend auto`` measures which of the two is faster on the CPU it runs on, once, where both can
run the request (fp32: ``backend_choice.py``), and runs that one.

How it runs:
- One ``InferenceSession`` per loaded model, opened with all of ONNX Runtime's graph optimizations (it fuses the
  layer norms, GELUs and some matrix products of a BERT-family graph; the export already fused each layer's
  attention where the model allows: ``onnx_export.py``),
  ``intra_op_num_threads`` the process's PyTorch thread count, and threads that sleep rather than spin between
  batches, leaving the core to the tokenizer.
- **Its memory arena shrinks after every batch** (the run option ``memory.enable_memory_arena_shrinkage``). With
  the arena left to grow, a batch's activations stay held for good: one batch of 64 windows of 256 tokens left
  MiniLM's process at 1,546 MiB against 574-644 MiB without the arena. The budget's calibration measures what one
  batch costs from nothing, which only holds when a batch gives its memory back. Without an arena, every
  activation is its own allocation, and with the mmap threshold memfit fixes for the budget
  (``engine/process.py``) its own ``mmap``: 141-148 texts/s where the arena that shrinks ran 178-199, and held
  the same 495 MiB after a large batch (docs/benchmarks.md, "ONNX Runtime").
- **The tokenizer and config are kept beside the exported graph** (``graph_snapshot.py``), as beside OpenVINO's: a
  run that finds both starts without transformers or torch (the bundled MiniLM on its 30-text sample: 1.84-2.06 s
  and 291 MiB, against 4.51-5.07 s and 459 MiB that imported both to tokenize; Intel Xeon with AMX).
- Its output is handed to the same heads the other backends feed, as numpy arrays (``batches.GraphEngine``,
  which runs OpenVINO's graphs too).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from memfit.engine.backend import BackendKind, LoadRequest
from memfit.engine.batches import Engine, GraphEngine, Head, graph_probe_inputs
from memfit.engine.graph_cache import GraphOutput, graph_input_names, graph_output, package_version
from memfit.engine.graph_snapshot import save_snapshot, snapshot_beside, snapshot_config_beside
from memfit.engine.onnx_export import ATTENTION_METADATA, cached_onnx_file, onnx_file, onnxruntime_version
from memfit.engine.process import compute_threads
from memfit.errors import ModelLoadError, exception_line
from memfit.memory.calibration import Network
from memfit.memory.device import Device


@dataclass(frozen=True)
class OnnxSession:
    """An ONNX graph opened by ONNX Runtime; ``run`` may be called from several threads at once."""

    session: Any  # onnxruntime.InferenceSession
    run_options: Any  # onnxruntime.RunOptions: the arena shrinks when a batch ends
    input_names: tuple[str, ...]
    path: Path
    exported: bool  # this load exported the graph (else it was read from the cache)

    def run(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """The graph's one output for a padded batch, as a NumPy array that is the caller's to keep."""
        return self.session.run(None, {name: inputs[name] for name in self.input_names}, self.run_options)[0]


def open_session(path: Path, threads: int, exported: bool) -> OnnxSession:
    """Open the graph at ``path`` for the CPU (the module docstring says how, and why its arena shrinks). It is fed
    the inputs the graph has: the export drops one the model never reads (DeBERTa-v2 has no segment embeddings, yet its
    tokenizer makes ``token_type_ids``), and ONNX Runtime refuses an input the graph lacks."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = max(1, threads)
    options.inter_op_num_threads = 1
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3  # errors only: its warnings name graph nodes, not anything a user can act on
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - any failure to open the graph means: this backend cannot run it
        raise ModelLoadError(
            f"ONNX Runtime cannot open the exported graph ({exception_line(exc)}); use --backend torch"
        ) from exc
    input_names = tuple(node.name for node in session.get_inputs())
    unknown = sorted(set(input_names) - set(graph_input_names(with_token_types=True)))
    if unknown:
        raise ModelLoadError(
            f"the exported graph asks for inputs memfit does not make ({', '.join(unknown)}); use --backend torch"
        )
    run_options = onnxruntime.RunOptions()
    run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return OnnxSession(session, run_options, input_names, path, exported)


def session_network(session: OnnxSession, config: Any, output: GraphOutput) -> Network:
    """An ONNX session as the memory layer sees it. The exported attention materialises batch x heads x length^2
    scores, so calibration fits that term; the weights are the graph file's fp32 initializers, which ONNX Runtime
    copies into its own memory when it opens the file. A graph whose attention the export fused holds far less per
    batch than a plain one, so its calibrations are its own (the attention named in the memory model's key)."""
    fused = session.session.get_modelmeta().custom_metadata_map.get(ATTENTION_METADATA) == "fused"
    vocab = int(getattr(config, "vocab_size", 1000) or 1000)
    generator = np.random.default_rng(0)

    def probe(batch: int, length: int) -> None:
        session.run(graph_probe_inputs(generator, vocab, batch, length))

    return Network(
        config=config,
        compute_dtype="fp32",
        weights_bytes=session.path.stat().st_size,
        attention="onnxruntime fused" if fused else "onnxruntime",
        attention_materialized=True,
        runtime=f"onnxruntime {onnxruntime_version()}",
        kind=f"onnx:{output}",
        probe=probe,
    )


@dataclass(frozen=True)
class OnnxRuntimeBackend:
    """An :class:`OnnxSession` behind the backend interface (``memfit.engine.backend``)."""

    session: OnnxSession
    output: GraphOutput
    pad_token_id: int
    network: Network
    name: str = "onnxruntime"
    dtype: str = "fp32"
    module: None = None
    retries_fp32: bool = False

    def engine(self, head: Head) -> Engine:
        return GraphEngine(self.session.run, self.session.input_names, self.output, self.pad_token_id, head)

    def fp32_reference(self) -> Callable[[Head], Engine]:
        # it runs fp32 already, so the quality guard (which measures reduced precision) never asks for a copy
        return self.engine

    def fp32_copy_bytes(self) -> int:
        return 0

    def guard_identity(self) -> str | None:
        return None

    def release_buffers(self) -> None:
        pass  # its arena shrinks after every batch (the module's docstring)


def _unavailable(device: Device, dtype: str, quantize: str) -> str | None:
    if device.type != "cpu":
        return f"--backend onnxruntime runs on the CPU; on {device} use --backend torch"
    if quantize != "none":
        return "--quantize int8 runs on --backend openvino or torch, not onnxruntime"
    if dtype != "fp32":
        return f"--backend onnxruntime runs fp32 on the CPU, not {dtype}; add --dtype fp32"
    missing = [
        name
        for name, version in (("onnxruntime", onnxruntime_version()), ("onnx", package_version("onnx")))
        if version is None
    ]
    if missing:
        return f"--backend onnxruntime needs {' and '.join(missing)} (pip install 'memfit[onnx]')"
    return None


def _load(request: LoadRequest) -> OnnxRuntimeBackend:
    """The exported graph (exported once and cached) opened by ONNX Runtime, in fp32. The model's tokenizer and
    config are written beside the graph when this run did not read them from a snapshot (``graph_snapshot.py``), so a
    later run starts without transformers."""
    from memfit.engine.models import load_model_config

    output = graph_output(request.task)
    path, exported = cached_onnx_file(request.model_name, output, request.uses_token_types)
    session = open_session(path, compute_threads(), exported)
    config = request.config if request.config is not None else load_model_config(request.model_name)
    if request.config is None and request.tokenizer is not None:
        save_snapshot(path.parent, request.tokenizer, config)
    return OnnxRuntimeBackend(session, output, request.pad_token_id, session_network(session, config, output))


def _snapshot(model_name: str, task: str) -> tuple[Any, Any] | None:
    """The tokenizer and config an earlier run wrote beside the model's cached ONNX graph for ``task``, so this run
    needs no transformers (and no torch); else None."""
    return snapshot_beside(onnx_file(model_name, graph_output(task)), model_name)


def _snapshot_config(model_name: str, task: str) -> Any:
    """:func:`_snapshot`'s config alone, the tokenizer left unbuilt."""
    return snapshot_config_beside(onnx_file(model_name, graph_output(task)), model_name)


ONNXRUNTIME = BackendKind(
    "onnxruntime",
    "ONNX Runtime",
    _unavailable,
    _load,
    _snapshot,
    _snapshot_config,
    runtime_version=onnxruntime_version,
)
