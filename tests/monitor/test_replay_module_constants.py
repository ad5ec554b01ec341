"""A NaN a module writes into its activation is that module's bug, not bad data.

"Input" is data the step was given (the batch, a target): it exists before the
model's forward. A NaN constant a module creates in its forward (``torch.tensor``,
a Python NaN written by indexing: both reach the dispatcher as ``aten.lift_fresh``)
or writes with ``fill_`` is born in that module: phase "forward", the module's
qualified name, the op that put it into the activation and the line.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from floatguard import Guard, replay

X = torch.randn(4, 8)
Y = torch.randn(4, 3)


class Planted(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.scratch: torch.Tensor | None = None  # a plain attribute, reused by every call

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.form == "index":
            h[:, 0] = float("nan")  # PLANTED index
        elif self.form == "constant":
            h = h + torch.tensor(float("nan"))  # PLANTED constant
        elif self.form == "fill":
            h.fill_(float("nan"))  # PLANTED fill
        elif self.form == "mask":
            h[h.abs() >= h.abs().amax()] = float("nan")  # PLANTED mask
        elif self.form == "scratch":
            if self.scratch is None:
                self.scratch = torch.empty_like(h)
            # the step's first run left its NaN here: the replay finds it before the fill
            self.scratch.fill_(float("nan"))  # PLANTED scratch
            h = h + self.scratch
        return h


class Net(nn.Module):
    def __init__(self, form: str = "none") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 8), Planted(form), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@pytest.mark.parametrize(
    ("form", "op"),
    [
        ("index", "aten.fill_.Tensor"),
        ("constant", "aten.add.Tensor"),
        ("fill", "aten.fill_.Scalar"),
        ("mask", "aten.index_put_.default"),
        ("scratch", "aten.fill_.Scalar"),
    ],
)
def test_a_nan_a_module_writes_is_born_in_that_module(form: str, op: str) -> None:
    model = Net(form)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    r = guard.step(lambda: F.mse_loss(model(X), Y))
    assert r.reason == "nonfinite_loss"  # a model bug: not skipped as bad data
    f = r.fault
    assert f is not None
    assert (f.phase, f.module, f.op, f.kind) == ("forward", "body.1", op, "nan")
    assert f.tensor == "output" and f.deterministic is True
    assert f.source is not None and f"# PLANTED {form}" in f.source


@pytest.mark.parametrize(
    ("form", "op"), [("index", "aten.fill_.Tensor"), ("constant", "aten.add.Tensor")]
)
def test_a_module_constant_in_a_later_micro_batch_is_the_modules(form: str, op: str) -> None:
    model = Net()
    plant = model.body[1]
    assert isinstance(plant, Planted)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def micro_batch(form: str) -> torch.Tensor:
        plant.form = form  # the module's bug shows on the second micro-batch only
        return F.mse_loss(model(X), Y)

    r = guard.step([lambda: micro_batch("none"), lambda: micro_batch(form)])
    assert r.reason == "nonfinite_loss"
    f = r.fault
    assert f is not None and (f.phase, f.module, f.op) == ("forward", "body.1", op)


def test_a_nan_in_the_batch_is_still_input() -> None:
    model = Net()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    bad = X.clone()
    bad[2, 2] = math.nan
    r = guard.step(lambda: F.mse_loss(model(bad), Y))
    assert (r.action, r.reason) == ("skipped", "nonfinite_input")
    f = r.fault
    assert f is not None and (f.phase, f.module, f.op, f.tensor) == (
        "input",
        "",
        "input",
        "input[0]",
    )


def test_a_batch_the_closure_builds_from_python_values_is_input() -> None:
    """``torch.tensor`` and indexing in the closure, outside the model: data."""
    model = Net()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    rows = X.tolist()
    rows[1][4] = math.nan

    def closure() -> torch.Tensor:
        return F.mse_loss(model(torch.tensor(rows)), Y)

    r = guard.step(closure)
    assert (r.action, r.reason) == ("skipped", "nonfinite_input")
    f = r.fault
    assert f is not None and (f.phase, f.op, f.tensor) == ("input", "input", "input[0]")


def test_a_target_the_loss_code_builds_from_python_values_is_input() -> None:
    model = Net()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    targets = Y.tolist()
    targets[3][0] = math.nan

    def closure() -> torch.Tensor:
        return F.mse_loss(model(X), torch.tensor(targets))

    r = guard.step(closure)
    assert (r.action, r.reason) == ("skipped", "nonfinite_input")
    f = r.fault
    assert f is not None and (f.phase, f.module, f.op) == ("input", "", "input")
    assert f.tensor == "data into aten.lift_fresh.default"


class NaNPadding(nn.Module):
    """Replaces non-finite values by a NaN sentinel constant: on finite activations the
    constant is never selected, and harms nothing."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.where(torch.isfinite(h), h, torch.tensor(float("nan")))


class Log(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.log(h)  # NaN on negative values


def test_an_unused_nan_constant_is_neither_data_nor_a_birth() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), NaNPadding(), Log(), nn.Linear(8, 3))
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    r = guard.step(lambda: F.mse_loss(model(X), Y))
    assert r.reason == "nonfinite_loss"
    f = r.fault
    assert f is not None and (f.phase, f.module, f.op) == ("forward", "2", "aten.log.default")


def test_an_infinite_module_constant_as_a_mask_fill_is_intended() -> None:
    class MaskedMax(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            masked = h.masked_fill(h < 0, torch.tensor(float("-inf")))
            return masked.amax(dim=1, keepdim=True) * h

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), MaskedMax(), nn.Linear(8, 3))
    assert replay(lambda: F.mse_loss(model(X), Y).backward()) is None
