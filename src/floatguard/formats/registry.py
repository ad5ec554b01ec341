"""Floating-point formats as exact value objects.

A :class:`Format` describes what a binary floating-point format can hold: its
layout (sign, exponent and mantissa widths, bias), how it encodes the special
values (IEEE inf/NaN, OCP "fn" finite-only with an all-ones NaN, AMD/Graphcore
"fnuz" with NaN in the negative-zero code, or no special codes at all), and the
derived limits (``max``, ``tiny``, ``smallest_subnormal``, ``eps``).

All limits are exact Python floats computed from the layout, so every format the
registry knows (fp64 down to fp4) and every :meth:`Format.custom` format agree
with ``ml_dtypes.finfo`` and ``torch.finfo`` where those exist (except
``torch.finfo(float8_e5m2fnuz).eps``, which reports 0.125 where the definition
``2**-mantissa_bits`` gives 0.25).
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field
from typing import Literal

import torch

__all__ = ["FORMATS", "Format", "SpecialEncoding", "get", "names"]

SpecialEncoding = Literal["ieee", "fn", "fnuz", "none"]
"""How a format spends codes on non-finite values.

``"ieee"``
    The all-ones exponent is reserved: mantissa 0 is ±inf, anything else NaN.
``"fn"``
    Finite-only (OCP style): only the all-ones exponent *and* mantissa code is
    NaN; every other code is a finite number. No inf.
``"fnuz"``
    Finite, no negative zero: the code ``1000…0`` (what would be −0) is the one
    NaN; there is no inf and a single zero.
``"none"``
    Every code is a finite number (FP6 and FP4 in the OCP MX spec).
