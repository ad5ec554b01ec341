"""The words every part of the guard shares: precision, watch, actions, closures, results."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from floatguard.causes import Cause
from floatguard.errors import FloatguardError
from floatguard.monitor.localize import Fault

__all__ = ["Action", "Closure", "GraphUnsafe", "Precision", "StepResult", "Watch"]

Precision = Literal["fp32", "bf16", "fp16"]
Action = Literal["applied", "skipped", "rolled_back"]
Watch = Literal["replay", "hooks", "off"]
Closure = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class StepResult:
    """What the guard did with one step, and the numbers it decided on.

    ``reason`` (None when applied) is a :data:`~floatguard.causes.Cause`:
    "nonfinite_input", "nonfinite_param", "nonfinite_optimizer_state",
    "optimizer_update", "overflow" (fp16 gradient overflow), "nonfinite_loss",
    "nonfinite_grad", "transient" (a replay of the step was clean), "loss_spike",
    "grad_norm_spike", "after_rollback" (a batch the policy skips after a rollback).
    ``fault``: where the non-finite value was born, when it was localized.
    ``snapshot_age``: with a ``snapshot_dir``, how many steps a resume from the newest
    snapshot on disk would run again if the run stopped now (1 right after a snapshot
    step; it keeps growing while writes fail: the run has no fresh point to resume
    from, and a RuntimeWarning said so once); None without a ``snapshot_dir``.
    """

    step: int
    action: Action
    reason: Cause | None
    loss: float
    grad_norm: float
    scale: float
    clip_coef: float = 1.0
    lr_factor: float = 1.0
    fault: Fault | None = field(default=None, repr=False)
    snapshot_age: int | None = None
    lr: float | None = None

    @property
    def settled(self) -> bool:
        """Whether the guard has decided this step (always, but for a deferred step the
        host has not read yet: ``Guard(sync="deferred")``, :class:`PendingResult
        <floatguard.guard.deferred.PendingResult>`)."""
        return True


class GraphUnsafe(FloatguardError, RuntimeError):
    """A step a CUDA graph would replay wrongly, or could not capture
    (:meth:`Guard.graphed <floatguard.guard.core.Guard.graphed>`; see
    :mod:`floatguard.guard.graphs`)."""
