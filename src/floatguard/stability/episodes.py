"""Spike episodes: one bad batch, a burst, or a training that became unstable.

Torch-free (the diagnosis imports it to read a log): plain steps and floats in, plain
dataclasses out. :func:`classify_spikes` is the whole rule; its docstring states it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["EpisodeKind", "SpikeEpisode", "classify_spikes"]

EpisodeKind = Literal["isolated", "burst", "sustained", "unresolved"]

GAP = 20  # spikes fewer than this many steps apart are one episode
LEVEL_STEPS = 20  # applied steps before an episode that give its level
SETTLE = 10  # applied steps after an episode whose median says whether the loss came back
SETTLE_MIN = 5  # an isolated spike needs at least this many applied steps after it
LEVEL_MIN = 3  # fewer applied steps on a side: that level is unknown
BAND = 0.25  # "back": at most 25% above the level before (for a loss near 0: 1e-6)
REPEAT = 3  # spikes from an episode on that, with a lasting LR rise, make it sustained
LR_RISE = 1.5  # a rise of the LR by this factor or more ...
LR_LOOK_BACK = 50  # ... at most this many steps before the episode's first spike


@dataclass(frozen=True)
class SpikeEpisode:
    """Spikes close together, with what the loss did around them."""

    kind: EpisodeKind
    steps: tuple[int, ...]
    """The spike steps of the episode."""
    level_before: float | None
    """Median applied loss over up to LEVEL_STEPS applied steps before the first spike
    (None: fewer than LEVEL_MIN)."""
    level_after: float | None
    """Median applied loss over the first SETTLE applied steps after the last spike."""
    n_after: int
    """Applied steps after the last spike (up to SETTLE) that ``level_after`` is from."""
    reason: str
    """Why it is this kind, in words."""

    @property
    def back(self) -> bool | None:
        """Whether the loss came back within the band of its level (None: unknown)."""
        return _back(self.level_before, self.level_after)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["steps"] = list(self.steps)
        out["back"] = self.back
        return out


def _median(vs: list[float]) -> float | None:
    return statistics.median(vs) if len(vs) >= LEVEL_MIN else None


def _back(before: float | None, after: float | None) -> bool | None:
    if before is None or after is None:
        return None
    return after - before <= BAND * max(abs(before), 1e-6)


def _lasting_lr_rise(lrs: Sequence[tuple[int, float]], first: int) -> tuple[int, float] | None:
    """The step and factor of a rise of the LR by LR_RISE or more between ``first -
    LR_LOOK_BACK`` and ``first`` that was never undone (no later LR back below the
    rise's level / LR_RISE, to the end of ``lrs``); None if there is none."""
    pts = [(s, v) for s, v in lrs if math.isfinite(v) and v > 0]
    for j in range(len(pts) - 1, 0, -1):
        (_, a), (s, b) = pts[j - 1], pts[j]
        if not first - LR_LOOK_BACK <= s <= first:
            continue
        if b / a >= LR_RISE and all(v * LR_RISE > b for _, v in pts[j:]):
            return s, b / a
    return None


def classify_spikes(
    spike_steps: Sequence[int],
    applied_losses: Sequence[tuple[int, float]],
    trend_alarm_steps: Sequence[int] = (),
    *,
    lrs: Sequence[tuple[int, float]] = (),
) -> list[SpikeEpisode]:
    """Tell an isolated spike that did not recur from a sustained change.

    ``spike_steps``: the steps of the spikes (the ones a replay did not clear);
    ``applied_losses``: (step, loss) of the applied steps (non-finite losses are left
    out); ``trend_alarm_steps``: the steps of the trend warnings
    (:class:`~floatguard.stability.trend.TrendWatch`); ``lrs``: optionally (step, LR)
    of the schedule (the guard's own back-off factor taken out). Returns the episodes
    in step order.

    The rule:

    1. Spikes fewer than GAP (20) steps apart are one *episode*.
    2. An episode's *level before* is the median applied loss over up to LEVEL_STEPS
       (20) applied steps before its first spike; its *level after*, the median over
       the first SETTLE (10) applied steps after its last spike; each unknown with
       fewer than LEVEL_MIN (3) steps. The loss is *back* when the level after is at
       most BAND (25%) above the level before.
    3. *isolated*: one spike, at least SETTLE_MIN (5) applied steps after it, and the
       loss back: one bad batch; it did not recur within GAP steps (a later spike is a
       later episode, judged on its own).
    4. *sustained*: from the first episode that is not isolated on, every episode, when
       from it on one of these holds: a trend alarm at or after GAP steps before its
       first spike (a rise that lasted windows); the loss over the last LEVEL_STEPS
       applied steps of the run is not back within the band of the level before it (a
       level shift that stayed, known from at least LEVEL_MIN steps); or at least
       REPEAT (3) spikes and the LR rose by LR_RISE (1.5x) or more within LR_LOOK_BACK
       (50) steps before its first spike and never came back down (the change that
       made the training unstable).
    5. Otherwise *burst* (several spikes, or one the loss took more than SETTLE steps
       to recover from, then back, nothing that lasted), or *unresolved*: one spike
       with fewer than SETTLE_MIN applied steps after it (the run ended too soon to
       tell).

    Pure: no state, no torch; O(spikes x applied steps) at most.
    """
    spikes = sorted(set(spike_steps))
    points = [(s, v) for s, v in applied_losses if math.isfinite(v)]
    groups: list[list[int]] = []
    for s in spikes:
        if groups and s - groups[-1][-1] < GAP:
            groups[-1].append(s)
        else:
            groups.append([s])

    def before(at: int) -> float | None:
        return _median([v for s, v in points if s < at][-LEVEL_STEPS:])

    local: list[tuple[float | None, float | None, int]] = []
    for g in groups:
        after = [v for s, v in points if s > g[-1]][:SETTLE]
        local.append((before(g[0]), _median(after), len(after)))

    def isolated(i: int) -> bool:
        lb, la, n = local[i]
        return len(groups[i]) == 1 and n >= SETTLE_MIN and _back(lb, la) is True

    start, why = len(groups), ""
    for i, g in enumerate(groups):
        if isolated(i):
            continue
        first, lb = g[0], local[i][0]
        trend = [t for t in trend_alarm_steps if t >= first - GAP]
        rise = _lasting_lr_rise(lrs, first) if lrs else None
        n = sum(len(x) for x in groups[i:])
        end_level = _median([v for s, v in points if s > g[-1]][-LEVEL_STEPS:])
        if trend:
            why = f"a trend warning at step {trend[0]} followed"
        elif end_level is not None and _back(lb, end_level) is False:
            why = f"the loss stayed up: {end_level:.3g} at the end against {lb:.3g} before"
        elif n >= REPEAT and rise is not None:
            why = f"{n} spikes after the LR rose x{rise[1]:.3g} at step {rise[0]} and stayed up"
        else:
            continue
        start = i
        break

    out = []
    for i, g in enumerate(groups):
        lb, la, n_after = local[i]
        if i >= start:
            kind: EpisodeKind = "sustained"
            reason = (
                why if i == start else f"after the sustained change from step {groups[start][0]}"
            )
        elif isolated(i):
            kind, reason = "isolated", f"one spike; the loss was back within {n_after} steps"
        elif len(g) == 1 and n_after < SETTLE_MIN:
            kind, reason = "unresolved", f"one spike and only {n_after} applied steps after it"
        else:
            kind = "burst"
            reason = (
                f"{len(g)} spikes, then the loss came back" if _back(lb, la) is not False
                else f"{len(g)} spike(s); the loss was still up {n_after} steps later, but "
                     f"came back and nothing lasted"
            )  # fmt: skip
        out.append(SpikeEpisode(kind, tuple(g), lb, la, n_after, reason))
    return out
