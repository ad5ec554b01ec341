"""The locator: on a bad step only, the replay that names the birth (the state check
before it is :mod:`floatguard.guard.vetting`'s).

- *replay*: the step re-run from its starting state (RNG, buffers) under the op-level
  replay (:func:`floatguard.monitor.replay.run_localized`), to name the birth and to
  learn whether it reproduces.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from floatguard._values import local_part
from floatguard.guard.channel import ReadChannel
from floatguard.guard.read import StepRead, StepReader
from floatguard.guard.run import StepRunner
from floatguard.guard.scratch import clear_grads
from floatguard.guard.types import Closure
from floatguard.guard.vetting import StateCheck, named_root
from floatguard.monitor.localize import Fault
from floatguard.monitor.replay import ReplayResult, run_traced
from floatguard.repro.tape import Site, TapeRecorder
from floatguard.stability.clip import total_norm
from floatguard.stability.step_state import StepState, set_rng_state

__all__ = ["Locator"]


class Locator:
    """Finds where a bad step's non-finite value came from (bad steps only), by replay;
    ``check``: the state check (:class:`~floatguard.guard.vetting.StateCheck`)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: StepState,
        runner: StepRunner,
        reader: StepReader,
        channel: ReadChannel,
        check: StateCheck,
    ) -> None:
        self.model, self.optimizer, self.state = model, optimizer, state
        self.runner, self.reader, self.channel, self.check = runner, reader, channel, check
        # The last replay's birth on this rank (before the ranks agreed) and its site.
        self.last_local: Fault | None = None
        self.last_site: Site | None = None

    # ---------------------------------------------------------- replay
    def replay(self, step: int, closures: Sequence[Closure], read: StepRead) -> Fault:
        """Re-run the step from its starting state under the op-level replay; the birth
        when it reproduces, else what the read saw (``deterministic`` False when the
        replayed step was clean)."""
        found, reproduced = self._rerun(closures)
        if found is not None and reproduced:
            self.last_local = found.to_fault(step, deterministic=True)
            return self.last_local
        self.last_site = None
        # Not localized (or not reproduced): what the read saw, where it saw it.
        loss_ok = read.finite_loss
        seen = read.grad_norm if loss_ok else read.loss
        self.last_local = Fault(
            step=step,
            phase="backward" if loss_ok else "loss",
            module="",
            tensor="grad" if loss_ok else "loss",
            kind="nan" if math.isnan(seen) else "inf",
            deterministic=reproduced,
        )
        return self.last_local

    def replay_values(self, closures: Sequence[Closure]) -> tuple[float, float]:
        """Re-run the step from its starting state (no op-level replay) and read its
        loss and gradient norm once: does a spike reproduce? (Spike steps only.)"""
        with self._from_step_start():
            self.runner.run(closures)
            _, grads, dev = self.reader.params_with_grads()
            norm = (
                total_norm(grads, self.channel.norm_type).to(dev).double()
                if grads
                else torch.zeros((), dtype=torch.float64, device=dev)
            )
            loss = self.runner.mean_loss(dev).double()
            values = torch.stack([loss, norm]).tolist()
        return float(values[0]), float(values[1])

    def _rerun(self, closures: Sequence[Closure]) -> tuple[ReplayResult | None, bool]:
        self.last_local, self.last_site = None, None
        with self._from_step_start():
            found, _, site, _ = run_traced(
                lambda: self.runner.run(closures), named_root(self.model)
            )
            reproduced = self._step_is_bad()
        self.last_site = site
        return found, reproduced

    def record(
        self, closures: Sequence[Closure], tape: TapeRecorder, during: Callable[[], None]
    ) -> None:
        """Re-run the step from its starting state once more, feeding ``tape`` every op
        (a repro bundle's recording replay, see :mod:`floatguard.repro.tape`); ``during``
        is called after the run, before the step's gradients and losses are cleared (to
        find the loss and gradients among the tape's slots)."""
        with self._from_step_start():
            run_traced(lambda: self.runner.run(closures), named_root(self.model), tape=tape)
            during()

    def tensor_of(self, fault: Fault) -> torch.Tensor | None:
        """The state tensor a state fault names (:meth:`StateCheck.tensor_of`)."""
        return self.check.tensor_of(fault)

    @contextlib.contextmanager
    def _from_step_start(self) -> Iterator[None]:
        """Run from the step's starting state (gradients, losses, buffers, RNG) without
        DDP's gradient sync, and leave no trace of the run (the RNG as after the step)."""
        after = self.state.rng_now()
        clear_grads(self.optimizer)
        self.runner.clear()
        self.state.restore_buffers()
        self.state.restore_rng()
        try:
            with self.channel.no_gradient_sync():
                yield
        finally:
            clear_grads(self.optimizer)
            self.runner.clear()
            set_rng_state(after)

    def _step_is_bad(self) -> bool:
        """Whether the replayed step was bad again (loss or a gradient non-finite)."""
        _, grads, dev = self.reader.params_with_grads()
        flags = [self.runner.losses_finite().to(dev)] if self.runner.losses else []
        flags += [
            local_part(g.detach()).isfinite().all().to(dev)
            for g in grads
            if g.layout == torch.strided
        ]
        return not all(torch.stack(flags).tolist()) if flags else False
