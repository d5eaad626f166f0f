"""Reduced precision that is measured before it is trusted: int8 quantization and the quality guard.

``models.resolve_dtype`` picks the compute dtype (bf16/fp16 where the hardware runs it fast); this
module adds what makes reduced precision safe to use by default:

- :func:`resolve_precision` combines the dtype request with ``quantize`` (``none`` | ``int8``).
- :func:`load_precision_model` loads the weights in that precision. int8 on the CPU is PyTorch dynamic
  quantization with *per-channel* weight scales, applied to every Linear layer except the feed-forward
  output projections and the pooler: the feed-forward intermediate activations carry the large
  outliers that per-tensor activation quantization destroys (measured on all-MiniLM-L6-v2: all layers
  per-tensor, min cosine vs fp32 0.87; all layers per-channel 0.95; without the FFN output layers 0.98,
  see docs/precision.md). int8 on CUDA is bitsandbytes' LLM.int8 when that optional package is installed.
- The **quality guard** (:func:`measure_quality`, :func:`enforce`): half precision is nearly always fine
  and int8 often is not, and both fail silently. So before a reduced-precision run, the pooled
  embeddings of a calibration sample of the user's own texts (the first 64, truncated to 256 tokens to
  keep it cheap) are computed with the reduced model and with a temporary fp32 copy of the same model,
  and the run is refused with :class:`~memfit.errors.QualityError` when their minimum cosine is below a
  threshold (0.999 for bf16/fp16, 0.99 for int8; overridable). The figure goes into the manifest.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import itertools
import json
import logging
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Literal

import numpy as np

from memfit.data.chunking import SpecialTokens, Window, make_windows, tokenize_texts
from memfit.defaults import QUANTIZE_CHOICES
from memfit.engine.batches import AdaptiveBudget, Engine, Head, run_windows
from memfit.errors import ConfigError, ModelLoadError, QualityError
from memfit.memory.calibration import cache_dir, read_cache_entry, write_cache_entry
from memfit.memory.model import CPU_RESIDENT_DRIFT_BYTES, MemoryPlan, least_budget
from memfit.memory.guard import resident_guard
from memfit.engine.models import load_model, resolve_dtype
from memfit.memory.planner import BatchBudget
from memfit.engine.pooling import EmbeddingHead, Pooling
from memfit.memory.device import Device, DtypeName, torch_dtype

if TYPE_CHECKING:
    import torch

log = logging.getLogger("memfit")

Quantize = Literal["none", "int8"]

DEFAULT_MIN_COSINE: dict[str, float] = {"bf16": 0.999, "fp16": 0.999, "int8": 0.99}
CALIBRATION_TEXTS = 64
# Long enough for attention over real sentences and paragraphs, short enough that the fp32 pass over
# 64 texts stays a small fraction of a second-scale start-up on a laptop CPU.
CALIBRATION_MAX_TOKENS = 256


def resolve_precision(dtype: str, quantize: str, device: Device) -> tuple[DtypeName, Quantize]:
    """The compute dtype and quantization actually used.

    int8 on the CPU runs its non-quantized parts in fp32 on PyTorch (its dynamic int8 kernels take fp32
    activations), so ``dtype=auto`` becomes fp32 here and an explicit bf16/fp16 is refused; on the compiled backend
    ``load_runtime`` then gives ``auto`` its usual pick (bf16 where the CPU is fast at it).
    """
    if quantize not in QUANTIZE_CHOICES:
        raise ConfigError(f"unknown quantize {quantize!r}; choose one of {', '.join(QUANTIZE_CHOICES)}")
    if quantize == "int8" and device.type == "cpu":
        if dtype not in ("auto", "fp32"):
            raise ConfigError(
                f"--quantize int8 on the CPU takes --dtype auto or fp32 (auto computes the rest of the compiled "
                f"graph in bf16 where the CPU is fast at it); drop --dtype {dtype} "
                f"(or use --dtype {dtype} without int8)"
            )
        return "fp32", "int8"
    return resolve_dtype(dtype, device), quantize  # type: ignore[return-value]


def precision_name(dtype: DtypeName, quantize: Quantize) -> str:
    """One word for what the guard compares against fp32: ``int8``, ``bf16``, ``fp16`` or ``fp32``."""
    return "int8" if quantize == "int8" else dtype


def default_min_cosine(dtype: DtypeName, quantize: Quantize) -> float | None:
    """The guard's default threshold; ``None`` for full fp32, which needs no guard."""
    return DEFAULT_MIN_COSINE.get(precision_name(dtype, quantize))


