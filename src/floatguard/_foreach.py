"""Foreach ops over tensors of every kind: plain tensors and DTensors, grouped.

torch's foreach ops refuse a list that mixes plain tensors and DTensors ("got mixed
torch.Tensor and DTensor": a tensor-parallel model whose other parameters, a head or a
LayerNorm, stay plain), and the fused ones
(``_amp_foreach_non_finite_check_and_unscale_``) want one device. Words used here:

- *local part*: a DTensor's ``to_local()``, this rank's piece, sharing its memory;
- *element-wise op*: scale, clamp, unscale, copy. For a Shard or Replicate placement it
  is the same op on every rank's local part (every rank changes its piece in place, no
  collective), so :func:`local_groups` hands the ops plain tensors grouped by device.
  For a Partial placement (the ranks hold addends of the gradient: SequenceParallel's
  LayerNorm) a linear op (scale, unscale) is still its local op, a clamp or a norm is
  not: :func:`reduce_partial_grads` makes such gradients Replicate first.
- :func:`mesh_groups` keeps DTensors whole, grouped by mesh, for an op that needs
  DTensor's own semantics (a global norm, which runs a collective).

The grouping is written once (:func:`_grouped`); a list of plain tensors only (every
run without DTensors) is returned as it is, after one type check per tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["dtensor_type", "is_dtensor", "local_groups", "mesh_groups", "reduce_partial_grads"]

_PLAIN = (torch.Tensor, nn.Parameter)


@functools.cache
def dtensor_type() -> type | None:
    """torch's DTensor class (None where torch has no torch.distributed)."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def is_dtensor(t: object) -> bool:
    if type(t) in _PLAIN:
        return False
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def _local(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local part (a DTensor's), or ``t``. Call it under no_grad: 0.2 us a
    DTensor, against 6 us with autograd recording the call."""
    out: torch.Tensor = t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]
    return out


def _grouped(
    lists: Sequence[Sequence[torch.Tensor]],
    key: Callable[[torch.Tensor], Hashable],
    part: Callable[[torch.Tensor], torch.Tensor],
) -> list[tuple[Hashable, tuple[list[torch.Tensor], ...]]]:
    """Parallel ``lists`` (a foreach op's arguments) split by ``key`` of the first list's
    tensors (first-seen order; order kept within a group), each tensor as ``part(t)``."""
    groups: dict[Hashable, tuple[list[torch.Tensor], ...]] = {}
    for i, t in enumerate(lists[0]):
        k = key(t)
        if k not in groups:
            groups[k] = tuple([] for _ in lists)
        for out, ts in zip(groups[k], lists, strict=True):
            out.append(part(ts[i]))
    return list(groups.items())


def _all_plain(lists: Sequence[Sequence[torch.Tensor]]) -> bool:
    return all(type(t) in _PLAIN for ts in lists for t in ts)


def local_groups(*lists: Sequence[torch.Tensor]) -> list[tuple[list[torch.Tensor], ...]]:
    """The arguments of an element-wise foreach op, as plain tensors: DTensors by their
    local part (no collective), grouped by device. ``lists`` are parallel (a
    ``_foreach_copy_``'s destinations and sources); each group holds the same positions
    of every list. Plain tensors only: one group, the lists as given (copied).

    Not for a Partial DTensor under a non-linear op (see :func:`reduce_partial_grads`)."""
    if not lists or not lists[0]:
        return []
    if _all_plain(lists):
        return [tuple(list(ts) for ts in lists)]
    with torch.no_grad():  # a DTensor's device is its local part's
        return [g for _, g in _grouped(lists, lambda t: t.device, _local)]


def mesh_groups(tensors: Sequence[torch.Tensor]) -> list[tuple[Any, list[torch.Tensor]]]:
    """``tensors`` grouped by kind: ``(None, plain tensors)`` and ``(mesh, DTensors on
    that mesh)`` for each mesh, DTensors kept whole (for DTensor's own ops: a norm, whose
    result is a DTensor on that mesh)."""
    if not tensors:
        return []
    if _all_plain([tensors]):
        return [(None, list(tensors))]

    def mesh_of(t: torch.Tensor) -> Hashable:
        return t.device_mesh if is_dtensor(t) else None  # type: ignore[attr-defined]

    return [(k, g[0]) for k, g in _grouped([tensors], mesh_of, lambda t: t)]


# Partial's reduce ops as the all-reduce that resolves them ("avg": a sum, then divided).
_REDUCE = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN"}


def reduce_partial_grads(params: Sequence[torch.Tensor]) -> int:
    """Make every DTensor gradient with a Partial placement Replicate on those mesh dims:
    ``p.grad`` becomes the same DTensor with its addends reduced (its local tensor is
    reduced in place and rewrapped), the value the placement stands for. How many were.

    A collective only where such gradients exist (SequenceParallel's LayerNorm under
    tensor parallelism): per (mesh, placements, dtype), one all-reduce per Partial mesh
    dim over the gradients' local parts concatenated (an unknown reduce op: DTensor's
    ``redistribute``, one per gradient). Plain gradients: one type check each, no op.
    The optimizer, which would redistribute a Partial gradient itself, then needs none.
    """
    if _all_plain([[p.grad for p in params if p.grad is not None]]):
        return 0
    from torch.distributed.tensor import DTensor, Replicate

    groups: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            key = (g.device_mesh, g.placements, g.dtype, g.device)
            groups.setdefault(key, []).append(p)
    for (mesh, placements, _, _), group in groups.items():
        replicated = tuple(Replicate() if pl.is_partial() else pl for pl in placements)
        ops = [getattr(pl, "reduce_op", None) for pl in placements if pl.is_partial()]
        known = all(op in _REDUCE for op in ops)
        with torch.no_grad():
            if known:
                _reduce_in_place(group, mesh, placements)
            for p in group:
                g = p.grad
                assert isinstance(g, DTensor)
                if known:
                    p.grad = DTensor.from_local(
                        g.to_local(), mesh, replicated, run_check=False,
                        shape=g.shape, stride=g.stride(),
                    )  # fmt: skip
                else:
                    p.grad = g.redistribute(mesh, replicated)
    return sum(len(g) for g in groups.values())


def _reduce_in_place(group: list[torch.Tensor], mesh: Any, placements: tuple[Any, ...]) -> None:
    """All-reduce the local parts of ``group``'s gradients over each Partial mesh dim, in
    one buffer (a copy in, the collective, a copy back)."""
    import torch.distributed as dist

    parts = [p.grad.to_local() for p in group]  # type: ignore[union-attr]
    flat = torch.cat([t.reshape(-1) for t in parts])
    for dim, pl in enumerate(placements):
        if pl.is_partial():
            how = getattr(pl, "reduce_op", "sum")
            op = getattr(dist.ReduceOp, _REDUCE[how])
            dist.all_reduce(flat, op=op, group=mesh.get_group(dim))
            if how == "avg":
                flat /= mesh.size(dim)
    sizes = [t.numel() for t in parts]
    sources = [s.view_as(t) for s, t in zip(torch.split(flat, sizes), parts, strict=True)]
    torch._foreach_copy_(parts, sources)
