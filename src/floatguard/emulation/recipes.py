"""Low-precision scaling recipes: how a tensor is scaled into a format's window, then quantized.

Convention (Transformer Engine's): a *scale* ``s`` multiplies values into the
format's range, ``q = quantize(x * s) / s``. Every recipe returns the fake-quantized
tensor (values the low-precision format would give back, in x's dtype) and the
scales it used (:class:`QuantResult`).

One policy for a degenerate amax, in every recipe: a scale is never NaN or inf.
An amax of 0 (an all-zero tensor or block) or a non-finite amax gives scale 1.0
(current scaling) or keeps the previous scale (delayed scaling); the number of
such fallbacks is reported (``fallbacks``) so the caller can record an event. The
references: Transformer Engine's current scaling returns 1.0 for an amax that is 0,
inf or NaN (``compute_scale_from_amax``, ``transformer_engine/common/recipe/
recipe_common.cuh``) and, its amax kernels skipping NaN elements (``fmaxf``), never
sees a NaN amax from NaN elements; its delayed scaling keeps the previous scale
(``delayed_scaling.cu``). torchao clamps amax to 1e-12 (so an all-zero tensor gets a
scale of 4.5e14, and an inf amax a scale of 0, which turns inf into NaN); DeepSeek's
reference kernel divides by zero. ``nan_policy="skip_elements"`` (Tensorwise, Rowwise,
Block, Delayed) takes TE's NaN-skipping amax; the default ``"propagate"`` lets a NaN
element make its amax NaN, so the fallback shows it.

Formats and recipes (references in the docstrings):
``Tensorwise``, ``Rowwise``, ``Delayed`` (+ ``DelayedScaler``, in ``_delayed``),
``Block`` (1x128 / 128x128, DeepSeek-V3), ``MX`` (32-element blocks, E8M0 scales;
floor, ceil, even, rceil), ``NVFP4`` (16-element e2m1 blocks, e4m3 block scales, fp32
tensor scale, in ``_nvfp4``), ``EMAScaler`` (the lessons' (docs/lessons.md) dynamic
scaler, with a real FP8 cast). The shared pieces (amax, scale, result) are in ``_core``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from floatguard.emulation._core import (
    FLT_MAX,
    FLT_MIN,
    NanPolicy,
    QuantResult,
    TensorRecipe,
    _amax_and_skipped,
    _blocks_last,
    _check_nan_policy,
    _no_skips,
    amax_to_scale,
    amax_to_scale_and_fallbacks,
    tensor_to_amax,
)
from floatguard.emulation._delayed import AmaxAlgo as AmaxAlgo
from floatguard.emulation._delayed import Delayed, DelayedScaler
from floatguard.emulation._nvfp4 import NVFP4
from floatguard.emulation._nvfp4 import NVFP4Rounding as NVFP4Rounding
from floatguard.formats.registry import Format, get
from floatguard.formats.rounding import quantize

__all__ = [
    "MX",
    "NVFP4",
    "Block",
    "Delayed",
    "DelayedScaler",
    "EMAScaler",
    "NanPolicy",
    "QuantResult",
    "Rowwise",
    "TensorRecipe",
    "Tensorwise",
    "amax_to_scale",
    "amax_to_scale_and_fallbacks",
    "quant_metrics",
    "tensor_to_amax",
]

MXScaleMode = Literal["floor", "ceil", "even", "rceil"]
BlockScale = Literal["fp32", "pow2"]
ScaleStorage = Literal["encode", "decode_mul", "decode_div"]


def _fq(x: torch.Tensor, scale: torch.Tensor, fmt: Format) -> torch.Tensor:
    """quantize(x * scale) / scale in float32 (saturating: values past max clamp)."""
    xs = x.to(torch.float32) * scale
    q = quantize(xs, fmt, overflow="saturate")
    return q / scale


def _decode_scale(
    amax: torch.Tensor, fmt: Format, *, eps: float, power_of_two: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The *decode* scale ``sf = max(amax, eps) / fmt.max`` (float32, one rounding, as
    DeepSeek-V3's and DeepGEMM's casts compute it), and a mask of those that fell back.

    ``power_of_two``: UE8M0 scales, ``2**ceil(log2(sf))`` with the exponent taken exactly
    from the bits, as DeepGEMM's current ``ceil_to_ue8m0`` does (``deep_gemm/utils/
    math.py``: the exponent field, plus one where the mantissa is not 0, clamped to
    [1, 254]); DeepGEMM before April 2026 and DeepSeek-V3's ``act_quant``
    (``inference/kernel.py``) take ``ceil(log2(sf))`` in float32, which can land on the
    integer just above a power of two. An amax of 0 (with
    ``eps=0``) or non-finite falls back to 1.0; an ``sf`` below float32's smallest normal
    (whose reciprocal would overflow; the references give inf there) is raised to it and
    counted as a fallback.
    """
    a = amax.to(torch.float32)
    denom = torch.clamp(a, min=eps) if eps > 0 else a
    sf = (denom.to(torch.float64) / fmt.max).to(torch.float32)  # == denom / fmt.max in fp32
    if power_of_two:
        m, e = torch.frexp(sf)  # sf = m * 2**e, m in [0.5, 1): ceil(log2 sf) = e - (m == 0.5)
        sf = torch.ldexp(torch.ones_like(sf), torch.where(m == 0.5, e - 1, e))
    usable = torch.isfinite(a) & (denom > 0)
    tiny = usable & (sf < FLT_MIN)
    sf = torch.where(tiny, torch.full_like(sf, FLT_MIN), sf)
    sf = torch.where(usable, sf, torch.ones_like(sf))
    return sf, ~usable | tiny


