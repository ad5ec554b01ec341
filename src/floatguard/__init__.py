"""floatguard: keep deep-learning training numerically healthy.

The public API is what ``__all__`` lists; everything else is private.
"""

from floatguard.formats import FORMATS, Explanation, Format, explain, quantize
from floatguard.formats.codec import decode, encode

__version__ = "0.1.0"

__all__ = [
    "FORMATS",
    "Explanation",
    "Format",
    "__version__",
    "decode",
    "encode",
    "explain",
    "quantize",
]
