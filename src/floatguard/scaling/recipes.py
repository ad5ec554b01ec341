"""Low-precision scaling recipes: how a tensor is scaled into a format's window, then quantized.

Convention (Transformer Engine's): a *scale* ``s`` multiplies values into the
format's range, ``q = quantize(x * s) / s``. Every recipe returns the fake-quantized
tensor (values the low-precision format would give back, in x's dtype) and the
scales it used.

One policy for a degenerate amax, in every recipe: a scale is never NaN or inf.
An amax of 0 (an all-zero tensor or block) or a non-finite amax gives scale 1.0
(current scaling) or keeps the previous scale (delayed scaling); the number of
such fallbacks is reported (``fallbacks``) so the caller can record an event. The
references disagree here: Transformer Engine keeps the previous scale, torchao
clamps amax to 1e-12 (so an all-zero tensor gets a scale of 4.5e14, and an inf
amax a scale of 0, which turns inf into NaN), DeepSeek's reference kernel divides
by zero.

Formats and recipes (references in the docstrings):
``Tensorwise``, ``Rowwise``, ``Delayed`` (+ ``DelayedScaler``), ``Block``
(1x128 / 128x128, DeepSeek-V3), ``MX`` (32-element blocks, E8M0 scales; floor,
ceil, even, rceil), ``NVFP4`` (16-element e2m1 blocks, e4m3 block scales, fp32
tensor scale), ``EMAScaler`` (the lessons' (docs/lessons.md) dynamic scaler, with a real FP8 cast).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

from floatguard.formats.registry import Format, get
from floatguard.formats.rounding import quantize

__all__ = [
    "MX",
    "NVFP4",
    "Block",
    "Delayed",
    "DelayedScaler",
    "EMAScaler",
    "QuantResult",
    "Rowwise",
    "TensorRecipe",
    "Tensorwise",
    "amax_to_scale",
    "amax_to_scale_and_fallbacks",
    "quant_metrics",
    "tensor_to_amax",
]


@dataclass(frozen=True)
class QuantResult:
    """A fake-quantized tensor, the scales used (shape per recipe), and how many scales
    fell back because their amax was 0 or non-finite (a device int, no sync)."""

    values: torch.Tensor
    scales: torch.Tensor
    fallbacks: torch.Tensor


FLT_MAX = float.fromhex("0x1.fffffep127")  # float32's largest value, ~3.4028e38
FLT_MIN = 2.0**-126  # float32's smallest normal
MXScaleMode = Literal["floor", "ceil", "even", "rceil"]
AmaxAlgo = Literal["max", "most_recent"]
BlockScale = Literal["fp32", "pow2"]
ScaleStorage = Literal["encode", "decode_mul", "decode_div"]


def amax_to_scale(
    amax: torch.Tensor,
    fmt: str | Format,
    *,
    margin: float = 0,
    eps: float = 0.0,
    power_of_two: bool = False,
    fallback: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """``fmt.max / max(amax, eps) / 2**margin`` as float32, or ``fallback`` where amax is 0
    (with ``eps=0``) or not finite. See :func:`amax_to_scale_and_fallbacks`."""
    return amax_to_scale_and_fallbacks(
        amax, fmt, margin=margin, eps=eps, power_of_two=power_of_two, fallback=fallback
    )[0]


def amax_to_scale_and_fallbacks(
    amax: torch.Tensor,
    fmt: str | Format,
    *,
    margin: float = 0,
    eps: float = 0.0,
    power_of_two: bool = False,
    fallback: torch.Tensor | float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales for ``amax``, and a bool mask of those that fell back.

    - The scale is ``fmt.max / max(amax, eps) / 2**margin`` rounded *once* to float32
      (the correctly rounded quotient, as Transformer Engine's ``__fdiv_rn``): the
      division runs in float64 and is rounded to float32, which is exact rounding for
      a quotient of float32 values (53 >= 2 * 24 + 2 bits; Figueroa, "When is double
      rounding innocuous?", 1995). torch's ``scalar / tensor`` is
      ``reciprocal(amax) * max``, two roundings, 1 ulp off for ~38% of amaxes.
    - ``power_of_two``: the largest power of two ``s`` with ``amax * s <= fmt.max /
      2**margin``, from the exponent bits (``frexp``), never through a float32 ``log2``.
    - A tiny but finite amax whose quotient overflows float32 gets ``FLT_MAX`` (TE's
      ``value_for_inf``; ``2**127`` for powers of two), so its values are kept rather
      than flushed by a scale of 1; it counts as a fallback.
    - ``eps=0`` is Transformer Engine's formula (amax 0 falls back), ``eps=1e-12``
      torchao's (amax 0 gives ``fmt.max / 1e-12``). Non-finite amax falls back.

    Float32 scales on amax's device, no sync.
    """
    f = get(fmt)
    a = amax.to(torch.float32)
    denom = torch.clamp(a, min=eps) if eps > 0 else a
    d64 = denom.to(torch.float64)
    q = f.max / d64 / (2.0**margin)  # exact in float64 up to one rounding
    usable = torch.isfinite(a) & (d64 > 0)
    if power_of_two:
        _, e = torch.frexp(q)  # q = m * 2**e, m in [0.5, 1): 2**(e - 1) <= q
        s = torch.ldexp(torch.ones_like(q), e - 1)
        # q was rounded: where it rounded up onto a power of two, amax * s is past max.
        s = torch.where(d64 * s * (2.0**margin) > f.max, s * 0.5, s)
        big = s > 2.0**127
        scale = torch.where(big, torch.full_like(s, 2.0**127), s).to(torch.float32)
        overflow = big
    else:
        overflow = q > FLT_MAX
        scale = torch.where(overflow, torch.full_like(q, FLT_MAX), q).to(torch.float32)
    fb = torch.as_tensor(fallback, dtype=torch.float32, device=a.device)
    scale = torch.where(usable, scale, fb)
    return scale, ~usable | (usable & overflow)


