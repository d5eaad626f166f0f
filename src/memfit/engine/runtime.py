"""The loaded model, built once: :func:`load_runtime` returns a frozen :class:`Runtime` that every job uses.

A runtime holds what does not change while a model serves: the network on its device in its precision,
behind one :class:`~memfit.engine.backend.Backend` (a PyTorch module, an OpenVINO graph compiled for the CPU,
...), the tokenizer and its special tokens, the
window size, the memory calibration and the memory plan made from it. Jobs (:class:`~memfit.Encoder`,
:class:`~memfit.Classifier`, ``memfit serve``, a Ray worker) are thin layers on top that add per-call
settings and the mutable parts of a run (the adaptive batch budget, the quality guard's verdict); they get
their engine from :meth:`Runtime.engine`, so none of them knows which backend runs.

Loading is explicit, in this order: resolve device and precision → the backends that can run them
(``registry.py``) → tokenizer (or the snapshot of it a backend kept beside its cached files, so the run imports
no transformers) → the backend's network → the window → the budget in bytes → **calibrate**
(:func:`calibrate_network`: cached, else probe forwards, the only step that measures) → the pure planner
(:func:`memfit.memory.model.plan_from_calibration`) → refuse a budget that cannot hold even the first batch.
Nothing here sets process-wide state; entry points call :func:`memfit.engine.process.configure_process` first.

**Backends** (``backend=``): a name from :data:`memfit.engine.registry.BACKENDS`, or ``auto``: the first of them
that can run the request and loads (``registry.py`` says which and why).

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
from typing import TYPE_CHECKING, Any, Callable

from memfit.memory.calibration import ANALYTIC, MemoryCalibration, Network, calibrate
from memfit.engine.backend import Backend, LoadRequest, Task
from memfit.engine.backend_choice import BY_NAME, ordered_by_measurement
from memfit.engine.registry import BACKENDS, auto_dtype_for, candidate_backends, load_backend
from memfit.data.chunking import SpecialTokens
from memfit.data.prompts import PromptConfig
from memfit.data.tokenization import clear_tokenizer_caches
from memfit.memory.guard import resident_guard
from memfit.errors import ConfigError, DoesNotFitError, ModelLoadError
from memfit.memory.host_budget import HostBudget, fitted_to_plan, host_budget
from memfit.memory.peak import process_peak_rss_bytes, settle_file_pages, start_peak_window
from memfit.memory.model import (
    CPU_RESIDENT_DRIFT_BYTES,
    MemoryPlan,
    batch_room,
    check_plan_fits,
    device_memory,
    hold_allocator_to_budget,
    least_budget,
    plan_from_calibration,
    plan_streamed,
    resident_needs_bytes,
    resolve_budget_bytes,
)
from memfit.memory.planner import padded_length
from memfit.defaults import OFFLOAD_CHOICES
from memfit.engine.batches import AdaptiveBudget, Engine, Head
from memfit.engine.models import (
    SentenceTransformerDefaults,
    load_model_config,
    load_tokenizer,
    model_position_limit,
    read_sentence_transformer_defaults,
    resolve_max_length,
    resolve_model_name,
    warn_of_slow_precision,
)
from memfit.engine.pooling import Pooling, check_pooling
from memfit.engine.precision import Quantize, resolve_precision
from memfit.engine.checkpoint import CheckpointSizes, checkpoint_sizes
from memfit.engine.graph_cache import local_model_dir
from memfit.engine.streamed_floor import (
    StreamedFloor,
    floor_key,
    recall_floor,
    refusal_below_floor,
    remember_floor,
    streamed_refusal,
)
from memfit.engine.torch_backend import TORCH
from memfit.memory.device import Device, DtypeName, resolve_device

if TYPE_CHECKING:
    import torch

log = logging.getLogger("memfit")


@dataclass(frozen=True)
class Runtime:
    """A model loaded for inference within a memory budget (see the module docstring). Immutable."""

    model_name: str
    task: Task
    backend: Backend  # what runs the network (engine/backend.py)
    config: Any  # the model's transformers config
    tokenizer: Any  # a transformers fast tokenizer, or the snapshot of one that answers as it does (graph_snapshot.py)
    special: SpecialTokens
    pad_token_id: int
    uses_token_types: bool  # models without segment embeddings (RoBERTa, BART) take no token_type_ids
    device: Device
    dtype: DtypeName
    quantize: Quantize
    max_length: int  # window size in tokens, special tokens included
    default_pooling: Pooling | None  # embedding: the model's sentence-transformers pooling, else mean; None: classifier
    calibration: MemoryCalibration
    memory: MemoryPlan
    host: HostBudget
    prompts: PromptConfig = PromptConfig()  # embedding: the model's sentence-transformers prompts
    matryoshka: bool = False  # embedding: whether the model card says it was trained for shortened vectors
    backend_choice: str = BY_NAME  # why this backend runs (``memfit plan``, the manifest)
    # ``dtype`` is ``auto``'s pick, not the caller's, so a cached pass of the quality guard may stand (set by the
    # resident load; a streamed runtime's PyTorch layers have their guard measured on every run anyway)
    dtype_was_auto: bool = False

    @property
    def dim(self) -> int:
        """Hidden size: the length of a pooled vector or token row."""
        return int(self.config.hidden_size)

    @property
    def model(self) -> torch.nn.Module | None:
        """The PyTorch module when the backend runs one (to inspect its layers or attention kernel), else None."""
        return self.backend.module

    def engine(self, head: Head) -> Engine:
        """An engine that runs batches of windows on this runtime's network and reduces them with ``head``."""
        return self.backend.engine(head)

    def adaptive_budget(self) -> AdaptiveBudget:
        """A job's own batch budget on this runtime: the plan's, lowered after out-of-memory errors, and on the CPU
        held to the resident set by the closed-loop guard (which may free what :meth:`guard_releases` names)."""
        release, release_kept = self.guard_releases()
        return AdaptiveBudget(
            self.memory.batch_budget,
            guard=resident_guard(self.memory, self.device.type, release=release, release_kept=release_kept),
        )

    def fp32_reference(self) -> Callable[[Head], Engine]:
        """For the quality guard: a function that loads this network again in fp32 (unquantized) and returns an
        engine on it; the copy is freed when that engine is."""
        return self.backend.fp32_reference()

    def fp32_copy_bytes(self) -> int:
        """What :meth:`fp32_reference`'s copy adds to the process while it runs."""
        return self.backend.fp32_copy_bytes()

    def guard_releases(self) -> tuple[list[Callable[[], None]], list[Callable[[], None]]]:
        """What the closed-loop guard may free on this runtime: before a refusal (the tokenizer's caches), and before
        it cuts a batch (what the network keeps between batches)."""
        return [functools.partial(clear_tokenizer_caches, self.tokenizer)], [self.release_buffers]

    def release_buffers(self) -> None:
        """Free what the network keeps between batches to reuse (the backend's :meth:`~Backend.release_buffers`)."""
        self.backend.release_buffers()

    def describe(self) -> str:
        int8 = " + int8" if self.quantize == "int8" else ""
        return (
            f"model {self.model_name} on {self.device} in {self.dtype}{int8} ({self.backend.name}), "
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
    ``torch`` | ``openvino`` | ``onnxruntime`` (module docstring). ``streams``: batches a host runs at once on a
    compiled backend (``memfit serve``'s model workers). ``offload``: ``auto`` | ``never`` | ``always``: stream the
    layers from the weights file (:func:`streamed_runtime`; ``auto`` only when the resident plan cannot fit an
    explicit budget).
    Raises :class:`~memfit.errors.DoesNotFitError` when the budget cannot hold the first batch (unless
    ``refuse=False``: ``memfit plan`` reports that instead).
    """
    if task not in ("embedding", "classification"):
        raise ConfigError(f"unknown task {task!r}; choose embedding or classification")
    start_peak_window()  # the budget checks below read this job's peak, not an earlier job's in this process
    name = resolve_model_name(model)
    resolved_device = resolve_device(device)
    dtype_name, quantized = resolve_precision(dtype, quantize, resolved_device)
    if dtype == "auto":
        dtype_name = auto_dtype_for(backend, resolved_device, dtype_name, quantized)
    if task == "classification" and quantized != "none":
        raise ConfigError("--quantize int8 is available for embeddings only")
    candidates = candidate_backends(backend, resolved_device, dtype_name, quantized)
    held_at_start = device_memory(resolved_device).used_by_process_bytes
    offload_request = OffloadRequest(
        offload, name, task, resolved_device, dtype_name, quantized, backend, memory_budget, max_length, calibrate
    )
    if refuse:
        refuse_below_recorded_floor(offload_request, held_at_start)
    # any candidate's: under auto the backend that runs is ordered after this (backend_choice.py), and all hold the
    # same tokenizer and config
    snapshot = next((found for kind in candidates if (found := kind.snapshot(name, task)) is not None), None)
    tokenizer = snapshot[0] if snapshot is not None else load_tokenizer(name)
    uses_token_types = "token_type_ids" in tokenizer.model_input_names
    streamed = streamed_runtime(offload_request, tokenizer, refuse, held_at_start)
    if streamed is not None:
        warn_of_slow_precision(streamed.dtype, resolved_device)
        return streamed
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    request = LoadRequest(
        name,
        task,
        resolved_device,
        dtype_name,
        quantized,
        uses_token_types,
        pad_token_id,
        streams,
        config=snapshot[1] if snapshot is not None else None,
        tokenizer=tokenizer,
        dtype_was_auto=dtype == "auto",
    )
    choice = BY_NAME
    if backend == "auto":
        candidates, choice = ordered_by_measurement(candidates, name, task, dtype_name, quantized)
    loaded = load_backend(candidates, request)
    if loaded.name != candidates[0].name:
        choice = f"{choice}; {candidates[0].name} could not load this model"
    st_defaults, default_pooling, output_bytes_per_token = task_defaults(task, name, loaded.network)
    config = loaded.network.config
    window = resolve_max_length(max_length, config, tokenizer, st_defaults)
    plan, measured, host = plan_network_memory(
        loaded.network, resolved_device, memory_budget, output_bytes_per_token, calibrate
    )
    if refuse:

        def planned(budget: int) -> MemoryPlan:
            reserved = host_budget(budget, resolved_device).reserved_bytes
            return plan_from_calibration(
                loaded.network, resolved_device, budget, output_bytes_per_token, measured, reserved_bytes=reserved
            )

        # a refusal names the least budget that holds one full window, with the drift allowance the next run needs
        check_plan_fits(
            plan,
            resolved_device,
            works_bytes=lambda: _smallest_budget(planned, window, resolved_device) + CPU_RESIDENT_DRIFT_BYTES,
            other_ways=lambda: lighter_loads(offload_request, loaded.dtype),
        )
    warn_of_slow_precision(loaded.dtype, resolved_device)  # after any refusal: that one prints its line alone
    runtime = Runtime(
        model_name=name,
        task=task,
        backend=loaded,
        config=config,
        tokenizer=tokenizer,
        special=SpecialTokens.from_tokenizer(tokenizer),
        pad_token_id=pad_token_id,
        uses_token_types=uses_token_types,
        device=resolved_device,
        dtype=loaded.dtype,
        quantize=quantized,
        max_length=window,
        default_pooling=default_pooling,
        calibration=measured,
        memory=plan,
        host=fitted_to_plan(host, plan),
        prompts=st_defaults.prompts,
        matryoshka=st_defaults.matryoshka,
        backend_choice=choice,
        dtype_was_auto=dtype == "auto",
    )
    log.info(runtime.describe())
    log.info(plan.describe())
    return runtime


def model_config(name: str, backend: str = "auto") -> Any:
    """The model's config, to choose what to load (a classify mode, a reranker's relevant class): the one a backend
    cached beside one of the model's compiled graphs where there is one (read without transformers or torch,
    ``graph_snapshot.py``), else transformers'. Only ``backend``'s cache is looked in (every backend's under
    ``auto``): a run on another would import transformers anyway, and finding a graph's cache entry hashes the
    model's files once."""
    for kind in BACKENDS.values():
        if backend not in ("auto", kind.name):
            continue
        for task in ("embedding", "classification"):
            config = kind.snapshot_config(name, task)
            if config is not None:
                return config
    return load_model_config(name)


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
    device: Device,
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
    measured = calibrate_network(network, device, budget_bytes, calibrate)
    plan = plan_from_calibration(
        network, device, budget_bytes, output_bytes_per_token, measured, reserved_bytes=host.reserved_bytes
    )
    return dataclasses.replace(plan, refault_bytes=refault), measured, host


