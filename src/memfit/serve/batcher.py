"""Dynamic batching for ``memfit serve``: windows from many requests, cut into batches by the memory plan.

A request's texts arrive here already tokenized and cut into windows (``chunking.py``), as one
:class:`Ticket`. Threads share the model:

- the **scheduler** keeps the queued windows in arrival order, per *lane* (windows that can share a
  batch: the same engine head). It looks at most ``lookahead`` windows ahead, cuts them with the planner's
  core (:func:`best_run`: padded cost under the :class:`~memfit.engine.batches.AdaptiveBudget`'s
  :class:`~memfit.memory.planner.BatchBudget`, sorted by length) and takes the batch with the most real
  tokens, or, once the oldest window has waited ``age_cap`` seconds, a batch holding every window of its
  request (:func:`whole_request_run`), so no request starves and an overdue one is answered by one batch.
  While a batch runs it prepares the next one as soon as a full batch is queued; an idle model waits at most
  ``max_wait`` for company.
- the **workers** (``workers`` threads) each run one batch at a time through
  :func:`~memfit.engine.batches.run_windows`, memfit's one out-of-memory guard, and hand every window's result
  back to its ticket. Batches running at once share the token budget: each is cut under
  ``1/workers`` of it, so together they stay within the memory plan. On the CPU, several workers of
  one thread each keep every core busy without an OpenMP team (whose barriers stall when another
  process or the event loop preempts one member); when fewer windows are queued than a full batch,
  they are split across the idle workers.

Windows of a cancelled ticket (its client went away) are dropped wherever they are still queued. The
queue itself is not bounded here: admission (``admission.py``) bounds the tokens a server holds.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence


from memfit.data.chunking import Window
from memfit.defaults import DEFAULT_LOOKAHEAD
from memfit.engine.batches import AdaptiveBudget, Engine, Head, run_windows
from memfit.errors import ConfigError
from memfit.memory.planner import BatchBudget, padded_length
from memfit.memory.device import Device

log = logging.getLogger("memfit")


@dataclass(frozen=True, slots=True)
class Lane:
    """Windows that may share a batch: one engine head (pooling, token rows or logits)."""

    name: str
    head: Head


@dataclass(eq=False)
class Ticket:
    """One request's windows; ``future`` resolves to one engine result per window, in window order."""

    lane: Lane
    windows: Sequence[Window]
    future: Future = field(default_factory=Future)
    remaining: int = 0
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.outputs: list = [None] * len(self.windows)
        self.remaining = len(self.windows)


@dataclass(eq=False, slots=True)
class _Queued:
    ticket: Ticket
    index: int  # window number within the ticket
    length: int
    arrived: float


@dataclass(frozen=True, slots=True)
class BatchingOptions:
    """How the scheduler trades latency for batch size (seconds and windows)."""

    max_wait: float = 0.001  # an idle model waits this long for more windows before running a partial batch
    age_cap: float = 0.1  # a window this old rides in the very next batch
    lookahead: int = DEFAULT_LOOKAHEAD  # windows considered (in arrival order) when cutting a batch
    workers: int | None = None  # batches run at once (threads); None: the server picks (runtime.model_workers)

    def __post_init__(self) -> None:
        if self.lookahead < 1:
            raise ConfigError(f"--lookahead must be at least 1, got {self.lookahead}")


