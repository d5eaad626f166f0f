"""Memory calibration: measure what one forward pass of a model costs on a device, once, and cache it.

A few short probe forwards (the same number of tokens at different lengths, so the token and the
length^2 terms separate, and the same lengths at a larger number of tokens, so what a forward costs
whatever its size separates from what grows with it) record the peak growth of device memory:
``max_memory_allocated`` on CUDA, the resident-set high-water mark on the CPU (``VmHWM``, reset through
``/proc/self/clear_refs`` before each probe, with freed heap handed back to the kernel first so a probe is
not hidden in memory a previous one left resident). The probes are held to the memory budget: a large one that
would pass it is left out (:func:`measure_calibration`). A complete fit is cached per (model shape, device, dtype,
attention implementation, torch version) in the user cache directory (``$MEMFIT_CACHE_DIR``, else
``$XDG_CACHE_HOME/memfit``, else ``~/.cache/memfit``), so later runs start at once.

:func:`calibrate` is the one explicit step that runs the probes (or reads the cache); its result, a
:class:`MemoryCalibration`, is what the pure planner in ``model.py`` consumes. Nothing here runs on
import or from a constructor: ``runtime.load_runtime`` calls it once per loaded model.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, TypeVar

import numpy as np

from memfit.atomic import write_bytes_atomically
from memfit.memory.peak import PeakMeter
from memfit.memory.device import DTYPE_BYTES, Device, DtypeName, torch_dtype

if TYPE_CHECKING:
    import torch

log = logging.getLogger("memfit")

# Probe shapes (batch, padded length): the same number of tokens at three lengths, so bytes per
# token and bytes per attention cell (batch x length^2) separate; then the two longer lengths again at
# LARGE_PROBE_TOKENS, the CPU's fp32 batch cap, so a per-forward cost (scratch space, the mask's
# expansion: ~6 MiB on all-MiniLM-L6-v2) separates from the per-token one. Fitted from 512-token probes
# alone, that fixed cost was spread over the tokens: 26-35 KiB per token predicted against 17-20 KiB
# measured at 2,048 tokens (2-core AMD EPYC, MiniLM fp32, configured process), up to 1.55x over.
# Lengths are capped at the model's position limit. A complete calibration runs once per model shape and is cached.
PROBE_TOKENS = 512
LARGE_PROBE_TOKENS = 2048
PROBE_LENGTHS = (64, 256, 512)
LONG_PROBE_LENGTH = 2048
"""A model whose position limit passes the longest of :data:`PROBE_LENGTHS` gets one more probe, one sequence of up
to this many tokens (:func:`large_probe_shapes`), and every fit of it has a batch x length^2 term: what a window
holds in proportion to its length squared, negligible at 512 tokens, is most of it at 8,192. PyTorch's SDPA, which
holds no scores, is handed a batch x 1 x length x length mask wherever a batch has padding (XLM-R, 2-core AMD EPYC,
one sequence half padding: 5.6 B a cell at 2,048 tokens, 5.1 at 8,192), and ModernBERT's sliding-window layers hold
their scores (16 B a cell in fp32 with 4 heads, from 1,024 to 8,192 tokens). Fitted from 512-token probes, a
ModernBERT with an 8,192-token window was planned at 30 MiB a window; its first took the process 330 MiB past a
1 GiB budget. 2,048 tokens show the term as clearly as 8,192 (the cost a cell was the same) at a sixteenth of the
attention's time."""

MEASURED_RUNS = 2
"""Measured forwards per probe shape. One forward's growth varied by up to ~10 MiB from run to run on the same
shape while glibc served a small batch's tensors from its heap (MiniLM fp32, 2-core AMD EPYC: 14.7-24.2 MiB for
2 x 256; with the 256 KiB mmap threshold ``configure_process`` sets, 8.39-8.44 MiB): the fit follows the lower of
each shape's runs (below) and the worst of all of them only raises the fixed term."""

FIRST_RUN_BYTES = 16 * 2**20
"""Room kept above a large probe's predicted growth before it runs: its shape's first, unmeasured run also faults in
the library pages and kernels that shape touches (8-15 MiB a shape on MiniLM fp32, below)."""

