"""ZClip's arithmetic, written once for three places (:class:`floatguard.stability.clip.ZClip`
picks one): float64 device tensors (no sync), Python floats on the host (after the
guard's read), and the host's state with a device norm (the guard's deferred mode).
The same IEEE float64 operations in each, so the same bits."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["DeviceOps", "HostOps", "MixedOps"]


class DeviceOps:
    """ZClip's arithmetic on float64 device tensors (no sync)."""

    @staticmethod
    def where(c: Any, a: Any, b: Any) -> Any:
        return torch.where(c, a, b)

    @staticmethod
    def sqrt(x: Any) -> Any:
        return torch.sqrt(x)

    @staticmethod
    def isfinite(x: Any) -> Any:
        return torch.isfinite(x)

    @staticmethod
    def clamp_max(x: Any, m: float) -> Any:
        return torch.clamp(x, max=m)

    @staticmethod
    def clamp_min(x: Any, m: float) -> Any:
        return torch.clamp(x, min=m)

    @staticmethod
    def div(a: Any, b: Any) -> Any:
        # IEEE division of tensors: a Python scalar on either side becomes a tensor
        # (torch computes scalar / tensor as reciprocal * scalar, and CUDA divides by a
        # scalar as a multiplication by its reciprocal: not the host's quotient)
        if not isinstance(a, torch.Tensor):
            a = torch.full_like(b, a)
        if not isinstance(b, torch.Tensor):
            b = torch.full_like(a, b)
        return torch.div(a, b)

    @staticmethod
    def not_(x: Any) -> Any:
        return ~x

    @staticmethod
    def num(x: Any) -> Any:
        return x.to(torch.float64)

    @staticmethod
    def one(like: Any) -> Any:
        return torch.ones_like(like)


class MixedOps(DeviceOps):
    """ZClip's arithmetic with the state on the host (Python floats and bools) and the
    norm on the device: the host's coefficient, computed without reading the norm."""

    @staticmethod
    def where(c: Any, a: Any, b: Any) -> Any:
        if isinstance(c, bool):
            return a if c else b
        return torch.where(c, a, b)

    @staticmethod
    def sqrt(x: Any) -> Any:
        return torch.sqrt(x) if isinstance(x, torch.Tensor) else math.sqrt(x)


class HostOps:
    """The same arithmetic on Python floats (IEEE float64, as on device): for a caller
    that already holds the norm on the host (the guard, after its one read)."""

    @staticmethod
    def where(c: Any, a: Any, b: Any) -> Any:
        return a if c else b

    @staticmethod
    def sqrt(x: Any) -> Any:
        return math.sqrt(x)

    @staticmethod
    def isfinite(x: Any) -> Any:
        return math.isfinite(x)

    @staticmethod
    def clamp_max(x: Any, m: float) -> Any:
        return x if x <= m or x != x else m

    @staticmethod
    def clamp_min(x: Any, m: float) -> Any:
        return x if x >= m or x != x else m

    @staticmethod
    def div(a: Any, b: Any) -> Any:
        # IEEE division, as torch does it (Python raises on a zero divisor)
        if b == 0:
            return (
                math.nan
                if a == 0 or a != a
                else math.copysign(math.inf, a) * (math.copysign(1.0, b))
            )
        return a / b

    @staticmethod
    def not_(x: Any) -> Any:
        return not x

    @staticmethod
    def num(x: Any) -> Any:
        return float(x)

    @staticmethod
    def one(like: Any) -> Any:
        return 1.0
