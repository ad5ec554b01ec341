"""floatguard: keep deep-learning training numerically healthy.

The public API is what ``__all__`` lists; everything else is private.
"""

from floatguard.formats import FORMATS, Explanation, Format, explain, quantize
from floatguard.formats.codec import decode, encode
from floatguard.ops import GradcheckReport, LogSumExp, Moments, gradcheck

__version__ = "0.1.0"

__all__ = [
    "FORMATS",
    "Explanation",
    "Format",
    "GradcheckReport",
    "LogSumExp",
    "Moments",
    "__version__",
    "decode",
    "encode",
    "explain",
    "gradcheck",
    "quantize",
]
