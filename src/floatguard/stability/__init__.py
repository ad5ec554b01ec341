"""What to do when numbers go wrong: clipping, spike detection, responses, snapshots."""

from floatguard.stability.clip import (
    ZClip,
    ZClipConfig,
    clip_grad_norm_,
    clip_grad_value_,
)
from floatguard.stability.respond import ClipPolicy, GuardStopped, ResponsePolicy, SpikePolicy
from floatguard.stability.response_parts import (
    BadDataPolicy,
    LadderPolicy,
    ReproPolicy,
    SnapshotPolicy,
)
from floatguard.stability.snapshot import Snapshot, SnapshotError, load_snapshot
from floatguard.stability.snapshot_store import SnapshotStore
from floatguard.stability.spikes import LossSpikeHandler, RobustSpikeDetector
from floatguard.stability.trend import TrendAlarm, TrendPolicy, TrendWatch
from floatguard.stability.zclip_windowed import WindowedZClip

__all__ = [
    "BadDataPolicy",
    "ClipPolicy",
    "GuardStopped",
    "LadderPolicy",
    "LossSpikeHandler",
    "ReproPolicy",
    "ResponsePolicy",
    "RobustSpikeDetector",
    "Snapshot",
    "SnapshotError",
    "SnapshotPolicy",
    "SnapshotStore",
    "SpikePolicy",
    "TrendAlarm",
    "TrendPolicy",
    "TrendWatch",
    "WindowedZClip",
    "ZClip",
    "ZClipConfig",
    "clip_grad_norm_",
    "clip_grad_value_",
    "load_snapshot",
]
