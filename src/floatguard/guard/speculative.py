"""The deferred mode's device half (:mod:`floatguard.guard.deferred` settles it): the
update gated on a device flag (:class:`SpeculativeUpdate`), the host mailbox the
step's read is posted to (:class:`Mailbox`), and the step's closures frozen for a
replay a call later (:func:`frozen`)."""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from floatguard._foreach import local_groups
from floatguard._values import local_part
from floatguard.guard.types import Closure, GraphUnsafe

__all__ = ["Mailbox", "SpeculativeUpdate", "frozen"]


_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}


class Mailbox:
    """The host copy of a packed read: a (pinned, on CUDA) buffer filled without
    blocking, and an event; :meth:`take` waits for the event only (no tensor read) and
    returns the values through a numpy view made once."""

    def __init__(self) -> None:
        self.host: torch.Tensor | None = None
        self.view: Any = None
        self.event: Any = None
        self.cuda = False

    def post(self, packed: torch.Tensor, record: bool = True) -> None:
        """Copy ``packed`` to the host buffer without blocking; ``record``: and record
        the event the host waits on (a captured step records it after the replay:
        :meth:`mark`)."""
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
        self.event, self.cuda = None, t.is_cuda
        if record:
            self.mark()

    def mark(self) -> None:
        """Record the event the host waits on (CUDA; on the CPU the copy is done)."""
        self.event = None
        if self.cuda:
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
        self.versions: list[tuple[torch.Tensor, int]] = []

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
        self.versions = []
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
        except GraphUnsafe:
            self.undo()  # (a graphed step's check stopped it before an operator ran)
            raise
        except BaseException as e:
            self.undo()  # a step is applied whole or not at all
            raise RuntimeError(
                f"floatguard: the deferred update raised ({type(e).__name__}: {e}); the "
                "step's copies were put back: weights and optimizer state are as before it"
            ) from e
        with torch.no_grad():
            for t, old in self.saved:
                here = local_part(t)
                torch.where(ok, here, local_part(old), out=here)
        self.ok = ok
        self.versions = [(p, p._version) for p in params]  # (a write after it shows)

    def prepare(self, params: list[torch.Tensor], device: torch.device) -> None:
        """Make the copy buffers for ``params``' update now (a capture must not allocate
        what every replay reuses)."""
        same = [t for t in self._targets(params) if t.device == device]
        key = [(id(t), t.shape, t.dtype) for t in same]
        if key != self._key:
            self._buffers = [torch.empty_like(t) for t in same]
            self._key = key

    def _copies(self, targets: list[torch.Tensor]) -> list[torch.Tensor]:
        """The targets copied into buffers kept from step to step (one foreach copy; new
        buffers only when the targets change)."""
        key = [(id(t), t.shape, t.dtype) for t in targets]
        if key != self._key:
            self._buffers = [torch.empty_like(t) for t in targets]
            self._key = key
        if targets:  # (DTensors through their local parts: no collective)
            with torch.no_grad():
                for bufs, sources in local_groups(self._buffers, [t.detach() for t in targets]):
                    torch._foreach_copy_(bufs, sources)
        return self._buffers

    def state(self) -> tuple[Any, ...]:
        """What :meth:`run` left for the host (the copies, the flag, how it gated): a
        captured step's replays leave the same, put back with :meth:`rearm`."""
        return (list(self.saved), list(self.host_saved), self.ok, self.uncopied)

    def rearm(self, state: tuple[Any, ...]) -> None:
        """The state :meth:`state` returned (a captured step replayed: its copies and
        flag are the capture's buffers, refilled by the replay)."""
        saved, host_saved, self.ok, self.uncopied = state
        self.saved, self.host_saved = list(saved), list(host_saved)
        self.versions = [(t, t._version) for t, _ in self.saved]  # (a replay bumps none)

    def undo(self) -> None:
        """Put back what the update changed (the host decided against the step)."""
        if self.uncopied and self.ok is not None:
            raise RuntimeError(
                "a fused optimizer's update, kept on the device with found_inf, cannot be "
                "undone: no copies were kept (the weights hold this step's update)"
            )
        edited = sum(p._version != v for p, v in self.versions)
        if edited:
            warnings.warn(
                f"floatguard: {edited} parameter(s) were written in place after the step "
                "returned, before the host settled it; the step is undone from its copies, "
                "and that write with it (call guard.settle() before writing the weights, or "
                "use a spike detector with a bar, detector='robust', which never undoes)",
                RuntimeWarning,
                stacklevel=4,
            )
        with torch.no_grad():
            for t, old in self.saved + self.host_saved:
                local_part(t).copy_(local_part(old))
        self.release()

    def settled(self, applied: bool) -> None:
        """The host learned the device's verdict: a step the device blocked gets its
        host-side optimizer tensors back too."""
        if not applied:
            with torch.no_grad():
                for t, old in self.host_saved:
                    local_part(t).copy_(local_part(old))
        self.release()

    def release(self) -> None:
        self.saved, self.host_saved, self.ok, self.versions = [], [], None, []
