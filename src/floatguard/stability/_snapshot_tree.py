"""How a snapshot copies a state: pytrees of tensors and plain values paired with the
previous snapshot's and copied in place (no new memory on a repeated snapshot), host
copies of accelerator state, FSDP2 shards kept as they are.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

import torch

from floatguard._foreach import is_dtensor
from floatguard.stability._host_copy import HostCopy, HostShard, host_buffer

__all__ = ["Stateful", "written_early"]


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


_ATOMS = (int, float, str, bool, type(None))


def _copy_plain(v: Any) -> Any:
    """A deep copy of a state made of dicts, lists and tuples of plain values (a
    detector's window, a scaler's counters), without :func:`copy.deepcopy`'s memo;
    anything else through it."""
    if type(v) in _ATOMS:
        return v
    if type(v) is list:  # (a detector's window: floats, copied without a call each)
        return [x if type(x) in _ATOMS else _copy_plain(x) for x in v]
    if type(v) is dict:
        return {k: x if type(x) in _ATOMS else _copy_plain(x) for k, x in v.items()}
    if type(v) is tuple:
        return tuple(_copy_plain(x) for x in v)
    return copy.deepcopy(v)


def _same_plain(a: Any, b: Any) -> bool:
    """Two non-tensor leaves are the same value (NaN counts as changed: copied again)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # an object without a plain truth value: copy it
        return False


_NESTED = (torch.Tensor, dict, list, tuple)


def _pair_up(old: Any, new: Any, dst: list[torch.Tensor], src: list[torch.Tensor]) -> bool:
    """Walk ``old`` (this snapshot's copy) and ``new`` (a live state) together: their
    tensors paired into ``dst``/``src``, a changed plain value (a learning rate) copied
    into ``old`` in place; False when the structure, a shape or a dtype differs (or a
    tensor is a subclass: a fresh snapshot deep-copies it)."""
    tensor = torch.Tensor
    if type(new) is tensor:
        if type(old) is not tensor or old.dtype != new.dtype or old.shape != new.shape:
            return False
        dst.append(old)
        src.append(new)
        return True
    if type(old) is HostShard:  # a host snapshot's DTensor shard
        if not is_dtensor(new) or not old.fits(new):
            return False
        dst.append(old.local)
        with torch.no_grad():
            src.append(new.to_local())
        return True
    if isinstance(new, dict):  # a module's state_dict is an OrderedDict
        if type(old) is not type(new) or old.keys() != new.keys():
            return False
        for k, v in new.items():
            if type(v) is tensor:  # the common leaf, paired without a call
                o = old[k]
                if type(o) is not tensor or o.dtype != v.dtype or o.shape != v.shape:
                    return False
                dst.append(o)
                src.append(v)
            elif isinstance(v, _NESTED):
                if not _pair_up(old[k], v, dst, src):
                    return False
            elif not _same_plain(old[k], v):
                old[k] = _copy_plain(v)
        return True
    if type(new) is list:
        if type(old) is not list or len(old) != len(new):
            return False
        for i, v in enumerate(new):
            if isinstance(v, _NESTED):
                if not _pair_up(old[i], v, dst, src):
                    return False
            elif not _same_plain(old[i], v):
                old[i] = _copy_plain(v)
        return True
    if type(new) is tuple:  # immutable: its plain values must be the same
        if type(old) is not tuple or len(old) != len(new):
            return False
        for o, v in zip(old, new, strict=True):
            if isinstance(v, _NESTED):
                if not _pair_up(o, v, dst, src):
                    return False
            elif not _same_plain(o, v):
                return False
        return True
    return False  # a tensor subclass or another container: a fresh snapshot copies it


