"""The watches of what does not NaN, after an applied step: the slow-divergence trend
(:class:`~floatguard.stability.trend.TrendWatch`, every applied step) and updates lost
to rounding (:class:`~floatguard.stability.stall.StallWatch`, its sampled steps); each
alarm is a ``warning`` event with its code and evidence, never a response; and at
close, whether the run ends with a finite state (the ``end`` event)."""

from __future__ import annotations

from floatguard.guard.emit import GuardEvents
from floatguard.guard.read import StepRead
from floatguard.guard.vetting import StateCheck
from floatguard.scaling.loss_scale import DynamicLossScaler
from floatguard.stability.stall import StallWatch
from floatguard.stability.trend import TrendWatch

__all__ = ["SilentWatches"]


class SilentWatches:
    """Feeds an applied step to the silent-fault watches and writes their warnings."""

    def __init__(
        self, trend: TrendWatch, stall: StallWatch, events: GuardEvents, scaler: DynamicLossScaler
    ) -> None:
        self.trend, self.stall, self.events, self.scaler = trend, stall, events, scaler

    def applied(self, step: int, read: StepRead, lr: float | None, scale: float) -> None:
        """Step ``step`` was applied (``lr``: the schedule's LR, the guard's back-off
        left out; ``scale``: the loss scale it ran with)."""
        alarms = self.trend.observe(
            step, read.loss, read.grad_norm, lr, scale if self.scaler.enabled else None
        )
        for alarm in alarms:
            self.events.warning(
                step, alarm.message, code=f"{alarm.signal}_trend", evidence=alarm.evidence()
            )
        if self.stall.active:
            stalled = self.stall.after(step)  # on its sampled steps only
            if stalled is not None:
                self.events.warning(
                    step, StallWatch.message(stalled), code="stalled_updates", evidence=stalled
                )

    def run_ended(
        self, step: int, check: StateCheck, amax: dict[str, float], lr_factor: float,
        lr: float | None,
    ) -> None:  # fmt: skip
        """The ``end`` event: whether the run ends with finite weights, optimizer state
        and floating buffers (one read, at close; ``amax``: the last snapshot's
        magnitudes, for the buffer rule), which are not, the LR factor, LR and scale."""
        try:
            bad = check.nonfinite_now(amax)
        except Exception:  # closing must not fail on the check
            bad = None
        scale = self.scaler.get_scale() if self.scaler.enabled else None
        self.events.end(step, None if bad is None else not bad, bad or [], lr_factor, lr, scale)
