"""What one step changes besides the weights: the RNG states and the module buffers.

The guard saves them before a step so that a bad step can be replayed exactly (the
same dropout masks, the same BatchNorm statistics) and so that a step that is not
applied leaves no trace (BatchNorm's running statistics do not learn the NaN batch).

Every buffer is copied, with one ``torch._foreach_copy_`` into storage kept from one
step to the next (no allocation after the first step). Version counters cannot tell
which buffers a step changed: BatchNorm's kernel updates its running statistics
without bumping them. The cost is one copy of the buffers per step (BatchNorm
statistics, masks and rotary tables are small next to the step). No host sync.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["StepState", "rng_state", "set_rng_state"]


class StepState:
    """Saved RNG states and buffers of ``model``, for replay and undo."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._names: list[str] = []
        self._copies: list[torch.Tensor] = []
        self.rng: dict[str, Any] = {}

    def save(self) -> None:
        """Copy the RNG states and every buffer (device copies, no sync)."""
        self.rng = rng_state(self.model)
        named = [(n, b) for n, b in self.model.named_buffers() if _copyable(b)]
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
                torch._foreach_copy_(self._copies, bufs)

    def restore_buffers(self) -> None:
        """Write the saved buffers back (a buffer replaced since is left alone)."""
        current = dict(self.model.named_buffers())
        pairs = [
            (current[n], c)
            for n, c in zip(self._names, self._copies, strict=True)
            if n in current and current[n].shape == c.shape and current[n].dtype == c.dtype
        ]
        if pairs:
            with torch.no_grad():
                torch._foreach_copy_([b for b, _ in pairs], [c for _, c in pairs])

    def restore_rng(self) -> None:
        set_rng_state(self.rng)


def _copyable(b: torch.Tensor) -> bool:
    try:
        b._version  # noqa: B018 (inference tensors have none and cannot be written)
    except RuntimeError:
        return False
    return b.layout == torch.strided


def rng_state(model: nn.Module) -> dict[str, Any]:
    """The torch RNG states a step draws from: CPU, and the model's CUDA devices."""
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
