"""Precision-readiness audit: what each layer's activations, weights and gradients would
lose in each format and scaling recipe, and a recommendation in words."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from floatguard.formats.quantize import quantize
from floatguard.formats.registry import get
from floatguard.scaling.recipes import Block, Recipe, Tensorwise
from floatguard.stats import TensorStats, tensor_stats

__all__ = ["AuditReport", "LayerAudit", "audit"]

KINDS = ("activation", "weight", "gradient")


@dataclass
class _Acc:
    stats: TensorStats | None = None
    signal: dict[str, float] = field(default_factory=dict)
    noise: dict[str, float] = field(default_factory=dict)
    flushed: dict[str, int] = field(default_factory=dict)

    def add(self, t: torch.Tensor, formats: Sequence[str], recipes: Mapping[str, Recipe]) -> None:
        t = t.detach().float()
        st = tensor_stats(t)
        self.stats = st if self.stats is None else self.stats.merge(st)
        finite = torch.isfinite(t)
        x = torch.where(finite, t, torch.zeros_like(t))
        sig = float((x.double() ** 2).sum())
        outs = {f"format:{f}": quantize(x, f, overflow="saturate") for f in formats}
        outs.update({f"recipe:{name}": r(x).values.float() for name, r in recipes.items()})
        for key, q in outs.items():
            self.signal[key] = self.signal.get(key, 0.0) + sig
            self.noise[key] = self.noise.get(key, 0.0) + float(((x - q).double() ** 2).sum())
            self.flushed[key] = self.flushed.get(key, 0) + int(((x != 0) & (q == 0)).sum())


@dataclass
class LayerAudit:
    """One layer: per kind, amax and per format / recipe the overflow, underflow and
    subnormal fractions and SQNR (dB); and the recommendation."""

    layer: str
    results: dict[str, dict[str, Any]]
    recommendation: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "results": self.results, "recommendation": self.recommendation}


@dataclass
class AuditReport:
    """Per-layer audits, in module order; ``to_dict()`` is JSON-ready."""

    layers: list[LayerAudit]
    formats: tuple[str, ...]
    recipes: tuple[str, ...]

    def __getitem__(self, layer: str) -> LayerAudit:
        for la in self.layers:
            if la.layer == layer:
                return la
        raise KeyError(f"no audited layer {layer!r}; have {[la.layer for la in self.layers]}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "formats": list(self.formats),
            "recipes": list(self.recipes),
            "layers": [la.to_dict() for la in self.layers],
        }

    def __str__(self) -> str:
        lines = []
        for la in self.layers:
            lines.append(f"{la.layer}: " + "; ".join(la.recommendation))
        return "\n".join(lines)


def _sqnr(signal: float, noise: float) -> float:
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


def _summarize(acc: _Acc) -> dict[str, Any]:
    st = acc.stats
    assert st is not None
    n = max(int(st.numel), 1)
    out: dict[str, Any] = {
        "amax": float(st.amax),
        "min_nonzero": float(st.min_nonzero),
        "numel": int(st.numel),
        "nonfinite": int(st.nan + st.posinf + st.neginf),
    }
    for key in acc.signal:
        entry: dict[str, float] = {
            "sqnr_db": _sqnr(acc.signal[key], acc.noise[key]),
            "underflow": acc.flushed[key] / n,
        }
        if key.startswith("format:"):
            f = get(key.split(":", 1)[1])
            entry["overflow"] = st.fraction(st.overflow_count(f))
            entry["subnormal"] = st.fraction(st.subnormal_count(f))
        out[key] = entry
    return out


def _recommend(results: dict[str, dict[str, Any]], recipes: Sequence[str]) -> list[str]:
    recs: list[str] = []
    kinds = [k for k in KINDS if k in results]
    fmt_keys = {key for k in kinds for key in results[k] if key.startswith("format:")}
    if "format:bf16" in fmt_keys:
        worst = max(
            results[k]["format:bf16"]["underflow"] + results[k]["format:bf16"]["overflow"]
            for k in kinds
        )
        recs.append("bf16 safe" if worst < 1e-3 else f"bf16 loses {100 * worst:.2g}% of values")
    if "format:fp16" in fmt_keys:
        f16 = get("fp16")
        over = max(results[k]["format:fp16"]["overflow"] for k in kinds)
        if over > 0:
            recs.append(f"fp16 overflows ({100 * over:.2g}% of values): keep bf16")
        elif "gradient" in results:
            g = results["gradient"]
            mn, amax = g["min_nonzero"], g["amax"]
            under = g["format:fp16"]["underflow"]
            if under > 1e-3 and math.isfinite(mn) and mn > 0:
                k = max(0, math.ceil(math.log2(f16.smallest_subnormal / mn)))
                headroom = math.floor(math.log2(f16.max / amax)) if amax > 0 else 24
                if k <= headroom:
                    recs.append(
                        f"fp16 needs a loss scale >= 2^{k} "
                        f"({100 * under:.2g}% of gradients underflow)"
                    )
                else:
                    recs.append(
                        f"fp16 gradients span more than its range ({100 * under:.2g}% underflow "
                        "at any safe scale): keep bf16"
                    )
            else:
                recs.append("fp16 safe")
        else:
            recs.append("fp16 safe")
    tw = [r for r in recipes if "tensor" in r]
    blk = [r for r in recipes if "block" in r or "1x128" in r]
    if tw and blk:
        t_key, b_key = f"recipe:{tw[0]}", f"recipe:{blk[0]}"
        t_under = max(results[k][t_key]["underflow"] for k in kinds if t_key in results[k])
        b_under = max(results[k][b_key]["underflow"] for k in kinds if b_key in results[k])
        if t_under > 0.01 and b_under < t_under / 2:
            recs.append(
                f"e4m3 tensor-wise loses {100 * t_under:.2g}% of values to underflow, "
                f"1x128 blocks {100 * b_under:.2g}%: use block scaling"
            )
        elif t_under <= 0.01:
            recs.append(
                f"e4m3 tensor-wise keeps {100 * (1 - t_under):.3g}% of values: "
                "tensor-wise is enough"
            )
        else:
            recs.append(
                f"e4m3 loses {100 * t_under:.2g}% tensor-wise and {100 * b_under:.2g}% with 1x128 "
                "blocks: keep this layer in bf16"
            )
    return recs


def audit(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    formats: Sequence[str] = ("bf16", "fp16", "e4m3fn", "e5m2"),
    recipes: Mapping[str, Recipe] | None = None,
    modules: tuple[type[nn.Module], ...] = (nn.Linear,),
) -> AuditReport:
    """Run forward and backward on ``batches`` and audit every matching layer.

    ``loss_fn(model, batch)`` gives the loss to back-propagate (default: the mean of
    the model's output). For each layer: the input activation, the weight and the
    output gradient, cast to each format (saturating, unscaled) and through each recipe
    (default: e4m3 tensor-wise and 1x128 blocks). Gradients are left as they were
    (``model.zero_grad()`` is called before and after). Reads results on the host.
    """
    fmts = tuple(get(f).name for f in formats)
    recs = (
        dict(recipes)
        if recipes is not None
        else {
            "e4m3 tensorwise": Tensorwise("e4m3fn"),
            "e4m3 block 1x128": Block("e4m3fn", (1, 128)),
        }
    )
    accs: dict[str, dict[str, _Acc]] = {}
    handles = []
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, modules)]
    if not targets:
        raise ValueError(f"no module of types {[m.__name__ for m in modules]} in the model")

    def forward_hook(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            slot = accs.setdefault(name, {k: _Acc() for k in KINDS})
            if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
                slot["activation"].add(args[0], fmts, recs)
            w = getattr(module, "weight", None)
            if isinstance(w, torch.Tensor):
                slot["weight"].add(w, fmts, recs)
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(  # type: ignore[no-untyped-call]
                    lambda g: slot["gradient"].add(g, fmts, recs)
                )

        return hook

    for name, m in targets:
        handles.append(m.register_forward_hook(forward_hook(name)))
    model.zero_grad(set_to_none=True)
    try:
        for batch in batches:
            loss = loss_fn(model, batch) if loss_fn is not None else model(batch).float().mean()
            loss.backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    layers = []
    for name, _ in targets:
        if name not in accs:
            continue
        results = {k: _summarize(a) for k, a in accs[name].items() if a.stats is not None}
        layers.append(LayerAudit(name, results, _recommend(results, list(recs))))
    return AuditReport(layers, fmts, tuple(recs))
