"""softmax, log_softmax, logsumexp and a streaming log-sum-exp state.

All three subtract the row maximum before ``exp`` (the log-sum-exp trick), so
no finite input overflows: ``softmax([1000, 2000, 3000]) = [0, 0, 1]`` and
``logsumexp([-1000] * 3) = -998.9014``. For float16/bfloat16 inputs the work
runs in float32 and the result is cast back to the input dtype.

Rows that are entirely ``-inf`` (a fully masked row) have no mass. torch gives
NaN there; floatguard gives ``logsumexp = -inf``, ``softmax = 0`` and
``log_softmax = -inf`` (the limits as the mass goes to zero), with gradients that
stay finite (zero). Pass ``empty_rows="nan"`` to get torch's NaN instead. A
``+inf`` entry gives NaN (no meaningful distribution), and NaN propagates.
Everything here is built from differentiable torch ops, so higher-order
gradients work; nothing syncs with the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from floatguard.ops._common import acc_dtype, check_dim, check_float

__all__ = ["LogSumExp", "log_softmax", "logsumexp", "softmax"]

EmptyRows = Literal["zero", "nan"]


def _check_empty_rows(empty_rows: str, op: str) -> None:
    if empty_rows not in ("zero", "nan"):
        raise ValueError(f"{op}: empty_rows={empty_rows!r}; use 'zero' or 'nan'")


def _shifted(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x - m, m, sum(exp(x - m)))`` with ``m`` the detached row max (0 for all -inf rows)."""
    m = torch.amax(x, dim=dim, keepdim=True).detach()
    # An all -inf row has max -inf; x - (-inf) would be NaN. Shift by 0 instead:
    # exp(-inf - 0) = 0 and the row's sum is 0, which the callers handle. A +inf or
    # NaN max is kept, so such rows come out NaN (as torch).
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)
    z = x - m
    return z, m, torch.exp(z).sum(dim=dim, keepdim=True)


def _normalized(x: torch.Tensor, dim: int, empty_rows: str, op: str, log: bool) -> torch.Tensor:
    """Shared body of softmax (``log=False``) and log_softmax (``log=True``)."""
    check_float(x, "x", op)
    _check_empty_rows(empty_rows, op)
    if x.numel() == 0:
        return x.clone()
    d = check_dim(x, dim, op)
    xf = x.to(acc_dtype(x.dtype))
    if xf.dim() == 0:
        xf = xf.reshape(1)
    z, _, s = _shifted(xf, d)
    has_mass = s != 0  # NaN rows count as having mass, so NaN propagates
    safe_s = torch.where(has_mass, s, torch.ones_like(s))
    y = z - torch.log(safe_s) if log else torch.exp(z) / safe_s
    if empty_rows == "nan":
        y = torch.where(has_mass, y, torch.full_like(y, math.nan))
    return y.reshape(x.shape).to(x.dtype)


def softmax(x: torch.Tensor, dim: int = -1, *, empty_rows: EmptyRows = "zero") -> torch.Tensor:
    """Numerically stable softmax along ``dim``; all ``-inf`` rows give zeros (or NaN)."""
    return _normalized(x, dim, empty_rows, "softmax", log=False)


def log_softmax(x: torch.Tensor, dim: int = -1, *, empty_rows: EmptyRows = "zero") -> torch.Tensor:
    """Stable ``x - logsumexp(x)`` along ``dim``; all ``-inf`` rows give ``-inf`` (or NaN)."""
    return _normalized(x, dim, empty_rows, "log_softmax", log=True)


