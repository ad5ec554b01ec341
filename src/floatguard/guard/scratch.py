"""What a step leaves behind besides its update, and how it is cleared."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from floatguard.guard.batch_id import BatchInputs
from floatguard.guard.emit import GuardEvents
from floatguard.guard.run import StepRunner
from floatguard.monitor.hooks import Monitor
from floatguard.scaling.loss_scale import DynamicLossScaler
from floatguard.stability.step_state import StepState

__all__ = ["Leftovers", "StepScratch", "clear_grads"]


def clear_grads(optimizer: torch.optim.Optimizer) -> None:
    """Every gradient of the optimizer's parameters set to None, as
    ``zero_grad(set_to_none=True)`` does, but never skipped: a framework's wrapper
    (accelerate's ``AcceleratedOptimizer``) makes ``zero_grad`` do nothing between the
    micro-batches of an accumulation, where the deferred mode settles a step."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


@dataclass
class Leftovers:
    """A step's work held off the model (:meth:`StepScratch.hold`): its gradients (the
    tensors, by reference), its recorded losses, its batch and the inputs recorded
    since. Falsy when the step has done nothing yet."""

    grads: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    batch: list[tuple[Any, ...]] = field(default_factory=list)
    recorded: list[tuple[Any, ...]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.grads or self.losses or self.batch or self.recorded)


class StepScratch:
    """A step's leftovers: the gradients, the recorded losses, its batch kept by
    reference (``batch``: the inputs of its forward calls, before any replay), the
    buffers' and RNG's saved state, the monitors' records. :meth:`end` clears them
    after a decided step; :meth:`undo` after one that raised, as if it had not begun."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, runner: StepRunner, inputs: BatchInputs,
        state: StepState, scaler: DynamicLossScaler, monitor: Monitor | None,
        stats_monitor: Monitor | None, events: GuardEvents,
    ) -> None:  # fmt: skip
        self.optimizer, self.runner, self.inputs, self.state = optimizer, runner, inputs, state
        self.scaler, self.monitor, self.stats_monitor = scaler, monitor, stats_monitor
        self.events = events
        self.batch: list[tuple[Any, ...]] = []

    def keep_batch(self) -> None:
        """The step's forward calls ran: keep their inputs (by reference, no copy)."""
        self.batch = self.inputs.take()

    def hold(self) -> Leftovers:
        """Take the current step's work off the model, no copy: the gradients of the
        optimizer's parameters (set to None), the losses, the batch, the inputs recorded
        since (the deferred mode keeps a step's work apart from the next one's until the
        host settles it). :meth:`put` puts it back."""
        grads = [
            (p, p.grad)
            for group in self.optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        for p, _ in grads:
            p.grad = None
        held = Leftovers(grads, self.runner.losses, self.batch, self.inputs.take())
        self.runner.losses, self.batch = [], []
        return held

    def put(self, held: Leftovers) -> None:
        """Put held work back in place of the current (which is dropped)."""
        clear_grads(self.optimizer)
        for p, g in held.grads:
            p.grad = g
        self.runner.losses, self.batch = list(held.losses), list(held.batch)
        self.inputs.take()
        self.inputs.put(held.recorded)

    def undo(self) -> None:
        """A step that raised (its closure, a SnapshotError, ...): discarded, and the RNG
        back where the step began, so a retry draws what an uninterrupted run draws."""
        self.discard()
        self.state.restore_rng()

    def discard(self) -> None:
        """A step not applied leaves nothing: gradients, losses, batch, buffers (put
        back), the scaler's growth (skipped), the monitors' records."""
        clear_grads(self.optimizer)
        self.runner.clear()
        self.batch = []
        self.inputs.take()
        self.state.restore_buffers()
        if self.scaler.enabled:
            self.scaler.skip_step()
        for mon in (self.monitor, self.stats_monitor):
            if mon is not None:
                mon.reset()

    def end(self, step: int) -> None:
        """Step ``step`` was decided: its ``stats`` event (on sampled steps), then the
        gradients, losses and batch cleared and the next step's starting state saved."""
        if self.stats_monitor is not None:
            summary = self.stats_monitor.stats_summary()  # empty on unsampled steps
            if summary:
                self.events.stats(step, summary)
            self.stats_monitor.next_step()
        clear_grads(self.optimizer)
        self.runner.clear()
        self.batch = []
        self.inputs.take()  # replays' calls
        if self.monitor is not None:
            self.monitor.next_step()
        self.state.save()

    def close(self) -> None:
        """The guard ends: the monitors detached, the inputs' hooks removed."""
        self.inputs.close()
        for mon in (self.monitor, self.stats_monitor):
            if mon is not None:
                mon.detach()
