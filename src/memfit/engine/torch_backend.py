"""PyTorch eager: the backend for every device (the CPU, CUDA) and every model transformers loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from memfit.engine.backend import Backend, BackendKind, LoadRequest
from memfit.engine.batches import Engine, Head, TorchEngine
from memfit.engine.precision import Quantize, fp32_copy_bytes, load_fp32_reference, load_precision_model
from memfit.memory.calibration import Network, torch_network
from memfit.memory.device import Device, DtypeName

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TorchBackend:
    """A transformers module on its device, fed padded batches by :class:`~memfit.engine.batches.TorchEngine`."""

    module: torch.nn.Module
    model_name: str  # what the quality guard's fp32 copy loads again
    device: Device
    pad_token_id: int
    dtype: DtypeName
    network: Network
    name: str = "torch"
    retries_fp32: bool = False

    @classmethod
    def of(cls, module: torch.nn.Module, model_name: str, device: Device, pad_token_id: int, dtype: DtypeName):
        """The backend of ``module``, its fp32 linear layers switched to oneDNN on a CPU that runs them faster
        there (``cpu_linears.py``)."""
        from memfit.engine.cpu_linears import use_onednn_linears

        kernels = use_onednn_linears(module) if device.type == "cpu" else None
        return cls(module, model_name, device, pad_token_id, dtype, torch_network(module, device, kernels))

    def engine(self, head: Head) -> Engine:
        return TorchEngine(self.module, self.device, self.pad_token_id, head)

    def fp32_reference(self) -> Callable[[Head], Engine]:
        name, device, pad = self.model_name, self.device, self.pad_token_id
        return lambda head: TorchEngine(load_fp32_reference(name, device), device, pad, head)

    def fp32_copy_bytes(self) -> int:
        return fp32_copy_bytes(self.module, self.device)

    def guard_identity(self) -> str | None:
        return None  # PyTorch's kernels vary with the installed build: measure every run

    def release_buffers(self) -> None:
        pass  # a batch's tensors are freed when it ends


def _unavailable(device: Device, dtype: DtypeName, quantize: Quantize) -> str | None:
    return None  # runs anything; what it cannot load fails with ModelLoadError


def load(request: LoadRequest) -> Backend:
    from transformers import AutoModel

    from memfit.engine.pooled_classifier import load_sequence_classifier

    dtype: DtypeName = request.dtype
    if request.task == "embedding":
        module = load_precision_model(request.model_name, AutoModel, request.device, dtype, request.quantize)
        if request.quantize == "int8" and request.device.type == "cpu":
            dtype = "fp32"  # PyTorch's dynamic int8: its float parts are fp32
    else:
        module = load_sequence_classifier(request.model_name, request.device, dtype)
    return TorchBackend.of(module, request.model_name, request.device, request.pad_token_id, dtype)


TORCH = BackendKind("torch", "PyTorch", _unavailable, load)
