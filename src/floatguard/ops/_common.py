"""Helpers shared by the ops: accumulation dtype and input checks."""

from __future__ import annotations

import torch

_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float32 for half inputs, the input's own dtype otherwise."""
    return torch.float32 if dtype in _HALF else dtype


def check_float(x: object, name: str, op: str) -> torch.Tensor:
    """Raise a clear error unless ``x`` is a floating-point tensor; return it."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(
            f"{op}: {name} must be float16, bfloat16, float32 or float64, got {x.dtype}; "
            f"convert it first, e.g. {name}.float()"
        )
    return x


def check_dim(x: torch.Tensor, dim: int, op: str) -> int:
    """Normalise ``dim`` against ``x.dim()`` (0-dim tensors accept 0 and -1, like torch)."""
    n = max(x.dim(), 1)
    if not -n <= dim < n:
        raise IndexError(f"{op}: dim={dim} is out of range for a {x.dim()}-d tensor")
    return dim % n


def broadcast_shapes(*shapes: tuple[int, ...] | torch.Size) -> torch.Size:
    """Typed wrapper of ``torch.broadcast_shapes`` (raises RuntimeError when they do not)."""
    out: torch.Size = torch.broadcast_shapes(*shapes)  # type: ignore[no-untyped-call]
    return out


def broadcast_tensors(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Typed wrapper of ``torch.broadcast_tensors`` for two tensors."""
    x, y = torch.broadcast_tensors(a, b)  # type: ignore[no-untyped-call]
    return x, y
