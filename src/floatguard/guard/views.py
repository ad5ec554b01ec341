"""The guard's read-only views (:class:`GuardViews`, a base of
:class:`~floatguard.guard.core.Guard`): its configuration as given, its collaborators'
state (the policy's counters, the detectors, the last snapshot) and its sync mode."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from floatguard.guard import policy
from floatguard.guard.crew import Crew
from floatguard.guard.types import Precision, Watch
from floatguard.scaling.loss_scale import DynamicLossScaler
from floatguard.stability.respond import ClipPolicy, ResponsePolicy, SpikePolicy
from floatguard.stability.snapshot import Snapshot
from floatguard.stability.spike_watch import SpikeDetector

__all__ = ["GuardViews"]


class GuardViews:
    """Read-only properties over what :class:`~floatguard.guard.core.Guard` holds."""

    _c: Crew
    _model: nn.Module
    _optimizer: torch.optim.Optimizer
    _scheduler: Any
    _precision: Precision
    _watch: Watch
    _distributed: bool
    _process_group: Any
    _device: torch.device
    _clip: ClipPolicy
    _spikes: SpikePolicy
    _response: ResponsePolicy
    _scaler: DynamicLossScaler
    _deferred: Any

    model = property(lambda self: self._model)
    optimizer = property(lambda self: self._optimizer)
    scheduler = property(lambda self: self._scheduler)
    precision = property(lambda self: self._precision)
    watch = property(lambda self: self._watch)
    distributed = property(lambda self: self._distributed)
    process_group = property(lambda self: self._process_group)
    device = property(lambda self: self._device)
    clip = property(lambda self: self._clip)
    spikes = property(lambda self: self._spikes)
    response = property(lambda self: self._response)
    scaler = property(lambda self: self._scaler)
    events = property(lambda self: self._c.events)
    monitor = property(lambda self: self._c.monitor)
    stats_monitor = property(lambda self: self._c.stats_monitor)

    @property
    def zclip(self) -> Any:
        return self._c.clipper.zclip

    @property
    def loss_detector(self) -> SpikeDetector | None:
        return self._c.spike_watch.loss

    @property
    def norm_detector(self) -> SpikeDetector | None:
        return self._c.spike_watch.grad_norm

    @property
    def ladder(self) -> policy.LadderState:
        """The response policy's counters (read-only; see :mod:`floatguard.guard.policy`)."""
        return self._c.run.ladder

    good_steps = property(lambda self: self._c.run.ladder.good_steps)
    consecutive_bad = property(lambda self: self._c.run.ladder.consecutive_bad)
    rollbacks = property(lambda self: self._c.run.ladder.rollbacks)
    transients = property(lambda self: self._c.run.ladder.transients)
    skip_remaining = property(lambda self: self._c.run.ladder.skip_remaining)
    lr_factor = property(lambda self: self._c.run.ladder.lr_factor)

    @property
    def step_count(self) -> int:
        """The number of guard steps taken (the index of the next step)."""
        return self._c.run.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self._c.run.step_count = value

    @property
    def last_snapshot(self) -> Snapshot | None:
        """The snapshot a rollback would restore (in memory)."""
        return self._c.keeper.snapshot

    @property
    def pending_step(self) -> int | None:
        """(``sync="deferred"``) The step the device ran but the host has not settled yet
        (None when none is)."""
        pending = None if self._deferred is None else self._deferred.pending
        return None if pending is None else int(pending.step)

    @property
    def deciding(self) -> bool:
        """Whether the guard is deciding (or settling) a step now: the ``optimizer.step()``
        and ``scheduler.step()`` calls made then are the guard's own (a framework's
        wrapper of them lets these through)."""
        return self._c.run.stage == "deciding"

    @property
    def sync(self) -> str:
        """``"exact"`` (one host read per step) or ``"deferred"`` (none on a healthy step)."""
        return "exact" if self._deferred is None else "deferred"
