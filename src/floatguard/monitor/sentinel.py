"""Device-resident finiteness records, read once on demand.

A record is either a *read* or a *proof*. A read is one ``torch.aminmax`` of the
tensor: a single pass that propagates NaN, so afterwards it tells whether the
tensor held a NaN (min and max are NaN), an inf (min is -inf or max is +inf, and
no NaN) or neither. It is exact for every dtype, unlike a sum (which overflows,
and turns +inf with -inf into NaN).

A proof reads nothing: it names the records the tensor was computed from and a
:class:`~floatguard.monitor.bounds.Rule` bounding the tensor from their values
(see :mod:`floatguard.monitor.bounds`). It keeps a reference to the tensor; when
the bound does not settle the question (it reaches the format's range, or an
input was non-finite), the tensor is read then, so every record's verdict is
exact. Should the tensor have been modified in place before that read, its
original values are gone and the record is reported as ``"inf"``: the bound
said it could have overflowed.

:meth:`Sentinel.flag` folds everything into one exact device bool without a host
sync (it has to read what the proofs kept: without a host read it cannot know which
proofs settled); :meth:`Sentinel.status_of` / :meth:`Sentinel.read` give the
verdicts per record and read only the tensors whose proofs did not settle.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from floatguard._values import dense_sum, values_of
from floatguard.monitor.bounds import DEVICE, HOST, INF, Bound, Rule

__all__ = ["Proof", "Sentinel"]

_LIMITS: dict[torch.dtype, float] = {}
# 8-bit float dtypes have no aminmax kernel: read in float32, which holds each of
# their values (NaN and inf included) exactly.
_WIDEN = frozenset(
    getattr(torch, n)
    for n in (
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    )
    if hasattr(torch, n)
)  # fmt: skip
# Packed FP4 (E2M1, two per byte) has no NaN or inf and no |value| above 6: finite by
# construction, recorded as the bound [-6, 6] without a read.
_FP4 = frozenset(getattr(torch, n) for n in ("float4_e2m1fn_x2",) if hasattr(torch, n))


@dataclass
class Proof:
    """A record settled by a bound instead of a read."""

    rule: Rule
    deps: tuple[int, ...]
    tensor: torch.Tensor  # kept to read it if the bound does not settle
    version: int
    limit: float  # largest finite value of the tensor's dtype
    width: int


class Sentinel:
    """An append-only list of records: (min, max) device scalars or proofs."""

    def __init__(self) -> None:
        self._mins: list[torch.Tensor] = []
        self._maxs: list[torch.Tensor] = []
        self._slots: list[int | Proof] = []  # index into _mins/_maxs, or a proof
        self._widths: list[int] = []
        self._flag: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def reads(self) -> int:
        """How many records were reads (the rest are proofs)."""
        return len(self._mins)

    def add(self, t: torch.Tensor, minmax: tuple[torch.Tensor, torch.Tensor] | None = None) -> int:
        """Read ``t`` (one kernel, no sync); returns the record's slot. ``minmax``:
        what ``torch.aminmax(t)`` gives, when the caller already has it."""
        if minmax is not None:
            lo, hi = minmax
        elif t.numel() == 0:
            z = torch.zeros((), dtype=t.dtype, device=t.device)
            lo, hi = z, z
        elif t.dtype in _WIDEN:
            lo, hi = torch.aminmax(t.detach().float())
        elif t.dtype in _FP4:
            hi = torch.full((), 6.0, device=t.device)
            lo = -hi
        else:
            lo, hi = torch.aminmax(t.detach())
        self._slots.append(len(self._mins))
        self._mins.append(lo)
        self._maxs.append(hi)
        self._widths.append(t.shape[-1] if t.dim() else 1)
        return len(self._slots) - 1

    def prove(self, t: torch.Tensor, rule: Rule, deps: Sequence[int]) -> int:
        """Record ``t`` by a proof from earlier records ``deps``; reads nothing.

        ``t`` is kept (until :meth:`clear`) so that it can be read if the bound
        does not settle.
        """
        width = t.shape[-1] if t.dim() else 1
        limit = _LIMITS.get(t.dtype) or _LIMITS.setdefault(t.dtype, torch.finfo(t.dtype).max)
        self._slots.append(Proof(rule, tuple(deps), t.detach(), t._version, limit, width))
        self._widths.append(width)
        return len(self._slots) - 1

    def is_proof(self, slot: int) -> bool:
        return isinstance(self._slots[slot], Proof)

    def materialize(self, slot: int) -> None:
        """Turn a proof into a read now (before the tensor is modified in place)."""
        p = self._slots[slot]
        if (
            isinstance(p, Proof)
            and p.tensor._version == p.version
            and p.tensor.layout == torch.strided
        ):
            t = p.tensor
            lo, hi = torch.aminmax(t) if t.numel() else (t.new_zeros(()), t.new_zeros(()))
            self._slots[slot] = len(self._mins)
            self._mins.append(lo)
            self._maxs.append(hi)

    def deps_of(self, slot: int) -> tuple[int, ...]:
        """The slots a proof reads (none for a read)."""
        s = self._slots[slot]
        return s.deps if isinstance(s, Proof) else ()

    def retain(self, keep: Sequence[int]) -> dict[int, int]:
        """Keep only the slots ``keep`` (ascending, with every slot their proofs read),
        renumbered in order; returns each kept slot's new number."""
        remap: dict[int, int] = {}
        slots: list[int | Proof] = []
        mins: list[torch.Tensor] = []
        maxs: list[torch.Tensor] = []
        for new, old in enumerate(keep):
            s = self._slots[old]
            if isinstance(s, Proof):
                slots.append(dataclasses.replace(s, deps=tuple(remap[d] for d in s.deps)))
            else:
                slots.append(len(mins))
                mins.append(self._mins[s])
                maxs.append(self._maxs[s])
            remap[old] = new
        self._widths = [self._widths[old] for old in keep]
        self._slots, self._mins, self._maxs = slots, mins, maxs
        self._flag = None
        return remap

    def held_bytes(self) -> int:
        """Bytes of device memory the records hold: the reads' (min, max) scalars and
        the tensors the proofs keep (each storage once; strided and sparse COO)."""
        n = sum(t.element_size() for t in self._mins) * 2
        storages: dict[tuple[torch.device, int], int] = {}
        for s in self._slots:
            if not isinstance(s, Proof):
                continue
            t = s.tensor
            if t.layout == torch.strided:
                parts = [t]
            elif t.layout == torch.sparse_coo:
                parts = [t._indices(), t._values()]
            else:
                parts = []
            for part in parts:
                try:
                    st = part.untyped_storage()
                    storages[(part.device, st.data_ptr())] = st.nbytes()
                except (RuntimeError, NotImplementedError):  # a subclass without storage
                    storages[(part.device, -id(part))] = part.element_size() * part.numel()
        return n + sum(storages.values())

    def clear(self) -> None:
        self._flag = None
        self._mins.clear()
        self._maxs.clear()
        self._slots.clear()
        self._widths.clear()

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self._mins:
            return None
        dtypes = {t.dtype for t in self._mins}
        # float64 records stay float64 (a finite 1e300 must not read as inf); the
        # rest fit float32 exactly, with their inf and NaN.
        wide = torch.float64 in dtypes and self._mins[0].device.type != "mps"
        target = torch.float64 if wide else torch.float32
        if len(dtypes) == 1:
            lo, hi = torch.stack(self._mins), torch.stack(self._maxs)
            return lo.to(target), hi.to(target)
        # Mixed dtypes (autocast): cast each scalar first. Kernels only, no host trip.
        lo = torch.stack([t.to(target) for t in self._mins])
        hi = torch.stack([t.to(target) for t in self._maxs])
        return lo, hi

    def packed(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(min, max) of every read record as two device vectors (float32, or float64
        when a record is), for a caller
        that folds them into its own single host read (the guard does); give the host
        copies back to :meth:`status_of`."""
        return self._stacked()

    def status_of(self, lo: list[float], hi: list[float]) -> list[str]:
        """Per record "ok" / "nan" / "inf" (+inf, maybe -inf too) / "ninf" (-inf only),
        from host copies of :meth:`packed`.

        Proofs are evaluated on the host in order; kept tensors whose proofs do not
        settle are read (all of a round in one more transfer, only then) and their
        exact values feed the proofs after them.
        """
        settled: dict[int, tuple[float, float] | None] = {}
        while True:
            status, suspects = self._evaluate(lo, hi, settled)
            if not suspects:
                return status
            settled.update(self._read_kept(suspects))

    @staticmethod
    def _verdict(a: float, b: float) -> str:
        if a != a or b != b:
            return "nan"
        if b == INF:
            return "inf"
        # -inf and no +inf: what masks and log-space padding hold (see localize)
        return "ninf" if a == -INF else "ok"

    def _evaluate(
        self, lo: list[float], hi: list[float], settled: dict[int, tuple[float, float] | None]
    ) -> tuple[list[str], list[int]]:
        status: list[str] = []
        bounds: list[Bound] = []
        suspects: list[int] = []
        for slot, s in enumerate(self._slots):
            values: tuple[float, float] | None = None
            if isinstance(s, int):
                values = (lo[s], hi[s])
            elif slot in settled:
                values = settled[slot]
                if values is None:  # modified in place before it could be read
                    status.append("inf")
                    bounds.append((INF, INF))
                    continue
            if values is not None:
                status.append(self._verdict(*values))
                a, b = values
                amax = max(abs(a), abs(b)) if status[-1] == "ok" else INF
                bounds.append((amax, amax * math.sqrt(self._widths[slot])))
                continue
            assert isinstance(s, Proof)
            deps = [bounds[i] for i in s.deps]
            used = [deps[i] for i in s.rule.uses] if s.rule.uses is not None else deps
            bound: Bound = (INF, INF)
            if all(math.isfinite(d[0]) and math.isfinite(d[1]) for d in used):
                bound = s.rule(HOST, [d if math.isfinite(d[0]) else (0.0, 0.0) for d in deps])
            if bound[0] < s.limit and bound[1] == bound[1]:
                status.append("ok")
                bounds.append(bound)
                continue
            bounds.append((INF, INF))
            status.append("?")
            suspects.append(slot)
        return status, suspects

    def _read_kept(self, slots: list[int]) -> dict[int, tuple[float, float] | None]:
        """Read the kept tensors of proofs that did not settle (one transfer)."""
        out: dict[int, tuple[float, float] | None] = {}
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[int]]] = {}
        for slot in slots:
            p = self._slots[slot]
            assert isinstance(p, Proof)
            t = p.tensor
            if t._version != p.version:
                out[slot] = None
            elif t.numel() == 0:
                out[slot] = (0.0, 0.0)
            else:
                pairs, order = by_device.setdefault(t.device, ([], []))
                wide = torch.float32 if t.device.type == "mps" else torch.float64
                v = values_of(dense_sum(t))  # a sparse gradient: as flag() reads it
                pairs.append(
                    torch.stack(torch.aminmax(v)).to(wide)
                    if v.numel()
                    else v.new_zeros(2, dtype=wide)
                )
                order.append(slot)
        for pairs, order in by_device.values():  # one transfer per device
            for slot, (a, b) in zip(order, torch.stack(pairs).cpu().tolist(), strict=True):
                out[slot] = (a, b)
        return out

    def flag(self) -> torch.Tensor:
        """Device bool: did any record see a NaN or inf? Exact, and no host sync.

        Without a host read nothing can tell which proofs settled, so the tensors
        the proofs kept are read here (the pass the proofs saved is paid when the
        flag is asked for). A tensor modified in place since its proof counts as
        non-finite when its bound, evaluated on device, does not settle it.
        """
        if self._flag is not None and self._flag[0] == len(self._slots):
            return self._flag[1]  # no record since the last call: the same answer
        st = self._stacked()
        if st is None and not self._slots:
            return torch.zeros((), dtype=torch.bool)
        bad = torch.zeros((), dtype=torch.bool)
        amax: torch.Tensor | None = None
        if st is not None:
            lo, hi = st
            bad = ~(torch.isfinite(lo).all() & torch.isfinite(hi).all())
            amax = torch.nan_to_num(_t(torch.maximum(lo.abs(), hi.abs()), lo), nan=INF, posinf=INF)
        bounds: list[Bound] = []
        for slot, s in enumerate(self._slots):
            if isinstance(s, int):
                assert amax is not None
                a = amax[s]
                bounds.append((a, a * math.sqrt(self._widths[slot])))
                continue
            t = s.tensor
            if t._version == s.version and t.numel():
                # A sparse gradient's duplicates are summed into a dense tensor (no sync).
                lo_t, hi_t = torch.aminmax(values_of(dense_sum(t)))
                finite = torch.isfinite(lo_t) & torch.isfinite(hi_t)
                amax_t = _t(torch.maximum(lo_t.abs(), hi_t.abs()), bad)
                a = torch.where(finite, amax_t, torch.full_like(amax_t, INF))
                bounds.append((a, a * math.sqrt(s.width)))
                bad = bad.to(finite.device) | ~finite
            else:
                deps = [bounds[i] for i in s.deps]
                a, r = s.rule(DEVICE, [(_t(d[0], bad), _t(d[1], bad)) for d in deps])
                a, r = _t(a, bad), _t(r, bad)
                ok = torch.isfinite(a) & (a < s.limit) & ~torch.isnan(r)
                for i in s.rule.uses if s.rule.uses is not None else range(len(deps)):
                    ok = ok & torch.isfinite(_t(deps[i][0], bad))
                bounds.append(
                    (
                        torch.where(ok, a, torch.full_like(a, INF)),
                        torch.where(ok, r, torch.full_like(r, INF)),
                    )
                )
                bad = bad.to(ok.device) | ~ok
        self._flag = (len(self._slots), bad)
        return bad

    def read(self) -> list[str]:
        """Per record: ``"ok"``, ``"nan"``, ``"inf"`` or ``"ninf"`` (-inf only; see
        :meth:`status_of`). One device-to-host transfer
        (two when a proof has to be settled by reading its tensor)."""
        st = self._stacked()
        if st is None:
            return self.status_of([], [])
        lo, hi = st
        # The one host read of the monitor: a small packed tensor, on request only.
        pair = torch.stack([lo, hi]).cpu()
        return self.status_of(pair[0].tolist(), pair[1].tolist())


def _t(v: object, like: torch.Tensor) -> torch.Tensor:
    """A device scalar from a rule's value (float64; float32 where a device has no float64)."""
    dtype = torch.float32 if like.device.type == "mps" else torch.float64
    if isinstance(v, torch.Tensor):
        return v.to(dtype)
    return torch.full((), float(v), dtype=dtype, device=like.device)  # type: ignore[arg-type]
