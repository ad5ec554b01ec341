"""floatguard: keep deep-learning training numerically healthy.

The public API is what ``__all__`` lists; everything else is private.
"""

from floatguard.formats import FORMATS, Explanation, Format, explain, quantize
from floatguard.formats.codec import decode, encode
from floatguard.monitor import Alert, Fault, Monitor, ReplayResult, replay
from floatguard.ops import GradcheckReport, LogSumExp, Moments, gradcheck
from floatguard.stats import TensorStats, audit_tensor_numerics, tensor_stats

__version__ = "0.1.0"

__all__ = [
    "FORMATS",
    "Alert",
    "Explanation",
    "Fault",
    "Format",
    "GradcheckReport",
    "LogSumExp",
    "Moments",
    "Monitor",
    "ReplayResult",
    "TensorStats",
    "__version__",
    "audit_tensor_numerics",
    "decode",
    "encode",
    "explain",
    "gradcheck",
    "quantize",
    "replay",
    "tensor_stats",
]
