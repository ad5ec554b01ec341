"""The spike watch: the loss and gradient-norm detectors a :class:`SpikePolicy` asks for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from floatguard.stability.spikes import LossSpikeHandler, RobustSpikeDetector

if TYPE_CHECKING:
    from floatguard.stability.respond import SpikePolicy

__all__ = ["SpikeDetector", "SpikeWatch"]


class SpikeDetector:
    """One detector as the guard uses it: ``would_spike`` before deciding (no state
    change), ``record`` after an applied step, and its ``state_dict``."""

    def __init__(self, policy: SpikePolicy, *, min_rel: float | None = None) -> None:
        self.policy = policy
        self.impl: LossSpikeHandler | RobustSpikeDetector
        if policy.detector == "lesson":
            self.impl = LossSpikeHandler(policy.threshold, policy.patience, policy.window)
        else:
            self.impl = RobustSpikeDetector(
                policy.window,
                policy.z,
                min(policy.warmup, policy.window),
                min_rel=policy.min_rel if min_rel is None else min_rel,
                range_rel=policy.range_rel,
                min_spread=policy.min_spread,
            )

    def would_spike(self, value: float) -> bool:
        """Whether recording ``value`` would call for action (no state change)."""
        return self.impl.would_trigger(value)

    def record(self, value: float) -> None:
        self.impl.check(value)

    def bar(self) -> float | None:
        """The value a step must exceed to be a spike now (the robust detector's
        threshold), or None where the detector has no single bar ("lesson")."""
        threshold = getattr(self.impl, "threshold", None)
        return float(threshold()) if callable(threshold) else None

    def state_dict(self) -> dict[str, Any]:
        return self.impl.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.impl.load_state_dict(sd)


class SpikeWatch:
    """The loss detector (``watch_loss``) and the gradient-norm detector
    (``watch_grad_norm``) of a policy; either may be None."""

    def __init__(self, policy: SpikePolicy) -> None:
        self.loss = SpikeDetector(policy) if policy.watch_loss else None
        self.grad_norm = (
            SpikeDetector(policy, min_rel=policy.grad_norm_min_rel)
            if policy.watch_grad_norm
            else None
        )

    def check(
        self, loss: float, grad_norm: float
    ) -> Literal["loss_spike", "grad_norm_spike"] | None:
        """Which signal spikes on this step (the loss first), or None (no state change)."""
        if self.loss is not None and self.loss.would_spike(loss):
            return "loss_spike"
        if self.grad_norm is not None and self.grad_norm.would_spike(grad_norm):
            return "grad_norm_spike"
        return None

    def record(self, loss: float, grad_norm: float) -> None:
        """An applied step's values enter the detectors' windows."""
        if self.loss is not None:
            self.loss.record(loss)
        if self.grad_norm is not None:
            self.grad_norm.record(grad_norm)
