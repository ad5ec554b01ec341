"""What a repro bundle holds of a step, made plain: values copied to the host, a module's
tree (its class, plain attributes and registered parts), tensors shared once, the
tape's calls encoded (see :mod:`floatguard.guard.repro_writer`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from floatguard.repro.ops import Unwritable, encode

__all__ = []


def _cpu(value: Any) -> Any:
    """A copy of ``value`` with every tensor a detached CPU copy (what the file holds)."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.layout != torch.strided:
            t = t.to_dense()
        return t.to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cpu(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_cpu(v) for v in value)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, str):
        return str(value)  # (torch.__version__ is a str subclass a safe load refuses)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    return repr(value)


def _plain(value: Any) -> Any:
    """``value`` as plain values a bundle may hold (anything else as its repr)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return value
    if isinstance(value, dict):
        return {str(k) if not isinstance(k, int) else k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value)


_PLAIN = (type(None), bool, int, float, str)


def _plain_attr(v: Any, depth: int = 0) -> bool:
    if isinstance(v, _PLAIN):
        return True
    if isinstance(v, (tuple, list)) and depth < 3 and len(v) <= 64:
        return all(_plain_attr(x, depth + 1) for x in v)
    return False


_MODULE_OWN = frozenset(vars(nn.Module()))  # nn.Module's own bookkeeping (hooks, dicts)


def _tree(m: nn.Module, depth: int = 0) -> dict[str, Any] | None:
    """How to build ``m`` again without its ``__init__``: its class's import path, its
    plain attributes (numbers, strings, tuples of them; private ones too, such as
    MultiheadAttention's ``_qkv_same_embed_dim``), its parameters' and buffers' names
    (a ``None`` one, like ``Linear(bias=False)``'s bias, as such), its children;
    ``other`` names the attributes that are none of these (a config object, a
    function) and cannot be written. None past 32 levels."""
    if depth > 32:
        return None
    cls = type(m)
    attrs: dict[str, Any] = {}
    other: list[str] = []
    for k, v in vars(m).items():
        if k in _MODULE_OWN and k != "training":
            continue
        if _plain_attr(v):
            attrs[k] = list(v) if isinstance(v, list) else v
        else:
            other.append(k)
    persistent = set(m.state_dict(keep_vars=True).keys())
    own = dict(m.named_parameters(recurse=False))
    bufs = dict(m.named_buffers(recurse=False))
    params = [[k, k in own] for k in _registered(m, "_parameters")]
    buffers = [[k, k in bufs, k in persistent or k not in bufs] for k in _registered(m, "_buffers")]
    children: dict[str, Any] = {}
    for k, c in m.named_children():
        children[k] = _tree(c, depth + 1)
    return {
        "class": f"{cls.__module__}:{cls.__qualname__}",
        "attrs": attrs,
        "other": other,
        "params": params,
        "buffers": buffers,
        "children": children,
    }


def _registered(m: nn.Module, table: str) -> list[str]:
    """The names registered in one of nn.Module's tables, ``None`` entries included
    (``named_parameters`` leaves those out; ``Linear(bias=False)`` has one)."""
    entries = vars(m).get(table)
    return [str(k) for k in entries] if isinstance(entries, dict) else []


def _shared(payload: Any) -> Any:
    """``payload`` with equal tensors held once: the module's inputs, its state, the
    tape's leaves and the step's state often copy the same values (``torch.save``
    writes a storage once however often it is referenced). Contiguous tensors of one
    dtype, shape and stride whose sampled elements agree are compared in full."""
    seen: dict[tuple[Any, ...], list[torch.Tensor]] = {}

    def one(t: torch.Tensor) -> torch.Tensor:
        n = t.numel()
        if n < 64 or not t.is_contiguous() or t.storage_offset() != 0:
            return t
        flat = t.reshape(-1)
        picks = flat[[0, n // 3, n // 2, (2 * n) // 3, n - 1]]
        key = (t.dtype, tuple(t.shape), repr(picks.tolist()))
        for other in seen.setdefault(key, []):
            if other is t or torch.equal(other, t):
                return other
        seen[key].append(t)
        return t

    def walk(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return one(v)
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, tuple):
            return tuple(walk(x) for x in v)
        return v

    return walk(payload)


def _encoded(calls: Any) -> dict[str, Any] | None:
    """Call arguments as a tape writes them, with their own leaves (None: unwritable)."""
    leaves: dict[int, torch.Tensor] = {}

    def slot(t: torch.Tensor) -> int:
        s = len(leaves)
        leaves[s] = t.detach().clone()
        return s

    try:
        return {"calls": encode(calls, slot), "leaves": leaves}
    except Unwritable:
        return None


def _device_name(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        try:
            return f"{device} ({torch.cuda.get_device_name(device)})"
        except (RuntimeError, AssertionError):
            return str(device)
    return str(device)
