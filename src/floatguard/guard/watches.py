"""The watches of what does not NaN, after an applied step: the slow-divergence trend
(:class:`~floatguard.stability.trend.TrendWatch`, every applied step) and updates lost
to rounding (:class:`~floatguard.stability.stall.StallWatch`, its sampled steps); each
alarm is a ``warning`` event with its code and evidence, never a response."""

from __future__ import annotations

from floatguard.guard.emit import GuardEvents
from floatguard.guard.read import StepRead
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
