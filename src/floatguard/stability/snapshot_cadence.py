"""The snapshot cadence: how many good steps apart snapshots are, fixed or from a cost budget."""

from __future__ import annotations

import math
import statistics
import time

__all__ = ["MAX_INTERVAL", "SnapshotCadence"]

# the longest interval a budget may set (a rollback never loses more good steps)
MAX_INTERVAL = 1000


class SnapshotCadence:
    """When the next snapshot is due, in good steps: every ``every`` of them, or, with
    a ``budget``, every ``interval`` where ``interval >= every`` is the smallest with
    ``copy_s / interval <= budget * step_s`` (copy and step times measured, the step's
    as the median of the last 32 intervals between :meth:`tick` calls), at most
    :data:`MAX_INTERVAL`."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.budget: float | None = None
        self.interval = every
        self.copy_s: float | None = None
        self._last: int | None = None  # good steps when the last snapshot was taken
        self._ticks: list[float] = []
        self._t: float | None = None

    def tick(self, now: float | None = None) -> None:
        t = time.perf_counter() if now is None else now
        if self._t is not None:
            self._ticks.append(t - self._t)
            del self._ticks[:-32]
        self._t = t

    def step_seconds(self) -> float | None:
        return statistics.median(self._ticks) if self._ticks else None

    def cost(self, seconds: float | None) -> None:
        """The last snapshot's copy took ``seconds`` (None: not known yet)."""
        if seconds is not None:
            self.copy_s = seconds
        step_s = self.step_seconds()
        if self.budget is None or self.copy_s is None or not step_s:
            self.interval = self.every
            return
        need = math.ceil(self.copy_s / (self.budget * step_s))
        self.interval = min(MAX_INTERVAL, max(self.every, need))

    def taken(self, good_steps: int) -> None:
        self._last = good_steps

    def due(self, good_steps: int) -> bool:
        if good_steps <= 0:
            return False
        if self.budget is None or self._last is None or good_steps < self._last:
            return good_steps % self.every == 0
        return good_steps - self._last >= self.interval
