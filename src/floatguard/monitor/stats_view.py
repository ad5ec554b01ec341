"""Views of a step's records for people and the event stream: alerts, statistics, format fit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from floatguard.formats.registry import Format, get
from floatguard.monitor.localize import Alert, Record
from floatguard.stats import EXP_MIN, TensorStats

__all__ = ["alerts", "format_fit", "stats_of", "stats_summary"]

StatsKey = tuple[str, str]  # (module, role)
_FIT = ("overflow", "underflow", "subnormal", "scale", "scale_pow2")
_PHASE_OF = {
    "fwd_input": "input",
    "fwd_param": "forward",
    "fwd_output": "forward",
    "loss": "loss",
    "bwd_grad_output": "backward",
    "bwd_param_grad": "param_grad",
    "bwd_grad_input": "backward",
}


def alerts(records: Sequence[Record], status: Sequence[str], step: int) -> list[Alert]:
    """Per non-finite record (``status`` per slot, from the sentinel): module, role,
    shape, NaN/inf flags, and the finite min/max when the record has statistics."""
    out = []
    for rec in records:
        st = status[rec.slot]
        if st == "ok":
            continue
        path, role = rec.paths[0]
        s = rec.stats
        out.append(
            Alert(
                step=step,
                phase=_PHASE_OF[rec.kind],
                module=path[-1] if path else "",
                tensor=role,
                shape=rec.shape,
                has_nan=bool(s.has_nan) if s is not None else st == "nan",
                has_inf=bool(s.has_inf) if s is not None else st in ("inf", "ninf"),
                min=float(s.min) if s is not None and int(s.finite_nonzero + s.zeros) else None,
                max=float(s.max) if s is not None and int(s.finite_nonzero + s.zeros) else None,
            )
        )
    return out


def stats_of(records: Sequence[Record]) -> dict[StatsKey, TensorStats]:
    """``{(module, role): TensorStats}`` of the records that have statistics, merged
    over repeats; a parameter's gradient is under ``"param:weight.grad"``."""
    out: dict[StatsKey, TensorStats] = {}
    for rec in records:
        if rec.stats is None:
            continue
        path, role = rec.paths[0]
        if rec.kind == "bwd_param_grad":
            role += ".grad"
        key = (path[-1] if path else "", role)
        out[key] = out[key].merge(rec.stats) if key in out else rec.stats
    return out


def _fit_row(st: TensorStats, fmts: Sequence[Format]) -> torch.Tensor:
    """float64 device vector: for each format, the :data:`_FIT` values in order."""
    n = torch.clamp(st.numel, min=1).double()
    return torch.cat(
        [
            torch.stack(
                [
                    st.overflow_count(f).double() / n,
                    st.underflow_count(f).double() / n,
                    st.subnormal_count(f).double() / n,
                    st.recommended_scale(f).double(),
                    st.recommended_scale(f, power_of_two=True).double(),
                ]
            )
            for f in fmts
        ]
    )


def _to_host(rows: list[torch.Tensor]) -> list[list[float]]:
    """Equal-length device vectors as host lists: one copy per device they are on."""
    by_device: dict[torch.device, list[int]] = {}
    for i, r in enumerate(rows):
        by_device.setdefault(r.device, []).append(i)
    out: list[list[float]] = [[] for _ in rows]
    for order in by_device.values():
        for i, values in zip(order, torch.stack([rows[i] for i in order]).tolist(), strict=True):
            out[i] = values
    return out


def format_fit(
    stats: dict[StatsKey, TensorStats], formats: Sequence[str]
) -> dict[StatsKey, dict[str, dict[str, float]]]:
    """How each tensor of ``stats`` would fit each of ``formats`` (see
    :meth:`Monitor.format_fit`). One device-to-host copy (per device)."""
    if not stats:
        return {}
    fmts = [get(f) for f in formats]
    values = _to_host([_fit_row(st, fmts) for st in stats.values()])
    k = len(_FIT)
    return {
        key: {
            f.name: dict(zip(_FIT, row[j * k : (j + 1) * k], strict=True))
            for j, f in enumerate(fmts)
        }
        for key, row in zip(stats, values, strict=True)
    }


def stats_summary(
    stats: dict[StatsKey, TensorStats], formats: Sequence[str]
) -> list[dict[str, Any]]:
    """A JSON-ready summary of ``stats`` (see :meth:`Monitor.stats_summary`): counts,
    amax, format fractions and the histogram of every tensor are packed into one
    float64 vector each and copied to the host together: one device-to-host copy
    (per device)."""
    if not stats:
        return []
    fmts = [get(f) for f in formats]
    rows = [
        torch.cat(
            [
                torch.stack(
                    [
                        st.numel.double(),
                        st.amax.double(),
                        (st.nan + st.posinf + st.neginf).double(),
                        st.zeros.double(),
                    ]
                ),
                _fit_row(st, fmts),
                st.hist.double(),  # counts below 2**53: exact
            ]
        )
        for st in stats.values()
    ]
    k, head = len(_FIT), 4
    out = []
    for key, row in zip(stats, _to_host(rows), strict=True):
        numel, amax, nonfinite, zeros = row[:head]
        fit = row[head : head + k * len(fmts)]
        hist = row[head + k * len(fmts) :]
        nz = [i for i, c in enumerate(hist) if c]
        lo, hi = (nz[0], nz[-1] + 1) if nz else (0, 0)
        out.append(
            {
                "module": key[0], "role": key[1], "numel": int(numel), "amax": amax,
                "nonfinite": int(nonfinite), "zeros": int(zeros),
                "formats": {
                    f.name: {n: fit[j * k + _FIT.index(n)]
                             for n in ("underflow", "overflow", "subnormal")}
                    for j, f in enumerate(fmts)
                },
                "hist_from": EXP_MIN + lo, "hist": [int(c) for c in hist[lo:hi]],
            }
        )  # fmt: skip
    return out
