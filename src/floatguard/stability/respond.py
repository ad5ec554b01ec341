"""Policies: frozen configurations of clipping, spike detection and the response ladder."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from floatguard.stability.clip import ZClipConfig

__all__ = ["ClipPolicy", "GuardStopped", "ResponsePolicy", "SpikePolicy"]


class GuardStopped(RuntimeError):
    """Raised when the response ladder is exhausted (too many rollbacks)."""

    def __init__(self, message: str, report: Mapping[str, object]) -> None:
        super().__init__(message)
        self.report = dict(report)


@dataclass(frozen=True)
class ClipPolicy:
    """``kind="zclip"`` (default, ``zclip`` holds its settings), ``"norm"`` (clip the
    total norm to ``max_norm``), ``"value"`` (clamp elements to ``max_value``) or ``"none"``."""

    kind: Literal["zclip", "norm", "value", "none"] = "zclip"
    max_norm: float = 1.0
    max_value: float = 1.0
    norm_type: float = 2.0
    zclip: ZClipConfig = field(default_factory=ZClipConfig)

    def __post_init__(self) -> None:
        if self.kind not in ("zclip", "norm", "value", "none"):
            raise ValueError(
                f"ClipPolicy.kind={self.kind!r}; use 'zclip', 'norm', 'value' or 'none'"
            )
        if not self.max_norm > 0 or not self.max_value > 0:
            raise ValueError("ClipPolicy.max_norm and max_value must be > 0")


@dataclass(frozen=True)
class SpikePolicy:
    """Which signals to watch and how: ``detector="robust"`` (median/MAD z-score, window
    and ``z``) or ``"lesson"`` (window mean + ``threshold`` std with ``patience``)."""

    watch_loss: bool = True
    watch_grad_norm: bool = False
    detector: Literal["robust", "lesson"] = "robust"
    window: int = 50
    z: float = 6.0
    warmup: int = 10
    threshold: float = 5.0
    patience: int = 1

    def __post_init__(self) -> None:
        if self.detector not in ("robust", "lesson"):
            raise ValueError(f"SpikePolicy.detector={self.detector!r}; use 'robust' or 'lesson'")
        if not isinstance(self.window, int) or self.window < 3:
            raise ValueError(f"SpikePolicy.window={self.window!r} must be an int >= 3")
        if not self.z > 0 or not self.threshold > 0:
            raise ValueError("SpikePolicy.z and threshold must be > 0")


@dataclass(frozen=True)
class ResponsePolicy:
    """The ladder, per bad step (non-finite or spike):

    1. clip (the clip policy, every step);
    2. skip the step: no optimizer, scheduler or scaler growth, statistics untouched;
    3. after ``lr_backoff_after`` consecutive bad steps: multiply the LR by
       ``lr_backoff_factor``, then restore it linearly over ``lr_recovery_steps`` good steps;
    4. after ``rollback_after`` consecutive bad steps: restore the last good snapshot
       and skip the next ``skip_batches`` batches (the PaLM recipe);
    5. after ``max_rollbacks`` rollbacks: raise :class:`GuardStopped` with a report.

    Snapshots are taken every ``snapshot_every`` good steps (in memory; also on disk
    under ``snapshot_dir`` when set).
    """

    lr_backoff_after: int = 2
    lr_backoff_factor: float = 0.5
    lr_recovery_steps: int = 50
    rollback_after: int = 5
    skip_batches: int = 1
    max_rollbacks: int = 3
    snapshot_every: int = 20
    snapshot_dir: str | None = None

    def __post_init__(self) -> None:
        ints = (
            "lr_backoff_after",
            "lr_recovery_steps",
            "rollback_after",
            "max_rollbacks",
            "snapshot_every",
        )
        for name in ints:
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ResponsePolicy.{name}={v!r} must be an int >= 1")
        if not isinstance(self.skip_batches, int) or self.skip_batches < 0:
            raise ValueError(
                f"ResponsePolicy.skip_batches={self.skip_batches!r} must be an int >= 0"
            )
        if not 0 < self.lr_backoff_factor < 1:
            raise ValueError(
                f"ResponsePolicy.lr_backoff_factor={self.lr_backoff_factor!r} must be in (0, 1)"
            )