def load_precision_model(model: str, auto_class, device: Device, dtype: DtypeName, quantize: Quantize):
    """Load ``model`` in ``dtype``, then quantize it when asked (see module docstring for the scheme)."""
    if quantize == "none":
        return load_model(model, auto_class, device, dtype)
    if device.type == "cuda":
        return _load_bitsandbytes_int8(model, auto_class, device, dtype)
    if device.type != "cpu":
        raise ConfigError(f"--quantize int8 is available on cpu and cuda, not on {device.type}")
    return quantize_int8_cpu(load_model(model, auto_class, device, "fp32"))


def int8_layer_names(model: torch.nn.Module) -> list[str]:
    """Linear layers that int8 quantizes: all but feed-forward output projections and the pooler.

    BERT-family FFN output layers are named ``*.output.dense`` (attention's output projection is
    ``*.attention.output.dense``); their inputs hold the outlier activations that break int8.
    """
    import torch

    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        ffn_output = name.endswith("output.dense") and "attention" not in name
        if not ffn_output and "pooler" not in name:
            names.append(name)
    return names


def quantize_int8_cpu(model: torch.nn.Module) -> torch.nn.Module:
    """Dynamic int8 (per-channel weights, per-batch activation scales) on :func:`int8_layer_names`."""
    import torch
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    spec = {name: per_channel_dynamic_qconfig for name in int8_layer_names(model)}
    with warnings.catch_warnings():
        # torch.ao's eager quantization announces its move to torchao; it still works in torch 2.x
        warnings.simplefilter("ignore")
        return quantize_dynamic(model, spec, dtype=torch.qint8, inplace=True)


