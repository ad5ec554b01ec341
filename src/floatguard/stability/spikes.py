"""Spike detectors for the loss and the gradient norm (host floats, after the guard's one read).

The lessons referred to here: docs/lessons.md.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

__all__ = ["LossSpikeHandler", "RobustSpikeDetector"]


class LossSpikeHandler:
    """The lessons' detector: a value is a spike when it exceeds ``mean + threshold * std``
    of the last ``window`` values (the current one included, as the lesson computes it);
    ``check`` returns True after ``patience`` consecutive spikes.

    Because the current value is part of its own window, its z-score is at most
    ``sqrt(window - 1)`` (3 for a window of 10): the lesson's default threshold of
    5 can never fire. The defaults are kept for fidelity; use a threshold below
    ``sqrt(window - 1)`` or :class:`RobustSpikeDetector`.

    Same trace as the lesson's class on finite values; unlike it, a non-finite value
    counts as a spike and never enters the history (the lesson's ``np.mean`` would be
    NaN from then on and no spike would ever be seen again).
    """

    def __init__(self, threshold: float = 5.0, patience: int = 3, window: int = 10) -> None:
        if not threshold > 0:
            raise ValueError(f"threshold={threshold!r} must be > 0")
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience={patience!r} must be an int >= 1")
        if not isinstance(window, int) or window < 2:
            raise ValueError(f"window={window!r} must be an int >= 2")
        self.threshold, self.patience, self.window = threshold, patience, window
        self.history: list[float] = []
        self.spike_count = 0
        self.last_is_spike = False

    def is_spike(self, value: float) -> bool:
        """Would ``value`` be a spike against the current history? (No state change.)"""
        if not math.isfinite(value):
            return True
        recent = ([*self.history, value])[-self.window :]
        if len(self.history) + 1 < self.window:
            return False
        mean = sum(recent) / len(recent)
        std = math.sqrt(sum((v - mean) ** 2 for v in recent) / len(recent))
        return value > mean + self.threshold * std

    def check(self, value: float) -> bool:
        """Record ``value``; True when ``patience`` consecutive spikes call for action."""
        spike = self.is_spike(value)
        if math.isfinite(value):
            self.history.append(value)
            del self.history[: -self.window * 4]
        self.last_is_spike = spike
        if spike:
            self.spike_count += 1
            return self.spike_count >= self.patience
        self.spike_count = 0
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "spike_count": self.spike_count}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.history = [float(v) for v in sd["history"]]
        self.spike_count = int(sd["spike_count"])


class RobustSpikeDetector:
    """Median / MAD z-score over a window (as axolotl and OLMo-core use): a value is a
    spike when ``(value - median) / (1.4826 * MAD) > z``. Spikes and non-finite values
    stay out of the window, so one outlier cannot raise the bar for the next."""

    def __init__(self, window: int = 50, z: float = 6.0, warmup: int = 10) -> None:
        if not isinstance(window, int) or window < 3:
            raise ValueError(f"window={window!r} must be an int >= 3")
        if not z > 0:
            raise ValueError(f"z={z!r} must be > 0")
        if not isinstance(warmup, int) or not 3 <= warmup <= window:
            raise ValueError(f"warmup={warmup!r} must be an int in [3, window]")
        self.window, self.z, self.warmup = window, z, warmup
        self.history: list[float] = []
        self._cached: tuple[list[float], float, float] | None = None

    def _median_and_scale(self) -> tuple[float, float]:
        """Median and 1.4826 MAD of the window, computed once per window content."""
        if self._cached is not None and self._cached[0] == self.history:
            return self._cached[1], self._cached[2]
        med = statistics.median(self.history)
        scale = 1.4826 * statistics.median(abs(v - med) for v in self.history)
        self._cached = (list(self.history), med, scale)
        return med, scale

    def score(self, value: float) -> float:
        """The robust z-score of ``value`` (0 during warmup, inf for non-finite)."""
        if not math.isfinite(value):
            return math.inf
        if len(self.history) < self.warmup:
            return 0.0
        med, scale = self._median_and_scale()
        if scale == 0:
            return 0.0 if value <= med else math.inf
        return (value - med) / scale

    def check(self, value: float) -> bool:
        """Record ``value``; True if it is a spike (then it is not added to the window)."""
        spike = self.score(value) > self.z
        if not spike:
            self.history.append(value)
            del self.history[: -self.window]
        return spike

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.history = [float(v) for v in sd["history"]]
