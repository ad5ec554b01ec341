"""Spike detectors for the loss and the gradient norm (host floats, after the guard's one read).

Both detectors take plain Python floats (the guard hands them the values of its one
host read); nothing here touches a tensor. Each has a pure :meth:`is_spike` (what the
value is, against the current window; no state change) and :meth:`check` (the same
decision, then the value is recorded): a loop may ask first and record only the
steps it applies.

The lessons referred to here: docs/lessons.md.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["LossSpikeHandler", "RobustSpikeDetector"]


def _real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_min_rel(min_rel: object) -> None:
    if not _real(min_rel) or not 0 <= min_rel < math.inf:  # type: ignore[operator]
        raise ValueError(
            f"min_rel={min_rel!r} must be a finite number >= 0: the jump over the window's "
            f"level a spike needs, as a fraction (0.5: 50% above it; 0 turns the test off)"
        )


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

    ``min_rel`` (keyword, default 0: off, the lesson's trace) adds
    :class:`RobustSpikeDetector`'s material-jump test: a finite spike must also exceed
    the mean of the ``window - 1`` values before it by ``min_rel`` times that mean's
    magnitude (a smooth curve's tiny std otherwise makes a 2% bump a spike).
    """

    def __init__(
        self, threshold: float = 5.0, patience: int = 3, window: int = 10, *, min_rel: float = 0.0
    ) -> None:
        if not threshold > 0:
            raise ValueError(f"threshold={threshold!r} must be > 0")
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience={patience!r} must be an int >= 1")
        if not isinstance(window, int) or window < 2:
            raise ValueError(f"window={window!r} must be an int >= 2")
        _check_min_rel(min_rel)
        self.threshold, self.patience, self.window = threshold, patience, window
        self.min_rel = float(min_rel)
        self.history: list[float] = []
        self.spike_count = 0
        self.last_is_spike = False

    def is_spike(self, value: float) -> bool:
        """Would ``value`` be a spike against the current history? (No state change.)

        Non-finite: always. Finite: only once ``window - 1`` values are recorded, when
        ``value > mean + threshold * std`` over the window ending with ``value`` (and,
        with ``min_rel > 0``, ``value - prior_mean > min_rel * |prior_mean|``)."""
        if not math.isfinite(value):
            return True
        recent = ([*self.history, value])[-self.window :]
        if len(self.history) + 1 < self.window:
            return False
        mean = sum(recent) / len(recent)
        std = math.sqrt(sum((v - mean) ** 2 for v in recent) / len(recent))
        if not value > mean + self.threshold * std:
            return False
        if self.min_rel == 0:
            return True
        prior = recent[:-1]
        level = sum(prior) / len(prior)
        return value - level > self.min_rel * abs(level)

    def would_trigger(self, value: float) -> bool:
        """What :meth:`check` would return for ``value`` (a spike that completes
        ``patience`` consecutive ones), without recording it."""
        return self.is_spike(value) and self.spike_count + 1 >= self.patience

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


def _median(xs: list[float]) -> float:
    """``statistics.median`` of a short non-empty list, without its overhead."""
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2


def _deviation(basis: list[float], i: int, k: int) -> float:
    """``basis[i]`` minus the median of its ``k`` neighbours in ``basis`` (``k // 2``
    either side; fewer at the ends)."""
    h = k // 2
    return basis[i] - _median(basis[max(0, i - h) : i] + basis[i + 1 : i + h + 1])


