"""Mergeable moments (Welford / Chan) and accurate sums (Kahan-Neumaier, pairwise).

``E[x^2] - E[x]^2`` cancels catastrophically when the mean is large compared to
the spread: for float32 ``[1e6, 1e6+1, 1e6+2]`` the squares are ~1e12, spaced
65536 apart, and the true variance 0.6667 is lost. :class:`Moments` keeps the
mean and the sum of squared deviations ``M2`` instead, and combines two sets
with Chan et al.'s parallel update
``M2 = M2_a + M2_b + delta^2 * n_a * n_b / n`` (Welford 1962; Chan, Golub and
LeVeque 1979), so it streams over batches, steps and ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from floatguard.ops._common import acc_dtype, check_dim, check_float

__all__ = ["Moments", "compensated_sum", "pairwise_sum"]


def _dims(x: torch.Tensor, dim: int | tuple[int, ...] | None, op: str) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(x.dim()))
    ds = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(sorted({check_dim(x, d, op) for d in ds}))


@dataclass(frozen=True)
class Moments:
    """Count, mean and ``M2 = Σ (x - mean)^2`` of everything seen so far.

    Build one with :meth:`of` (a batch, reduced over ``dim``), then ``merge`` or
    ``update``; read ``mean``, ``var(correction=...)`` and ``std``. Statistics are
    held in float32 for half inputs, float64 stays float64. Each batch is reduced
    two-pass (mean first, then squared deviations), which is exact to a few ulp;
    merging is Chan's formula. Differentiable; no host sync. ``var`` of fewer
    than ``correction + 1`` values is NaN, as torch.
    """

    count: torch.Tensor
    mean: torch.Tensor
    m2: torch.Tensor

    @classmethod
    def of(cls, x: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> Moments:
        """Moments of ``x`` over ``dim`` (all dims by default)."""
        check_float(x, "x", "Moments.of")
        dims = _dims(x, dim, "Moments.of")
        xf = x.to(acc_dtype(x.dtype))
        n = math.prod(xf.shape[d] for d in dims)
        if n == 0:
            return cls.empty(
                [s for i, s in enumerate(xf.shape) if i not in dims],
                dtype=xf.dtype,
                device=xf.device,
            )
        if dims:
            mean = xf.mean(dim=dims, keepdim=True)
            dev = xf - mean
            m2 = (dev * dev).sum(dim=dims)
            mean = mean.squeeze(dims)
        else:  # a 0-d tensor: one value
            mean, m2 = xf.clone(), torch.zeros_like(xf)
        return cls(torch.full_like(mean, float(n)), mean, m2)

    @classmethod
    def empty(
        cls,
        shape: tuple[int, ...] | list[int] | torch.Size = (),
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> Moments:
        """No values seen: count 0 (merging with it is the identity)."""
        z = torch.zeros(tuple(shape), dtype=acc_dtype(dtype), device=device)
        return cls(z, z.clone(), z.clone())

    def merge(self, other: Moments) -> Moments:
        """The moments of both sets together (Chan et al.)."""
        if not isinstance(other, Moments):
            raise TypeError(f"can only merge Moments, got {type(other).__name__}")
        n = self.count + other.count
        safe_n = torch.where(n > 0, n, torch.ones_like(n))
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / safe_n)
        m2 = self.m2 + other.m2 + delta * delta * (self.count * other.count / safe_n)
        return Moments(n, mean, m2)

    def update(self, x: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> Moments:
        """These moments with a batch ``x`` (reduced over ``dim``) folded in."""
        return self.merge(Moments.of(x, dim))

    def var(self, correction: int = 0) -> torch.Tensor:
        """``M2 / (count - correction)``; ``correction=1`` is the unbiased estimate."""
        denom = self.count - correction
        return torch.where(denom > 0, self.m2 / torch.where(denom > 0, denom, 1.0), math.nan)

    def std(self, correction: int = 0) -> torch.Tensor:
        """Square root of :meth:`var`."""
        return torch.sqrt(self.var(correction))


def _reduced_last(
    x: torch.Tensor, dim: int | tuple[int, ...] | None, dtype: torch.dtype | None, op: str
) -> torch.Tensor:
    """x (in ``dtype``) with the reduced dims moved last and flattened into one."""
    check_float(x, "x", op)
    dims = _dims(x, dim, op)
    xs = x.to(dtype) if dtype is not None else x
    if not dims:
        return xs.unsqueeze(-1)
    keep = [d for d in range(xs.dim()) if d not in dims]
    return xs.permute(*keep, *dims).reshape(*[xs.shape[d] for d in keep], -1)


def pairwise_sum(
    x: torch.Tensor, dim: int | tuple[int, ...] | None = None, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Sum by a balanced tree of additions: error ``O(eps * log n)`` instead of ``O(eps * n)``.

    Accumulates in ``dtype`` (default: x's own dtype, so the gain is visible at
    that precision). Differentiable.
    """
    y = _reduced_last(x, dim, dtype, "pairwise_sum")
    if y.shape[-1] <= 1:
        return y.sum(dim=-1)
    while y.shape[-1] > 1:
        if y.shape[-1] % 2:
            y = torch.cat([y, torch.zeros_like(y[..., :1])], dim=-1)
        y = y[..., 0::2] + y[..., 1::2]
    return y[..., 0]


def _neumaier_steps(columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neumaier over the last dim, vectorised over the others: returns (sum, compensation)."""
    s = torch.zeros_like(columns[..., 0])
    c = torch.zeros_like(s)
    for i in range(columns.shape[-1]):
        xi = columns[..., i]
        t = s + xi
        # The low-order part lost by t: exact (Fast2Sum) when |s| >= |xi|, else swapped.
        # Once t is inf or NaN the correction is meaningless (inf - inf); keep it out.
        lost = torch.where(s.abs() >= xi.abs(), (s - t) + xi, (xi - t) + s)
        c = c + torch.where(torch.isfinite(t), lost, torch.zeros_like(lost))
        s = t
    return s, c


def compensated_sum(
    x: torch.Tensor, dim: int | tuple[int, ...] | None = None, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Kahan-Neumaier compensated sum: error about ``eps * |sum| + n * eps^2 * Σ|x|``.

    Accumulates in ``dtype`` (default: x's own). The n values are split into
    about sqrt(n) lanes that run Neumaier's loop side by side, and the lanes'
    sums and compensations are combined by a second Neumaier pass, so the Python
    loop is O(sqrt(n)) steps. inf and NaN propagate. Differentiable.
    """
    y = _reduced_last(x, dim, dtype, "compensated_sum")
    n = y.shape[-1]
    if n <= 1:
        return y.sum(dim=-1)
    lanes = max(1, math.isqrt(n))
    steps = -(-n // lanes)
    pad = lanes * steps - n
    if pad:
        y = torch.cat([y, torch.zeros((*y.shape[:-1], pad), dtype=y.dtype, device=y.device)], -1)
    # [..., lanes, steps]: each lane sums a contiguous run of the input in order.
    s, c = _neumaier_steps(y.reshape(*y.shape[:-1], lanes, steps))
    total, comp = _neumaier_steps(torch.cat([s, c], dim=-1))
    return total + comp