CACHE_FORMAT = 6
"""4 → 5: OpenVINO probes release the compiled model's buffers (``CompiledGraph.infer_fresh``), so its fits now
measure each shape's activations; format 4's OpenVINO fits had them in the baseline instead. 5 → 6: a model whose
position limit passes 512 tokens is probed at up to :data:`LONG_PROBE_LENGTH` and fitted a length^2 term."""
Source = Literal["probes", "small probes", "cache", "analytic"]
"""Where the activation coefficients came from. "small probes": the :data:`LARGE_PROBE_TOKENS` probes were left out
because they would have passed the budget (:func:`measure_calibration`); such a fit is not cached."""


def attention_implementation(model: torch.nn.Module) -> str:
    """The attention kernel transformers chose for ``model`` ("eager", "sdpa", "flash_attention_2"...)."""
    return str(getattr(model.config, "_attn_implementation", None) or "eager")


def attention_materialized(model: torch.nn.Module) -> bool:
    """Whether attention holds batch x heads x length^2 scores: only eager does (see model.py)."""
    return attention_implementation(model) == "eager"


@dataclass(frozen=True)
class Network:
    """What calibration and the planner need to know of a loaded model, whatever runs it (PyTorch, a compiled
    graph): its config, compute dtype and weight bytes, its attention kernel, and one probe forward."""

    config: Any  # the transformers config
    compute_dtype: DtypeName
    weights_bytes: int
    attention: str  # "eager", "sdpa", ... or the compiled runtime's name
    attention_materialized: bool  # whether calibration fits a batch x length^2 term
    runtime: str  # what runs it, with its version: part of the calibration's cache key
    kind: str  # the model class, or what the graph computes
    probe: Callable[[int, int], None]  # one forward of random ids of shape (batch, padded length)
    probe_held_bytes: int = 0  # what a probe holds whatever its size, known before it runs (a streamed layer)


def torch_runtime(kernels: str | None = None) -> str:
    """The memory model's name for a PyTorch runtime: its version, and ``kernels`` where its products run other than
    PyTorch's default (``engine/cpu_linears.py``), which a calibration must not be shared across."""
    import torch

    return f"torch {torch.__version__}" + (f", {kernels}" if kernels else "")


def torch_network(model: torch.nn.Module, device: Device, kernels: str | None = None) -> Network:
    """A PyTorch module as the memory layer sees it (``kernels``: :func:`torch_runtime`)."""
    import torch

    parameter_dtype = next(model.parameters()).dtype
    tensors = itertools.chain(model.parameters(), model.buffers())

    def probe(batch: int, length: int) -> None:
        with torch.inference_mode():
            model(**_probe_inputs(model, device, batch, length))

    return Network(
        config=model.config,
        compute_dtype=next(name for name in DTYPE_BYTES if torch_dtype(name) == parameter_dtype),
        weights_bytes=sum(t.numel() * t.element_size() for t in tensors),
        attention=attention_implementation(model),
        attention_materialized=attention_materialized(model),
        runtime=torch_runtime(kernels),
        kind=type(model).__name__,
        probe=probe,
    )


@dataclass(frozen=True, slots=True)
class Calibration:
    """Measured forward-pass memory of one (model shape, device, dtype, attention): what the cache holds."""

    bytes_per_token: float
    bytes_per_attention_cell: float
    warmup_bytes: int  # what the first forward leaves held for good (kernel caches, thread pools)
    fixed_bytes: float = 0.0  # what a forward needs whatever its size (scratch space, the mask's expansion)


Entry = TypeVar("Entry")


