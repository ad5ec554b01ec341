"""The actor: carries a decision out (apply, skip, scale back-off, rollback, stop) and logs it."""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch

from floatguard.guard import policy
from floatguard.guard.emit import GuardEvents
from floatguard.guard.judge import StepVerdict
from floatguard.guard.persist import RunState
from floatguard.guard.read import StepRead, StepReader
from floatguard.guard.speculative import SpeculativeUpdate
from floatguard.guard.types import Action
from floatguard.guard.update_check import UpdateCheck
from floatguard.monitor.localize import Fault
from floatguard.scaling.loss_scale import DynamicLossScaler
from floatguard.stability.clipper import Clipper
from floatguard.stability.respond import GuardStopped, ResponsePolicy
from floatguard.stability.snapshot_keeper import SnapshotKeeper
from floatguard.stability.spike_watch import SpikeWatch
from floatguard.stability.stall import StallWatch
from floatguard.stability.step_state import StepState

__all__ = ["Actor", "is_metric_scheduler"]

Snapshotter = Callable[[int, dict[str, float], policy.LadderState], policy.LadderState]


class Actor:
    """Applies a step whole (snapshot when due, clip, ``optimizer.step()`` with the LR
    factor, scheduler, scaler growth, detector windows) or leaves no trace of it
    (buffers restored, scaler growth skipped), restoring a snapshot on a rollback or a
    stop that asks for it. Once ``optimizer.step()`` ran whole it sets the run's stage to
    ``"applied"``; before that a failure leaves no trace."""

    def __init__(
        self,
        run: RunState,
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
        updates: UpdateCheck,
        step_scheduler: bool = True,
        stall: StallWatch | None = None,
    ) -> None:
        self.run, self.optimizer, self.scheduler, self.scaler = run, optimizer, scheduler, scaler
        self.state, self.reader, self.clipper = state, reader, clipper
        self.spike_watch, self.keeper, self.emit = spike_watch, keeper, emit
        self.response, self.stateful = response, stateful
        self.updates, self.step_scheduler, self.stall = updates, step_scheduler, stall
        self.metric: float | None = None  # the metric a metric-driven scheduler is given

    def act(
        self,
        step: int,
        read: StepRead,
        verdict: StepVerdict,
        snapshot: Snapshotter,
        batch: dict[str, Any] | None = None,
        speculative: tuple[SpeculativeUpdate, bool] | None = None,
    ) -> tuple[Action, policy.LadderState]:
        """Carry ``verdict`` out; the action taken and the policy's state after it.
        ``batch``: the step's batch identity, for its fault and spike events.
        ``speculative``: a deferred step's update, already run on the device, and whether
        the device kept it: an applied step is then booked only (or run now, when the
        device blocked what the host applies), a step not applied is undone first."""
        decision, fault = verdict.decision, verdict.fault
        if speculative is not None and decision.response != "apply":
            update, kept = speculative
            if kept:
                update.undo()
            else:
                update.settled(False)
        if fault is not None:
            self.emit.fault(step, fault, decision.cause, batch)
            for other in verdict.also:  # another rank's own fault of the same step
                self.emit.fault(step, other, decision.cause, batch)
        if decision.response == "apply":
            return "applied", self._apply(step, read, verdict, snapshot, speculative)
        self.state.restore_buffers()  # a step not applied leaves no trace in them
        if decision.response == "backoff_scale":
            before = self.scaler.get_scale()
            self.scaler.update(found_inf=True)
            self.emit.overflow(step, before, self.scaler.get_scale())
        else:
            self.scaler.skip_step()
        if verdict.spike is not None:
            signal = verdict.spike.removesuffix("_spike")
            self.emit.spike(step, signal, verdict.spike_value, verdict.spike_reproduced, batch)
        if decision.warning is not None:
            code = "bad_data" if decision.cause == "nonfinite_input" else "transients"
            self.emit.warning(step, decision.warning, decision.state.transients, code=code)
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
        self,
        step: int,
        read: StepRead,
        verdict: StepVerdict,
        snapshot: Snapshotter,
        speculative: tuple[SpeculativeUpdate, bool] | None = None,
    ) -> policy.LadderState:
        """Apply the step whole, or leave no trace of it: the scheduler is stepped first
        (its new hyper-parameters held back until the update ran: a scheduler that
        raises, like ReduceLROnPlateau stepped without a metric, raises before any
        weight moved); anything raising afterwards puts the scheduler, the parameter
        groups, the scaler, the clipper and the detectors back as they were before
        the step, and an ``optimizer.step()`` that raised after it moved a weight is
        answered by restoring the last clean snapshot (said in the error)."""
        state = verdict.decision.state
        saved = self._light_state()
        params: list[torch.Tensor] = []
        versions: list[int] = []
        try:
            if verdict.amax is not None:
                # The weights just gave a finite loss and gradients, and were vetted.
                state = snapshot(step, verdict.amax, state)
            params, grads, _ = self.reader.params_with_grads()
            if speculative is None:
                self.clipper.apply(params, grads, verdict.clip[0])  # (deferred: on device)
            # Everything the step changes besides the weights, before the update (none
            # of it is read by the update), so nothing can raise after it.
            scheduled = self._schedule(read.loss if self.metric is None else self.metric)
            self.clipper.update(read.grad_norm, verdict.clip[1])
            self.scaler.update(found_inf=False)
            self.spike_watch.record(read.loss, read.grad_norm)
            state = policy.applied(state, self.response)
            self.keeper.fence()  # a host snapshot's copy is read before the update
            if self.stall is not None:
                self.stall.before(verdict.decision.state.lr_factor)
            versions = [p._version for p in params]
            if speculative is None or not speculative[1]:
                if speculative is not None:  # the device blocked what the host applies
                    speculative[0].settled(False)
                self._optimizer_step(verdict.decision.state.lr_factor)
            else:
                speculative[0].settled(True)  # the device's update stands
        except BaseException as e:
            self._restore_light(saved)
            if any(p._version != v for p, v in zip(params, versions, strict=False)):
                to = self.keeper.restore(self.stateful()) if self.keeper.snapshot else None
                self.state.save()
                where = (
                    f"the last clean snapshot (step {to}) was restored"
                    if to is not None
                    else "no clean snapshot was there to restore"
                )
                raise RuntimeError(
                    f"floatguard: optimizer.step() raised at step {step} after it changed "
                    f"weights ({type(e).__name__}: {e}); {where}"
                ) from e
            raise
        self.run.stage = "applied"  # the update ran whole: from here on nothing undoes it
        if scheduled is not None:
            _set_hypers(self.optimizer, scheduled)
        return state

    def _light_state(self) -> dict[str, Any]:
        """What an apply changes besides the weights and the optimizer's tensors, saved
        to put back when it raises (small: counters, histories, hyper-parameters)."""
        return {
            "hypers": _hypers(self.optimizer),
            "scheduler": (
                _one_level(self.scheduler.state_dict())
                if self.scheduler is not None and hasattr(self.scheduler, "state_dict")
                else None
            ),
            "scaler": self.scaler.state_dict(),  # (these state_dicts are fresh copies)
            "parts": [(o, o.state_dict()) for o in self._parts()],
        }

    def _restore_light(self, saved: dict[str, Any]) -> None:
        _set_hypers(self.optimizer, saved["hypers"])
        if saved["scheduler"] is not None:
            self.scheduler.load_state_dict(saved["scheduler"])
        self.scaler.load_state_dict(saved["scaler"])
        for part, sd in saved["parts"]:
            part.load_state_dict(sd)

    def _parts(self) -> list[Any]:
        """ZClip and the spike detectors: the host state an applied step updates."""
        parts = [self.clipper.zclip, self.spike_watch.loss, self.spike_watch.grad_norm]
        return [p for p in parts if p is not None]

    def _schedule(self, metric: float) -> list[dict[str, Any]] | None:
        """Step the scheduler now and return the hyper-parameters it set for the next
        step, the parameter groups left as the update about to run needs them."""
        if self.scheduler is None or not self.step_scheduler:
            return None
        before = _hypers(self.optimizer)
        with warnings.catch_warnings():
            # stepped ahead of optimizer.step() on purpose (see _apply)
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
            if is_metric_scheduler(self.scheduler):
                self.scheduler.step(metric)
            else:
                self.scheduler.step()
        after = _hypers(self.optimizer)
        _set_hypers(self.optimizer, before)
        return after

    def optimizer_step(self, lr_factor: float) -> None:
        """``optimizer.step()`` with the LR factor (a deferred step's gated update)."""
        self._optimizer_step(lr_factor)

    def _optimizer_step(self, lr_factor: float) -> None:
        """``optimizer.step()`` with the LR factor applied around it only (a scheduler
        never sees it)."""
        if lr_factor != 1.0:
            saved = [pg["lr"] for pg in self.optimizer.param_groups]
            for pg in self.optimizer.param_groups:
                pg["lr"] = pg["lr"] * lr_factor
            try:
                self.updates.record()
                self.optimizer.step()
            finally:
                for pg, lr in zip(self.optimizer.param_groups, saved, strict=True):
                    pg["lr"] = lr
        else:
            self.updates.record()
            self.optimizer.step()

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


