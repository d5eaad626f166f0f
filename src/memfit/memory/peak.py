"""Peak memory metering: the CPU's resident-set high-water mark (``VmHWM``) and CUDA allocator stats.

Resetting ``VmHWM`` (writing ``/proc/self/clear_refs``) changes what every other reader of the process's
peak sees, so it only ever happens through an explicit call: :meth:`PeakMeter.start` (the calibration
probes and the trainer's per-step measurement) or :func:`reset_rss_peak`. :func:`process_peak_rss_bytes`
remembers the peak before each of memfit's resets, so the whole run's peak is never hidden by them.
"""

from __future__ import annotations

import ctypes
import os
import sys
from functools import lru_cache
from pathlib import Path

import torch

CLEAR_REFS = "/proc/self/clear_refs"


class PeakMeter:
    """Peak growth of device memory over a block of code: CUDA allocator stats, or the CPU's VmHWM."""

    def __init__(self, device: torch.device):
        self.device = device

    @property
    def available(self) -> bool:
        """Whether :meth:`start` can reset the peak here (a check only: nothing is written)."""
        return self.device.type == "cuda" or can_reset_rss_peak()

    def current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return proc_status_bytes("VmRSS")

    def start(self) -> int:
        """Settle memory and reset the peak; returns the current usage."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            return torch.cuda.memory_allocated(self.device)
        trim_host_heap()  # freed heap back to the kernel, so the next peak is seen in full
        reset_rss_peak()
        return proc_status_bytes("VmRSS")

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return proc_status_bytes("VmHWM")

    def trim(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            trim_host_heap()


def trim_host_heap() -> None:
    """Hand freed heap memory back to the kernel (glibc ``malloc_trim``); a no-op elsewhere."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)


MADV_PAGEOUT = 21  # linux/mman.h, Linux 5.4 and later


def page_out_file_mappings() -> None:
    """Ask the kernel to drop this process's read-only file pages (shared libraries' code and data, memory-mapped
    model files) from its resident set; the ones still used fault back in. They count in the resident set, and
    how many there are depends on the page cache, not on memfit: right after an install, when the libraries'
    files are all cached, the kernel maps their neighbouring pages too, and a fresh clone's process held 106 MiB
    more of them than the same job in an older environment (586 vs 480 MiB on PyTorch, 613 vs 509 MiB on
    OpenVINO, MiniLM). Paging them out took 0.05-0.07 s and cut 580 to 348 MiB, of which 25 MiB came back on the
    next batches (docs/memory.md). A no-op where ``madvise(MADV_PAGEOUT)`` is missing."""
    libc = glibc()
    if libc is None:
        return
    try:
        maps = open("/proc/self/maps").read().splitlines()
    except OSError:
        return
    for line in maps:
        fields = line.split()
        if len(fields) < 6 or not fields[5].startswith("/") or "w" in fields[1]:
            continue  # anonymous memory, or writable mappings (their private copies are not file pages)
        start, end = (int(address, 16) for address in fields[0].split("-"))
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_PAGEOUT)


def release_host_memory() -> None:
    """Everything the process can give back without losing work: glibc's freed heap and the file pages it can
    read again (:func:`trim_host_heap`, :func:`page_out_file_mappings`)."""
    trim_host_heap()
    page_out_file_mappings()


@lru_cache(maxsize=1)
def glibc():
    """glibc through ctypes, or None (not Linux, or a libc without ``malloc_trim`` such as musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - musl has no malloc_trim
        return libc
    except (OSError, AttributeError):
        return None


def proc_status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


_peak_before_resets = 0
"""The process's VmHWM just before memfit last reset it: resets are for measuring one block of code,
and must not hide the whole run's peak from :func:`process_peak_rss_bytes`."""


def reset_rss_peak() -> None:
    """Set VmHWM to the current resident set (Linux), remembering the peak it had."""
    global _peak_before_resets
    _peak_before_resets = max(_peak_before_resets, proc_status_bytes("VmHWM"))
    Path(CLEAR_REFS).write_text("5")  # VmHWM := VmRSS


def process_peak_rss_bytes() -> int:
    """The peak resident set of this whole process (Linux), across memfit's own resets of VmHWM."""
    return max(_peak_before_resets, proc_status_bytes("VmHWM"))


def can_reset_rss_peak() -> bool:
    """Whether this process may reset its VmHWM (Linux with a writable ``clear_refs``); writes nothing."""
    return sys.platform.startswith("linux") and os.access(CLEAR_REFS, os.W_OK) and os.path.exists("/proc/self/status")
