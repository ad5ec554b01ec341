"""Device-resident finiteness records: one ``aminmax`` per watched tensor, read once on demand.

``torch.aminmax`` is a single pass that propagates NaN, so a record tells, after
the fact, whether its tensor held a NaN (min and max are NaN), an inf (min is
-inf or max is +inf, and no NaN) or neither. It is exact for every dtype, unlike
a sum (which overflows, and turns +inf with -inf into NaN). Records stay on the
tensor's device; :meth:`Sentinel.flag` folds them into one device bool without a
host sync, and :meth:`Sentinel.read` moves them to the host in one transfer.
"""

from __future__ import annotations

import torch

__all__ = ["Sentinel"]


class Sentinel:
    """An append-only list of (min, max) device scalars, one pair per record."""

    def __init__(self) -> None:
        self._mins: list[torch.Tensor] = []
        self._maxs: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self._mins)

    def add(self, t: torch.Tensor) -> int:
        """Record ``t``; returns the record's index. One kernel, no sync."""
        if t.numel() == 0:
            z = torch.zeros((), dtype=t.dtype, device=t.device)
            lo, hi = z, z
        else:
            lo, hi = torch.aminmax(t.detach())
        self._mins.append(lo)
        self._maxs.append(hi)
        return len(self._mins) - 1

    def clear(self) -> None:
        self._mins.clear()
        self._maxs.clear()

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self._mins:
            return None
        dtypes = {t.dtype for t in self._mins}
        if len(dtypes) == 1:
            lo, hi = torch.stack(self._mins), torch.stack(self._maxs)
            return lo.to(torch.float32), hi.to(torch.float32)
        # Mixed dtypes (autocast): cast each scalar to float32 first (every float's
        # min/max, inf and NaN survive the cast). Kernels only, no host round trip.
        lo = torch.stack([t.to(torch.float32) for t in self._mins])
        hi = torch.stack([t.to(torch.float32) for t in self._maxs])
        return lo, hi

    def packed(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(min, max) of every record as two float32 device vectors, for a caller that
        folds them into its own single host read (the guard does)."""
        return self._stacked()

    @staticmethod
    def status_of(lo: list[float], hi: list[float]) -> list[str]:
        """Per record "ok" / "nan" / "inf" from host copies of :meth:`packed`."""
        out = []
        for a, b in zip(lo, hi, strict=True):
            if a != a or b != b:
                out.append("nan")
            elif a == float("-inf") or b == float("inf"):
                out.append("inf")
            else:
                out.append("ok")
        return out

    def flag(self) -> torch.Tensor:
        """Device bool: did any record see a NaN or inf? (No host sync.)"""
        st = self._stacked()
        if st is None:
            return torch.zeros((), dtype=torch.bool)
        lo, hi = st
        return ~(torch.isfinite(lo).all() & torch.isfinite(hi).all())

    def read(self) -> list[str]:
        """Per record: ``"ok"``, ``"nan"`` or ``"inf"``. One device-to-host transfer."""
        st = self._stacked()
        if st is None:
            return []
        lo, hi = st
        # The one host read of the monitor: a small packed tensor, on request only.
        pair = torch.stack([lo, hi]).cpu()
        return self.status_of(pair[0].tolist(), pair[1].tolist())
