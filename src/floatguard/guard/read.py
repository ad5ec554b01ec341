"""The reader: gradients, norm, loss and monitor records, packed; the step's one host read."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from floatguard.guard.channel import Head, ReadChannel
from floatguard.monitor.hooks import Monitor
from floatguard.monitor.localize import Fault
from floatguard.scaling.loss_scale import DynamicLossScaler

__all__ = ["Packed", "StepRead", "StepReader"]


@dataclass(frozen=True)
class StepRead:
    """The host copy of the step's packed numbers (the same on every rank)."""

    overflow: bool
    grad_norm: float
    loss: float
    bad_ranks: tuple[int, ...] = ()  # under torch.distributed: ranks with a bad local loss/norm
    monitor_fault: Fault | None = None  # watch="hooks": the first birth in the records
    extra: tuple[float, ...] = ()  # what the caller asked to read with the step

    @property
    def finite_loss(self) -> bool:
        return math.isfinite(self.loss)

    @property
    def gradient_overflow(self) -> bool:
        """An fp16 overflow flag, or a non-finite gradient norm."""
        return self.overflow or not math.isfinite(self.grad_norm)


class StepReader:
    """Gathers the step's numbers on device and reads them once.

    The packed tensor is the channel's head (its layout and decoder, see
    :class:`~floatguard.guard.channel.Head`), then, with the hook monitor, its records'
    low and high halves (:meth:`Monitor.packed_records`). Nothing else is read on a
    clean step.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scaler: DynamicLossScaler,
        channel: ReadChannel,
        monitor: Monitor | None,
        device: torch.device,
    ) -> None:
        self.optimizer = optimizer
        self.scaler = scaler
        self.channel = channel
        self.monitor = monitor
        self.device = device

    def params_with_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.device]:
        """The optimizer's parameters that have a gradient, their gradients, their device."""
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        dev = params[0].device if params else self.device
        return params, [p.grad for p in params if p.grad is not None], dev

    def read(self, step: int, loss: torch.Tensor, extra: torch.Tensor | None = None) -> StepRead:
        """Unscale (fp16) and take the norm on device, pack, read once (the step's one
        host read), decode. ``loss``: the step's mean loss (device scalar). ``extra``:
        a 1-D tensor read in the same read (a snapshot step's state magnitudes), its
        values returned as ``StepRead.extra``."""
        packed = self.pack(step, loss, extra)
        return self.decode(packed, packed.tensor.tolist())  # the one host read of the step

    def pack(self, step: int, loss: torch.Tensor, extra: torch.Tensor | None = None) -> Packed:
        """Everything :meth:`read` reads, packed on device (no sync): unscale (fp16), the
        norm, the loss, the monitor's records, ``extra``."""
        params, _, dev = self.params_with_grads()
        self.channel.reduce_partial(params)  # DTensor addends (Partial) summed first
        found = (
            self.scaler.unscale_(self.optimizer).to(dev)
            if self.scaler.enabled
            else torch.zeros((), device=dev)
        )
        _, grads, _ = self.params_with_grads()  # after unscale_ (a sparse gradient is coalesced)
        head = self.channel.head(step, found, grads, loss.to(dev), dev)
        packed, n_records = head.tensor, 0
        records = self.monitor.packed_records() if self.monitor is not None else None
        if records is not None:
            lo, hi = records
            n_records = len(lo)
            # float64 records stay float64 (cat promotes): a finite 1e300 is not an inf
            packed = torch.cat([packed, lo.to(dev), hi.to(dev)])
        n_extra = 0
        if extra is not None:
            n_extra = extra.numel()
            packed = torch.cat([packed.double(), extra.to(dev).double()])
        return Packed(packed, head, n_records, n_extra)

    def decode(self, packed: Packed, values: list[float]) -> StepRead:
        """The :class:`StepRead` of a packed read's host copy ``values``."""
        head, n_records, n_extra = packed.head, packed.n_records, packed.n_extra
        extra_values = tuple(values[len(values) - n_extra :]) if n_extra else ()
        values = values[: len(values) - n_extra]
        agreed = head.decode(values[: head.size])
        fault = None
        if self.monitor is not None and n_records:
            at = head.size
            faults = self.monitor.faults_from(values[at : at + n_records], values[at + n_records :])
            fault = faults[0] if faults else None
        return StepRead(
            overflow=agreed.overflow,
            grad_norm=agreed.grad_norm,
            loss=agreed.loss,
            bad_ranks=agreed.bad_ranks,
            monitor_fault=fault,
            extra=extra_values,
        )


@dataclass(frozen=True)
class Packed:
    """A step's read, packed on device: the tensor, the channel's head (its first
    values), how many monitor records and extra values follow."""

    tensor: torch.Tensor
    head: Head
    n_records: int
    n_extra: int