# -- calibrate, then plan: the memory layer's planner, given this model's position limit -------------------------------


def calibrate_network(network: Network, device: Device, budget_bytes: int, enabled: bool = True) -> MemoryCalibration:
    """:func:`~memfit.memory.calibration.calibrate` with the model's position limit, its probes held under
    ``budget_bytes`` (``ANALYTIC`` if disabled)."""
    if not enabled:
        return ANALYTIC
    return calibrate(network, device, model_position_limit(network.config), ceiling_bytes=budget_bytes)


# -- offload: the whole model resident, or its layers streamed from the weights file (engine/streamed.py) ----------


@dataclass(frozen=True, slots=True)
class OffloadRequest:
    """What decides whether a load streams its layers: ``offload`` (``auto`` | ``never`` | ``always``) and the
    load's model, task, device, precision, backend, budget and window as the caller asked for them, and whether it
    calibrates (else the analytic memory model plans)."""

    offload: str
    name: str
    task: Task
    device: Device
    dtype: DtypeName
    quantize: Quantize
    backend: str
    memory_budget: str | int | None
    max_length: int | None
    calibrate: bool

    def __post_init__(self) -> None:
        if self.offload not in OFFLOAD_CHOICES:
            raise ConfigError(f"unknown offload {self.offload!r}; choose one of {', '.join(OFFLOAD_CHOICES)}")

    def why_not_streamed(self, sizes: CheckpointSizes | None) -> str | None:
        """Why these settings cannot stream (``sizes``: the checkpoint's, None without a local safetensors file), or
        None when they can."""
        if self.quantize != "none":
            return "--offload streams fp32 / bf16 / fp16 weights, not --quantize int8"
        if self.backend not in ("auto", TORCH.name):
            # the streamed layers are PyTorch modules: a compiled graph holds every layer's weights
            return (
                f"--offload runs the streamed layers on PyTorch, not --backend {self.backend}; "
                "use --backend auto or torch"
            )
        if sizes is None:
            # a hub model not downloaded yet; one in the cache (or a folder) has sharded or .bin weights
            where = "" if local_model_dir(self.name) is not None else f" (a hub model's: hf download {self.name})"
            return f"--offload streams weights from a local model.safetensors{where}; {self.name} has none"
        return None


