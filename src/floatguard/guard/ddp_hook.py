"""The step's read carried by DDP's own gradient all-reduce (the guard's comm hook).

Words used here:

- *the carried read*: a few numbers appended to DDP's last gradient bucket, in the
  bucket's dtype (float32 or float64): the loss, this rank's bad bit, whether this
  rank is in a guard step (*armed*: a count and a bit), then the exact step check's
  slots (:mod:`floatguard.guard.step_check`). Every last bucket carries them, armed or
  not, so the all-reduce has the same size on every rank: a backward outside
  guard.step() on one rank meets the others' guard step as an unarmed read (a
  GuardDesync naming it), never as a collective of another size (which crashes gloo).
- *the slot*: what is registered on the model (DDP takes one comm hook per model, for
  good): :class:`CommHookSlot` runs the open guard's :class:`DDPReadHook`, or DDP's
  default all-reduce once that guard is closed; a later guard on the same model takes
  the slot over (:func:`attach`).
- *the timed group*: the hook all-reduces on the guard's group created with
  ``peer_timeout_s`` (:class:`~floatguard.guard.peers.Peers`), so a silent peer ends
  DDP's backward with the backend's error after that long, which the guard explains
  (a CUDA bucket's wait belongs to NCCL's own watchdog).

Norm and overflow need no reduction (DDP's gradients are the same average on every
rank). Bad bits and armed bits name ranks below 24 (float32's mantissa); above, the
bad-step all-gather names the rank, and the armed count still catches the desync.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from floatguard.distributed import GuardDesync
from floatguard.guard.peers import Peers
from floatguard.guard.step_check import bad_ranks_of, differing, encode, slot_count

__all__ = ["Carried", "CommHookSlot", "DDPReadHook", "attach", "detach"]

_EXTRA_HEAD = 4  # loss, bad bits, armed count, armed bits; then the slots
_MANTISSA = {torch.float32: 24, torch.float64: 53}


@dataclass(frozen=True)
class Carried:
    """The carried read as summed over the ranks (host numbers)."""

    found: float
    norm_sq: float
    loss: float
    bad_ranks: tuple[int, ...]
    differs: tuple[str, ...]


class DDPReadHook:
    """The guard's comm hook, run by the model's :class:`CommHookSlot` (when the model
    has no hook of its own); without a pending read it is DDP's default all-reduce
    (gradients divided by the world size, then summed), plus the unarmed carried read on
    the last bucket."""

    def __init__(self, group: Any, peers: Peers) -> None:
        self.group = group
        self.peers = peers
        self.world = peers.world
        self.pending: tuple[torch.Tensor, torch.Tensor, int, int] | None = None
        self.result: torch.Tensor | None = None
        self.dtype: torch.dtype | None = None  # of the last carried read
        self.mine: list[float] = []  # this rank's slots in it

    def arm(self, loss: torch.Tensor, local_bad: torch.Tensor, step: int, fingerprint: int) -> None:
        """Set the read to send with the next backward's last bucket (device, no sync)."""
        self.pending, self.result = (loss, local_bad, step, fingerprint), None

    def _extras(self, dtype: torch.dtype, dev: torch.device) -> torch.Tensor | None:
        """This rank's carried read for a last bucket of ``dtype`` (None: none fits)."""
        m = _MANTISSA.get(dtype)
        n_slots = slot_count(self.world, m) if m is not None else 0
        if m is None or n_slots == 0:
            return None
        rank = self.peers.rank
        if self.pending is None:  # not in a guard step: zeros, armed 0
            return torch.zeros(_EXTRA_HEAD + n_slots, dtype=dtype, device=dev)
        loss, local_bad, step, fingerprint = self.pending
        bit = float(2**rank) if rank < 24 else 0.0
        self.mine = encode(step, fingerprint, self.world, m)
        fixed = torch.tensor([1.0, bit, *self.mine], dtype=dtype)
        head = torch.stack([loss.to(dtype).reshape(()), local_bad.to(dtype).reshape(()) * bit])
        return torch.cat([head.to(dev), fixed.to(dev)])

    def __call__(self, state: Any, bucket: Any) -> Any:
        import torch.distributed as dist

        buf = bucket.buffer()
        extra = self._extras(buf.dtype, buf.device) if bucket.is_last() else None
        armed = self.pending is not None and extra is not None
        if extra is not None:
            self.pending = None
        n = buf.numel()
        both = buf.div_(self.world) if extra is None else torch.cat([buf.div(self.world), extra])
        group = self.peers.timed if self.peers.timed is not None else self.group  # (finished)
        work = dist.all_reduce(both, group=group, async_op=True)
        self.peers.launched = "DDP's gradient all-reduce"
        fut = work.get_future().then(lambda f: f.value()[0])

        def split(f: Any) -> torch.Tensor:
            out: torch.Tensor = f.value()
            if armed:
                self.result, self.dtype = out[n:].clone(), out.dtype
            return out[:n]

        return fut if extra is None else fut.then(split)

    def take(self, found: torch.Tensor, norm: torch.Tensor) -> torch.Tensor | None:
        """The step's read as carried (float64: this rank's overflow flag and squared
        norm, then the summed extras), for :meth:`decode`; None when the hook did not
        carry it (no float32/64 last bucket: the guard then all-reduces its read)."""
        r, self.result = self.result, None
        if r is None:
            return None
        head = torch.stack([found.double().reshape(()), norm.double().reshape(()) ** 2])
        return torch.cat([head.to(r.device), r.double()])

    def decode(self, read: list[float], step: int) -> Carried:
        """:meth:`take`'s host copy. A rank that was not in guard step ``step`` (its
        backward ran outside guard.step()) is a GuardDesync naming it (the others are
        told: it never reads this); the step check's verdict is in ``differs``."""
        found, norm_sq, loss, bits, armed, armed_bits = read[:6]
        rank, w = self.peers.rank, self.world
        if armed != w:
            inside = set(bad_ranks_of(armed_bits, w, 24))
            out = tuple(r for r in range(min(w, 24)) if r not in inside)
            who = f"rank(s) {', '.join(map(str, out))}" if out else f"{w - int(armed)} rank(s)"
            raise self.peers.fail(
                GuardDesync(
                    f"rank {rank} stops at guard step {step}: DDP's gradient all-reduce of "
                    f"this guard step met a backward that {who} ran outside guard.step() (or "
                    "with another number of micro-batches): every rank must run each training "
                    "step's forward and backward inside guard.step()",
                    ranks=out,
                    step=step,
                ),
                tell=True,
            )
        if not math.isfinite(norm_sq) and bits == 0 and rank < 24:
            bits = float(2**rank)  # nobody's loss was bad: every rank saw the bad norm
        m = _MANTISSA.get(self.dtype or torch.float32, 24)
        differs = differing(read[6:], self.mine, w, m)
        return Carried(found, norm_sq, loss, bad_ranks_of(bits, w, 24), differs)


