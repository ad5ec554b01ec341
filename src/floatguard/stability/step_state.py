"""What one step changes besides the weights: the RNG states and the module buffers.

The guard saves them before a step so that a bad step can be replayed exactly (the
same dropout masks, the same BatchNorm statistics) and so that a step that is not
applied leaves no trace (BatchNorm's running statistics do not learn the NaN batch).

Buffers are copied into storage kept from one step to the next (no allocation after
the first step). Only buffers that a step has changed are copied: the first save
copies every buffer; later saves copy those whose version counter moved since they
were last seen, a set that settles after one step (BatchNorm's running statistics
and counters). A buffer that changes for the first time on a bad step cannot be
restored to its value before that step (it was not copied): it is restored from
its last copy, or left as it is when it never had one. No host-device sync.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["StepState"]


def _version(t: torch.Tensor) -> int | None:
    try:
        return int(t._version)
    except RuntimeError:  # an inference tensor
        return None


class StepState:
    """Saved RNG states and (changing) buffers of ``model``, for replay and undo."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._copies: dict[str, torch.Tensor] = {}
        self._versions: dict[str, int | None] = {}
        self._changing: set[str] | None = None  # None: not saved yet, copy all
        self.rng: dict[str, Any] = {}

    def save(self) -> None:
        """Copy the RNG states and the buffers a step changes (device copies, no sync)."""
        self.rng = rng_state(self.model)
        first = self._changing is None
        changing: set[str] = set() if self._changing is None else self._changing
        for name, buf in self.model.named_buffers():
            v = _version(buf)
            if not first and self._versions.get(name) == v and name not in changing:
                continue
            if not first:
                changing.add(name)
            copy = self._copies.get(name)
            with torch.no_grad():
                if copy is None or copy.shape != buf.shape or copy.dtype != buf.dtype:
                    self._copies[name] = buf.detach().clone()
                else:
                    copy.copy_(buf)
            self._versions[name] = v
        self._changing = changing

    def restore_buffers(self) -> None:
        """Write the saved buffers back (those that changed since they were saved)."""
        buffers = dict(self.model.named_buffers())
        with torch.no_grad():
            for name, copy in self._copies.items():
                buf = buffers.get(name)
                if buf is None or _version(buf) == self._versions.get(name):
                    continue
                if buf.shape == copy.shape and buf.dtype == copy.dtype:
                    buf.copy_(copy)
                    self._versions[name] = _version(buf)

    def restore_rng(self) -> None:
        set_rng_state(self.rng)


def rng_state(model: nn.Module) -> dict[str, Any]:
    """The torch RNG states a step draws from: CPU, and the model's CUDA device."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    devices = {p.device for p in model.parameters() if p.device.type == "cuda"}
    for d in devices:
        state[str(d)] = torch.cuda.get_rng_state(d)
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    for key, value in state.items():
        if key == "cpu":
            torch.set_rng_state(value)
        else:
            torch.cuda.set_rng_state(value, torch.device(key))
