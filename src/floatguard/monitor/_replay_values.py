"""The values a replay judges: an op's floating operands, their severity, their memory."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from floatguard._values import local_part, values_of


def _float_operands(
    obj: Any, constant: Callable[[torch.Tensor], bool] | None = None
) -> tuple[list[torch.Tensor], list[float], list[torch.Tensor]]:
    """The floating tensors in ``obj`` (by their values), its float scalars, and the
    floating tensors ``constant`` picks out (module constants), apart."""
    leaves, _ = tree_flatten(obj)
    tensors: list[torch.Tensor] = []
    consts: list[torch.Tensor] = []
    for x in leaves:
        if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
            (consts if constant is not None and constant(x) else tensors).append(values_of(x))
    scalars = [float(x) for x in leaves if isinstance(x, float)]
    return tensors, scalars, consts


def _severity(t: torch.Tensor) -> int:
    """0 finite, 1 -inf only (no NaN, no +inf), 2 NaN or +inf. One host read."""
    t = local_part(t)  # a DTensor (FSDP2): this rank's values, no collective
    if t.numel() == 0:
        return 0
    lo, hi = torch.aminmax(t.detach().reshape(-1).float() if t.dtype.itemsize < 2 else t)
    a, b = float(lo), float(hi)  # NaN propagates through aminmax
    if a != a or b != b or b == math.inf:
        return 2
    return 1 if a == -math.inf else 0


def _has_nan(t: torch.Tensor) -> bool:
    return bool(torch.isnan(t).any())


def _local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``t``'s values on this rank: a DTensor's local part, the
    tensor an ``AsyncCollectiveTensor`` (a functional collective's output) wraps."""
    t = local_part(t)
    elem = getattr(t, "elem", None) if type(t).__name__ == "AsyncCollectiveTensor" else None
    return elem if isinstance(elem, torch.Tensor) else t


def _storage(t: torch.Tensor) -> int:
    """The address of the memory holding ``t``'s values on this rank (0 when unknown):
    a DTensor and its local part are one memory, as are a collective's output and the
    ``AsyncCollectiveTensor`` wrapping it (a wrapper's own storage cannot be read)."""
    try:
        return int(_local_tensor(t).untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0
