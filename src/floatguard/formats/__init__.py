"""What a number format can hold: the registry, fake quantization and bit-level explanation."""

from floatguard.formats.codec import decode, encode
from floatguard.formats.explain import Explanation, explain
from floatguard.formats.registry import FORMATS, Format, SpecialEncoding, get, names
from floatguard.formats.rounding import Overflow, Rounding, Subnormals, default_overflow, quantize

__all__ = [
    "FORMATS",
    "Explanation",
    "Format",
    "Overflow",
    "Rounding",
    "SpecialEncoding",
    "Subnormals",
    "decode",
    "default_overflow",
    "encode",
    "explain",
    "get",
    "names",
    "quantize",
]
