"""One bad batch in steady training, through the guard with its default policy (issue 36,
item 5): "a batch with a loss 5x its neighbours was applied with no event"."""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from floatguard import Guard


def _train(seed: int, bad: int | None, steps: int) -> dict[int, tuple[str, str | None, float]]:
    """A 10-class MLP classifier on Gaussian blobs (AdamW, lr 3e-3), each step under the
    guard's defaults; at step ``bad`` the batch's labels are shuffled. The step events
    by step: (action, reason, loss)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    centers = 1.5 * torch.randn(10, 20, generator=g)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 10))
    guard = Guard(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    for step in range(steps):
        y = torch.randint(0, 10, (64,), generator=g)
        x = centers[y] + torch.randn(64, 20, generator=g)
        if step == bad:
            y = y[torch.randperm(64, generator=g)]

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            return F.cross_entropy(model(x), y)

        guard.step(closure)
    return {e.step: (e["action"], e["reason"], e["loss"]) for e in guard.events.of_kind("step")}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clean_run_has_no_spike(seed: int) -> None:
    steps = _train(seed, None, 120)
    assert [s for s, (action, *_) in steps.items() if action != "applied"] == []


@pytest.mark.parametrize(
    ("seed", "bad"), [(0, 30), (1, 30), (2, 30), (1, 80), (2, 80)], ids=lambda v: str(v)
)
def test_a_shuffled_batch_is_a_loss_spike(seed: int, bad: int) -> None:
    steps = _train(seed, bad, bad + 5)
    neighbours = statistics.median(steps[s][2] for s in range(bad - 5, bad))
    # At step 30 the loss is still falling fast (the window's median is 2-3x the loss of
    # the moment): the shuffled batch is 5-9x its neighbours, and was applied before.
    assert steps[bad][2] > 5 * neighbours
    assert steps[bad][:2] == ("skipped", "loss_spike")
    assert [s for s, (action, *_) in steps.items() if action != "applied"] == [bad]
