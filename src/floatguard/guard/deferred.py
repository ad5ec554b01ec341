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
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from floatguard.guard.read import Packed
from floatguard.guard.types import Closure, StepResult

__all__ = ["Mailbox", "Pending", "PendingResult", "SpeculativeUpdate"]


_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}


class Mailbox:
    """The host copy of a packed read: a (pinned, on CUDA) buffer filled without
    blocking, and an event; :meth:`take` waits for the event only (no tensor read) and
    returns the values through a numpy view made once."""

    def __init__(self) -> None:
        self.host: torch.Tensor | None = None
        self.view: Any = None
        self.event: Any = None

    def post(self, packed: torch.Tensor) -> None:
        t = packed.detach().reshape(-1)
        if t.dtype not in (torch.float32, torch.float64):
            t = t.double()
        if self.host is None or self.host.shape != t.shape or self.host.dtype != t.dtype:
            if t.is_cuda:  # page-locked, so the copy can run without the host waiting
                self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                self.view = self.host.numpy()  # (a host tensor's view, made once)
            else:  # the numpy buffer first, the tensor over it: nothing read, ever
                self.view = np.empty(tuple(t.shape), dtype=_NUMPY[t.dtype])
                self.host = torch.from_numpy(self.view)
        self.host.copy_(t, non_blocking=t.is_cuda)
        self.event = None
        if t.is_cuda:
            self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self.event.record()

    def ready(self) -> bool:
        """Whether the copy has landed (no wait)."""
        return self.event is None or bool(self.event.query())

    def take(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()  # waits for the copy, not for a read of the device
        values: list[float] = self.view.tolist()
        return values


def frozen(closure: Closure) -> Closure:
    """``closure`` with the variables it reads bound to their values now, for a replay
    when the step settles a call later: a loop's ``lambda: loss(model(x), y)`` reads
    ``x`` and ``y`` when called, and by then they are the next batch's. A plain function
    gets its closure cells copied (a loop inside a function) and, when it reads module
    globals (a loop in a script), a shallow copy of its globals; defaults stay bound.
    Anything else (a bound method, a partial, a callable object) is kept as it is: bind
    the batch yourself (``lambda x=x, y=y: ...``)."""
    if not isinstance(closure, types.FunctionType):
        return closure
    code = closure.__code__
    cells = None
    if closure.__closure__ is not None:
        cells = tuple(_frozen_cell(c) for c in closure.__closure__)
    glob = closure.__globals__
    if code.co_names and any(n in glob for n in code.co_names):
        glob = dict(glob)
    f = types.FunctionType(code, glob, closure.__name__, closure.__defaults__, cells)
    f.__kwdefaults__ = closure.__kwdefaults__
    return f


def _frozen_cell(cell: Any) -> Any:
    try:
        return types.CellType(cell.cell_contents)
    except ValueError:  # an empty cell (a name not yet bound): keep the live one
        return cell


class SpeculativeUpdate:
    """``optimizer.step()`` gated on a device flag, and undone on the host's word."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.host_saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.ok: torch.Tensor | None = None
        self.known: frozenset[int] = frozenset()
        self._key: list[Any] = []
        self._buffers: list[torch.Tensor] = []
        self.uncopied = False

    def _targets(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        out = list(params)
        for p in params:
            for v in self.optimizer.state.get(p, {}).values():
                if isinstance(v, torch.Tensor):
                    out.append(v)
        return out

    def can_gate(self, params: list[torch.Tensor]) -> bool:
        """Whether this step's update can be gated: the optimizer already keeps state for
        exactly these parameters (its first update creates the state)."""
        return bool(params) and frozenset(id(p) for p in params) == self.known

    def after_exact(self, params: list[torch.Tensor]) -> None:
        """An exact step updated ``params``: their optimizer state now exists."""
        self.known = frozenset(id(p) for p in params)

    def fused(self) -> bool:
        """Whether the optimizer skips an update on the device by itself: torch's fused
        Adam, AdamW and SGD take ``found_inf`` (GradScaler's flag) and leave weights,
        moments and step counters as they were when it is 1."""
        opt = self.optimizer
        return isinstance(opt, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)) and all(
            bool(g.get("fused")) for g in opt.param_groups
        )

    def run(
        self,
        params: list[torch.Tensor],
        ok: torch.Tensor,
        clip: Callable[[], None],
        step: Callable[[], None],
        undoable: bool = True,
    ) -> None:
        """Copy the parameters and optimizer tensors, clip, step, and keep the update
        only where ``ok`` (a device bool): ``where(ok, new, old)``. Optimizer tensors on
        another device than ``ok`` (Adam's CPU ``step`` on a CUDA run) are put back by
        the host when it settles the step (before the next step runs). ``undoable=False``
        (the host will not overrule the device: every spike detector compares on the
        device) with a fused optimizer: no copies, ``found_inf = not ok`` handed to the
        optimizer, which skips on the device."""
        self.uncopied = False
        if not undoable and self.fused():
            clip()
            opt: Any = self.optimizer
            opt.found_inf = (~ok).to(torch.float32)
            try:
                step()
            finally:
                del opt.found_inf
            self.saved, self.host_saved, self.ok, self.uncopied = [], [], ok, True
            return
        targets = self._targets(params)
        dev = ok.device
        same = [t for t in targets if t.device == dev]
        self.saved = list(zip(same, self._copies(same), strict=True))
        self.host_saved = [(t, t.detach().clone()) for t in targets if t.device != dev]
        try:
            clip()
            step()
        except BaseException as e:
            self.undo()  # a step is applied whole or not at all
            raise RuntimeError(
                f"floatguard: the deferred update raised ({type(e).__name__}: {e}); the "
                "step's copies were put back: weights and optimizer state are as before it"
            ) from e
        with torch.no_grad():
            for t, old in self.saved:
                torch.where(ok, t, old, out=t)
        self.ok = ok

    def _copies(self, targets: list[torch.Tensor]) -> list[torch.Tensor]:
        """The targets copied into buffers kept from step to step (one foreach copy; new
        buffers only when the targets change)."""
        key = [(id(t), t.shape, t.dtype) for t in targets]
        if key != self._key:
            self._buffers = [torch.empty_like(t) for t in targets]
            self._key = key
        if targets:
            with torch.no_grad():
                torch._foreach_copy_(self._buffers, [t.detach() for t in targets])
        return self._buffers

    def undo(self) -> None:
        """Put back what the update changed (the host decided against the step)."""
        if self.uncopied and self.ok is not None:
            raise RuntimeError(
                "a fused optimizer's update, kept on the device with found_inf, cannot be "
                "undone: no copies were kept (the weights hold this step's update)"
            )
        with torch.no_grad():
            for t, old in self.saved + self.host_saved:
                t.copy_(old)
        self.release()

    def settled(self, applied: bool) -> None:
        """The host learned the device's verdict: a step the device blocked gets its
        host-side optimizer tensors back too."""
        if not applied:
            with torch.no_grad():
                for t, old in self.host_saved:
                    t.copy_(old)
        self.release()

    def release(self) -> None:
        self.saved, self.host_saved, self.ok = [], [], None


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
