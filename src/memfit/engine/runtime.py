"""The loaded model, built once: :func:`load_runtime` returns a frozen :class:`Runtime` that every job uses.

A runtime holds what does not change while a model serves: the network on its device in its precision
(a PyTorch module, or an OpenVINO graph compiled for the CPU), the tokenizer and its special tokens, the
window size, the memory calibration and the memory plan made from it. Jobs (:class:`~memfit.Encoder`,
:class:`~memfit.Classifier`, ``memfit serve``, a Ray worker) are thin layers on top that add per-call
settings and the mutable parts of a run (the adaptive batch budget, the quality guard's verdict); they get
their engine from :meth:`Runtime.engine`, so none of them knows which backend runs.

Loading is explicit, in this order: resolve device, backend and precision → tokenizer and network (for
``openvino``: the cached graph, else the PyTorch weights converted once, ``openvino_backend.py``; an embedding
model's cached graph comes with the tokenizer and config an earlier run wrote beside it, so the run imports no
transformers, ``graph_snapshot.py``) → the
window → the budget in bytes → **calibrate** (:func:`calibrate_network`: cached, else probe forwards, the
only step that measures) → the pure planner (:func:`memfit.memory.model.plan_from_calibration`) → refuse a
budget that cannot hold even the first batch. Nothing here sets process-wide state; entry points call
:func:`memfit.engine.process.configure_process` first.

**Backends** (``backend=``): ``torch`` runs PyTorch eager; ``openvino`` the compiled CPU graph; ``auto`` picks
OpenVINO on the CPU when it is installed and the model converts (it measured 1.5-1.7x PyTorch in fp32 and
1.3-1.6x PyTorch's bf16 on short texts, docs/benchmarks.md), PyTorch on GPUs and for int8.

**Sharing.** A :class:`Runtime` is immutable, so one instance may serve several threads (a server's
batcher and its request handlers) or live inside one Ray actor. PyTorch runs under
``torch.inference_mode``, safe from several threads; the OpenVINO engine gives each thread its own
inference request. The fast tokenizer is thread-safe as long as no caller changes its truncation or
padding settings (memfit never does). What must not be shared between concurrent runs is the
:class:`~memfit.engine.batches.AdaptiveBudget`: each job (or the server's single batcher) makes its own
from ``runtime.memory.batch_budget``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from memfit.memory.calibration import ANALYTIC, MemoryCalibration, Network, calibrate, torch_network
from memfit.data.chunking import SpecialTokens
from memfit.data.tokenization import clear_tokenizer_caches
from memfit.memory.guard import resident_guard
from memfit.errors import ConfigError, DoesNotFitError, GraphCompileError, ModelLoadError
from memfit.memory.host_budget import HostBudget, fitted_to_plan, host_budget
from memfit.memory.peak import process_peak_rss_bytes, settle_file_pages, start_peak_window
from memfit.memory.model import (
    CPU_RESIDENT_DRIFT_BYTES,
    MemoryPlan,
    batch_room,
    check_plan_fits,
    device_memory,
    hold_allocator_to_budget,
    plan_from_calibration,
    plan_streamed,
    resident_needs_bytes,
    resolve_budget_bytes,
)
from memfit.memory.planner import padded_length
from memfit.defaults import BACKEND_CHOICES, OFFLOAD_CHOICES
from memfit.engine.batches import AdaptiveBudget, Engine, Head, TorchEngine
from memfit.engine.models import (
    DtypeName,
    SentenceTransformerDefaults,
    load_model_config,
    load_tokenizer,
    model_position_limit,
    read_sentence_transformer_defaults,
    resolve_device,
    resolve_dtype,
    resolve_max_length,
    resolve_model_name,
)
from memfit.engine.pooling import Pooling, check_pooling
from memfit.engine.streamed import StreamedBackend, checkpoint_sizes, load_streamed
from memfit.engine.graph_snapshot import SnapshotConfig, SnapshotTokenizer, load_snapshot, save_snapshot
from memfit.engine.openvino_backend import (
    OPENVINO_PRECISION,
    CompiledGraph,
    GraphOutput,
    OpenVINOEngine,
    graph_file,
    graph_network,
    load_graph,
    nncf_version,
    openvino_version,
    recompiled,
)
from memfit.engine.precision import (
    Quantize,
    fp32_copy_bytes,
    load_fp32_reference,
    load_precision_model,
    resolve_precision,
)

log = logging.getLogger("memfit")

BackendName = Literal["torch", "openvino", "streamed"]

Task = Literal["embedding", "classification"]
"""``embedding``: the base model (``AutoModel``), pooled by memfit. ``classification``: a sequence
classifier (NLI or trained) whose own head turns each window into logits."""


@dataclass(frozen=True)
class Runtime:
    """A model loaded for inference within a memory budget (see the module docstring). Immutable."""

    model_name: str
    task: Task
    backend: BackendName
    model: torch.nn.Module | None  # the PyTorch module (backend torch); None on a compiled backend
    graph: CompiledGraph | None  # the compiled graph (backend openvino)
    config: Any  # the model's transformers config
    tokenizer: Any  # a transformers fast tokenizer, or the snapshot of one that answers as it does (graph_snapshot.py)
    special: SpecialTokens
    pad_token_id: int
    uses_token_types: bool  # models without segment embeddings (RoBERTa, BART) take no token_type_ids
    device: torch.device
    dtype: DtypeName
    quantize: Quantize
    max_length: int  # window size in tokens, special tokens included
    default_pooling: Pooling | None  # embedding: the model's sentence-transformers pooling, else mean; None: classifier
    calibration: MemoryCalibration
    memory: MemoryPlan
    host: HostBudget
    streamed: StreamedBackend | None = None  # backend streamed (--offload): the layers stay in the file

    @property
    def dim(self) -> int:
        """Hidden size: the length of a pooled vector or token row."""
        return int(self.config.hidden_size)

    @property
    def output(self) -> GraphOutput:
        """What the network's forward gives the heads: token vectors (embedding) or logits (classification)."""
        return "last_hidden_state" if self.task == "embedding" else "logits"

    def engine(self, head: Head) -> Engine:
        """An engine that runs batches of windows on this runtime's network and reduces them with ``head``."""
        if self.streamed is not None:
            return self.streamed.engine(head)
        if self.graph is not None:
            return OpenVINOEngine(self.graph, self.output, self.pad_token_id, head)
        return TorchEngine(self.model, self.device, self.pad_token_id, head)

    def adaptive_budget(self) -> AdaptiveBudget:
        """A job's own batch budget on this runtime: the plan's, lowered after out-of-memory errors, and on the CPU
        held to the resident set by the closed-loop guard (which may clear the tokenizer's caches to make room)."""
        return AdaptiveBudget(
            self.memory.batch_budget,
            guard=resident_guard(
                self.memory, self.device.type, release=[functools.partial(clear_tokenizer_caches, self.tokenizer)]
            ),
        )

    def fp32_reference(self) -> Callable[[Head], Engine]:
        """For the quality guard: a function that loads this network again in fp32 (unquantized) and returns an
        engine on it; the copy is freed when that engine is."""
        if self.streamed is not None:
            return self.streamed.fp32_reference()
        if self.graph is not None:
            graph = self.graph
            return lambda head: OpenVINOEngine(recompiled(graph, "fp32"), self.output, self.pad_token_id, head)
        name, device, pad = self.model_name, self.device, self.pad_token_id
        return lambda head: TorchEngine(load_fp32_reference(name, device), device, pad, head)

    def fp32_copy_bytes(self) -> int:
        """What :meth:`fp32_reference`'s copy adds to the process while it runs (see
        :func:`~memfit.engine.precision.fp32_copy_bytes`; a compiled graph's fp32 constants, counted twice the
        same way: the compiled copy and the cache file's pages it reads)."""
        if self.streamed is not None:
            return self.streamed.fp32_copy_bytes()
        if self.graph is not None:
            return 2 * self.graph.fp32_weights_bytes
        return fp32_copy_bytes(self.model, self.device)

    def describe(self) -> str:
        int8 = " + int8" if self.quantize == "int8" else ""
        return (
            f"model {self.model_name} on {self.device} in {self.dtype}{int8} ({self.backend}), "
            f"window {self.max_length} tokens"
        )


