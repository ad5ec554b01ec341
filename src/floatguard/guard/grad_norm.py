"""The step's squared gradient norm by DTensor placement, in two parts for one SUM all-reduce.

Under torch.distributed without DDP the packed read (:func:`floatguard.guard.step_check.pack`)
carries the squared gradient norm as a *summed part* (slot 1: the SUM over the ranks is
taken as it is) and an *averaged part* (slot 2: the SUM is divided by the n ranks on the
host). Each gradient's local squared norm ``s`` (a DTensor's local part, no collective)
goes to one part with a weight, so that the SUM gives the global sum, every element of
every gradient counted once. Words used here:

- *placement*, per mesh dim of a DTensor: ``Shard`` (the ranks along that dim hold
  disjoint pieces: their squares add up; ``_StridedShard`` too), ``Replicate`` (each
  holds the whole: counted once), ``Partial`` (each holds an addend: the reader reduces
  such gradients first, :func:`floatguard._foreach.reduce_partial_grads`);
- *representative*: a rank whose coordinate is 0 on every Replicate mesh dim of the
  DTensor's mesh: it alone counts the piece it shares with the other coordinates;
- *copies*: a DTensor on a mesh of m < n ranks (torchtitan's 2-D layout: a parameter
  that ``fully_shard`` shards over dp only lives on the dp mesh, and every tp
  coordinate holds a copy of that mesh): the n / m copies hold the same values.

The weights:

- a DTensor on a mesh of all n ranks: the summed part, weight 1 on a representative,
  0 elsewhere (FSDP2's ``Shard``: every rank 1; HSDP's ``(Replicate, Shard)`` and a TP
  ``Replicate`` bias: the ranks at replicate coordinate 0);
- a DTensor on a mesh of m < n ranks: the averaged part, weight m on a representative
  (0 elsewhere): the SUM over the n / m copies of m * s, divided by n, is s;
- a plain tensor: the averaged part, weight 1 (a DDP replica, a TP model's head left
  plain: the same on every rank, counted once).

Numerics: the weights are 0, 1 and integers m (exact in float64, no 1/3); each norm is
taken in float32 (float64 for a float64 gradient), squared in float64. For a mesh of
all n ranks the result is the float64 sum of the distinct pieces' squares (the
replicas' own values, not a blend); the averaged part is one float64 division by n on
the host (exact for n a power of two, else within an ulp). A non-finite ``s`` is never
weighted (0 * inf would be NaN, and a non-representative's NaN would vanish): it goes
to its part as it is, so an inf on any rank's replica is an inf in the agreed norm.
Replicas that differ (a finite corruption of one) are not blended: a representative's
values count. A mesh whose size does not divide n (its copies do not tile the ranks)
is refused with ValueError. The per-gradient weights are cached on the gradients'
(mesh, placements, dtype): the step pays one type check per gradient, ~10 small device
ops, no host sync.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from floatguard._foreach import is_dtensor
from floatguard._values import stored_values

__all__ = ["PlacementNorm"]

_SUMMED, _AVERAGED = 0, 1


def _row(mesh: Any, placements: tuple[Any, ...], world: int) -> tuple[int, float]:
    """A DTensor's part and weight (see the module)."""
    coord = mesh.get_coordinate()
    if coord is None:  # this rank holds none of it (its local part is empty)
        return _SUMMED, 0.0
    if any(p.is_partial() for p in placements):
        raise AssertionError("a Partial gradient reached the norm (reduce_partial_grads first)")
    rep = all(coord[d] == 0 for d, p in enumerate(placements) if p.is_replicate())
    size = int(mesh.size())
    if size == world:
        return _SUMMED, float(rep)
    if size > world or world % size:
        raise ValueError(
            f"a gradient lives on {mesh} ({size} ranks), whose copies cannot tile the "
            f"guard's {world} ranks: the guard cannot tell which ranks hold its replicas; "
            "give the guard the process group of the mesh's ranks (Guard(process_group=...))"
        )
    return _AVERAGED, float(size) if rep else 0.0


class PlacementNorm:
    """The summed and averaged parts of the squared gradient norm (device float64
    scalars, no sync) for ``world`` ranks; see the module for the weights."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._rows: dict[Hashable, tuple[int, float]] = {}
        self._keys: tuple[Hashable, ...] | None = None
        self._cached: tuple[torch.Tensor, torch.Tensor, torch.dtype] | None = None
        self._plain = False  # the cached keys are plain tensors only: all averaged, weight 1

    def _key(self, g: torch.Tensor) -> Hashable:
        if not is_dtensor(g):
            return g.dtype
        return (g.dtype, g.device_mesh, g.placements)  # type: ignore[attr-defined]

    def _weights(
        self, grads: Sequence[torch.Tensor], keys: tuple[Hashable, ...], dev: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
        """(weights, home) as (2, n) device tensors and the norms' dtype, for these keys."""
        if self._keys == keys and self._cached is not None and self._cached[0].device == dev:
            return self._cached
        weights = torch.zeros(2, len(grads), dtype=torch.float64)
        home = torch.zeros(2, len(grads), dtype=torch.bool)
        for i, (g, k) in enumerate(zip(grads, keys, strict=True)):
            if k not in self._rows:
                self._rows[k] = (
                    _row(g.device_mesh, g.placements, self.world)  # type: ignore[attr-defined]
                    if is_dtensor(g)
                    else (_AVERAGED, 1.0)
                )
            part, w = self._rows[k]
            weights[part, i], home[part, i] = w, True
        wide = any(g.dtype == torch.float64 for g in grads)
        self._keys, self._plain = keys, not any(is_dtensor(g) for g in grads)
        self._cached = (weights.to(dev), home.to(dev), torch.float64 if wide else torch.float32)
        return self._cached

    def parts(
        self, grads: Sequence[torch.Tensor], dev: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(summed, averaged)``: device float64 scalars to pack (no sync)."""
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        if not grads:
            return zero, zero
        keys = tuple(self._key(g) for g in grads)
        weights, home, dtype = self._weights(grads, keys, dev)
        # A DTensor by its local part (no collective); a sparse gradient by its values.
        with torch.no_grad():
            local = [stored_values(g.to_local() if is_dtensor(g) else g) for g in grads]  # type: ignore[attr-defined]
        norms = torch._foreach_norm(local, 2.0, dtype=dtype)
        try:
            stacked = torch.stack(norms)
        except RuntimeError:  # norms on several devices
            stacked = torch.stack([n.to(dev) for n in norms])
        sq = stacked.to(dev, torch.float64).square()
        if self._plain:  # no DTensor: every weight is 1, in the averaged part
            return zero, sq.sum()
        finite = torch.isfinite(sq)
        contrib = torch.where(finite, weights * sq, torch.where(home, sq, 0.0))
        both = contrib.sum(dim=1)
        return both[_SUMMED], both[_AVERAGED]
