"""Where a non-finite value was born: the rules, applied to records in execution order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from floatguard.stats import TensorStats

__all__ = ["Alert", "Fault", "Phase", "Record", "localize"]

Phase = Literal["input", "param", "forward", "backward", "param_grad", "loss"]
RecordKind = Literal[
    "fwd_input",
    "fwd_param",
    "fwd_output",
    "loss",
    "bwd_grad_output",
    "bwd_param_grad",
    "bwd_grad_input",
]


_SAID = {
    "outside": ", written outside the optimizer update",
    "update_or_outside": ", written by the update or outside it",
    "buffer": "",
}


@dataclass(frozen=True)
class Fault:
    """A non-finite value and where it was born.

    ``phase``: "input" (non-finite data entering the model), "param" (a parameter
    that was already non-finite; found by the guard's check or a replay), "forward",
    "backward", "param_grad" or "loss". ``module``: qualified name from ``named_modules()``
    ("" for the root). ``tensor``: the role, e.g. ``"output[0]"``, ``"grad_input[1]"``,
    ``"param:weight"``, ``"input[0]"``; when a parent is blamed for a value it made
    between its children, the role names the child it was passed to
    (``"mlp.input[0]"``, ``"attn.grad_output[0]"``). ``kind``: "nan" or "inf"
    (NaN wins), or "huge": a parameter still finite but absurdly large (the guard's
    snapshot check: a flipped exponent bit). ``stats``: the tensor's
    :class:`TensorStats` in "stats" mode.
    From a replay (the guard's localization) also: ``op``, the aten op
    (``"aten.log.default"``; ``"parameter"`` / ``"input"`` when the value was already
    there), ``source``, the user's line, and ``deterministic``: whether a replay of
    the step reproduced the fault (None when not replayed). ``rank``: under
    torch.distributed, the rank where it was born (None otherwise, or not known).
    ``inputs``: from a replay, the statistics of the op's inputs (what tells an
    overflowing input from a vanishing variance in a normalization).
    """

    step: int
    phase: Phase
    module: str
    tensor: str
    kind: Literal["nan", "inf", "huge"]
    shape: tuple[int, ...] = ()
    stats: TensorStats | None = field(default=None, compare=False, repr=False)
    op: str | None = None
    source: str | None = None
    deterministic: bool | None = None
    rank: int | None = None
    inputs: tuple[TensorStats, ...] = field(default=(), compare=False, repr=False)

    def __str__(self) -> str:
        where = self.module or "<root>"
        on = f" on rank {self.rank}" if self.rank is not None else ""
        what = "an absurd finite value" if self.kind == "huge" else self.kind
        text = f"step {self.step}: {what} born in {where}{on} ({self.phase}, {self.tensor})"
        said = _SAID.get(self.op or "")
        if said is not None:  # who wrote a bad state tensor, in words (the guard's check)
            text += said + (f": {self.source}" if self.source is not None else "")
        else:
            if self.op is not None:
                text += f" by {self.op}"
            if self.source is not None:
                text += f" at {self.source}"
        if self.deterministic is not None:
            text += " [deterministic]" if self.deterministic else " [transient]"
        return text

    def to_record(self) -> dict[str, object]:
        """The fault as a JSON-ready dict (statistics left out), for other ranks."""
        return {
            "step": self.step, "phase": self.phase, "module": self.module,
            "tensor": self.tensor, "kind": self.kind, "shape": list(self.shape),
            "op": self.op, "source": self.source, "deterministic": self.deterministic,
            "rank": self.rank,
        }  # fmt: skip

    @classmethod
    def from_record(cls, r: dict[str, Any]) -> Fault:
        """The inverse of :meth:`to_record`."""
        return cls(
            int(r["step"]), r["phase"], str(r["module"]), str(r["tensor"]), r["kind"],
            tuple(int(d) for d in r.get("shape", ())), None, r.get("op"), r.get("source"),
            r.get("deterministic"), r.get("rank"),
        )  # fmt: skip


@dataclass(frozen=True)
class Alert:
    """The lessons' (docs/lessons.md) per-module health alert for one non-finite tensor."""

    step: int
    phase: str
    module: str
    tensor: str
    shape: tuple[int, ...]
    has_nan: bool
    has_inf: bool
    min: float | None
    max: float | None


@dataclass(slots=True)
class Record:
    """One watched tensor: what it was, where (call path), and its sentinel slot.

    ``slot`` indexes the sentinel; an alias (a tensor already recorded this step)
    points at the earlier record's slot. ``paths`` holds every (call path, role)
    the tensor played, innermost first (a child's output returned by its parent).
    """

    kind: RecordKind
    paths: list[tuple[tuple[str, ...], str]]
    slot: int
    shape: tuple[int, ...]
    stats: TensorStats | None = None


def _local(child: str, parent: str) -> str:
    return child[len(parent) + 1 :] if parent and child.startswith(parent + ".") else child


_NAN, _NINF, _INF = 3, 1, 2  # taint levels: -inf only < +inf < NaN
_LEVEL = {"ok": 0, "ninf": _NINF, "inf": _INF, "nan": _NAN}
_HARM = ("loss", "fwd_param", "bwd_param_grad")


def _is_birth(level: int, deps: int) -> bool:
    """A NaN is born where its dependencies held no NaN and no +inf (the softmax of a
    fully masked row: -inf in, NaN out); +inf where they were finite or -inf only;
    -inf only is an intended infinity (a mask), never a birth by itself."""
    if level == _NAN:
        return deps < _INF
    if level == _INF:
        return deps < _INF
    return False


def _harmed(records: list[Record], status: list[str]) -> bool:
    """Whether the step went bad: a non-finite loss, parameter or parameter gradient
    (or, when no loss was recorded, a NaN or +inf model output). A
    clean step reports no fault whatever its masks hold."""
    has_loss = any(r.kind == "loss" for r in records)
    for rec in records:
        level = _LEVEL.get(status[rec.slot], _NAN)
        if rec.kind in _HARM and level:
            return True
        if rec.kind in ("bwd_grad_input", "bwd_grad_output") and level >= _INF:
            return True
        if (
            not has_loss
            and rec.kind == "fwd_output"
            and len(rec.paths[-1][0]) == 1
            and level >= _INF
        ):
            return True
    return False


def localize(records: list[Record], status: list[str], step: int) -> list[Fault]:
    """Apply the birth rules to records in execution order; return every fault born.

    Nothing is reported unless the step went bad (:func:`_harmed`). A record is a
    birth when what it depends on was clean enough (:func:`_is_birth`): a module's
    output against its call (inputs, parameters, children); a module's input against
    its caller (which made it between its children), or phase "input" for the
    outermost module; a non-finite parameter always; in backward, a module's input
    gradient or parameter gradient against the module's incoming gradient and
    children, and a module's incoming gradient against its caller's backward (or
    phase "loss" at the top). A loss is a birth when the forward held no NaN/+inf.
    When the step went bad and no record is a birth (an overflow to -inf only, say),
    the first -inf record born of finite values is reported.
    """
    if not _harmed(records, status):
        return []
    faults = _births(records, status, step, strict=True)
    return faults or _births(records, status, step, strict=False)


def _births(records: list[Record], status: list[str], step: int, *, strict: bool) -> list[Fault]:
    faults: list[Fault] = []
    fwd: dict[str, int] = {}
    bwd: dict[str, int] = {}
    forward_level = 0
    # Modules that ran this step. A parameter of one that did not (its owner used it
    # directly: nn.MultiheadAttention's out_proj, a tied weight) gets its gradient
    # from the nearest ancestor that ran, which is checked in its stead.
    called = {
        rec.paths[0][0][-1]
        for rec in records
        if rec.kind in ("fwd_input", "fwd_param", "fwd_output") and rec.paths[0][0]
    }

    def taint(path: tuple[str, ...], into: dict[str, int], level: int) -> None:
        for name in path:
            if into.get(name, 0) < level:
                into[name] = level

    def born(level: int, deps: int) -> bool:
        return _is_birth(level, deps) if strict else (level > 0 and deps == 0)

    for rec in records:
        level = _LEVEL.get(status[rec.slot], _NAN)
        if not level:
            continue
        kind: Literal["nan", "inf"] = "nan" if level == _NAN else "inf"
        path, role = rec.paths[0]
        name = path[-1] if path else ""

        def add(
            phase: Phase, module: str, tensor: str, rec: Record = rec, kind: str = kind
        ) -> None:
            k: Literal["nan", "inf"] = "nan" if kind == "nan" else "inf"
            faults.append(Fault(step, phase, module, tensor, k, rec.shape, rec.stats))

        if rec.kind == "fwd_input":
            if len(path) <= 1:
                if born(level, forward_level):
                    add("input", name, role)
            else:
                parent = path[-2]
                if born(level, fwd.get(parent, 0)):
                    add("forward", parent, f"{_local(name, parent)}.{role}")
            taint(path, fwd, level)
            forward_level = max(forward_level, level)
        elif rec.kind == "fwd_param":
            add("forward", name, role)
            taint(path, fwd, _NAN)
            forward_level = _NAN
        elif rec.kind == "fwd_output":
            if born(level, fwd.get(name, 0)):
                add("forward", name, role)
            taint(path, fwd, level)
            forward_level = max(forward_level, level)
        elif rec.kind == "loss":
            if forward_level < _INF:
                add("loss", "", role)
            forward_level = _NAN
        elif rec.kind == "bwd_grad_output":
            outer_path, outer_role = rec.paths[-1]
            if len(outer_path) <= 1:
                if not bwd and born(level, forward_level):
                    add("loss", "", outer_role)
            else:
                parent = outer_path[-2]
                if born(level, max(bwd.get(parent, 0), fwd.get(parent, 0))):
                    add("backward", parent, f"{_local(outer_path[-1], parent)}.{outer_role}")
            for p, _ in rec.paths:
                taint(p, bwd, level)
        elif rec.kind in ("bwd_param_grad", "bwd_grad_input"):
            # A module whose forward already saw non-finite values computes its backward
            # from them: what it produces is a consequence, not a new fault.
            ran = name
            if rec.kind == "bwd_param_grad" and name not in called:
                ran = next((p for p in reversed(path) if p in called), name)
            if born(level, max(bwd.get(ran, 0), fwd.get(ran, 0))):
                add("param_grad" if rec.kind == "bwd_param_grad" else "backward", name, role)
            taint(path, bwd, level)
    return faults
