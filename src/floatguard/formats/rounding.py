"""Fake quantization: the exact values a format would store, in the input's dtype.

How it computes (all exact, no lookup tables, no host sync):

* Inputs are read in a *working* dtype: float32 for float16/bfloat16/float32
  inputs (every half value is exact in float32), float64 for float64 inputs, so
  a float64 value is rounded once, directly to the target (no double rounding
  through float32).
* Round to nearest, ties to even, uses one of two branch-free tricks:

  - *magic add*: with ``c = copysign(2**(e + W - m), x)`` where ``e`` is x's
    binary exponent clamped to the target's normal range and ``W`` the working
    mantissa width, the hardware addition ``x + c`` rounds x to a multiple of
    the target's quantum ``2**(e - m)`` (ties to even), and ``- c`` is exact.
    Clamping ``e`` from below gives the target's fixed subnormal quantum.
  - *integer RNE* for targets that share the working exponent range (bf16 and
    tf32 from float32): add ``half - 1 + lsb`` to the bit pattern and mask.

* Every other mode scales by the per-element quantum ``q`` (a power of two, so
  ``x / q`` is exact), rounds the integer part (``trunc``, ``ceil``, ``floor``,
  or stochastically), and scales back.
* Overflow, flush-to-zero, the fnuz single zero and the unsigned e8m0 rules are
  applied afterwards, from the rounded value.

On CPU the work runs over cache-sized blocks so the handful of elementwise
passes stay in L2; on other devices it runs on the whole tensor at once.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from floatguard.formats.registry import FORMATS as _REGISTRY
from floatguard.formats.registry import Format, get

__all__ = ["Overflow", "Rounding", "Subnormals", "quantize"]

Rounding = Literal["nearest", "stochastic", "toward_zero", "ceil", "floor"]
Overflow = Literal["saturate", "nonsaturate"]
Subnormals = Literal["keep", "flush"]

_ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic", "toward_zero", "ceil", "floor")
_OVERFLOWS: tuple[str, ...] = ("saturate", "nonsaturate")
_SUBNORMALS: tuple[str, ...] = ("keep", "flush")
_INPUT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

# Block size for CPU processing: 2**18 float32 elements = 1 MiB, which keeps the
# ~7 elementwise passes of one block inside L2 (measured fastest on 2 cores).
_CPU_BLOCK = 1 << 18


class _Working:
    """Bit layout of the dtype the arithmetic runs in (float32 or float64)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        if dtype == torch.float32:
            self.int_dtype, self.W, self.E = torch.int32, 23, 8
        else:
            self.int_dtype, self.W, self.E = torch.int64, 52, 11
        self.bias = (1 << (self.E - 1)) - 1
        self.emin = 1 - self.bias  # smallest normal exponent
        self.emax = self.bias  # largest finite exponent
        self.field_mask = (1 << self.E) - 1
        self.exp_mask = self.field_mask << self.W


def _working_for(dtype: torch.dtype) -> _Working:
    return _Working(torch.float64 if dtype == torch.float64 else torch.float32)


def _pow2_bits(e: torch.Tensor, w: _Working) -> torch.Tensor:
    """``2**e`` for an integer tensor ``e`` with ``e >= w.emin`` (normal powers of two)."""
    return ((e + w.bias).to(w.int_dtype) << w.W).view(w.dtype)


def _quantum(x: torch.Tensor, fmt: Format, w: _Working) -> torch.Tensor:
    """Per-element spacing of ``fmt`` at ``x``: ``2**(clamp(e(x), emin, emax) - m)``.

    Exact for every input, including working-dtype subnormals, zero, inf and NaN
    (the last three get the spacing at the clamp bounds, which is harmless).
    """
    m = fmt.mantissa_bits
    # Exponent field straight from the bits: floor(log2|x|) + bias for normal x,
    # 0 for zero and working subnormals (whose true exponent is below emin of every
    # format we compute in this working dtype, or equal to it for bf16/tf32).
    field = (x.view(w.int_dtype) >> w.W) & w.field_mask
    e = field - w.bias
    if fmt.emin < w.emin:
        # Only reachable for e8m0-style formats whose smallest value is below the
        # working normal range; x's true exponent must come from frexp then.
        _, fe = torch.frexp(x)
        e = torch.where(field == 0, fe.to(e.dtype) - 1, e)
    e = e.clamp_(fmt.emin, fmt.emax) - m
    if fmt.emin - m >= w.emin:
        return _pow2_bits(e, w)
    # Subnormal spacings (fp32 from fp64 inputs, tf32, bf16, e8m0): build 2**(e + W)
    # as a normal number, then scale down exactly by 2**-W.
    big = _pow2_bits(e.clamp(min=w.emin - w.W) + w.W, w)
    return torch.where(e < w.emin, big * math.ldexp(1.0, -w.W), _pow2_bits(e.clamp(min=w.emin), w))


