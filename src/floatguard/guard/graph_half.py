"""The guard's side of a graphed step (:mod:`floatguard.guard.graphs`): when a step may
replay, the device tensors the host writes for it, the step the graph captures, and
the replayed step handed to the deferred mode to settle."""

from __future__ import annotations

import math
from typing import Any

import torch

from floatguard.guard.deferred import DeferredStepper
from floatguard.guard.pending import PendingResult
from floatguard.guard.read import Packed
from floatguard.guard.types import Closure, GraphUnsafe

__all__ = ["GraphHalf"]


class GraphHalf:
    """The crew's and the deferred stepper's part in a graphed step."""

    def __init__(self, crew: Any, stepper: DeferredStepper, device: torch.device) -> None:
        self._c, self._d = crew, stepper
        # [loss bar, norm bar, ZClip's six state values]: written by the host before
        # every replay (one copy), read by the captured step
        self.scalars = torch.zeros(8, dtype=torch.float64, device=device)
        self._staging = torch.zeros(8, dtype=torch.float64, pin_memory=device.type == "cuda")

    def graph_ready(self) -> str | None:
        """None when the next step may replay; else why it runs eagerly."""
        c, d = self._c, self._d
        keeper, ladder = c.keeper, c.run.ladder
        if d.pending is not None:
            return "a step is pending"
        if keeper.first_due or keeper.vetting_first or keeper.reads_state(ladder.good_steps):
            return "a snapshot step (its state is vetted in an exact read)"
        if ladder.skip_remaining > 0:
            return "a batch skipped after a rollback"
        if ladder.lr_factor != 1.0:
            return "the LR is backed off"
        if d.undoable():
            return "a spike detector without a bar the device compares with (lesson)"
        opt = c.scratch.optimizer
        params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        if not d.update.can_gate(params):
            missing = [p for p in params if id(p) not in d.update.known]
            names = {id(p): n for n, p in c.state.model.named_parameters()}
            shown = ", ".join(repr(names.get(id(p), "?")) for p in missing[:3])
            return (
                f"{len(missing)} trainable parameter(s) got no gradient in the last exact "
                f"step ({shown}): a parameter that never gets one keeps every step eager "
                "(freeze it: requires_grad=False)"
            )
        return None

    def graph_scalars(self) -> torch.Tensor:
        """The host's values for the next replay, written into :attr:`scalars` (a
        non-blocking copy from a pinned buffer on CUDA: the step before was settled, so
        the copy before it has landed)."""
        sw, zclip = self._c.spike_watch, self._c.clipper.zclip
        values = []
        for detector in (sw.loss, sw.grad_norm):
            bar = detector.bar() if detector is not None else None
            values.append(math.inf if bar is None else float(bar))
        values += zclip.host_state() if zclip is not None else [0.0] * 6
        self._staging.copy_(torch.tensor(values, dtype=torch.float64))
        self.scalars.copy_(self._staging, non_blocking=self.scalars.is_cuda)
        return self.scalars

    def graph_targets(self) -> list[tuple[int, int]]:
        """The tensors a capture holds on to (parameters, optimizer state, buffers), by
        identity and storage: when one was replaced, the graph is captured again."""
        opt = self._c.scratch.optimizer
        model = self._c.state.model
        out = []
        for g in opt.param_groups:
            for p in g["params"]:
                out.append((id(p), p.data_ptr()))
                for v in opt.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor):
                        out.append((id(v), v.data_ptr()))
        out += [(id(b), b.data_ptr()) for b in model.buffers()]
        return out

    def prepare_capture(self) -> None:
        """What a replay reuses, made before the capture: the update's copy buffers."""
        opt = self._c.scratch.optimizer
        params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        self._d.update.prepare(params, self.scalars.device)

    def device_step(
        self, closures: list[Closure], scalars: torch.Tensor, checking: bool = False
    ) -> tuple[Packed, list[torch.Tensor], tuple[Any, ...]]:
        """What the graph captures: the forward and backward, the packed read, the
        verdict against the bars in ``scalars``, the clipping (ZClip from its state in
        ``scalars``), the gated update and the read's copy to the mailbox. ``checking``
        (the check backend): the optimizer's step counters are copied first and put back
        when the check stops the update (a fused Adam counts the step before its kernel,
        which the check stops)."""
        c, d = self._c, self._d
        c.runner.run(closures, cache=False)
        packed = c.reader.pack(c.run.step_count, c.runner.mean_loss())
        ok = d.verdict(packed, scalars[:2])
        opt = c.scratch.optimizer
        counters = [
            (t, t.detach().clone())
            for g in opt.param_groups
            for p in g["params"]
            for k, t in opt.state.get(p, {}).items()
            if checking and k == "step" and isinstance(t, torch.Tensor)
        ]
        try:
            d.gated_update(packed, ok, 1.0, scalars[2:], record=False)
        except GraphUnsafe:
            with torch.no_grad():
                for t, kept in counters:
                    t.copy_(kept)
            raise
        return packed, list(c.runner.losses), d.update.state()

    def record_batch(self, batch: tuple[torch.Tensor, ...]) -> None:
        """The step's batch: the tensors the graphed step was called with (by reference)."""
        self._c.inputs.take()
        self._c.inputs.put([(batch, {})])

    def pend_graphed(
        self,
        step: int,
        packed: Packed,
        losses: list[torch.Tensor],
        update: tuple[Any, ...],
        closures: list[Closure],
        last_update: Any,
    ) -> PendingResult:
        """The replayed step left to settle: the update's copies and flag are the
        capture's (refilled by the replay), the mailbox's event recorded now."""
        c, d = self._c, self._d
        d.update.rearm(update)
        d.mailbox.mark()
        c.updates.record()  # the hyper-parameters the replayed update used
        c.runner.losses = list(losses)
        return d.pend(step, packed, closures, last_update)