class RobustSpikeDetector:
    """A spike is a value both statistically and materially out of line with the
    recently recorded ones.

    A non-finite value is always a spike. A finite one is judged on the *basis*: the
    last ``window`` nonzero recorded values (see "zeros" below), once it holds
    ``warmup`` of them (before that, no finite value is a spike). Three numbers
    describe it: the ``level`` a new value is compared with (the basis' median, or
    lower: see "trends"), each basis value's *deviation* from its neighbours (the
    median of the ``neighbours`` values around it), the spread ``s = max(1.4826 *
    MAD, min_spread)`` of the deviations, and ``rise``: how far the largest deviation
    before the latest one at or below their median lies above that median (the
    highest rise the stream has come back from; 0 if none). A finite ``value`` is a
    spike when it clears all three bars (:meth:`threshold` is the highest):

    1. the robust z-score, as axolotl and OLMo-core use it: ``value - level > z * s``;
    2. a material jump over the level: ``value - level > min_rel * |level|``;
    3. beyond the range the window has shown: ``value - level > (1 + range_rel) * rise``.

    With ``neighbours=0`` the level is the basis' median and the deviations are the
    values themselves: the rule before trends were accounted for (``level = med``,
    ``rise = hi - med`` with ``hi`` the largest value before the latest return to
    the median; bar 3 reads ``value - hi > range_rel * (hi - med)``).

    Trends (``neighbours``, default 8). Over a window of 50 steps early in training
    the loss falls several-fold. Judged against the whole window, a falling stream
    hides a bad batch three ways: the median lies far above where the loss is now,
    the MAD measures the fall rather than the noise, and the window's first values
    look like a rise the stream "came back from". A shuffled-labels batch at 8x its
    neighbours at step 30 of a classifier, or 5x at step 80, was applied without an
    event (issue 36, item 5). So a value is compared with where the stream is now,
    ``level = min(median, median of the last neighbours values)`` (only a falling
    stream moves it: under a rising one, a divergence or a gradient norm growing
    early in training, the window's median stays the level, as before, so a climb is
    caught once past ``1 + min_rel`` of it and cannot lower its own bar), and the
    spread and the range are measured on deviations from each value's own
    neighbourhood, which a trend does not inflate. On a stationary window both
    change little (a neighbourhood median is a little noisier than the window's);
    ``benchmarks/spike_false_rate.py`` measures the clean-run rate before and after.

    Why not the z-score alone: it measures a value against the window's typical
    deviation, and ordinary windows can have a tiny one.

    - A smooth curve (large batches, gradient accumulation) has a MAD of a fraction
      of a percent: a batch 2% harder than its neighbours scores z > 6 and was
      skipped. Bar 2 asks for a jump that matters: with ``min_rel=0.5`` nothing
      within 1.5x the running median is a spike. Such a step cannot wreck the run (its
      gradient is of ordinary size, and the clipper bounds it anyway) while skipping
      it throws a good batch away; a blow-up (2x, 10x, a divergence that keeps
      climbing) clears it. 0.5 is far above the noise of a smooth loss (a few
      percent) and below the jump of a real loss spike; lower it to catch smaller
      jumps. For the gradient norm, which doubles in clean runs (leaving a plateau,
      early training) and which the clipper already bounds, use ``min_rel=2``: see
      ``benchmarks/spike_false_rate.py`` (at 0.5 the demo GPT's clean runs have
      gradient-norm jumps of 1.8-2.3x flagged; at 2, none, and 10x probes are still
      caught).
    - A heavy-tailed stream (a converged regression's gradient norm; a hinge loss,
      whose batch value is set by a few margin violators and ranges over decades)
      reaches 4-13x its median in clean runs. Bar 3 measures the tail empirically: a value
      the stream has recently risen to and come back from is ordinary for it. With
      ``range_rel=1.5`` a spike must rise 2.5x as far above the median as that; on a
      Gaussian window of 50 (max about 2.25 sigma above the median) this is about
      ``med + 5.6 sigma``, next to bar 1's 6 sigma, so bar 1 still decides for
      well-behaved streams and bar 3 for heavy tails. (0.5 left false spikes on the
      benchmark's hinge classifier and MLP; 1.0 about 1 in 700 informative batches of
      a simulated hinge loss, 1.5 about 1 in 2500.) A run of rising values that has
      not come back down (a divergence) does not count toward ``rise``, so it cannot
      raise its own bar.

    Zeros. A hinge or margin loss is exactly 0 on most batches (and so is its
    gradient norm): the window's median and MAD were 0 and every informative batch had
    an infinite z-score (54 of 56 were skipped: the batches the model learns from). A
    zero is a batch with nothing to learn; it says nothing about how large the signal
    is when there is something, so zeros are kept in the history (the ones among the
    last ``window`` nonzero values, at most ``4 * window`` entries in all) but are not
    in the basis, and do not push nonzero values out of it: the basis of a stream
    that is mostly zeros still holds ``window`` informative values to estimate its
    tail from. With fewer than ``warmup`` nonzero values there is no scale: nothing
    finite is a spike (the first informative batches after a run of zeros are learned
    from), unless ``min_spread`` (an absolute floor on the spread, in the signal's
    units) gives one: then the basis is the last ``window`` values, zeros included,
    and a value above ``z * min_spread`` (and bar 3) is a spike. Generally, when all
    three bars equal the level (a constant window with ``min_rel=0`` and no
    ``min_spread``), only a non-finite value is a spike. A constant nonzero window (a
    bf16 loss sitting on one representable value) has a scale, ``|level|``: bar 2
    decides.

    Spikes and non-finite values stay out of the window, so one outlier cannot raise
    the bar for the next. The knobs are configuration, not state: ``state_dict`` is
    the window alone, as before ``min_rel``, ``range_rel``, ``min_spread`` and
    ``neighbours`` existed.

    Limits: bar 2 is relative to ``|level|``, so for a signal around 0 that goes both
    ways it adds nothing (bars 1 and 3 decide). ``rise`` is one sample: a large value
    that was not a spike (or one recorded during warmup, which is not judged) raises
    bar 3 while it stays in the basis. A stream with a heavier tail than its window
    has shown can still give a rare false spike (the simulated hinge loss above, 0.7-1.6%
    of samples inside the margin: about 1 in 2500 informative batches). No rule on
    a window's values alone can tell a stream's own 2x jumps from a fault's: these
    defaults keep ordinary streams quiet at the price of missing jumps below 1.5x
    the level (bar 2) or within the range the stream has shown (bar 3). A value that
    starts a level shift (a batch after which the loss stays 2x higher) is a spike
    when it comes; the ones after it, once the neighbourhood has moved, are not.
    """

    def __init__(
        self,
        window: int = 50,
        z: float = 6.0,
        warmup: int = 10,
        *,
        min_rel: float = 0.5,
        range_rel: float = 1.5,
        min_spread: float = 0.0,
        neighbours: int = 8,
    ) -> None:
        if not isinstance(window, int) or window < 3:
            raise ValueError(f"window={window!r} must be an int >= 3")
        if not z > 0:
            raise ValueError(f"z={z!r} must be > 0")
        if not isinstance(warmup, int) or not 3 <= warmup <= window:
            raise ValueError(f"warmup={warmup!r} must be an int in [3, window]")
        _check_min_rel(min_rel)
        if not _real(range_rel) or not 0 <= range_rel < math.inf:
            raise ValueError(
                f"range_rel={range_rel!r} must be a finite number >= 0: how far beyond the "
                f"rise the window has come back from a spike must go, as a fraction of it "
                f"(1.5: 2.5x that rise above the median; 0: just above it)"
            )
        if not _real(min_spread) or not 0 <= min_spread < math.inf:
            raise ValueError(
                f"min_spread={min_spread!r} must be a finite number >= 0: an absolute floor "
                f"on the window's spread, in the signal's units (0 for none)"
            )
        if isinstance(neighbours, bool) or not isinstance(neighbours, int) or neighbours < 0:
            raise ValueError(
                f"neighbours={neighbours!r} must be an int >= 0: how many recorded values "
                f"before a value make its neighbourhood (0: judge against the whole window)"
            )
        self.window, self.z, self.warmup = window, z, warmup
        self.neighbours = neighbours
        self.min_rel, self.range_rel = float(min_rel), float(range_rel)
        self.min_spread = float(min_spread)
        self.history: list[float] = []
        self._appended = 0  # values recorded so far: with the list's identity, the cache key
        self._cached: tuple[tuple[int, int, int], tuple[float, float, float] | None] | None = None
        # Deviations that can no longer change (a value with all its neighbours in the
        # basis), by the value's serial number among the nonzero values recorded: one
        # new median per step instead of one per basis value.
        self._nonzero = 0
        self._devs: dict[int, float] = {}

    def _stats(self) -> tuple[float, float, float] | None:
        """``(level, spread, rise)`` of the basis (see the class), or None when the
        window cannot judge a finite value; computed once per window content (the guard
        asks :meth:`is_spike` before it records)."""
        key = (id(self.history), len(self.history), self._appended)
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        stats: tuple[float, float, float] | None = None
        basis = [v for v in self.history if v != 0][-self.window :]
        nonzero = len(basis)
        if len(basis) < self.warmup and self.min_spread > 0:
            basis = self.history[-self.window :]
        if len(basis) >= self.warmup:
            level, dev = self._level_and_deviations(basis, zeros=len(basis) > nonzero)
            center = _median(dev)
            mad = _median([abs(d - center) for d in dev])
            # The rises the stream came back from: the deviations before its latest
            # return to their median (at least half are at or below it, so there is one).
            back = len(dev) - 1
            while dev[back] > center:
                back -= 1
            rise = max([center, *dev[:back]]) - center
            stats = (level, max(1.4826 * mad, self.min_spread), rise)
        self._cached = (key, stats)
        return stats

    def _level_and_deviations(
        self, basis: list[float], *, zeros: bool
    ) -> tuple[float, list[float]]:
        """The level and the deviations of the class' rule (``neighbours=0``, or a basis
        of at most ``neighbours`` values: the median and the values themselves).
        ``zeros``: the basis is ``min_spread``'s, zeros included."""
        k, n = self.neighbours, len(basis)
        med = _median(basis)
        if k == 0 or n <= k:
            return med, basis
        level = min(med, _median(basis[-k:]))
        h = k // 2
        if zeros:  # min_spread's basis of zeros and values: no serial numbers
            return level, [_deviation(basis, i, k) for i in range(n)]
        first = self._nonzero - n  # the serial number of basis[0]
        while self._devs and next(iter(self._devs)) < first + h:
            del self._devs[next(iter(self._devs))]  # now at the basis' start, or gone
        dev = []
        for i in range(n):
            if h <= i < n - h:  # all its neighbours in the basis: final
                d = self._devs.get(first + i)
                if d is None:
                    d = self._devs[first + i] = _deviation(basis, i, k)
            else:
                d = _deviation(basis, i, k)
            dev.append(d)
        return level, dev

    def threshold(self) -> float:
        """The bar a finite value must exceed to be a spike now: the highest of the
        three (see the class); ``inf`` while the window cannot judge or has no scale."""
        stats = self._stats()
        if stats is None:
            return math.inf
        level, spread, rise = stats
        bar = level + max(self.z * spread, self.min_rel * abs(level), (1 + self.range_rel) * rise)
        return bar if bar > level else math.inf

    def is_spike(self, value: float) -> bool:
        """Is ``value`` a spike against the current window? No state change: the one
        decision :meth:`check` records (a loop may ask first and record the steps it
        applies after)."""
        return not math.isfinite(value) or value > self.threshold()

    def would_trigger(self, value: float) -> bool:
        """What :meth:`check` would return: :meth:`is_spike` (there is no patience)."""
        return self.is_spike(value)

    def score(self, value: float) -> float:
        """The robust z-score ``(value - med) / spread`` of bar 1 (0 while the window
        cannot judge, inf for a non-finite value or a value above a zero-spread
        median): for reports; the decision is :meth:`is_spike`'s."""
        if not math.isfinite(value):
            return math.inf
        stats = self._stats()
        if stats is None:
            return 0.0
        level, spread, _ = stats
        if spread == 0:
            return 0.0 if value <= level else math.inf
        return (value - level) / spread

    def check(self, value: float) -> bool:
        """Record ``value``; True if it is a spike (:meth:`is_spike`), which then stays
        out of the window."""
        spike = self.is_spike(value)
        if not spike:
            self.history.append(value)
            self._appended += 1
            self._nonzero += value != 0
            # Keep the last `window` nonzero values and the zeros among them, at most
            # 4 * window entries in all.
            nonzero = len(self.history) - self.history.count(0.0)  # (-0.0 == 0.0)
            drop = 0
            while nonzero > self.window or len(self.history) - drop > 4 * self.window:
                nonzero -= self.history[drop] != 0
                drop += 1
            del self.history[:drop]
        return spike

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.history = [float(v) for v in sd["history"]]
        self._appended += 1  # a new window (its list may reuse the old one's id)
        self._nonzero = len(self.history) - self.history.count(0.0)
        self._devs.clear()
