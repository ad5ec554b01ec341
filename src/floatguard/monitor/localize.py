"""Where a non-finite value was born: the rules, applied to records in execution order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from floatguard.stats import TensorStats

__all__ = ["Alert", "Fault", "Phase", "Record", "localize"]

Phase = Literal["input", "forward", "backward", "param_grad", "loss"]
RecordKind = Literal[
    "fwd_input",
    "fwd_param",
    "fwd_output",
    "loss",
    "bwd_grad_output",
    "bwd_param_grad",
    "bwd_grad_input",
]


@dataclass(frozen=True)
class Fault:
    """A non-finite value and where it was born.

    ``phase``: "input" (non-finite data entering the model), "forward", "backward",
    "param_grad" or "loss". ``module``: qualified name from ``named_modules()``
    ("" for the root). ``tensor``: the role, e.g. ``"output[0]"``, ``"grad_input[1]"``,
    ``"param:weight"``, ``"input[0]"``; when a parent is blamed for a value it made
    between its children, the role names the child it was passed to
    (``"mlp.input[0]"``, ``"attn.grad_output[0]"``). ``kind``: "nan" or "inf"
    (NaN wins). ``stats``: the tensor's :class:`TensorStats` in "stats" mode.
    """

    step: int
    phase: Phase
    module: str
    tensor: str
    kind: Literal["nan", "inf"]
    shape: tuple[int, ...] = ()
    stats: TensorStats | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        where = self.module or "<root>"
        return f"step {self.step}: {self.kind} born in {where} ({self.phase}, {self.tensor})"


@dataclass(frozen=True)
class Alert:
    """The lessons' per-module health alert for one non-finite tensor."""

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


def localize(records: list[Record], status: list[str], step: int) -> list[Fault]:
    """Apply the birth rules to records in execution order; return every fault born.

    A record is a birth when the values it depends on were finite:
    a module's output when nothing in its call (inputs, parameters, children)
    was non-finite; a module's input when its caller had seen nothing
    non-finite (the caller made it between its children), or phase "input" for
    the outermost module; a non-finite parameter always; in backward, a
    module's input gradient or parameter gradient when the module's incoming
    gradient and its children were finite, and a module's incoming gradient
    when its caller's backward had been clean (or phase "loss" at the top).
    """
    faults: list[Fault] = []
    fwd: set[str] = set()
    bwd: set[str] = set()
    any_forward_bad = False
    # Modules that ran this step. A parameter of one that did not (its owner used it
    # directly: nn.MultiheadAttention's out_proj, a tied weight) gets its gradient
    # from the nearest ancestor that ran, which is checked in its stead.
    called = {
        rec.paths[0][0][-1]
        for rec in records
        if rec.kind in ("fwd_input", "fwd_param", "fwd_output") and rec.paths[0][0]
    }

    def taint(path: tuple[str, ...], into: set[str]) -> None:
        into.update(path)

    for rec in records:
        st = status[rec.slot]
        if st == "ok":
            continue
        kind: Literal["nan", "inf"] = "nan" if st == "nan" else "inf"
        path, role = rec.paths[0]
        name = path[-1] if path else ""

        def add(
            phase: Phase, module: str, tensor: str, rec: Record = rec, kind: str = kind
        ) -> None:
            k: Literal["nan", "inf"] = "nan" if kind == "nan" else "inf"
            faults.append(Fault(step, phase, module, tensor, k, rec.shape, rec.stats))

        if rec.kind == "fwd_input":
            if len(path) <= 1:
                if not any_forward_bad:
                    add("input", name, role)
            else:
                parent = path[-2]
                if parent not in fwd:
                    add("forward", parent, f"{_local(name, parent)}.{role}")
            taint(path, fwd)
            any_forward_bad = True
        elif rec.kind == "fwd_param":
            add("forward", name, role)
            taint(path, fwd)
            any_forward_bad = True
        elif rec.kind == "fwd_output":
            if name not in fwd:
                add("forward", name, role)
            taint(path, fwd)
            any_forward_bad = True
        elif rec.kind == "loss":
            if not any_forward_bad:
                add("loss", "", role)
            any_forward_bad = True
        elif rec.kind == "bwd_grad_output":
            outer_path, outer_role = rec.paths[-1]
            if len(outer_path) <= 1:
                if not bwd and not any_forward_bad:
                    add("loss", "", outer_role)
            else:
                parent = outer_path[-2]
                if parent not in bwd and parent not in fwd:
                    add("backward", parent, f"{_local(outer_path[-1], parent)}.{outer_role}")
            for p, _ in rec.paths:
                taint(p, bwd)
        elif rec.kind in ("bwd_param_grad", "bwd_grad_input"):
            # A module whose forward already saw non-finite values computes its backward
            # from them: what it produces is a consequence, not a new fault.
            ran = name
            if rec.kind == "bwd_param_grad" and name not in called:
                ran = next((p for p in reversed(path) if p in called), name)
            if ran not in bwd and ran not in fwd:
                add("param_grad" if rec.kind == "bwd_param_grad" else "backward", name, role)
            taint(path, bwd)
    return faults
