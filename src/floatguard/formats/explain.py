"""Bit-level explanation of how one value is stored in a format."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

import torch

from floatguard.formats.codec import encode
from floatguard.formats.registry import Format, get
from floatguard.formats.rounding import Overflow, Rounding, default_overflow, quantize

__all__ = ["Explanation", "ValueClass", "explain", "parse_value"]

ValueClass = Literal["zero", "subnormal", "normal", "inf", "nan", "overflow"]


@dataclass(frozen=True)
class Explanation:
    """How ``value`` is stored in ``format``.

    ``sign``/``exponent``/``mantissa`` are the bit fields as strings (``sign`` is
    empty for unsigned formats, ``mantissa`` for formats without mantissa bits,
    all three are empty where the format has no code for the stored value, as for
    NaN in FP4). ``exponent_unbiased`` is the power of two of the stored value's
    leading bit (``emin`` for subnormals; None for zero, inf and NaN).
    ``klass`` is the class of the *input* with respect to the format:
    ``"overflow"`` when a finite input lies beyond what rounding keeps finite.
    ``underflow`` is True when a non-zero input was stored as zero.
    ``ulp`` is the spacing of the format at the stored value; ``next_down`` /
    ``next_up`` the neighbouring representable values (None past the ends).
    """

    value: float
    format: str
    stored: float
    klass: ValueClass
    sign: str
    exponent: str
    mantissa: str
    code: int | None
    exponent_unbiased: int | None
    abs_error: float
    rel_error: float
    ulp: float
    next_down: float | None
    next_up: float | None
    underflow: bool

    @property
    def bits(self) -> str:
        """The grouped bit pattern, ``[s] [exponent] [mantissa]``."""
        groups = [g for g in (self.sign, self.exponent, self.mantissa) if g]
        return " ".join(f"[{g}]" for g in groups) if groups else "(no code)"

    def to_dict(self) -> dict[str, object]:
        """Plain-dict view (JSON-ready)."""
        d = asdict(self)
        d["bits"] = self.bits
        return d

    def __str__(self) -> str:
        err = f"abs err {self.abs_error:.3g}, rel err {self.rel_error:.3g}"
        return (
            f"{self.format}: {self.bits} = {self.stored!r} ({self.klass}; {err}; "
            f"ulp {self.ulp:.3g})"
        )


def _fields(fmt: Format, code: int) -> tuple[str, str, str]:
    m, e = fmt.mantissa_bits, fmt.exponent_bits
    mant = format(code & ((1 << m) - 1), f"0{m}b") if m else ""
    exp = format((code >> m) & ((1 << e) - 1), f"0{e}b")
    sign = str((code >> (e + m)) & 1) if fmt.signed else ""
    return sign, exp, mant


def parse_value(text: str) -> float:
    """Read a decimal (``0.1``, ``1e-8``), hex float (``0x1.cp8``), ``inf`` or ``nan``."""
    t = text.strip()
    short = t if len(t) <= 40 else t[:37] + "..."
    try:
        v = float.fromhex(t) if "0x" in t.lower() else float(t)
    except ValueError:
        raise ValueError(
            f"cannot read {short!r} as a number; try e.g. 0.1, 1e-8, 0x1.cp8, inf, nan"
        ) from None
    except OverflowError:
        raise ValueError(
            f"{short!r} is beyond float64's range (max ~1.8e308); write inf for infinity"
        ) from None
    if math.isinf(v) and "inf" not in t.lower():
        raise ValueError(
            f"{short!r} is beyond float64's range (it would read as {v}); write inf for infinity"
        )
    return v


def explain(
    value: float | str,
    fmt: str | torch.dtype | Format,
    *,
    rounding: Rounding = "nearest",
    overflow: Overflow | None = None,
) -> Explanation:
    """Explain how ``value`` is stored in ``fmt``: bits, class, stored value, error, neighbours.

    ``value`` is read as a Python float (float64), so ``explain("0.1", "fp32")``
    shows 0.1 rounded once from its float64 value (0.100000001490116...).
    Rounding and overflow modes are those of :func:`floatguard.quantize`.
    """
    f = get(fmt)
    if isinstance(value, str):
        v = parse_value(value)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        v = float(value)
    else:
        raise TypeError(f"value must be a number or a numeric string, got {value!r}")
    mode: Overflow = default_overflow(f) if overflow is None else overflow
    x = torch.tensor([v], dtype=torch.float64)
    stored = float(quantize(x, f, rounding=rounding, overflow=mode).item())
    # Finite inputs whose rounding leaves the finite range, whatever the mode says.
    ns = float(quantize(x, f, rounding=rounding, overflow="nonsaturate").item())
    klass: ValueClass
    if math.isnan(v) or (not f.signed and v <= 0):
        klass = "nan"  # NaN in, or 0 / a negative in an unsigned format (no code but NaN)
    elif math.isinf(v):
        klass = "inf" if f.has_inf else "overflow"
    elif not math.isfinite(ns) or (f.special == "none" and abs(v) > f.max and stored != v):
        klass = "overflow"
    elif stored == 0.0:
        klass = "zero"
    elif abs(stored) < f.tiny:
        klass = "subnormal"
    else:
        klass = "normal"
    code: int | None
    if math.isnan(stored) and not f.has_nan:
        code, sign, exp, mant = None, "", "", ""
    else:
        code = int(encode(f, torch.tensor([stored], dtype=torch.float64)).item())
        sign, exp, mant = _fields(f, code)
    finite = math.isfinite(stored)
    e_unb: int | None = None
    if finite and stored != 0.0:
        e_unb = max(math.frexp(abs(stored))[1] - 1, f.emin)
    if finite and math.isfinite(v):
        abs_err = abs(stored - v)
    elif math.isinf(stored) and math.isfinite(v):
        abs_err = math.inf  # a finite value stored as inf (an overflow): infinitely off
    elif math.isinf(stored) and stored == v:
        abs_err = 0.0  # inf stored as itself
    else:
        abs_err = math.nan
    rel_err = (
        abs_err / abs(v)
        if v != 0 and not math.isnan(abs_err)
        else (0.0 if abs_err == 0 else math.nan)
    )
    return Explanation(
        value=v,
        format=f.name,
        stored=stored,
        klass=klass,
        sign=sign,
        exponent=exp,
        mantissa=mant,
        code=code,
        exponent_unbiased=e_unb,
        abs_error=abs_err,
        rel_error=rel_err,
        ulp=f.ulp(stored) if finite else math.nan,
        next_down=f.next_down(stored) if not math.isnan(stored) else None,
        next_up=f.next_up(stored) if not math.isnan(stored) else None,
        underflow=v != 0.0 and stored == 0.0,
    )
