"""Precision-readiness audit: what each layer's activations, weights and gradients would
lose in each format and scaling recipe, and a recommendation in words.

One convention for the loss: ``loss_fn(model, batch) -> loss`` (audit's ``loss_fn``, and
the third element an audit target of ``floatguard audit`` returns), never a
``criterion(output, target)``; see :func:`audit`. (The guard takes a closure instead:
``Guard.step(closure)`` calls ``closure()``, as ``Optimizer.step(closure)``.)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from floatguard._values import values_of
from floatguard.batch_loss import batch_loss, check_loss_fn
from floatguard.emulation.emulation_recipe import EmulationRecipe
from floatguard.emulation.recipes import Block, TensorRecipe, Tensorwise
from floatguard.formats.registry import get
from floatguard.formats.rounding import quantize
from floatguard.stats import EXP_MIN, TensorStats, tensor_stats

if TYPE_CHECKING:
    from floatguard.emulation.coverage import GemmCoverage

__all__ = ["AuditReport", "LayerAudit", "audit"]

KINDS = ("activation", "weight", "output", "gradient")


@dataclass
class _Acc:
    stats: TensorStats | None = None
    signal: dict[str, float] = field(default_factory=dict)
    noise: dict[str, float] = field(default_factory=dict)
    flushed: dict[str, int] = field(default_factory=dict)

    def add(
        self, t: torch.Tensor, formats: Sequence[str], recipes: Mapping[str, TensorRecipe]
    ) -> None:
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
    """Per-layer audits, in module order, and the GEMM coverage emulate() would have
    (``coverage``, see :func:`audit`); ``to_dict()`` is JSON-ready."""

    layers: list[LayerAudit]
    formats: tuple[str, ...]
    recipes: tuple[str, ...]
    coverage: GemmCoverage | None = None

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
            "gemm_coverage": None if self.coverage is None else self.coverage.to_dict(),
        }

    def __str__(self) -> str:
        lines = []
        for la in self.layers:
            lines.append(f"{la.layer}: " + "; ".join(la.recommendation))
        if self.coverage is not None:
            lines.append(f"emulate() coverage: {self.coverage.summary()}")
        return "\n".join(lines)


def _is_gemm(m: nn.Module, modules: tuple[type[nn.Module], ...] | None) -> bool:
    """The layers audited: ``modules`` if given, else nn.Linear and transformers'
    ``Conv1D`` (GPT-2's linear layers; matched by name, transformers is not imported)."""
    if modules is not None:
        return isinstance(m, modules)
    return isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"


def _pct(x: float) -> str:
    """A fraction as a percentage with three significant digits (never 1e+02%)."""
    return f"{100 * x:.3g}%"


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


FP16_MAX = float.fromhex("0x1.ffcp15")  # 65504
FP32_MAX = float.fromhex("0x1.fffffep127")  # 3.4028234663852886e38
# The most an fp16 loss can be scaled by: the backward seeds the loss with its own
# gradient, the scale, as an fp16 value (inf from 65520 on): the largest power of two
# below 65504 is 2^15.
FP16_LOSS_SCALE_LOG2 = math.floor(math.log2(FP16_MAX))  # 15
# A float32 scale itself: the largest power of two float32 holds.
FP32_SCALE_LOG2 = math.floor(math.log2(FP32_MAX))  # 127


@dataclass(frozen=True)
class _LossSeen:
    """What the audit saw of the losses it back-propagated."""

    fp16: bool
    """Some loss was an fp16 tensor (``model.half()``, or an autocast loss op that
    stays in fp16, such as ``out.mean()``): ``loss * scale`` seeds the backward with
    the scale as an fp16 value, so 2^15 is the most (2^16 is inf there)."""
    amax: float
    """The largest |loss| (a float32 scaled loss must stay within float32's range)."""


def _underflow_at(st: TensorStats, log2_scale: int) -> float:
    """The fraction of ``st``'s values that round to zero in fp16 once multiplied by
    ``2**log2_scale``: :meth:`TensorStats.underflow_count`'s binades moved down by
    ``log2_scale`` (a power of two only shifts exponents). To a binade."""
    f = get("fp16")
    top = f.emin - f.mantissa_bits - 2 - log2_scale  # the highest exponent still flushed
    n = top - EXP_MIN + 1
    return st.fraction(st.hist[:n].sum()) if n > 0 else 0.0


def _fp16_loss_scale(g: dict[str, Any], st: TensorStats | None, loss: _LossSeen | None) -> str:
    """The loss-scale advice for fp16, from the gradients measured (``g``, ``st``).

    The scale multiplies the loss. Under autocast the loss is float32 (autocast runs
    loss ops in float32) and so is GradScaler's scale (2^16 to start, doubled after
    2000 clean steps, halved at an overflow): the scale is not an fp16 value and may
    pass 2^15. What bounds it: every gradient the backward computes in fp16 is the true
    one times the scale, so the largest gradient times the scale must stay below fp16's
    max 65504 (``2^h_grad``); and the scaled loss must stay within float32's range. Only
    an fp16 *loss* (``model.half()``, or ``out.mean()`` of an fp16 output under
    autocast) takes the scale itself as an fp16 value, its own gradient: 2^15 at most
    (2^16 is inf there). The least useful scale, ``2^k``, keeps the smallest gradient
    from rounding to zero (below 2^-25, half fp16's smallest subnormal 2^-24, and at
    it: ties go to even, zero). Recommended: the largest power of two the bounds allow,
    ``2^h``, which keeps the most small gradients out of underflow and subnormals (it
    is where GradScaler's dynamic scale settles); when ``k > h`` no scale keeps both
    ends, and the advice says what still underflows at ``2^h`` (to a binade).
    """
    under = g["format:fp16"]["underflow"]
    mn, amax = g["min_nonzero"], g["amax"]
    # the layer's parameter gradients (an fp16 GEMM's output under autocast) count too
    of_param = g.get("param_grad_amax", 0.0) > amax
    amax = max(amax, g.get("param_grad_amax", 0.0))
    if under <= 1e-3 or not (math.isfinite(mn) and mn > 0 and amax > 0):
        return "fp16 safe"
    half_tiny = get("fp16").smallest_subnormal / 2  # 2^-25: this and below flush to zero
    k = max(0, math.floor(math.log2(half_tiny / mn)) + 1)
    # amax <= 65504 here (an fp16 overflow is advised on before), so h_grad >= 0
    h_grad = math.floor(math.log2(FP16_MAX / amax))
    lamax = loss.amax if loss is not None else 0.0
    h_f32 = FP32_SCALE_LOG2
    if lamax > 0 and math.isfinite(lamax):
        h_f32 = min(h_f32, math.floor(math.log2(FP32_MAX / lamax)))
    fp16_loss = loss is not None and loss.fp16
    h32 = min(h_grad, h_f32)  # with a float32 loss
    h = min(h32, FP16_LOSS_SCALE_LOG2) if fp16_loss else h32

    owner = ", a parameter's" if of_param else ""
    big = f"the largest gradient ({amax:.3g}{owner})"

    def why(at: int) -> str:
        if at == h_grad:
            return f"the largest that keeps {big} below fp16's max 65504"
        if at == h_f32:
            return f"the largest that keeps the scaled loss ({lamax:.3g}) within float32's range"
        return "the most an fp16 loss takes (its own gradient is the scale, fp16's max 65504)"

    need = f"{_pct(under)} of gradients underflow unscaled"
    least = f"2^{k} is the least that keeps the smallest ({mn:.3g}) from rounding to zero"
    caveat = ""
    if not fp16_loss and h > FP16_LOSS_SCALE_LOG2:
        caveat = (
            ", with the loss in float32 as autocast's loss ops give it (an fp16 loss's own "
            f"gradient is the scale: 2^{FP16_LOSS_SCALE_LOG2} at most)"
        )
    if k <= h:
        use = f"use 2^{h}, {why(h)}, {least}"
        return f"fp16 needs a loss scale from 2^{k} to 2^{h} ({need}): {use}{caveat}"
    if fp16_loss and k <= h32:
        return (
            f"fp16 gradients need a loss scale of 2^{k} or more ({need}), beyond the "
            f"2^{FP16_LOSS_SCALE_LOG2} an fp16 loss takes (its own gradient is the scale, and "
            "fp16's max is 65504): compute the loss in float32 (loss.float() before its final "
            f"sum or mean) and use 2^{h32}, {why(h32)}, {least}"
        )
    limits = []
    if h_grad < k:
        limits.append(f"above 2^{h_grad} {big} passes fp16's max 65504")
    if h_f32 < k:
        limits.append(f"above 2^{h_f32} the scaled loss ({lamax:.3g}) leaves float32's range")
    if fp16_loss:
        limits.append(
            f"an fp16 loss takes 2^{FP16_LOSS_SCALE_LOG2} at most (its own gradient is the scale)"
        )
    left = _underflow_at(st, h) if st is not None else under
    if left <= 1e-3:  # the smallest few flush at the best scale: as harmless as "fp16 safe"
        return (
            f"fp16 needs a loss scale of 2^{h} ({need}): use 2^{h}, {why(h)}, where "
            f"{_pct(left)} still underflow (the smallest, {mn:.3g}, needs 2^{k}){caveat}"
        )
    return (
        f"fp16 gradients span more than its range ({need}): {least}, but "
        + ", and ".join(limits)
        + f"; at 2^{h}, {_pct(left)} still underflow: keep bf16"
    )


def _recommend(
    results: dict[str, dict[str, Any]],
    recipes: Sequence[str],
    grad_stats: TensorStats | None = None,
    loss: _LossSeen | None = None,
) -> list[str]:
    recs: list[str] = []
    kinds = [k for k in KINDS if k in results]
    bad = [f"{k} ({results[k]['nonfinite']} of {results[k]['numel']})" for k in kinds
           if results[k].get("nonfinite")]  # fmt: skip
    if bad:  # the statistics are of the finite values only: no verdict is honest
        return [
            "non-finite values in " + ", ".join(bad) + ": the model computes NaN/inf already "
            "(a corrupted weight, a bad batch); fix that first, no format can be judged"
        ]
    fmt_keys = {key for k in kinds for key in results[k] if key.startswith("format:")}
    if "format:bf16" in fmt_keys:
        worst = max(
            results[k]["format:bf16"]["underflow"] + results[k]["format:bf16"]["overflow"]
            for k in kinds
        )
        recs.append("bf16 safe" if worst < 1e-3 else f"bf16 loses {_pct(worst)} of values")
    if "format:fp16" in fmt_keys:
        over = max(results[k]["format:fp16"]["overflow"] for k in kinds)
        if over > 0:
            where = ", ".join(k for k in kinds if results[k]["format:fp16"]["overflow"] > 0)
            recs.append(f"fp16 overflows ({_pct(over)} of values, in the {where}): keep bf16")
        elif "gradient" in results:
            recs.append(_fp16_loss_scale(results["gradient"], grad_stats, loss))
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
                f"e4m3 tensor-wise loses {_pct(t_under)} of values to underflow, "
                f"1x128 blocks {_pct(b_under)}: use block scaling"
            )
        elif t_under <= 0.01:
            recs.append(
                f"e4m3 tensor-wise keeps {_pct(1 - t_under)} of values: tensor-wise is enough"
            )
        else:
            recs.append(
                f"e4m3 loses {_pct(t_under)} tensor-wise and {_pct(b_under)} with 1x128 "
                "blocks: keep this layer in bf16"
            )
    return recs


