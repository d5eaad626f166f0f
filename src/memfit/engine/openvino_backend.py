"""The compiled CPU backend: the model converted once to an OpenVINO graph, cached on disk, run by OpenVINO.

Why: PyTorch eager runs a BERT-family encoder at well under half of what a 2-core CPU can do (on a 2-core
AMD EPYC with AVX-512 BF16, all-MiniLM-L6-v2 on short reviews: PyTorch fp32 ~104 GFLOP/s, OpenVINO fp32
~170 and bf16 ~280 of a ~170-240 GFLOP/s fp32 / twice that bf16 peak; ../shared/MEASURED.md,
docs/benchmarks.md). OpenVINO's CPU plugin fuses the attention and layer-norm blocks and runs fp32, bf16
(AVX-512 BF16 or AMX) and int8 from one graph; it runs on AMD CPUs too.

The steps, each explicit:

- :func:`graph_file` finds the cached graph: ``<cache>/openvino/<key>/model.xml`` (+ ``.bin``), the key a hash of
  the model's files (their SHA-256, remembered per path, size and mtime so a cached start does not re-read
  the weights), the task, the transformers and OpenVINO versions.
- :func:`convert` traces the loaded fp32 PyTorch module once (``openvino.convert_model``) with dynamic batch
  and length and returns only what the heads read (``last_hidden_state`` or ``logits``); :func:`save_graph`
  writes it atomically (the ``.bin`` first, the ``.xml`` last: an ``.xml`` present means a whole graph).
  The graph is stored in fp32; the precision is chosen when it is compiled, so one file serves both.
- :func:`compile_graph` compiles it for the CPU in the asked precision (``INFERENCE_PRECISION_HINT``), with a
  bounded shape cache (:data:`RUNTIME_CACHE_ENTRIES`): length-sorted batches rarely repeat a shape, and the
  plugin's default cache of 5,000 compiled shapes grew the resident set by ~25 MiB over 120 shapes on MiniLM
  with no speed gained (docs/memory.md).
- :class:`OpenVINOEngine` runs a batch of windows and hands the result, as torch tensors that share its
  memory, to the same heads the PyTorch engine feeds, so pooling, token rows and classification scores are
  computed by one piece of code whatever the backend.

``--quantize int8`` (with NNCF installed, the ``int8`` extra) compiles an int8 copy of the graph instead,
quantized once by NNCF's post-training quantization in the converting child and cached beside the fp32 graph
(:func:`quantize_graph`): int8 weights and activations everywhere but the feed-forward output projections, whose
inputs (the GELU's long-tailed outputs) int8 would wreck, and the rest in the float precision asked. Its
activation ranges are calibrated on random sequences of ordinary tokens, no text: measured on all-MiniLM-L6-v2,
that calibration gave the same min cosine against fp32 as 300 real news sentences (0.996-0.997;
benchmarks/bench_openvino_int8.py, docs/precision.md), and the quality guard measures every int8 run on the
run's own texts.

Inference requests are not thread-safe: each calling thread gets its own (``memfit serve`` runs several model
workers on one compiled model, as OpenVINO streams).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np
import torch

from memfit.atomic import replace_durably, temporary_path, write_bytes_atomically
from memfit.data.chunking import Window
from memfit.engine.backend import BackendKind, LoadRequest
from memfit.engine.batches import Head, pad_arrays
from memfit.errors import ConfigError, GraphCompileError, ModelLoadError
from memfit.memory.calibration import Network, cache_dir

log = logging.getLogger("memfit")

GraphOutput = Literal["last_hidden_state", "logits"]

GRAPH_FORMAT = 1
"""Bump when what :func:`convert` writes changes, so older cached graphs are not used."""

RUNTIME_CACHE_ENTRIES = 16
"""Compiled shapes the CPU plugin keeps (``CPU_RUNTIME_CACHE_CAPACITY``). Measured on all-MiniLM-L6-v2 over
~120 batch shapes (2-core AMD EPYC, AVX-512 BF16): the default 5,000 ended 25 MiB higher than 16, at the same
speed; 0 (no cache) rebuilt kernels for every batch and ended 180 MiB higher."""

OPENVINO_PRECISION = {"fp32": "f32", "bf16": "bf16"}
"""memfit's dtype names → OpenVINO's inference precision. fp16 is not a CPU precision here."""

INT8_KEPT_IN_FLOAT = (r".*layer\.\d+\.output\.dense.*", r".*layer\.\d+\.ffn\.lin2.*")
"""Operations :func:`quantize_graph` leaves in float: the feed-forward output projections (BERT, RoBERTa, MPNet,
MiniLM: ``layer.N.output.dense``; DistilBERT: ``layer.N.ffn.lin2``). In int8 they cost all-MiniLM-L6-v2 its
min cosine (0.985 with them, 0.996 without, on long texts); an architecture named otherwise is quantized whole and
judged by the quality guard."""

INT8_SCHEME = 1
"""Bump when what :func:`quantize_graph` makes changes (what it keeps in float, its calibration), so older cached
int8 graphs are not used."""

INT8_CALIBRATION_SEQUENCES = 300
INT8_CALIBRATION_LENGTHS = (8, 128)  # ordinary tokens per sequence, special tokens added


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


# -- the cache key -----------------------------------------------------------------------------------------------


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


# -- conversion --------------------------------------------------------------------------------------------------


class _GraphModule(torch.nn.Module):
    """The model with positional inputs and one output, as the graph has them."""

    def __init__(self, model: torch.nn.Module, output: GraphOutput, with_token_types: bool):
        super().__init__()
        self.model = model
        self.output = output
        self.with_token_types = with_token_types

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.with_token_types:
            inputs["token_type_ids"] = token_type_ids
        return getattr(self.model(**inputs), self.output)


def graph_input_names(with_token_types: bool) -> tuple[str, ...]:
    return ("input_ids", "attention_mask", "token_type_ids") if with_token_types else ("input_ids", "attention_mask")


def convert(model: torch.nn.Module, output: GraphOutput, with_token_types: bool):
    """Trace ``model`` (fp32, eval) into an OpenVINO graph with dynamic batch and length."""
    openvino = import_openvino()

    names = graph_input_names(with_token_types)
    fill = {"token_type_ids": torch.zeros}
    example = tuple(fill.get(name, torch.ones)(2, 16, dtype=torch.long) for name in names)
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            # tracing warns about every Python-level shape check in transformers' attention code; the graph
            # is checked against PyTorch by the tests (tests/test_backends.py), not by these warnings
            warnings.simplefilter("ignore")
            graph = openvino.convert_model(
                _GraphModule(model, output, with_token_types),
                example_input=example,
                input=[(name, [-1, -1], torch.long) for name in names],
            )
    except Exception as exc:  # noqa: BLE001 - any tracing failure means: this model does not convert
        raise ModelLoadError(
            f"OpenVINO cannot convert this model ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0][:200]}); use --backend torch"
        ) from exc
    for node, name in zip(graph.inputs, names):
        node.get_tensor().set_names({name})
    return graph


def quantize_graph(graph, tokenizer, with_token_types: bool, position_limit: int):
    """An int8 copy of ``graph`` by NNCF's post-training quantization (module docstring), its activation ranges
    calibrated on random sequences of ordinary tokens of ``tokenizer``'s vocabulary, none longer than the model's
    ``position_limit``. Raises :class:`ModelLoadError` when NNCF cannot quantize it."""
    import nncf

    from memfit.data.chunking import SpecialTokens

    generator = np.random.default_rng(0)
    specials = SpecialTokens.from_tokenizer(tokenizer)
    special = set(tokenizer.all_special_ids)
    ordinary = np.array([i for i in range(len(tokenizer)) if i not in special])
    longest = min(INT8_CALIBRATION_LENGTHS[1], position_limit - len(specials.prefix) - len(specials.suffix))
    shortest = min(INT8_CALIBRATION_LENGTHS[0], longest)
    samples = []
    for _ in range(INT8_CALIBRATION_SEQUENCES):
        length = int(generator.integers(shortest, longest + 1))
        ids = np.array([[*specials.prefix, *generator.choice(ordinary, length).tolist(), *specials.suffix]])
        sample = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        if with_token_types:
            sample["token_type_ids"] = np.zeros_like(ids)
        samples.append(sample)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return nncf.quantize(
                graph,
                nncf.Dataset(samples),
                model_type=nncf.ModelType.TRANSFORMER,
                subset_size=len(samples),
                ignored_scope=nncf.IgnoredScope(patterns=list(INT8_KEPT_IN_FLOAT), validate=False),
            )
    except Exception as exc:  # noqa: BLE001 - any failure of NNCF's means: this graph does not quantize
        raise ModelLoadError(
            f"NNCF cannot quantize this model to int8 ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else 'no message'}); "
            "drop --quantize int8, or use --backend torch"
        ) from exc


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


# -- compiled graph and engine -----------------------------------------------------------------------------------


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
        """One forward on a new inference request, dropped afterwards: what a batch of this shape costs from
        nothing (a kept request reuses the buffers of its largest batch so far, which would hide the cost)."""
        request = self.compiled.create_infer_request()
        request.infer({name: inputs[name] for name in self.input_names}, share_inputs=True, share_outputs=True)
        del request


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
    quantized) first (:func:`convert_in_child`)."""
    names = graph_input_names(with_token_types)
    source: Literal["cache", "converted"] = "cache"
    path = graph_file(model_name, output)
    if path is None or not path.is_file():
        convert_in_child(model_name, output, with_token_types, False)
        path = _cached(graph_file(model_name, output), model_name)  # a hub model's files are local now
        log.info("OpenVINO graph converted and cached: %s", path)
        source = "converted"
    graph_path = int8_graph_file(path) if int8 else path
    if not graph_path.is_file():  # quantized from the cached fp32 graph, in a child of its own (its own peak)
        convert_in_child(model_name, output, with_token_types, True)
        graph_path = _cached(graph_path, model_name)
        log.info("OpenVINO graph quantized to int8 and cached: %s", graph_path)
        source = "converted"
    elif source == "cache":
        log.info("OpenVINO graph from the cache: %s", graph_path)
    return compile_graph(graph_path, names, precision, threads, streams, source, fp32_graph=path if int8 else None)