def streamed_runtime(
    request: OffloadRequest,
    tokenizer: Any,
    refuse: bool,
    held_at_start: int,
) -> Runtime | None:
    """The runtime whose layers stream from the weights file, when ``offload`` asks for it; None: run resident.

    ``always`` streams (or says why it cannot: ``ConfigError``); ``never`` does not; ``auto`` streams only when an
    explicit budget is below what the resident path needs, judged from the checkpoint's header before anything
    is loaded (loading the whole model first would already break the budget), and says so in one line with both
    plans' figures. A budget even the streamed plan cannot keep is refused (``DoesNotFitError``, exit 4) with the
    smallest budget that works. ``held_at_start``: what the process held before the tokenizer loaded; the smallest
    budget is recorded beside it (``streamed_floor.py``), so that a later load refuses a budget far below it at once."""
    offload, name, task, device, dtype = request.offload, request.name, request.task, request.device, request.dtype
    memory_budget, max_length = request.memory_budget, request.max_length
    if offload == "never" or (offload == "auto" and memory_budget is None):
        return None  # the default budget is what the machine can spare: the resident path, as always
    sizes = checkpoint_sizes(name, dtype)
    problem = request.why_not_streamed(sizes)
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
    from memfit.engine.streamed import load_streamed  # imports torch: only a run that streams needs it

    streamed = load_streamed(name, task, config, device, dtype, pad, keep_layers=True)
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
            streamed.held_layers_bytes,
            host_budget(budget, device).reserved_bytes,
        )

    measured = calibrate_network(network, device, budget_bytes, request.calibrate)
    # the next run's baseline differs from this one's by a few MiB: name a budget with the drift allowance above
    # the smallest one this run's plan would accept
    smallest = _smallest_budget(lambda budget: planned(budget, measured), window, device)
    works = smallest + CPU_RESIDENT_DRIFT_BYTES
    plan = dataclasses.replace(planned(budget_bytes, measured), refault_bytes=refault, smallest_budget_bytes=works)
    key = floor_key(name, task, dtype, max_length, device, request.calibrate)
    # a fit from the small probes alone is kept too: its smallest plan runs one window, no larger than the 512-token
    # probes it was fitted to, with the layers a probe holds as its fixed term, so it is the full fit's within a few
    # MiB (docs/memory.md, "The probes keep the budget")
    if key is not None:
        remember_floor(key, StreamedFloor(smallest, held_at_start, held, plan.baseline_bytes, plan.weights_bytes))
    if refuse and not _streamed_plan_fits(plan, window, device):
        raise DoesNotFitError(
            streamed_refusal(budget_bytes, plan.baseline_bytes, plan.weights_bytes, works, recorded=False)
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
        backend=streamed.with_layer_budget(plan.layer_budget),
        config=config,
        tokenizer=tokenizer,
        special=SpecialTokens.from_tokenizer(tokenizer),
        pad_token_id=pad,
        uses_token_types="token_type_ids" in tokenizer.model_input_names,
        device=device,
        dtype=dtype,
        quantize=request.quantize,
        max_length=window,
        default_pooling=default_pooling,
        calibration=measured,
        memory=plan,
        host=fitted_to_plan(host_budget(budget_bytes, device), plan),
        prompts=st_defaults.prompts,
        matryoshka=st_defaults.matryoshka,
        backend_choice="--offload auto: the resident plan does not fit the budget"
        if offload == "auto"
        else "--offload always",
    )
    log.info(runtime.describe())
    log.info(plan.describe())
    return runtime


