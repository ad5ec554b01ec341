"""Numerical gradient checking in float64 with the lessons' (docs/lessons.md) verdicts."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

__all__ = ["GradcheckEntry", "GradcheckReport", "Grade", "gradcheck"]

Grade = Literal["perfect", "acceptable", "questionable", "suspicious", "wrong"]


def verdict_for(rel_error: float) -> Grade:
    """The lessons' rules of thumb: < 1e-7 perfect, < 1e-5 acceptable, > 1e-3 suspicious,
    > 1 wrong; in between (1e-5 .. 1e-3) is "questionable"."""
    if math.isnan(rel_error) or rel_error > 1.0:
        return "wrong"
    if rel_error > 1e-3:
        return "suspicious"
    if rel_error >= 1e-5:
        return "questionable"
    if rel_error >= 1e-7:
        return "acceptable"
    return "perfect"


@dataclass(frozen=True)
class GradcheckEntry:
    """One checked tensor: where its worst element is and how far off it is."""

    name: str
    shape: tuple[int, ...]
    max_rel_error: float
    max_abs_error: float
    worst_index: tuple[int, ...] | None
    analytic: float
    numeric: float
    verdict: Grade


@dataclass(frozen=True)
class GradcheckReport:
    """Per input (or parameter) results; ``ok`` when none is worse than "acceptable"."""

    entries: tuple[GradcheckEntry, ...]
    eps: float

    @property
    def ok(self) -> bool:
        return all(e.verdict in ("perfect", "acceptable") for e in self.entries)

    @property
    def max_rel_error(self) -> float:
        return max((e.max_rel_error for e in self.entries), default=0.0)

    def __getitem__(self, name: str) -> GradcheckEntry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(f"no checked tensor named {name!r}; have {[e.name for e in self.entries]}")

    def __str__(self) -> str:
        header = ("tensor", "shape", "max rel err", "max abs err", "worst at", "verdict")
        rows = [
            (
                e.name,
                "x".join(map(str, e.shape)) or "scalar",
                f"{e.max_rel_error:.3e}",
                f"{e.max_abs_error:.3e}",
                "-" if e.worst_index is None else str(list(e.worst_index)),
                e.verdict,
            )
            for e in self.entries
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()
        out = [f"gradcheck (central differences, eps={self.eps:g}, float64)", line]
        out.append("  ".join("-" * w for w in widths))
        for r in rows:
            out.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        out.append("verdict: " + ("OK" if self.ok else "gradient looks WRONG somewhere"))
        return "\n".join(out)


def _scalarize(out: object, weights: list[torch.Tensor]) -> torch.Tensor:
    """Reduce any output to a scalar by a fixed random projection of its float tensors."""
    tensors: list[torch.Tensor] = []

    def collect(o: object) -> None:
        if isinstance(o, torch.Tensor):
            if o.is_floating_point():
                tensors.append(o)
        elif isinstance(o, (list, tuple)):
            for i in o:
                collect(i)
        elif isinstance(o, dict):
            for i in o.values():
                collect(i)

    collect(out)
    if not tensors:
        raise TypeError("gradcheck: the function returned no floating-point tensor")
    if not weights:
        g = torch.Generator().manual_seed(0)
        for t in tensors:
            weights.append(torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.device))
    total = torch.zeros((), dtype=torch.float64, device=tensors[0].device)
    for t, w in zip(tensors, weights, strict=True):
        # Non-finite outputs would make every difference NaN; they are reported as such.
        total = total + (t.to(torch.float64) * w).sum()
    return total


def gradcheck(
    fn: Callable[..., object] | nn.Module,
    inputs: torch.Tensor | Sequence[object],
    *,
    eps: float | None = None,
    wrt: Literal["inputs", "parameters"] = "inputs",
) -> GradcheckReport:
    """Compare autograd's gradient with central differences, in float64.

    ``fn`` is called as ``fn(*inputs)``; its output (any tensors, nested in
    tuples/lists/dicts) is reduced to a scalar by a fixed random projection, so
    every output element takes part. ``wrt="inputs"`` checks every floating
    input tensor; ``wrt="parameters"`` checks the parameters of an ``nn.Module``
    ``fn`` (by name). Inputs and the module are copied to float64 first: the
    caller's tensors and module are never changed.

    For each element, ``(f(x + eps) - f(x - eps)) / (2 eps)`` (``eps`` default
    1e-6: truncation error ``O(eps^2)``, cancellation ``O(1e-16 / eps)``) is
    compared with the analytic value; the relative error is
    ``|a - n| / max(|a|, |n|)``, with the denominator floored at 1e-8 of the
    largest gradient so exact zeros do not amplify rounding noise. Verdicts use
    the lessons' thresholds (see :func:`verdict_for`). Cost: two forward calls per
    checked element; meant for small tensors.
    """
    if wrt not in ("inputs", "parameters"):
        raise ValueError(f"gradcheck: wrt={wrt!r}; use 'inputs' or 'parameters'")
    if eps is None:
        eps = 1e-6
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"gradcheck: eps={eps!r} must be a positive number")
    args_in = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    if isinstance(fn, nn.Module):
        fn = copy.deepcopy(fn).to(torch.float64)
    elif wrt == "parameters":
        raise TypeError("gradcheck: wrt='parameters' needs an nn.Module")
    if not callable(fn):
        raise TypeError(f"gradcheck: fn must be callable, got {type(fn).__name__}")
    args = [
        a.detach().to(torch.float64).clone()
        if isinstance(a, torch.Tensor) and a.is_floating_point()
        else a
        for a in args_in
    ]
    named: list[tuple[str, torch.Tensor]]
    if wrt == "parameters":
        assert isinstance(fn, nn.Module)
        named = [(n, p) for n, p in fn.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("gradcheck: the module has no trainable parameters")
    else:
        named = [
            (f"input[{i}]", a)
            for i, a in enumerate(args)
            if isinstance(a, torch.Tensor) and a.is_floating_point()
        ]
        if not named:
            raise ValueError("gradcheck: no floating-point tensor among the inputs")
    weights: list[torch.Tensor] = []
    targets = [t for _, t in named]
    for t in targets:
        t.requires_grad_(True)
    loss = _scalarize(fn(*args), weights)
    grads = torch.autograd.grad(loss, targets, allow_unused=True)
    entries = []
    with torch.no_grad():
        for (name, t), g in zip(named, grads, strict=True):
            analytic = torch.zeros_like(t) if g is None else g.detach().to(torch.float64)
            numeric = torch.empty_like(analytic)
            flat = t.view(-1)
            for i in range(flat.numel()):
                orig = flat[i].item()
                flat[i] = orig + eps
                f_plus = _scalarize(fn(*args), weights).item()
                flat[i] = orig - eps
                f_minus = _scalarize(fn(*args), weights).item()
                flat[i] = orig
                numeric.view(-1)[i] = (f_plus - f_minus) / (2 * eps)
            entries.append(_entry(name, analytic, numeric))
    return GradcheckReport(tuple(entries), float(eps))


def _entry(name: str, analytic: torch.Tensor, numeric: torch.Tensor) -> GradcheckEntry:
    if analytic.numel() == 0:
        return GradcheckEntry(name, tuple(analytic.shape), 0.0, 0.0, None, 0.0, 0.0, "perfect")
    diff = (analytic - numeric).abs()
    scale = torch.maximum(analytic.abs(), numeric.abs())
    finite_scale = scale[torch.isfinite(scale)]
    floor = 1e-8 * float(finite_scale.max()) if finite_scale.numel() else 0.0
    floor = max(floor, 1e-300)
    rel = diff / torch.clamp(scale, min=floor)
    rel = torch.where(diff == 0, torch.zeros_like(rel), rel)
    rel = torch.where(torch.isnan(rel), torch.full_like(rel, math.inf), rel)
    flat_idx = int(torch.argmax(rel.reshape(-1)))
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_idx), analytic.shape))
    worst = float(rel.reshape(-1)[flat_idx])
    return GradcheckEntry(
        name=name,
        shape=tuple(analytic.shape),
        max_rel_error=worst,
        max_abs_error=float(diff.nan_to_num(nan=math.inf).max()),
        worst_index=idx,
        analytic=float(analytic.reshape(-1)[flat_idx]),
        numeric=float(numeric.reshape(-1)[flat_idx]),
        verdict=verdict_for(worst),
    )
