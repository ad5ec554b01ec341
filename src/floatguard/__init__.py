"""floatguard: keep deep-learning training numerically healthy.

The public API is what ``__all__`` lists; everything else is private.
"""

from floatguard._safe_io import NotRegularFile
from floatguard._version import __version__
from floatguard.advise import Advice, LayerAdvice, advise
from floatguard.audit import AuditReport, audit
from floatguard.distributed import DistributedStop, GuardDesync, PeerFailed
from floatguard.emulation import EmulationRecipe, NothingToEmulate, emulate, restore
from floatguard.errors import FloatguardError
from floatguard.events import Event, EventLog, read_events
from floatguard.formats import FORMATS, Explanation, Format, explain, quantize
from floatguard.formats.codec import decode, encode
from floatguard.gap import ExpectedGap, expected_gap
from floatguard.guard import GraphedStep, GraphUnsafe, Guard, StepResult
from floatguard.monitor import Alert, Fault, Monitor, ReplayResult, replay
from floatguard.ops import GradcheckReport, LogSumExp, Moments, gradcheck
from floatguard.repro import ReproError
from floatguard.scaling import DynamicLossScaler, MasterWeights
from floatguard.stability import (
    BadDataPolicy,
    ClipPolicy,
    GuardStopped,
    LadderPolicy,
    LossSpikeHandler,
    ReproPolicy,
    ResponsePolicy,
    RobustSpikeDetector,
    Snapshot,
    SnapshotError,
    SnapshotPolicy,
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
from floatguard.stability.snapshot import ForeignSnapshotError
from floatguard.stability.snapshot_folder import SnapshotFolderBusy
from floatguard.stats import TensorStats, audit_tensor_numerics, tensor_stats

__all__ = [  # noqa: RUF022 (grouped by what a user does, sorted within a group)
    # know your numbers
    "FORMATS",
    "Explanation",
    "Format",
    "decode",
    "encode",
    "explain",
    "quantize",
    # compute safely
    "GradcheckReport",
    "LogSumExp",
    "Moments",
    "gradcheck",
    # see and localize
    "Alert",
    "Fault",
    "Monitor",
    "ReplayResult",
    "TensorStats",
    "audit_tensor_numerics",
    "replay",
    "tensor_stats",
    # prevent and recover
    "BadDataPolicy",
    "ClipPolicy",
    "DynamicLossScaler",
    "GraphUnsafe",
    "GraphedStep",
    "Guard",
    "LadderPolicy",
    "LossSpikeHandler",
    "MasterWeights",
    "ReproPolicy",
    "ResponsePolicy",
    "RobustSpikeDetector",
    "Snapshot",
    "SnapshotPolicy",
    "SnapshotStore",
    "SpikePolicy",
    "StepResult",
    "TrendAlarm",
    "TrendPolicy",
    "TrendWatch",
    "WindowedZClip",
    "ZClip",
    "ZClipConfig",
    "clip_grad_norm_",
    "clip_grad_value_",
    "load_snapshot",
    # emulate low precision
    "Advice",
    "AuditReport",
    "EmulationRecipe",
    "ExpectedGap",
    "LayerAdvice",
    "advise",
    "audit",
    "emulate",
    "expected_gap",
    "restore",
    # understand
    "Event",
    "EventLog",
    "read_events",
    # errors (floatguard.errors: each also the builtin it stands for)
    "DistributedStop",
    "FloatguardError",
    "ForeignSnapshotError",
    "GuardDesync",
    "GuardStopped",
    "NotRegularFile",
    "NothingToEmulate",
    "PeerFailed",
    "ReproError",
    "SnapshotError",
    "SnapshotFolderBusy",
    "__version__",
]