def load_runtime(
    model: str | os.PathLike | None = None,
    device: str = "auto",
    dtype: str = "auto",
    quantize: str = "none",
    memory_budget: str | int | None = None,
    max_length: int | None = None,
    task: Task = "embedding",
    calibrate: bool = True,
    backend: str = "auto",
    streams: int = 1,
    refuse: bool = True,
    offload: str = "auto",
) -> Runtime:
    """Load ``model`` once and plan its memory: the :class:`Runtime` every job runs on.

    ``model``: ``None`` for the bundled all-MiniLM-L6-v2, a local directory or a hub id. ``device``:
    ``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``. ``dtype``: ``auto`` | ``fp32`` | ``bf16`` | ``fp16``.
    ``quantize``: ``none`` | ``int8`` (embedding only). ``memory_budget``: "4GiB", "500MB", "80%" (of the
    device's total memory) or bytes; default: what the process holds plus 90% of the free memory.
    ``max_length``: window size (default: the model's sentence-transformers ``max_seq_length`` for
    embeddings; the tokenizer's ``model_max_length`` for classifiers, as transformers' pipelines do).
    ``calibrate=False`` plans from the analytic memory model without probe forwards. ``backend``: ``auto`` |
    ``torch`` | ``openvino`` (module docstring). ``streams``: batches a host runs at once on a compiled
    backend (``memfit serve``'s model workers). ``offload``: ``auto`` | ``never`` | ``always``: stream the
    layers from the weights file (:func:`streamed_runtime`; ``auto`` only when the resident plan cannot fit an
    explicit budget).
    Raises :class:`~memfit.errors.DoesNotFitError` when the budget cannot hold the first batch (unless
    ``refuse=False``: ``memfit plan`` reports that instead).
    """
    if task not in ("embedding", "classification"):
        raise ConfigError(f"unknown task {task!r}; choose embedding or classification")
    start_peak_window()  # the budget checks below read this job's peak, not an earlier job's in this process
    name = resolve_model_name(model)
    torch_device = resolve_device(device)
    dtype_name, quantized = resolve_precision(dtype, quantize, torch_device)
    if task == "classification" and quantized != "none":
        raise ConfigError("--quantize int8 is available for embeddings only")
    chosen = resolve_backend(backend, torch_device, dtype_name, quantized)
    if chosen == "openvino" and quantized == "int8" and dtype == "auto":
        dtype_name = resolve_dtype("auto", torch_device)  # the graph's float parts in auto's pick (bf16 where fast)
    snapshot = cached_graph_snapshot(name, task) if chosen == "openvino" else None
    tokenizer = snapshot[0] if snapshot is not None else load_tokenizer(name)
    uses_token_types = "token_type_ids" in tokenizer.model_input_names
    streamed = streamed_runtime(
        offload,
        name,
        task,
        torch_device,
        dtype_name,
        quantized,
        backend,
        memory_budget,
        max_length,
        tokenizer,
        calibrate,
        refuse,
    )
    if streamed is not None:
        return streamed
    loaded = load_network(
        name,
        task,
        chosen,
        backend == "auto",
        torch_device,
        dtype_name,
        quantized,
        uses_token_types,
        streams,
        config=snapshot[1] if snapshot is not None else None,
        dtype_was_auto=dtype == "auto",
    )
    if loaded.graph is not None:
        dtype_name = loaded.graph.precision  # type: ignore[assignment]  # auto's bf16 may have become fp32
        if snapshot is None and task == "embedding" and loaded.graph.directory is not None:
            save_snapshot(loaded.graph.directory, tokenizer, loaded.network.config)
    elif quantized == "int8" and torch_device.type == "cpu":
        dtype_name = "fp32"  # PyTorch's dynamic int8 (a graph that did not convert): its float parts are fp32
    st_defaults, default_pooling, output_bytes_per_token = task_defaults(task, name, loaded.network)
    config = loaded.network.config
    window = resolve_max_length(max_length, config, tokenizer, st_defaults)
    plan, measured, host = plan_network_memory(
        loaded.network, torch_device, memory_budget, output_bytes_per_token, calibrate
    )
    if refuse:
        check_plan_fits(plan, torch_device)
    runtime = Runtime(
        model_name=name,
        task=task,
        backend=loaded.backend,
        model=loaded.model,
        graph=loaded.graph,
        config=config,
        tokenizer=tokenizer,
        special=SpecialTokens.from_tokenizer(tokenizer),
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        uses_token_types=uses_token_types,
        device=torch_device,
        dtype=dtype_name,
        quantize=quantized,
        max_length=window,
        default_pooling=default_pooling,
        calibration=measured,
        memory=plan,
        host=fitted_to_plan(host, plan),
    )
    log.info(runtime.describe())
    log.info(plan.describe())
    return runtime


