"""What one step changes besides the weights: the RNG states and the module buffers.

The guard saves them before a step so that a bad step can be replayed exactly (the
same dropout masks, the same BatchNorm statistics) and so that a step that is not
applied leaves no trace (BatchNorm's running statistics do not learn the NaN batch).

Every buffer is copied, with one ``torch._foreach_copy_`` into storage kept from one
step to the next (no allocation after the first step; a DTensor buffer through its
local part, one copy per device). Version counters cannot tell
which buffers a step changed: BatchNorm's kernel updates its running statistics
without bumping them. The cost is one copy of the buffers per step (BatchNorm
statistics, masks and rotary tables are small next to the step). No host sync.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from floatguard._foreach import local_groups
from floatguard._values import local_part

__all__ = ["StepState", "cuda_devices", "rng_state", "set_rng_state"]


class StepState:
    """Saved RNG states and buffers of ``model``, for replay and undo."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._names: list[str] = []
        self._copies: list[torch.Tensor] = []
        self.rng: dict[str, Any] = {}
        self._devices = cuda_devices(model)
        # Where the buffers live: (module, attribute), found once; read anew each save
        # (a module may replace a buffer tensor). Looked up again on every restore.
        self._where = self._locate()

    def _locate(self) -> list[tuple[str, nn.Module, str]]:
        return [
            (f"{mname}.{bname}" if mname else bname, m, bname)
            for mname, m in self.model.named_modules()
            for bname, _ in m.named_buffers(recurse=False)
        ]

    def rng_now(self) -> dict[str, Any]:
        return rng_state(self._devices)

    def save(self) -> None:
        """Copy the RNG states and every buffer (device copies, no sync)."""
        self.rng = rng_state(self._devices)
        named = [(n, b) for n, m, a in self._where if _copyable(b := getattr(m, a))]
        names = [n for n, _ in named]
        bufs = [b.detach() for _, b in named]
        same = names == self._names and all(
            c.shape == b.shape and c.dtype == b.dtype and c.device == b.device
            for c, b in zip(self._copies, bufs, strict=True)
        )
        if not same:
            self._names, self._copies = names, [b.clone() for b in bufs]
        elif bufs:
            with torch.no_grad():
                for copies, sources in local_groups(self._copies, bufs):
                    torch._foreach_copy_(copies, sources)

    def has_running_stats(self) -> bool:
        """Whether a module keeps running statistics its forward writes in training
        (BatchNorm, InstanceNorm with ``track_running_stats``)."""
        return any(
            isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
            for m in self.model.modules()
        )

    def restore_buffers(self) -> None:
        """Write the saved buffers back (a buffer replaced since is left alone)."""
        self._where = self._locate()
        current = {n: getattr(m, a) for n, m, a in self._where}
        pairs = [
            (current[n], c)
            for n, c in zip(self._names, self._copies, strict=True)
            if n in current and current[n].shape == c.shape and current[n].dtype == c.dtype
        ]
        if pairs:
            with torch.no_grad():
                for bufs, copies in local_groups([b for b, _ in pairs], [c for _, c in pairs]):
                    torch._foreach_copy_(bufs, copies)

    def gate_buffers(self, keep: torch.Tensor) -> None:
        """Keep the buffers the step's forward wrote only where ``keep`` (a device bool),
        else the saved ones: ``where(keep, now, saved)``, no sync (the guard's deferred
        mode gates BatchNorm's running statistics as it gates the weights)."""
        current = {n: getattr(m, a) for n, m, a in self._where}
        with torch.no_grad():
            for n, c in zip(self._names, self._copies, strict=True):
                b = current.get(n)
                if b is not None and b.shape == c.shape and b.dtype == c.dtype:
                    here = local_part(b)  # (a DTensor's local part: no collective)
                    torch.where(keep.to(here.device), here, local_part(c), out=here)

    def restore_rng(self) -> None:
        set_rng_state(self.rng)


def _copyable(b: torch.Tensor) -> bool:
    try:
        b._version  # noqa: B018 (inference tensors have none and cannot be written)
    except RuntimeError:
        return False
    return b.layout == torch.strided


def cuda_devices(model: nn.Module) -> list[torch.device]:
    return sorted({p.device for p in model.parameters() if p.device.type == "cuda"}, key=str)


def rng_state(devices: list[torch.device]) -> dict[str, Any]:
    """The torch RNG states a step draws from: CPU, and the given CUDA devices."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    for d in devices:
        state[str(d)] = torch.cuda.get_rng_state(d)
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    for key, value in state.items():
        if key == "cpu":
            torch.set_rng_state(value)
        else:
            torch.cuda.set_rng_state(value, torch.device(key))
