"""Independent references for the format tests.

``ML_DTYPES`` maps our format names to ml_dtypes' types. ``brute_round`` rounds by
searching the sorted table of every finite value of a format (decoded by ml_dtypes
where it has the format), in float64: slow, obvious, and independent of the
bit tricks in floatguard.formats.rounding.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch

from floatguard.formats import Format, decode, get

ML_DTYPES: dict[str, object] = {
    "fp32": np.float32,
    "fp16": np.float16,
    "bf16": ml_dtypes.bfloat16,
    "e4m3fn": ml_dtypes.float8_e4m3fn,
    "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "e5m2": ml_dtypes.float8_e5m2,
    "e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
    "e8m0fnu": ml_dtypes.float8_e8m0fnu,
    "e3m2fn": ml_dtypes.float6_e3m2fn,
    "e2m3fn": ml_dtypes.float6_e2m3fn,
    "e2m1fn": ml_dtypes.float4_e2m1fn,
}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())


ML_DTYPES_VERSION = _version(ml_dtypes.__version__)

# Where ml_dtypes' answer differs between the versions floatguard supports (>= 0.5):
# - e8m0 of a float32 *subnormal* input: 0.5 and 0.6 round on the bit pattern, which
#   sends all of [2**-127, 2**-126) to 2**-126 (torch 2.13's own cast still does);
#   0.7 rounds to the nearest value, as floatguard always has.
ML_E8M0_ROUNDS_SUBNORMALS_ON_BITS = ML_DTYPES_VERSION < (0, 7)
# Quirks every supported version has (the tests mask them, whichever way they go):
# - FP6/FP4 have no NaN code and ml_dtypes casts NaN to -0 (floatguard keeps NaN).

# ml_dtypes formats that are custom formats for floatguard.
ML_CUSTOM: dict[str, tuple[Format, object]] = {
    "float8_e4m3": (Format.custom(4, 3), ml_dtypes.float8_e4m3),
    "float8_e3m4": (Format.custom(3, 4), ml_dtypes.float8_e3m4),
    "float8_e4m3b11fnuz": (
        Format.custom(4, 3, bias=11, special="fnuz"),
        ml_dtypes.float8_e4m3b11fnuz,
    ),
}


def ml_cast(x: torch.Tensor, np_dtype: object) -> torch.Tensor:
    """x (float32 or float64) → ml_dtypes type → back to x's dtype."""
    arr = x.numpy()
    with np.errstate(invalid="ignore", over="ignore"):
        out = arr.astype(np_dtype).astype(arr.dtype)
    return torch.from_numpy(out)


def all_codes(fmt: Format) -> torch.Tensor:
    return torch.arange(1 << fmt.bits, dtype=torch.int64)


def grid(fmt: Format) -> torch.Tensor:
    """Sorted non-negative finite values of a ≤16-bit format, plus the first value past max."""
    vals = decode(fmt, all_codes(fmt))
    vals = vals[torch.isfinite(vals) & (vals >= 0)]
    vals = torch.unique(vals)  # sorted; -0 and +0 merge
    nxt = fmt.max + (fmt.max if fmt.mantissa_bits == 0 else fmt.ulp(fmt.max))
    return torch.cat([vals, torch.tensor([nxt], dtype=torch.float64)])