def audit(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    formats: Sequence[str] = ("bf16", "fp16", "e4m3fn", "e5m2"),
    recipes: Mapping[str, TensorRecipe] | None = None,
    modules: tuple[type[nn.Module], ...] | None = None,
    emulation: EmulationRecipe | None = None,
) -> AuditReport:
    """Run forward and backward on ``batches`` and audit every matching layer.

    ``loss_fn(model, batch)`` is called with the model and each element of ``batches``
    and returns the scalar loss to back-propagate: it runs the forward itself (default:
    the model's own ``.loss`` when it returns one, else the mean of its output; a dict
    batch goes in as keyword arguments). It is not a ``criterion(output, target)``: a
    torch loss module given as ``loss_fn`` is a TypeError; wrap it, as in
    ``loss_fn=lambda model, batch: criterion(model(batch[0]), batch[1])``.

    For each layer: the input activation, the weight and the output gradient, cast to
    each format (saturating, unscaled) and through each recipe (default: e4m3
    tensor-wise and 1x128 blocks). Gradients are left as they were (``model.zero_grad()``
    is called before and after). Reads results on the host.

    ``emulation`` (an :class:`~floatguard.emulation.EmulationRecipe`): the report's
    ``coverage`` is the share of the GEMM FLOPs of one more forward and backward of the
    first batch (``loss_fn`` is called once more) that ``emulate(model, emulation)`` runs
    on emulated operands, as :func:`floatguard.emulation.coverage` measures it at dispatch:
    the model emulated for that run and restored, before the audit's own hooks exist (an
    RNN, an eager attention, a skipped LM head are FLOPs left in high precision). A model
    emulate() swaps nothing in (no covered layer, or a bare ``nn.Linear``) gets its plain
    count, 0% emulated; one already emulated is measured as it is. None (the default):
    not measured, ``coverage`` is None.
    """
    check_loss_fn(loss_fn)
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
    targets = [(n, m) for n, m in model.named_modules() if _is_gemm(m, modules)]
    if not targets:
        kinds = [m.__name__ for m in modules] if modules else ["Linear", "Conv1D"]
        raise ValueError(f"no module of types {kinds} in the model")

    def forward_hook(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            slot = accs.setdefault(name, {k: _Acc() for k in KINDS})
            if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
                slot["activation"].add(args[0], fmts, recs)
            w = getattr(module, "weight", None)
            if isinstance(w, torch.Tensor):
                slot["weight"].add(w, fmts, recs)
            if isinstance(output, torch.Tensor) and output.is_floating_point():
                # the forward's own result: a matmul that overflows fp16 shows here
                slot["output"].add(output, fmts, recs)
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(  # type: ignore[no-untyped-call]
                    lambda g: slot["gradient"].add(g, fmts, recs)
                )

        return hook

    # The largest gradient of each layer's parameters, per backward (a parameter hook
    # sees each backward's gradient before it accumulates): under autocast the weight
    # gradient is an fp16 GEMM output too, summed over the batch, and bounds the scale
    # as the output gradient does.
    param_grad: dict[str, float] = {}

    def param_hook(name: str) -> Callable[[torch.Tensor], None]:
        def hook(g: torch.Tensor) -> None:
            v = values_of(g)
            a = float(v.abs().max()) if v.numel() else 0.0  # a host read (audit reads anyway)
            if math.isfinite(a) and a > param_grad.get(name, 0.0):
                param_grad[name] = a

        return hook

    gemm, batches = _first_batch_coverage(model, batches, loss_fn, emulation)
    for name, m in targets:
        handles.append(m.register_forward_hook(forward_hook(name)))
        for p in m.parameters(recurse=False):
            if p.requires_grad:
                handles.append(p.register_hook(param_hook(name)))
    model.zero_grad(set_to_none=True)
    loss_fp16, loss_amax = False, 0.0
    try:
        for batch in batches:
            loss = batch_loss(loss_fn, model, batch)
            loss_fp16 |= loss.dtype == torch.float16
            loss_amax = max(loss_amax, float(loss.detach().abs().max()))  # a host read
            loss.backward()  # type: ignore[no-untyped-call]
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    layers = []
    for name, _ in targets:
        if name not in accs:
            continue
        results = {k: _summarize(a) for k, a in accs[name].items() if a.stats is not None}
        if "gradient" in results:
            results["gradient"]["param_grad_amax"] = param_grad.get(name, 0.0)
        seen = _LossSeen(loss_fp16, loss_amax)
        rec = _recommend(results, list(recs), accs[name]["gradient"].stats, seen)
        layers.append(LayerAudit(name, results, rec))
    return AuditReport(layers, fmts, tuple(recs), gemm)


def _first_batch_coverage(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None,
    recipe: EmulationRecipe | None,
) -> tuple[GemmCoverage | None, Iterable[Any]]:
    """The coverage audit on the first batch (before the audit's hooks exist, so they do
    not see it), and the batches with that one still first (an iterator is read once)."""
    from floatguard.emulation import NothingToEmulate, coverage, is_emulated

    if recipe is None:
        return None, batches
    it = iter(batches)
    try:
        first = next(it)
    except StopIteration:
        return None, ()
    rest = itertools.chain([first], it)
    if is_emulated(model):
        return coverage(model, first, loss_fn=loss_fn), rest
    try:
        return coverage(model, first, recipe, loss_fn=loss_fn, inplace=True), rest
    except NothingToEmulate:  # emulate() would swap nothing: what runs is all high precision
        return coverage(model, first, loss_fn=loss_fn), rest