def is_metric_scheduler(scheduler: Any) -> bool:
    """Whether ``scheduler.step`` needs a metric (``ReduceLROnPlateau`` and any scheduler
    whose ``step`` has a required positional parameter)."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return True
    step = getattr(scheduler, "step", None)
    if step is None:
        return False
    try:
        sig = inspect.signature(step)
    except (TypeError, ValueError):
        return False
    return any(
        p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        for p in sig.parameters.values()
    )


def _one_level(sd: dict[str, Any]) -> dict[str, Any]:
    """A scheduler's state_dict copied one level deep (its lists and dicts: a torch
    scheduler replaces or mutates those; deeper values are numbers)."""
    return {k: copy.copy(v) if isinstance(v, (list, dict)) else v for k, v in sd.items()}


class _Held:
    """A tensor hyper-parameter (``lr=torch.tensor(...)``) as it was: the object the group
    held and a copy of its value (a scheduler fills it in place)."""

    __slots__ = ("obj", "value")

    def __init__(self, obj: torch.Tensor) -> None:
        self.obj, self.value = obj, obj.detach().clone()


def _hypers(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every parameter group's settings (all but its parameters), copied (a tensor's
    value too: a device copy, no sync)."""
    return [
        {k: _Held(v) if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
        for g in optimizer.param_groups
    ]


def _set_hypers(optimizer: torch.optim.Optimizer, hypers: list[dict[str, Any]]) -> None:
    """Put back what :func:`_hypers` copied: a tensor's object and, in place, its value
    (a fused optimizer, or a captured graph, holds that object)."""
    for group, values in zip(optimizer.param_groups, hypers, strict=True):
        for k, v in values.items():
            if isinstance(v, _Held):
                with torch.no_grad():
                    v.obj.copy_(v.value)
                group[k] = v.obj
            else:
                group[k] = v
