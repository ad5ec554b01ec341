"""A view reads no value: the replay judges a tensor where an op reads it, never at a view.

FSDP2 views its freshly allocated all-gather outputs (memory no op of the step wrote,
holding whatever was there: a NaN at times) before it copies into them: taking that for
the step's data made a clean rank claim a NaN batch. Data viewed before it is used is
still data, judged at the op that reads it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from floatguard import Guard

X = torch.randn(4, 8)
Y = torch.randn(4, 8)


class Gathered(nn.Module):
    """Writes its activation through a view into memory no op of the step wrote, as
    FSDP2's all-gather does with ``out=`` (it allocates by resizing a storage, outside
    the dispatcher: the memory holds what was there, here a NaN)."""

    def __init__(self) -> None:
        super().__init__()
        self.memory = torch.zeros(32)  # a plain attribute, not a buffer

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with _disable_current_modes():  # stale memory: unseen by the replay's dispatch
            self.memory.fill_(math.nan)
        out = self.memory.view(4, 8)
        with torch.no_grad():
            torch.mul(h, 1.0, out=out)
        return out + (h - h.detach())  # the values written, the gradient through h


def test_a_view_of_memory_no_op_wrote_is_not_data() -> None:
    """The step's bad data is its target; a module before it views stale memory (NaN)
    it then writes: the target is named, not the view."""
    model = nn.Sequential(nn.Linear(8, 8), Gathered())
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    bad = Y.clone()
    bad[0, 3] = math.nan
    r = guard.step(lambda: F.mse_loss(model(X), bad))
    assert (r.action, r.reason) == ("skipped", "nonfinite_input")
    f = r.fault
    assert f is not None and (f.phase, f.module, f.op) == ("input", "", "input"), f
    assert "view" not in f.tensor, f


def test_a_target_viewed_before_use_is_still_input() -> None:
    model = nn.Sequential(nn.Linear(8, 8))
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    bad = Y.clone()
    bad[1, 2] = math.nan
    r = guard.step(lambda: F.mse_loss(model(X).view(-1), bad.view(-1)))
    assert (r.action, r.reason) == ("skipped", "nonfinite_input")
    f = r.fault
    assert f is not None and (f.phase, f.module, f.op) == ("input", "", "input"), f
    assert f.tensor.startswith("data into aten.") and "view" not in f.tensor, f