def _copy_into(
    old: dict[str, Any],
    new: dict[str, Any],
    plain: set[str],
    copier: HostCopy | None = None,
    new_objects: dict[str, Stateful] | None = None,
) -> bool:
    """Copy each object's new state into the old state's tensors when the structure,
    shapes and dtypes match (one ``torch._foreach_copy_``; with ``copier``, the host
    snapshot's copy, asynchronous from an accelerator); True when
    done for every object (on False the old state may be half updated: the caller
    makes a fresh snapshot). The states named in ``plain`` held no tensor (scalers,
    detectors): they are replaced by copies."""
    if old.keys() != new.keys():
        return False
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    rebuilt: dict[str, Any] = {}
    for name, state in new.items():
        if name in plain:
            rebuilt[name] = _copy_plain(state)
        elif not _pair_up(old[name], state, dst, src):
            return False
    try:
        if copier is not None:
            copier.start(dst, src, written_early(new_objects, src) if new_objects else None)
        else:
            with torch.no_grad():
                if dst:
                    # (a device or layout change raises here: then a fresh snapshot is made)
                    torch._foreach_copy_(dst, src)
    except RuntimeError:
        return False
    old.update(rebuilt)
    return True


def written_early(objects: dict[str, Stateful], src: list[torch.Tensor]) -> list[bool] | None:
    """Which of ``src`` the next forward writes in place: the modules' buffers (by
    memory; None when there are none), for :meth:`HostCopy.start`'s ``early``."""
    with torch.no_grad():  # (a DTensor buffer by its local part, as the copy has it)
        ptrs = {
            (b.to_local() if is_dtensor(b) else b).data_ptr()  # type: ignore[attr-defined]
            for m in objects.values() if isinstance(m, torch.nn.Module)
            for b in m.buffers()
        }  # fmt: skip
    if not ptrs:
        return None
    return [s.data_ptr() in ptrs for s in src]


def _host_tree(v: Any, dst: list[torch.Tensor], src: list[torch.Tensor]) -> Any:
    """A copy of a state with every plain tensor replaced by a new host buffer, and
    every DTensor by a :class:`HostShard` of its local part (the buffers and sources
    paired into ``dst``/``src`` for the copy); other tensor subclasses and other
    leaves deep-copied where they are."""
    if type(v) is torch.Tensor:
        buf = host_buffer(v)
        dst.append(buf)
        src.append(v)
        return buf
    if is_dtensor(v):
        shard = HostShard(v)
        dst.append(shard.local)
        with torch.no_grad():
            src.append(v.to_local())
        return shard
    if isinstance(v, dict):
        out = copy.copy(v)  # keeps an OrderedDict's type
        for k, x in v.items():
            out[k] = _host_tree(x, dst, src)
        return out
    if type(v) in (list, tuple):
        return type(v)(_host_tree(x, dst, src) for x in v)
    return _copy_plain(v)


def _has_shard(v: Any) -> bool:
    if type(v) is HostShard:
        return True
    if isinstance(v, dict):
        return any(_has_shard(x) for x in v.values())
    if type(v) in (list, tuple):
        return any(_has_shard(x) for x in v)
    return False


def _live_copy(v: Any, *, only_shards: bool = False) -> Any:
    """A state as ``load_state_dict`` takes it: a deep copy (nothing aliases the
    snapshot), each :class:`HostShard` rebuilt as its DTensor. ``only_shards``: the
    rest is not copied (for a write). A state without shards is one ``deepcopy``."""
    if not _has_shard(v):
        return v if only_shards else copy.deepcopy(v)
    if type(v) is HostShard:
        return v.rebuild()
    if isinstance(v, dict):
        out = copy.copy(v)
        for k, x in v.items():
            out[k] = _live_copy(x, only_shards=only_shards)
        return out
    if type(v) in (list, tuple):
        return type(v)(_live_copy(x, only_shards=only_shards) for x in v)
    return v if only_shards else copy.deepcopy(v)


def _on_accelerator(v: Any) -> bool:
    """Whether a tensor in ``v`` (dicts, lists, tuples) is on an accelerator (the walk
    stops at the first tensor found there)."""
    if isinstance(v, torch.Tensor):
        return v.device.type != "cpu"
    if isinstance(v, dict):
        return any(_on_accelerator(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_on_accelerator(x) for x in v)
    return False