"""

_KNOWN_ENCODINGS: tuple[str, ...] = ("ieee", "fn", "fnuz", "none")


@dataclass(frozen=True)
class Format:
    """A binary floating-point format.

    Values are ``(-1)**s * 2**(E - bias) * 1.M`` for exponent fields
    ``E >= 1`` and ``(-1)**s * 2**(1 - bias) * 0.M`` for ``E == 0``
    (subnormals), minus whatever codes the ``special`` encoding reserves.
    Formats with ``mantissa_bits == 0`` and ``signed=False`` (``e8m0fnu``) have
    no subnormals and no zero: every code is the power of two
    ``2**(E - bias)``.

    Attributes are exact: ``max``, ``tiny`` (smallest positive normal),
    ``smallest_subnormal`` and ``eps`` (``2**-mantissa_bits``, the gap between
    1 and the next value) are Python floats computed from the layout.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    special: SpecialEncoding = "ieee"
    signed: bool = True
    torch_dtype: torch.dtype | None = field(default=None, compare=False)
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.exponent_bits, int) or not 1 <= self.exponent_bits <= 11:
            raise ValueError(
                f"exponent_bits={self.exponent_bits!r} is out of range; use an int in 1..11 "
                "(fp64 has 11)"
            )
        if not isinstance(self.mantissa_bits, int) or not 0 <= self.mantissa_bits <= 52:
            raise ValueError(
                f"mantissa_bits={self.mantissa_bits!r} is out of range; use an int in 0..52 "
                "(fp64 has 52)"
            )
        if self.special not in _KNOWN_ENCODINGS:
            raise ValueError(
                f"special={self.special!r} is not a known encoding; use one of {_KNOWN_ENCODINGS}"
            )
        if self.special == "ieee" and self.exponent_bits < 2:
            raise ValueError(
                "an IEEE-like format needs exponent_bits >= 2 (the top exponent is reserved "
                f"for inf/NaN); got {self.exponent_bits}. Use ieee=False for a finite format."
            )
        if not self.signed and self.mantissa_bits != 0:
            raise ValueError(
                "unsigned formats are only supported as power-of-two scale formats "
                f"(mantissa_bits=0, like e8m0fnu); got mantissa_bits={self.mantissa_bits}"
            )
        if self.special == "fnuz" and not self.signed:
            raise ValueError("'fnuz' puts NaN in the negative-zero code; it needs signed=True")
        if self.special == "fn" and self.exponent_bits == 1 and self.mantissa_bits == 0:
            raise ValueError("a 1-bit-exponent, 0-bit-mantissa 'fn' format holds no finite value")
        emax = self._emax_unchecked()
        if emax + 1 > 1024 or self.emin - self.mantissa_bits < -1074:
            raise ValueError(
                f"format {self.name!r} (bias {self.bias}) reaches outside fp64's range; "
                "floatguard computes in fp64 at most"
            )

    # ------------------------------------------------------------------ layout
    @property
    def bits(self) -> int:
        """Storage width: sign (if signed) + exponent + mantissa bits."""
        return int(self.signed) + self.exponent_bits + self.mantissa_bits

    @property
    def has_inf(self) -> bool:
        """Whether ±inf has a code (IEEE-like formats only)."""
        return self.special == "ieee"

    @property
    def has_nan(self) -> bool:
        """Whether NaN has a code (every encoding but ``"none"``)."""
        return self.special != "none"

    @property
    def has_negative_zero(self) -> bool:
        """Whether −0 is distinct from +0 (false for fnuz and unsigned formats)."""
        return self.signed and self.special != "fnuz"

    @property
    def has_zero(self) -> bool:
        """Whether 0 is representable (false for e8m0fnu-style scale formats)."""
        return self.signed or self.mantissa_bits > 0

    @property
    def has_subnormals(self) -> bool:
        """Whether the zero exponent field encodes subnormals (needs mantissa bits)."""
        return self.mantissa_bits > 0

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal value."""
        if not self.has_zero:
            # e8m0fnu: exponent field 0 is the value 2**-bias, not a subnormal.
            return -self.bias
        return 1 - self.bias

    def _emax_unchecked(self) -> int:
        top_field = (1 << self.exponent_bits) - 1
        if self.special == "ieee":
            top_field -= 1  # all-ones exponent is inf/NaN
        elif self.special == "fn" and self.mantissa_bits == 0:
            top_field -= 1  # the all-ones code is NaN and it is the whole top binade
        return top_field - self.bias

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite value."""
        return self._emax_unchecked()

    # ------------------------------------------------------------------ limits
    @property
    def max(self) -> float:
        """Largest finite value (exact)."""
        m = self.mantissa_bits
        if self.special == "fn" and m > 0:
            # Top binade loses its all-ones mantissa code to NaN.
            significand = 2.0 - 2.0 ** (1 - m)
        else:
            significand = 2.0 - 2.0**-m
        return math.ldexp(significand, self.emax)

    @property
    def tiny(self) -> float:
        """Smallest positive normal value, ``2**emin`` (exact)."""
        return math.ldexp(1.0, self.emin)

    @property
    def smallest_subnormal(self) -> float:
        """Smallest positive value, ``2**(emin - mantissa_bits)`` (``tiny`` if no subnormals)."""
        return math.ldexp(1.0, self.emin - self.mantissa_bits)

    @property
    def eps(self) -> float:
        """Gap between 1.0 and the next larger value, ``2**-mantissa_bits``."""
        return math.ldexp(1.0, -self.mantissa_bits)

    @property
    def min(self) -> float:
        """Most negative finite value (``-max``), or the smallest value for unsigned formats."""
        return -self.max if self.signed else self.tiny

    @property
    def decimal_digits(self) -> float:
        """Approximate decimal precision, ``(mantissa_bits + 1) * log10(2)``."""
        return (self.mantissa_bits + 1) * math.log10(2.0)

    @property
    def dynamic_range_bits(self) -> float:
        """``log2(max / smallest_subnormal)``: binades the format spans."""
        return math.log2(self.max) - math.log2(self.smallest_subnormal)

    # ------------------------------------------------------------ constructors
    @classmethod
    def custom(
        cls,
        exponent_bits: int,
        mantissa_bits: int,
        *,
        bias: int | None = None,
        ieee: bool = True,
        has_nan: bool = True,
        special: SpecialEncoding | None = None,
        name: str | None = None,
    ) -> Format:
        """Build any signed ``eXmY`` format.

        ``bias`` defaults to ``2**(exponent_bits - 1) - 1``. ``ieee=True`` reserves
        the top exponent for inf/NaN (like fp16 and e5m2); ``ieee=False`` builds a
        finite-only format where only the all-ones code is NaN (OCP "fn", like
        e4m3fn), or, with ``has_nan=False``, a format where every code is a
        number (like the OCP FP6/FP4 element formats). ``special`` names the
        encoding directly and overrides both flags (``"fnuz"`` builds formats
        like ``float8_e4m3b11fnuz``).
        """
        for label, value in (("exponent_bits", exponent_bits), ("mantissa_bits", mantissa_bits)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{label} must be an int, got {value!r}")
        # (the range itself is checked when the format is built; a huge exponent_bits
        # must reach that check, not overflow here)
        default_bias = (1 << (exponent_bits - 1)) - 1 if 1 <= exponent_bits <= 64 else 0
        if bias is None:
            bias = default_bias
        if isinstance(bias, bool) or not isinstance(bias, int):
            raise TypeError(f"bias must be an int, got {bias!r}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str, got {name!r}")
        if ieee and not has_nan:
            raise ValueError("has_nan=False only applies to finite formats; pass ieee=False too")
        if special is None:
            special = "ieee" if ieee else ("fn" if has_nan else "none")
        if name is None:
            suffix = {"ieee": "", "fn": "fn", "fnuz": "fnuz", "none": "fn_nonan"}.get(special, "")
            name = f"e{exponent_bits}m{mantissa_bits}{suffix}"
            if bias != default_bias:
                name += f"_b{bias}"
        return cls(name, exponent_bits, mantissa_bits, bias, special)

    # ---------------------------------------------------------------- helpers
    def ulp(self, value: float) -> float:
        """Gap between ``value`` (assumed in range) and the next value away from zero."""
        a = abs(value)
        if a == 0.0 or not math.isfinite(a):
            return self.smallest_subnormal
        e = max(math.frexp(a)[1] - 1, self.emin)
        return math.ldexp(1.0, e - self.mantissa_bits)

    def next_up(self, value: float) -> float | None:
        """The next representable value above ``value`` (a value of this format).

        Returns ``inf`` past ``max`` for formats with inf, ``None`` past ``max``
        otherwise.
        """
        if math.isnan(value):
            return None
        if value == math.inf:
            return None
        if value == -math.inf:
            return -self.max
        if value < 0:
            down = self.next_down(-value)
            return None if down is None else -down
        if value >= self.max:
            return math.inf if self.has_inf else None
        if value == 0.0:
            return self.smallest_subnormal
        return value + self.ulp(value)

    def next_down(self, value: float) -> float | None:
        """The next representable value below ``value`` (a value of this format)."""
        if math.isnan(value) or value == -math.inf:
            return None
        if value == math.inf:
            return self.max
        if value <= 0:
            if value == 0.0:
                return -self.smallest_subnormal if self.signed else None
            up = self.next_up(-value)
            return None if up is None or up == math.inf else -up
        if not self.has_zero and value <= self.tiny:
            return None
        if value <= self.smallest_subnormal:
            return 0.0
        mant, exp = math.frexp(value)
        e = exp - 1
        if mant == 0.5 and e > self.emin:
            return value - math.ldexp(1.0, e - 1 - self.mantissa_bits)
        return value - self.ulp(value)

    def summary(self) -> dict[str, object]:
        """Plain-dict view of the format (for tables and JSON)."""
        return {
            "name": self.name,
            "bits": self.bits,
            "exponent_bits": self.exponent_bits,
            "mantissa_bits": self.mantissa_bits,
            "bias": self.bias,
            "max": self.max,
            "tiny": self.tiny,
            "smallest_subnormal": self.smallest_subnormal,
            "eps": self.eps,
            "decimal_digits": self.decimal_digits,
            "has_inf": self.has_inf,
            "has_nan": self.has_nan,
            "has_negative_zero": self.has_negative_zero,
            "signed": self.signed,
            "torch_dtype": None if self.torch_dtype is None else str(self.torch_dtype),
        }

    def __str__(self) -> str:
        return self.name


def _dtype(name: str) -> torch.dtype | None:
    # Older torch releases lack some float8 dtypes; the format still works.
    dt = getattr(torch, name, None)
    return dt if isinstance(dt, torch.dtype) else None


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("fp64", 11, 52, 1023, "ieee", True, torch.float64, "IEEE 754 binary64"),
        Format("fp32", 8, 23, 127, "ieee", True, torch.float32, "IEEE 754 binary32"),
        Format("tf32", 8, 10, 127, "ieee", True, None, "NVIDIA TensorFloat-32 (19 bits)"),
        Format("fp16", 5, 10, 15, "ieee", True, torch.float16, "IEEE 754 binary16"),
        Format("bf16", 8, 7, 127, "ieee", True, torch.bfloat16, "bfloat16 (Brain float)"),
        Format("e4m3fn", 4, 3, 7, "fn", True, _dtype("float8_e4m3fn"), "OCP FP8 E4M3"),
        Format("e4m3fnuz", 4, 3, 8, "fnuz", True, _dtype("float8_e4m3fnuz"), "FP8 E4M3 (AMD/GC)"),
        Format("e5m2", 5, 2, 15, "ieee", True, _dtype("float8_e5m2"), "OCP FP8 E5M2"),
        Format("e5m2fnuz", 5, 2, 16, "fnuz", True, _dtype("float8_e5m2fnuz"), "FP8 E5M2 (AMD/GC)"),
        Format("e8m0fnu", 8, 0, 127, "fn", False, _dtype("float8_e8m0fnu"), "OCP MX scale E8M0"),
        Format("e3m2fn", 3, 2, 3, "none", True, None, "OCP MX FP6 E3M2"),
        Format("e2m3fn", 2, 3, 1, "none", True, None, "OCP MX FP6 E2M3"),
        Format("e2m1fn", 2, 1, 1, "none", True, None, "OCP MX FP4 E2M1"),
    )
}
"""The registry: short name → :class:`Format`, in display order."""

