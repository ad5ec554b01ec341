"""Elementwise functions with stable values *and* gradients everywhere.

Two traps recur. ``torch.where(x > 0, torch.log(x), 0)`` has a NaN gradient at
``x = 0``: where() routes zero gradient into the unused branch, but that branch's
own derivative there is infinite, and ``0 * inf = NaN``. The fix used here is the
double where: feed the unused branch a harmless input
(``torch.log(torch.where(x > 0, x, 1))``) so its derivative is finite. The second
trap is computing ``exp(x)`` for large ``x`` in a branch that is then discarded;
these functions only ever exponentiate ``-|x|``.
"""

from __future__ import annotations

import math

import torch

from floatguard.ops._common import acc_dtype, broadcast_tensors, check_float

__all__ = [
    "log1mexp",
    "log1pexp",
    "logaddexp",
    "safe_div",
    "safe_log",
    "safe_sqrt",
    "sigmoid",
    "softplus",
]


def _up(x: torch.Tensor, op: str) -> torch.Tensor:
    check_float(x, "x", op)
    return x.to(acc_dtype(x.dtype))


def _neg_abs(x: torch.Tensor) -> torch.Tensor:
    """``-|x|`` with derivative ``-sign(x)`` *including* 1 at 0 from the right.

    ``torch.abs`` has derivative 0 at 0, which would zero the gradient of every
    function below at x = 0 (sigmoid'(0) would come out 0 instead of 0.25).
    """
    return torch.where(x >= 0, -x, x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` from ``z = exp(-|x|)``: ``1/(1+z)`` for x >= 0, ``z/(1+z)`` below.

    Never overflows; half inputs compute in float32 and return their dtype.
    """
    xf = _up(x, "sigmoid")
    z = torch.exp(_neg_abs(xf))
    out = torch.where(xf >= 0, 1.0 / (1.0 + z), z / (1.0 + z))
    return out.to(x.dtype)


def log1pexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|))``: exact for every finite x.

    torch's softplus switches to the identity above a threshold (20 by default);
    this never needs one. Gradient: ``sigmoid(x)``.
    """
    xf = _up(x, "log1pexp")
    out = torch.where(xf >= 0, xf, 0.0) + torch.log1p(torch.exp(_neg_abs(xf)))
    return out.to(x.dtype)


def softplus(x: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """``log(1 + exp(beta * x)) / beta``, without a threshold (see :func:`log1pexp`)."""
    if not isinstance(beta, (int, float)) or not beta > 0:
        raise ValueError(f"softplus: beta={beta!r} must be a positive number")
    xf = _up(x, "softplus")
    bx = xf * beta
    out = (torch.where(bx >= 0, bx, 0.0) + torch.log1p(torch.exp(_neg_abs(bx)))) / beta
    return out.to(x.dtype)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(-|x|))`` (Mächler 2012): ``log(-expm1(-a))`` for ``a <= ln 2``,
    ``log1p(-exp(-a))`` above, each where it is accurate. ``-inf`` at 0."""
    xf = _up(x, "log1mexp")
    a = xf.abs()
    small = a <= math.log(2.0)
    # Double where: each branch only sees inputs where it is finite.
    a_small = torch.where(small, a, torch.ones_like(a))
    a_large = torch.where(small, torch.ones_like(a), a)
    out = torch.where(small, torch.log(-torch.expm1(-a_small)), torch.log1p(-torch.exp(-a_large)))
    return out.to(x.dtype)


def logaddexp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``log(exp(a) + exp(b)) = max + log1p(exp(-|a - b|))``; ``-inf`` with ``-inf`` is ``-inf``.

    The gradient at ``a == b`` is 0.5 each, and stays finite for infinite inputs.
    """
    af, bf = _up(a, "logaddexp"), _up(b, "logaddexp")
    af, bf = broadcast_tensors(af, bf)
    m = torch.maximum(af, bf)
    same = af == bf  # includes -inf/-inf and inf/inf, where a - b is NaN
    diff = torch.where(same, torch.zeros_like(af), af - bf)
    out = m + torch.log1p(torch.exp(-diff.abs()))
    return out.to(torch.promote_types(a.dtype, b.dtype))


def safe_log(x: torch.Tensor, *, fill: float = -math.inf) -> torch.Tensor:
    """``log(x)`` where ``x > 0``, ``fill`` elsewhere; the gradient there is 0, not NaN."""
    xf = _up(x, "safe_log")
    pos = xf > 0
    out = torch.where(pos, torch.log(torch.where(pos, xf, torch.ones_like(xf))), fill)
    return out.to(x.dtype)


def safe_div(a: torch.Tensor, b: torch.Tensor, *, fill: float = 0.0) -> torch.Tensor:
    """``a / b`` where ``b != 0``, ``fill`` elsewhere; gradients there are 0, not NaN/inf."""
    af, bf = _up(a, "safe_div"), _up(b, "safe_div")
    nz = bf != 0
    out = torch.where(nz, af / torch.where(nz, bf, torch.ones_like(bf)), fill)
    return out.to(torch.promote_types(a.dtype, b.dtype))


def safe_sqrt(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(x)`` for ``x > 0``, 0 for ``x <= 0``; the gradient at 0 is 0, not inf.

    (``torch.sqrt`` has gradient ``1/(2 sqrt(0)) = inf`` at 0, which turns the
    norm of a zero vector into NaN gradients.)
    """
    xf = _up(x, "safe_sqrt")
    pos = xf > 0
    out = torch.where(pos, torch.sqrt(torch.where(pos, xf, torch.ones_like(xf))), 0.0)
    return out.to(x.dtype)
