"""floatguard: keep deep-learning training numerically healthy.

The public API is what ``__all__`` lists; everything else is private.
"""

from floatguard.audit import AuditReport, audit
from floatguard.distributed import GuardDesync, PeerFailed
from floatguard.events import Event, EventLog, read_events
from floatguard.formats import FORMATS, Explanation, Format, explain, quantize
from floatguard.formats.codec import decode, encode
from floatguard.guard import Guard, StepResult
from floatguard.monitor import Alert, Fault, Monitor, ReplayResult, replay
from floatguard.ops import GradcheckReport, LogSumExp, Moments, gradcheck
from floatguard.scaling import DynamicLossScaler, EmulationRecipe, MasterWeights, emulate, restore
from floatguard.stability import (
    ClipPolicy,
    GuardStopped,
    LossSpikeHandler,
    ResponsePolicy,
    RobustSpikeDetector,
    Snapshot,
    SnapshotError,
    SnapshotStore,
    SpikePolicy,
    TrendAlarm,
    TrendPolicy,
    TrendWatch,
    WindowedZClip,
    ZClip,
    ZClipConfig,
    clip_grad_norm_,
    clip_grad_value_,
    load_snapshot,
)
from floatguard.stats import TensorStats, audit_tensor_numerics, tensor_stats

__version__ = "0.1.0"

__all__ = [
    "FORMATS",
    "Alert",
    "AuditReport",
    "ClipPolicy",
    "DynamicLossScaler",
    "EmulationRecipe",
    "Event",
    "EventLog",
    "Explanation",
    "Fault",
    "Format",
    "GradcheckReport",
    "Guard",
    "GuardDesync",
    "GuardStopped",
    "LogSumExp",
    "LossSpikeHandler",
    "MasterWeights",
    "Moments",
    "Monitor",
    "PeerFailed",
    "ReplayResult",
    "ResponsePolicy",
    "RobustSpikeDetector",
    "Snapshot",
    "SnapshotError",
    "SnapshotStore",
    "SpikePolicy",
    "StepResult",
    "TensorStats",
    "TrendAlarm",
    "TrendPolicy",
    "TrendWatch",
    "WindowedZClip",
    "ZClip",
    "ZClipConfig",
    "__version__",
    "audit",
    "audit_tensor_numerics",
    "clip_grad_norm_",
    "clip_grad_value_",
    "decode",
    "emulate",
    "encode",
    "explain",
    "gradcheck",
    "load_snapshot",
    "quantize",
    "read_events",
    "replay",
    "restore",
    "tensor_stats",
]
