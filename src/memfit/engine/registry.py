"""The backends memfit can run, in ``--backend auto``'s order of preference, and the choice between them.

``auto`` takes the first backend that can run the request and loads it; one that fails to load (a model OpenVINO
cannot convert) is passed over with a warning for the next. OpenVINO comes first: on the CPU its compiled graph ran
1.5-1.7x PyTorch in fp32 and 1.3-1.6x PyTorch's bf16 on short texts (docs/benchmarks.md); it cannot run on GPUs,
where PyTorch does. ONNX Runtime (the onnx extra) runs fp32 on the CPU: it was faster than OpenVINO's fp32 on the
AVX2-only EPYC. Where both can run a request, which one goes first is measured on this CPU, once
(``backend_choice.py``); the order here is the one a measurement must beat.
"""

from __future__ import annotations

import logging
import re

from memfit.defaults import BACKEND_CHOICES
from memfit.engine.backend import Backend, BackendKind, LoadRequest
from memfit.engine.onnxruntime_backend import ONNXRUNTIME
from memfit.engine.openvino.backend import OPENVINO
from memfit.engine.precision import Quantize
from memfit.engine.torch_backend import TORCH
from memfit.errors import ConfigError, ModelLoadError
from memfit.memory.device import Device, DtypeName

log = logging.getLogger("memfit")

BACKENDS: dict[str, BackendKind] = {kind.name: kind for kind in (OPENVINO, ONNXRUNTIME, TORCH)}


def candidate_backends(backend: str, device: Device, dtype: DtypeName, quantize: Quantize) -> list[BackendKind]:
    """The backends to try, in order: an explicit one (refused with its reason when it cannot run the request), or
    every one that can under ``auto``."""
    if backend not in BACKEND_CHOICES:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKEND_CHOICES)}")
    if backend != "auto":
        problem = BACKENDS[backend].unavailable(device, dtype, quantize)
        if problem is not None:
            raise ConfigError(problem)
        return [BACKENDS[backend]]
    return [kind for kind in BACKENDS.values() if kind.unavailable(device, dtype, quantize) is None]


def auto_dtype_for(backend: str, device: Device, dtype: DtypeName, quantize: Quantize) -> DtypeName:
    """What ``--dtype auto`` runs in on ``backend``: its pick for the device (``dtype``), or fp32 where a backend
    named by ``--backend`` refuses that pick for its precision alone (ONNX Runtime on a CPU with fast bf16):
    ``--backend onnxruntime`` alone asks for ONNX Runtime as it runs, and was refused for a bf16 that nobody asked
    for. A refusal for anything else (the device, int8, a missing package) reads the same in fp32 and stands."""
    kind = BACKENDS.get(backend)
    if kind is None or dtype == "fp32":
        return dtype
    refused = kind.unavailable(device, dtype, quantize)
    return "fp32" if refused is not None and kind.unavailable(device, "fp32", quantize) != refused else dtype


def load_backend(candidates: list[BackendKind], request: LoadRequest) -> Backend:
    """The first of ``candidates`` that loads; a :class:`ModelLoadError` passes over to the next with a warning
    (the last one's is raised), which says why without the error's advice of another ``--backend``."""
    for kind, after in zip(candidates, [*candidates[1:], None]):
        try:
            return kind.load(request)
        except ModelLoadError as exc:
            if after is None:
                raise
            log.warning("%s; running it on %s", re.sub(r"; use --backend [^;]*$", "", str(exc)), after.label)
    raise ConfigError("no backend can run this request")  # candidate_backends never returns an empty list
