"""The loaded model, built once: :func:`load_runtime` returns a frozen :class:`Runtime` that every job uses.

A runtime holds what does not change while a model serves: the weights on their device in their
precision, the tokenizer and its special tokens, the window size, the memory calibration and the memory
plan made from it. Jobs (:class:`~memfit.Encoder`, :class:`~memfit.Classifier`, ``memfit serve``, a Ray
worker) are thin layers on top that add per-call settings and the mutable parts of a run (the adaptive
batch budget, the quality guard's verdict).

Loading is explicit, in this order: resolve device and precision → tokenizer and weights → the window
→ the budget in bytes → **calibrate** (:func:`calibrate_model`: cached, else probe
forwards, the only step that measures) → the pure planner (:func:`memfit.memory.model.plan_from_calibration`)
→ refuse a budget that cannot hold even the first batch. Nothing here sets process-wide state;
entry points call :func:`memfit.engine.process.configure_process` first.

**Sharing.** A :class:`Runtime` is immutable, so one instance may serve several threads (a server's
batcher and its request handlers) or live inside one Ray actor. The model runs under
``torch.inference_mode`` in the engine, which is safe to call from several threads; the fast tokenizer
is too, as long as no caller changes its truncation or padding settings (memfit never does). What
must not be shared between concurrent runs is the :class:`~memfit.engine.batches.AdaptiveBudget`: each job
(or the server's single batcher) makes its own from ``runtime.memory.batch_budget``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

import torch

from memfit.memory.calibration import ANALYTIC, MemoryCalibration, calibrate
from memfit.data.chunking import SpecialTokens
from memfit.errors import ConfigError
from memfit.memory.host_budget import HostBudget, fitted_to_plan, host_budget
from memfit.memory.model import (
    MemoryPlan,
    check_plan_fits,
    device_memory,
    plan_from_calibration,
    resolve_budget_bytes,
)
from memfit.engine.models import (
    DtypeName,
    SentenceTransformerDefaults,
    load_tokenizer,
    model_position_limit,
    read_sentence_transformer_defaults,
    resolve_device,
    resolve_max_length,
    resolve_model_name,
)
from memfit.engine.pooling import Pooling, check_pooling
from memfit.engine.precision import Quantize, load_precision_model, resolve_precision

log = logging.getLogger("memfit")

Task = Literal["embedding", "classification"]
"""``embedding``: the base model (``AutoModel``), pooled by memfit. ``classification``: a sequence
classifier (NLI or trained) whose own head turns each window into logits."""


@dataclass(frozen=True)
class Runtime:
    """A model loaded for inference within a memory budget (see the module docstring). Immutable."""

    model_name: str
    task: Task
    model: torch.nn.Module
    tokenizer: Any  # a transformers fast tokenizer
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

    @property
    def dim(self) -> int:
        """Hidden size: the length of a pooled vector or token row."""
        return int(self.model.config.hidden_size)

    def describe(self) -> str:
        int8 = " + int8" if self.quantize == "int8" else ""
        return f"model {self.model_name} on {self.device} in {self.dtype}{int8}, window {self.max_length} tokens"


def load_runtime(
    model: str | os.PathLike | None = None,
    device: str = "auto",
    dtype: str = "auto",
    quantize: str = "none",
    memory_budget: str | int | None = None,
    max_length: int | None = None,
    task: Task = "embedding",
    calibrate: bool = True,
) -> Runtime:
    """Load ``model`` once and plan its memory: the :class:`Runtime` every job runs on.

    ``model``: ``None`` for the bundled all-MiniLM-L6-v2, a local directory or a hub id. ``device``:
    ``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``. ``dtype``: ``auto`` | ``fp32`` | ``bf16`` | ``fp16``.
    ``quantize``: ``none`` | ``int8`` (embedding only). ``memory_budget``: "4GiB", "500MB", "80%" (of the
    device's total memory) or bytes; default: what the process holds plus 90% of the free memory.
    ``max_length``: window size (default: the model's sentence-transformers ``max_seq_length`` for
    embeddings; the tokenizer's ``model_max_length`` for classifiers, as transformers' pipelines do).
    ``calibrate=False`` plans from the analytic memory model without probe forwards.
    Raises :class:`~memfit.errors.DoesNotFitError` when the budget cannot hold the first batch.
    """
    from transformers import AutoModel

    from memfit.engine.pooled_classifier import load_sequence_classifier

    name = resolve_model_name(model)
    torch_device = resolve_device(device)
    dtype_name, quantized = resolve_precision(dtype, quantize, torch_device)
    tokenizer = load_tokenizer(name)
    if task == "embedding":
        loaded = load_precision_model(name, AutoModel, torch_device, dtype_name, quantized)
        st_defaults = read_sentence_transformer_defaults(name)
        default_pooling: Pooling | None = check_pooling(st_defaults.pooling or "mean")
        # token rows are copied out as float32: count them as in-flight output per token
        output_bytes_per_token = 4 * int(loaded.config.hidden_size)
    elif task == "classification":
        if quantized != "none":
            raise ConfigError("--quantize int8 is available for embeddings only")
        loaded = load_sequence_classifier(name, torch_device, dtype_name)
        st_defaults = SentenceTransformerDefaults()  # the pipeline truncates at tokenizer.model_max_length
        default_pooling = None
        output_bytes_per_token = 0
    else:
        raise ConfigError(f"unknown task {task!r}; choose embedding or classification")
    window = resolve_max_length(max_length, loaded.config, tokenizer, st_defaults)
    budget_bytes = resolve_budget_bytes(memory_budget, device_memory(torch_device))
    host = host_budget(budget_bytes, torch_device)
    measured = calibrate_model(loaded, torch_device, calibrate)
    plan = plan_from_calibration(loaded, torch_device, budget_bytes, output_bytes_per_token, measured,
                                 reserved_bytes=host.reserved_bytes)
    check_plan_fits(plan, torch_device)
    runtime = Runtime(
        model_name=name, task=task, model=loaded, tokenizer=tokenizer,
        special=SpecialTokens.from_tokenizer(tokenizer),
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        uses_token_types="token_type_ids" in tokenizer.model_input_names,
        device=torch_device, dtype=dtype_name, quantize=quantized, max_length=window,
        default_pooling=default_pooling, calibration=measured, memory=plan, host=fitted_to_plan(host, plan),
    )
    log.info(runtime.describe())
    log.info(plan.describe())
    return runtime


# -- calibrate, then plan: the memory layer's planner, given this model's position limit -------------------------------


def calibrate_model(model: torch.nn.Module, device: torch.device, enabled: bool = True) -> MemoryCalibration:
    """:func:`~memfit.memory.calibration.calibrate` with the model's position limit (``ANALYTIC`` if disabled)."""
    return calibrate(model, device, model_position_limit(model.config)) if enabled else ANALYTIC


def build_memory_plan(model: torch.nn.Module, device: torch.device, memory_budget: str | int | None,
                      output_bytes_per_token: float, calibrate: bool = True, reserved_bytes: int = 0) -> MemoryPlan:
    """Calibrate (:func:`calibrate_model`), then plan (:func:`plan_from_calibration`), without refusing."""
    budget = resolve_budget_bytes(memory_budget, device_memory(device))
    measured = calibrate_model(model, device, calibrate)
    return plan_from_calibration(model, device, budget, output_bytes_per_token, measured, reserved_bytes)


def plan_memory(model: torch.nn.Module, device: torch.device, memory_budget: str | int | None,
                output_bytes_per_token: float, calibrate: bool = True, reserved_bytes: int = 0) -> MemoryPlan:
    """Turn the user's budget (default: 90% of free device memory) into a planner budget, or refuse.

    The budget covers the whole process on the device (peak RSS on the CPU, allocated memory on CUDA), so
    what is already held (weights, runtime) is subtracted before sizing batches.
    """
    plan = build_memory_plan(model, device, memory_budget, output_bytes_per_token, calibrate, reserved_bytes)
    return check_plan_fits(plan, device)