def _scaled_quantize(
    x: torch.Tensor,
    amax: torch.Tensor,
    fmt: Format,
    *,
    eps: float,
    power_of_two: bool,
    storage: ScaleStorage,
    value_for_inf: float = FLT_MAX,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fake-quantize x (float32) with scales from ``amax`` (broadcastable to x), in the
    ``storage`` convention; returns (values, the scales as stored, fallback mask).

    - ``"encode"`` (Transformer Engine, torchao): ``s = fmt.max / amax``,
      ``quantize(x * s) / s``; the stored scale is s (``value_for_inf`` where the
      quotient overflows).
    - ``"decode_mul"`` (DeepGEMM's ``per_token_cast_to_fp8`` / ``per_block_cast_to_fp8``):
      ``sf = amax / fmt.max``, ``quantize(x * (1 / sf)) * sf``; the stored scale is sf.
    - ``"decode_div"`` (DeepSeek-V3's inference ``act_quant``): ``quantize(x / sf) * sf``.
    """
    if storage == "encode":
        s, fell = amax_to_scale_and_fallbacks(
            amax, fmt, eps=eps, power_of_two=power_of_two, value_for_inf=value_for_inf
        )
        return _fq(x, s, fmt), s, fell
    sf, fell = _decode_scale(amax, fmt, eps=eps, power_of_two=power_of_two)
    xf = x.to(torch.float32)
    xs = xf * (1.0 / sf) if storage == "decode_mul" else xf / sf
    return quantize(xs, fmt, overflow="saturate") * sf, sf, fell


def _check_storage(owner: str, storage: object, eps: object) -> None:
    if storage not in get_args(ScaleStorage):
        raise ValueError(
            f"{owner}.storage={storage!r}; use one of {', '.join(get_args(ScaleStorage))}"
        )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{owner}.eps={eps!r} must be a number >= 0 (DeepSeek uses 1e-4)")


def quant_metrics(
    x: torch.Tensor,
    q: torch.Tensor,
    fmt: str | Format | None = None,
    *,
    scale: torch.Tensor | float | None = None,
) -> dict[str, float]:
    """SQNR (dB), relative error and the overflow / underflow / subnormal shares (%) of a
    quantization ``x -> q`` (over the finite elements of x).

    Underflow counts non-zero values that came back as zero. Overflow and subnormal
    shares need the format, and are measured where the format sees the values: on
    ``x * scale`` and ``q * scale`` when a ``scale`` broadcastable to x is given (the
    scales of :class:`Tensorwise` and :class:`Rowwise`), else on x and q themselves.
    Reads the result on the host.
    """
    xf, qf = x.detach().double(), q.detach().double()
    if scale is not None:
        sc = torch.as_tensor(scale, dtype=torch.float64, device=xf.device)
        xs, qs = xf * sc, qf * sc
    else:
        xs, qs = xf, qf
    finite = torch.isfinite(xf)
    xf, qf, xs, qs = xf[finite], qf[finite], xs[finite], qs[finite]
    noise = ((xf - qf) ** 2).sum()
    signal = (xf**2).sum()
    sqnr = float(10 * torch.log10(signal / noise)) if float(noise) > 0 else math.inf
    n = max(xf.numel(), 1)
    out = {
        "sqnr_db": sqnr,
        "rel_error": float(torch.sqrt(noise / signal)) if float(signal) > 0 else 0.0,
        "underflow_pct": 100.0 * float(((xf != 0) & (qf == 0)).sum()) / n,
        "overflow_pct": 0.0,
        "subnormal_pct": 0.0,
    }
    if fmt is not None:
        f = get(fmt)
        out["overflow_pct"] = 100.0 * float((xs.abs() > f.max).sum()) / n
        out["subnormal_pct"] = 100.0 * float(((qs != 0) & (qs.abs() < f.tiny)).sum()) / n
    return out


@dataclass(frozen=True)
class Tensorwise(TensorRecipe):
    """One scale for the whole tensor from its current amax (TE Float8CurrentScaling,
    torchao tensorwise). A quotient that overflows float32 gets FLT_MAX, whatever the
    input dtype (TE's ``compute_scale_from_amax_kernel`` passes FLT_MAX).

    ``nan_policy``: ``"propagate"`` (default): a NaN element makes the amax NaN and the
    scale falls back to 1.0, counted; ``"skip_elements"``: TE's amax, which skips NaN
    elements (``fmaxf``), counted in ``QuantResult.nan_skipped``. NaN elements come back
    NaN either way."""

    fmt: str = "e4m3fn"
    power_of_two: bool = False
    eps: float = 0.0
    storage: ScaleStorage = "encode"
    nan_policy: NanPolicy = "propagate"

    def __post_init__(self) -> None:
        get(self.fmt)
        _check_storage("Tensorwise", self.storage, self.eps)
        _check_nan_policy("Tensorwise", self.nan_policy)

    def __call__(self, x: torch.Tensor) -> QuantResult:
        return self.with_amax(x, *self.amax(x))

    def amax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x's amax under this recipe's ``nan_policy`` (0-dim) and the NaN elements skipped."""
        return _amax_and_skipped(x, None, self.nan_policy)

    def with_amax(
        self, x: torch.Tensor, amax: torch.Tensor, skipped: torch.Tensor | None = None
    ) -> QuantResult:
        """x quantized with the scale of ``amax`` (e.g. the amax of the whole tensor after a
        MAX all-reduce over the ranks holding its shards, Transformer Engine's amax
        reduction)."""
        f = get(self.fmt)
        q, scale, fell = _scaled_quantize(
            x, amax, f, eps=self.eps, power_of_two=self.power_of_two, storage=self.storage
        )
        nan = _no_skips(x) if skipped is None else skipped
        return QuantResult(q.to(x.dtype), scale, fell.sum(), nan)


@dataclass(frozen=True)
class Rowwise(TensorRecipe):
    """One scale per slice along ``axis`` (torchao rowwise: per row of activations, per
    output channel of weights). ``nan_policy`` as :class:`Tensorwise`, per slice."""

    fmt: str = "e4m3fn"
    axis: int = -1
    power_of_two: bool = False
    eps: float = 0.0
    storage: ScaleStorage = "encode"
    nan_policy: NanPolicy = "propagate"

    def __post_init__(self) -> None:
        get(self.fmt)
        _check_storage("Rowwise", self.storage, self.eps)
        if isinstance(self.axis, bool) or not isinstance(self.axis, int):
            raise ValueError(f"Rowwise.axis={self.axis!r} must be an int")
        _check_nan_policy("Rowwise", self.nan_policy)

    def __call__(self, x: torch.Tensor) -> QuantResult:
        f = get(self.fmt)
        amax, skipped = _amax_and_skipped(x, self.axis, self.nan_policy)
        q, scale, fell = _scaled_quantize(
            x, amax, f, eps=self.eps, power_of_two=self.power_of_two, storage=self.storage
        )
        return QuantResult(q.to(x.dtype), scale, fell.sum(), skipped)


@dataclass(frozen=True)
class Block(TensorRecipe):
    """A scale per block of the last two dims: ``(1, 128)`` tiles for activations and
    gradients, ``(128, 128)`` blocks for weights (DeepSeek-V3; TE Float8BlockScaling).
    ``scale="fp32"`` keeps the exact ``fmt.max / amax``; ``"pow2"`` rounds it down to a
    power of two (with decode storage: ``amax / fmt.max`` rounded *up* to a power of two,
    UE8M0, as DeepGEMM). ``eps`` floors each block's amax (DeepSeek/DeepGEMM clamp to
    1e-4). ``storage``: ``"encode"`` (TE's convention, the default), ``"decode_mul"``
    (DeepGEMM: store ``sf = amax / 448``, cast ``x * (1 / sf)``) or ``"decode_div"``
    (DeepSeek-V3's ``act_quant``: ``x / sf``); the scales returned are the stored ones.
    Partial blocks at the edges are fine (zero padding does not change amax).

    With ``"encode"`` storage, a block whose quotient ``fmt.max / amax`` overflows float32
    gets TE's ``value_for_inf`` for block scaling, the *input* dtype's max
    (``compute_scale_from_types``, ``transformer_engine/common/recipe/
    recipe_common.cuh``): bf16's ``0x7f7f0000`` (3.3895e38) for bf16 inputs, FLT_MAX for
    float32 ones, fp16's 65504 for fp16 ones (never reached: fp16's smallest amax, 2**-24,
    gives a finite quotient); ``"pow2"`` masks it to ``2**127`` (``2**15`` for fp16).
    ``nan_policy`` as :class:`Tensorwise`, per block (TE's block casts skip NaN elements:
    ``"skip_elements"``)."""

    fmt: str = "e4m3fn"
    block: tuple[int, int] = (1, 128)
    scale: BlockScale = "fp32"
    eps: float = 0.0
    storage: ScaleStorage = "encode"
    nan_policy: NanPolicy = "propagate"

    def __post_init__(self) -> None:
        get(self.fmt)
        if len(self.block) != 2 or any(not isinstance(b, int) or b < 1 for b in self.block):
            raise ValueError(f"Block.block={self.block!r} must be two positive ints")
        if self.scale not in get_args(BlockScale):
            raise ValueError(f"Block.scale={self.scale!r}; use 'fp32' or 'pow2'")
        _check_storage("Block", self.storage, self.eps)
        _check_nan_policy("Block", self.nan_policy)

    @classmethod
    def deepgemm_activation(cls, ue8m0: bool = False) -> Block:
        """DeepGEMM's ``per_token_cast_to_fp8``: 1x128 e4m3 tiles, amax floored at 1e-4,
        decode scales ``amax / 448`` (UE8M0 powers of two with ``ue8m0``), ``x * (1/sf)``."""
        return cls("e4m3fn", (1, 128), "pow2" if ue8m0 else "fp32", 1e-4, "decode_mul")

    @classmethod
    def deepgemm_weight(cls, ue8m0: bool = False) -> Block:
        """DeepGEMM's ``per_block_cast_to_fp8``: 128x128 e4m3 blocks, as the activation."""
        return cls("e4m3fn", (128, 128), "pow2" if ue8m0 else "fp32", 1e-4, "decode_mul")

    @classmethod
    def deepseek_v3_activation(cls) -> Block:
        """1x128 tiles, e4m3, fp32 scales (activations and gradients)."""
        return cls("e4m3fn", (1, 128), "fp32")

    @classmethod
    def deepseek_v3_weight(cls) -> Block:
        """128x128 blocks, e4m3, fp32 scales (weights)."""
        return cls("e4m3fn", (128, 128), "fp32")

    def __call__(self, x: torch.Tensor, *, source: torch.dtype | None = None) -> QuantResult:
        """``source``: the dtype x had before it was widened (an emulated bf16 layer hands
        its operands over as float32): it picks ``value_for_inf``, as TE's kernel's
        input type does; None: x's dtype."""
        f = get(self.fmt)
        x2 = x.reshape(-1, x.shape[-1]) if x.dim() >= 2 else x.reshape(1, -1)
        rows, cols = x2.shape
        br, bc = self.block
        pr, pc = (-rows) % br, (-cols) % bc
        xp = torch.nn.functional.pad(x2.float(), (0, pc, 0, pr))
        blocks = xp.reshape((rows + pr) // br, br, (cols + pc) // bc, bc)
        amax, skipped = _amax_and_skipped(blocks, (1, 3), self.nan_policy)
        q, s, fell = _scaled_quantize(
            blocks, amax, f, eps=self.eps, power_of_two=self.scale == "pow2",
            storage=self.storage, value_for_inf=_value_for_inf(source or x.dtype),
        )  # fmt: skip
        q = q.reshape(rows + pr, cols + pc)
        q = q[:rows, :cols].reshape(x.shape).to(x.dtype)
        return QuantResult(q, s.reshape(amax.shape[0], amax.shape[2]), fell.sum(), skipped)


def _value_for_inf(dtype: torch.dtype) -> float:
    """TE's ``TypeInfo<IType>::max_finite_value``: the input dtype's max (bf16, fp16), else
    FLT_MAX (float32; TE takes no float64 input, floatguard treats it as float32)."""
    if dtype in (torch.bfloat16, torch.float16):
        return float(torch.finfo(dtype).max)
    return FLT_MAX


@dataclass(frozen=True)
class MX(TensorRecipe):
    """OCP Microscaling: blocks of ``block`` (32) elements along the last dim share an
    E8M0 scale ``2**X``; elements are ``x / 2**X`` in ``element`` format (saturating).

    ``scale_mode`` picks X from the block amax (the OCP spec and torchao's modes):
    ``"floor"``: ``floor(log2 amax) - emax_elem`` (OCP; amax may land above the
    element max and saturate); ``"ceil"``: one more whenever amax is not a power of
    two; ``"even"``: amax rounded to the element's mantissa width first, then floor;
    ``"rceil"``: ``ceil(log2(amax / elem_max))`` (NVIDIA's: never saturates).
    ``emax_elem = floor(log2(element max))``. X is clamped to E8M0's [-127, 127]; an
    all-zero block gets X = -127 (zeros stay zeros), a NaN block a NaN scale.
    """

    element: str = "e4m3fn"
    block: int = 32
    scale_mode: MXScaleMode = "floor"

    def __post_init__(self) -> None:
        if get(self.element).name not in ("e4m3fn", "e5m2", "e2m3fn", "e3m2fn", "e2m1fn"):
            raise ValueError(
                f"MX.element={self.element!r}; MX elements are e4m3fn, e5m2, e2m3fn, e3m2fn, e2m1fn"
            )
        if not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"MX.block={self.block!r} must be a positive int")
        if self.scale_mode not in get_args(MXScaleMode):
            raise ValueError(f"MX.scale_mode={self.scale_mode!r}; use floor, ceil, even or rceil")

    def exponents(self, amax: torch.Tensor) -> torch.Tensor:
        """The unbiased shared exponent X per block amax (float32 tensor; NaN for NaN)."""
        f = get(self.element)
        emax_elem = math.floor(math.log2(f.max))
        a = amax.to(torch.float32)
        if self.scale_mode == "rceil":
            # ceil(log2(amax / elem_max)) exactly: frexp gives r = m * 2**e, m in [0.5, 1);
            # log2 in float32 would lose the fraction just above a power of two. The
            # quotient in float64: in float32 it underflows to 0 for a tiny amax (whose
            # exponent is then clamped to -127, not taken as 0).
            m, e = torch.frexp(a.to(torch.float64) / f.max)
            x = torch.where(m == 0.5, e - 1, e).to(torch.float32)
        elif self.scale_mode == "even":
            # Round amax half-up at the element's mantissa width, keep the exponent only
            # (a carry moves to the next power of two, as the OCP/torchao "even" mode).
            bits = a.view(torch.int32) + (1 << (22 - f.mantissa_bits))
            pow2 = ((bits >> 23) & 0xFF).to(torch.float32) - 127
            x = pow2 - emax_elem
        else:
            m, e = torch.frexp(a)
            floor_log2 = (e - 1).to(torch.float32)
            if self.scale_mode == "ceil":
                floor_log2 = floor_log2 + (m != 0.5).to(torch.float32)
            x = floor_log2 - emax_elem
        x = torch.where(a > 0, x, torch.full_like(x, -127.0))
        x = torch.clamp(x, -127.0, 127.0)
        # A block holding inf or NaN: E8M0 has only a NaN code for it (OCP MX v1.0,
        # section 5.4.1), and the whole block decodes to NaN. The NaN is made from the
        # non-finite amax itself (a - a), not a NaN fill: a fill would be a NaN born here
        # on every call, and floatguard's own watch would blame the quantizer.
        return torch.where(torch.isfinite(a), x, (a - a).to(x.dtype))

    def __call__(self, x: torch.Tensor) -> QuantResult:
        f = get(self.element)
        blocks, pad = _blocks_last(x.float(), self.block)
        amax = tensor_to_amax(blocks, -1, keepdim=True)
        scale = torch.exp2(self.exponents(amax))  # the E8M0 scale value 2**X
        q = quantize(blocks / scale, f, overflow="saturate") * scale
        q = q.reshape(*q.shape[:-2], -1)
        if pad:
            q = q[..., : x.shape[-1]]
        fell = (amax == 0) | ~torch.isfinite(amax)
        values = q.reshape(x.shape).to(x.dtype)
        return QuantResult(values, scale.squeeze(-1), fell.sum(), _no_skips(x))


@dataclass
class EMAScaler:
    """The lessons' dynamic FP8 scaler, repaired: an EMA of the amax (``smoothing``) with a
    ``margin`` of headroom, and a real cast to ``fmt`` (the lesson rounded through int8,
    which is not what an FP8 format stores)."""

    fmt: str = "e4m3fn"
    margin: int = 0
    smoothing: float = 0.9
    amax_ema: torch.Tensor | None = None

    def __post_init__(self) -> None:
        get(self.fmt)
        if not 0 <= self.smoothing < 1:
            raise ValueError(f"EMAScaler.smoothing={self.smoothing!r} must be in [0, 1)")

    def __call__(self, x: torch.Tensor) -> QuantResult:
        f = get(self.fmt)
        amax = tensor_to_amax(x)
        ok = torch.isfinite(amax)
        if self.amax_ema is None:
            self.amax_ema = torch.where(ok, amax, torch.zeros_like(amax))
        else:
            new = self.smoothing * self.amax_ema + (1 - self.smoothing) * amax
            self.amax_ema = torch.where(ok, new, self.amax_ema)
        scale, fell = amax_to_scale_and_fallbacks(self.amax_ema, f, margin=self.margin)
        return QuantResult(_fq(x, scale, f).to(x.dtype), scale, fell.sum(), _no_skips(x))

    def state_dict(self) -> dict[str, Any]:
        """The EMA of the amax (None before the first call), like DelayedScaler's."""
        ema = None if self.amax_ema is None else self.amax_ema.clone()
        return {
            "fmt": self.fmt,
            "margin": self.margin,
            "smoothing": self.smoothing,
            "amax_ema": ema,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        fresh = EMAScaler(sd["fmt"], int(sd["margin"]), float(sd["smoothing"]))
        self.fmt, self.margin, self.smoothing = fresh.fmt, fresh.margin, fresh.smoothing
        ema = sd["amax_ema"]
        self.amax_ema = None if ema is None else torch.as_tensor(ema, dtype=torch.float32).clone()


def __getattr__(name: str) -> Any:
    if name == "Recipe":  # the old name, easily confused with EmulationRecipe
        import warnings

        warnings.warn(
            "floatguard.scaling.Recipe is now TensorRecipe (how one tensor is quantized; "
            "EmulationRecipe picks one per GEMM operand)",
            DeprecationWarning,
            stacklevel=2,
        )
        return TensorRecipe
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
