"""Recording a bad step's ops as a tape (see :mod:`floatguard.repro.ops` for the words).

The recorder rides on the replay's dispatch mode (:mod:`floatguard.monitor._births`, which
imports it: the tape knows nothing of the monitor),
which counts every op the step dispatches: the replay that localized a birth gave it
a number, and the recording replay (the same step from the same state, run the same
way) reaches the same op at the same number. What is recorded:

- *scope*: at the ``"step"`` level every op; at the ``"minimal"`` level the ops of the
  birth's module (and its submodules; the root's own code only when the root is the
  birth's module; the loss code for a loss-phase birth) in the birth's direction
  (forward or backward) and forward pass, up to the birth. A tensor a scoped op reads
  that no scoped op made is a leaf: its value as it was read (the module's inputs, its
  parameters, saved activations, gradients flowing in).
- random ops (``nondeterministic_seeded``) and ops outside the ``aten`` namespace (a
  collective) are not taped: their outputs are leaves, so a tape needs no RNG and no
  process group to replay.
- a tensor changed in place by an op off the tape after the tape last saw it is read
  again as a new leaf (its value when read is what counts).
- the birth op alone: its inputs as they were just before it ran (``single``).

Then the tape is cut to the birth's *cone*: the ops whose outputs (by the memory they
wrote) the birth's inputs depend on; the leaves are those the cone reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from floatguard.repro.ops import Unwritable, encode, out_slots

__all__ = ["Mark", "Site", "TapeRecorder"]

# Where an op ran in a replay: (op, module, backward, forward pass, occurrence there).
Mark = tuple[str, str | None, bool, int, int]

_MAX_OPS = 200_000  # a step longer than this is not taped whole


@dataclass(frozen=True)
class Site:
    """Where the replay found a birth: the op's mark (op, module as the replay saw it,
    backward or not, forward pass, how many times that op ran there before) and the
    attribution it had when it ran, or (``seq`` None) a value already there
    (``tensor``)."""

    seq: Mark | None
    module: str | None
    backward: bool
    forward_pass: int
    op: str
    tensor: torch.Tensor | None = field(default=None, repr=False, compare=False)


@dataclass
class _Op:
    op: str
    args: Any
    kwargs: Any
    out: Any
    reads: list[int]
    writes: list[int]
    module: str | None
    backward: bool
    source: str | None
    seq: int


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    try:
        return (str(t.device), int(t.untyped_storage().data_ptr()))
    except (RuntimeError, NotImplementedError):
        return (str(t.device), id(t))


def _written_args(func: Any) -> list[int]:
    """Positions of the arguments ``func`` writes (in-place self, ``out=``)."""
    schema = getattr(func, "_schema", None)
    out = []
    for i, a in enumerate(getattr(schema, "arguments", ())):
        info = getattr(a, "alias_info", None)
        if info is not None and getattr(info, "is_write", False):
            out.append(i)
    return out


class TapeRecorder:
    """Collects the tape while the recording replay runs (see the module).

    ``site``: the birth to record up to (None: record the whole step, the ``"step"``
    level). ``whole``: every op in scope (the ``"step"`` level)."""

    def __init__(self, site: Site | None, *, whole: bool) -> None:
        self.site = site
        self.whole = whole
        self.ops: list[_Op] = []
        self.leaves: dict[int, torch.Tensor] = {}
        self.objs: dict[int, torch.Tensor] = {}  # slot -> the tensor it stood for (held)
        self.slot_of: dict[int, int] = {}  # id(tensor) -> slot
        self.version: dict[int, int] = {}  # slot -> its tensor's version when last seen
        self.storage: dict[int, tuple[str, int]] = {}
        # (memory, offset, shape, strides, dtype) -> slot: autograd hands an op a view
        # another op returned as a new tensor object over the same memory
        self.by_view: dict[tuple[Any, ...], int] = {}
        self.next_slot = 0
        self.birth: int | None = None  # index in ops
        self.single: dict[str, Any] | None = None
        self.done = False
        self.failed: str | None = None

    # ------------------------------------------------------------------ scope
    def in_scope(self, module: str | None, backward: bool, forward_pass: int) -> bool:
        if self.whole:
            return True
        s = self.site
        if s is None or backward != s.backward or forward_pass != s.forward_pass:
            return False
        if s.module is None or s.module == "":
            return module == s.module
        return module is not None and (module == s.module or module.startswith(s.module + "."))

    # ------------------------------------------------------------------ slots
    def _new(self, t: torch.Tensor) -> int:
        s = self.next_slot
        self.next_slot += 1
        self.objs[s] = t
        self.slot_of[id(t)] = s
        self.version[s] = t._version
        self.storage[s] = _storage_key(t)
        self.by_view[self._view_key(t)] = s
        return s

    @staticmethod
    def _view_key(t: torch.Tensor) -> tuple[Any, ...]:
        try:
            offset, stride = t.storage_offset(), tuple(t.stride())
        except (RuntimeError, NotImplementedError):
            offset, stride = -1, ()
        return (_storage_key(t), offset, tuple(t.shape), stride, t.dtype)

    def _read(self, t: torch.Tensor) -> int:
        """The slot of a tensor an op reads: its own, or a new leaf holding its value now."""
        s = self.slot_of.get(id(t))
        if s is not None and self.objs[s] is t and self.version[s] in (t._version, -1):
            self.version[s] = t._version
            return s
        s = self.by_view.get(self._view_key(t))
        if s is not None and s not in self.leaves and self.version[s] in (t._version, -1):
            # The same memory under another tensor object: autograd wraps a view an op
            # returned in a tensor of its own, sharing its base's version counter.
            self.version[s] = t._version
            return s
        s = self._new(t)
        self.leaves[s] = t.detach().clone()
        return s

    def _out(self, t: torch.Tensor) -> int:
        s = self.slot_of.get(id(t))
        if s is not None and self.objs[s] is t:
            self.version[s] = t._version  # an in-place op's output: its self
            return s
        return self._new(t)

    # ------------------------------------------------------------------ recording
    def before(
        self,
        seq: int,
        mark: Mark,
        func: Any,
        args: Any,
        kwargs: dict[str, Any],
        module: str | None,
        backward: bool,
        forward_pass: int,
    ) -> tuple[Any, ...] | None:
        """Called before an op runs; what :meth:`after` needs, or None (not taped)."""
        if self.done or self.failed is not None:
            return None
        is_birth = self.site is not None and self.site.seq == mark
        if is_birth:
            self.single = self._single(func, args, kwargs)
        if not self.in_scope(module, backward, forward_pass) and not is_birth:
            return None
        if getattr(func, "namespace", "") != "aten":
            return None
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            return None
        if len(self.ops) >= _MAX_OPS:
            self.failed = f"the step ran more than {_MAX_OPS} ops"
            return None
        reads: list[int] = []

        def slot(t: torch.Tensor) -> int:
            s = self._read(t)
            reads.append(s)
            return s

        try:
            enc_args = encode(tuple(args), slot)
            enc_kwargs = encode(dict(kwargs), slot)
        except Unwritable as e:
            if is_birth:
                self.failed = f"{func}'s arguments cannot be written ({e})"
            return None
        return (seq, func, enc_args, enc_kwargs, reads, module, backward, is_birth)

    def after(self, rec: tuple[Any, ...], out: Any, args: Any, source: str | None) -> None:
        seq, func, enc_args, enc_kwargs, reads, module, backward, is_birth = rec
        try:
            enc_out = encode(out, self._out)
        except Unwritable:
            enc_out = None
        writes = [s for s in out_slots(enc_out) if s is not None]
        if getattr(func, "is_view", False):
            for s in writes:  # autograd gives a view its base's version counter after this
                self.version[s] = -1
        for i in _written_args(func):
            if i < len(args) and isinstance(args[i], torch.Tensor):
                w = self.slot_of.get(id(args[i]))
                if w is not None:
                    self.version[w] = args[i]._version
                    writes.append(w)
        for t in args if isinstance(args, (list, tuple)) else ():
            if isinstance(t, torch.Tensor):
                r = self.slot_of.get(id(t))
                if r is not None and self.objs[r] is t:
                    self.version[r] = t._version
        op = _Op(str(func), enc_args, enc_kwargs, enc_out, reads, writes, module, backward,
                 source, seq)  # fmt: skip
        self.ops.append(op)
        if is_birth:
            self.birth = len(self.ops) - 1
            self.done = not self.whole

    def _single(self, func: Any, args: Any, kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """The birth op alone, every tensor it reads a leaf (copied before it runs)."""
        leaves: dict[int, torch.Tensor] = {}

        def slot(t: torch.Tensor) -> int:
            s = len(leaves)
            leaves[s] = t.detach().clone()
            return s

        try:
            return {
                "op": str(func),
                "args": encode(tuple(args), slot),
                "kwargs": encode(dict(kwargs), slot),
                "leaves": leaves,
            }
        except Unwritable:
            return None

    # ------------------------------------------------------------------ the tape
    def tape(self, *, cone: bool) -> dict[str, Any] | None:
        """The recorded tape as plain values (ops up to the birth, or all of them),
        cut to the birth's cone when ``cone``; None when nothing usable was recorded."""
        if self.failed is not None or not self.ops:
            return None
        last = self.birth if self.birth is not None and not self.whole else len(self.ops) - 1
        keep = list(range(last + 1))
        if cone and self.birth is not None:
            needed = {self.storage[s] for s in self.ops[self.birth].reads}
            kept = [self.birth]
            for i in range(self.birth - 1, -1, -1):
                op = self.ops[i]
                if any(self.storage[w] in needed for w in op.writes):
                    kept.append(i)
                    needed.update(self.storage[r] for r in op.reads)
            keep = sorted(kept)
        used: set[int] = set()
        for i in keep:
            used.update(self.ops[i].reads)
        leaves = {s: self.leaves[s] for s in sorted(used) if s in self.leaves}
        ops = [
            {
                "op": self.ops[i].op,
                "args": self.ops[i].args,
                "kwargs": self.ops[i].kwargs,
                "out": self.ops[i].out,
                "module": self.ops[i].module,
                "backward": self.ops[i].backward,
                "source": self.ops[i].source,
            }
            for i in keep
        ]
        birth = keep.index(self.birth) if self.birth is not None and self.birth in keep else None
        return {"ops": ops, "leaves": leaves, "birth": birth}

    def slot(self, t: torch.Tensor) -> int | None:
        """The slot a tensor the step produced stands in (the loss, a gradient), if taped."""
        s = self.slot_of.get(id(t))
        return s if s is not None and self.objs[s] is t else None

    def release(self) -> None:
        self.objs.clear()
        self.slot_of.clear()
        self.leaves.clear()


def nonfinite_where(t: torch.Tensor) -> dict[str, Any]:
    """Where a tensor holds non-finite values: kind, count, first index, shape."""
    v = t.detach()
    if v.is_complex():
        v = torch.view_as_real(v)
    if not v.is_floating_point() or v.numel() == 0:
        return {"kind": None, "count": 0, "first": None, "shape": list(t.shape)}
    v = v.float()
    bad = ~v.isfinite()
    count = int(bad.sum())
    first = [int(i) for i in bad.nonzero()[0].tolist()] if count else None
    kind = None
    if count:
        kind = "nan" if bool(v.isnan().any()) else "inf"
        if kind == "inf" and not bool((v == math.inf).any()):
            kind = "-inf"
    return {"kind": kind, "count": count, "first": first, "shape": list(t.shape)}
