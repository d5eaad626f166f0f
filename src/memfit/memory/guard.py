"""The closed-loop budget guard: each batch is cut to what the resident set leaves room for *now*.

The memory plan (``model.py``) is open-loop: it reads the process once, before the first batch, and
turns the rest of the budget into a token budget with a fixed margin. What the process gains afterwards
is invisible to it: code pages of torch and Arrow first touched mid-run (more of them right after an
install, when those libraries' files sit in the page cache), oneDNN's kernels, heap fragmentation,
input and output in flight. :class:`ResidentSetGuard` closes the loop. Before each batch it reads the
resident set (``/proc/self/statm``: ~2 µs on a kept descriptor) and admits as many of the batch's
sequences as fit beside it:

    resident now + in flight beside the batch + batches already running + predicted(batch) + margin ≤ budget

``predicted`` is the calibrated :class:`~memfit.memory.model.ActivationModel`; ``in flight beside the
batch`` is what other threads may still add while it runs (the host reserve of ``host_budget.py``: the
next block being tokenized, output waiting for the writer), kept while one of them is at work
(:meth:`ResidentSetGuard.tracking`); ``margin`` covers what the batch itself adds
beyond its activations (see :data:`GUARD_MARGIN_BYTES`). When not even one sequence fits, the guard
first waits for a tracked thread still at work (the writer's queue drains, the next block is ready), then
releases what can be released (the callers' own, such as the tokenizer's caches, then glibc's freed heap and
clean file pages) and reads again; if it still does not fit, it raises
:class:`~memfit.errors.DoesNotFitError` naming a budget that would work, instead of running over.

After each batch that set a new high-water mark (``VmHWM``), the guard knows that batch's true peak and
raises its margin to whatever that batch added beyond the prediction, so drift it has seen once is
kept free from then on. It needs the resident set, the budget and the predicted bytes of a batch shape, and
from the backend only a way to free the buffers a network keeps between batches (``Backend.release_buffers``).
Only the CPU is guarded (Linux, where ``/proc`` exists); on CUDA the allocator counts exactly and raises its own
out-of-memory error.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import resource
import sys
import threading
from dataclasses import dataclass
from collections.abc import Callable, Iterator, Sequence

from memfit.errors import DoesNotFitError
from memfit.memory.model import ActivationModel, MemoryPlan
from memfit.memory.peak import file_resident_bytes, proc_status_bytes, release_host_memory, trim_host_heap

log = logging.getLogger("memfit")

MiB = 2**20

GUARD_MARGIN_BYTES = 8 * MiB
"""What one batch may add to the resident set beyond its predicted activations and the reserve before
the guard has measured it: pages of library code and kernels first touched by a new batch shape, a
little heap slack; half the plan's drift floor. Measured (docs/memory.md, "The closed-loop guard"): in
``embed --tokens`` of a 300,000-character document at 768 MiB the batches that set a new high-water
mark peaked 79.6 MiB or more *below* prediction + reserve. The guard raises the margin for the rest of
a run as soon as a batch is seen to add more."""

_PAGE_BYTES = resource.getpagesize()


class _StatmReader:
    """The process's resident set in bytes from ``/proc/self/statm``, on a descriptor kept open per process
    (reopened after a fork, whose ``/proc/self`` is another process)."""

    def __init__(self) -> None:
        self._pid = -1
        self._fd = -1

    def __call__(self) -> int:
        pid = os.getpid()
        if pid != self._pid:
            self._fd = os.open("/proc/self/statm", os.O_RDONLY)
            self._pid = pid
        fields = os.pread(self._fd, 128, 0).split()
        return int(fields[1]) * _PAGE_BYTES


resident_set_bytes: Callable[[], int] = _StatmReader()
"""The resident set now (anonymous + file-backed + shared pages: what ``VmRSS`` and ``VmHWM`` count)."""


def resident_peak_bytes() -> int:
    """The kernel's high-water mark of the resident set (``VmHWM``)."""
    return proc_status_bytes("VmHWM")


@dataclass(frozen=True, slots=True)
class Admission:
    """A batch let through: how many of its sequences, at which width, and what the process held then."""

    batch_size: int
    padded_length: int
    predicted_bytes: float
    resident_before: int
    peak_before: int
    alone: bool  # no other batch was running, so a new high-water mark is this batch's own
    releases_before: int = 0  # how many releases the guard had made when it let the batch through
    beside_bytes: int = 0  # what was kept for other threads while it ran (:meth:`ResidentSetGuard.tracking`)


