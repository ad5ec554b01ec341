"""A deferred step waiting for the host (:mod:`floatguard.guard.deferred`): its result,
which settles the step when read (:class:`PendingResult`), and what it keeps until then
(:class:`Pending`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import torch

from floatguard.guard.read import Packed
from floatguard.guard.scratch import Leftovers
from floatguard.guard.speculative import Mailbox, SpeculativeUpdate
from floatguard.guard.types import Closure, StepResult


class Settles(Protocol):
    """What a pending result asks of the deferred stepper that made it."""

    settling: int | None

    def settle(self) -> StepResult | None: ...


__all__ = ["Pending", "PendingResult"]


_LAZY = frozenset(f.name for f in fields(StepResult)) - {"step"}


class PendingResult(StepResult):
    """A deferred step's :class:`StepResult`: ``step`` is known at once; reading any
    other field settles the step first (waits for its read: the caller's explicit
    sync) and returns the decided value. A step whose settling raised (a GuardStopped
    decided for it) raises that again when read. Until it is decided it holds its
    guard (an unread step can still be settled through it); a decided result does
    not keep its guard alive."""

    def __init__(self, step: int, stepper: Settles) -> None:
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
        if stepper.settling == step:
            raise RuntimeError(
                f"floatguard: step {step}'s result was read while the step is being settled "
                "(a closure replayed to localize it reads it, e.g. from a list of results "
                "the loop appends to): bind what the closure reads when the step runs"
            )
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
    held: Leftovers = field(default_factory=Leftovers)  # its gradients, losses, batch
    inputs: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    rng_after: dict[str, Any] | None = None  # the RNG as the step returned

    def refilled(self) -> bool:
        """Whether a tensor of the step's batch was written in place since the step."""
        return any(t._version != v for t, v in self.inputs)
