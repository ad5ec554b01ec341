"""Spike detectors: the lesson's trace, NaN safety, and the robust variant."""

from __future__ import annotations

import math

import numpy as np
import pytest

from floatguard import LossSpikeHandler, RobustSpikeDetector


class LessonLossSpikeHandler:
    """The lesson's class (reference for the trace)."""

    def __init__(self, threshold=5.0, patience=3):  # type: ignore[no-untyped-def]
        self.threshold = threshold
        self.patience = patience
        self.loss_history = []  # type: ignore[var-annotated]
        self.spike_count = 0

    def check_spike(self, loss):  # type: ignore[no-untyped-def]
        self.loss_history.append(loss)
        if len(self.loss_history) < 10:
            return False
        recent = self.loss_history[-10:]
        mean = np.mean(recent)
        std = np.std(recent)
        is_spike = loss > mean + self.threshold * std
        if is_spike:
            self.spike_count += 1
            if self.spike_count >= self.patience:
                return True
        else:
            self.spike_count = 0
        return False


def _losses() -> list[float]:
    rng = np.random.default_rng(0)
    xs = list(3.0 - 0.01 * np.arange(200) + rng.normal(0, 0.02, 200))
    for i in (40, 41, 42, 43, 100, 150, 151, 152):
        xs[i] += 0.3
    return [float(x) for x in xs]


@pytest.mark.parametrize(("threshold", "patience"), [(5.0, 3), (2.0, 1), (2.5, 2)])
def test_lesson_trace_reproduced(threshold: float, patience: int) -> None:
    lesson = LessonLossSpikeHandler(threshold, patience)
    ours = LossSpikeHandler(threshold, patience)
    trace_l = [lesson.check_spike(v) for v in _losses()]
    trace_o = [ours.check(v) for v in _losses()]
    assert trace_o == trace_l
    if (threshold, patience) == (2.0, 1):
        # The injected +0.3 jumps are found (so the comparison is not all-False).
        assert sum(trace_o) >= 4


def test_lesson_default_can_never_fire() -> None:
    """With the value inside its own 10-value window, its z-score is at most sqrt(9) = 3:
    the lesson's default threshold of 5 never detects anything. Ours documents this."""
    d = LossSpikeHandler(threshold=5.0, patience=1)
    assert not any(d.check(v) for v in [1.0] * 9 + [1e9])
    d2 = LossSpikeHandler(threshold=2.9, patience=1)
    assert [d2.check(v) for v in [1.0] * 9 + [1e9]][-1] is True


def test_nan_never_poisons_the_history() -> None:
    lesson = LessonLossSpikeHandler(2.0, 1)
    ours = LossSpikeHandler(2.0, 1)
    seq = [*_losses()[:30], math.nan, 2.7, 2.7, 9.0, *_losses()[30:60]]
    lt = [lesson.check_spike(v) for v in seq]
    ot = [ours.check(v) for v in seq]
    assert ot[30] is True  # NaN is a spike
    assert ot[33] is True and lt[33] is False  # while the NaN is in its window the lesson is blind
    assert all(math.isfinite(v) for v in ours.history)


def test_robust_detector() -> None:
    d = RobustSpikeDetector(window=20, z=6.0, warmup=5)
    flags = [d.check(v) for v in [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02]]
    assert not any(flags)
    assert d.check(5.0) is True
    assert 5.0 not in d.history  # a spike does not raise the bar
    assert d.check(1.01) is False
    assert d.check(math.nan) is True
    with pytest.raises(ValueError, match="warmup=2"):
        RobustSpikeDetector(warmup=2)