def task_defaults(task: Task, name: str, network: Network) -> tuple[SentenceTransformerDefaults, Pooling | None, int]:
    """What the task takes from the model beside its weights: the sentence-transformers defaults (window,
    pooling), the default pooling, and the output bytes per token counted in flight."""
    if task == "embedding":
        st_defaults = read_sentence_transformer_defaults(name)
        # token rows are copied out as float32: count them as in-flight output per token
        return st_defaults, check_pooling(st_defaults.pooling or "mean"), 4 * int(network.config.hidden_size)
    # the pipeline truncates at tokenizer.model_max_length
    return SentenceTransformerDefaults(), None, 0


def plan_network_memory(
    network: Network,
    device: torch.device,
    memory_budget: str | int | None,
    output_bytes_per_token: int,
    calibrate: bool,
) -> tuple[MemoryPlan, MemoryCalibration, HostBudget]:
    """The memory plan of the loaded ``network`` under ``memory_budget``, its calibration, and the host's
    share of the budget (input and output in flight)."""
    budget_bytes = resolve_budget_bytes(memory_budget, device_memory(device))
    hold_allocator_to_budget(device, budget_bytes)  # before the probes: they are held to it too
    host = host_budget(budget_bytes, device)
    refault = 0
    if device.type == "cpu":
        # start from the working set of file pages, not from what the page cache happened to map (after an
        # install: 150 MiB more, docs/memory.md); the guard expects that much back after a release
        refault = settle_file_pages(functools.partial(network.probe, 1, 16))
    measured = calibrate_network(network, device, calibrate)
    plan = plan_from_calibration(
        network, device, budget_bytes, output_bytes_per_token, measured, reserved_bytes=host.reserved_bytes
    )
    return dataclasses.replace(plan, refault_bytes=refault), measured, host


