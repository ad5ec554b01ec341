"""The actor: carries a decision out (apply, skip, scale back-off, rollback, stop) and logs it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from floatguard.guard import policy
from floatguard.guard.emit import GuardEvents
from floatguard.guard.judge import Verdict
from floatguard.guard.keeper import SnapshotKeeper
from floatguard.guard.read import StepRead, StepReader
from floatguard.guard.types import Action
from floatguard.monitor.localize import Fault
from floatguard.scaling.loss_scale import DynamicLossScaler
from floatguard.stability.clip import Clipper
from floatguard.stability.respond import GuardStopped, ResponsePolicy
from floatguard.stability.spike_watch import SpikeWatch
from floatguard.stability.step_state import StepState

__all__ = ["Actor"]

Snapshotter = Callable[[int, dict[str, float], policy.LadderState], policy.LadderState]


class Actor:
    """Applies a step whole (snapshot when due, clip, ``optimizer.step()`` with the LR
    factor, scheduler, scaler growth, detector windows) or leaves no trace of it
    (buffers restored, scaler growth skipped), restoring a snapshot on a rollback or a
    stop that asks for it. ``applying``: ``optimizer.step()`` has begun, so a failure
    from here on cannot be undone (the guard's stage flag)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        scaler: DynamicLossScaler,
        state: StepState,
        reader: StepReader,
        clipper: Clipper,
        spike_watch: SpikeWatch,
        keeper: SnapshotKeeper,
        emit: GuardEvents,
        response: ResponsePolicy,
        stateful: Callable[[], dict[str, Any]],
    ) -> None:
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.state, self.reader, self.clipper = state, reader, clipper
        self.spike_watch, self.keeper, self.emit = spike_watch, keeper, emit
        self.response, self.stateful = response, stateful
        self.applying = False

    def act(
        self, step: int, read: StepRead, verdict: Verdict, snapshot: Snapshotter
    ) -> tuple[Action, policy.LadderState]:
        """Carry ``verdict`` out; the action taken and the policy's state after it."""
        decision, fault = verdict.decision, verdict.fault
        if fault is not None:
            self.emit.fault(step, fault, decision.cause)
        if decision.response == "apply":
            return "applied", self._apply(step, read, verdict, snapshot)
        self.state.restore_buffers()  # a step not applied leaves no trace in them
        if decision.response == "backoff_scale":
            before = self.scaler.get_scale()
            self.scaler.update(found_inf=True)
            self.emit.overflow(step, before, self.scaler.get_scale())
        else:
            self.scaler.skip_step()
        if verdict.spike is not None:
            signal = verdict.spike.removesuffix("_spike")
            self.emit.spike(step, signal, verdict.spike_value, verdict.spike_reproduced)
        if decision.warning is not None:
            self.emit.warning(step, decision.warning, decision.state.transients)
        if decision.response == "stop":
            self._stop(step, decision, fault)
        action: Action = "skipped"
        if decision.response == "rollback":
            to_step = self.keeper.restore(self.stateful())
            self.emit.rollback(
                step, to_step, decision.state.rollbacks, self.response.skip_batches, fault
            )
            action = "rolled_back"
        if decision.lr_backoff:
            self.emit.lr_backoff(step, decision.state.lr_factor)
        return action, decision.state

    def _apply(
        self, step: int, read: StepRead, verdict: Verdict, snapshot: Snapshotter
    ) -> policy.LadderState:
        state = verdict.decision.state
        if verdict.amax is not None:
            # The weights just gave a finite loss and gradients, and were vetted.
            state = snapshot(step, verdict.amax, state)
        params, grads, _ = self.reader.params_with_grads()
        self.clipper.apply(params, grads, verdict.clip[0])
        self.keeper.fence()  # a host snapshot's copy is read before the update
        self.applying = True
        self._optimizer_step(state.lr_factor)
        self.clipper.update(read.grad_norm, verdict.clip[1])
        self.scaler.update(found_inf=False)
        self.spike_watch.record(read.loss, read.grad_norm)
        return policy.applied(state, self.response)

    def _optimizer_step(self, lr_factor: float) -> None:
        """``optimizer.step()`` with the LR factor applied around it only (a scheduler
        never sees it), then the scheduler's step."""
        if lr_factor != 1.0:
            saved = [pg["lr"] for pg in self.optimizer.param_groups]
            for pg in self.optimizer.param_groups:
                pg["lr"] = pg["lr"] * lr_factor
            try:
                self.optimizer.step()
            finally:
                for pg, lr in zip(self.optimizer.param_groups, saved, strict=True):
                    pg["lr"] = lr
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def _stop(self, step: int, decision: policy.Decision, fault: Fault | None) -> None:
        """The one stop: restore the last clean snapshot when the model holds a bad
        value (``decision.restore``), write the ``stop`` event, raise GuardStopped."""
        restored = None
        if decision.restore and self.keeper.snapshot is not None:
            restored = self.keeper.restore(self.stateful())
            self.state.save()  # the snapshot's buffers are the ones to keep
        reason = decision.stop or "repeated_fault"
        text = str(fault) if fault is not None else None
        self.emit.stop(step, reason, text)
        report = {
            "step": step,
            "reason": reason,
            "cause": decision.cause,
            "rollbacks": decision.state.rollbacks,
            "events": self.emit.count(),  # every event written, the stop included
            "fault": text,
            "restored_to": restored,
        }
        left = "" if restored is None else f" The model is as it was before step {restored}."
        raise GuardStopped(
            f"training stopped at step {step} ({reason}): {decision.message}"
            + (f": {fault}" if fault is not None else "")
            + "."
            + left,
            report,
            fault,
        )
