"""The response policy: (evidence, state) -> decision; pure Python, no torch, tested as a table.

Words used here:

- *evidence*: what the step's read and (on a bad step) the localization found, as
  plain values: is the loss finite, did the gradients overflow, can the loss scale
  still back off, the localized fault's facts, a spike and whether its replay
  reproduced it, whether the step before was applied, whether a clean snapshot exists.
- *state*: the ladder's counters (:class:`LadderState`), saved with each snapshot in
  exactly the keys earlier versions wrote (``to_meta`` / ``from_meta``).
- *decision*: what to do with the step (apply, skip, back the loss scale off, roll
  back, stop), the cause in the one vocabulary (:mod:`floatguard.causes`), and what
  to log (an LR back-off, a warning, the stop's reason and message).

:func:`decide` is the judgement; :func:`applied`, :func:`snapshot_taken` and
:func:`resumed` are the transitions the guard reports back. Each returns a new
state; nothing here touches a tensor, so every rule is one row of a table test
(``tests/guard/test_policy.py``) and one row of the table in ``docs/guard.md``.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from floatguard.causes import Cause, StopReason

if TYPE_CHECKING:
    from floatguard.stability.respond import ResponsePolicy

__all__ = [
    "Decision",
    "Evidence",
    "FaultFacts",
    "FaultKey",
    "LadderState",
    "Response",
    "applied",
    "cause_of_fault",
    "decide",
    "fault_key",
    "snapshot_taken",
]

Response = Literal["apply", "skip", "backoff_scale", "rollback", "stop"]
FaultKey = tuple[str, str, str, "str | None"]
SpikeSignal = Literal["loss_spike", "grad_norm_spike"]


class FaultFacts(Protocol):
    """What the policy reads of a fault (:class:`~floatguard.monitor.localize.Fault` has it)."""

    @property
    def phase(self) -> str: ...
    @property
    def module(self) -> str: ...
    @property
    def tensor(self) -> str: ...
    @property
    def op(self) -> str | None: ...
    @property
    def deterministic(self) -> bool | None: ...


def fault_key(fault: FaultFacts) -> FaultKey:
    """What makes two faults "the same fault" for the stop rule (a bad state tensor is
    the same fault whoever is known to have written it: the update, or outside it)."""
    return (fault.phase, fault.module, fault.tensor, None if fault.phase == "param" else fault.op)


@dataclass(frozen=True)
class Evidence:
    """What one step showed, as plain values (see the module's words)."""

    finite_loss: bool = True
    overflow: bool = False  # a gradient overflowed (fp16 found_inf) or the norm is non-finite
    scale_can_back_off: bool = False  # fp16 loss scaling on, and the scale above its floor
    fault: FaultFacts | None = None  # the localized fault (None: finite, or not localized)
    spike: SpikeSignal | None = None
    spike_reproduced: bool | None = None  # the spike's replay (None: not replayed)
    has_clean_snapshot: bool = True

    @property
    def finite(self) -> bool:
        return self.finite_loss and not self.overflow


@dataclass(frozen=True)
class LadderState:
    """The policy's counters. ``rolled_back_for``: the fault the last rollback answered
    (cleared by the next snapshot: training went on past it). ``input_recent``: for
    each of the last ``bad_data_window`` decided steps, whether its batch was bad."""

    good_steps: int = 0
    consecutive_bad: int = 0
    rollbacks: int = 0
    rollback_streak: int = 0
    good_since_rollback: int = 0
    transients: int = 0
    skip_remaining: int = 0
    lr_factor: float = 1.0
    lr_recover_from: float | None = None
    lr_recover_step: int = 0
    rolled_back_for: FaultKey | None = None
    input_streak: int = 0
    input_recent: tuple[bool, ...] = ()

    def replace(self, **changes: Any) -> LadderState:
        """``dataclasses.replace`` for this state of plain values, without its per-field
        machinery (~1 us against ~9: it runs on every step); an unknown name raises."""
        unknown = changes.keys() - _LADDER_FIELDS
        if unknown:
            raise TypeError(f"LadderState has no field(s) {sorted(unknown)}")
        new = copy.copy(self)
        for name, value in changes.items():
            object.__setattr__(new, name, value)
        return new

    def to_meta(self) -> dict[str, Any]:
        """The counters under the keys snapshots have always used (plus the new ones)."""
        return {
            "good": self.good_steps,
            "consecutive_bad": self.consecutive_bad,
            "rollbacks": self.rollbacks,
            "transients": self.transients,
            "rollback_streak": self.rollback_streak,
            "good_since_rollback": self.good_since_rollback,
            "skip_remaining": self.skip_remaining,
            "lr_factor": self.lr_factor,
            "lr_recover_from": self.lr_recover_from,
            "lr_recover_step": self.lr_recover_step,
            "input_streak": self.input_streak,
            "input_recent": list(self.input_recent),
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> LadderState:
        """The inverse of :meth:`to_meta`; keys a snapshot does not have take defaults."""
        recover = meta.get("lr_recover_from")
        return cls(
            good_steps=int(meta.get("good", 0)),
            consecutive_bad=int(meta.get("consecutive_bad", 0)),
            rollbacks=int(meta.get("rollbacks", 0)),
            rollback_streak=int(meta.get("rollback_streak", 0)),
            good_since_rollback=int(meta.get("good_since_rollback", 0)),
            transients=int(meta.get("transients", 0)),
            skip_remaining=int(meta.get("skip_remaining", 0)),
            lr_factor=float(meta.get("lr_factor", 1.0)),
            lr_recover_from=None if recover is None else float(recover),
            lr_recover_step=int(meta.get("lr_recover_step", 0)),
            input_streak=int(meta.get("input_streak", 0)),
            input_recent=tuple(bool(b) for b in meta.get("input_recent", ())),
        )


_LADDER_FIELDS = frozenset(f.name for f in dataclasses.fields(LadderState))


@dataclass(frozen=True)
class Decision:
    """What to do with one step, why, and what to log.

    ``response``: "apply", "skip", "backoff_scale" (skip and back the fp16 loss scale
    off), "rollback" (restore the last clean snapshot) or "stop" (raise
    :class:`~floatguard.stability.respond.GuardStopped`). ``cause``: None when applied.
    ``lr_backoff``: the LR factor was multiplied by ``lr_backoff_factor`` (an
    ``lr_backoff`` event). ``warning``: a warning event's message. ``stop`` and
    ``message``: the stop's reason and text. ``restore``: before stopping, restore the
    last clean snapshot (the model holds a non-finite or absurd value, and a stopped
    run must not be left so). ``state``: the counters after this step.
    """

    response: Response
    cause: Cause | None
    state: LadderState = field(repr=False)
    lr_backoff: bool = False
    warning: str | None = None
    stop: StopReason | None = None
    message: str | None = None
    restore: bool = False


# The causes where the model itself holds the bad value: answered by a rollback, and a
# stop restores the last clean snapshot first.
_BAD_STATE = frozenset(
    {"nonfinite_param", "nonfinite_optimizer_state", "optimizer_update", "nonfinite_buffer"}
)


def cause_of_fault(fault: FaultFacts | None, finite_loss: bool) -> Cause:
    """The cause a localized (or unlocalized) non-finite step is answered for."""
    if fault is None:
        return "nonfinite_loss" if not finite_loss else "nonfinite_grad"
    if fault.phase == "param":
        if fault.tensor.startswith("optimizer:"):
            return "nonfinite_optimizer_state"
        if fault.tensor.startswith("buffer:"):
            return "nonfinite_buffer"
        if fault.op == "optimizer.step":
            return "optimizer_update"
        return "nonfinite_param"
    if fault.deterministic is False:
        return "transient"
    if fault.phase == "input":
        return "nonfinite_input"
    return "nonfinite_loss" if not finite_loss else "nonfinite_grad"


def decide(evidence: Evidence, state: LadderState, policy: ResponsePolicy) -> Decision:
    """The response to one step, by cause (see ``docs/guard.md``, "The judgement")."""
    if evidence.finite_loss and evidence.overflow and evidence.scale_can_back_off:
        return Decision("backoff_scale", "overflow", _input_seen(state, policy, False))
    bad_state = evidence.fault is not None and evidence.fault.phase == "param"
    if not evidence.finite or bad_state:  # (a bad state is found on a finite step too)
        return _on_fault(evidence, state, policy)
    state = _input_seen(state, policy, False)
    if evidence.spike is not None:
        if evidence.spike_reproduced is False:
            return _transient(state, policy, "transient")
        return _ladder(evidence, state, policy, evidence.spike)
    if state.skip_remaining > 0:
        state = state.replace(skip_remaining=state.skip_remaining - 1)
        return Decision("skip", "after_rollback", state)
    return Decision("apply", None, state)


def _on_fault(evidence: Evidence, state: LadderState, policy: ResponsePolicy) -> Decision:
    fault = evidence.fault
    cause = cause_of_fault(fault, evidence.finite_loss)
    again = (
        fault is not None
        and bool(fault.deterministic)
        and state.rolled_back_for == fault_key(fault)
    )
    if cause in _BAD_STATE:
        state = _input_seen(state, policy, False)
        if again:
            return _stop(state, cause, "repeated_fault", fault, restore=True)
        return _rollback(evidence, state, policy, cause, lr_backoff=False)
    if cause == "transient":
        return _transient(_input_seen(state, policy, False), policy, cause)
    if cause == "nonfinite_input":
        return _bad_batch(state, policy)
    state = _input_seen(state, policy, False)
    if again:
        return _stop(state, cause, "repeated_fault", fault)
    return _ladder(evidence, state, policy, cause)


def _ladder(
    evidence: Evidence, state: LadderState, policy: ResponsePolicy, cause: Cause
) -> Decision:
    """Skip; after ``lr_backoff_after`` bad steps in a row back the LR off; after
    ``rollback_after`` roll back (and back the LR off once more)."""
    state = state.replace(consecutive_bad=state.consecutive_bad + 1)
    if state.consecutive_bad >= policy.rollback_after:
        return _rollback(evidence, state, policy, cause, lr_backoff=True)
    if state.consecutive_bad >= policy.lr_backoff_after:
        return Decision("skip", cause, _back_off_lr(state, policy), lr_backoff=True)
    return Decision("skip", cause, state)


def _back_off_lr(state: LadderState, policy: ResponsePolicy) -> LadderState:
    """The one LR back-off: multiply the factor, then recover linearly from there."""
    factor = state.lr_factor * policy.lr_backoff_factor
    return state.replace(lr_factor=factor, lr_recover_from=factor, lr_recover_step=0)


def _rollback(
    evidence: Evidence,
    state: LadderState,
    policy: ResponsePolicy,
    cause: Cause,
    *,
    lr_backoff: bool,
) -> Decision:
    fault = evidence.fault
    streak = 0 if state.good_since_rollback >= policy.rollback_window else state.rollback_streak
    state = state.replace(rollback_streak=streak + 1, good_since_rollback=0)
    restore = cause in _BAD_STATE
    if state.rollback_streak > policy.max_rollbacks:
        return _stop(
            state,
            cause,
            "max_rollbacks",
            fault,
            restore=restore,
            max_rollbacks=policy.max_rollbacks,
        )
    if not evidence.has_clean_snapshot:
        return _stop(state, cause, "no_clean_snapshot", fault)
    state = state.replace(
        rollbacks=state.rollbacks + 1,
        consecutive_bad=0,
        skip_remaining=policy.skip_batches,
        rolled_back_for=(
            fault_key(fault) if fault is not None and fault.deterministic else state.rolled_back_for
        ),
    )
    if lr_backoff:
        state = _back_off_lr(state, policy)
    return Decision("rollback", cause, state, lr_backoff=lr_backoff)


def _transient(state: LadderState, policy: ResponsePolicy, cause: Cause) -> Decision:
    state = state.replace(transients=state.transients + 1)
    warning = None
    if state.transients in (policy.transient_warn_after, 10 * policy.transient_warn_after):
        warning = (
            f"{state.transients} bad steps did not reproduce when replayed: suspect a "
            "nondeterministic kernel, a race (asynchronous copies, streams) or failing "
            "hardware"
        )
    return Decision("skip", cause, state, warning=warning)


def _input_seen(state: LadderState, policy: ResponsePolicy, bad: bool) -> LadderState:
    if not bad and state.input_streak == 0 and True not in state.input_recent:
        return state  # no bad batch in the window: nothing to slide (and no copy per step)
    recent = (*state.input_recent, bad)[-policy.bad_data_window :]
    return state.replace(input_streak=state.input_streak + 1 if bad else 0, input_recent=recent)


def _bad_batch(state: LadderState, policy: ResponsePolicy) -> Decision:
    """A non-finite batch is skipped (LR and scale unchanged, not a ladder step); a
    data pipeline that keeps producing them is warned about, then stopped."""
    state = _input_seen(state, policy, True)
    bad = sum(state.input_recent)
    seen = len(state.input_recent)
    fraction = bad / seen
    if state.input_streak >= policy.bad_data_stop_after or (
        seen >= policy.bad_data_stop_after and fraction >= policy.bad_data_stop_fraction
    ):
        message = (
            f"{state.input_streak} non-finite batches in a row, {bad} of the last {seen} "
            "steps: the data pipeline produces non-finite values; check the data (and "
            "its preprocessing) before training on"
        )
        return Decision("stop", "nonfinite_input", state, stop="bad_data", message=message)
    warning = None
    if state.input_streak == policy.bad_data_warn_after:
        warning = (
            f"{state.input_streak} non-finite batches in a row: the data pipeline may be "
            "producing non-finite values"
        )
    return Decision("skip", "nonfinite_input", state, warning=warning)


def _stop(
    state: LadderState,
    cause: Cause,
    reason: StopReason,
    fault: FaultFacts | None,
    *,
    restore: bool = False,
    max_rollbacks: int = 0,
) -> Decision:
    what = {
        "repeated_fault": "the same deterministic fault came back after a rollback; "
        "rolling back again would loop: fix the cause (see the fault's module, op and line)",
        "max_rollbacks": f"{max_rollbacks} rollbacks did not restore healthy steps; see the "
        "event log",
        "no_clean_snapshot": "a rollback was needed and no clean snapshot is left",
    }.get(reason, reason)
    return Decision("stop", cause, state, stop=reason, message=what, restore=restore)


def applied(state: LadderState, policy: ResponsePolicy) -> LadderState:
    """The step was applied: count it and recover the LR factor (linearly)."""
    step, frac, factor, recover = state.lr_recover_step, 1.0, state.lr_factor, None
    if state.lr_recover_from is not None:
        step = state.lr_recover_step + 1
        frac = min(1.0, step / policy.lr_recovery_steps)
        factor = state.lr_recover_from + (1.0 - state.lr_recover_from) * frac
        recover = state.lr_recover_from if frac < 1.0 else None
        factor = factor if frac < 1.0 else 1.0
    return state.replace(
        good_steps=state.good_steps + 1,
        consecutive_bad=0,
        good_since_rollback=state.good_since_rollback + 1,
        lr_factor=factor,
        lr_recover_from=recover,
        lr_recover_step=step,
    )


def snapshot_taken(state: LadderState) -> LadderState:
    """A new clean snapshot: training went on past the fault the last rollback answered."""
    return state.replace(rolled_back_for=None)