def _load_bitsandbytes_int8(model: str, auto_class, device: Device, dtype: DtypeName):
    try:
        import bitsandbytes  # noqa: F401 - only checks that the optional extra is installed
    except ImportError:
        raise ConfigError(
            "--quantize int8 on CUDA needs the optional package bitsandbytes "
            "(pip install bitsandbytes); or use --dtype bf16/fp16 without int8"
        ) from None
    from transformers import BitsAndBytesConfig

    try:
        loaded = auto_class.from_pretrained(
            model,
            dtype=torch_dtype(dtype),
            quantization_config=BitsAndBytesConfig(load_in_8bit=True),
            device_map={"": device.index or 0},
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model {model!r} in int8: {str(exc).strip().splitlines()[0]}") from exc
    return loaded.eval()  # already on the device: bitsandbytes models refuse .to()


@dataclass(frozen=True, slots=True)
class QualityReport:
    """What the guard measured: reduced precision vs fp32 on the calibration sample."""

    precision: str  # bf16 | fp16 | int8
    min_cosine: float
    mean_cosine: float
    threshold: float
    texts: int
    tokens: int
    seconds: float
    fell_back_to: str | None = None  # dtype=auto ran this instead when the reduced precision failed
    source: Literal["measured", "cache"] = "measured"  # cache: a pass measured by an earlier run (see below)

    @property
    def passed(self) -> bool:
        return self.min_cosine >= self.threshold

    def describe(self) -> str:
        measured = "" if self.source == "measured" else ", a pass reused from an earlier run on this machine"
        texts = "of your texts" if self.source == "measured" else "texts"
        return (
            f"{self.precision} vs fp32 on {self.texts} {texts} ({self.tokens} tokens): "
            f"min cosine {self.min_cosine:.5f}, mean {self.mean_cosine:.5f} "
            f"(threshold {self.threshold}, {self.seconds:.1f}s{measured})"
        )

    def as_manifest(self) -> dict:
        return asdict(self)


def calibration_windows(tokenizer, special: SpecialTokens, max_length: int, texts: Sequence[str]) -> list[Window]:
    """The guard's inputs: ``texts`` tokenized and truncated to one window of at most
    :data:`CALIBRATION_MAX_TOKENS` tokens each."""
    window_tokens = min(max_length, CALIBRATION_MAX_TOKENS)
    return [
        window
        for item, tokens in enumerate(tokenize_texts(tokenizer, list(texts), offsets=False))
        for window in make_windows(item, tokens, special, window_tokens, "truncate", stride=0)
    ]


def load_fp32_reference(model_name: str, device: Device) -> torch.nn.Module:
    """The guard's reference: the same weights in fp32, without quantization."""
    from transformers import AutoModel

    return load_model(model_name, AutoModel, device, "fp32")


def _smallest_budget_for_reference(memory: MemoryPlan, copy_bytes: int, longest: int, device: Device) -> int:
    """A budget under which the fp32 reference runs one ``longest``-token text beside its copy and the plan's
    baseline: the least one as :func:`measure_quality` judges it (a bisection over the same batch budget), plus the
    drift allowance a refusal's budget has (the next run's baseline differs by a few MiB)."""

    def fits(budget_bytes: int) -> bool:
        plan = dataclasses.replace(memory, budget_bytes=budget_bytes)
        budget = plan.budget_beside(copy_bytes, activation_scale=2.0, device=device, dtype="fp32")
        return budget.max_batch_tokens >= longest

    return least_budget(fits) + CPU_RESIDENT_DRIFT_BYTES


def measure_quality(
    reduced: Callable[[Head], Engine],
    load_reference: Callable[[Head], Engine],
    copy_bytes: int,
    windows: list[Window],
    pooling: Pooling,
    threshold: float,
    *,
    precision: str,
    device: Device,
    memory: MemoryPlan,
    batch_budget: BatchBudget,
    release_buffers: Callable[[], None],
) -> QualityReport | None:
    """Cosine between the reduced-precision network's pooled embeddings and an fp32 reference's on ``windows``.

    ``reduced(head)`` and ``load_reference(head)`` return engines (the reference loads an fp32 copy of the
    network, ``copy_bytes`` in the process, freed before returning). Both run through the normal engine and
    OOM guard: the reduced one within ``batch_budget``, the reference beside it, with the batches that the
    memory plan ``memory`` leaves after holding the copy, at twice the activation bytes per token. None
    (with a warning) when not even one window fits beside the copy: the guard then stays off rather
    than break the budget. ``release_buffers`` frees what the reduced network keeps between batches (the
    runtime's): before a cut, and before the copy loads.
    """
    started = time.perf_counter()
    reference_budget = memory.budget_beside(copy_bytes, activation_scale=2.0, device=device, dtype="fp32")
    longest = max(len(w) for w in windows)
    if reference_budget.max_batch_tokens < longest:
        log.warning(
            "quality guard skipped: an fp32 copy of the model (%.0f MiB) and one %d-token text do not fit "
            "the memory budget beside the %s model; --memory-budget %.0fMiB would have %s checked against fp32",
            copy_bytes / 2**20,
            longest,
            precision,
            math.ceil(_smallest_budget_for_reference(memory, copy_bytes, longest, device) / 2**20),
            precision,
        )
        return None
    head = EmbeddingHead(pooling, keep_tokens=False)

    def pooled(engine: Engine, budget: AdaptiveBudget) -> np.ndarray:
        return np.stack([out.pooled for out in run_windows(engine, windows, budget, device)])

    ours = pooled(
        reduced(head),
        AdaptiveBudget(batch_budget, guard=resident_guard(memory, device.type, release_kept=[release_buffers])),
    )
    release_buffers()  # what the reduced network keeps for its next batch is not held beside the copy
    reference = load_reference(head)
    try:
        full = pooled(
            reference, AdaptiveBudget(reference_budget, guard=resident_guard(memory, device.type, activation_scale=2.0))
        )
    finally:
        del reference
        gc.collect()
        if device.type == "cuda":
            import torch

            torch.cuda.empty_cache()
    cosines = cosine_rows(ours, full)
    return QualityReport(
        precision=precision,
        # unrounded: a reduced precision that changes the vectors by less than a rounding step still differs
        # (OpenVINO's bf16 on a tiny model: 0.9999998), and a threshold of 1.0 must see that
        min_cosine=float(cosines.min()),
        mean_cosine=float(cosines.mean()),
        threshold=threshold,
        texts=len(windows),
        tokens=sum(len(w) for w in windows),
        seconds=round(time.perf_counter() - started, 3),
    )


CACHED_PASS_MARGIN = 4
"""A cached pass stands in for a new measurement only when its min cosine was this many times closer to 1 than the
threshold (0.99975 for bf16's 0.999): the first 64 texts of one corpus then say enough about another's. Measured
on the bundled MiniLM compiled in bf16 (2-core AMD EPYC with AVX-512 BF16): 0.99996 on movie reviews; on
all-mpnet-base-v2 OpenVINO's bf16 kept 0.9966-0.99961 (../shared/MEASURED.md, docs/precision.md), which is
measured on every run."""

QUALITY_CACHE_FORMAT = 1


def _verdict_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps({"format": QUALITY_CACHE_FORMAT, **key}, sort_keys=True).encode()).hexdigest()
    return cache_dir() / "quality" / f"{digest[:24]}.json"


