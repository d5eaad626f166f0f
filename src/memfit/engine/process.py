"""Process-wide settings for a memfit process: the one function an entry point calls before it loads a model.

Some things that keep a run inside its memory budget belong to the whole process, not to one model or
one job: environment variables a native library reads once, the C allocator's behaviour, library
logging, the number of CPU threads. Library code never sets them as a side effect (importing memfit,
constructing an :class:`~memfit.Encoder` or planning memory change none of them). The entry points
call :func:`configure_process` once, at start-up, before the first model is loaded: the ``memfit``
command, ``memfit serve`` and a Ray worker (``memfit.ray.worker``).

A program that uses the Python API without calling it still gets correct results, with three
differences on the CPU: oneDNN's kernel cache may grow to its default 1,024 entries, glibc's mmap
threshold drifts upwards and pyarrow's own pool keeps what written parts freed, so the resident set can
grow up to ~0.2 GiB past the memory plan over a long run (measured on all-MiniLM-L6-v2, docs/memory.md).
The memory budget is a promise only from the entry points, or in a program that calls
``memfit.configure_process(device)`` first.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

# oneDNN (PyTorch's CPU matmul library) caches up to 1,024 compiled primitives, one per input shape, each
# holding scratch memory sized by its shape. Length-sorted inference batches rarely repeat a shape, so the
# cache only grows: on all-MiniLM-L6-v2 over 1,000 long-tail texts it added 150 MiB (bf16) / 190 MiB (fp32)
# to the peak that no budget saw coming. Four entries still hold one batch's Linear shapes, which every
# layer reuses, and ran as fast as the default or faster (docs/memory.md). Training is left alone: its
# backward needs more shapes per step (4 entries: 0.61 vs 0.69 examples/s on bert-base).
INFERENCE_KERNEL_CACHE_ENTRIES = "4"

# glibc serves blocks over its mmap threshold with mmap and returns them to the kernel when freed, but
# every such free raises the threshold to the freed size (up to 32 MiB), so after the first batches the
# activation buffers of later batches come from the heap, which fragments and only grows: on
# all-MiniLM-L6-v2 at a 0.75 GiB budget over 150 long texts the resident set climbed 150 MiB past the
# plan during the run (peak 817 MiB). A fixed 1 MiB threshold kept it flat (peak 652 MiB) at the same
# speed. 256 KiB also puts a small batch's hidden states (768 KiB at 512 tokens on MiniLM) in mmap: with
# 1 MiB they fragmented the heap, which grew by 13.8 MiB for 512 and 768 tokens alike and by 6.2 for 256,
# run to run by up to 3 MiB, and calibration fitted that as a 7-8 MiB cost of every forward (batches of 1,024
# tokens predicted at 1.3-1.4x their growth). With 256 KiB a forward grows in proportion to its tokens (8.4,
# 16.9, 33.6 and 67.4 MiB for 512 to 4,096 tokens, runs within 0.1 MiB), at the same speed: 64.9 against
# 65.4 s over five runs each of 600 long-tail texts in fp32, 6 MiB lower peaks (docs/memory.md).
INFERENCE_MMAP_THRESHOLD_BYTES = 256 << 10
_M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h


def configure_process(
    device: str = "auto", *, inference: bool = True, threads: int | None = None, quiet_libraries: bool = True
) -> None:
    """Set what memfit needs process-wide, once, before the first model is loaded.

    - ``inference`` (CPU): cap oneDNN's primitive cache at 4 entries (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``,
      read once, at the process's first CPU matmul, and inherited by child processes) and fix glibc's mmap
      threshold at 256 KiB, unless the user set ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` / ``MALLOC_MMAP_THRESHOLD_``
      themselves. Training passes ``inference=False`` and keeps both defaults (they cost it speed).
    - CPU: pyarrow allocates with the system allocator (:func:`_arrow_system_pool`), unless the user set
      ``ARROW_DEFAULT_MEMORY_POOL``, from pyarrow's first import on.
    - ``threads``: the CPU threads a model runs on (:func:`compute_threads`; torch's intra-op count from its first
      import on; ``memfit serve``: its ``--threads`` per model worker); None keeps the default.
    - ``quiet_libraries``: transformers logs errors only and shows no per-tensor loading bar, and
      huggingface_hub no retry chatter (memfit says what matters in one line).

    ``device`` is the job's device request (``auto``, ``cpu``, ``cuda``...): the CPU settings apply unless it
    names a GPU. Calling it again changes nothing that a native library has already read.
    """
    from memfit.memory.peak import glibc

    on_cpu = not str(device).startswith("cuda")
    if on_cpu and "ARROW_DEFAULT_MEMORY_POOL" not in os.environ:
        when_imported("pyarrow", _arrow_system_pool)
    if inference and on_cpu:
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", INFERENCE_KERNEL_CACHE_ENTRIES)
        libc = glibc()
        if libc is not None and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
            libc.mallopt(_M_MMAP_THRESHOLD, INFERENCE_MMAP_THRESHOLD_BYTES)
    if threads is not None:
        set_compute_threads(threads)
    if quiet_libraries:
        from huggingface_hub.utils import logging as hub_logging

        hub_logging.set_verbosity_error()
        when_imported("transformers.utils.logging", _quiet_transformers)


_configured_threads: int | None = None  # configure_process's ``threads``


def compute_threads() -> int:
    """The CPU threads a model runs on: :func:`configure_process`'s ``threads``, else torch's count where torch is
    loaded (a program may have set it), else the count torch starts with: ``MKL_NUM_THREADS`` or ``OMP_NUM_THREADS``
    up to the machine's physical cores, else the physical cores this process may run on (checked against torch 2.13
    on 2 cores: 2, 1 under ``taskset -c 0``, 1 and 2 for ``OMP_NUM_THREADS=1`` and ``8``). So a run on a compiled
    graph, which never imports torch (``memory/device.py``), runs on as many threads as a run that does."""
    if _configured_threads is not None:
        return _configured_threads
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.get_num_threads()
    for name in ("MKL_NUM_THREADS", "OMP_NUM_THREADS"):  # torch reads both, and MKL's wins
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return min(int(value), _physical_cores(range(os.cpu_count() or 1)))
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return _physical_cores(allowed)


def _physical_cores(cpus: Iterable[int]) -> int:
    """The cores (not hyperthreads) among ``cpus``, as Linux's topology files list them (each CPU its own core
    where they cannot be read)."""
    cores = set()
    for cpu in cpus:
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{topology}/physical_package_id") as package, open(f"{topology}/core_id") as core:
                cores.add((package.read().strip(), core.read().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def set_compute_threads(threads: int) -> None:
    """Run models on ``threads`` CPU threads: compiled graphs compiled from now on, and torch from its first import
    (now, if it is loaded)."""
    global _configured_threads
    _configured_threads = threads
    when_imported("torch", _set_torch_threads)


def _set_torch_threads(torch: ModuleType) -> None:
    if _configured_threads is not None:
        torch.set_num_threads(_configured_threads)


def _arrow_system_pool(pyarrow: ModuleType) -> None:
    """pyarrow allocates from its own pool (mimalloc or jemalloc), which keeps what it frees for reuse and hands
    nothing to glibc, so neither the mmap threshold nor the guard's heap trim reaches it: from the first to the fourth
    Parquet part of 1,400 x 768 float32 vectors the resident set rose 34 MiB with the default pool and 8 MiB (once, at
    the second part) with the system allocator, in processes configured alike (docs/memory.md, "Arrow's memory
    pool")."""
    pyarrow.set_memory_pool(pyarrow.system_memory_pool())


def _quiet_transformers(hf_logging: ModuleType) -> None:
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def when_imported(module_name: str, configure: Callable[[ModuleType], None]) -> None:
    """Call ``configure(module)`` now if ``module_name`` is imported, else right after its first import.

    Quieting transformers by importing it would cost every process ~0.5 s, and a run on a cached compiled graph
    never imports it otherwise (``graph_snapshot.py``); the settings still hold from its first import on."""
    if module_name in sys.modules:
        configure(sys.modules[module_name])
        return
    waiting = (f for f in sys.meta_path if isinstance(f, _ConfigureOnImport) and f.module_name == module_name)
    if not any(finder.configure is configure for finder in waiting):  # configure_process called again
        sys.meta_path.insert(0, _ConfigureOnImport(module_name, configure))


class _ConfigureOnImport(importlib.abc.MetaPathFinder):
    """A finder that finds nothing itself: for one module, it has the other finders find it and wraps its loader
    so that ``configure`` runs once the module has executed; then it leaves ``sys.meta_path``."""

    def __init__(self, module_name: str, configure: Callable[[ModuleType], None]):
        self.module_name = module_name
        self.configure = configure

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.module_name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        execute, configure = spec.loader.exec_module, self.configure

        def execute_then_configure(module: ModuleType) -> None:
            execute(module)
            configure(module)

        spec.loader.exec_module = execute_then_configure  # type: ignore[method-assign]
        return spec
