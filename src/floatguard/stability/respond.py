"""Policies: frozen configurations of clipping, spike detection and the response ladder."""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from floatguard.errors import FloatguardError
from floatguard.stability.clip import ZClipConfig
from floatguard.stability.response_parts import (
    PARTS,
    BadDataPolicy,
    LadderPolicy,
    ReproPolicy,
    SnapshotPolicy,
    check,
)

__all__ = ["ClipPolicy", "GuardStopped", "ResponsePolicy", "SpikePolicy"]

ClipKind = Literal["zclip", "norm", "value", "none"]
DetectorKind = Literal["robust", "lesson"]
SnapshotErrorPolicy = Literal["retry", "disable", "raise"]
SnapshotPlace = Literal["auto", "host", "device"]
ReproLevel = Literal["minimal", "step"]


class GuardStopped(FloatguardError, RuntimeError):
    """Raised when the guard stops the run: ``report`` holds the step, the stop's
    ``reason`` (a :data:`~floatguard.causes.StopReason`), the ``cause``, the rollbacks,
    the number of events written and the fault as text; ``fault`` is the fault itself
    (a :class:`~floatguard.monitor.localize.Fault`, None when there was none)."""

    def __init__(
        self, message: str, report: Mapping[str, object], fault: object | None = None
    ) -> None:
        super().__init__(message)
        self.report = dict(report)
        self.fault = fault


@dataclass(frozen=True)
class ClipPolicy:
    """``kind="zclip"`` (default, ``zclip`` holds its settings), ``"norm"`` (clip the
    total norm to ``max_norm``), ``"value"`` (clamp elements to ``max_value``) or ``"none"``.

    ``norm_type``: the norm the guard measures, clips on and watches for spikes (2 by
    default, ``math.inf`` for the largest element, any p >= 1). Under
    torch.distributed only 2 is supported (the ranks add squared norms).
    """

    kind: ClipKind = "zclip"
    max_norm: float = 1.0
    max_value: float = 1.0
    norm_type: float = 2.0
    zclip: ZClipConfig = field(default_factory=ZClipConfig)

    def __post_init__(self) -> None:
        if self.kind not in get_args(ClipKind):
            raise ValueError(
                f"ClipPolicy.kind={self.kind!r}; use 'zclip', 'norm', 'value' or 'none'"
            )
        if not self.max_norm > 0 or not self.max_value > 0:
            raise ValueError("ClipPolicy.max_norm and max_value must be > 0")
        if (
            isinstance(self.norm_type, bool)
            or not isinstance(self.norm_type, (int, float))
            or not self.norm_type >= 1
        ):
            raise ValueError(
                f"ClipPolicy.norm_type={self.norm_type!r} must be a number >= 1 (2 for the "
                "Euclidean norm, math.inf for the largest element)"
            )


