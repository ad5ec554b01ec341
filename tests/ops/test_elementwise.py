"""Elementwise ops: values against torch/float64, and the NaN-gradient traps."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
import torch.nn.functional as F

from floatguard.ops import (
    log1mexp,
    log1pexp,
    logaddexp,
    safe_div,
    safe_log,
    safe_sqrt,
    sigmoid,
    softplus,
)

X = torch.tensor([-1e4, -1000.0, -40.0, -1.0, -1e-8, 0.0, 1e-8, 0.5, 30.0, 1000.0, 1e4])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_sigmoid_softplus_values(dtype: torch.dtype) -> None:
    x = X.to(dtype)
    tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6, torch.float64: 1e-12}[
        dtype
    ]
    torch.testing.assert_close(sigmoid(x).double(), torch.sigmoid(x.double()), atol=tol, rtol=tol)
    ref_sp = torch.logaddexp(torch.zeros_like(x.double()), x.double())
    torch.testing.assert_close(log1pexp(x).double(), ref_sp, atol=tol, rtol=tol)
    torch.testing.assert_close(softplus(x).double(), ref_sp, atol=tol, rtol=tol)
    x64 = x.double()
    torch.testing.assert_close(
        softplus(x64, beta=2.0), torch.logaddexp(torch.zeros_like(x64), 2 * x64) / 2
    )
    # torch's softplus without its threshold overflows where ours does not.
    assert float(F.softplus(torch.tensor(1000.0), threshold=1e9)) == float("inf")
    assert float(softplus(torch.tensor(1000.0))) == 1000.0


def test_gradients_finite_at_extremes() -> None:
    x = X.double().clone().requires_grad_(True)
    for fn in (sigmoid, log1pexp):
        (g,) = torch.autograd.grad(fn(x).sum(), x)
        assert bool(torch.isfinite(g).all())
        s = torch.sigmoid(x.detach())
        torch.testing.assert_close(g, s * (1 - s) if fn is sigmoid else s)
    assert torch.autograd.gradcheck(
        sigmoid, (torch.randn(5, dtype=torch.float64, requires_grad=True) * 30,)
    )


def test_log1mexp_accuracy_on_both_branches() -> None:
    a = torch.tensor([1e-10, 1e-5, 0.1, math.log(2), 1.0, 20.0, 50.0], dtype=torch.float64)
    mpmath.mp.dps = 50  # reference at 50 digits (mpmath ships with torch's sympy)
    ref = torch.tensor(
        [float(mpmath.log(1 - mpmath.exp(-mpmath.mpf(v)))) for v in a.tolist()], dtype=torch.float64
    )
    torch.testing.assert_close(log1mexp(a), ref, rtol=1e-14, atol=0)
    torch.testing.assert_close(log1mexp(-a), ref, rtol=1e-14, atol=0)
    naive = torch.log(1 - torch.exp(-a))
    # The naive form loses everything far from 0 (log(1 - 2e-22) = 0) and at 1e-17 (-inf).
    assert float(naive[-1]) == 0.0 and float(ref[-1]) < -1e-22
    assert float(torch.log(1 - torch.exp(torch.tensor(-1e-17, dtype=torch.float64)))) == -math.inf
    assert math.isfinite(float(log1mexp(torch.tensor(1e-17, dtype=torch.float64))))
    assert float(log1mexp(torch.tensor(0.0))) == -math.inf
    x = a[2:].clone().requires_grad_(True)  # away from the log singularity at 0
    assert torch.autograd.gradcheck(log1mexp, (x,))


def test_logaddexp() -> None:
    a = torch.tensor([0.0, -math.inf, -math.inf, 1e4, 3.0, math.inf], dtype=torch.float64)
    b = torch.tensor([0.0, -math.inf, 2.0, -1e4, 3.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(logaddexp(a, b), torch.logaddexp(a, b))
    ar, br = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    ga, gb = torch.autograd.grad(logaddexp(ar, br).sum(), (ar, br))
    assert bool(torch.isfinite(ga).all()) and bool(torch.isfinite(gb).all())
    assert float(ga[0]) == 0.5 and float(gb[4]) == 0.5
    assert float(ga[1]) == 0.5  # -inf with -inf: still the symmetric split
    assert float(ga[2]) == 0.0 and float(gb[2]) == 1.0


def test_where_log_trap_vs_safe_log() -> None:
    x = torch.tensor([0.0, 2.0], requires_grad=True)
    trap = torch.where(x > 0, torch.log(x), torch.zeros_like(x))
    (g_trap,) = torch.autograd.grad(trap.sum(), x)
    assert math.isnan(float(g_trap[0]))  # the classic NaN gradient
    y = safe_log(x, fill=0.0)
    (g,) = torch.autograd.grad(y.sum(), x)
    assert y.tolist() == [0.0, pytest.approx(math.log(2.0))] and g.tolist() == [0.0, 0.5]
    assert float(safe_log(torch.tensor(-1.0))) == -math.inf


def test_sqrt_norm_trap_vs_safe_sqrt() -> None:
    v = torch.zeros(3, requires_grad=True)
    (g_trap,) = torch.autograd.grad(torch.sqrt((v * v).sum()), v)
    assert bool(torch.isnan(g_trap).all())
    (g,) = torch.autograd.grad(safe_sqrt((v * v).sum()), v)
    assert g.tolist() == [0.0, 0.0, 0.0]
    x = torch.tensor([4.0, 0.0, -1.0], requires_grad=True)
    y = safe_sqrt(x)
    (gx,) = torch.autograd.grad(y.sum(), x)
    assert y.tolist() == [2.0, 0.0, 0.0] and gx.tolist() == [0.25, 0.0, 0.0]


def test_safe_div() -> None:
    a = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    b = torch.tensor([2.0, 0.0, -1.0], requires_grad=True)
    y = safe_div(a, b, fill=7.0)
    ga, gb = torch.autograd.grad(y.sum(), (a, b))
    assert y.tolist() == [0.5, 7.0, -3.0]
    assert ga.tolist() == [0.5, 0.0, -1.0] and gb.tolist() == [-0.25, 0.0, -3.0]


def test_bad_input() -> None:
    with pytest.raises(TypeError, match=r"got torch.int64"):
        sigmoid(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="beta=0"):
        softplus(torch.ones(2), beta=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_every_dtype_against_float64(dtype: torch.dtype) -> None:
    x = torch.tensor([-30.0, -2.5, -0.1, 0.0, 0.1, 2.5, 30.0]).to(dtype)
    x64 = x.double()
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-6, torch.float64: 1e-12}[
        dtype
    ]
    nz = x64 != 0
    cases = [
        (log1mexp(x)[nz], torch.log(-torch.expm1(-x64.abs()))[nz]),
        (logaddexp(x, x.flip(0)), torch.logaddexp(x64, x64.flip(0))),
        (safe_log(x)[x64 > 0], torch.log(x64[x64 > 0])),
        (safe_sqrt(x), torch.sqrt(x64.clamp(min=0))),
        (safe_div(x, x.flip(0) + 1), x64 / (x64.flip(0) + 1)),
    ]
    for got, ref in cases:
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol)
