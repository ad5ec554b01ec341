"""Bit codes of a format: decode any code to its value, encode representable values to codes.

These are exact, vectorised, and independent of the fast rounding paths in
:mod:`floatguard.formats.rounding`, so each checks the other in the tests.
Codes are int64 tensors holding the format's bit pattern in the low ``fmt.bits``
bits (a 4- or 6-bit code is a small integer, as ml_dtypes stores it in a byte).
"""

from __future__ import annotations

import math

import torch

from floatguard.formats.registry import Format, get

__all__ = ["decode", "decode_unchecked", "encode", "nan_code"]


def nan_code(fmt: Format) -> int | None:
    """The canonical NaN code of ``fmt`` (quiet NaN for IEEE formats), or None if it has none."""
    m, e = fmt.mantissa_bits, fmt.exponent_bits
    if fmt.special == "ieee":
        quiet = 1 << (m - 1) if m > 0 else 0
        return (((1 << e) - 1) << m) | quiet
    if fmt.special == "fn":
        return (1 << (e + m)) - 1
    if fmt.special == "fnuz":
        return 1 << (fmt.bits - 1)
    return None


def decode(fmt: Format | str, codes: torch.Tensor) -> torch.Tensor:
    """Values (float64) of integer ``codes`` of ``fmt``; codes out of range raise ValueError."""
    f = get(fmt)
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise TypeError(f"codes must be an integer tensor, got {codes.dtype}")
    c = codes.to(torch.int64)
    if f.bits < 64 and c.numel():
        bad = c[(c < 0) | (c >= (1 << f.bits))]
        if bad.numel():
            raise ValueError(
                f"code {int(bad[0])} is out of range for {f.name}: codes must lie in "
                f"[0, 2**{f.bits}) = [0, {(1 << f.bits) - 1}]"
            )
    return decode_unchecked(f, c)


def decode_unchecked(f: Format, c: torch.Tensor) -> torch.Tensor:
    """:func:`decode` of int64 codes known to be in range: no check, so no host read."""
    m, e = f.mantissa_bits, f.exponent_bits
    field = (c >> m) & ((1 << e) - 1)
    mant = c & ((1 << m) - 1)
    fm = field.to(torch.float64)
    frac = mant.to(torch.float64) * math.ldexp(1.0, -m)
    if f.has_zero:
        is_sub = field == 0
        significand = torch.where(is_sub, frac, 1.0 + frac)
        exponent = torch.where(is_sub, torch.full_like(fm, f.emin), fm - f.bias)
    else:
        significand = torch.ones_like(fm)
        exponent = fm - f.bias
    value = significand * torch.exp2(exponent)
    if f.signed:
        neg = ((c >> (f.bits - 1)) & 1).bool()
        value = torch.where(neg, -value, value)
    top = field == (1 << e) - 1
    if f.special == "ieee":
        value = torch.where(
            top & (mant == 0), torch.copysign(torch.full_like(value, math.inf), value), value
        )
        value = value.masked_fill(top & (mant != 0), math.nan)
    elif f.special == "fn":
        value = value.masked_fill(top & (mant == (1 << m) - 1), math.nan)
    elif f.special == "fnuz":
        value = value.masked_fill(c == (1 << (f.bits - 1)), math.nan)
    return value


def encode(fmt: Format | str, values: torch.Tensor) -> torch.Tensor:
    """Codes (int64) of ``values``, which must already be values of ``fmt`` (quantize first).

    NaN encodes to :func:`nan_code`; a value the format cannot hold (not on its
    grid, beyond ``max``, inf without an inf code) raises ValueError. This is a
    checking routine, not a hot path: it reads the tensor on the host.
    """
    f = get(fmt)
    v = values.detach().to(torch.float64).cpu().reshape(-1)
    m = f.mantissa_bits
    a = v.abs()
    _mant, ex = torch.frexp(a)
    e = (ex - 1).to(torch.int64)
    is_sub = (e < f.emin) & (a > 0)
    if f.has_zero:
        field = torch.where(is_sub | (a == 0), torch.zeros_like(e), e + f.bias)
        scale_e = torch.where(is_sub | (a == 0), torch.full_like(e, f.emin), e)
        significand = a * torch.exp2(-scale_e.to(torch.float64))
        mbits = torch.where(field == 0, significand, significand - 1.0) * (1 << m)
    else:
        field = e + f.bias
        mbits = torch.zeros_like(a)
    code = (field << m) | mbits.to(torch.int64)
    if f.signed:
        neg = torch.signbit(v) & ~torch.isnan(v)
        if not f.has_negative_zero:
            neg &= a != 0
        code = code | (neg.to(torch.int64) << (f.bits - 1))
    inf = torch.isinf(v)
    nan = torch.isnan(v)
    if f.has_inf:
        inf_code = ((1 << f.exponent_bits) - 1) << m
        code = torch.where(inf, inf_code | (torch.signbit(v).to(torch.int64) << (f.bits - 1)), code)
    ncode = nan_code(f)
    if ncode is not None:
        code = torch.where(nan, torch.full_like(code, ncode), code)
    ok = nan if ncode is not None else torch.zeros_like(nan)
    if f.has_inf:
        ok = ok | inf
    finite = ~(nan | inf)
    exact = finite & (a <= f.max) & (mbits == torch.round(mbits))
    if not f.has_zero:
        exact &= (a >= f.tiny) & ~torch.signbit(v)
    ok = ok | exact
    if not bool(ok.all()):
        bad = v[~ok][0].item()
        raise ValueError(
            f"{bad!r} is not a value of {f.name}; round it first with floatguard.quantize"
        )
    return code.reshape(values.shape)