def cached_pass(key: dict, threshold: float) -> QualityReport | None:
    """The pass an earlier run measured for ``key`` (the compiled graph, precision, pooling and CPU) on a full
    sample (:data:`CALIBRATION_TEXTS`), if it clears ``threshold`` by :data:`CACHED_PASS_MARGIN`; else None (then
    the guard measures)."""
    report = read_cache_entry(_verdict_path(key), key, "report", QualityReport)
    if report is None or report.texts < CALIBRATION_TEXTS:
        return None
    if 1 - report.min_cosine > (1 - threshold) / CACHED_PASS_MARGIN:
        return None
    return dataclasses.replace(report, threshold=threshold, source="cache")


def remember_pass(key: dict, report: QualityReport) -> None:
    """Cache a measured pass for :func:`cached_pass`, when it was measured on a full sample: a short job's few texts,
    or ``memfit serve``'s two warm-up sentences, say too little of another corpus to stand for it (the margin is
    justified on 64 texts). A read-only cache directory only costs later runs the guard."""
    if report.texts < CALIBRATION_TEXTS:
        return
    write_cache_entry(_verdict_path(key), key, "report", asdict(report), "the quality guard's pass")


def fp32_copy_bytes(model: torch.nn.Module, device: Device) -> int:
    """What loading an fp32 copy of ``model`` adds to the process: its fp32 tensors, and on the CPU also
    the checkpoint's pages, which the loader memory-maps and reads (they count in the resident set until
    the copy is freed)."""
    import torch

    elements = sum(t.numel() for t in itertools.chain(model.parameters(), model.buffers()))
    # int8 dynamic-quantized Linear layers keep their weights outside parameters()
    elements += sum(m.weight().numel() for m in model.modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear))
    fp32 = 4 * elements
    return 2 * fp32 if device.type == "cpu" else fp32


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity in float64; two zero rows count as identical, a zero row against any other as 0
    (a vector a reduced precision zeroed must not pass the quality guard)."""
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    dot = (a * b).sum(axis=1)
    norm_a, norm_b = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    both_zero = (norm_a == 0) & (norm_b == 0)
    return np.where(both_zero, 1.0, dot / np.maximum(norm_a * norm_b, 1e-30))


def cosine_text(value: float, threshold: float) -> str:
    """``value`` with 5 decimals, or as many more as it takes to show that it is below ``threshold``: a cosine can
    be ``1 - 1e-10`` (seen on an AVX2-only CPU, where OpenVINO computed a bf16 request in fp32 and the guard compared
    fp32 with itself; memfit now runs that as fp32), which 9 decimals round up to the threshold of 1.0 it failed. 17
    significant digits tell any two distinct doubles apart."""
    for decimals in range(5, 18):
        text = f"{value:.{decimals}f}"
        if float(text) < threshold:
            return text
    return text


def enforce(report: QualityReport, can_accept: bool = True) -> None:
    """Log the measurement; refuse the run with :class:`QualityError` when it is below the threshold.

    ``can_accept``: whether the job takes a lower threshold (``memfit embed --min-cosine``); the message
    offers it only then."""
    log.info("quality guard: %s", report.describe())
    if not report.passed:
        accept = ""
        if can_accept:
            accept = (
                f", or accept it with --min-cosine {max(0.0, np.floor(report.min_cosine * 1000) / 1000):.3f}"
                " (min_cosine=... in Python)"
            )
        raise QualityError(
            f"{report.precision} changes the embeddings too much for this model and data: min cosine vs fp32 "
            f"{cosine_text(report.min_cosine, report.threshold)} < {report.threshold} on the first {report.texts} "
            f"texts; use --dtype fp32"
            f"{' without --quantize int8' if report.precision == 'int8' else ''}{accept}",
            report=report,
        )
