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

from memfit.memory.device import Device

CLEAR_REFS = "/proc/self/clear_refs"


class PeakMeter:
    """Peak growth of device memory over a block of code: CUDA allocator stats, or the CPU's VmHWM."""

    def __init__(self, device: Device):
        self.device = device

    @property
    def available(self) -> bool:
        """Whether :meth:`start` can reset the peak here (a check only: nothing is written)."""
        return self.device.type == "cuda" or can_reset_rss_peak()

    def current(self) -> int:
        if self.device.type == "cuda":
            import torch

            return torch.cuda.memory_allocated(self.device)
        return proc_status_bytes("VmRSS")

    def start(self) -> int:
        """Settle memory and reset the peak; returns the current usage."""
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            return torch.cuda.memory_allocated(self.device)
        trim_host_heap()  # freed heap back to the kernel, so the next peak is seen in full
        reset_rss_peak()
        return proc_status_bytes("VmRSS")

    def peak(self) -> int:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return proc_status_bytes("VmHWM")

    def trim(self) -> None:
        if self.device.type == "cuda":
            import torch

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
    """Drop this process's clean pages of shared libraries (their code and constants) from its resident set;
    the page cache keeps them, and the ones still used fault back in.

    They count in the resident set, and how many there are depends on the page cache, not on memfit: right
    after an install the libraries' files are all cached and every fault maps their neighbours too. Measured
    on the 2-core AMD EPYC (MiniLM, PyTorch, after one batch): a fresh venv's process held 304 MiB of file
    pages, the same job in an older venv 180 MiB. ``MADV_PAGEOUT`` skips every page another process maps as
    well, so it handed back nothing whenever a second process had imported torch from the same venv (the test
    runner that started the CLI, a server's or Ray's other workers: 80 of 81 MiB stayed); this zaps the
    mappings with ``MADV_DONTNEED`` instead, which drops only this process's mapping of them: 304 MiB fell
    to 51, and the next batches faulted 100 MiB back in (docs/memory.md).

    Only what loses nothing is touched (:func:`clean_library_mappings`): private, read-only mappings of
    shared libraries (which stay mapped for the process's life) holding no page of their own, in memory or in
    swap. A library's relocated read-only data (RELRO) holds such pages; zapping it too crashed the process.
    A no-op off Linux."""
    libc = glibc()
    if libc is None:
        return
    try:
        with open("/proc/self/smaps", encoding="utf-8", errors="surrogateescape") as smaps:
            text = smaps.read()
    except OSError:
        return
    for start, end in clean_library_mappings(text):
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)


_UNTOUCHABLE_FLAGS = {"ht", "pf", "io", "lo"}  # hugetlb, raw page frames, I/O memory, locked (proc(5) VmFlags)


def clean_library_mappings(smaps: str) -> list[tuple[int, int]]:
    """The ``(start, end)`` addresses of the mappings in ``smaps`` (the text of ``/proc/PID/smaps``) whose
    pages can be dropped and read again from their file: private and read-only, of a shared library
    (``*.so``, ``*.so.N``: mapped once and never replaced while the process runs), holding no page of its own
    (``Anonymous: 0`` and ``Swap: 0``), and none of the special kinds in ``VmFlags``."""
    mappings: list[tuple[int, int]] = []
    for block in _smaps_blocks(smaps):
        header, fields = block
        parts = header.split(maxsplit=5)
        if len(parts) < 6:
            continue  # anonymous memory
        path = parts[5]
        name = os.path.basename(path)
        library = path.startswith("/") and not path.startswith("/dev/") and (name.endswith(".so") or ".so." in name)
        private_read_only = "w" not in parts[1] and parts[1].endswith("p")
        own_pages = fields.get("Anonymous", "1 kB").split()[0] != "0" or fields.get("Swap", "0 kB").split()[0] != "0"
        special = bool(_UNTOUCHABLE_FLAGS.intersection(fields.get("VmFlags", "").split()))
        if library and private_read_only and not own_pages and not special:
            low, high = parts[0].split("-")
            mappings.append((int(low, 16), int(high, 16)))
    return mappings


def _smaps_blocks(smaps: str) -> list[tuple[str, dict[str, str]]]:
    """Each mapping of ``smaps`` text: its header line and its ``Key: value`` lines."""
    blocks: list[tuple[str, dict[str, str]]] = []
    for line in smaps.splitlines():
        key, colon, value = line.partition(":")
        if colon and " " not in key:  # "Rss:       12 kB", "VmFlags: rd mr ..."
            if blocks:
                blocks[-1][1][key] = value.strip()
        elif line.strip():
            blocks.append((line, {}))
    return blocks


def file_resident_bytes() -> int:
    """The file pages of the resident set: ``VmRSS`` less ``RssAnon`` (so files on tmpfs, counted as shared
    memory, are in it)."""
    return proc_status_bytes("VmRSS") - proc_status_bytes("RssAnon")


def settle_file_pages(work: Callable[[], None]) -> int:
    """Hand back the clean file pages (:func:`unmap_clean_file_pages`), then run ``work`` (one small forward)
    so the pages it needs fault back in: the process then plans from its working set rather than from what
    the page cache happened to map (docs/memory.md). Returns the bytes of file pages ``work`` faulted back in
    (0 without ``/proc``): what a forward will fault back in after a later release."""
    unmap_clean_file_pages()
    try:
        before = file_resident_bytes()
    except OSError:
        work()
        return 0
    work()
    return max(0, file_resident_bytes() - before)


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