def brute_round(
    x: torch.Tensor,
    fmt: Format | str,
    rounding: str = "nearest",
    overflow: str | None = None,
    subnormals: str = "keep",
) -> torch.Tensor:
    """Reference quantize by table search in float64 (formats of at most 16 bits).

    Rounds |x| between its two neighbours in the sorted table of values, then
    applies the documented overflow, flush and sign rules. Returns float64.
    """
    f = get(fmt)
    if overflow is None:
        overflow = "nonsaturate" if f.has_inf else "saturate"
    xs = x.to(torch.float64).reshape(-1)
    if subnormals == "flush":
        xs = torch.where(xs.abs() < torch.finfo(x.dtype).tiny, xs * 0.0, xs)
    g = grid(f)
    a = xs.abs()
    neg = torch.signbit(xs)
    idx = torch.searchsorted(g, a)
    n = len(g)
    exact = (idx < n) & (g[idx.clamp(max=n - 1)] == a)
    ic = idx.clamp(1, n - 1)
    lo = torch.where(idx == 0, torch.zeros_like(a), g[ic - 1])  # idx 0: below e8m0's 2**-127
    hi = torch.where(idx == 0, g[0].expand_as(a), g[ic])
    if rounding == "nearest":
        dl, dh = a - lo, hi - a
        tie = torch.where(torch.remainder(lo / (hi - lo), 2) == 0, lo, hi)
        r = torch.where(dl < dh, lo, torch.where(dh < dl, hi, tie))
        down = torch.zeros_like(neg)
    else:
        if rounding == "toward_zero":
            down = torch.ones_like(neg)
        elif rounding == "ceil":
            down = neg.clone()
        elif rounding == "floor":
            down = ~neg
        else:
            raise ValueError(rounding)
        r = torch.where(down, lo, hi)
    r = torch.where(exact, a, r)
    r = torch.where(idx >= n, torch.full_like(a, math.inf), r)  # past the virtual value
    finite_in = torch.isfinite(a)
    # Directed rounding toward zero (on |x|) never overflows a finite value.
    r = torch.where(down & finite_in & (r > f.max), torch.full_like(a, f.max), r)
    over = r > f.max
    if overflow == "saturate" or f.special == "none":
        r = torch.where(over, torch.full_like(a, f.max), r)
    else:
        r = torch.where(over, torch.full_like(a, math.inf if f.has_inf else math.nan), r)
    if subnormals == "flush" and f.has_subnormals:
        r = torch.where((r > 0) & (r < f.tiny), torch.zeros_like(r), r)
    if not f.has_zero:
        r = torch.where(r < f.tiny, torch.full_like(r, f.tiny), r)
        r = torch.where(neg | (a == 0), torch.full_like(r, math.nan), r)
    out = torch.where(neg, -r, r)
    if not f.has_negative_zero:
        out = torch.where(out == 0, torch.zeros_like(out), out)
    out = torch.where(torch.isnan(xs), torch.full_like(out, math.nan), out)
    return out.reshape(x.shape)


def special_values(fmt: Format) -> torch.Tensor:
    """The table: ±0, subnormals and their ties, ties at every binade boundary, ±max and
    the values around the first overflow, ±inf, NaN (float64, all exact in float32
    for formats of at most 16 bits)."""
    m = fmt.mantissa_bits
    vals = [0.0, fmt.smallest_subnormal, fmt.smallest_subnormal / 2, fmt.smallest_subnormal * 1.5]
    vals += [fmt.smallest_subnormal / 4, fmt.tiny, fmt.tiny * (1 - 2.0 ** -(m + 2))]
    for e in range(fmt.emin, fmt.emax + 1):
        b = math.ldexp(1.0, e)
        ulp = math.ldexp(1.0, e - m)
        vals += [b, b + ulp / 2, b + 1.5 * ulp, 2 * b - ulp / 2, 2 * b - ulp / 4, b + ulp / 4]
    top = fmt.ulp(fmt.max) if m else fmt.max
    vals += [fmt.max, fmt.max + top / 2, fmt.max + top / 4, fmt.max + 3 * top / 4, fmt.max + top]
    vals += [fmt.max * 4, 1e30, 3.0e38, math.inf, math.nan, 1.0, 0.1, 1 / 3]
    t = torch.tensor(vals, dtype=torch.float64)
    t = t[(t.abs() < 3.4e38) | ~torch.isfinite(t)]
    return torch.cat([t, -t])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: bit-identical, or both NaN."""
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    int_dtype = {torch.float64: torch.int64, torch.float32: torch.int32}.get(a.dtype, torch.int16)
    eq = a.view(int_dtype) == b.view(int_dtype)
    return eq | (torch.isnan(a) & torch.isnan(b))
