"""The record book: a step's records, the sentinel slots they point at, and their aliases."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch

from floatguard._values import local_part, values_of
from floatguard.monitor._stats_read import stats_and_minmax
from floatguard.monitor.bounds import Rule, sum_rule
from floatguard.monitor.localize import Record, RecordKind
from floatguard.monitor.sentinel import Sentinel
from floatguard.stats import TensorStats

__all__ = ["RecordBook"]

Roles = list[tuple[tuple[str, ...], str]]  # (call path, role) per place a record was seen


class _Seen(NamedTuple):
    """A tensor recorded this step: a weak reference (an id alone may be reused), its
    version counter then (an in-place change since means new values), its slot."""

    ref: weakref.ref[torch.Tensor]
    version: int
    slot: int


class RecordBook:
    """One step's records in execution order, each pointing at a slot of the
    :class:`Sentinel` (a read or a proof); the alias table (tensor identity and version
    to slot: a tensor recorded twice shares one slot) and, in stats mode, the
    statistics of each slot that was read with them."""

    def __init__(self) -> None:
        self.sentinel = Sentinel()
        self.records: list[Record] = []
        self.slot_stats: dict[int, TensorStats] = {}
        self._seen: dict[int, _Seen] = {}

    def clear(self) -> None:
        self.sentinel.clear()
        self.records.clear()
        self._seen.clear()
        self.slot_stats.clear()

    def drop(self, spans: Sequence[tuple[int, int]]) -> dict[int, int]:
        """Drop the records in ``spans`` (ascending, disjoint ``[start, end)`` ranges of
        :attr:`records`) and every slot that no other record reads, directly or through
        a proof. The kept slots are renumbered in order; returns each one's new number
        (records, aliases and statistics are renumbered here)."""
        kept: list[Record] = []
        i = 0
        for start, end in spans:
            kept += self.records[i:start]
            i = end
        kept += self.records[i:]
        need = {r.slot for r in kept}
        todo = list(need)
        while todo:
            for d in self.sentinel.deps_of(todo.pop()):
                if d not in need:
                    need.add(d)
                    todo.append(d)
        remap = self.sentinel.retain(sorted(need))
        for r in kept:
            r.slot = remap[r.slot]
        self.records[:] = kept
        self._seen = {
            k: e._replace(slot=remap[e.slot])
            for k, e in self._seen.items()
            if e.slot in remap and e.ref() is not None
        }
        self.slot_stats = {remap[s]: st for s, st in self.slot_stats.items() if s in remap}
        return remap

    def held_bytes(self) -> int:
        """Device bytes the records hold (see :meth:`Sentinel.held_bytes`)."""
        return self.sentinel.held_bytes()

    def seen_slot(self, t: torch.Tensor, version: int | None) -> int | None:
        """The slot of ``t`` if this very tensor, at this version, was recorded this step."""
        hit = self._seen.get(id(t))
        if hit is not None and hit.ref() is t and hit.version == version:
            return hit.slot
        return None

    def remember(self, t: torch.Tensor, version: int, slot: int) -> None:
        """File ``t`` (at ``version``) as having the values recorded in ``slot``."""
        self._seen[id(t)] = _Seen(weakref.ref(t), version, slot)

    def alias(self, kind: RecordKind, roles: Roles, slot: int, shape: tuple[int, ...]) -> None:
        """A record of values already recorded in ``slot`` (it shares the slot)."""
        self.records.append(Record(kind, roles, slot, shape, self.slot_stats.get(slot)))

    def add(
        self,
        kind: RecordKind,
        path: tuple[str, ...],
        role: str,
        t: torch.Tensor,
        proof: tuple[Rule, list[int]] | None = None,
        *,
        stats_on: bool,
    ) -> Record:
        """A record with a slot of its own: a proof (``proof``: the rule and the slots it
        reads) or a read of ``t``, with its statistics when ``stats_on``."""
        # A DTensor (FSDP2's sharded parameters and gradients) is read by this rank's
        # part: a DTensor op here would run a collective inside a hook, out of step
        # with the other ranks' collectives (a deadlock).
        t = local_part(t)
        stats: TensorStats | None = None
        if proof is not None and not stats_on:
            slot = self.sentinel.prove(t, proof[0], proof[1])
        elif t.is_sparse and not stats_on and not t.is_coalesced():
            # Reading it exactly means coalescing it, which sizes its output on the host
            # (a sync on CUDA). Its stored values are read instead (non-finite there is
            # non-finite after summing), and the sums of duplicates are proved finite
            # from them; a sum the bound cannot settle is coalesced and read when the
            # monitor is read.
            values = t.detach()._values()
            if values.is_complex():
                values = torch.view_as_real(values)
            vslot = self.sentinel.add(values)
            width = t.shape[-1] if t.dim() else 1
            rule = sum_rule(max(t._nnz(), 1), values.dtype, width)
            slot = self.sentinel.prove(t, rule, [vslot])
        else:
            strided = t.layout == torch.strided
            r = t if strided and not t.is_complex() else values_of(t)
            if stats_on:
                # one read for both where it can (so the slot's verdict is the
                # stats' read: it must see t's values, not the memory around a
                # view, see _stats_read); a sparse tensor's stats count the zeros it
                # does not store
                sparse = not strided and not t.is_complex()
                stats, minmax = stats_and_minmax(t if sparse else r)
                slot = self.sentinel.add(r, minmax)
            else:
                slot = self.sentinel.add(r)
        rec = Record(kind, [(path, role)], slot, tuple(t.shape))
        if stats is not None:
            rec.stats = self.slot_stats[rec.slot] = stats
        self.records.append(rec)
        return rec