def resolve_backend(backend: str, device: torch.device, dtype: DtypeName, quantize: Quantize) -> BackendName:
    """The backend that runs: an explicit ``torch`` / ``openvino`` (checked against device, precision and the
    installed packages), or ``auto``'s pick (module docstring)."""
    if backend not in BACKEND_CHOICES:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKEND_CHOICES)}")
    if backend == "torch":
        return "torch"
    problem = None
    if device.type != "cpu":
        problem = f"--backend openvino runs on the CPU; on {device} use --backend torch"
    elif quantize != "none" and nncf_version() is None:
        problem = "--quantize int8 on --backend openvino needs NNCF (pip install 'memfit[int8]')"
    elif dtype not in OPENVINO_PRECISION:
        problem = f"--backend openvino runs fp32 or bf16 on the CPU, not {dtype}"
    elif openvino_version() is None:
        problem = "--backend openvino needs the openvino package (pip install openvino)"
    if problem is None:
        return "openvino"
    if backend == "openvino":
        raise ConfigError(problem)
    return "torch"


@dataclass(frozen=True)
class LoadedNetwork:
    """What :func:`load_network` loaded: the backend that runs, its network, and the memory layer's view of it."""

    backend: BackendName
    model: torch.nn.Module | None
    graph: CompiledGraph | None
    network: Network