def _magic_ok(fmt: Format, w: _Working) -> bool:
    """Whether the magic-add rounding applies: ``c`` stays finite and normal."""
    m = fmt.mantissa_bits
    fits = fmt.emax + w.W - m <= w.emax and fmt.emin + w.W - m >= w.emin
    return fmt.has_zero and m < w.W and fits


def _magic_constant(a: torch.Tensor, fmt: Format, w: _Working) -> torch.Tensor:
    """``c = 2**(clamp(e(a), emin, emax) + W - m)``: adding it rounds ``a`` to fmt's grid."""
    bits = a.view(w.int_dtype) & w.exp_mask
    bits.clamp_((fmt.emin + w.bias) << w.W, (fmt.emax + w.bias) << w.W)
    bits += (w.W - fmt.mantissa_bits) << w.W
    return bits.view(w.dtype)


def _round_magic(a: torch.Tensor, fmt: Format, w: _Working) -> torch.Tensor:
    """Round ``a >= 0`` to nearest even via ``(a + c) - c``."""
    c = _magic_constant(a, fmt, w)
    r = a + c
    r -= c
    return r


def _first_overflow(fmt: Format) -> float:
    """The grid value right after ``max`` (what rounding reaches first when it overflows)."""
    return fmt.max + (fmt.max if fmt.mantissa_bits == 0 else fmt.ulp(fmt.max))


def _quantize_nearest_fast(
    xw: torch.Tensor, res: torch.Tensor, fmt: Format, w: _Working, overflow: str
) -> None:
    """The default case in 8 elementwise passes: nearest, keep subnormals, signed format.

    Works on the negated magnitude so that overflow is one ``threshold`` pass
    (``y <= t ? value : y``, which lets NaN through), then copies x's sign.
    """
    a = torch.abs(xw)
    c = _magic_constant(a, fmt, w)
    r = a + c
    torch.sub(c, r, out=r)  # r = -round(a), exact
    if overflow == "saturate" or fmt.special == "none":
        r.clamp_(min=-fmt.max)
    else:
        fill = -math.inf if fmt.has_inf else math.nan
        torch.nn.functional.threshold(r, -_first_overflow(fmt), fill, inplace=True)
    torch.copysign(r, xw, out=res)
    if not fmt.has_negative_zero:
        res += 0.0  # -0 + +0 = +0 under round-to-nearest: fnuz has one zero


def _round_int(a: torch.Tensor, fmt: Format, w: _Working) -> torch.Tensor:
    """Round ``a >= 0`` to nearest even on the bit pattern; target shares the working emin."""
    drop = w.W - fmt.mantissa_bits
    b = a.view(w.int_dtype)
    if drop == w.W:
        # No mantissa bits: the kept significand is the implied leading 1, always odd,
        # so a tie goes up (as the magic-add and scaled paths and float64 inputs do);
        # the bit above the cut is the exponent's, not a mantissa lsb.
        t = b + (1 << (drop - 1))
    else:
        t = (b >> drop) & 1
        t += (1 << (drop - 1)) - 1
        t += b
    t &= ~((1 << drop) - 1)
    r = t.view(w.dtype)
    # The carry can turn a NaN payload into inf or wrap it into the sign bit: put NaN back.
    return r.masked_fill_(torch.isnan(a), math.nan)


