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
import typing
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["TrendAlarm", "TrendPolicy", "TrendSignal", "TrendWatch"]

TrendSignal = Literal["loss", "grad_norm"]
SIGNALS: tuple[TrendSignal, ...] = typing.get_args(TrendSignal)

LR_JUMP = 1.5
"""A step-to-step LR change at least this factor (either way) is named as a jump in an
alarm's evidence; a schedule's own steps (cosine, linear warm-up, a creep of a few
percent a step) are smaller."""

_STATE_VERSION = 1


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _g(x: float | None) -> str:
    return "?" if x is None else f"{x:.4g}"


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2


def _median_se(xs: list[float]) -> tuple[float | None, float]:
    """The median of ``xs`` and its standard error on a log scale (the losses and norms
    watched here are positive and their noise multiplicative): ``1.2533 * sigma /
    sqrt(n)`` with ``sigma = 1.4826 * MAD`` of the logs (a normal sample's, robust to
    the tails). With a value at or below 0 the linear standard error over the median
    stands in for it (inf for a median at or below 0); ``(None, 0)`` for no value."""
    med = _median(xs)
    if med is None:
        return None, 0.0
    k = 1.2533 * 1.4826 / math.sqrt(len(xs))
    if min(xs) > 0:
        logs = [math.log(x) for x in xs]
        mid = _median(logs)
        assert mid is not None
        return med, k * _median([abs(x - mid) for x in logs])  # type: ignore[operator]
    if med <= 0:
        return med, math.inf
    return med, k * _median([abs(x - med) for x in xs]) / med  # type: ignore[operator]


@dataclass(frozen=True)
class TrendPolicy:
    """Settings of a :class:`TrendWatch`; see the module for the rule."""

    window: int = 20
    """Observations (applied steps) per window; each window's value is their median.
    Short enough that a divergence in the last 100 steps of a 300-step run is told
    (``benchmarks/trend_false_rate.py``: at 25, 2 of 15 planted runs went unreported;
    at 50, 8); the standard errors keep a short window's noise from alarming."""
    recent: int = 2
    """How many of the latest windows must all be above the margin."""
    warmup_windows: int = 5
    """Complete windows before anything can alarm (at least ``recent + 1``: the best
    window must come before the rise); 5 x 20: the first 100 steps."""
    loss_ratio: float = 1.5
    """The loss's margin: a window surely above this times the best window (see
    ``confidence``) is in a rise."""
    grad_norm_ratio: float = 3.0
    """The gradient norm's margin (its clean runs swing 2x: leaving a plateau, early
    training)."""
    grad_norm_loss_ratio: float = 1.1
    """A gradient-norm alarm also needs the loss's last ``recent`` windows all at least
    this times the loss's best (0 turns the requirement off)."""
    confidence: float = 2.0
    """How sure a window must be to be above the margin, in standard errors of the
    window medians (log scale): its value less ``confidence`` of its standard errors
    must exceed the ratio times the best's value plus ``max(confidence, sqrt(2 ln n))``
    of the best's, n the complete windows so far (0: the plain values). A noisy loss's
    medians jitter and the lowest of many windows is a low outlier: with the plain
    values, windows of 25 gave 9 false alarms in the benchmark's 19,490 clean steps
    (near-converged classifiers), and a lognormal loss (sigma 1) one every few thousand
    steps; with 2, none."""
    hold: float = 0.5
    """The latest window must still lie at least this fraction of the way from the best
    to the first of the last ``recent`` windows (1: no recovery at all allowed; a
    rising signal has held whatever this is)."""
    again_factor: float = 2.0
    """An alarmed trend alarms again once a window is this times the one it last
    alarmed on."""
    climb: int = 4
    """A steady climb counts as surely above the margin too: this many consecutive
    windows, each above the one before, the latest above the ratio times the best by
    value over the best window raised by ``confidence / 2`` of its standard errors (the
    latest window's own noise is not subtracted: a monotone run of ``climb`` medians is
    itself the evidence; a noisy flat loss rarely climbs 4 windows in a row, and not to
    1.5x its best). Label noise growing to 60% over 300 steps at lr 1e-3 (the loss 1.8x its best
    at the end, within the standard-error margin) is told this way. 0 turns it off."""
    watch_loss: bool = True
    watch_grad_norm: bool = True

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"TrendPolicy.{name}={getattr(self, name)!r} must be {rule}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        need(is_int(self.window) and self.window >= 3, "window", "an int >= 3 (steps per window)")
        need(is_int(self.recent) and self.recent >= 1, "recent", "an int >= 1 (windows)")
        need(
            is_int(self.warmup_windows) and self.warmup_windows > self.recent,
            "warmup_windows",
            f"an int > recent={self.recent!r} (the best window comes before the rise)",
        )
        for name in ("loss_ratio", "grad_norm_ratio", "again_factor"):
            need(_finite(getattr(self, name)) and getattr(self, name) > 1, name,
                 "a finite number > 1 (a factor over a window)")  # fmt: skip
        need(
            _finite(self.grad_norm_loss_ratio) and self.grad_norm_loss_ratio >= 0,
            "grad_norm_loss_ratio",
            "a finite number >= 0 (0: a gradient-norm alarm needs nothing of the loss)",
        )
        need(_finite(self.hold) and 0 < self.hold <= 1, "hold", "a number in (0, 1]")
        need(is_int(self.climb) and self.climb >= 0, "climb", "an int >= 0 (0: off)")
        need(_finite(self.confidence) and self.confidence >= 0, "confidence",
             "a finite number >= 0 (standard errors)")  # fmt: skip
        for name in ("watch_loss", "watch_grad_norm"):
            need(isinstance(getattr(self, name), bool), name, "True or False")

    def ratio(self, signal: TrendSignal) -> float:
        """The margin's factor for ``signal``."""
        return self.loss_ratio if signal == "loss" else self.grad_norm_ratio

    def watches(self, signal: TrendSignal) -> bool:
        return self.watch_loss if signal == "loss" else self.watch_grad_norm


