"""What a replay records of a birth: the public ReplayResult and the candidate that carries it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from floatguard.monitor.localize import Fault, Phase
from floatguard.repro.tape import Mark
from floatguard.stats import TensorStats


@dataclass(frozen=True)
class ReplayResult:
    """Where the step's first harmful non-finite value was born.

    ``op``: the aten op (``"aten.log.default"``), or ``"parameter"`` / ``"input"``
    when the value was already there. ``phase``: "param", "input", "forward",
    "loss", "backward" or "param_grad". ``module``: qualified name in the model
    ("" for the root, None when no module was running). ``tensor``: the role
    (``"output"``, ``"grad"``, ``"input[0]"``, ``"param:weight"``). ``kind``: "nan" or
    "inf". ``source``: the user's line (for backward ops, the forward line that made
    the node). ``deterministic``: with ``repeat >= 2``, whether every run found the
    same op at the same line (None with one run).
    """

    op: str
    phase: Phase
    kind: Literal["nan", "inf"]
    source: str | None
    inputs: list[TensorStats] = field(repr=False)
    outputs: list[TensorStats] = field(repr=False)
    deterministic: bool | None = None
    module: str | None = None
    tensor: str = "output"
    shape: tuple[int, ...] = ()

    def __str__(self) -> str:
        det = (
            ""
            if self.deterministic is None
            else (" (deterministic)" if self.deterministic else " (NOT deterministic)")
        )
        where = "" if self.module is None else f" in {self.module or '<root>'}"
        return (
            f"{self.kind} first produced by {self.op}{where} in {self.phase} "
            f"({self.tensor}) at {self.source}{det}"
        )

    def to_fault(self, step: int, *, deterministic: bool | None) -> Fault:
        """This birth as the guard's :class:`~floatguard.monitor.localize.Fault` of
        ``step`` (the output's statistics kept; ``deterministic`` as the guard judged
        it: whether the replayed step was bad again)."""
        return Fault(
            step=step,
            phase=self.phase,
            module=self.module if self.module is not None else "",
            tensor=self.tensor,
            kind=self.kind,
            shape=self.shape,
            stats=self.outputs[0] if self.outputs else None,
            op=self.op,
            source=self.source,
            deterministic=deterministic,
            inputs=tuple(self.inputs),
        )


@dataclass
class _Candidate:
    result: ReplayResult
    backward: bool
    ninf_only: bool
    storages: tuple[int, ...] = ()
    forward_pass: int = 0  # the forward pass it belongs to (backward: the one before)
    # The bad outputs themselves, held so that their memory is not reused while the
    # replay runs (a later gradient at the same address would look like this one).
    held: tuple[torch.Tensor, ...] = ()
    # The op's mark (None: a value already there): the op, the module it ran in as the
    # replay saw it, backward or not, the forward pass, and how many times that op ran
    # there before; a repro bundle's recording replay finds the same op by it.
    seq: Mark | None = None
    scope: str | None = None
