"""An op tape's words: how an aten call's arguments are written down, read back and run.

A *tape* is a list of aten calls whose tensors are *slots*: numbered values, either
*leaves* (a tensor's value as it was when the tape first read it, kept in the bundle)
or the outputs of an earlier call on the tape. An argument is written as plain
values only (what ``torch.load(weights_only=True)`` reads without running code):

- a tensor: ``{"t": slot}``; a tuple: ``{"tuple": [...]}``; a list: a list;
- ``torch.dtype`` / ``torch.device`` / ``torch.layout`` / ``torch.memory_format``:
  ``{"dtype": "float16"}``, ``{"device": "cuda:0"}``, ``{"layout": "strided"}``,
  ``{"memory_format": "contiguous_format"}``;
- None, bool, int, float (inf and NaN included) and str as themselves.

Anything else (a generator, a Python object) cannot be written: the call is not
taped (:class:`Unwritable`). Reading a tape back accepts only these shapes, op names
of the ``aten`` namespace that exist in the torch reading it, and devices rewritten
to the one asked for; nothing in a tape can name code to run.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch

from floatguard.errors import FloatguardError

__all__ = [
    "Unwritable",
    "assign",
    "decode",
    "encode",
    "op_named",
    "out_slots",
]

_OP_NAME = re.compile(r"^aten\.([a-z_][a-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)$")
_DTYPES = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}
_LAYOUTS = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.layout)
}
_FORMATS = {
    str(v).removeprefix("torch."): v
    for v in vars(torch).values()
    if isinstance(v, torch.memory_format)
}
_DEVICE = re.compile(r"^(cpu|cuda|mps|xpu|meta|hpu|npu)(:\d{1,4})?$")
_MARKERS = frozenset({"t", "tuple", "dtype", "device", "layout", "memory_format"})


class Unwritable(FloatguardError, ValueError):
    """An argument a tape cannot write as plain values (see the module)."""


def encode(value: Any, slot_of: Callable[[torch.Tensor], int]) -> Any:
    """``value`` written as plain values, tensors as the slots ``slot_of`` gives them."""
    if isinstance(value, torch.Tensor):
        return {"t": slot_of(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"tuple": [encode(v, slot_of) for v in value]}
    if isinstance(value, list):
        return [encode(v, slot_of) for v in value]
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        if _MARKERS.intersection(value):
            raise Unwritable("a dict whose keys are the tape's markers")
        return {"kwargs": {k: encode(v, slot_of) for k, v in value.items()}}
    raise Unwritable(f"a {type(value).__name__} argument")


def decode(value: Any, slots: dict[int, torch.Tensor], device: torch.device) -> Any:
    """The value :func:`encode` wrote, tensors taken from ``slots``, every device
    rewritten to ``device``. ValueError for anything :func:`encode` does not write."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [decode(v, slots, device) for v in value]
    if isinstance(value, dict) and len(value) == 1:
        ((key, inner),) = value.items()
        if key == "t":
            if not isinstance(inner, int) or isinstance(inner, bool) or inner not in slots:
                raise ValueError(f"a tensor argument names slot {inner!r}, which the tape lacks")
            return slots[inner]
        if key == "tuple" and isinstance(inner, list):
            return tuple(decode(v, slots, device) for v in inner)
        if key == "kwargs" and isinstance(inner, dict):
            return {str(k): decode(v, slots, device) for k, v in inner.items()}
        if key == "dtype" and inner in _DTYPES:
            return _DTYPES[inner]
        if key == "device" and isinstance(inner, str) and _DEVICE.match(inner):
            return device
        if key == "layout" and inner in _LAYOUTS:
            return _LAYOUTS[inner]
        if key == "memory_format" and inner in _FORMATS:
            return _FORMATS[inner]
    raise ValueError(f"not a tape argument: {str(value)[:80]!r}")


def op_named(name: Any) -> Any:
    """The aten overload a tape names (``"aten.mm.default"``); ValueError for any other
    name (another namespace, a name this torch does not have)."""
    m = _OP_NAME.match(name) if isinstance(name, str) else None
    if m is None:
        raise ValueError(f"not an aten op name: {str(name)[:80]!r}")
    packet = getattr(torch.ops.aten, m.group(1), None)
    overload = getattr(packet, m.group(2), None) if packet is not None else None
    if overload is None or not isinstance(overload, torch._ops.OpOverload):
        raise ValueError(f"{name}: this torch ({torch.__version__}) has no such op")
    return overload


def out_slots(value: Any) -> list[int | None]:
    """The slots an op's written output assigns, in order (None: not a tensor)."""
    if isinstance(value, dict) and "t" in value:
        return [value["t"]]
    if isinstance(value, dict) and "tuple" in value:
        value = value["tuple"]
    if isinstance(value, list):
        out: list[int | None] = []
        for v in value:
            out.extend(out_slots(v) if isinstance(v, (dict, list)) else [None])
        return out
    return [None]


def assign(written: Any, result: Any, slots: dict[int, torch.Tensor]) -> None:
    """Put an op's ``result`` into the slots its ``written`` output names."""
    if isinstance(written, dict) and "t" in written:
        if not isinstance(result, torch.Tensor):
            raise ValueError("the op returned no tensor where the tape recorded one")
        slots[int(written["t"])] = result
        return
    if isinstance(written, dict) and "tuple" in written:
        written = written["tuple"]
    if isinstance(written, list):
        if not isinstance(result, (list, tuple)) or len(result) != len(written):
            raise ValueError("the op returned another number of outputs than the tape recorded")
        for w, r in zip(written, result, strict=True):
            if isinstance(w, (dict, list)):
                assign(w, r, slots)


def finite_level(t: torch.Tensor) -> int:
    """0 finite, 1 -inf only, 2 NaN or +inf (a floating tensor's values; others 0)."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return 0
    v = torch.view_as_real(t) if t.is_complex() else t
    lo, hi = torch.aminmax(v.detach().reshape(-1).float())
    a, b = float(lo), float(hi)
    if math.isnan(a) or math.isnan(b) or b == math.inf:
        return 2
    return 1 if a == -math.inf else 0
