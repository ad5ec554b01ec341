"""layer_norm and rms_norm with float32 statistics and a per-dtype default eps.

The lessons referred to here: docs/lessons.md.
"""

from __future__ import annotations

import torch

from floatguard.ops._common import acc_dtype, check_float

__all__ = ["DEFAULT_EPS", "default_eps", "layer_norm", "rms_norm"]

DEFAULT_EPS: dict[torch.dtype, float] = {
    torch.float64: 1e-5,
    torch.float32: 1e-5,
    torch.bfloat16: 1e-5,
    # fp16: 1e-4 is the first round value above fp16's smallest normal (6.1e-5), so the
    # eps is itself a normal fp16 number and 1/sqrt(var + eps) <= 100 keeps x_hat * weight
    # far from fp16's 65504 when a row is (near) constant. The lesson's advice ("fp16 may
    # need a larger eps") and torch's 1e-5 default, which is subnormal in fp16.
    torch.float16: 1e-4,
}
"""The eps each dtype gets when ``eps=None``."""


def default_eps(dtype: torch.dtype) -> float:
    """Default eps for ``dtype`` (see :data:`DEFAULT_EPS`)."""
    return DEFAULT_EPS.get(dtype, 1e-5)


def _shape(normalized_shape: int | tuple[int, ...] | list[int] | torch.Size) -> tuple[int, ...]:
    return (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)


def _check(x: torch.Tensor, shape: tuple[int, ...], eps: float, op: str) -> tuple[int, ...]:
    check_float(x, "x", op)
    if len(shape) == 0 or tuple(x.shape[-len(shape) :]) != shape or len(shape) > x.dim():
        raise ValueError(
            f"{op}: normalized_shape {shape} does not match the trailing dims of x {tuple(x.shape)}"
        )
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{op}: eps={eps!r} must be a non-negative number")
    return tuple(range(-len(shape), 0))


def layer_norm(
    x: torch.Tensor,
    normalized_shape: int | tuple[int, ...] | list[int] | torch.Size,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the trailing dims.

    Mean and (biased) variance are computed two-pass in float32 for half inputs,
    never as ``E[x^2] - E[x]^2``; the output has x's dtype. ``eps=None`` picks
    :func:`default_eps` for x's dtype (1e-4 for float16, 1e-5 otherwise).
    """
    shape = _shape(normalized_shape)
    e = default_eps(x.dtype) if eps is None else eps
    dims = _check(x, shape, e, "layer_norm")
    xf = x.to(acc_dtype(x.dtype))
    mean = xf.mean(dim=dims, keepdim=True)
    dev = xf - mean
    var = (dev * dev).mean(dim=dims, keepdim=True)
    y = dev * torch.rsqrt(var + e)
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype)


def rms_norm(
    x: torch.Tensor,
    normalized_shape: int | tuple[int, ...] | list[int] | torch.Size,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the trailing dims, statistics in float32.

    ``eps=None`` picks :func:`default_eps` for x's dtype. (torch's ``rms_norm``
    defaults to the dtype's machine epsilon instead.)
    """
    shape = _shape(normalized_shape)
    e = default_eps(x.dtype) if eps is None else eps
    dims = _check(x, shape, e, "rms_norm")
    xf = x.to(acc_dtype(x.dtype))
    y = xf * torch.rsqrt((xf * xf).mean(dim=dims, keepdim=True) + e)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)
