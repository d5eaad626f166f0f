"""The backend seam: the one interface in front of every way memfit runs a network.

A :class:`Backend` is a loaded network and what runs it (PyTorch eager, a compiled OpenVINO graph, ...). The
:class:`~memfit.engine.runtime.Runtime` holds one and asks it for engines; jobs, the server and Ray workers talk
to the runtime, so nothing above ``engine/`` knows which backend runs (``tests/engine/test_backends.py`` checks that).
TEI's ``backends/`` crate puts one trait in front of ORT, candle and Python the same way.

**Adding a backend**: a module that defines a class with this interface and a :class:`BackendKind` (its name,
when it cannot run, how it loads), one line in :data:`memfit.engine.registry.BACKENDS`, and
its name in :data:`memfit.defaults.BACKEND_CHOICES` (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, Protocol

from memfit.engine.batches import Engine, Head
from memfit.engine.precision import Quantize
from memfit.memory.calibration import Network
from memfit.memory.device import Device, DtypeName

if TYPE_CHECKING:
    import torch

Task = Literal["embedding", "classification"]
"""``embedding``: the base model (``AutoModel``), pooled by memfit. ``classification``: a sequence
classifier (NLI or trained) whose own head turns each window into logits."""


@dataclass(frozen=True)
class LoadRequest:
    """What a backend is asked to load: a model for a task, on a device, in a precision."""

    model_name: str
    task: Task
    device: Device
    dtype: DtypeName
    quantize: Quantize
    uses_token_types: bool  # the tokenizer makes segment ids (BERT), or not (RoBERTa)
    pad_token_id: int
    streams: int = 1  # batches a host runs at once (``memfit serve``'s model workers)
    config: Any = None  # the model's transformers config when already read (a snapshot), else the backend loads it
    tokenizer: Any = None  # the loaded tokenizer, for a backend that keeps a snapshot of it beside its own files
    dtype_was_auto: bool = False  # ``dtype`` is ``auto``'s pick, so the backend may run another precision instead


class Backend(Protocol):
    """A loaded network and what runs it. Immutable once loaded: one instance serves several threads."""

    name: str  # the ``--backend`` name; recorded in manifests and ``/info``
    dtype: DtypeName  # the precision it runs (a backend may run auto's pick in another, see LoadRequest)
    network: Network  # what the memory layer (calibration, the planner) sees of it
    # the PyTorch module when one runs (callers that inspect its layers or attention kernel); None otherwise
    module: torch.nn.Module | None
    # whether ``dtype=auto``'s reduced precision that fails the quality guard runs in fp32 on this same backend
    # rather than being refused (the compiled graph's fp32 still beats PyTorch's fp32)
    retries_fp32: bool

    def engine(self, head: Head) -> Engine:
        """An engine that runs batches of windows on this network and reduces each with ``head``."""
        ...

    def fp32_reference(self) -> Callable[[Head], Engine]:
        """For the quality guard: loads the same network again in fp32 (unquantized) and returns an engine on it;
        the copy is freed when that engine is."""
        ...

    def fp32_copy_bytes(self) -> int:
        """What :meth:`fp32_reference`'s copy adds to the process while it runs."""
        ...

    def guard_identity(self) -> str | None:
        """What a cached pass of the quality guard is bound to (the compiled file it measured), or None: then
        reduced precision is measured on every run."""
        ...

    def release_buffers(self) -> None:
        """Free what the network keeps between batches to reuse (OpenVINO keeps the buffers of the largest batch it
        ran); a no-op where nothing is kept. The closed-loop guard calls it when a batch would be cut even after the
        heap's trim (kept, those buffers count as held memory beside the next batch's own prediction of them), and
        the quality guard before its fp32 copy loads. A best effort that must be safe while another thread runs a
        batch on the same network: what is in use stays."""
        ...


def no_snapshot(model_name: str, task: Task) -> tuple[Any, Any] | None:
    return None


def no_snapshot_config(model_name: str, task: Task) -> Any:
    return None


@dataclass(frozen=True)
class BackendKind:
    """A backend as the registry lists it: its name, why it cannot run a request (None: it can), how it loads.

    ``unavailable`` is asked before anything is loaded, so ``--backend auto`` passes over a backend that cannot
    run on this device, in this precision or without its package. ``snapshot``: the tokenizer and config a
    backend kept beside its own cached files (None: load them with transformers), so a run can start without
    importing transformers; ``snapshot_config``: the config alone, for a caller that only chooses what to load (a
    classify mode) and would build the tokenizer for nothing. ``runtime_version``: for a compiled CPU runtime
    whose speed against the others ``auto`` measures on each CPU (``backend_choice.py``), its installed version,
    which the verdict is kept for; None: not measured (it keeps its place in ``auto``'s order)."""

    name: str
    label: str  # how messages name it: "PyTorch", "OpenVINO"
    unavailable: Callable[[Device, DtypeName, Quantize], str | None]
    load: Callable[[LoadRequest], Backend]
    snapshot: Callable[[str, Task], tuple[Any, Any] | None] = no_snapshot
    snapshot_config: Callable[[str, Task], Any] = no_snapshot_config
    runtime_version: Callable[[], str | None] | None = None