def cache_dir() -> Path:
    """Where calibrations are cached: ``$MEMFIT_CACHE_DIR``, ``$XDG_CACHE_HOME/memfit`` or ``~/.cache/memfit``."""
    if os.environ.get("MEMFIT_CACHE_DIR"):
        return Path(os.environ["MEMFIT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "memfit"


def read_cache_entry(path: Path, key: dict, field: str, kind: Callable[..., Entry]) -> Entry | None:
    """``kind`` built from the object stored under ``field`` in the cache file ``path`` for ``key``, or None: no
    file, an unreadable one, one written for another key (a digest collision, an older format) or with fields
    ``kind`` does not take. Every cache of memfit's that is keyed by what it depends on (calibrations, the quality
    guard's passes, streamed floors) stores ``{"key": ..., field: ...}`` this way."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("key") != key or not isinstance(stored.get(field), dict):
        return None
    try:
        return kind(**stored[field])
    except TypeError:
        return None


def write_cache_entry(path: Path, key: dict, field: str, value: dict, what: str) -> None:
    """Store ``value`` under ``field`` for ``key`` in ``path``, atomically; a read-only cache directory only costs
    later runs what the entry (``what``, for the log line) would have saved them."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomically(path, json.dumps({"key": key, field: value}, indent=1).encode(), private=True)
    except OSError as exc:
        log.info("could not cache %s in %s: %s", what, path.parent, exc)


def calibration_key(network: Network, device: Device) -> dict:
    """What the forward's memory depends on: the architecture's shape (not the weights' values), the
    device, the dtype, the attention kernel and what runs it (torch or a compiled runtime, with versions)."""
    config = network.config
    shape = {
        name: getattr(config, name, None)
        for name in (
            "model_type",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        )
    }
    device_name = "cpu"
    if device.type == "cuda":
        import torch

        device_name = torch.cuda.get_device_name(device)
    return {
        "format": CACHE_FORMAT,
        "class": network.kind,
        **shape,
        "device": device_name,
        "dtype": network.compute_dtype,
        "attention": network.attention,
        "runtime": network.runtime,
    }


def _cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / f"calibration-{digest}.json"


def load_calibration(key: dict) -> Calibration | None:
    """The cached calibration for ``key``, or None (missing, unreadable or for another key)."""
    return read_cache_entry(_cache_path(key), key, "calibration", Calibration)


def save_calibration(key: dict, calibration: Calibration) -> None:
    """Write atomically; a read-only cache directory only costs the next run its probes."""
    write_cache_entry(_cache_path(key), key, "calibration", asdict(calibration), "the memory calibration")


def probe_shapes(length_limit: int) -> list[tuple[int, int]]:
    """(batch, padded length) of the probes: :data:`PROBE_TOKENS` tokens at each of :data:`PROBE_LENGTHS`, then
    :data:`LARGE_PROBE_TOKENS` at the two longest of them (:func:`large_probe_shapes`)."""
    return _small_probe_shapes(length_limit) + large_probe_shapes(length_limit)


def _small_probe_shapes(length_limit: int) -> list[tuple[int, int]]:
    lengths = sorted({min(length, length_limit) for length in PROBE_LENGTHS})
    return [(max(1, PROBE_TOKENS // length), length) for length in lengths]


def has_long_window(length_limit: int) -> bool:
    """Whether a position limit passes the small probes' lengths (:data:`LONG_PROBE_LENGTH` says what follows)."""
    return length_limit > PROBE_LENGTHS[-1]


def large_probe_shapes(length_limit: int) -> list[tuple[int, int]]:
    """The :data:`LARGE_PROBE_TOKENS` probes, and the long one where the position limit passes the small probes'
    lengths (:data:`LONG_PROBE_LENGTH`): the ones a tight budget may leave out (:func:`measure_calibration`)."""
    small = _small_probe_shapes(length_limit)
    large = [(max(1, LARGE_PROBE_TOKENS // length), length) for _, length in small[-2:]]
    if has_long_window(length_limit):
        large.append((1, min(length_limit, LONG_PROBE_LENGTH)))
    return [shape for shape in large if shape not in small]


def _probe_inputs(model: torch.nn.Module, device: Device, batch: int, length: int) -> dict[str, torch.Tensor]:
    """Random token ids with the last row half padding, so the masked attention path is the one measured."""
    import torch

    vocab = int(getattr(model.config, "vocab_size", 1000))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(min(5, vocab - 1), vocab, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[-1, max(1, length // 2) :] = 0
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def measure_calibration(
    network: Network, device: Device, length_limit: int, ceiling_bytes: int | None = None
) -> tuple[Calibration, bool] | None:
    """Run the probe forwards and fit bytes per token and per attention cell; None where the device's
    peak cannot be measured (no resettable VmHWM). Also says whether every probe ran.

    ``ceiling_bytes`` (the memory budget, for the whole process on the CPU, allocated memory on CUDA) holds the
    probes to the budget as the run is: a :data:`LARGE_PROBE_TOKENS` probe runs only where what the device holds
    now, plus its predicted growth and :data:`FIRST_RUN_BYTES`, stays under it. The prediction is what the probe
    holds whatever its size (``probe_held_bytes``) plus the rest of the same length's small probe, scaled by the
    tokens. Without the large probes the fit has one size of probe: its fixed term is ``probe_held_bytes`` and the
    rest grows with the tokens (:func:`fit_activation_coefficients` without a fixed column), so a large batch is
    predicted with the small probes' own fixed costs spread over its tokens. On all-mpnet-base-v2 streamed at a
    tight budget the largest probe alone passed the budget on a cold cache (docs/memory.md)."""
    meter = PeakMeter(device)
    if not meter.available:
        return None
    shapes = probe_shapes(length_limit)
    before = meter.start()
    # one-time set-up (thread pools, kernel caches, scratch space) happens in the first forward of a
    # size: the first one's residue is the warm-up; then each shape runs once unmeasured before its
    # measured forward, so a probe sees its activations, not the library pages and kernels its shape
    # first touches (settled at load, they fault back in here: +8-15 MiB of "fixed" cost per shape on
    # MiniLM fp32). Those stay resident, where the guard sees them before the next batch.
    network.probe(*shapes[0])
    meter.trim()
    warmup = max(0, meter.current() - before)
    measured_shapes, growth = [], []
    left_out: list[tuple[tuple[int, int], float]] = []  # a large probe the budget left out, and its predicted growth
    complete = True
    held = network.probe_held_bytes
    large = set(large_probe_shapes(length_limit))
    for batch, length in shapes:
        if ceiling_bytes is not None and (batch, length) in large:
            predicted = held + _predicted_beyond_held(measured_shapes, growth, held, batch, length)
            meter.trim()
            if meter.current() + predicted + FIRST_RUN_BYTES > ceiling_bytes:
                complete = False
                if math.isfinite(predicted):
                    left_out.append(((batch, length), predicted - held))
                continue
        network.probe(batch, length)
        for _ in range(MEASURED_RUNS):
            meter.trim()
            start = meter.start()
            network.probe(batch, length)
            measured_shapes.append((batch, length))
            growth.append(max(0, meter.peak() - start))
    meter.trim()
    # a long window's length^2 term is fitted whatever the attention kernel (LONG_PROBE_LENGTH says why)
    with_attention = network.attention_materialized or has_long_window(length_limit)
    if complete:
        per_token, per_cell, fixed = fit_activation_coefficients(measured_shapes, growth, with_attention)
    else:
        # a probe left out is fitted at its predicted growth, an upper bound: the fit must not promise it less
        beyond_held = [max(0, g - held) for g in growth] + [bound for _, bound in left_out]
        per_token, per_cell, fixed = fit_activation_coefficients(
            measured_shapes + [shape for shape, _ in left_out], beyond_held, with_attention, fit_fixed=False
        )
        fixed += held
    calibration = Calibration(
        bytes_per_token=per_token, bytes_per_attention_cell=per_cell, warmup_bytes=warmup, fixed_bytes=fixed
    )
    return calibration, complete


def _predicted_beyond_held(
    shapes: list[tuple[int, int]], growth: list[int], held: int, batch: int, length: int
) -> float:
    """A large probe's growth beyond ``held`` before it runs: the most a token of the same length grew, scaled by its
    tokens; for a length no probe has run (the long probe), the most a sequence of the longest one grew, scaled by
    the length squared, which bounds anything that grows with the length or its square."""
    same = [max(0, g - held) / (b * n) for (b, n), g in zip(shapes, growth) if n == length]
    if same:
        return max(same) * batch * length
    longest = max((n for _, n in shapes), default=0)
    if longest == 0:
        return math.inf
    per_sequence = max(max(0, g - held) / b for (b, n), g in zip(shapes, growth) if n == longest)
    return per_sequence * batch * (length / longest) ** 2


def fit_activation_coefficients(
    shapes: list[tuple[int, int]], growth_bytes: list[int], with_attention: bool, fit_fixed: bool = True
) -> tuple[float, float, float]:
    """Fit ``growth = f + a x tokens + c x batch x length^2`` (c only ``with_attention``; f, a, c >= 0) by
    least squares, then raise f so that no probe is under-predicted (the budget must hold for the worst shape,
    not the average). Returns (a, c, f). A shape measured more than once is fitted by its lowest growth (one
    run's noise only adds: pages and scratch another run did not need), and its highest only raises f, so a
    noisy run cannot tilt the slope.

    Without a materialised attention the probes differ only by noise in the length^2 direction, so fitting c
    there would turn noise into a spurious attention budget. Where the probes cannot separate f from a (all of
    one size, or ``fit_fixed`` is off: a budget left the large probes out, and sizes a few tokens apart would fit
    f badly), f stays 0 and a is scaled up instead."""
    lowest: dict[tuple[int, int], float] = {}
    for shape, grown in zip(shapes, growth_bytes):
        lowest[shape] = min(lowest.get(shape, math.inf), grown)
    distinct = list(lowest)
    tokens = np.array([b * n for b, n in distinct], dtype=np.float64)
    cells = np.array([b * n * n for b, n in distinct], dtype=np.float64)
    growth = np.array([lowest[shape] for shape in distinct], dtype=np.float64)
    columns = {"a": tokens}
    if with_attention and len(set(n for _, n in shapes)) >= 2:
        columns["c"] = cells
    if fit_fixed and len(set(tokens)) >= 2:
        columns["f"] = np.ones_like(tokens)
    coefficients = _nonnegative_least_squares(columns, growth)
    per_token, per_cell, fixed = coefficients.get("a", 0.0), coefficients.get("c", 0.0), coefficients.get("f", 0.0)
    tokens = np.array([b * n for b, n in shapes], dtype=np.float64)
    cells = np.array([b * n * n for b, n in shapes], dtype=np.float64)
    growth = np.array(growth_bytes, dtype=np.float64)
    if per_token <= 0 and per_cell <= 0:  # nothing grew with the size: the worst run's cost per token, of all runs
        per_token, per_cell, fixed = float(np.max(growth / tokens)), 0.0, 0.0
    predicted = fixed + tokens * per_token + cells * per_cell
    if "f" in columns:
        fixed += max(0.0, float(np.max(growth - predicted)))
    elif per_token > 0:  # (no run grew at all: nothing to scale, and 0 / 0 is no ratio)
        scale = float(np.max(growth / predicted))
        if scale > 1:
            per_token, per_cell = per_token * scale, per_cell * scale
    elif per_cell > 0:  # the length^2 term alone (a long probe's bound outweighed the rest): what it leaves out of a
        # probe is carried by the tokens, which a short batch has many of, rather than by a term that grows with the
        # length squared
        per_token = max(0.0, float(np.max((growth - predicted) / tokens)))
    return per_token, per_cell, fixed


def _nonnegative_least_squares(columns: dict[str, np.ndarray], target: np.ndarray) -> dict[str, float]:
    """Least squares with every coefficient >= 0: drop the most negative term and refit (a handful of terms, so
    this active-set loop is exact)."""
    names = list(columns)
    while names:
        matrix = np.stack([columns[name] for name in names], axis=1)
        solution, *_ = np.linalg.lstsq(matrix, target, rcond=None)
        if np.all(solution >= 0):
            return {name: float(value) for name, value in zip(names, solution)}
        del names[int(np.argmin(solution))]
    return {}


@dataclass(frozen=True, slots=True)
class MemoryCalibration:
    """What :func:`calibrate` found for one model on one device: the planner's measured input."""

    calibration: Calibration | None  # None: no measurement (the planner uses its analytic estimate)
    source: Source
    pending_warmup_bytes: int = 0  # a cached run's first forward has not happened yet: add it to the baseline


ANALYTIC = MemoryCalibration(calibration=None, source="analytic")
"""No calibration: the planner's first-principles estimate alone."""


def calibrate(
    network: Network, device: Device, length_limit: int, ceiling_bytes: int | None = None
) -> MemoryCalibration:
    """The cached calibration of ``network`` on ``device``, else run the probes now (held under ``ceiling_bytes``,
    the budget: :func:`measure_calibration`) and cache them, unless the budget left some out.

    Running the probes resets the process's VmHWM (see ``peak.py``) and writes the cache file (a complete fit's);
    this is the one place that does either on the way to a memory plan."""
    key = calibration_key(network, device)
    cached = load_calibration(key)
    if cached is not None:
        return MemoryCalibration(cached, "cache", pending_warmup_bytes=cached.warmup_bytes)
    measured = measure_calibration(network, device, length_limit, ceiling_bytes)
    if measured is None:
        log.info("device peak memory cannot be measured here; using the analytic memory model")
        return ANALYTIC
    calibration, complete = measured
    if not complete:
        # a cautious fit: a later run with room for every probe measures again rather than plan by this one
        log.info(
            "memory calibration: the %s-token probes were left out, as they would pass the memory budget; "
            "the plan follows the smaller probes and is not cached",
            f"{LARGE_PROBE_TOKENS:,}",
        )
        return MemoryCalibration(calibration, "small probes")
    save_calibration(key, calibration)
    return MemoryCalibration(calibration, "probes")