def _cached(path: Path | None, model_name: str) -> Path:
    """``path`` when the child wrote it, else the error that says the cache cannot be written."""
    if path is None or not path.is_file():
        raise _not_cached(model_name)
    return path


def _not_cached(model_name: str) -> ModelLoadError:
    return ModelLoadError(
        f"the OpenVINO graph of {model_name!r} could not be cached in {cache_dir()}; "
        "make it writable (or set MEMFIT_CACHE_DIR), or use --backend torch"
    )


def convert_in_child(model_name: str, output: GraphOutput, with_token_types: bool, int8: bool = False) -> None:
    """Convert and cache the graph in a child process, once per model and machine (and with ``int8`` its int8
    copy, :func:`quantize_graph`).

    In this process the traced graph shares the PyTorch weights and the tracer keeps them (and ~55 MiB more)
    alive after both are deleted (measured on MiniLM: 145 MiB of the job's memory held for good); a child gives
    everything back when it exits. Its own peak (~0.56 GiB for MiniLM, docs/memory.md) comes before the job
    starts and once: later runs read the cache."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "memfit.engine.openvino_backend",
            model_name,
            output,
            "1" if with_token_types else "0",
            "1" if int8 else "0",
        ],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        raise ModelLoadError(
            lines[-1].removeprefix("memfit: ")
            if lines
            else f"converting {model_name!r} for OpenVINO failed (exit {result.returncode})"
        )


def _convert_main(model_name: str, output: GraphOutput, with_token_types: bool, int8: bool) -> int:
    """The child of :func:`convert_in_child`: load the fp32 PyTorch module, convert, save; or, with ``int8``,
    quantize the cached fp32 graph and save that. A one-line error."""
    from memfit.errors import MemfitError

    try:
        if int8:
            from memfit.engine.models import load_model_config, load_tokenizer, model_position_limit

            path = _cached(graph_file(model_name, output), model_name)
            graph = import_openvino().Core().read_model(str(path))
            limit = model_position_limit(load_model_config(model_name))
            quantized = quantize_graph(graph, load_tokenizer(model_name), with_token_types, limit)
            if not save_graph(quantized, int8_graph_file(path)):
                raise ModelLoadError(f"the int8 OpenVINO graph of {model_name!r} could not be cached in {path.parent}")
        else:
            graph = convert(_fp32_module(model_name, output), output, with_token_types)
            path = graph_file(model_name, output)  # a hub model's files are local once its module is loaded
            if path is None or not save_graph(graph, path):
                raise _not_cached(model_name)
    except MemfitError as exc:
        print(f"memfit: {exc}", file=sys.stderr)
        return 3
    return 0


def _fp32_module(model_name: str, output: GraphOutput) -> torch.nn.Module:
    from transformers import AutoModel

    from memfit.engine.models import load_model
    from memfit.engine.pooled_classifier import load_sequence_classifier

    cpu = torch.device("cpu")
    if output == "last_hidden_state":
        return load_model(model_name, AutoModel, cpu, "fp32")
    return load_sequence_classifier(model_name, cpu, "fp32")


class GraphResult:
    """What a head reads from a model output (``last_hidden_state`` or ``logits``), as torch tensors."""

    def __init__(self, name: GraphOutput, value: torch.Tensor):
        setattr(self, name, value)


class OpenVINOEngine:
    """Runs padded batches of windows through a :class:`CompiledGraph`; hands the output to the job's head."""

    def __init__(self, graph: CompiledGraph, output: GraphOutput, pad_token_id: int, head: Head):
        self.graph = graph
        self.output = output
        self.pad_token_id = pad_token_id
        self.head = head

    def forward(self, windows: Sequence[Window]) -> list:
        # exact width: the CPU gains nothing from rounding (batches.inference_pad_multiple)
        with_types = "token_type_ids" in self.graph.input_names
        inputs = pad_arrays(windows, self.pad_token_id, multiple=1, token_types=with_types)
        value = torch.from_numpy(self.graph.infer(inputs))
        return self.head(GraphResult(self.output, value), torch.from_numpy(inputs["attention_mask"]), windows)


