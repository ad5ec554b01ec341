"""Finiteness proofs: bounding a module's output from what was already checked.

Reading a tensor is what the sentinel costs. For a module whose inputs and
parameters were already checked, many outputs need no read at all: a
``Linear`` of finite inputs can only be non-finite by overflow, and overflow is
impossible when a bound on ``|y|`` stays below the largest finite value of the
format. A :class:`Rule` turns bounds on what a module consumed (the ``amax`` of
its input and of its parameters, and a bound on the 2-norm of the input's rows
along the last dimension) into a bound on what it produced, in forward (output)
and in backward (the gradient it sends to its input).

Every bound is a theorem about IEEE arithmetic in any summation order, not an
estimate: for a dot product of length ``K`` the computed value satisfies
``|fl(sum x_k w_k + b)| <= (1 + 2^-8)^3 (1 + u)^K (sum |x_k| |w_k| + |b|)``, where
the ``2^-8`` terms cover inputs rounded to TF32 or bf16 and the output rounding,
and ``u`` is the unit roundoff of the accumulation (:func:`accumulation_roundoff`:
``2^-8`` wherever bfloat16 is involved, else float32's or float64's); ``(1 + u)^K``
is bounded by ``exp(K u)``. Normalisations use the bound that holds for any
non-negative computed variance (torch's kernels use Welford), ``|x - mean| *
rsqrt(var + eps) <= 2 amax(x) / sqrt(eps)``, and elementwise activations their
exact envelope (``|gelu(x)| <= |x|``, ``|tanh(x)| <= min(|x|, 1)``,
``sup |gelu'| < 1.13``...). Normalisations of inputs with ``amax sqrt(D) >= 1e18``
and tanh-GELU's backward beyond ``1e18`` are not proved (squares and cubes
inside those kernels could overflow there).

A proof only ever says "finite"; when it cannot (a bound reaches the format's
range, or something it depends on was not finite) the monitor reads the
retained tensor instead, so the verdict per tensor stays exact. Rules are
written once over an ``ops`` pair (min and a finite-gate) so they evaluate on
host floats after the step's one read, or on device tensors (the no-sync
:attr:`Monitor.found_nonfinite` uses them for a tensor modified in place since
its proof).

Only exact module types are proved (a subclass may override ``forward``), only
with float32, float64 or bfloat16 data and parameters, and never under float16
autocast, where real activations do come within reach of 65504 and a read is
the better deal.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "PROVABLE_DTYPES",
    "Ops",
    "Rule",
    "accumulation_roundoff",
    "backward_rule",
    "forward_rule",
    "provable_type",
    "rule_params",
    "sum_rule",
]

PROVABLE_DTYPES = frozenset({torch.float32, torch.float64, torch.bfloat16})
INF = math.inf
U = 2.0**-8  # unit roundoff of bfloat16: the coarsest rounding these kernels may apply
MARGIN = 1.0 + 2.0**-6  # elementwise functions: a few roundings, generously
HUGE = 1e18  # norms and tanh-GELU backward are not proved beyond this (x**2, x**3 inside)

Bound = tuple[Any, Any]  # (amax bound, bound on the 2-norm of rows along the last dim)


@dataclass(frozen=True)
class Ops:
    """The two non-arithmetic operations rules need, for host floats or device tensors."""

    min: Callable[[Any, Any], Any]
    gate: Callable[[Any, float, Any], Any]  # gate(x, limit, v): v where x < limit, else inf


def _a(m: nn.Module, name: str) -> Any:
    """A module attribute, untyped (rules read hyper-parameters of many classes)."""
    return getattr(m, name)


def _host_min(a: Any, b: Any) -> Any:
    return a if a < b else b


def _host_gate(x: Any, limit: float, v: Any) -> Any:
    return v if x < limit else INF


def _dev_min(a: Any, b: Any) -> Any:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.minimum(a, b)
    if isinstance(a, torch.Tensor):
        return torch.clamp(a, max=b)
    return torch.clamp(b, max=a)


def _dev_gate(x: Any, limit: float, v: Any) -> Any:
    return torch.where(x < limit, v, torch.full_like(v, INF))


HOST = Ops(_host_min, _host_gate)
DEVICE = Ops(_dev_min, _dev_gate)


@functools.lru_cache(maxsize=64)
def accumulation_roundoff(*dtypes: torch.dtype, low_precision: bool = False) -> float:
    """Unit roundoff of the sums inside a matmul or convolution of these dtypes.

    bfloat16 anywhere (data, parameters, or ``low_precision``: a bf16 autocast)
    may accumulate in bfloat16 (reduced-precision reductions are allowed by
    default on CUDA): ``2^-8``. Otherwise float32 accumulates in float32
    (``2^-24``; TF32 or bf16 *inputs* are covered separately) and float64 in
    float64.
    """
    if low_precision or torch.bfloat16 in dtypes:
        return 2.0**-8
    return 2.0**-53 if all(d == torch.float64 for d in dtypes) else 2.0**-24


def _dot_factor(k: int, acc: float) -> float:
    """Bound on ``|fl(sum_k x w + b)| / (sum_k |x| |w| + |b|)``.

    Inputs may be rounded to TF32 or bf16 (``1 + 2^-8`` each), products and the
    output rounded once more (``1 + 2^-8``), and each of the ``k`` additions
    rounds with ``acc``: ``(1 + 2^-8)^3 (1 + acc)^k <= (1 + 2^-8)^3 exp(k acc)``.
    """
    e = k * acc
    return (1 + U) ** 3 * math.exp(e) * (1 + 1e-12) if e < 700 else INF


@dataclass(frozen=True)
class Rule:
    """A proof of finiteness for one module call.

    ``fn(ops, deps)`` maps the bounds of the dependencies (the data input or
    incoming gradient first, then what ``deps`` lists) to the bound of the
    result. ``name`` says which theorem is used (for messages and tests).
    """

    name: str
    fn: Callable[[Ops, Sequence[Bound]], Bound]
    uses: tuple[int, ...] | None = None  # the dependencies the bound reads (None: all)

    def __call__(self, ops: Ops, deps: Sequence[Bound]) -> Bound:
        return self.fn(ops, deps)


def sum_rule(terms: int, dtype: torch.dtype, width: int) -> Rule:
    """Each element a sum of at most ``terms`` values bounded by the one dependency (a
    sparse COO tensor's stored values, duplicates summed when it is coalesced):
    ``|fl(sum of m terms)| <= m A (1 + u)^(m-1) <= m A exp(m u)``, with ``u`` the unit
    roundoff of ``dtype`` (the sum is taken in it or wider)."""
    u = torch.finfo(dtype).eps / 2
    e = terms * u
    factor = terms * math.exp(e) * (1 + 1e-12) if e < 700 else INF
    root = math.sqrt(width)

    def fn(ops: Ops, deps: Sequence[Bound]) -> Bound:
        a = deps[0][0] * factor
        return a, a * root

    return Rule("sum of stored duplicates", fn, (0,))


# Elementwise activations: |f(x)| <= min(L |x| + C, cap), sup |f'(x)| <= D.
# (L, C, cap, D) per type; a factory because some depend on the module's arguments.
def _elementwise(m: nn.Module) -> tuple[float, float, float, float] | None:
    if getattr(m, "inplace", False):
        return None  # it would overwrite the tensor its input's proof may need to read
    t = type(m)
    if t in (nn.ReLU, nn.Identity):
        return 1.0, 0.0, INF, 1.0
    if t is nn.GELU:
        return 1.0, 0.0, INF, 1.13  # |x Phi(x)| <= |x|; max slope 1.1289 (tanh form alike)
    if t is nn.SiLU:
        return 1.0, 0.0, INF, 1.1  # max slope 1.0998
    if t is nn.Tanh:
        return 1.0, 0.0, 1.0, 1.0
    if t is nn.Softsign:
        return 1.0, 0.0, 1.0, 1.0
    if t is nn.Sigmoid:
        return 0.0, 1.0, 1.0, 0.25
    if t is nn.LeakyReLU:
        s = abs(float(_a(m, "negative_slope")))
        return max(1.0, s), 0.0, INF, max(1.0, s)
    if t is nn.ELU:
        a = abs(float(_a(m, "alpha")))
        return 1.0, a, INF, max(1.0, a)
    if t is nn.ReLU6:
        return 1.0, 0.0, 6.0, 1.0
    if t is nn.Hardtanh:
        return 0.0, max(abs(float(_a(m, "min_val"))), abs(float(_a(m, "max_val")))), INF, 1.0
    if t is nn.Hardswish:
        return 1.0, 0.0, INF, 1.5  # slope (2x + 3) / 6 on [-3, 3]
    if t is nn.Softplus:
        beta = float(_a(m, "beta"))
        return (1.0, math.log(2.0) / beta, INF, 1.0) if beta > 0 else None
    if t in (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d):
        p = float(_a(m, "p"))
        if not m.training:
            return 1.0, 0.0, INF, 1.0
        return (1.0 / (1.0 - p), 0.0, INF, 1.0 / (1.0 - p)) if p < 1.0 else None
    return None


def _norm_eps(m: nn.Module, dtype: torch.dtype) -> float | None:
    eps = getattr(m, "eps", None)
    if eps is None:
        # nn.RMSNorm's default is the eps of the dtype it computes in, which may be
        # float32 for half inputs: take the smaller (the larger bound).
        eps = min(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)
    eps = float(eps)
    return eps if eps > 0 else None


def forward_rule(
    m: nn.Module, x: torch.dtype | None, out: torch.Tensor, acc: float = U
) -> Rule | None:
    """The rule proving ``m``'s output ``out`` finite from its input and its parameters.

    ``x`` is the dtype of the one floating input (None for ``Embedding``, which
    has none); ``acc`` the unit roundoff of sums (:func:`accumulation_roundoff`).
    Dependencies, in order: the input (if any), then the parameters named by
    :func:`rule_params`. None when this call of ``m`` is not provable.
    """
    t = type(m)
    d = out.shape[-1] if out.dim() else 1
    sd = math.sqrt(d)
    if t is nn.Linear and x is not None:
        k = _a(m, "in_features")
        f, sk = _dot_factor(k, acc), math.sqrt(k)
        has_b = _a(m, "bias") is not None

        def linear(ops: Ops, deps: Sequence[Bound]) -> Bound:
            (ax, rx), (aw, _) = deps[0], deps[1]
            ab = deps[2][0] if has_b else 0.0
            a = f * (aw * ops.min(ax * k, rx * sk) + ab)
            return a, a * sd

        return Rule("linear", linear)
    if t in (nn.Conv1d, nn.Conv2d, nn.Conv3d) and x is not None:
        w = _a(m, "weight")
        k = int(w.shape[1]) * math.prod(int(s) for s in w.shape[2:])
        f = _dot_factor(k, acc)
        has_b = _a(m, "bias") is not None

        def conv(ops: Ops, deps: Sequence[Bound]) -> Bound:
            ax, aw = deps[0][0], deps[1][0]
            ab = deps[2][0] if has_b else 0.0
            a = f * (k * ax * aw + ab)
            return a, a * sd

        return Rule("conv", conv)
    if t in (nn.LayerNorm, *_rmsnorm()) and x is not None:
        eps = _norm_eps(m, x)
        if eps is None:
            return None  # eps=0: a constant row is 0/0
        nd = math.prod(int(s) for s in _a(m, "normalized_shape"))
        scale = (2.0 if t is nn.LayerNorm else 1.0) / math.sqrt(eps) * MARGIN
        has_w = getattr(m, "weight", None) is not None
        has_b = getattr(m, "bias", None) is not None

        def norm(ops: Ops, deps: Sequence[Bound]) -> Bound:
            ax = deps[0][0]
            aw = deps[1][0] if has_w else 1.0
            ab = deps[1 + has_w][0] if has_b else 0.0
            a = ops.gate(ax * math.sqrt(nd), HUGE, (ax * scale * aw + ab) * MARGIN)
            return a, a * sd

        return Rule("norm", norm)
    if t is nn.Embedding and x is None:

        def embedding(ops: Ops, deps: Sequence[Bound]) -> Bound:
            a = deps[0][0]
            return a, a * sd

        return Rule("embedding", embedding)
    ew = _elementwise(m) if x is not None else None
    if ew is not None:
        lip, c, cap, _ = ew

        # These envelopes hold for every finite input (tanh-GELU's x**3 overflowing
        # inside is harmless: tanh(+-inf) = +-1), so no magnitude gate.
        def elementwise(ops: Ops, deps: Sequence[Bound]) -> Bound:
            ax, rx = deps[0]
            a = ops.min(lip * ax + c, cap) * MARGIN
            r = ops.min(lip * rx + c * sd, cap * sd) * MARGIN
            return a, r

        return Rule(f"elementwise:{t.__name__}", elementwise)
    return None


def backward_rule(m: nn.Module, width: int, dtype: torch.dtype, acc: float = U) -> Rule | None:
    """The rule proving the gradient ``m`` sends to its input finite.

    ``width``/``dtype``: the last dimension and dtype of the forward input;
    ``acc`` the unit roundoff of sums (:func:`accumulation_roundoff`).
    Dependencies, in order: the gradient arriving at ``m``'s output, the forward
    input, then the parameters named by :func:`rule_params`.
    """
    t = type(m)
    sd = math.sqrt(width)
    if t is nn.Linear:
        n = _a(m, "out_features")
        f, sn = _dot_factor(n, acc), math.sqrt(n)

        def linear(ops: Ops, deps: Sequence[Bound]) -> Bound:
            (ag, rg), aw = deps[0], deps[2][0]
            a = f * aw * ops.min(ag * n, rg * sn)
            return a, a * sd

        return Rule("linear", linear, uses=(0, 2))
    if t in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
        w = _a(m, "weight")
        k = int(w.shape[0]) // int(_a(m, "groups")) * math.prod(int(s) for s in w.shape[2:])
        if _a(m, "padding_mode") != "zeros":
            # reflect / replicate / circular padding copies an input value up to
            # 1 + left + right times per dimension, and each copy gets its own gradient
            pads = [int(p) for p in _a(m, "_reversed_padding_repeated_twice")]
            k *= math.prod(1 + pads[i] + pads[i + 1] for i in range(0, len(pads), 2))
        f = _dot_factor(k, acc)

        def conv(ops: Ops, deps: Sequence[Bound]) -> Bound:
            ag, aw = deps[0][0], deps[2][0]
            a = f * k * ag * aw
            return a, a * sd

        return Rule("conv", conv, uses=(0, 2))
    if t in (nn.LayerNorm, *_rmsnorm()):
        eps = _norm_eps(m, dtype)
        if eps is None:
            return None
        nd = math.prod(int(s) for s in _a(m, "normalized_shape"))
        c = (2.0 if t is nn.LayerNorm else 1.0) / math.sqrt(eps) * MARGIN
        rstd = 1.0 / math.sqrt(eps) * MARGIN
        has_w = getattr(m, "weight", None) is not None

        # dx = rstd (g' - mean g' - xhat mean(g' xhat)), g' = g * weight, |xhat| <= c amax(x);
        # the sums inside are up to nd times the means, so the bound carries nd. Loose
        # (large but finite inputs do not settle it and are read), never wrong.
        def norm(ops: Ops, deps: Sequence[Bound]) -> Bound:
            ag, ax = deps[0][0], deps[1][0]
            aw = deps[2][0] if has_w else 1.0
            xh = ax * c
            a = ops.gate(ax * math.sqrt(nd), HUGE, rstd * aw * ag * (2.0 + xh * xh) * nd * MARGIN)
            return a, a * sd

        return Rule("norm", norm)
    ew = _elementwise(m)
    if ew is not None:
        slope = ew[3] * MARGIN
        # tanh-GELU's backward forms (1 - tanh(u)^2) * (1 + 3c x^2): 0 * inf once x^2
        # overflows, so it is proved only for |x| < 1e18; the others are finite for
        # every finite x.
        gated = t is nn.GELU and _a(m, "approximate") == "tanh"

        def elementwise(ops: Ops, deps: Sequence[Bound]) -> Bound:
            (ag, rg), ax = deps[0], deps[1][0]
            if gated:
                return ops.gate(ax, HUGE, ag * slope), ops.gate(ax, HUGE, rg * slope)
            return ag * slope, rg * slope

        return Rule(f"elementwise:{t.__name__}", elementwise)
    return None


def rule_params(m: nn.Module) -> list[str]:
    """Names of the parameters a rule depends on, in dependency order."""
    t = type(m)
    if t in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d):
        return ["weight"] + (["bias"] if _a(m, "bias") is not None else [])
    if t in (nn.LayerNorm, *_rmsnorm()):
        return [n for n in ("weight", "bias") if getattr(m, n, None) is not None]
    if t is nn.Embedding:
        return ["weight"]
    return []


def _rmsnorm() -> tuple[type[nn.Module], ...]:
    cls = getattr(nn, "RMSNorm", None)  # torch >= 2.4
    return (cls,) if cls is not None else ()


_ELEMENTWISE = (
    nn.ReLU, nn.Identity, nn.GELU, nn.SiLU, nn.Tanh, nn.Softsign, nn.Sigmoid, nn.LeakyReLU,
    nn.ELU, nn.ReLU6, nn.Hardtanh, nn.Hardswish, nn.Softplus,
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
)  # fmt: skip


def provable_type(m: nn.Module) -> bool:
    """Whether ``m``'s exact type has a rule (its arguments may still rule a call out)."""
    t = type(m)
    return t in _ELEMENTWISE or t in (
        nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.LayerNorm, nn.Embedding, *_rmsnorm()
    )  # fmt: skip