def load_network(
    name: str,
    task: Task,
    backend: BackendName,
    may_fall_back: bool,
    device: torch.device,
    dtype: DtypeName,
    quantize: Quantize,
    uses_token_types: bool,
    streams: int,
    config: Any = None,
    dtype_was_auto: bool = False,
) -> LoadedNetwork:
    """The model as ``backend`` runs it. With ``may_fall_back`` (``backend=auto``) a model that OpenVINO cannot
    convert runs on PyTorch instead, with a warning. ``config``: the model's config when already read (from a
    cached graph's snapshot), else it is loaded here. ``dtype_was_auto``: ``dtype`` is ``auto``'s pick, so a
    graph OpenVINO cannot compile in bf16 is compiled in fp32 (still faster than PyTorch's fp32) before PyTorch
    is tried."""
    if backend == "openvino":
        output: GraphOutput = "last_hidden_state" if task == "embedding" else "logits"
        threads = torch.get_num_threads() * streams
        try:
            try:
                graph = load_graph(name, output, uses_token_types, dtype, threads, streams, int8=quantize == "int8")
            except GraphCompileError as exc:
                if not (dtype_was_auto and dtype != "fp32"):
                    raise
                log.warning("%s; running it in fp32", str(exc).removesuffix("; use --backend torch"))
                graph = load_graph(name, output, uses_token_types, "fp32", threads, streams, int8=quantize == "int8")
        except ModelLoadError as exc:
            if not may_fall_back:
                raise
            log.warning("%s; running it on PyTorch", str(exc).removesuffix("; use --backend torch"))
        else:
            network = graph_network(graph, config if config is not None else load_model_config(name), output)
            return LoadedNetwork("openvino", None, graph, network)
    from transformers import AutoModel

    from memfit.engine.pooled_classifier import load_sequence_classifier

    if task == "embedding":
        model = load_precision_model(name, AutoModel, device, dtype, quantize)
    else:
        model = load_sequence_classifier(name, device, dtype)
    return LoadedNetwork("torch", model, None, torch_network(model, device))


def cached_graph_snapshot(name: str, task: Task) -> tuple[SnapshotTokenizer, SnapshotConfig] | None:
    """For an embedding model whose compiled graph is cached: the tokenizer and config written beside it by an
    earlier run, so this one needs no transformers (``graph_snapshot.py``); else None."""
    if task != "embedding":
        return None  # classifiers read their labels and heads through transformers' config classes
    path = graph_file(name, "last_hidden_state")
    if path is None or not path.is_file():
        return None
    return load_snapshot(path.parent, lambda: load_tokenizer(name), lambda: load_model_config(name))


# -- calibrate, then plan: the memory layer's planner, given this model's position limit -------------------------------


def calibrate_network(network: Network, device: torch.device, enabled: bool = True) -> MemoryCalibration:
    """:func:`~memfit.memory.calibration.calibrate` with the model's position limit (``ANALYTIC`` if disabled)."""
    return calibrate(network, device, model_position_limit(network.config)) if enabled else ANALYTIC


