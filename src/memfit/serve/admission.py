"""Admission: the queue tokens an admitted request holds, from tokenization until its answer is sent.

The admitted queue is bounded in tokens (``Limits.max_queue_tokens``); a request that would pass it is refused
with 429 and ``Retry-After`` (:class:`QueueFull`) rather than held in memory the budget has no room for.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from memfit.memory.model import trim_host_heap
from memfit.serve.metrics import ServerMetrics

# A request that held this many queue tokens (or tokenized this many characters) hands its freed heap
# back to the kernel when it is done, so the next large one does not stack on top of it.
TRIM_AFTER_TOKENS = 100_000


class QueueFull(Exception):
    """The admitted queue holds too many tokens: answer 429 with ``retry_after`` seconds."""

    def __init__(self, retry_after: int, message: str):
        super().__init__(message)
        self.retry_after = retry_after


class ClientGone(Exception):
    """The client disconnected while its request waited; its windows were dropped."""


class Admission:
    """Counts the queue tokens held by admitted requests, from tokenization until their answer is sent."""

    def __init__(self, capacity: int, metrics: ServerMetrics):
        self.capacity = capacity
        self.held = 0
        self._lock = threading.Lock()
        self._metrics = metrics

    def try_acquire(self, cost: int) -> bool:
        with self._lock:
            if self.held + cost > self.capacity:
                return False
            self.held += cost
            self._metrics.admitted_tokens.set(self.held)
            return True

    def release(self, cost: int) -> None:
        with self._lock:
            self.held -= cost
            self._metrics.admitted_tokens.set(self.held)


@dataclass
class Lease:
    """Queue tokens a request holds; released once its response has been sent."""

    admission: Admission
    cost: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission.release(self.cost)
            if self.cost >= TRIM_AFTER_TOKENS:
                trim_host_heap()