def best_run(lengths: Sequence[int], budget: BatchBudget, anchor: int | None = None) -> list[int]:
    """The batch to run next: of the runs of neighbours in length order that fit ``budget`` (padded
    cost), the one with the most real tokens, holding ``anchor`` (an index into ``lengths``) if given.

    Every run of the length-sorted look-ahead is a candidate, not only the pieces of one greedy
    partition: around an overdue window the batch takes its nearest lengths, below it first (they pad
    to its width for free). Simulated on the movie-review sentences with 128 windows queued and 1,024
    tokens per batch: 86% of the padded tokens are real, against 82% for the greedy partition's piece.
    A window over the budget on its own still gets a batch (the engine's OOM guard has the last word)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    sorted_lengths = [lengths[i] for i in order]
    prefix = list(itertools.accumulate(sorted_lengths, initial=0))
    first = order.index(anchor) if anchor is not None else 0
    best = (-1, first, first)
    for hi in range(first, len(order)):  # hi: the longest window of the run, which sets its width
        width = padded_length(sorted_lengths[hi])
        lo = hi - min(hi + 1, max(1, budget.capacity(width))) + 1
        if anchor is not None and lo > first:
            break  # every longer run leaves the anchor out
        real = prefix[hi + 1] - prefix[lo]
        if real > best[0]:
            best = (real, lo, hi)
    _, lo, hi = best
    return [order[k] for k in range(lo, hi + 1)]


def whole_request_run(lengths: Sequence[int], request: Sequence[int], budget: BatchBudget) -> list[int]:
    """The batch for an overdue request: all of its windows (``request``, indices into ``lengths``)
    when they fit one batch, topped up with the longest other windows that pad to no more than its
    widest; else :func:`best_run` around its first window.

    A request is answered when its last window is, so a batch that holds only its oldest window (its
    other windows, of other lengths, waiting for batches of their own neighbours) leaves it waiting for
    several batches after it became the oldest. Taking its windows together answers it in one."""
    width = padded_length(max(lengths[i] for i in request))
    size = max(1, budget.capacity(width))
    if len(request) > size:
        return best_run(lengths, budget, anchor=request[0])
    own = set(request)
    others = sorted(
        (i for i in range(len(lengths)) if i not in own and padded_length(lengths[i]) <= width),
        key=lambda i: (-lengths[i], i),
    )
    return list(request) + others[: size - len(request)]


class BatchObserver:
    """What the batcher reports (metrics.py implements it); the default records nothing."""

    def queued(self, windows: int, tokens: int) -> None: ...

    def batch(self, windows: int, padded_tokens: int, real_tokens: int, seconds: float) -> None: ...

    def dropped(self, windows: int) -> None: ...


class Batcher:
    """Runs the windows of every submitted ticket on one model, in batches that fit the budget."""

    def __init__(
        self,
        make_engine: Callable[[Head], Engine],
        device: Device,
        budget: AdaptiveBudget,
        options: BatchingOptions = BatchingOptions(),
        observer: BatchObserver | None = None,
    ):
        self.make_engine, self.device, self.budget = make_engine, device, budget
        self.options = options
        self.observer = observer or BatchObserver()
        self._lanes: dict[str, deque[_Queued]] = {}
        self._engines: dict[str, Engine] = {}
        self._cond = threading.Condition()
        self._queued_tokens = 0
        self.workers = max(1, options.workers or 1)
        self._in_flight = 0  # batches cut and not yet finished (at most one per worker running, one waiting)
        self._stopping = False
        self._handoff: queue.Queue[tuple[Lane, list[_Queued]] | None] = queue.Queue(maxsize=1)
        self._threads = [threading.Thread(target=self._schedule, name="memfit-scheduler", daemon=True)]
        self._threads += [
            threading.Thread(target=self._execute, name=f"memfit-worker-{i}", daemon=True) for i in range(self.workers)
        ]
        self.tokens_per_second = 0.0  # smoothed model throughput, for Retry-After estimates
        self._warmup: tuple[Lane, Sequence[Window]] | None = None
        self._warmed = threading.Barrier(self.workers + 1)  # every worker, and start() waiting for them
        self._warmup_errors: list[Exception] = []

    # -- public -----------------------------------------------------------------------------------

    def start(self, warmup: tuple[Lane, Sequence[Window]] | None = None) -> None:
        """Start the scheduler and the workers. With ``warmup``, each worker first runs those windows as a batch
        of its own, and this returns once every worker has: a thread's first batch pays for its lazy set-up
        (torch's per-thread state, oneDNN's kernels for its shapes, a compiled graph's infer request), which no
        request should wait for. A warm-up that fails stops the batcher and raises its error."""
        self._warmup = warmup
        if warmup is not None:
            self._open_lane(warmup[0])
        for thread in self._threads:
            thread.start()
        if warmup is None:
            return
        self._warmed.wait()
        if self._warmup_errors:
            self.stop()
            raise self._warmup_errors[0]

    def stop(self) -> None:
        """Finish what is queued, then end both threads."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()

    def submit(self, lane: Lane, windows: Sequence[Window]) -> Ticket:
        """Queue ``windows``; the ticket's future gets their results (or the error that stopped them)."""
        ticket = Ticket(lane, windows)
        if not windows:
            ticket.future.set_result([])
            return ticket
        now = time.monotonic()
        with self._cond:
            if self._stopping:
                raise RuntimeError("the batcher is stopping")
            self._open_lane(lane)
            self._lanes[lane.name].extend(_Queued(ticket, i, len(w), now) for i, w in enumerate(windows))
            self._queued_tokens += sum(len(w) for w in windows)
            self._report_queue()
            self._cond.notify_all()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Drop the ticket's windows that have not run yet (its client disconnected)."""
        with self._cond:
            ticket.cancelled = True
            self._cond.notify_all()
        ticket.future.cancel()

    def _open_lane(self, lane: Lane) -> None:
        """The lane's queue and engine, made on its first use."""
        if lane.name not in self._engines:
            self._engines[lane.name] = self.make_engine(lane.head)
            self._lanes[lane.name] = deque()

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    # -- scheduler --------------------------------------------------------------------------------

    def _schedule(self) -> None:
        while True:
            with self._cond:
                cut = None
                while cut is None:
                    self._drop_cancelled_heads()
                    lane = self._oldest_lane()
                    if lane is None:
                        if self._stopping:
                            for _ in range(self.workers):
                                self._handoff.put(None)
                            return
                        self._cond.wait()
                        continue
                    delay = self._delay(lane)
                    if delay > 0:
                        self._cond.wait(delay)
                        continue
                    cut = self._cut(lane)
                self._in_flight += 1
            self._handoff.put(cut)  # waits while the previous cut is still waiting for the executor

    def _oldest_lane(self) -> str | None:
        heads = [(q[0].arrived, name) for name, q in self._lanes.items() if q]
        return min(heads)[1] if heads else None

    def _share(self) -> BatchBudget:
        """One worker's part of the token budget (the batches running at once share it)."""
        budget = self.budget.current
        return budget if self.workers == 1 else budget.scaled(1 / self.workers)

    def _full(self, waiting: deque[_Queued]) -> bool:
        share = self._share()
        return len(waiting) >= share.max_batch_seqs or self._lane_tokens(waiting) >= share.max_batch_tokens

    def _delay(self, lane: str) -> float:
        """0 when a batch should be cut now, else how long to wait (a wake-up may come earlier)."""
        waiting = self._lanes[lane]
        if self._full(waiting) or self._stopping:
            # a worker is free, or the next batch is prepared while every worker runs one
            return 0.0 if self._in_flight <= self.workers else 0.05
        if self._in_flight >= self.workers:
            return 0.05  # every worker is busy: keep collecting; a worker wakes us when it is done
        age = time.monotonic() - waiting[0].arrived
        return max(0.0, self.options.max_wait - age)

    def _lane_tokens(self, waiting: deque[_Queued], cap: int | None = None) -> int:
        """Padded tokens of the look-ahead, capped once a batch is certainly full."""
        total = 0
        cap = self._share().max_batch_tokens if cap is None else cap
        for item in itertools.islice(waiting, self.options.lookahead):
            total += padded_length(item.length)
            if total >= cap:
                break
        return total

    def _cut(self, lane: str) -> tuple[Lane, list[_Queued]]:
        """Take the next batch from ``lane``'s look-ahead; the rest goes back in arrival order.

        Less than a full batch queued and several workers idle: the batch takes only its part of what
        is queued, so the idle workers share it (one core each) instead of one running it all."""
        waiting = self._lanes[lane]
        budget = self._share()
        idle = self.workers - self._in_flight
        if idle > 1 and not self._full(waiting):
            part = -(-self._lane_tokens(waiting, cap=budget.max_batch_tokens) // idle)
            budget = BatchBudget(max(1, part), budget.max_batch_seqs, budget.max_attention_cells)
        window: list[_Queued] = []
        while waiting and len(window) < self.options.lookahead:
            item = waiting.popleft()
            if item.ticket.cancelled:
                self._forget([item])
            else:
                window.append(item)
        lengths = [item.length for item in window]
        if time.monotonic() - window[0].arrived >= self.options.age_cap:
            oldest = window[0].ticket
            chosen = whole_request_run(lengths, [i for i, item in enumerate(window) if item.ticket is oldest], budget)
        else:
            chosen = best_run(lengths, budget)
        taken = set(chosen)
        waiting.extendleft(reversed([item for i, item in enumerate(window) if i not in taken]))
        batch = [window[i] for i in chosen]
        self._queued_tokens -= sum(item.length for item in batch)
        self._report_queue()
        return batch[0].ticket.lane, batch

    def _drop_cancelled_heads(self) -> None:
        for waiting in self._lanes.values():
            dropped = []
            while waiting and waiting[0].ticket.cancelled:
                dropped.append(waiting.popleft())
            if dropped:
                self._forget(dropped)

    def _forget(self, items: list[_Queued]) -> None:
        self._queued_tokens -= sum(item.length for item in items)
        self.observer.dropped(len(items))
        self._report_queue()

    def _report_queue(self) -> None:
        self.observer.queued(sum(len(q) for q in self._lanes.values()), self._queued_tokens)

    # -- executor ---------------------------------------------------------------------------------

    def _warm_up(self) -> None:
        """Run the warm-up windows once on this worker's thread (not counted in the metrics)."""
        lane, windows = self._warmup
        try:
            run_windows(self._engines[lane.name], list(windows), self.budget, self.device)
        except Exception as exc:  # noqa: BLE001 - handed to start(), which raises it
            self._warmup_errors.append(exc)
        finally:
            self._warmed.wait()

    def _execute(self) -> None:
        if self._warmup is not None:
            self._warm_up()
        while (cut := self._handoff.get()) is not None:
            lane, batch = cut
            live = [item for item in batch if not item.ticket.cancelled]
            try:
                if live:
                    self._run(lane, live)
                if len(live) < len(batch):
                    self.observer.dropped(len(batch) - len(live))
            finally:
                with self._cond:
                    self._in_flight -= 1
                    self._cond.notify_all()

    def _run(self, lane: Lane, batch: list[_Queued]) -> None:
        windows = [item.ticket.windows[item.index] for item in batch]
        started = time.perf_counter()
        try:
            outputs = run_windows(self._engines[lane.name], windows, self.budget, self.device)
        except Exception as exc:  # noqa: BLE001 - the requests in this batch fail; the server lives on
            log.error("a batch of %d windows failed: %s", len(windows), exc)
            for ticket in {id(item.ticket): item.ticket for item in batch}.values():
                if not ticket.future.done():
                    ticket.future.set_exception(exc)
            return
        seconds = time.perf_counter() - started
        real = sum(item.length for item in batch)
        self.observer.batch(len(batch), len(batch) * padded_length(max(item.length for item in batch)), real, seconds)
        rate = self.workers * real / max(seconds, 1e-6)  # the workers run side by side
        self.tokens_per_second = rate if not self.tokens_per_second else 0.8 * self.tokens_per_second + 0.2 * rate
        for item, output in zip(batch, outputs):
            ticket = item.ticket
            ticket.outputs[item.index] = output
            ticket.remaining -= 1
            if ticket.remaining == 0 and not ticket.future.done():
                ticket.future.set_result(ticket.outputs)