def _round_pow2(a: torch.Tensor, fmt: Format, w: _Working) -> torch.Tensor:
    """Nearest power of two for e8m0-style formats (no zero, no mantissa), ``a >= 0``.

    Adding half the mantissa range to the bit pattern and masking the mantissa
    rounds to the nearest power of two, ties up (the implied leading 1 is odd).
    Values below ``1.5 * tiny`` go to ``tiny``: for e8m0 in float32 that covers
    the float32 subnormals, whose bit pattern would otherwise round by bits.
    """
    b = a.view(w.int_dtype) + (1 << (w.W - 1))
    b &= w.exp_mask
    r = b.view(w.dtype)
    # NaN payloads can carry into the sign bit; the caller maps NaN inputs to NaN.
    return r.masked_fill_(a < 1.5 * fmt.tiny, fmt.tiny)


def _round_scaled(
    a: torch.Tensor,
    fmt: Format,
    w: _Working,
    rounding: str,
    up: torch.Tensor | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Any rounding mode on ``a >= 0``: ``round(a / q) * q`` with the per-element quantum ``q``.

    ``up`` marks the elements whose magnitude rounds up under ``ceil`` / ``floor``.
    """
    q = _quantum(a, fmt, w)
    s = a / q  # exact: q is a power of two and s < 2**(m + 1) for in-range values
    if rounding == "nearest":
        s = torch.round(s)  # half to even
    elif rounding == "toward_zero":
        s = torch.floor(s)
    elif rounding in ("ceil", "floor"):
        assert up is not None
        s = torch.where(up, torch.ceil(s), torch.floor(s))
    else:  # stochastic: floor(s) + Bernoulli(frac), so E[result] = s exactly
        lo = torch.floor(s)
        frac = s - lo  # exact (Sterbenz)
        # float64 draws resolve frac to 2**-53, far finer than any float32 frac.
        u = torch.rand(s.shape, generator=generator, device=s.device, dtype=torch.float64)
        # NaN and inf give a NaN frac, the comparison is False, and lo passes through.
        s = lo + (u < frac).to(s.dtype)
    return s * q


def _round(
    a: torch.Tensor,
    fmt: Format,
    w: _Working,
    rounding: str,
    up: torch.Tensor | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Round magnitudes ``a`` to ``fmt``'s grid, ignoring overflow and special rules."""
    m = fmt.mantissa_bits
    if m >= w.W and fmt.emin - m <= w.emin - w.W and fmt.emax >= w.emax:
        return a.clone()  # the format holds every working value
    if rounding == "nearest" and fmt.has_zero:
        if _magic_ok(fmt, w):
            return _round_magic(a, fmt, w)
        if fmt.emin == w.emin and m < w.W:
            return _round_int(a, fmt, w)
    if rounding == "nearest" and m == 0 and not fmt.has_zero and fmt.emin >= w.emin - 1:
        if fmt.emax <= w.emax:
            return _round_pow2(a, fmt, w)
    return _round_scaled(a, fmt, w, rounding, up, generator)


def _quantize_block(
    x: torch.Tensor,
    out: torch.Tensor,
    fmt: Format,
    w: _Working,
    rounding: str,
    overflow: str,
    subnormals: str,
    generator: torch.Generator | None,
) -> None:
    """Quantize one block ``x`` into ``out`` (same shape; any of the input dtypes)."""
    xw = x if x.dtype == w.dtype else x.to(w.dtype)
    res = out if out.dtype == w.dtype else torch.empty_like(xw)
    if rounding == "nearest" and subnormals == "keep" and fmt.signed and _magic_ok(fmt, w):
        _quantize_nearest_fast(xw, res, fmt, w, overflow)
        if res is not out:
            out.copy_(res)
        return
    if subnormals == "flush":
        # Denormals-are-zero: subnormals of the input's own dtype read as +-0.
        xw = torch.where(torch.abs(xw) < torch.finfo(x.dtype).tiny, xw * 0.0, xw)
    # Everything below works on magnitudes; the sign is copied back at the end.
    a = torch.abs(xw)
    neg: torch.Tensor | None = None
    up: torch.Tensor | None = None
    if rounding in ("ceil", "floor"):
        neg = torch.signbit(xw)
        up = neg if rounding == "floor" else ~neg
    r = _round(a, fmt, w, rounding, up, generator)
    mx = fmt.max
    # IEEE 754 directed rounding never overflows a finite value against its direction:
    # toward zero gives ±max, ceil gives -max for negatives, floor +max for positives.
    if rounding == "toward_zero":
        r = torch.where(torch.isinf(a), r, r.clamp(max=mx))
    elif up is not None:
        r = torch.where(up | torch.isinf(a), r, r.clamp(max=mx))
    if subnormals == "flush" and fmt.has_subnormals:
        # Tininess after rounding: a value that rounds up to tiny is kept.
        r.masked_fill_(r < fmt.tiny, 0.0)
    if not fmt.signed:
        # Power-of-two scale format: no zero, no sign. Positive values below the
        # smallest code become that code; 0, negatives and NaN have no code: NaN.
        r.clamp_(min=fmt.tiny)
        r.masked_fill_(~(xw > 0), math.nan)
    if overflow == "saturate" or fmt.special == "none":
        # "none" formats have no code for inf or NaN: overflow can only saturate.
        r.clamp_(max=mx)
    else:
        r.masked_fill_(r > mx, math.inf if fmt.has_inf else math.nan)
    if fmt.signed:
        torch.copysign(r, xw, out=res)
        if not fmt.has_negative_zero:
            res += 0.0  # -0 + +0 = +0 under round-to-nearest: fnuz has one zero
    else:
        res.copy_(r)
    if res is not out:
        out.copy_(res)


# fp16 and bf16 are IEEE-style binary formats: torch's float32 -> fp16/bf16 cast is the
# correctly rounded (nearest-even) conversion on every device, so it *is* the exact
# operation. The tests check it bit for bit against the branch-free path.
_NATIVE_NEAREST = {"fp16": torch.float16, "bf16": torch.bfloat16}
_use_native_casts = True


def _native_cast(
    x: torch.Tensor, fmt: Format, rounding: str, overflow: str, subnormals: str
) -> torch.Tensor | None:
    if not _use_native_casts or rounding != "nearest" or subnormals != "keep":
        return None
    dt = _NATIVE_NEAREST.get(fmt.name)
    if dt is None or fmt != _REGISTRY[fmt.name] or x.dtype not in (torch.float32, dt):
        return None
    out = x.to(dt).to(x.dtype) if x.dtype != dt else x.clone()
    if overflow == "saturate":
        out.clamp_(-fmt.max, fmt.max)
    return out


def _quantize_impl(
    x: torch.Tensor,
    fmt: Format,
    rounding: str,
    overflow: str,
    subnormals: str,
    generator: torch.Generator | None,
) -> torch.Tensor:
    x = x.detach()
    native = _native_cast(x, fmt, rounding, overflow, subnormals)
    if native is not None:
        return native
    w = _working_for(x.dtype)
    flat = x.reshape(-1)
    out = torch.empty_like(flat)
    n = flat.numel()
    step = _CPU_BLOCK if flat.device.type == "cpu" else max(n, 1)
    for start in range(0, n, step):
        stop = min(start + step, n)
        _quantize_block(
            flat[start:stop], out[start:stop], fmt, w, rounding, overflow, subnormals, generator
        )
    return out.reshape(x.shape)


class _StraightThrough(torch.autograd.Function):
    """Quantize forward, identity backward (the straight-through estimator)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        fmt: Format,
        rounding: str,
        overflow: str,
        subnormals: str,
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        return _quantize_impl(x, fmt, rounding, overflow, subnormals, generator)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        return grad, None, None, None, None, None


def default_overflow(fmt: Format) -> Overflow:
    """``"nonsaturate"`` for formats with inf, ``"saturate"`` for the rest."""
    return "nonsaturate" if fmt.has_inf else "saturate"


def quantize(
    x: torch.Tensor,
    fmt: str | torch.dtype | Format,
    *,
    rounding: Rounding = "nearest",
    overflow: Overflow | None = None,
    subnormals: Subnormals = "keep",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Return the values ``fmt`` would store for ``x``, in ``x``'s dtype, shape and device.

    Args:
        x: a float32, float64, float16 or bfloat16 tensor.
        fmt: a format name (``"e4m3fn"``, ``"float8_e5m2"``, ...), torch dtype or
            :class:`Format`.
        rounding: ``"nearest"`` (half to even, subnormals included);
            ``"stochastic"`` (rounds up with probability equal to the fraction of
            the spacing, so ``E[q(x)] = x`` for in-range x; reproducible with
            ``generator``); ``"toward_zero"`` (truncation: for bf16 this is
            dropping the low 16 bits of the fp32 pattern); ``"ceil"`` / ``"floor"``
            (toward +inf / -inf; for e8m0fnu scales these are the TE/cuBLAS and
            OCP MX conventions, ``"nearest"`` is torch's and ml_dtypes').
        overflow: ``"nonsaturate"``: values beyond ``fmt.max`` after rounding
            become ±inf if the format has inf, NaN if it has not (OCP
            non-saturating mode, ml_dtypes). ``"saturate"``: finite overflow and
            ±inf become ±max; NaN stays NaN (OCP saturating mode, CUDA satfinite,
            torch's CPU cast to e4m3fn). Default: ``"nonsaturate"`` for formats
            with inf, ``"saturate"`` otherwise. Formats with no inf *and* no NaN
            code (FP6, FP4) always saturate, as ml_dtypes does.
        subnormals: ``"keep"``, or ``"flush"``: results whose magnitude is below
            ``fmt.tiny`` after rounding (tininess after rounding, as x86) become
            zero of the same sign, and inputs that are subnormal in ``x``'s own
            dtype are read as zero (denormals-are-zero).
        generator: the random source for ``rounding="stochastic"`` (ignored
            otherwise); on CPU, blocks are drawn in order, so a seeded generator
            gives the same result every time.

    Directed modes follow IEEE 754 at the top of the range: a finite value never
    rounds to infinity against the rounding direction (toward_zero gives ±max,
    floor gives +max for large positives, ceil -max for large negatives).

    Special values:
        NaN in gives NaN out for every format, including FP6/FP4 which have no
        NaN code (ml_dtypes maps NaN to -0 there; hiding a NaN would hide a
        fault). fnuz formats have one zero: -0 and negatives that round to zero
        give +0. e8m0fnu (unsigned powers of two, no zero) gives NaN for 0,
        negative inputs and NaN, and ``2**-127`` for positive values below it.

    The result can round again when ``fmt`` holds values ``x``'s dtype cannot
    (e8m0 of 65504 in float16 is 2**16, which is inf in float16). The gradient,
    if ``x`` requires one, is straight-through (identity). No host-device sync.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(
            f"quantize supports float32, float64, float16 and bfloat16 inputs, got {x.dtype}; "
            "convert first, e.g. x.float()"
        )
    f = get(fmt)
    if rounding not in _ROUNDINGS:
        raise ValueError(f"rounding={rounding!r} is not supported; use one of {_ROUNDINGS}")
    if overflow is None:
        overflow = default_overflow(f)
    elif overflow not in _OVERFLOWS:
        raise ValueError(f"overflow={overflow!r} is not supported; use one of {_OVERFLOWS}")
    if subnormals not in _SUBNORMALS:
        raise ValueError(f"subnormals={subnormals!r} is not supported; use one of {_SUBNORMALS}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if x.dtype != torch.float64 and f.max > torch.finfo(x.dtype).max:
        # The format holds values x's dtype cannot (fp64, a wide custom format): round
        # exactly in float64, then back to x's dtype (which can round again, as above).
        if subnormals == "flush":  # denormals-are-zero in x's own dtype, before widening
            x = torch.where(x.abs() < torch.finfo(x.dtype).tiny, x * 0, x)
        wide = quantize(
            x.double(), f, rounding=rounding, overflow=overflow, subnormals=subnormals,
            generator=generator,
        )  # fmt: skip
        return wide.to(x.dtype)
    if x.requires_grad and torch.is_grad_enabled():
        out: torch.Tensor = _StraightThrough.apply(  # type: ignore[no-untyped-call]
            x, f, rounding, overflow, subnormals, generator
        )
        return out
    return _quantize_impl(x, f, rounding, overflow, subnormals, generator)
