"""Peak memory metering: the CPU's resident-set high-water mark (``VmHWM``) and CUDA allocator stats.

Resetting ``VmHWM`` (writing ``/proc/self/clear_refs``) changes what every other reader of the process's
peak sees, so it only ever happens through an explicit call: :meth:`PeakMeter.start` (the calibration
probes and the trainer's per-step measurement) or :func:`reset_rss_peak`. :func:`process_peak_rss_bytes`
remembers the peak before each of memfit's resets, so the whole run's peak is never hidden by them; a job
starts its own window (:func:`start_peak_window`), so an earlier job in the same process is not its peak.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
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


MADV_DONTNEED = 4  # linux/mman.h


def unmap_clean_file_pages() -> None:
    """Drop this process's clean, read-only file pages (shared libraries' code and constants, memory-mapped
    model files) from its resident set; the page cache keeps them, and the ones still used fault back in.

    They count in the resident set, and how many there are depends on the page cache, not on memfit: right
    after an install the libraries' files are all cached and every fault maps their neighbours too. Measured
    on the 2-core AMD EPYC (MiniLM, PyTorch, after one batch): a fresh venv's process held 304 MiB of file
    pages, the same job in an older venv 180 MiB. ``MADV_PAGEOUT`` skips every page another process maps as
    well, so it handed back nothing whenever a second process had imported torch from the same venv (the test
    runner that started the CLI, a server's or Ray's other workers: 80 of 81 MiB stayed); this zaps the
    mappings with ``MADV_DONTNEED`` instead, which drops only this process's mapping of them: 304 MiB fell
    to 51, and the next batches faulted 100 MiB back in (docs/memory.md).

    Only private mappings without a single copied-on-write page are touched (``Anonymous: 0`` in
    ``/proc/self/smaps``): for those, dropping a page loses nothing, as the file still holds it. Relocated
    read-only data (RELRO), anything writable or shared, and device files are left alone. A no-op off Linux."""
    libc = glibc()
    if libc is None:
        return
    try:
        with open("/proc/self/smaps") as smaps:
            lines = smaps.read().splitlines()
    except OSError:
        return
    for start, end in _clean_read_only_file_mappings(lines):
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)


def _clean_read_only_file_mappings(smaps_lines: list[str]) -> list[tuple[int, int]]:
    """The ``(start, end)`` addresses of the private, read-only mappings of regular files that hold no
    anonymous (copied-on-write) page, from the lines of ``/proc/self/smaps``."""
    mappings: list[tuple[int, int]] = []
    candidate: tuple[int, int] | None = None
    for line in smaps_lines:
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
            # a mapping's header: address range, permissions, offset, device, inode[, path]
            path = fields[5] if len(fields) >= 6 else ""
            permissions = fields[1]
            plain_file = path.startswith("/") and not path.startswith("/dev/")
            private_read_only = "w" not in permissions and permissions.endswith("p")
            candidate = None
            if plain_file and private_read_only:
                low, high = fields[0].split("-")
                candidate = (int(low, 16), int(high, 16))
        elif fields and fields[0] == "Anonymous:" and candidate is not None:
            if int(fields[1]) == 0:
                mappings.append(candidate)
            candidate = None
    return mappings


def settle_file_pages(work: Callable[[], None]) -> int:
    """Hand back the clean file pages (:func:`unmap_clean_file_pages`), then run ``work`` (one small forward)
    so the pages it needs fault back in: the process then plans from its working set rather than from what
    the page cache happened to map (docs/memory.md). Returns the bytes of file pages ``work`` faulted back in
    (0 without ``/proc``): what a forward will fault back in after a later release."""
    unmap_clean_file_pages()
    try:
        before = proc_status_bytes("RssFile")
    except OSError:
        work()
        return 0
    work()
    return max(0, proc_status_bytes("RssFile") - before)


def release_host_memory() -> None:
    """Everything the process can give back without losing work: glibc's freed heap and the file pages it can
    read again (:func:`trim_host_heap`, :func:`unmap_clean_file_pages`)."""
    trim_host_heap()
    unmap_clean_file_pages()


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


def start_peak_window() -> None:
    """Measure the process's peak from here on (Linux): a job calls this as it starts. In a long-lived
    process (a notebook, a test session, an application that trains and then embeds) the kernel's
    high-water mark still holds what an earlier job reached, and a job that reported or checked that figure
    would refuse or report for memory it never used. A no-op where VmHWM cannot be reset."""
    global _peak_before_resets
    if can_reset_rss_peak():
        reset_rss_peak()
        _peak_before_resets = 0


def process_peak_rss_bytes() -> int:
    """The peak resident set of this process (Linux) since the running job started
    (:func:`start_peak_window`), across memfit's own resets of VmHWM."""
    return max(_peak_before_resets, proc_status_bytes("VmHWM"))


def can_reset_rss_peak() -> bool:
    """Whether this process may reset its VmHWM (Linux with a writable ``clear_refs``); writes nothing."""
    return sys.platform.startswith("linux") and os.access(CLEAR_REFS, os.W_OK) and os.path.exists("/proc/self/status")