def logsumexp(
    x: torch.Tensor,
    dim: int | tuple[int, ...] = -1,
    keepdim: bool = False,
    *,
    empty_rows: EmptyRows = "zero",
) -> torch.Tensor:
    """Stable ``log(sum(exp(x)))`` over ``dim`` (an int or a tuple, as torch).

    An empty reduction or an all ``-inf`` row gives ``-inf`` (torch agrees for the
    value; its gradient there is NaN, ours is zero). ``empty_rows="nan"`` gives NaN.
    """
    check_float(x, "x", "logsumexp")
    _check_empty_rows(empty_rows, "logsumexp")
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    dims = tuple(check_dim(x, d, "logsumexp") for d in dims)
    xf = x.to(acc_dtype(x.dtype))
    squeeze0 = xf.dim() == 0
    if squeeze0:
        xf = xf.reshape(1)
    if xf.numel() == 0:
        m = torch.full_like(xf.sum(dim=dims, keepdim=True), -math.inf)
        out = m if keepdim else m.squeeze(dims)
        return out.to(x.dtype)
    m = torch.amax(xf, dim=dims, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = torch.exp(xf - m).sum(dim=dims, keepdim=True)
    has_mass = s != 0  # NaN rows count as having mass, so NaN propagates
    out = m + torch.log(torch.where(has_mass, s, torch.ones_like(s)))
    empty = -math.inf if empty_rows == "zero" else math.nan
    out = torch.where(has_mass, out, torch.full_like(out, empty))
    if not keepdim:
        out = out.squeeze(dims)
    if squeeze0:
        out = out.reshape(())
    return out.to(x.dtype)


@dataclass(frozen=True)
class LogSumExp:
    """Streaming log-sum-exp: ``(max, sum)`` with ``value = max + log(sum)``.

    ``sum`` is relative to ``max`` (``sum = Σ exp(x - max)``), so neither ever
    overflows. ``absorb`` folds in a block of values along a dim, ``merge``
    combines two states (over chunks, over time, across ranks: all-gather the
    two tensors and merge), and merging is associative up to rounding. The empty
    state is ``(-inf, 0)``; merging with it is the identity (the lesson's (docs/lessons.md) online
    softmax computes ``exp(-inf - (-inf)) = NaN`` there; this does not).
    States hold float32 for half inputs. All operations are differentiable.
    """

    max: torch.Tensor
    sum: torch.Tensor

    @classmethod
    def empty(
        cls,
        shape: tuple[int, ...] | torch.Size = (),
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> LogSumExp:
        """The state of nothing absorbed yet: ``value() = -inf``."""
        dt = acc_dtype(dtype)
        return cls(
            torch.full(tuple(shape), -math.inf, dtype=dt, device=device),
            torch.zeros(tuple(shape), dtype=dt, device=device),
        )

    @classmethod
    def of(cls, x: torch.Tensor, dim: int = -1) -> LogSumExp:
        """The state of the values of ``x`` along ``dim`` (that dim is reduced away)."""
        check_float(x, "x", "LogSumExp.of")
        d = check_dim(x, dim, "LogSumExp.of")
        xf = x.to(acc_dtype(x.dtype))
        if xf.shape[d] == 0:
            shape = xf.shape[:d] + xf.shape[d + 1 :]
            return cls.empty(shape, dtype=xf.dtype, device=xf.device)
        m = torch.amax(xf, dim=d)
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        s = torch.exp(xf - m_safe.unsqueeze(d)).sum(dim=d)
        return cls(m, s)

    def absorb(self, x: torch.Tensor, dim: int = -1) -> LogSumExp:
        """This state with the values of ``x`` along ``dim`` folded in."""
        return self.merge(LogSumExp.of(x, dim))

    def merge(self, other: LogSumExp) -> LogSumExp:
        """The state of both inputs together (commutative; associative up to rounding)."""
        if not isinstance(other, LogSumExp):
            raise TypeError(f"can only merge a LogSumExp, got {type(other).__name__}")
        m = torch.maximum(self.max, other.max)
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        s = self.sum * torch.exp(self.max - m_safe) + other.sum * torch.exp(other.max - m_safe)
        return LogSumExp(m, s)

    def value(self) -> torch.Tensor:
        """``log Σ exp(x)`` of everything absorbed: ``-inf`` for the empty state."""
        m_safe = torch.where(torch.isfinite(self.max), self.max, torch.zeros_like(self.max))
        has_mass = self.sum != 0
        out = m_safe + torch.log(torch.where(has_mass, self.sum, torch.ones_like(self.sum)))
        return torch.where(has_mass, out, torch.full_like(out, -math.inf))
