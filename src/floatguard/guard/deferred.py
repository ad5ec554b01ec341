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

The step's work (gradients, losses, batch) is held apart at once, so the next step
begins clean. The host *settles* the step later (:class:`Pending`): a closure step runs
its forward and backward first and settles after (:meth:`DeferredStepper.run_ahead`: the
host waits for the read while the device works); otherwise when the next step begins,
when a forward with grad enabled begins, at ``finish``, ``close``, the state methods,
or when the step's :class:`PendingResult` is read (the user's explicit sync). Work the
next step began is held apart while the step settles, and run again (or, without
closures to run it from, skipped) where the settling changed what it used.
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
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from floatguard.guard.pending import Pending, PendingResult
from floatguard.guard.read import Packed
from floatguard.guard.speculative import Mailbox, SpeculativeUpdate, frozen
from floatguard.guard.types import Closure, StepResult
from floatguard.stability.step_state import set_rng_state

__all__ = ["DeferredStepper", "Pending", "PendingResult"]


class _SettleFirst(BaseException):
    """A settling asked for while the next step runs ahead of it (its closure reads the
    step before's result): the run ahead is dropped, the step settled, then run again.
    (A BaseException: the closure's own ``except Exception`` does not swallow it.)"""


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
        self.ahead_steps = 0  # steps whose forward and backward ran before the settling
        # what a settling changed that the next step's begun work used: "rolled_back",
        # "update" (undone or redone), "scale" (the fp16 loss scale, by scale_ratio),
        # "raised"; None: nothing
        self.stale: str | None = None
        self.scale_ratio = 1.0
        self._ahead = self._settling_ahead = False
        self.settling: int | None = None  # the step being settled
        self._running_stats = self._c.state.has_running_stats()
        # The three-call loop runs the next forward before any guard call: the pending
        # step is settled when a forward with grad enabled begins, so a rollback or an
        # undo lands before the forward reads the weights (a no_grad evaluation forward
        # does not wait for the host).
        # (held weakly: a guard dropped without close() is collected and lets go of its
        # snapshot folder, as in the exact mode; the hook then does nothing)
        me = weakref.ref(self)

        def before_forward(module: torch.nn.Module, args: Any) -> None:
            stepper = me()
            if (
                stepper is not None
                and stepper.pending is not None
                and not stepper._ahead
                and torch.is_grad_enabled()
            ):
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
        ok = self.verdict(packed)
        if c.run.ladder.skip_remaining > 0:  # a batch the policy skips after a rollback
            ok = ok & False
        last_update = c.updates.last()  # the last update that stood, until this one does
        self.gated_update(packed, ok, c.run.ladder.lr_factor)
        c.channel.read_sent()
        return self.pend(step, packed, closures, last_update)

    def verdict(self, packed: Packed, bars: torch.Tensor | None = None) -> torch.Tensor:
        """The device's ``ok``: the agreed found, norm and loss (the same on every rank)
        finite and no overflow, and no spike against the detectors' bars: host floats
        as of the step before (what the exact mode's check compares with), or ``bars``,
        a float64 device copy of them (loss, norm: a captured step's), compared in
        float64 as the host compares."""
        head = packed.head
        ok = head.device_ok()
        sw = self._c.spike_watch
        for i, (detector, value) in enumerate(((sw.loss, head.loss), (sw.grad_norm, head.norm))):
            if detector is None:
                continue
            if bars is not None:
                ok = ok & ~(value.double() > bars[i])
                continue
            bar = detector.bar()
            if bar is not None and bar < math.inf:
                ok = ok & ~(value.double() > bar)
        return ok

    def undoable(self) -> bool:
        """Whether the host may overrule the device (a spike detector without a bar the
        device can compare with: ``lesson``): the update is then kept undoable (copies,
        even for a fused optimizer)."""
        sw = self._c.spike_watch
        return any(d is not None and d.bar() is None for d in (sw.loss, sw.grad_norm))

    def gated_update(
        self,
        packed: Packed,
        ok: torch.Tensor,
        lr_factor: float,
        zstate: torch.Tensor | None = None,
        record: bool = True,
    ) -> None:
        """Clip on the device, ``optimizer.step()`` gated on ``ok``, the running
        statistics gated alike, the read and ``ok`` posted to the mailbox (``record``:
        with its event; ``zstate``: ZClip's state as a device copy, see
        :meth:`Clipper.apply_on_device <floatguard.stability.clipper.Clipper.apply_on_device>`)."""
        c = self._c
        params, grads, _ = c.reader.params_with_grads()
        norm = packed.head.norm
        self.update.run(
            params, ok,
            lambda: c.clipper.apply_on_device(params, grads, norm, zstate),
            lambda: c.actor.optimizer_step(lr_factor), self.undoable(),
        )  # fmt: skip
        c.state.gate_buffers(ok)  # the forward's running statistics, gated alike
        self.mailbox.post(
            torch.cat([packed.tensor.reshape(-1), ok.reshape(1).to(packed.tensor.dtype)]),
            record,
        )

    def pend(
        self, step: int, packed: Packed, closures: list[Closure], last_update: Any
    ) -> PendingResult:
        """The step, gated on the device, left for the host to settle: its closures
        frozen for a replay, its work held apart (the gradients by reference: the next
        step begins clean, and may run before this one is settled)."""
        result = PendingResult(step, self)
        self.pending = Pending(
            step, packed, [frozen(f) for f in closures], self.mailbox, self.update, result,
            last_update,
        )  # fmt: skip
        self.deferred_steps += 1
        self.pending.held = held = self._c.scratch.hold()
        self.pending.inputs = [
            (t, t._version) for t in tree_flatten(held.batch)[0] if isinstance(t, torch.Tensor)
        ]
        self.pending.rng_after = self._c.state.rng_now()  # where the next step's draws begin
        return result

    def can_run_ahead(self, closures: list[Closure]) -> bool:
        """Whether the next step's forward and backward (its closures) may run before the
        pending step is settled (:meth:`run_ahead`): a step is pending, the guard runs
        the forward, no module keeps running statistics (BatchNorm: the settling may
        put them back), no hook monitor records the forward, no first snapshot is due,
        and the run is not distributed (the settling's collectives stay where every
        rank expects them)."""
        c = self._c
        return (
            self.pending is not None
            and bool(closures)
            and not self._running_stats
            and c.monitor is None
            and c.stats_monitor is None
            and not c.keeper.first_due
            and c.channel.peers is None
        )

    def begin(
        self,
        closures: list[Closure],
        replay: Sequence[Closure] | None,
        run: Callable[[list[Closure]], None],
    ) -> StepResult | tuple[list[Closure], Sequence[Closure] | None, bool]:
        """A step begins: the pending one is settled, after this step's forward and
        backward where they may run ahead (``run``). Returns what the step then runs:
        (closures, replay, whether its work already ran), or the step's result when the
        caller's work (a three-call loop whose forward the guard did not see begin) was
        computed on weights the settling changed and there is nothing to run it again
        from: skipped (a rollback's ``after_rollback`` batch; else ``transient``)."""
        if self.can_run_ahead(closures):
            self._c.channel.begin(self._c.run.step_count)
            if self.run_ahead(lambda: run(closures)):
                return [], closures, True
            return closures, replay, False
        self.settle()
        stale = self.take_stale()
        if stale is None or closures:
            return closures, replay, False
        c = self._c
        if stale == "scale":  # the caller's backward scaled by the scale before: rescaled
            grads = [p.grad for g in c.scratch.optimizer.param_groups for p in g["params"]
                     if p.grad is not None]  # fmt: skip
            if grads:
                torch._foreach_mul_(grads, self.scale_ratio)  # (a power of two: exact)
            return closures, replay, False
        c.scratch.hold()  # computed on weights since changed: dropped
        if replay:
            return list(replay), None, False  # run again by the guard
        if stale == "rolled_back":
            left = c.run.ladder.skip_remaining
            c.run.ladder = c.run.ladder.replace(skip_remaining=max(0, left - 1))
        result: StepResult = self._end.skipped_outside(
            "after_rollback" if stale == "rolled_back" else "transient", None, None
        )
        return result

    def run_ahead(self, run: Callable[[], None]) -> bool:
        """Run the next step's forward and backward (``run``), then settle the pending
        step: on a GPU the host waits for the pending step's read while the device works
        on the next step. The pending step settles as if the next had not begun (the
        RNG as it was; the begun work held apart). True: the begun work stands (put
        back, the RNG as after it). False: the settling changed what it used (an undo,
        a redo, a rollback, the loss scale): it is dropped, to be run again."""
        c = self._c
        entry = c.state.rng_now()
        self._ahead = True
        try:
            run()
        except _SettleFirst:  # the closure asked for the step before (read its result):
            self._ahead = False  # settled first, then the step runs from the start
            c.scratch.hold()
            set_rng_state(entry)
            self.settle()
            self.take_stale()
            return False
        except BaseException:
            self._ahead = False
            c.scratch.hold()  # (dropped: the step did not happen)
            set_rng_state(entry)
            self.settle()
            raise
        finally:
            self._ahead = False
        after = c.state.rng_now()
        set_rng_state(entry)
        self._settling_ahead = True  # (the RNG put back where this step began)
        try:
            self.settle()
        except BaseException:
            c.scratch.hold()
            raise
        finally:
            self._settling_ahead = False
        if self.take_stale() is not None:
            c.scratch.hold()
            return False
        set_rng_state(after)
        self.ahead_steps += 1
        return True

    def take_stale(self) -> str | None:
        """What the last settling changed after the next step's work had begun (the
        weights, the optimizer's state, the loss scale: see ``stale``), and forget it."""
        stale, self.stale = self.stale, None
        return stale

    def settle(self) -> StepResult | None:
        """Decide the pending step, if any: its read from the mailbox, then the exact
        mode's judgement and actor (the device update booked, undone or redone)."""
        p = self.pending
        if p is None:
            return None
        if self._ahead:  # asked from inside the next step's closure, running ahead
            raise _SettleFirst
        self.pending = None
        c = self._c
        begun = c.scratch.hold()  # the next step's work, if it began: kept apart
        c.scratch.put(p.held)
        scale = c.runner.scaler.get_scale()
        changed: str | None = "raised"
        try:
            result, device_kept = self._decide(p)
            changed = None
            if result.action == "rolled_back":
                changed = "rolled_back"
            elif device_kept != (result.action == "applied"):
                changed = "update"  # undone, or redone
            elif c.runner.scaler.get_scale() != scale:
                changed = "scale"
        finally:
            self.settling = None
            c.scratch.put(begun)
            if changed is not None:
                # weights written in place: a cast autocast cached (a settling inside the
                # caller's autocast, at its forward) is stale
                torch.clear_autocast_cache()
            if begun and changed is not None:
                self.stale = changed
                self.scale_ratio = c.runner.scaler.get_scale() / scale
            if begun and not self._settling_ahead and p.rng_after is not None:
                # the caller's forward drew before this settling: the next step's replays
                # start where it began, as the step before returned (the exact mode's)
                c.state.rng = p.rng_after
        return result

    def _decide(self, p: Pending) -> tuple[StepResult, bool]:
        c = self._c
        self.settling = p.step
        values = p.mailbox.take()
        kept = device_kept = values[-1] > 0
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
            if (verdict.fault is not None or verdict.spike is not None) and p.refilled():
                warnings.warn(
                    f"floatguard: step {p.step}'s inputs were written in place after the "
                    "step (a reused input buffer): its replay saw other data, so what it "
                    "found (a transient fault, a spike that does not reproduce) is about "
                    "that data; call guard.settle() before refilling the buffer, or pass "
                    "fresh tensors", RuntimeWarning, stacklevel=3,
                )  # fmt: skip
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
        return result, device_kept
