"""The device a job runs on and the precision it computes in, as names, read without importing torch.

A run on a cached compiled graph (OpenVINO, ONNX Runtime) needs no torch: importing it costs ~1.2-2 CPU-s and ~170 MiB
of resident memory (docs/memory.md), which on a 2-core machine is half of such a run's time and, under a budget,
memory the batches could have had. So the layers a compiled run goes through name the device by a string torch
itself accepts (``"cpu"``, ``"cuda"``, ``"cuda:1"``), and the precision by its name; torch is imported where a
tensor is made.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from memfit.errors import ConfigError

if TYPE_CHECKING:
    import torch

DtypeName = Literal["fp32", "bf16", "fp16"]
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}

# Where a GPU driver shows itself on Linux: NVIDIA's, ROCm's, WSL2's (CUDA through /dev/dxg) and Jetson's. Without
# any of them torch cannot see a GPU, so ``auto`` answers "cpu" without importing torch to ask; an explicit ``cuda``
# always asks torch.
GPU_DRIVER_PATHS = (
    "/proc/driver/nvidia/version",
    "/dev/nvidia0",
    "/dev/nvidiactl",
    "/dev/kfd",
    "/dev/dxg",
    "/dev/nvhost-ctrl-gpu",
)


def torch_dtype(dtype: DtypeName) -> torch.dtype:
    """The torch dtype of a precision name (torch is imported here, where a tensor is about to be made)."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


class Device(str):
    """A device as torch names it; every torch call that takes a device takes it as is (it is a ``str``), and
    ``type`` and ``index`` read as on a ``torch.device``."""

    __slots__ = ()

    @property
    def type(self) -> str:
        return self.partition(":")[0]

    @property
    def index(self) -> int | None:
        _, _, index = self.partition(":")
        return int(index) if index else None


def resolve_device(device: object = "auto") -> Device:
    """``auto`` → ``cuda`` when torch sees a GPU, else ``cpu``. A ``torch.device`` is taken by its name."""
    if isinstance(device, Device):
        return device
    name = str(device)
    if name == "auto":
        return Device("cuda" if _gpu_driver_present() and _cuda_available() else "cpu")
    kind, colon, index = name.partition(":")
    if kind not in ("cpu", "cuda") or (colon and not index.isdigit()):
        raise ConfigError(f"unknown device {name!r}")
    if kind == "cuda":
        if not _cuda_available():
            raise ConfigError(f"device {name!r} asked for, but CUDA is not available here")
        import torch

        if index and int(index) >= torch.cuda.device_count():
            raise ConfigError(f"device {name!r} asked for, but this machine has {torch.cuda.device_count()} GPU(s)")
    return Device(name)


def _gpu_driver_present() -> bool:
    """False only where torch is not loaded and, on Linux, no GPU driver shows itself: then torch could see no GPU."""
    if sys.modules.get("torch") is not None or sys.platform != "linux":
        return True
    return any(Path(path).exists() for path in GPU_DRIVER_PATHS)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