class CommHookSlot:
    """The comm hook floatguard registers on a DDP model, once: it runs ``target`` (the
    open guard's :class:`DDPReadHook`), or with none attached DDP's default all-reduce
    (gradients divided by the world size, then summed), so a model whose guard was
    closed trains on under DDP exactly as without floatguard."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.target: DDPReadHook | None = None

    def as_comm_hook(self) -> Any:
        """For ``register_comm_hook(None, ...)`` (unannotated: DDP checks annotations)."""
        return lambda state, bucket: self(state, bucket)

    def __call__(self, state: Any, bucket: Any) -> Any:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        target = self.target
        if target is not None:
            return target(state, bucket)
        return default_hooks.allreduce_hook(self.group, bucket)  # DDP's own default


_SLOTS: weakref.WeakKeyDictionary[nn.Module, CommHookSlot] = weakref.WeakKeyDictionary()


def attach(model: nn.Module, hook: DDPReadHook) -> bool:
    """Make ``hook`` the one ``model``'s floatguard slot runs, registering the slot on
    the model's first guard; a guard built on a model that has one takes it over (an
    older guard still open then all-reduces its read separately). False: the model has
    a comm hook of the user's own, which stays."""
    slot = _SLOTS.get(model)
    if slot is None:
        slot = CommHookSlot(hook.group)
        try:
            model.register_comm_hook(None, slot.as_comm_hook())  # type: ignore[operator]
        except RuntimeError:  # "can only be called once": the user's hook stays
            return False
        _SLOTS[model] = slot
    slot.target = hook
    return True


def detach(model: nn.Module, hook: DDPReadHook) -> None:
    """``hook``'s guard is closed: ``model``'s slot runs DDP's default all-reduce again
    (unless a later guard took it over)."""
    slot = _SLOTS.get(model)
    if slot is not None and slot.target is hook:
        slot.target = None