def tensor_to_amax(
    x: torch.Tensor, dim: int | tuple[int, ...] | None = None, *, keepdim: bool = False
) -> torch.Tensor:
    """``max |x|`` in float32, over ``dim`` (all of x when None; 0 for an empty tensor).
    NaN propagates (a NaN amax is a fallback downstream). Detached, no sync. The one
    amax expression of every recipe (torchao's ``tensor_to_amax``)."""
    a = x.detach().abs()
    if dim is None:
        return a.amax().float() if x.numel() else torch.zeros((), device=x.device)
    return a.amax(dim=dim, keepdim=keepdim).float()


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
    from the bits (DeepGEMM's ``ceil_to_ue8m0`` goes through a float32 ``log2``, which
    can land on the integer just above a power of two; we never do). An amax of 0 (with
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fake-quantize x (float32) with scales from ``amax`` (broadcastable to x), in the
    ``storage`` convention; returns (values, the scales as stored, fallback mask).

    - ``"encode"`` (Transformer Engine, torchao): ``s = fmt.max / amax``,
      ``quantize(x * s) / s``; the stored scale is s.
    - ``"decode_mul"`` (DeepGEMM's ``per_token_cast_to_fp8`` / ``per_block_cast_to_fp8``):
      ``sf = amax / fmt.max``, ``quantize(x * (1 / sf)) * sf``; the stored scale is sf.
    - ``"decode_div"`` (DeepSeek-V3's inference ``act_quant``): ``quantize(x / sf) * sf``.
    """
    if storage == "encode":
        s, fell = amax_to_scale_and_fallbacks(amax, fmt, eps=eps, power_of_two=power_of_two)
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


def _blocks_last(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """View x's last dim as [..., nblocks, block] (zero-padded); returns the pad."""
    k = x.shape[-1]
    pad = (-k) % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, block), pad


class TensorRecipe:
    """How *one tensor* is scaled and quantized (Tensorwise, Rowwise, Block, MX, NVFP4):
    ``__call__(x) -> QuantResult``. Not to be confused with
    :class:`~floatguard.scaling.EmulationRecipe`, which picks a TensorRecipe for each
    operand of a GEMM (activation, weight, gradient). Called ``Recipe`` in 0.1.0;
    that name still works, with a DeprecationWarning."""

    def __call__(self, x: torch.Tensor) -> QuantResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Just the fake-quantized values, in x's dtype."""
        return self(x).values.to(x.dtype)


@dataclass(frozen=True)
class Tensorwise(TensorRecipe):
    """One scale for the whole tensor from its current amax (TE Float8CurrentScaling,
    torchao tensorwise)."""

    fmt: str = "e4m3fn"
    power_of_two: bool = False
    eps: float = 0.0
    storage: ScaleStorage = "encode"

    def __post_init__(self) -> None:
        get(self.fmt)
        _check_storage("Tensorwise", self.storage, self.eps)

    def __call__(self, x: torch.Tensor) -> QuantResult:
        f = get(self.fmt)
        amax = tensor_to_amax(x)
        q, scale, fell = _scaled_quantize(
            x, amax, f, eps=self.eps, power_of_two=self.power_of_two, storage=self.storage
        )
        return QuantResult(q.to(x.dtype), scale, fell.sum())


@dataclass(frozen=True)
class Rowwise(TensorRecipe):
    """One scale per slice along ``axis`` (torchao rowwise: per row of activations, per
    output channel of weights)."""

    fmt: str = "e4m3fn"
    axis: int = -1
    power_of_two: bool = False
    eps: float = 0.0
    storage: ScaleStorage = "encode"

    def __post_init__(self) -> None:
        get(self.fmt)
        _check_storage("Rowwise", self.storage, self.eps)
        if isinstance(self.axis, bool) or not isinstance(self.axis, int):
            raise ValueError(f"Rowwise.axis={self.axis!r} must be an int")

    def __call__(self, x: torch.Tensor) -> QuantResult:
        f = get(self.fmt)
        amax = tensor_to_amax(x, self.axis, keepdim=True)
        q, scale, fell = _scaled_quantize(
            x, amax, f, eps=self.eps, power_of_two=self.power_of_two, storage=self.storage
        )
        return QuantResult(q.to(x.dtype), scale, fell.sum())


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
    Partial blocks at the edges are fine (zero padding does not change amax)."""

    fmt: str = "e4m3fn"
    block: tuple[int, int] = (1, 128)
    scale: BlockScale = "fp32"
    eps: float = 0.0
    storage: ScaleStorage = "encode"

    def __post_init__(self) -> None:
        get(self.fmt)
        if len(self.block) != 2 or any(not isinstance(b, int) or b < 1 for b in self.block):
            raise ValueError(f"Block.block={self.block!r} must be two positive ints")
        if self.scale not in get_args(BlockScale):
            raise ValueError(f"Block.scale={self.scale!r}; use 'fp32' or 'pow2'")
        _check_storage("Block", self.storage, self.eps)

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

    def __call__(self, x: torch.Tensor) -> QuantResult:
        f = get(self.fmt)
        x2 = x.reshape(-1, x.shape[-1]) if x.dim() >= 2 else x.reshape(1, -1)
        rows, cols = x2.shape
        br, bc = self.block
        pr, pc = (-rows) % br, (-cols) % bc
        xp = torch.nn.functional.pad(x2.float(), (0, pc, 0, pr))
        blocks = xp.reshape((rows + pr) // br, br, (cols + pc) // bc, bc)
        amax = tensor_to_amax(blocks, (1, 3), keepdim=True)
        q, s, fell = _scaled_quantize(
            blocks, amax, f, eps=self.eps, power_of_two=self.scale == "pow2",
            storage=self.storage,
        )  # fmt: skip
        q = q.reshape(rows + pr, cols + pc)
        q = q[:rows, :cols].reshape(x.shape).to(x.dtype)
        return QuantResult(q, s.reshape(amax.shape[0], amax.shape[2]), fell.sum())


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
        # section 5.4.1), and the whole block decodes to NaN.
        return torch.where(torch.isfinite(a), x, torch.full_like(x, math.nan))

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
        return QuantResult(q.reshape(x.shape).to(x.dtype), scale.squeeze(-1), fell.sum())


NVFP4Rounding = Literal["nearest", "stochastic"]


@dataclass(frozen=True)
class NVFP4(TensorRecipe):
    """NVIDIA NVFP4: 16-element blocks of e2m1, each with an e4m3 scale, under one fp32
    per-tensor scale. Encode scale ``S = (6 * 448) / amax_tensor``; a block's decode scale
    ``amax_block / 6`` is stored as ``e4m3(amax_block / 6 * S)``; elements are
    ``e2m1(x * S / stored)``; values come back as ``q * stored / S``.

    ``two_d``: square ``block x block`` tiles over the last two dims (a 2-D weight's
    16x16 tiles, as NVIDIA's NVFP4 training recipe scales weights so that W and W^T
    quantize alike); otherwise 1 x ``block`` along the last dim (activations, gradients).
    ``rounding="stochastic"``: the e2m1 elements round stochastically (unbiased: the
    recipe's choice for gradients); the scales still round to nearest. The draws come
    from torch's default generator (seed it with ``torch.manual_seed``)."""

    block: int = 16
    two_d: bool = False
    rounding: NVFP4Rounding = "nearest"

    def __post_init__(self) -> None:
        if not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"NVFP4.block={self.block!r} must be a positive int")
        if self.rounding not in get_args(NVFP4Rounding):
            raise ValueError(f"NVFP4.rounding={self.rounding!r}; use 'nearest' or 'stochastic'")

    def _tiles(self, xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(tiles, per-tile amax broadcastable to tiles, a function back to x's shape)."""
        if not self.two_d:
            blocks, _ = _blocks_last(xf, self.block)
            cols = xf.shape[-1]

            def back_1d(q: torch.Tensor) -> torch.Tensor:
                return q.reshape(*q.shape[:-2], -1)[..., :cols].reshape(xf.shape)

            return blocks, tensor_to_amax(blocks, -1, keepdim=True), back_1d
        x2 = xf.reshape(-1, xf.shape[-1]) if xf.dim() >= 2 else xf.reshape(1, -1)
        rows, cols = x2.shape
        b = self.block
        pr, pc = (-rows) % b, (-cols) % b
        xp = torch.nn.functional.pad(x2, (0, pc, 0, pr))
        tiles = xp.reshape((rows + pr) // b, b, (cols + pc) // b, b)

        def back_2d(q: torch.Tensor) -> torch.Tensor:
            return q.reshape(rows + pr, cols + pc)[:rows, :cols].reshape(xf.shape)

        return tiles, tensor_to_amax(tiles, (1, 3), keepdim=True), back_2d

    def __call__(self, x: torch.Tensor) -> QuantResult:
        e2m1, e4m3 = get("e2m1fn"), get("e4m3fn")
        xf = x.float()
        amax_t = tensor_to_amax(xf)
        # One correctly rounded quotient (float64, rounded once to float32); a tiny amax
        # whose quotient overflows float32 gets FLT_MAX, never inf (which would turn the
        # whole tensor into zeros).
        q64 = (e2m1.max * e4m3.max) / amax_t.to(torch.float64)
        ok = torch.isfinite(amax_t) & (amax_t > 0)
        s_enc = torch.where(
            ok, torch.clamp(q64, max=FLT_MAX).to(torch.float32), torch.ones_like(amax_t)
        )
        fell = ~ok | (ok & (q64 > FLT_MAX))
        tiles, amax_b, back = self._tiles(xf)
        stored = quantize(amax_b / e2m1.max * s_enc, e4m3, overflow="saturate")
        dec = stored / s_enc  # the block's decode scale in real units
        safe = torch.where(dec > 0, dec, torch.ones_like(dec))
        q = quantize(tiles / safe, e2m1, rounding=self.rounding, overflow="saturate") * safe
        q = torch.where(dec > 0, q, torch.zeros_like(q))
        values = back(q).to(x.dtype)
        # scales: the fp32 tensor scale, then every stored e4m3 block scale
        scales = torch.cat([s_enc.reshape(1), stored.reshape(-1)])
        return QuantResult(values, scales, fell.sum())


@dataclass(frozen=True)
class Delayed:
    """Delayed scaling (TE DelayedScaling): the scale for this step comes from the amax
    history of previous steps, ``fmt.max / amax_h / 2**margin`` with ``amax_h`` the max
    (``algo="max"``) or the most recent entry of the last ``history_len`` amaxes.

    ``margin`` may be fractional (``2**0.5`` of headroom). ``skip_nonfinite``: the history
    maximum ignores NaN/inf entries (TE's NaN-skipping reduction), so one bad step does
    not freeze the scale for ``history_len`` steps; by default a non-finite maximum keeps
    the previous scale (TE's plain rule), counted as a fallback."""

    fmt: str = "e4m3fn"
    history_len: int = 16
    algo: AmaxAlgo = "max"
    margin: float = 0
    skip_nonfinite: bool = False

    def __post_init__(self) -> None:
        get(self.fmt)
        if not isinstance(self.history_len, int) or self.history_len < 1:
            raise ValueError(f"Delayed.history_len={self.history_len!r} must be an int >= 1")
        if self.algo not in get_args(AmaxAlgo):
            raise ValueError(f"Delayed.algo={self.algo!r}; use 'max' or 'most_recent'")
        if (
            isinstance(self.margin, bool)
            or not isinstance(self.margin, (int, float))
            or (not math.isfinite(self.margin))
        ):
            raise ValueError(f"Delayed.margin={self.margin!r} must be a finite number")

    def scaler(self) -> DelayedScaler:
        return DelayedScaler(self)


@dataclass
class DelayedScaler:
    """State of a :class:`Delayed` recipe: the amax history and the current scale (device).

    ``__call__(x)`` quantizes with the current scale, records x's amax, and computes
    the next scale; an amax of 0 or non-finite keeps the previous scale (TE's rule).
    """

    recipe: Delayed
    history: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    steps: int = field(default=0)

    def __call__(self, x: torch.Tensor) -> QuantResult:
        f = get(self.recipe.fmt)
        if self.history is None or self.scale is None:
            self.history = torch.zeros(self.recipe.history_len, device=x.device)
            self.scale = torch.ones((), device=x.device)
        values = _fq(x, self.scale, f).to(x.dtype)
        used = self.scale.clone()
        amax = tensor_to_amax(x)
        self.history = torch.roll(self.history, 1)
        self.history[0] = amax
        self.steps += 1
        h = self.history
        if self.recipe.skip_nonfinite:  # the largest finite entry (0 when none: falls back)
            h = torch.where(torch.isfinite(h), h, torch.zeros_like(h))
        amax_h = h.amax() if self.recipe.algo == "max" else h[0]
        self.scale, fell = amax_to_scale_and_fallbacks(
            amax_h, f, margin=self.recipe.margin, fallback=self.scale
        )
        return QuantResult(values, used, fell.sum())

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": None if self.history is None else self.history.clone(),
            "scale": None if self.scale is None else self.scale.clone(),
            "steps": self.steps,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.history, self.scale, self.steps = sd["history"], sd["scale"], int(sd["steps"])


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
        return QuantResult(_fq(x, scale, f).to(x.dtype), scale, fell.sum())

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
