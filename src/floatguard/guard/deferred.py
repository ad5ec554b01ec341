"""The deferred mode (``Guard(sync="deferred")``): decide on the device, learn on the host
a step later.

A deferred step runs the closures as the exact mode does, packs the step's read on the
device (:meth:`StepReader.pack <floatguard.guard.read.StepReader.pack>`), and instead of
reading it:

- computes the device verdict ``ok`` (loss and gradient norm finite, no fp16 overflow);
- clips on the device (``clip_grad_norm_``'s coefficient from the device norm, or the
  value clamp) and runs ``optimizer.step()`` *gated*: parameters and the optimizer's
  device tensors are copied first, and put back with ``torch.where(ok, new, old)``
  after the update (any ``torch.optim`` optimizer; exact: an element is either the
  update's or the old value). So a bad step changes no weight whether or not the host
  has looked yet;
- posts the packed read (and ``ok``) to a host mailbox: a pinned buffer filled by a
  non-blocking copy, with a CUDA event (on CPU the copy is a plain copy), read through
  a numpy view once it is ready, no tensor read at all.

The host *settles* the step later (:class:`Pending`): at the latest when the next step
begins (also at :meth:`Guard.backward`, ``record_loss``, ``finish``, ``close``, the state
methods, or when the step's :class:`PendingResult` is read: the user's explicit sync).
Settling decodes the mailbox and runs the exact mode's judgement and actor on it: a step
the policy applies and the device applied is only booked (scheduler, scaler growth,
detectors); a step the policy does not apply (a spike, a skipped batch, a rollback, a
stop) that the device applied is undone from the copies first; a bad step is localized
by replay (its closures and RNG are kept until then). The response lands before the
next step runs.

Host reads: none on a step run this way. The guard runs a step in the exact mode (one
read) when the deferred one cannot decide it: the first step (the optimizer has no
state to gate yet), a step whose set of parameters with gradients changed, and the
snapshot steps (their state is vetted in the read).
"""

from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass, fields
from typing import Any

import torch

from floatguard.guard.read import Packed
from floatguard.guard.speculative import Mailbox, SpeculativeUpdate, frozen
from floatguard.guard.types import Closure, StepResult

__all__ = ["DeferredStepper", "Pending", "PendingResult"]


_LAZY = frozenset(f.name for f in fields(StepResult)) - {"step"}


class PendingResult(StepResult):
    """A deferred step's :class:`StepResult`: ``step`` is known at once; reading any
    other field settles the step first (waits for its read: the caller's explicit
    sync) and returns the decided value. A step whose settling raised (a GuardStopped
    decided for it) raises that again when read. Until it is decided it holds its
    guard (an unread step can still be settled through it); a decided result does
    not keep its guard alive."""

    def __init__(self, step: int, stepper: DeferredStepper) -> None:
        object.__setattr__(self, "step", step)
        object.__setattr__(self, "_stepper", stepper)
        object.__setattr__(self, "_decided", None)
        object.__setattr__(self, "_error", None)

    def __getattribute__(self, name: str) -> Any:
        if name in _LAZY:
            decided = object.__getattribute__(self, "_decided")
            if decided is None:
                decided = object.__getattribute__(self, "_resolve")()
            return getattr(decided, name)
        return object.__getattribute__(self, name)

    def _resolve(self) -> StepResult:
        error = object.__getattribute__(self, "_error")
        if error is not None:
            raise error
        stepper = object.__getattribute__(self, "_stepper")
        step = object.__getattribute__(self, "step")
        if stepper is None:
            raise RuntimeError(f"floatguard: step {step} was never decided")
        stepper.settle()
        error = object.__getattribute__(self, "_error")
        if error is not None:
            raise error
        decided: StepResult | None = object.__getattribute__(self, "_decided")
        if decided is None:
            raise RuntimeError(f"floatguard: step {step} was never decided")
        return decided

    def decide(self, result: StepResult) -> None:
        object.__setattr__(self, "_decided", result)
        object.__setattr__(self, "_stepper", None)

    def fail(self, error: BaseException) -> None:
        """The step's settling raised ``error`` (reading the result raises it again)."""
        object.__setattr__(self, "_error", error)
        object.__setattr__(self, "_stepper", None)

    @property
    def settled(self) -> bool:
        """Whether the host has decided this step (reading it then costs nothing)."""
        return object.__getattribute__(self, "_decided") is not None


@dataclass
class Pending:
    """A deferred step waiting for the host: its packed read and mailbox, its closures
    (for a replay), its speculative update and its result."""

    step: int
    packed: Packed
    closures: list[Closure]
    mailbox: Mailbox
    update: SpeculativeUpdate
    result: PendingResult
    last_update: Any = None


