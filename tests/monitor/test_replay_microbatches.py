"""Gradient accumulation: every micro-batch is localized as if it ran alone.

``guard.step([c1, c2])`` replays forward 1, backward 1, forward 2, backward 2 in one
replay. A NaN in the second micro-batch must be named exactly as in the first: its
data as phase "input" (and the step skipped as bad data), a module's NaN by module,
op and line.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from floatguard import Guard, replay

X = torch.rand(4, 8) + 0.5  # positive: log() of it is finite
Y = torch.randn(4, 3)


def _nan_batch() -> torch.Tensor:
    x = X.clone()
    x[1, 3] = math.nan
    return x


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _unchanged(model: nn.Module, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("bad_at", [0, 1, 2])
def test_a_nan_batch_in_any_micro_batch_is_bad_data(bad_at: int) -> None:
    model = _mlp()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batches = [X, X * 0.5, X * 2]
    batches[bad_at] = _nan_batch()
    closures = [lambda x=x: F.mse_loss(model(x), Y) for x in batches]
    before = _weights(model)
    r = guard.step(closures)
    assert (r.action, r.reason) == ("skipped", "nonfinite_input")
    f = r.fault
    assert f is not None
    assert (f.phase, f.module, f.op, f.tensor, f.kind) == ("input", "", "input", "input[0]", "nan")
    assert f.deterministic is True
    assert _unchanged(model, before)


def test_a_nan_target_in_the_second_micro_batch_is_bad_data() -> None:
    """Data that is not the model's input (a target the closure captured) enters in
    the loss code of micro-batch 2: still the step's data."""
    model = _mlp()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    bad_y = Y.clone()
    bad_y[2, 1] = math.nan
    r = guard.step([lambda: F.mse_loss(model(X), Y), lambda: F.mse_loss(model(X), bad_y)])
    assert (r.action, r.reason) == ("skipped", "nonfinite_input")
    f = r.fault
    assert f is not None and (f.phase, f.module, f.op) == ("input", "", "input")
    assert f.tensor.startswith("data into aten.mse_loss")
    assert f.source is not None and "bad_y" in f.source


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # NaN where x < 0


class LogStat(nn.Module):
    """Records a statistic with no gradient: its NaN (log of the negative values of
    its input, on every micro-batch) harms neither the loss nor the gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.stat = torch.zeros(())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.stat = torch.log(h).mean()
        return h


class LogNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.log = Log()
        self.lin = nn.Linear(8, 8)
        self.stat = LogStat()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stat(self.lin(self.log(x))))


def test_a_module_nan_in_the_second_micro_batch_is_named() -> None:
    """Micro-batch 1 only has the harmless NaN of ``stat``; micro-batch 2's negative
    value makes ``log`` produce the NaN that reaches the loss: that is the birth,
    not micro-batch 1's harmless one."""
    model = LogNet()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    neg = X.clone()
    neg[0, 5] = -1.0
    r = guard.step([lambda: F.mse_loss(model(X), Y), lambda: F.mse_loss(model(neg), Y)])
    assert r.reason == "nonfinite_loss" and r.action == "skipped"
    f = r.fault
    assert f is not None
    assert (f.phase, f.module, f.op, f.kind) == ("forward", "log", "aten.log.default", "nan")
    assert f.source is not None and "return torch.log(x)  # NaN where x < 0" in f.source


def test_the_first_harmed_micro_batch_is_named_when_several_are() -> None:
    model = LogNet()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    neg = X.clone()
    neg[0, 5] = -1.0
    r = guard.step(
        [
            lambda: F.mse_loss(model(X), Y),
            lambda: F.mse_loss(model(neg), Y),
            lambda: F.mse_loss(model(_nan_batch()), Y),
        ]
    )
    f = r.fault
    assert f is not None and (f.phase, f.module, f.op) == ("forward", "log", "aten.log.default")


def test_replay_names_each_micro_batch_like_the_first() -> None:
    """The public replay with two forward/backward passes: the NaN batch of the
    second is found by the model-input check."""
    model = _mlp()

    def step() -> torch.Tensor:
        losses = []
        for x in (X, _nan_batch()):
            loss = F.mse_loss(model(x), Y)
            loss.backward()
            losses.append(loss.detach())
        return torch.stack(losses).mean()

    r = replay(step)
    assert r is not None and (r.phase, r.op, r.tensor) == ("input", "input", "input[0]")


def test_code_after_the_last_backward_is_not_a_micro_batch() -> None:
    """Ops after the last backward that never call the model (the mean of the
    micro-batches' losses) are the step's loss code, not a next micro-batch's data."""
    model = _mlp()

    def step() -> torch.Tensor:
        losses = []
        for _ in range(2):
            loss = model(X).mean() + 2e38  # finite; two of them sum past float32's range
            loss.backward()
            losses.append(loss.detach())
        return torch.stack(losses).sum()

    r = replay(step, model=model)
    assert r is not None
    assert (r.op, r.phase, r.module, r.kind) == ("aten.sum.default", "loss", "", "inf")
