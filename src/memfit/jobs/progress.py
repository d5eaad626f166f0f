"""The progress bar of a job: texts (or examples), tokens per second and an ETA, on a terminal only."""

from __future__ import annotations

import sys
import time
from typing import Sequence

from tqdm.auto import tqdm

from memfit.data.chunking import Window

# texts advance by window shares; show whole numbers rather than tqdm's "12.5/300"
_BAR_FORMAT = "{l_bar}{bar}| {n:.0f}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


class Progress:
    """A progress bar on a terminal (texts, tokens/s, ETA when the total is known); silent in pipes."""

    def __init__(self, total: int | None, enabled: bool | None, unit: str = "text"):
        self.bar = tqdm(
            total=total,
            unit=unit,
            disable=not self.shown(enabled),
            dynamic_ncols=True,
            smoothing=0.1,
            file=sys.stderr,
            bar_format=None if total is None else _BAR_FORMAT,
        )
        self.tokens = 0
        self.started = time.perf_counter()

    @staticmethod
    def shown(enabled: bool | None) -> bool:
        """``enabled=None`` means: only when stderr is a terminal."""
        return sys.stderr.isatty() if enabled is None else enabled

    def add_batch(self, windows: Sequence[Window], windows_per_item: Sequence[int]) -> None:
        """Advance by the finished windows: each counts as its share of its text, so the bar moves
        with every batch rather than once per block of thousands of texts."""
        if self.bar.disable:
            return
        self.tokens += sum(len(w) for w in windows)
        elapsed = time.perf_counter() - self.started
        if elapsed > 0:
            self.bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tok/s", refresh=False)
        self.bar.update(sum(1.0 / windows_per_item[w.item] for w in windows))

    def add_texts(self, count: int) -> None:
        """For jobs that count whole texts (training)."""
        self.bar.update(count)

    def close(self) -> None:
        self.bar.close()