class DeferredStepper:
    """Runs the deferred half of a step (:meth:`start`: pack, device verdict, gated
    update, mailbox) and settles it (:meth:`settle`: the exact mode's judgement and
    actor on the mailbox's copy). ``crew``/``end``: the guard's collaborators and its
    step end (:class:`~floatguard.guard.conclude.StepEnd`)."""

    def __init__(
        self, crew: Any, end: Any, optimizer: torch.optim.Optimizer, model: torch.nn.Module
    ) -> None:
        self._c, self._end = crew, end
        self.update = SpeculativeUpdate(optimizer)
        self.mailbox = Mailbox()
        self.pending: Pending | None = None
        self.deferred_steps = 0
        # The three-call loop runs the next forward before any guard call: the pending
        # step is settled when a forward with grad enabled begins, so a rollback or an
        # undo lands before the forward reads the weights (a no_grad evaluation forward
        # does not wait for the host).
        # (held weakly: a guard dropped without close() is collected and lets go of its
        # snapshot folder, as in the exact mode; the hook then does nothing)
        me = weakref.ref(self)

        def before_forward(module: torch.nn.Module, args: Any) -> None:
            stepper = me()
            if stepper is not None and stepper.pending is not None and torch.is_grad_enabled():
                stepper.settle()

        self._hook = model.register_forward_pre_hook(before_forward, prepend=True)
        weakref.finalize(self, self._hook.remove)

    def remove(self) -> None:
        """Detach the forward hook (the guard is closed)."""
        self._hook.remove()

    def can_defer(self, closures: bool) -> bool:
        """Whether this step's update can be gated on the device (see the module).
        ``closures``: the step's forward is a closure the guard runs (after settling the
        step before); else the caller ran it, and a spike detector without a bar the
        device can compare with (``detector="lesson"``) would leave a spike's undo to
        the host after the next forward ran on the speculative weights."""
        params, _, _ = self._c.reader.params_with_grads()
        if not closures:
            sw = self._c.spike_watch
            if any(d is not None and d.bar() is None for d in (sw.loss, sw.grad_norm)):
                return False
        return self.update.can_gate(params)

    def params(self) -> list[torch.Tensor]:
        """This step's parameters with a gradient (what its update will touch)."""
        params: list[torch.Tensor] = self._c.reader.params_with_grads()[0]
        return params

    def after_exact(self, updated: list[torch.Tensor]) -> None:
        """An exact step applied an update to ``updated``: whatever state the optimizer
        keeps for them exists now (none for plain SGD), so their next updates can be
        gated."""
        self.update.after_exact(updated)

    def start(self, step: int, closures: list[Closure]) -> PendingResult:
        """The step's read packed, its update gated on the device, its read posted."""
        c = self._c
        packed: Packed = c.reader.pack(step, c.runner.mean_loss())
        head = packed.head  # the agreed found, norm and loss (the same on every rank)
        ok = head.device_ok()
        # a spike against the detectors' bars (host floats as of the step before: what
        # the exact mode's check compares with), in float64 as the host compares
        sw = c.spike_watch
        for detector, value in ((sw.loss, head.loss), (sw.grad_norm, head.norm)):
            bar = detector.bar() if detector is not None else None
            if bar is not None and bar < math.inf:
                ok = ok & ~(value.double() > bar)
        if c.run.ladder.skip_remaining > 0:  # a batch the policy skips after a rollback
            ok = ok & False
        params, grads, _ = c.reader.params_with_grads()
        lr_factor = c.run.ladder.lr_factor
        last_update = c.updates.last()  # the last update that stood, until this one does
        # the host can only overrule the device where a detector has no bar to compare
        # on the device (lesson): then the update is kept undoable (copies)
        undoable = any(d is not None and d.bar() is None for d in (sw.loss, sw.grad_norm))
        self.update.run(
            params, ok,
            lambda: c.clipper.apply_on_device(params, grads, head.norm),
            lambda: c.actor.optimizer_step(lr_factor), undoable,
        )  # fmt: skip
        c.state.gate_buffers(ok)  # the forward's running statistics, gated alike
        self.mailbox.post(
            torch.cat([packed.tensor.reshape(-1), ok.reshape(1).to(packed.tensor.dtype)])
        )
        result = PendingResult(step, self)
        self.pending = Pending(
            step, packed, [frozen(f) for f in closures], self.mailbox, self.update, result,
            last_update,
        )  # fmt: skip
        self.deferred_steps += 1
        return result

    def settle(self) -> StepResult | None:
        """Decide the pending step, if any: its read from the mailbox, then the exact
        mode's judgement and actor (the device update booked, undone or redone)."""
        p = self.pending
        if p is None:
            return None
        self.pending = None
        c = self._c
        values = p.mailbox.take()
        kept = values[-1] > 0
        read = c.reader.decode(p.packed, values[:-1])
        c.run.stage = "deciding"
        own = c.updates.last()
        c.updates.restore(p.last_update)  # the judge asks about the update before this step
        healthy = read.finite_loss and not read.gradient_overflow
        if kept and healthy and c.spike_watch.check(read.loss, read.grad_norm) is not None:
            # a spike is replayed to see whether it reproduces: on the weights the step
            # found, as the exact mode does; the host then applies it or not
            p.update.undo()
            kept = False
        try:
            verdict = c.judge.judge(p.step, read, p.closures, ([], []), c.run.ladder,
                                    c.run.previous_applied)  # fmt: skip
            result: StepResult = self._end.act(p.step, read, verdict, p.closures, (p.update, kept))
            if result.action == "applied" and kept:  # the device's update stands
                c.updates.restore(own)
        except BaseException as e:
            p.result.fail(e)
            if not c.run.applied():  # as the exact mode: the step leaves no trace
                try:
                    p.update.undo()
                except RuntimeError as kept_anyway:  # a fused update: no copies to undo
                    warnings.warn(f"floatguard: step {p.step}: {kept_anyway}", RuntimeWarning,
                                  stacklevel=2)  # fmt: skip
                c.run.step_count = p.step
                c.scratch.undo()
                c.keeper.abort_step()
            raise
        finally:
            c.run.stage = "idle"
        p.result.decide(result)
        return result