_ALIASES: dict[str, str] = {
    # fp64 / fp32 / tf32 / fp16 / bf16
    "float64": "fp64", "double": "fp64", "f64": "fp64", "binary64": "fp64",
    "float32": "fp32", "float": "fp32", "f32": "fp32", "single": "fp32", "binary32": "fp32",
    "tensorfloat32": "tf32", "tensorfloat-32": "tf32",
    "float16": "fp16", "half": "fp16", "f16": "fp16", "binary16": "fp16",
    "bfloat16": "bf16",
    # FP8
    "float8_e4m3fn": "e4m3fn", "fp8_e4m3": "e4m3fn", "fp8_e4m3fn": "e4m3fn", "e4m3": "e4m3fn",
    "float8_e4m3fnuz": "e4m3fnuz", "fp8_e4m3fnuz": "e4m3fnuz",
    "float8_e5m2": "e5m2", "fp8_e5m2": "e5m2",
    "float8_e5m2fnuz": "e5m2fnuz", "fp8_e5m2fnuz": "e5m2fnuz",
    "float8_e8m0fnu": "e8m0fnu", "fp8_e8m0": "e8m0fnu", "e8m0": "e8m0fnu", "fp8_e8m0fnu": "e8m0fnu",
    # FP6 / FP4
    "float6_e3m2fn": "e3m2fn", "fp6_e3m2": "e3m2fn", "e3m2": "e3m2fn",
    "float6_e2m3fn": "e2m3fn", "fp6_e2m3": "e2m3fn", "e2m3": "e2m3fn",
    "float4_e2m1fn": "e2m1fn", "fp4_e2m1": "e2m1fn", "e2m1": "e2m1fn", "fp4": "e2m1fn",
    "float4_e2m1fn_x2": "e2m1fn",
}  # fmt: skip
# Names that are not one element format: why, and what to use instead.
_NOT_A_FORMAT: dict[str, str] = {
    "fp8": "is ambiguous: e4m3fn (max 448, for weights and activations) or e5m2 "
    "(max 57344, for gradients)",
    "float8": "is ambiguous: e4m3fn (max 448, for weights and activations) or e5m2 "
    "(max 57344, for gradients)",
    "nvfp4": "is a scaling recipe, not an element format: floatguard.emulation.NVFP4() "
    "(e2m1fn elements, e4m3fn block scales, an fp32 tensor scale)",
    "mxfp8": "is a scaling recipe, not an element format: floatguard.emulation.MX('e4m3fn') "
    "(or MX('e5m2')): 32-element blocks with an e8m0fnu scale",
    "mxfp6": "is a scaling recipe, not an element format: floatguard.emulation.MX('e3m2fn') "
    "or MX('e2m3fn')",
    "mxfp4": "is a scaling recipe, not an element format: floatguard.emulation.MX('e2m1fn')",
}
_EXMY = re.compile(r"^(?:float\d*_)?e(\d+)m(\d+)(fn|fnuz)?$")
# Note: "e4m3" is accepted as e4m3fn because that is what every DL stack means by it;
# the IEEE-like E4M3 (ml_dtypes.float8_e4m3, max 240) is Format.custom(4, 3).


