"""floatguard.gradcheck against torch.autograd.gradcheck, and on a wrong backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import floatguard
from floatguard.ops.gradcheck import verdict_for


class _WrongSquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def,override]
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def,override]
        (x,) = ctx.saved_tensors
        return g * x  # wrong: should be 2 * x


class _SlightlyOff(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def,override]
        ctx.save_for_backward(x)
        return torch.sin(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def,override]
        (x,) = ctx.saved_tensors
        return g * torch.cos(x) * (1 + 1e-4)


def test_agrees_with_torch_on_correct_functions() -> None:
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    for fn, args in [
        (lambda a, b: torch.tanh(a @ b), (x, y)),
        (lambda a: floatguard.ops.logsumexp(a, -1), (x,)),
        (lambda a: floatguard.ops.softmax(a * 3, 0), (x,)),
    ]:
        assert torch.autograd.gradcheck(fn, args)
        report = floatguard.gradcheck(fn, args)
        assert report.ok, str(report)
        assert all(e.verdict == "perfect" for e in report.entries), str(report)


def test_flags_a_wrong_backward_like_torch() -> None:
    x = torch.rand(5, dtype=torch.float64) + 0.5
    with pytest.raises(RuntimeError, match="Jacobian mismatch"):
        torch.autograd.gradcheck(_WrongSquare.apply, (x.clone().requires_grad_(True),))
    report = floatguard.gradcheck(_WrongSquare.apply, (x,))
    assert not report.ok
    assert report["input[0]"].verdict in ("suspicious", "wrong")
    assert report.max_rel_error == pytest.approx(0.5, rel=1e-6)  # |x - 2x| / |2x|
    assert "WRONG" in str(report)
    subtle = floatguard.gradcheck(_SlightlyOff.apply, (x,))
    assert subtle["input[0]"].verdict == "questionable"


def test_module_parameters_and_inputs_are_untouched() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(2, 3)  # the lesson's 3x2 weight
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(4, 2)
    x_before = x.clone()
    report = floatguard.gradcheck(layer, (x,), wrt="parameters")
    assert [e.name for e in report.entries] == ["weight", "bias"]
    assert report.ok and report["weight"].shape == (3, 2)
    for k, v in layer.state_dict().items():
        assert torch.equal(v, before[k]) and v.dtype == torch.float32
    assert torch.equal(x, x_before)
    inputs = floatguard.gradcheck(layer, x)
    assert inputs.ok and inputs.entries[0].name == "input[0]"


def test_verdict_thresholds() -> None:
    assert [verdict_for(e) for e in (1e-9, 1e-6, 1e-4, 1e-2, 2.0, float("nan"))] == [
        "perfect",
        "acceptable",
        "questionable",
        "suspicious",
        "wrong",
        "wrong",
    ]


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="wrt='weights'"):
        floatguard.gradcheck(torch.sin, torch.ones(2), wrt="weights")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"needs an nn.Module"):
        floatguard.gradcheck(torch.sin, torch.ones(2), wrt="parameters")
    with pytest.raises(ValueError, match="eps=0"):
        floatguard.gradcheck(torch.sin, torch.ones(2), eps=0)
    with pytest.raises(ValueError, match="no floating-point tensor among the inputs"):
        floatguard.gradcheck(lambda i: torch.ones(2), torch.ones(2, dtype=torch.long))