def graph_network(graph: CompiledGraph, config: Any, output: GraphOutput) -> Network:
    """A compiled graph as the memory layer sees it. Its attention materialises batch x heads x length^2 scores
    (measured on MiniLM: 49 B per cell in fp32 at 512 tokens, docs/memory.md), so calibration fits that term."""
    openvino = import_openvino()

    vocab = int(getattr(config, "vocab_size", 1000) or 1000)
    generator = np.random.default_rng(0)

    def probe(batch: int, length: int) -> None:
        ids = generator.integers(min(5, vocab - 1), vocab, (batch, length), dtype=np.int64)
        mask = np.ones((batch, length), dtype=np.int64)
        mask[-1, max(1, length // 2) :] = 0
        graph.infer_fresh({"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)})

    dtype = torch.bfloat16 if graph.precision == "bf16" else torch.float32
    return Network(
        config=config,
        compute_dtype=dtype,
        # the float constants in the precision they compute in; an int8 copy's as stored (its kept layers in fp32)
        weights_bytes=(
            graph.stored_weights_bytes if graph.int8 else graph.fp32_weights_bytes * torch.finfo(dtype).bits // 32
        ),
        attention="openvino",
        attention_materialized=True,
        runtime=f"openvino {openvino.get_version()}"
        + (f" int8 scheme {INT8_SCHEME} nncf {nncf_version()}" if graph.int8 else ""),
        kind=f"graph:{output}",
        probe=probe,
    )


# -- the backend --------------------------------------------------------------------------------------------------


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

    def engine(self, head: Head) -> OpenVINOEngine:
        return OpenVINOEngine(self.graph, self.output, self.pad_token_id, head)

    def fp32_reference(self):
        graph, output, pad = self.graph, self.output, self.pad_token_id
        return lambda head: OpenVINOEngine(recompiled(graph, "fp32"), output, pad, head)

    def fp32_copy_bytes(self) -> int:
        # its fp32 constants counted twice: the compiled copy, and the cache file's pages it reads
        return 2 * self.graph.fp32_weights_bytes

    def guard_identity(self) -> str | None:
        if self.graph.directory is None:
            return None
        return f"{self.graph.directory.name}/{Path(self.graph.source_graph).name}"


def _unavailable(device: torch.device, dtype: str, quantize: str) -> str | None:
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
    parts. An embedding model's tokenizer and config are written beside a new graph (``graph_snapshot.py``), so a
    later run starts without transformers."""
    from memfit.engine.graph_snapshot import save_snapshot
    from memfit.engine.models import load_model_config, resolve_dtype

    output: GraphOutput = "last_hidden_state" if request.task == "embedding" else "logits"
    threads = torch.get_num_threads() * request.streams
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
    """For an embedding model whose compiled graph is cached: the tokenizer and config written beside it by an
    earlier run, so this one needs no transformers (``graph_snapshot.py``); else None."""
    from memfit.engine.graph_snapshot import load_snapshot
    from memfit.engine.models import load_model_config, load_tokenizer

    if task != "embedding":
        return None  # classifiers read their labels and heads through transformers' config classes
    path = graph_file(model_name, "last_hidden_state")
    if path is None or not path.is_file():
        return None
    return load_snapshot(path.parent, lambda: load_tokenizer(model_name), lambda: load_model_config(model_name))


OPENVINO = BackendKind("openvino", "OpenVINO", _unavailable, _load, _snapshot)


if __name__ == "__main__":
    sys.exit(_convert_main(sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"))  # type: ignore[arg-type]