def lighter_loads(request: OffloadRequest, dtype: DtypeName) -> list[str]:
    """The options a resident refusal names beside a budget that works: ``--dtype bf16`` where the weights loaded in
    fp32 and bf16 was not asked (half their bytes), and the ``--offload`` that streams a streamable model's layers
    where this load kept them resident: ``auto`` for ``never`` under an explicit budget (``auto`` streams only then),
    ``always`` otherwise (an H200's 160 MiB refusal of a bert-base-shaped model in bf16 suggested bf16 while the
    streamed path ran within it)."""
    # not where bf16 was asked and the backend computes it in fp32 (OpenVINO on a CPU without bf16 kernels)
    ways = ["--dtype bf16"] if dtype == "fp32" and request.dtype != "bf16" and request.quantize == "none" else []
    try:
        streamable = request.why_not_streamed(checkpoint_sizes(request.name, request.dtype)) is None
    except ModelLoadError:
        streamable = False  # an unreadable header: the refusal stands on its budget alone
    if streamable:
        ways.append(
            "--offload auto" if request.offload == "never" and request.memory_budget is not None else "--offload always"
        )
    return ways


def refuse_below_recorded_floor(request: OffloadRequest, held_bytes: int) -> None:
    """Before anything loads: refuse (``DoesNotFitError``) a budget far below the smallest one an earlier streamed
    load of this model and these settings needed (``streamed_floor.py``), when the resident plan cannot fit it
    either; otherwise return and let the full load decide. ``held_bytes``: what the process holds now."""
    if request.offload == "never" or request.memory_budget is None:
        return  # nothing would stream, or no budget to refuse
    key = floor_key(request.name, request.task, request.dtype, request.max_length, request.device, request.calibrate)
    floor = recall_floor(key) if key is not None else None
    if floor is None:
        return  # no load of these settings recorded one (the common case: nothing more is read)
    sizes = checkpoint_sizes(request.name, request.dtype)
    if request.why_not_streamed(sizes) is not None:
        return
    assert sizes is not None
    budget_bytes = resolve_budget_bytes(request.memory_budget, device_memory(request.device))
    reserved = host_budget(budget_bytes, request.device).reserved_bytes
    # what the full load will hold when it weighs the resident plan: the recording load's, moved by what this process
    # holds more or less at the start
    held_when_chosen = floor.held_when_chosen_bytes + held_bytes - floor.held_at_start_bytes
    if (
        request.offload == "auto"
        and resident_needs_bytes(held_when_chosen, sizes.weights_bytes, reserved) <= budget_bytes
    ):
        return  # the resident plan may fit: the full load decides
    refusal = refusal_below_floor(floor, budget_bytes, held_bytes)
    if refusal is not None:
        raise DoesNotFitError(refusal)


def _streamed_plan_fits(plan: MemoryPlan, window: int, device: Device) -> bool:
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


def _smallest_budget(plan_for: Callable[[int], MemoryPlan], window: int, device: Device) -> int:
    """The smallest budget (to the MiB) whose plan (resident, or streamed) holds one full window beside the baseline
    and the host reserve that budget keeps, and, on the CPU, which loading and calibrating did not pass: a bisection
    over the pure planner, so a refusal names a budget that works."""

    def fits(budget: int) -> bool:
        plan = plan_for(budget)
        room = batch_room(budget, plan.baseline_bytes + plan.reserved_bytes, device)
        loaded_within = device.type != "cpu" or budget >= process_peak_rss_bytes()
        return room >= plan.activations.predict(1, padded_length(window)) and loaded_within

    return least_budget(fits)