def names() -> list[str]:
    """Short names of the registered formats, in display order."""
    return list(FORMATS)


def _by_dtype(dtype: torch.dtype) -> Format | None:
    for f in FORMATS.values():
        if f.torch_dtype is not None and f.torch_dtype == dtype:
            return f
    return None


def get(spec: str | torch.dtype | Format) -> Format:
    """Look a format up by short name, long spelling, torch dtype, or pass one through.

    >>> get("float8_e4m3fn").name
    'e4m3fn'

    Unknown names raise :class:`ValueError` naming the closest match and the known names.
    """
    if isinstance(spec, Format):
        return spec
    if isinstance(spec, torch.dtype):
        found = _by_dtype(spec)
        if found is None:
            raise ValueError(
                f"torch dtype {spec} is not a floating-point format floatguard knows; "
                f"known: {', '.join(FORMATS)}"
            )
        return found
    if not isinstance(spec, str):
        raise TypeError(
            f"a format is a name, a torch.dtype or a Format, got {type(spec).__name__}: {spec!r}"
        )
    key = spec.strip().lower().replace("torch.", "").replace("-", "_")
    if key in FORMATS:
        return FORMATS[key]
    if key in _ALIASES:
        return FORMATS[_ALIASES[key]]
    if key in _NOT_A_FORMAT:
        raise ValueError(f"{spec!r} {_NOT_A_FORMAT[key]}")
    m = _EXMY.match(key)
    if m:  # any eXmY[fn|fnuz] spelling: a custom format of that layout
        e, mant, suffix = int(m.group(1)), int(m.group(2)), m.group(3)
        try:
            if suffix == "fnuz":  # the fnuz convention (ml_dtypes, AMD): bias 2**(e - 1)
                bias = 1 << (e - 1) if 1 <= e <= 64 else 0
                return Format.custom(e, mant, special="fnuz", bias=bias)
            return Format.custom(e, mant, ieee=suffix is None)
        except ValueError as err:
            raise ValueError(f"format {spec!r}: {err}") from None
    candidates = list(FORMATS) + list(_ALIASES)
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    known = ", ".join(FORMATS)
    if close:
        target = _ALIASES.get(close[0], close[0])
        raise ValueError(f"unknown format {spec!r}; did you mean {target!r}? Known: {known}")
    raise ValueError(f"unknown format {spec!r}. Known: {known}, or any eXmY (e3m4, e5m2fnuz)")