@dataclass(frozen=True)
class SpikePolicy:
    """Which signals to watch and how: ``detector="robust"`` (median/MAD z-score, window
    and ``z``) or ``"lesson"`` (window mean + ``threshold`` std with ``patience``).

    The robust detector calls a value a spike only when its z-score is above ``z``
    **and** it jumps materially over the window's median (by ``min_rel`` of it for the
    loss, ``grad_norm_min_rel`` for the gradient norm, whose early-training swings of
    2x are ordinary) **and** it goes ``range_rel`` beyond the range the window has
    come back from; exact zeros (a hinge loss) are left out of its statistics, and
    ``min_spread`` gives an all-zero window an absolute scale. See
    :class:`~floatguard.stability.spikes.RobustSpikeDetector` and the false-spike table
    in ``docs/guard.md``.
    """

    watch_loss: bool = True
    watch_grad_norm: bool = False
    detector: DetectorKind = "robust"
    window: int = 50
    z: float = 6.0
    warmup: int = 10
    threshold: float = 5.0
    patience: int = 1
    min_rel: float = 0.5
    grad_norm_min_rel: float = 2.0
    range_rel: float = 1.5
    min_spread: float = 0.0

    def __post_init__(self) -> None:
        if self.detector not in get_args(DetectorKind):
            raise ValueError(f"SpikePolicy.detector={self.detector!r}; use 'robust' or 'lesson'")
        if not isinstance(self.window, int) or self.window < 3:
            raise ValueError(f"SpikePolicy.window={self.window!r} must be an int >= 3")
        if not self.z > 0 or not self.threshold > 0:
            raise ValueError("SpikePolicy.z and threshold must be > 0")
        for name in ("min_rel", "grad_norm_min_rel", "range_rel", "min_spread"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(
                    f"SpikePolicy.{name}={v!r} must be a finite number >= 0 (0 turns that bar off)"
                )


@dataclass(frozen=True, init=False)
class ResponsePolicy:
    """What the guard does with a bad step, by cause.

    - a non-finite input batch: skip it (LR and loss scale unchanged; not counted);
    - an fp16 gradient overflow with a finite loss: back the loss scale off (not
      counted);
    - a non-finite parameter or optimizer state: roll back to the last snapshot on
      that step (skipping cannot heal it);
    - a transient fault (a replay of the step is clean): skip it and count it; after
      ``transient_warn_after`` of them a ``warning`` event names the likely causes;
    - a loss or gradient-norm spike, or another deterministic fault (or one that could
      not be localized): the ladder. Skip; after ``lr_backoff_after`` consecutive
      such steps multiply the LR by ``lr_backoff_factor`` (restored linearly over
      ``lr_recovery_steps`` good steps); after ``rollback_after`` restore the last
      snapshot and skip the next ``skip_batches`` batches (the PaLM recipe; 0 by
      default: no good batch is thrown away unless you ask);
    - a batch that is non-finite when the step is given it (``nonfinite_input``) is
      skipped; ``bad_data_warn_after`` of them in a row is a ``warning`` event;
      ``bad_data_stop_after`` in a row, or a ``bad_data_stop_fraction`` of the last
      ``bad_data_window`` decided steps (once ``bad_data_stop_after`` were seen) stops the run
      (reason ``bad_data``): the data pipeline produces non-finite values;
    - the same deterministic fault again after a rollback, before the next snapshot:
      stop (:class:`GuardStopped`) with the fault named; after ``max_rollbacks``
      rollbacks in a row (fewer than ``rollback_window`` good steps between them):
      stop. Rare faults far apart (a cosmic ray a day) never add up to a stop.

    Snapshots are taken every ``snapshot_every`` good steps, of weights that have just
    given a finite loss and gradients, in memory (copied into the same buffers each
    time). A rollback loses at most ``snapshot_every`` steps. With ``snapshot_dir``,
    every ``disk_every``-th of them is also written there (verified files, the last
    ``snapshot_keep`` kept; :meth:`Guard.resume` continues a run from the newest good
    one). A failed write is a ``snapshot_error`` event and, per
    ``on_snapshot_error``: ``"retry"`` at the next snapshot (default), ``"disable"``
    writing for the rest of the run, or ``"raise"`` :class:`SnapshotError` with the
    step not applied (model, optimizer, gradients and counters as before it).

    Where the snapshot lives (``snapshot_on``): ``"host"`` keeps it in host memory
    (pinned buffers allocated once, copied from the accelerator on a side stream
    without a host wait; the optimizer step waits for the copy on the device, and a
    rollback or a write to disk waits on the host), ``"device"`` on the tensors' own
    device (a second copy of weights and optimizer state there), ``"auto"`` (default)
    host when the state is on an accelerator, device on a CPU (where both are the same
    memory). How often (``snapshot_budget``): a fraction of step time the snapshot
    copies may cost; the interval between snapshots is raised above
    ``snapshot_every`` until the measured copy time, spread over it, is at most that
    share of the measured step time (``"auto"``: 0.01 for host snapshots of
    accelerator state, None on a CPU; None: every ``snapshot_every`` good steps,
    deterministic). A budget makes the cadence depend on measured times, so two runs
    with the same seed may snapshot at different steps (each snapshot is an event).

    ``snapshot_overlap=True``: a snapshot is copied as its step begins (the state the
    last update left), while the step's forward and backward run, and becomes the
    rollback target once that step's read has vetted it and the step is applied;
    until then the previous snapshot stays the target. That needs a second copy of
    the state (twice the snapshot's memory, in host memory for host snapshots); the
    copy then costs the step only what the forward and backward do not hide (with
    ``step(closure)``; in the three-call loop they have run before ``step()``).

    ``repro_dir``: write a *repro bundle* there for each distinct fault (off by
    default): one checksummed file ``floatguard repro`` re-runs in a fresh process,
    and turns into a standalone script (:mod:`floatguard.repro`). ``repro_level``
    ``"minimal"`` keeps the birth's module (its ops from its inputs to the non-finite
    value, its call inputs and ``state_dict``: sized like the module);
    ``"step"`` the whole step (every op, the batch, the pre-step model, optimizer,
    scaler and RNG state, captured before a rollback), and a bundle for each
    spike too. ``repro_keep`` bundles are kept (this rank's oldest removed). A
    healthy step costs nothing; a bad step is re-run once more to record it.

    The keywords come in four parts, each a policy of its own that may be given whole
    (:mod:`floatguard.stability.response_parts`): ``ladder=LadderPolicy(...)``,
    ``snapshots=SnapshotPolicy(every=, dir=, keep=, ...)``, ``bad_data=BadDataPolicy(...)``,
    ``repro=ReproPolicy(dir=, level=, keep=)``; ``policy.snapshots`` etc. read them back.
    A part and a keyword of it given together must agree (else ValueError). Presets:
    :meth:`durable`, :meth:`debugging`.
    """

    def __init__(
        self,
        *,
        ladder: LadderPolicy | None = None,
        snapshots: SnapshotPolicy | None = None,
        bad_data: BadDataPolicy | None = None,
        repro: ReproPolicy | None = None,
        **flat: Any,
    ) -> None:
        known = {f.name: f.default for f in fields(ResponsePolicy)}
        unknown = sorted(set(flat) - set(known))
        if unknown:
            near = difflib.get_close_matches(unknown[0], [*known, *PARTS], n=1)
            raise TypeError(
                f"ResponsePolicy() got unknown keyword(s) {unknown}"
                + (f": did you mean {near[0]!r}?" if near else "")
                + f" The keywords are {sorted(known)}, or the parts {sorted(PARTS)}"
            )
        values = dict(known)
        # every flat keyword given and a part: dataclasses.replace(policy, part=...), where
        # the part replaces its fields
        replacing = set(flat) == set(known)
        parts: dict[str, Any] = {}
        for key, part in (("ladder", ladder), ("snapshots", snapshots),
                          ("bad_data", bad_data), ("repro", repro)):  # fmt: skip
            if part is None:
                continue
            cls = PARTS[key][0]
            if not isinstance(part, cls):
                raise TypeError(f"ResponsePolicy({key}={part!r}): give a {cls.__name__}")
            for name, value in part.flat().items():
                if name in flat and not replacing and not _same(flat[name], value):
                    raise ValueError(
                        f"ResponsePolicy({name}={flat[name]!r}, {key}=...) disagree: the "
                        f"{cls.__name__} says {value!r}; give it once"
                    )
                parts[name] = value
        values.update(flat)
        values.update(parts)
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self.__post_init__()

    lr_backoff_after: int = 2
    lr_backoff_factor: float = 0.5
    lr_recovery_steps: int = 50
    rollback_after: int = 5
    skip_batches: int = 0
    max_rollbacks: int = 3
    rollback_window: int = 1000
    snapshot_every: int = 5
    snapshot_dir: str | None = field(default=None, metadata={"per_rank": True})
    snapshot_keep: int = 2
    disk_every: int = 1
    on_snapshot_error: SnapshotErrorPolicy = "retry"
    transient_warn_after: int = 3
    bad_data_warn_after: int = 3
    bad_data_stop_after: int = 10
    bad_data_window: int = 50
    bad_data_stop_fraction: float = 0.5
    snapshot_on: SnapshotPlace = "auto"
    snapshot_budget: float | Literal["auto"] | None = "auto"
    snapshot_overlap: bool = False
    repro_dir: str | os.PathLike[str] | None = field(default=None, metadata={"per_rank": True})
    repro_level: ReproLevel = "minimal"
    repro_keep: int = 5

    def __post_init__(self) -> None:
        check({f.name: getattr(self, f.name) for f in fields(ResponsePolicy)})

    def _part(self, key: str) -> Any:
        cls, names = PARTS[key]
        return cls(**{own: getattr(self, flat) for own, flat in names.items()})

    @property
    def ladder(self) -> LadderPolicy:
        """The ladder's settings, as one part."""
        return self._part("ladder")  # type: ignore[no-any-return]

    @property
    def snapshots(self) -> SnapshotPolicy:
        """The snapshots' settings, as one part."""
        return self._part("snapshots")  # type: ignore[no-any-return]

    @property
    def bad_data(self) -> BadDataPolicy:
        """The bad-data settings, as one part."""
        return self._part("bad_data")  # type: ignore[no-any-return]

    @property
    def repro(self) -> ReproPolicy:
        """The repro bundles' settings, as one part."""
        return self._part("repro")  # type: ignore[no-any-return]

    @staticmethod
    def per_rank_fields() -> tuple[str, ...]:
        """The fields each rank may set differently (its own folders: the field's
        ``per_rank`` metadata); the others must match across ranks (the guard's
        configuration fingerprint compares them)."""
        return tuple(f.name for f in fields(ResponsePolicy) if f.metadata.get("per_rank"))

    @classmethod
    def durable(cls, snapshot_dir: str | os.PathLike[str], **overrides: Any) -> ResponsePolicy:
        """Every snapshot also on disk in ``snapshot_dir``, three kept, and a write that
        fails stops the step (``on_snapshot_error="raise"``): a run that must be able to
        resume from its newest snapshot after a crash."""
        base = {"snapshot_dir": str(snapshot_dir), "snapshot_keep": 3, "disk_every": 1,
                "on_snapshot_error": "raise"}  # fmt: skip
        return cls(**{**base, **_set_fields(overrides)})

    @classmethod
    def debugging(cls, repro_dir: str | os.PathLike[str], **overrides: Any) -> ResponsePolicy:
        """For finding a bug: every distinct fault and spike written as a whole-step
        repro bundle to ``repro_dir`` (``floatguard repro`` re-runs it)."""
        return cls(**{"repro_dir": repro_dir, "repro_level": "step", **_set_fields(overrides)})


def _same(a: object, b: object) -> bool:
    """Equal, a path and its string alike."""
    if isinstance(a, os.PathLike) or isinstance(b, os.PathLike):
        return (
            isinstance(a, (str, os.PathLike))
            and isinstance(b, (str, os.PathLike))
            and (os.fspath(a) == os.fspath(b))
        )
    return a == b


def _set_fields(overrides: dict[str, Any]) -> dict[str, Any]:
    """A preset's overrides as flat keywords: a part gives the fields it sets (those not
    at their defaults), so the preset's other choices stay."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        if key in PARTS and value is not None:
            if not isinstance(value, PARTS[key][0]):
                raise TypeError(f"ResponsePolicy({key}={value!r}): give a {PARTS[key][0].__name__}")
            part: Any = value
            default: dict[str, Any] = PARTS[key][0]().flat()
            out.update({k: v for k, v in part.flat().items() if v != default[k]})
        else:
            out[key] = value
    return out
