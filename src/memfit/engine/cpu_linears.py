"""fp32 linear layers on the CPU through oneDNN, where this CPU runs them faster that way.

Why: PyTorch's CPU wheels multiply fp32 matrices with MKL, and MKL picks its kernels by the CPU's vendor as well as
its flags. On 2 cores of an AMD EPYC with AVX-512 (family 26), a 2,048³ fp32 product ran at 203 GFLOP/s through
``torch.matmul`` and 456 through OpenVINO, whose kernels are oneDNN's; the same product through PyTorch's own
oneDNN linear operator ran at 458-487. A whole all-MiniLM-L6-v2 forward on real short texts ran 1.8x faster
with its linear layers on oneDNN (docs/benchmarks.md). PyTorch ships oneDNN and its compiler already sends linear
layers there; eager mode does not.

The choice is measured, not read from a table of CPUs: :func:`onednn_speedup` times one of the model's own linear
shapes both ways on this machine (tens of milliseconds, once per shape and process), and the layers switch only
where oneDNN is clearly faster and gives the same numbers. A switched layer keeps its very ``Parameter`` objects,
so the weights' memory, the state dict and the streamed path's weight slot see the same module; only its forward
changes, and only for fp32 tensors on the CPU outside autograd and autocast (anything else takes ``F.linear`` as
before).

Training is left on ``F.linear``. Tried with the forward and the input's gradient on oneDNN (all-MiniLM-L6-v2,
800 Rotten Tomatoes snippets, fp32, family-26 EPYC): an epoch took 20.1 s against 24.6 s with no budget, but the
process held 0.62 GiB after calibration against 0.56 (training keeps oneDNN's default cache of 1,024 kernels, one per
shape, docs/memory.md), so under a 900 MiB budget its micro-batches were smaller and the epoch took 29.4 s against
22.9 s.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger("memfit")

ONEDNN_LINEARS = "oneDNN linears"
"""What a PyTorch module's runtime says once its linear layers run on oneDNN: the memory model's calibrations key
on it (oneDNN's scratch space per product is not MKL's)."""

CLEAR_SPEEDUP = 1.2
"""oneDNN is used where it runs a layer's shape at least this much faster than ``F.linear``: near a tie, the
default stays (on CPUs where MKL runs its best kernels, the two are the same kernels' speed)."""

SAME_NUMBERS = 1e-4
"""The largest difference, relative to the output's largest value, at which oneDNN's product counts as the same:
both sum in fp32, in different orders (measured: 1e-6 of the largest value)."""

_PROBE_ROWS = 512  # tokens in one product: a batch of short texts, or one long window
_PROBE_REPEATS = 5


class OneDNNLinear(torch.nn.Linear):
    """``torch.nn.Linear`` whose fp32 CPU forward outside autograd and autocast runs
    ``torch.ops.mkldnn._linear_pointwise`` (the operator PyTorch's compiler uses for linear layers on the CPU) on
    the layer's own weight; anything else, or an input the operator does not take, ``F.linear`` as before."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dtype is torch.float32
            and x.device.type == "cpu"
            and not torch.is_grad_enabled()
            and not torch.is_autocast_enabled("cpu")  # autocast casts F.linear's operands: leave it to it
            and x.is_contiguous()
            and (self.bias is None or self.bias.is_contiguous())  # the operator misreads a strided bias
        ):
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def use_onednn_linears(*modules: torch.nn.Module) -> str | None:
    """Switch the fp32 linear layers of ``modules`` to :class:`OneDNNLinear` where :func:`onednn_speedup` finds
    oneDNN clearly faster on their widest shape: :data:`ONEDNN_LINEARS` if it did (the kernels the memory model's
    ``torch_runtime`` names), else None. Call it for modules that run on the CPU: their
    layers hold their weights there, or on the meta device until the CPU's are assigned (the streamed path's layer
    slot, passed beside the model it was detached from). Quantized or reduced-precision layers stay as they are."""
    linears = [
        child
        for module in modules
        for child in module.modules()
        if type(child) is torch.nn.Linear
        and child.weight.dtype is torch.float32
        and child.weight.device.type in ("cpu", "meta")
    ]
    if not linears or not _onednn_available():
        return None
    widest = max(linears, key=lambda linear: linear.in_features * linear.out_features)
    speedup = onednn_speedup(widest.in_features, widest.out_features)
    if speedup < CLEAR_SPEEDUP:
        return None
    for linear in linears:
        linear.__class__ = OneDNNLinear  # the same object, its Parameters and hooks in place: only forward changes
    log.info("fp32 linear layers on oneDNN: %.2fx PyTorch's default on this CPU", speedup)
    return ONEDNN_LINEARS


def onednn_speedup(in_features: int, out_features: int) -> float:
    """How many times faster oneDNN runs a ``(512, in_features) x (in_features, out_features)`` fp32 product than
    ``F.linear`` on this machine's threads (best of five each, alternated); 0 where its result is not the same
    within :data:`SAME_NUMBERS`. Measured once per shape and process: model workers that load at once wait for
    one measurement rather than time each other's products."""
    with _MEASURING:
        return _measured_speedup(in_features, out_features)


_MEASURING = threading.Lock()


@functools.lru_cache(maxsize=None)
def _measured_speedup(in_features: int, out_features: int) -> float:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(_PROBE_ROWS, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    bias = torch.randn(out_features, generator=generator)
    with torch.inference_mode():
        expected = F.linear(x, weight, bias)
        got = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        if not float((got - expected).abs().max()) <= SAME_NUMBERS * max(1.0, float(expected.abs().max())):
            return 0.0
        default, onednn = float("inf"), float("inf")
        for _ in range(_PROBE_REPEATS):
            default = min(default, _seconds(lambda: F.linear(x, weight, bias)))
            onednn = min(onednn, _seconds(lambda: torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")))
    return default / onednn


def _seconds(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


@functools.lru_cache(maxsize=1)
def _onednn_available() -> bool:
    """Whether this PyTorch has oneDNN and its linear operator (a build without them keeps ``F.linear``)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
