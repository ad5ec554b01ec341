"""Slow divergence: a sustained upward trend of the loss or the gradient norm.

A run whose loss creeps up over hundreds of steps (an LR schedule that climbs too far,
labels that grow noisier, an LR raised mid-run) never produces a NaN or a spike; it
just gets worse. :class:`TrendWatch` compares the run with its own best stretch and
says so, once per trend, as a warning: it never skips, rolls back or changes anything.

Words used here:

- *observation*: one applied step's loss, gradient norm, LR and loss scale (host
  floats: the guard reads the loss and norm once per step already, so the watch costs
  the device nothing).
- *window*: ``window`` (20) consecutive observations; its *value* for a signal is the
  median of its finite values, so one spike (or a handful) does not move it, and its
  *standard error* that of the median, on a log scale (from the MAD of the logs).
- *best window*: the complete window with the lowest value so far, per signal.
- *above the margin*: a window's value less ``confidence`` (2) standard errors exceeds
  ``loss_ratio`` (1.5; ``grad_norm_ratio``, 3, for the gradient norm) times the best
  window's value plus ``max(confidence, sqrt(2 ln n))`` of its standard errors, n the
  complete windows so far (the lowest of n noisy windows is low by about that much by
  chance alone: without it, a noisy loss's best window is an outlier that ordinary
  windows later "exceed").
- *rise*: the consecutive complete windows, up to the latest, above the margin; it
  *began* at the first step of its first window.
- *held*: the latest window has not come back more than ``1 - hold`` (half) of the way
  from the first of the last ``recent`` windows toward the best.

The rule, judged when a window completes (so an alarm fires on the last step of a
window; between windows nothing is judged), after ``warmup_windows`` (5) complete
windows: a signal alarms when its last ``recent`` (2) windows are all in the rise and
the latest has held. The gradient norm also needs the loss to have stopped improving:
its last ``recent`` windows all above ``grad_norm_loss_ratio`` (1.1) times its own best,
by the same test (the gradient norm commonly grows while the loss falls: during
warm-up, and late in a run with weight decay; that is training, not divergence). The
signals are taken to be positive (a loss such as cross-entropy or MSE, a norm): a best
window at or below 0 is never exceeded.

Once a signal has alarmed, the same trend does not alarm again: it re-arms when a
window comes back below ``sqrt(ratio)`` times the best (halfway to the margin,
geometrically), and, while not re-armed, alarms again only when a window has grown
``again_factor`` (2) times over the window it last alarmed on.

Memory: the observations of the window being filled, the last ``recent + 1``
complete windows' summaries (at least 4), and the best window and the rise's first
window per signal: bounded whatever the run's length. Cost: a few list appends a step,
two sorts of ``window`` floats and ``window`` logs a window (about 5 us a step in
CPython).

Reading order: :class:`TrendPolicy`, :meth:`TrendWatch.observe`, ``_close_window``,
``_judge``, :class:`TrendAlarm`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from floatguard.stability.trend_policy import (
    _STATE_VERSION,
    LR_JUMP,
    SIGNALS,
    TrendAlarm,
    TrendPolicy,
    TrendSignal,
    _finite,
    _median,
    _median_se,
    _Window,
)

__all__ = ["TrendAlarm", "TrendPolicy", "TrendSignal", "TrendWatch"]


@dataclass
class _Track:
    """What the watch keeps per signal."""

    best: _Window | None = None
    rise: _Window | None = None  # the rise's first window
    rise_windows: int = 0
    alarmed: float | None = None  # the window value last alarmed on (None: armed)
    alarmed_step: int | None = None
    climb: int = 1  # consecutive windows each above the one before, ending at the latest
    climb_above: int = 0  # of those, the latest ones past the ratio (by value)


class TrendWatch:
    """Feed it every applied step (:meth:`observe`); it returns the alarms that step
    raised (at most one per signal, only on a window's last step). See the module for
    the rule and :class:`TrendPolicy` for the settings. Plain host arithmetic: a few
    list appends a step and two sorts of ``window`` floats a window."""

    def __init__(self, policy: TrendPolicy | None = None) -> None:
        self.policy = policy or TrendPolicy()
        self._fill: dict[str, list[float]] = {k: [] for k in ("loss", "grad_norm", "lr", "scale")}
        self._count = 0  # observations in the window being filled
        self._start: int | None = None  # its first step
        self._jump: tuple[float, int] | None = None  # its largest LR factor so far, and step
        self._prev_lr: float | None = None
        self._windows: deque[_Window] = deque(maxlen=max(4, self.policy.recent + 1))
        self._complete = 0
        self._track: dict[TrendSignal, _Track] = {s: _Track() for s in SIGNALS}

    # -- feeding ----------------------------------------------------------------------

    def observe(
        self, step: int, loss: float, grad_norm: float, lr: float | None, scale: float | None
    ) -> list[TrendAlarm]:
        """Record one applied step; the alarms it raises (empty but on a window's last
        step). Non-finite values are left out of their window's median; an LR or a
        scale of None (or non-finite) is left out of the evidence."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step={step!r} must be an int (the step number)")
        if self._start is None:
            self._start = step
        for key, v in (("loss", loss), ("grad_norm", grad_norm), ("lr", lr), ("scale", scale)):
            if _finite(v):
                self._fill[key].append(float(v))  # type: ignore[arg-type]
        if _finite(lr) and lr > 0:  # type: ignore[operator]
            lr_now = float(lr)  # type: ignore[arg-type]
            if self._prev_lr is not None:
                factor = lr_now / self._prev_lr
                big = max(factor, 1 / factor)
                if big >= LR_JUMP and (
                    self._jump is None or big > max(self._jump[0], 1 / self._jump[0])
                ):
                    self._jump = (factor, step)
            self._prev_lr = lr_now
        self._count += 1
        if self._count < self.policy.window:
            return []
        return self._judge(self._close_window(step))

    def _close_window(self, end: int) -> _Window:
        assert self._start is not None
        f = self._fill
        (loss, loss_se), (norm, norm_se) = _median_se(f["loss"]), _median_se(f["grad_norm"])
        jump, jump_step = self._jump if self._jump is not None else (None, None)
        w = _Window(
            self._start, end, loss, norm, _median(f["lr"]), _median(f["scale"]), jump,
            jump_step, loss_se, norm_se,
        )  # fmt: skip
        for xs in f.values():
            xs.clear()
        self._count, self._start, self._jump = 0, None, None
        self._windows.append(w)
        self._complete += 1
        return w

    # -- judging ----------------------------------------------------------------------

    def _judge(self, w: _Window) -> list[TrendAlarm]:
        p = self.policy
        for (
            s
        ) in SIGNALS:  # the rise and the best first, for both (the norm's rule reads the loss's)
            self._update(s, w)
        alarms = []
        for s in SIGNALS:
            alarm = self._decide(s, w) if p.watches(s) else None
            if alarm is not None:
                alarms.append(alarm)
        return alarms

    def _update(self, s: TrendSignal, w: _Window) -> None:
        t, v, ratio = self._track[s], w.value(s), self.policy.ratio(s)
        if v is None:
            return
        before = self._windows[-2].value(s) if len(self._windows) >= 2 else None
        rising = before is not None and v > before
        t.climb = t.climb + 1 if rising else 1
        b = t.best.value(s) if t.best is not None else None
        past = (
            t.best is not None
            and b is not None
            and b > 0
            and v > ratio * t.best.bound(s, self.policy.confidence / 2)
        )
        t.climb_above = t.climb_above + 1 if rising and past else 0
        climbing = self.policy.climb > 0 and t.climb >= self.policy.climb and past
        if climbing:  # the climb's windows past the ratio are the rise
            kept = list(self._windows)[-min(t.climb_above, len(self._windows)) :]
            if t.rise is None:
                t.rise = kept[0]
            t.rise_windows = max(t.rise_windows + 1, len(kept))
        elif t.best is not None and self._above(w, t.best, s, ratio):
            if t.rise is None:
                t.rise = w
            t.rise_windows += 1
        else:
            t.rise, t.rise_windows = None, 0
        if t.best is None or v < t.best.value(s):  # type: ignore[operator]
            t.best = w
        if t.alarmed is not None and v <= math.sqrt(ratio) * t.best.value(s):  # type: ignore[operator]
            t.alarmed, t.alarmed_step = None, None  # back near the best: re-armed

    def _above(self, w: _Window, best: _Window, s: TrendSignal, ratio: float) -> bool:
        """Is ``w`` surely above ``ratio`` times ``best`` for ``s``: its value less
        ``confidence`` standard errors above the best's plus ``z_best`` of its? The
        lowest of n windows is low by about ``sqrt(2 ln n)`` standard errors by chance
        alone (the expected extreme of n normal samples): ``z_best`` is the larger of
        that and ``confidence``. False for a best at or below 0 (the rule is for
        positive signals) or a missing value."""
        z = self.policy.confidence
        v, b = w.value(s), best.value(s)
        if v is None or b is None or b <= 0:
            return False
        return w.bound(s, -z) > ratio * best.bound(s, self._z_best())

    def _z_best(self) -> float:
        """How many standard errors the best window is raised by before comparing: the
        lowest of n windows is low by about ``sqrt(2 ln n)`` of them by chance."""
        z = self.policy.confidence
        return max(z, math.sqrt(2 * math.log(max(self._complete, 1)))) if z > 0 else 0.0

    def _decide(self, s: TrendSignal, w: _Window) -> TrendAlarm | None:
        p, t = self.policy, self._track[s]
        if self._complete < p.warmup_windows or t.rise_windows < p.recent:
            return None
        assert t.best is not None and t.rise is not None
        recent = list(self._windows)[-p.recent :]
        values = [x.value(s) for x in recent]
        best, v = t.best.value(s), w.value(s)
        assert best is not None and v is not None and all(x is not None for x in values)
        first = values[0]
        assert first is not None
        if v - best < p.hold * (first - best):
            return None  # coming back down: not (or no longer) sustained
        loss = self._track["loss"]
        loss_ratio = None
        if loss.best is not None and w.loss is not None and loss.best.loss:
            loss_ratio = w.loss / loss.best.loss
        if s == "grad_norm" and p.grad_norm_loss_ratio > 0:
            lb = loss.best
            if lb is None or not all(
                self._above(x, lb, "loss", p.grad_norm_loss_ratio) for x in recent
            ):
                return None  # the loss still improves: a growing norm is training
        again = None
        if t.alarmed is not None:
            if v < p.again_factor * t.alarmed:
                return None  # the same trend, not grown enough to say it again
            again = t.alarmed_step
        t.alarmed, t.alarmed_step = v, w.end
        return self._alarm(s, w, recent, values, t, loss_ratio, again)  # type: ignore[arg-type]

    def _alarm(
        self,
        s: TrendSignal,
        w: _Window,
        recent: list[_Window],
        values: list[float],
        t: _Track,
        loss_ratio: float | None,
        again: int | None,
    ) -> TrendAlarm:
        assert t.best is not None and t.rise is not None
        best = t.best.value(s)
        assert best is not None
        mids = [(x.start + x.end) / 2 for x in recent]
        per_step = _slope(mids, values)
        per_window = _slope([float(i) for i in range(len(values))], values)
        jump = self._largest_jump(t.best, t.rise)
        return TrendAlarm(
            signal=s, step=w.end, ratio=values[-1] / best if best else math.inf,
            best_start=t.best.start, best_end=t.best.end, best_value=best,
            window_starts=tuple(x.start for x in recent),
            window_ends=tuple(x.end for x in recent), window_values=tuple(values),
            slope_per_step=per_step, slope_per_window=per_window,
            rise_start=t.rise.start, rise_windows=t.rise_windows,
            loss_ratio=loss_ratio if s == "grad_norm" else (values[-1] / best if best else None),
            lr_best=t.best.lr, lr_rise=t.rise.lr,
            lr_jump=jump[0] if jump else None, lr_jump_step=jump[1] if jump else None,
            scale_best=t.best.scale, scale_rise=t.rise.scale, again_after=again,
        )  # fmt: skip

    def _largest_jump(self, best: _Window, rise: _Window) -> tuple[float, int] | None:
        """The largest LR jump in the kept windows after the best one, up to the rise's
        first (windows dropped from the kept ones are not searched: the rise's first
        window is kept while the rise lasts ``recent`` windows or fewer; for a longer
        rise, the search covers the kept windows from its first kept one)."""
        found: tuple[float, int] | None = None
        for x in (*self._windows, rise):
            if (
                best.end < x.end <= rise.end
                and x.lr_jump is not None
                and x.lr_jump_step is not None
            ):
                if found is None or abs(math.log(x.lr_jump)) > abs(math.log(found[0])):
                    found = (x.lr_jump, x.lr_jump_step)
        return found

    # -- state ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain values (lists, dicts, floats, ints, None): the window being filled, the
        kept windows, and per signal its best and rise windows and alarm state."""
        track = {
            s: {
                "best": None if t.best is None else asdict(t.best),
                "rise": None if t.rise is None else asdict(t.rise),
                "rise_windows": t.rise_windows,
                "alarmed": t.alarmed,
                "alarmed_step": t.alarmed_step,
                "climb": t.climb,
                "climb_above": t.climb_above,
            }
            for s, t in self._track.items()
        }
        return {
            "version": _STATE_VERSION,
            "fill": {k: list(v) for k, v in self._fill.items()},
            "count": self._count,
            "start": self._start,
            "jump": None if self._jump is None else list(self._jump),
            "prev_lr": self._prev_lr,
            "windows": [asdict(x) for x in self._windows],
            "complete": self._complete,
            "track": track,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("version") != _STATE_VERSION:
            raise ValueError(
                f"TrendWatch state version {sd.get('version')!r}; this floatguard reads "
                f"version {_STATE_VERSION}"
            )
        self._fill = {k: [float(x) for x in sd["fill"][k]] for k in self._fill}
        self._count, self._start = int(sd["count"]), sd["start"]
        self._jump = None if sd["jump"] is None else (float(sd["jump"][0]), int(sd["jump"][1]))
        self._prev_lr = sd["prev_lr"]
        self._windows.clear()
        self._windows.extend(_Window(**x) for x in sd["windows"])
        self._complete = int(sd["complete"])
        for s in SIGNALS:
            x = sd["track"][s]
            self._track[s] = _Track(
                None if x["best"] is None else _Window(**x["best"]),
                None if x["rise"] is None else _Window(**x["rise"]),
                int(x["rise_windows"]), x["alarmed"], x["alarmed_step"], int(x.get("climb", 1)),
                int(x.get("climb_above", 0)),
            )  # fmt: skip


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` on ``xs`` (0 for fewer than two points)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