def build_memory_plan(
    model: torch.nn.Module,
    device: torch.device,
    memory_budget: str | int | None,
    output_bytes_per_token: float,
    calibrate: bool = True,
    reserved_bytes: int = 0,
) -> MemoryPlan:
    """Calibrate (:func:`calibrate_network`), then plan (:func:`plan_from_calibration`), without refusing."""
    budget = resolve_budget_bytes(memory_budget, device_memory(device))
    network = torch_network(model, device)
    measured = calibrate_network(network, device, calibrate)
    return plan_from_calibration(network, device, budget, output_bytes_per_token, measured, reserved_bytes)


def plan_memory(
    model: torch.nn.Module,
    device: torch.device,
    memory_budget: str | int | None,
    output_bytes_per_token: float,
    calibrate: bool = True,
    reserved_bytes: int = 0,
) -> MemoryPlan:
    """Turn the user's budget (default: 90% of free device memory) into a planner budget, or refuse.

    The budget covers the whole process on the device (peak RSS on the CPU, allocated memory on CUDA), so
    what is already held (weights, runtime) is subtracted before sizing batches.
    """
    plan = build_memory_plan(model, device, memory_budget, output_bytes_per_token, calibrate, reserved_bytes)
    return check_plan_fits(plan, device)


# -- offload: the whole model resident, or its layers streamed from the weights file (engine/streamed.py) ----------


