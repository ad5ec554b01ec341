"""The trend watch's policy and alarm: :class:`TrendPolicy` (what counts as a slow
divergence), :class:`TrendAlarm` (one, with its evidence), and the window statistics
they share. :mod:`floatguard.stability.trend` is the watch itself, and explains it.
"""

from __future__ import annotations

import math
import typing
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["LR_JUMP", "SIGNALS", "TrendAlarm", "TrendPolicy", "TrendSignal"]

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