class ResidentSetGuard:
    """Cuts each batch to the room the resident set leaves now; refuses rather than run over the budget.

    ``budget_bytes``: the whole process's budget. ``activations``: predicted bytes of a batch shape.
    ``concurrent_bytes``: what other threads may add while a batch runs (input and output in flight).
    ``read_resident`` / ``read_peak`` / ``trim``: the process's resident set, its high-water mark and what
    it hands back before a refusal (freed heap and clean file pages); ``trim_heap``: the freed heap alone,
    handed back before a batch is cut (all replaceable, so the cut logic is tested with a scripted process);
    ``release``: what else may be freed before a refusal (the tokenizer's caches); ``release_kept``: what the
    network keeps between batches to reuse, freed with the heap's trim before a cut (OpenVINO keeps the buffers of
    the largest batch it ran: counted as held, they left a 600 MiB MiniLM bf16 run no room for one sequence once the
    quality guard and a 4,096-token batch had run); ``resume_hint`` ends the refusal.

    A batch's activations are freed when it ends, but glibc keeps much of that memory (its trim threshold
    follows the largest blocks freed), so the resident set stays up to a batch's worth above what the process
    holds, and the next batch reuses that memory rather than adding to it. Counting it would cut batches for
    room that is there: measured on MiniLM fp32 (2-core AMD EPYC, docs/memory.md), the anonymous part of the
    resident set rose from 820 to as much as 832 MiB within a run of 48 windows of 256 tokens, and a trim took
    it back to 821.
    So before a cut the guard trims the heap, once per batch run since the last trim (what the next batch
    faults back in is a few milliseconds against its forward, and is paid only when a batch would be cut).

    The trim hands back clean file pages too, and the next batch faults back in those it needs: until one
    batch has run alone since, up to ``refault_bytes`` of what the release took (the working set a forward
    faulted back in at load, :func:`~memfit.memory.peak.settle_file_pages`; raised to the most a batch was
    seen to fault back in after a release) and has not come back (``read_file_resident``) is kept free, so
    that batch does not pass the budget. Thread-safe: batches
    run side by side (the server's workers) are each counted while they run.
    """

    def __init__(
        self,
        budget_bytes: int,
        activations: ActivationModel,
        concurrent_bytes: int = 0,
        margin_bytes: int = GUARD_MARGIN_BYTES,
        read_resident: Callable[[], int] = resident_set_bytes,
        read_peak: Callable[[], int] = resident_peak_bytes,
        trim: Callable[[], None] = release_host_memory,
        trim_heap: Callable[[], None] = trim_host_heap,
        release: Sequence[Callable[[], None]] = (),
        release_kept: Sequence[Callable[[], None]] = (),
        resume_hint: str = "the parts already written stay, and --resume continues after them",
        refault_bytes: int = 0,
        read_file_resident: Callable[[], int] = file_resident_bytes,
    ):
        self.budget_bytes = budget_bytes
        self.activations = activations
        self.concurrent_bytes = concurrent_bytes
        self.margin_bytes = margin_bytes
        self._read_resident = read_resident
        self._read_peak = read_peak
        self._trim = trim
        self._trim_heap = trim_heap
        self._heap_may_hold_freed = True  # a batch has run since the heap was last trimmed
        self._releasers = tuple(release)
        self._kept_releasers = tuple(release_kept)
        # the threads the reserve is for, while tracked, with the thread that runs their stream's batches
        self._tracked: list[tuple[int, Callable[[], bool], Callable[[], None]]] = []
        self.resume_hint = resume_hint
        self.refault_bytes = refault_bytes
        self._read_file_resident = read_file_resident
        self._file_resident_after_release = 0
        self._refault_expected = 0  # file pages the last release took that no batch has run without since
        self._refault_pending_measure = False
        self._releases = 0
        self._lock = threading.Lock()
        self._running_bytes = 0.0  # predicted bytes of the batches admitted and not yet done
        self._running = 0
        self.batches_cut = 0  # how often a batch was cut below its plan (a figure for logs and tests)
        self.largest_added_bytes: float | None = None  # the most a batch was seen to add beyond its prediction

    def follow(
        self, plan: MemoryPlan, release: Sequence[Callable[[], None]], release_kept: Sequence[Callable[[], None]]
    ) -> None:
        """Guard the batches of ``plan`` from now on, freeing ``release`` and ``release_kept`` (the constructor's):
        a job whose runtime is replaced mid-run (``dtype=auto``'s fp32 fallback) keeps its guard, which must not keep
        the old network alive through its releases. What it learned of the file pages a release takes is kept."""
        with self._lock:
            self.activations = plan.activations
            self.concurrent_bytes = plan.reserved_bytes
            self.refault_bytes = max(self.refault_bytes, plan.refault_bytes)
            self._releasers = tuple(release)
            self._kept_releasers = tuple(release_kept)

    @contextlib.contextmanager
    def tracking(self, busy: Callable[[], bool], wait_idle: Callable[[], None]) -> Iterator[None]:
        """While the stream runs, ``busy()`` says whether a thread that the reserve (``concurrent_bytes``) is for
        may still allocate: the thread preparing the next block until it is ready, the writer until its queue
        is empty. Only the thread that runs the batches (the one that calls this) hands them work, so one that is
        idle when that thread admits a batch stays idle while the batch runs. With every tracked thread idle and
        every tracked stream run by the admitting thread (two streams side by side keep it), the reserve is not
        kept: what they hold is already in the resident set the guard reads, and counted again it cut a streamed run's
        blocks of 2,396 tokens to 5 windows of 40 (all-mpnet-base-v2 at 547 MiB, docs/memory.md). Untracked (the
        server, training), the reserve is always kept. When not even one sequence fits beside a reserve kept for a
        busy thread, the guard waits for it (``wait_idle``) and looks again before it releases anything: in
        ``test_guard``'s real process, a release made only because the next block was still being read handed back
        the file pages the batch then faulted in again, and that refault was taken for the batch's own excess."""
        tracked = (threading.get_ident(), busy, wait_idle)
        self._tracked.append(tracked)
        try:
            yield
        finally:
            self._tracked.remove(tracked)

    def beside_bytes(self) -> int:
        """What to keep for other threads when the calling thread admits a batch: the reserve, unless the streams
        tracked are all this thread's and their threads are all idle."""
        me = threading.get_ident()
        tracked = self._tracked
        if tracked and all(owner == me and not busy() for owner, busy, _ in tracked):
            return 0
        return self.concurrent_bytes

    def _wait_for_tracked(self) -> None:
        """Wait until every tracked thread that is at work is idle."""
        for _, busy, wait_idle in self._tracked:
            if busy():
                wait_idle()

    def admit(self, batch_size: int, padded_length: int) -> Admission:
        """Let through the first ``n`` (1 ≤ n ≤ ``batch_size``) sequences of a batch padded to
        ``padded_length`` that fit beside the resident set now; call :meth:`done` when the batch has run.

        Raises :class:`DoesNotFitError` when not even one fits after releasing what can be released."""
        with self._lock:
            beside = self.beside_bytes()
            resident = self._read_resident()
            fitting = self._fitting(resident, batch_size, padded_length, beside)
            if fitting < batch_size and self._heap_may_hold_freed:
                self._trim_heap()  # what the last batches freed and glibc kept is room
                self._heap_may_hold_freed = False
                resident = self._read_resident()
                fitting = self._fitting(resident, batch_size, padded_length, beside)
                if fitting < batch_size and self._running == 0 and self._kept_releasers:
                    # what the network keeps for its next batch is room too, unless a batch runs on it
                    for release_kept in self._kept_releasers:
                        release_kept()
                    self._trim_heap()
                    resident = self._read_resident()
                    fitting = self._fitting(resident, batch_size, padded_length, beside)
            if fitting == 0 and beside:
                self._wait_for_tracked()
                beside = self.beside_bytes()  # the reserve was kept for a thread that is done now
                resident = self._read_resident()
                fitting = self._fitting(resident, batch_size, padded_length, beside)
            if fitting == 0:
                self._release()
                resident = self._read_resident()
                fitting = self._fitting(resident, batch_size, padded_length, beside)
                if fitting == 0:
                    raise DoesNotFitError(self._refusal(resident, padded_length, beside))
            if fitting < batch_size:
                self.batches_cut += 1
                log.debug(
                    "guard: %d of %d sequences of %d tokens fit beside %.1f MiB resident",
                    fitting,
                    batch_size,
                    padded_length,
                    resident / MiB,
                )
            predicted = self.activations.predict(fitting, padded_length)
            admission = Admission(
                fitting,
                padded_length,
                predicted,
                resident,
                self._read_peak(),
                alone=self._running == 0,
                releases_before=self._releases,
                beside_bytes=beside,
            )
            self._running += 1
            self._running_bytes += predicted
            return admission

    def done(self, admission: Admission) -> None:
        """The admitted batch has run (or failed): stop counting it, and learn from its peak if it set a
        new high-water mark while it ran alone."""
        with self._lock:
            self._running -= 1
            self._running_bytes -= admission.predicted_bytes
            self._heap_may_hold_freed = True
            if not admission.alone:
                return
            returned = 0
            if self._refault_pending_measure and admission.releases_before == self._releases:
                # it ran alone after the last release, with what it needed faulted back in: learn how much that
                # was; what has not come back by now is not needed
                returned = max(0, self._read_file_resident() - self._file_resident_after_release)
                self.refault_bytes = max(self.refault_bytes, returned)
                self._refault_pending_measure = False
                self._refault_expected = 0
            peak = self._read_peak()
            if peak > admission.peak_before:
                # the file pages it faulted back in were kept free for it as the pending refault, and stay in the
                # resident set: no excess of its own
                added = peak - admission.resident_before - admission.predicted_bytes - admission.beside_bytes - returned
                self.largest_added_bytes = max(added, self.largest_added_bytes or added)
                if added > self.margin_bytes:
                    log.info(
                        "guard: a batch of %dx%d added %.1f MiB beyond its prediction; keeping that free from now on",
                        admission.batch_size,
                        admission.padded_length,
                        added / MiB,
                    )
                    self.margin_bytes = int(added)

    def _room(self, resident: int, beside: int) -> float:
        held_beside = beside + self._running_bytes + self.margin_bytes + self._pending_refault()
        return self.budget_bytes - resident - held_beside

    def _pending_refault(self) -> int:
        """What of the file pages the last release handed back may still fault back in: the expected working
        set, less what has come back, until a batch has run alone since (what that batch did not need is cold)."""
        if not self._refault_expected:
            return 0
        returned = max(0, self._read_file_resident() - self._file_resident_after_release)
        return max(0, self._refault_expected - returned)

    def _fitting(self, resident: int, batch_size: int, padded_length: int, beside: int) -> int:
        """The most of ``batch_size`` sequences of ``padded_length`` whose predicted bytes fit the room, with
        ``beside`` kept for other threads."""
        room = self._room(resident, beside)
        if self.activations.predict(1, padded_length) > room:
            return 0
        low, high = 1, batch_size  # predict grows with the batch: the largest size that fits, by bisection
        while low < high:
            middle = (low + high + 1) // 2
            if self.activations.predict(middle, padded_length) <= room:
                low = middle
            else:
                high = middle - 1
        return low

    def _release(self) -> None:
        """Free what the process keeps without needing it: glibc's freed heap, then the callers' own."""
        file_before = self._read_file_resident()
        for release in self._releasers:
            release()
        self._trim()
        self._file_resident_after_release = self._read_file_resident()
        taken = max(0, file_before - self._file_resident_after_release)
        self._refault_expected = min(taken, self.refault_bytes)
        self._refault_pending_measure = True
        self._releases += 1

    def _refusal(self, resident: int, padded_length: int, beside: int) -> str:
        one = self.activations.predict(1, padded_length)
        kept = {
            "for what else grows beside it": beside,
            "for the batches running": self._running_bytes,
            "as the margin of one batch": self.margin_bytes,
            "for the file pages a release took and the next batch faults back in": self._pending_refault(),
        }
        needed = resident + one + sum(kept.values())
        # 10% above what is held now: what drifted up to here may drift a little further
        works = math.ceil(1.1 * needed / MiB / 10) * 10
        terms = ", ".join(f"{size / MiB:,.0f} MiB {why}" for why, size in kept.items() if size >= MiB / 2) or "nothing"
        return (
            f"the memory budget ({self.budget_bytes / MiB:,.0f} MiB) has no room left for the next batch: "
            f"the process now holds {resident / MiB:,.0f} MiB (runtime, model, and what drifted in since it "
            f"was planned), one sequence of {padded_length} tokens needs {one / MiB:,.1f} MiB, and it keeps "
            f"{terms}: --memory-budget {works}MiB would work; {self.resume_hint}"
        )


def resident_guard(
    plan: MemoryPlan,
    device_type: str,
    release: Sequence[Callable[[], None]] = (),
    activation_scale: float = 1.0,
    release_kept: Sequence[Callable[[], None]] = (),
) -> ResidentSetGuard | None:
    """The guard for batches run under ``plan`` (activations ``activation_scale`` times the calibrated ones:
    an fp32 copy beside a bf16 model): on the CPU under Linux; None elsewhere (a GPU's allocator counts
    exactly and raises its own out-of-memory error; other systems have no ``/proc``). ``release``: what may be
    freed before a refusal; ``release_kept``: what the network keeps between batches, freed before a batch is cut."""
    if device_type != "cpu" or not sys.platform.startswith("linux"):
        return None
    return ResidentSetGuard(
        plan.budget_bytes,
        plan.activations.scaled(activation_scale),
        concurrent_bytes=plan.reserved_bytes,
        release=release,
        release_kept=release_kept,
        refault_bytes=plan.refault_bytes,
    )