def streamed_runtime(
    offload: str,
    name: str,
    task: Task,
    device: torch.device,
    dtype: DtypeName,
    quantize: Quantize,
    backend: str,
    memory_budget: str | int | None,
    max_length: int | None,
    tokenizer: Any,
    calibrate: bool,
    refuse: bool,
) -> Runtime | None:
    """The runtime whose layers stream from the weights file, when ``offload`` asks for it; None: run resident.

    ``always`` streams (or says why it cannot: ``ConfigError``); ``never`` does not; ``auto`` streams only when an
    explicit budget is below what the resident path needs, judged from the checkpoint's header before anything
    is loaded (loading the whole model first would already break the budget), and says so in one line with both
    plans' figures. A budget even the streamed plan cannot keep is refused (``DoesNotFitError``, exit 4) with the
    smallest budget that works."""
    if offload not in OFFLOAD_CHOICES:
        raise ConfigError(f"unknown offload {offload!r}; choose one of {', '.join(OFFLOAD_CHOICES)}")
    if offload == "never" or (offload == "auto" and memory_budget is None):
        return None  # the default budget is what the machine can spare: the resident path, as always
    sizes = checkpoint_sizes(name, dtype)
    problem = None
    if quantize != "none":
        problem = "--offload streams fp32 / bf16 / fp16 weights, not --quantize int8"
    elif backend == "openvino":
        problem = "--offload runs the streamed layers on PyTorch; use --backend auto or torch"
    elif sizes is None:
        problem = f"--offload streams weights from a local model.safetensors; {name} has none"
    if problem is not None:
        if offload == "always":
            raise ConfigError(problem)
        return None
    assert sizes is not None
    budget_bytes = resolve_budget_bytes(memory_budget, device_memory(device))
    host = host_budget(budget_bytes, device)
    held = device_memory(device).used_by_process_bytes
    resident_bytes = resident_needs_bytes(held, sizes.weights_bytes, host.reserved_bytes)
    if offload == "auto" and resident_bytes <= budget_bytes:
        return None
    config = load_model_config(name)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    streamed = load_streamed(name, task, config, device, dtype, pad)
    network = streamed.network
    st_defaults, default_pooling, output_bytes_per_token = task_defaults(task, name, network)
    window = resolve_max_length(max_length, config, tokenizer, st_defaults)
    hold_allocator_to_budget(device, budget_bytes)
    refault = settle_file_pages(functools.partial(network.probe, 1, 16)) if device.type == "cpu" else 0

    def planned(budget: int, measured: MemoryCalibration) -> MemoryPlan:
        return plan_streamed(
            network,
            device,
            budget,
            output_bytes_per_token,
            measured,
            streamed.held_bytes_per_token(output_bytes_per_token, window),
            2 * streamed.layer_bytes,
            host_budget(budget, device).reserved_bytes,
        )

    measured = calibrate_network(network, device, calibrate)
    # the next run's baseline differs from this one's by a few MiB: name a budget with the drift allowance above
    # the smallest one this run's plan would accept
    works = _smallest_streamed_budget(lambda budget: planned(budget, measured), window, device)
    works += CPU_RESIDENT_DRIFT_BYTES
    plan = dataclasses.replace(planned(budget_bytes, measured), refault_bytes=refault, smallest_budget_bytes=works)
    if refuse and not _streamed_plan_fits(plan, window, device):
        raise DoesNotFitError(
            f"the memory budget ({budget_bytes / 2**20:,.0f} MiB) cannot hold even the streamed plan: the process "
            f"holds {plan.baseline_bytes / 2**20:,.0f} MiB before the first block (runtime, the model's small parts "
            f"and two layers of weights: {plan.weights_bytes / 2**20:,.0f} MiB); raise --memory-budget to "
            f"{works / 2**20:,.0f} MiB, which works"
        )
    say = log.warning if offload == "auto" else log.info
    say(
        "--offload %s: memory budget %.0f MiB, the resident plan needs about %.0f MiB (weights %.0f MiB); the layers "
        "stream from the weights file: %.0f MiB held before the first block (weights %.0f MiB), blocks of up to %d "
        "tokens in sub-batches of up to %d",
        offload,
        budget_bytes / 2**20,
        resident_bytes / 2**20,
        sizes.weights_bytes / 2**20,
        plan.baseline_bytes / 2**20,
        plan.weights_bytes / 2**20,
        plan.batch_budget.max_batch_tokens,
        plan.layer_budget.max_batch_tokens if plan.layer_budget is not None else 0,
    )
    assert plan.layer_budget is not None
    runtime = Runtime(
        model_name=name,
        task=task,
        backend="streamed",
        model=None,
        graph=None,
        config=config,
        tokenizer=tokenizer,
        special=SpecialTokens.from_tokenizer(tokenizer),
        pad_token_id=pad,
        uses_token_types="token_type_ids" in tokenizer.model_input_names,
        device=device,
        dtype=dtype,
        quantize=quantize,
        max_length=window,
        default_pooling=default_pooling,
        calibration=measured,
        memory=plan,
        host=fitted_to_plan(host_budget(budget_bytes, device), plan),
        streamed=streamed.with_layer_budget(plan.layer_budget),
    )
    log.info(runtime.describe())
    log.info(plan.describe())
    return runtime


def _streamed_plan_fits(plan: MemoryPlan, window: int, device: torch.device) -> bool:
    """Whether one window of the full ``window`` fits beside the plan's baseline, and loading stayed within the
    budget (``check_plan_fits``'s two conditions, at the window's length rather than the shortest batch)."""
    room = batch_room(plan.budget_bytes, plan.baseline_bytes + plan.reserved_bytes, device)
    if room < plan.activations.predict(1, padded_length(window)):
        return False
    try:
        check_plan_fits(plan, device)
    except DoesNotFitError:
        return False
    return True


def _smallest_streamed_budget(plan_for: Callable[[int], MemoryPlan], window: int, device: torch.device) -> int:
    """The smallest budget (to the MiB) whose streamed plan holds one full window: a bisection over the pure
    planner, so the refusal names a budget that works."""
    low, high = 0, 2**40
    while high - low > 2**20:
        middle = (low + high) // 2
        plan = plan_for(middle)
        room = batch_room(middle, plan.baseline_bytes + plan.reserved_bytes, device)
        if room >= plan.activations.predict(1, padded_length(window)) and middle >= process_peak_rss_bytes():
            high = middle
        else:
            low = middle
    return high
