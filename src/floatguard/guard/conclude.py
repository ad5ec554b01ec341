"""The step's end: the verdict carried out and the step's result, built and emitted.

:class:`StepEnd` is what :meth:`Guard._step <floatguard.guard.core.Guard>` hands a judged
step to (the repro bundle of a bad step written before any rollback, the actor's apply
phase, the watches fed after an applied step, the keeper and the scratch closed, the
``step`` event), and what records a step the framework skipped on its own
(:meth:`Guard.skip_external <floatguard.guard.core.Guard.skip_external>`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from floatguard.causes import CAUSES, Cause
from floatguard.guard.crew import Crew
from floatguard.guard.judge import StepVerdict
from floatguard.guard.read import StepRead
from floatguard.guard.speculative import SpeculativeUpdate
from floatguard.guard.types import Closure, StepResult
from floatguard.scaling.loss_scale import DynamicLossScaler
from floatguard.stability.respond import GuardStopped

__all__ = ["StepEnd"]


class StepEnd:
    """Ends a guard step on the crew's collaborators (one per guard)."""

    def __init__(
        self, crew: Crew, scaler: DynamicLossScaler, optimizer: torch.optim.Optimizer
    ) -> None:
        self._c, self._scaler, self._optimizer = crew, scaler, optimizer

    def act(
        self,
        step: int,
        read: StepRead,
        verdict: StepVerdict,
        closures: Sequence[Closure] = (),
        speculative: tuple[SpeculativeUpdate, bool] | None = None,
    ) -> StepResult:
        """Carry out ``verdict`` for ``step`` and return (and emit) its result
        (``speculative``: a deferred step's device update and whether it was kept)."""
        c = self._c
        scale = self._scaler.get_scale()
        lr = self.lr(verdict.decision.state.lr_factor)  # what the update uses
        schedule_lr = self.lr(1.0)  # the schedule's, the guard's back-off left out
        batch = (
            c.inputs.identity(step, c.scratch.batch)
            if verdict.fault is not None or verdict.spike is not None
            else None
        )
        if c.repro is not None and verdict.decision.response != "apply":
            c.repro.bad_step(  # before a rollback
                step, verdict, c.judge.local, read.bad_ranks, closures, c.scratch.batch
            )
        try:
            action, c.run.ladder = c.actor.act(
                step, read, verdict, c.checkpoint.before_update, batch, speculative
            )
        except GuardStopped:
            c.run.ladder = verdict.decision.state
            raise
        c.run.previous_applied = action == "applied"
        if c.run.previous_applied:
            c.watches.applied(step, read, schedule_lr, scale)
        c.keeper.end_step()
        c.scratch.end(c.run.step_count - 1)
        result = StepResult(
            step,
            action,
            verdict.decision.cause,
            read.loss,
            read.grad_norm,
            scale,
            verdict.clip[0],
            c.run.ladder.lr_factor,
            verdict.fault,
            c.keeper.age(c.run.step_count),
            lr,
        )
        c.emit.step(result)
        return result

    def skipped_outside(
        self, reason: Cause, scale_before: float | None, scale_after: float | None
    ) -> StepResult:
        """A step the framework skipped on its own, counted and recorded (see
        :meth:`Guard.skip_external <floatguard.guard.core.Guard.skip_external>`)."""
        if reason not in CAUSES:
            raise ValueError(f"skip_external(reason={reason!r}); use one of {CAUSES}")
        c = self._c
        step = c.run.step_count
        c.run.step_count += 1
        loss = float(c.runner.mean_loss()) if c.runner.losses else math.nan
        c.scratch.discard()
        c.state.save()
        c.run.previous_applied = False
        if scale_before is not None and scale_after is not None:
            c.emit.overflow(step, scale_before, scale_after)
        scale = scale_after if scale_after is not None else self._scaler.get_scale()
        result = StepResult(
            step, "skipped", reason, loss, math.nan, scale, 1.0, c.run.ladder.lr_factor,
            snapshot_age=c.keeper.age(c.run.step_count),
        )  # fmt: skip
        c.emit.step(result)
        return result

    def lr(self, factor: float) -> float | None:
        """The LR a step's update uses: the first group's, times the LR factor."""
        groups = self._optimizer.param_groups
        lr = groups[0].get("lr") if groups else None
        if lr is None or isinstance(lr, torch.Tensor):
            return None  # (a tensor LR is not read: that would be a sync)
        return float(lr) * factor