@dataclass(frozen=True)
class _Window:
    """A complete window's summary (plain values: its ``asdict`` is its saved form)."""

    start: int  # first and last step
    end: int
    loss: float | None  # medians of the finite values (None: none was finite)
    grad_norm: float | None
    lr: float | None
    scale: float | None
    lr_jump: float | None = None  # the largest step-to-step LR factor in it (from the
    lr_jump_step: int | None = None  # step before its first one), if >= LR_JUMP either way
    loss_se: float = 0.0  # the medians' standard errors, on a log scale
    grad_norm_se: float = 0.0

    def value(self, signal: TrendSignal) -> float | None:
        return self.loss if signal == "loss" else self.grad_norm

    def bound(self, signal: TrendSignal, z: float) -> float:
        """The value times ``exp(z * se)``: ``z`` standard errors above it (below, for a
        negative ``z``; the value is not None)."""
        v, se = self.value(signal), self.loss_se if signal == "loss" else self.grad_norm_se
        assert v is not None
        return v * math.exp(z * se) if z else v


@dataclass(frozen=True)
class TrendAlarm:
    """A sustained rise of one signal, with the evidence; a warning, never a response.

    Steps are the observed (applied) steps. Window values are medians. ``lr_*`` and
    ``scale_*`` are None where the watch was not given them."""

    signal: TrendSignal
    step: int
    """The step it fired on: the last step of the latest window."""
    ratio: float
    """The latest window's value over the best window's."""
    best_start: int
    best_end: int
    best_value: float
    window_starts: tuple[int, ...]
    """The last ``recent`` windows (oldest first): first steps, last steps, values."""
    window_ends: tuple[int, ...]
    window_values: tuple[float, ...]
    slope_per_step: float
    """Least-squares slope of the windows' values against their middle steps (signal
    units per step; 0 with one window)."""
    slope_per_window: float
    """The same, per window (against the windows' index)."""
    rise_start: int
    """The first step of the first window above the margin (the rise began there)."""
    rise_windows: int
    """How many consecutive windows the rise has lasted."""
    loss_ratio: float | None
    """The loss's latest window over its best (for a gradient-norm alarm: how far the
    loss has stopped improving; for a loss alarm, ``ratio``)."""
    lr_best: float | None
    """The LR (median) over the best window and over the rise's first window."""
    lr_rise: float | None
    lr_jump: float | None
    """The largest step-to-step LR factor between the best window and the end of the
    rise's first window, if at least ``LR_JUMP`` either way, and its step."""
    lr_jump_step: int | None
    scale_best: float | None
    """The loss scale (median) over the best window and over the rise's first window."""
    scale_rise: float | None
    again_after: int | None = None
    """Set when the same trend alarmed before (at that step) and has grown
    ``again_factor`` times since."""

    @property
    def lr_ratio(self) -> float | None:
        if self.lr_best is None or self.lr_rise is None or self.lr_best == 0:
            return None
        return self.lr_rise / self.lr_best

    @property
    def scale_ratio(self) -> float | None:
        if self.scale_best is None or self.scale_rise is None or self.scale_best == 0:
            return None
        return self.scale_rise / self.scale_best

    @property
    def message(self) -> str:
        """One sentence: the windows, the ratio, the slope and what changed."""
        f = _g
        name = "loss" if self.signal == "loss" else "gradient norm"
        windows = ", ".join(
            f"{f(v)} ({s}-{e})"
            for s, e, v in zip(
                self.window_starts, self.window_ends, self.window_values, strict=True
            )
        )
        text = (
            f"{name} {self.ratio:.2f}x its best window (steps {self.best_start}-"
            f"{self.best_end}: {f(self.best_value)}), above its margin for "
            f"{self.rise_windows} windows since step {self.rise_start}: medians {windows}, "
            f"{self.slope_per_window:+.3g} a window"
        )
        if self.signal == "grad_norm" and self.loss_ratio is not None:
            text += f", while the loss stopped improving ({self.loss_ratio:.2f}x its best)"
        if self.again_after is not None:
            text += f", grown again since the alarm at step {self.again_after}"
        return f"{text}; {self._changed()}"

    def _changed(self) -> str:
        f = _g
        parts = []
        lr_ratio, scale_ratio = self.lr_ratio, self.scale_ratio
        lr_moved = lr_ratio is not None and not 1 / 1.05 <= lr_ratio <= 1.05
        if lr_moved:
            parts.append(f"the LR went x{lr_ratio:.3g} ({f(self.lr_best)} -> {f(self.lr_rise)})")
        if self.lr_jump is not None:
            parts.append(f"it jumped x{self.lr_jump:.3g} at step {self.lr_jump_step}")
        scale_moved = scale_ratio is not None and scale_ratio != 1
        if scale_moved:
            parts.append(
                f"the loss scale x{scale_ratio:.3g} ({f(self.scale_best)} -> {f(self.scale_rise)})"
            )
        if parts:
            return "since the best window " + ", ".join(parts)
        known = [n for n, r in (("LR", lr_ratio), ("loss scale", scale_ratio)) if r is not None]
        if not known:
            return "no LR or loss scale was given to compare (look at the data and the schedule)"
        return (
            f"the {' and the '.join(known)} did not change since the best window: "
            f"the data or the model did"
        )

    def evidence(self) -> dict[str, Any]:
        """The fields, ``lr_ratio``, ``scale_ratio`` and ``message``, as JSON-ready
        values (tuples as lists)."""
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        out.update(lr_ratio=self.lr_ratio, scale_ratio=self.scale_ratio, message=self.message)
        return out


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
