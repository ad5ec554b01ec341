"""What the guard saves and restores: snapshots, resume, its framework state dict, skipped steps."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import torch

from floatguard.causes import CAUSES, Cause
from floatguard.guard import policy
from floatguard.guard.layout import check_layout, layout_of
from floatguard.guard.resume_agree import agreed_load
from floatguard.guard.types import StepResult
from floatguard.stability.step_state import set_rng_state

if TYPE_CHECKING:
    from floatguard.guard.channel import ReadChannel
    from floatguard.guard.emit import GuardEvents
    from floatguard.guard.judge import Judge
    from floatguard.guard.keeper import SnapshotKeeper
    from floatguard.guard.run import StepRunner
    from floatguard.scaling.loss_scale import DynamicLossScaler
    from floatguard.stability.step_state import StepState

__all__ = ["GuardPersistence", "guard_state_dict", "load_guard_state_dict", "stateful_objects"]

_OPTIONAL = ("zclip", "loss_detector", "norm_detector")


class GuardPersistence:
    """The guard's persistence methods (a part of :class:`~floatguard.guard.Guard`,
    kept apart so the façade reads as the step): the vetted snapshot of construction
    and of snapshot steps, ``resume`` from disk, ``state_dict`` / ``load_state_dict``
    for a framework's checkpoint, and ``skip_external`` for a step the framework
    skipped itself. The attributes below are the guard's own."""

    step_count: int
    _layout_memo: dict[str, Any] | None = None
    _ladder: policy.LadderState
    _previous_applied: bool
    _snapshot_pending: bool
    _model: torch.nn.Module
    _optimizer: torch.optim.Optimizer
    _scheduler: Any
    _scaler: DynamicLossScaler
    _device: torch.device
    _keeper: SnapshotKeeper
    _judge: Judge
    _emit: GuardEvents
    _state: StepState
    _runner: StepRunner
    _channel: ReadChannel

    zclip: Any
    loss_detector: Any
    norm_detector: Any
    _trend: Any

    def _discard(self) -> None:
        raise NotImplementedError

    def _stateful(self) -> dict[str, Any]:
        return stateful_objects(
            self._model,
            self._optimizer,
            self._scaler,
            self._scheduler,
            self.zclip,
            self.loss_detector,
            self.norm_detector,
        )

    def _snapshot_meta(self, state: policy.LadderState | None = None) -> dict[str, Any]:
        ladder = state or self._ladder
        return {
            **ladder.to_meta(),
            "step_rng": dict(self._state.rng),
            "layout": self._layout(),
        }

    def _layout(self) -> dict[str, Any]:
        """The world this rank's snapshots are written in: the world size and the
        DTensor meshes of the model's parameters (FSDP2, tensor parallelism), so that
        a resume in another world can refuse what it cannot load, or say what changed."""
        if self._layout_memo is None:
            self._layout_memo = layout_of(self._model, self._channel.peers)
        return self._layout_memo

    def _vouch_initial(self, step: int, magnitudes: Any) -> None:
        """The first snapshot (taken as the first step began) vetted with the magnitudes
        that step's read carried: kept, or dropped when the state was already bad."""
        vetting = self._judge.vet(step, False, magnitudes)
        if vetting.bad is not None:
            self._keeper.drop()
            self._emit.warning(step, f"no snapshot taken: {vetting.bad}", 0)
        else:
            self._keeper.vouch(step, vetting.amax)
            self._ladder = policy.snapshot_taken(self._ladder)

    def _snapshot_now(
        self,
        step: int,
        amax: dict[str, float] | None = None,
        state: policy.LadderState | None = None,
    ) -> policy.LadderState:
        """Snapshot the state before step ``step`` is applied (vetted: at construction
        here, on a snapshot step by :meth:`_decide`)."""
        if amax is None:
            vetting = self._judge.vet(step, self._previous_applied)
            if vetting.bad is not None:
                self._emit.warning(step, f"no snapshot taken: {vetting.bad}", 0)
                return state or self._ladder
            amax = vetting.amax
        ladder = policy.snapshot_taken(state or self._ladder)
        meta = self._snapshot_meta(ladder)
        self._keeper.take(step, self._stateful(), meta, amax, good_steps=ladder.good_steps)
        self._ladder = ladder
        return ladder

    def resume(self, path: str | os.PathLike[str] | None = None, *, foreign: bool = False) -> int:
        """Continue a run from its newest good snapshot on disk; returns the step to run next.

        ``path``: a snapshot file, or a folder of them (default: the policy's
        ``snapshot_dir``). This guard continues the run the snapshot folder belongs to
        (its ``floatguard-run.json``): a snapshot written by another run is *foreign*.
        In a folder, a newer snapshot that fails to verify, is misnamed (its name says
        another step: renamed or swapped) or is foreign is passed over for the one
        before it (a ``snapshot_fallback`` event each, saying why). A file named by
        ``path`` is refused for those instead (SnapshotError; ForeignSnapshotError for
        another run's); ``foreign=True`` takes another run's snapshot on purpose (a
        branch of a run, a file copied from elsewhere). The snapshot is checked against
        the model and optimizer (every tensor's name, shape and dtype) before anything
        is loaded: a misfit is a SnapshotError naming the first tensor that differs,
        with model and optimizer untouched. The snapshot folder's lock is taken first:
        SnapshotFolderBusy while another guard writes there.

        Under torch.distributed (every rank calls it) the ranks resume from the same
        step: the newest one every rank has a good snapshot of, each from its own file
        (:mod:`floatguard.guard.resume_agree`); when there is none, or a rank cannot
        load its file, every rank raises SnapshotError naming each rank's steps or the
        rank that failed, with nothing loaded anywhere.

        Model, optimizer, scaler, scheduler, clipper, detectors, the guard's counters
        and the torch RNG (as at the start of that step) are restored; a ``resume``
        event marks where the event stream picks up (with this rank's newest step and
        the ranks behind, when the step agreed is older). Feed the data from the
        returned step on.
        """
        objects, peers = self._stateful(), self._channel.peers
        newest: int | None = None
        behind: list[int] | None = None
        if peers is None:
            snap, used = self._keeper.load(path, self._device, objects, foreign=foreign)
        else:
            snap, used, agreed = agreed_load(
                self._keeper, peers, path, self._device, objects, foreign=foreign
            )
            newest = agreed.newest if agreed.newest != agreed.step else None
            behind = list(agreed.behind) or None
        written = check_layout(snap.meta.get("layout"), self._layout(), used)
        snap.restore(objects)
        self._load_counters(snap.meta)
        self.step_count = snap.step
        self._keeper.adopt(snap, used)
        self._snapshot_pending = False  # the snapshot resumed from is the one to keep
        self._previous_applied = False
        self._state.save()
        self._emit.resume(snap.step, str(used), newest, behind, written, snap.run_id)
        return snap.step

    def _load_counters(self, meta: dict[str, Any]) -> None:
        self._ladder = policy.LadderState.from_meta(meta)
        self._keeper.taken = int(meta.get("snapshots", 0))
        if meta.get("step_rng"):
            set_rng_state(meta["step_rng"])

    def skip_external(
        self,
        reason: Cause = "overflow",
        *,
        scale_before: float | None = None,
        scale_after: float | None = None,
    ) -> StepResult:
        """Record a step the training framework skipped on its own (an fp16 GradScaler
        that found an inf and did not call the optimizer): the losses recorded for it
        are dropped, the buffers restored, the step counted, and an ``overflow`` event
        (when the scales are given) and a ``step`` event written. One host read."""
        if reason not in CAUSES:
            raise ValueError(f"skip_external(reason={reason!r}); use one of {CAUSES}")
        step = self.step_count
        self.step_count += 1
        loss = float(self._runner.mean_loss()) if self._runner.losses else math.nan
        self._discard()
        self._state.save()
        self._previous_applied = False
        if scale_before is not None and scale_after is not None:
            self._emit.overflow(step, scale_before, scale_after)
        scale = scale_after if scale_after is not None else self._scaler.get_scale()
        result = StepResult(
            step, "skipped", reason, loss, math.nan, scale, 1.0, self._ladder.lr_factor,
            snapshot_age=self._keeper.age(self.step_count),
        )  # fmt: skip
        self._emit.step(result)
        return result

    def state_dict(self) -> dict[str, Any]:
        """The guard's own state, for a framework's checkpoint (Lightning keeps a
        callback's): step counter, counters, loss scaler, clipper and spike detectors.
        Not the model, optimizer or scheduler (the framework saves those)."""
        counters = {**self._ladder.to_meta(), "snapshots": self._keeper.taken}
        sd = guard_state_dict(self.step_count, counters, self._own_parts())
        sd["trend"] = self._trend.state_dict()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (a guard configured the same way).
        The guard then continues the run its ``snapshot_dir`` belongs to (as after
        :meth:`resume`), so a framework's resume keeps the folder's snapshots its own."""
        step_count, counters = load_guard_state_dict(sd, self._own_parts())
        if "trend" in sd:  # (a state saved before the trend watch has none)
            self._trend.load_state_dict(sd["trend"])
        self._keeper.continue_run()
        self.step_count = step_count
        self._load_counters(counters)
        self._snapshot_pending = True  # of the state the next step starts from

    def _own_parts(self) -> dict[str, Any]:
        return {
            "scaler": self._scaler,
            "zclip": self.zclip,
            "loss_detector": self.loss_detector,
            "norm_detector": self.norm_detector,
        }


def stateful_objects(
    model: Any,
    optimizer: Any,
    scaler: Any,
    scheduler: Any,
    zclip: Any,
    loss_detector: Any,
    norm_detector: Any,
) -> dict[str, Any]:
    """Everything a snapshot captures and a rollback restores, by the names snapshot
    files have always used (the optional ones only when configured)."""
    objs: dict[str, Any] = {"model": model, "optimizer": optimizer, "scaler": scaler}
    optional = {
        "scheduler": scheduler,
        "zclip": zclip,
        "loss_detector": loss_detector,
        "norm_detector": norm_detector,
    }
    objs.update({k: v for k, v in optional.items() if v is not None})
    return objs


def guard_state_dict(
    step_count: int, counters: dict[str, Any], parts: dict[str, Any]
) -> dict[str, Any]:
    """``{"step_count", "counters", "scaler", and "zclip" / "loss_detector" /
    "norm_detector" when configured}``: the keys ``Guard.state_dict`` has always had."""
    sd: dict[str, Any] = {
        "step_count": step_count,
        "counters": counters,
        "scaler": parts["scaler"].state_dict(),
    }
    for name in _OPTIONAL:
        if parts.get(name) is not None:
            sd[name] = parts[name].state_dict()
    return sd


def load_guard_state_dict(sd: dict[str, Any], parts: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Load the parts' states from ``sd``; the step count and counters to restore. A
    state saved by a guard set up differently is a ValueError naming what is missing."""
    missing = [n for n in _OPTIONAL if parts.get(n) is not None and n not in sd]
    if missing or "counters" not in sd:
        raise ValueError(
            f"Guard.load_state_dict: the state has no {missing or ['counters']}: it was "
            "saved by a guard set up differently"
        )
    parts["scaler"].load_state_dict(sd["scaler"])
    for name in _OPTIONAL:
        if parts.get(name) is not None:
            parts[name].load_state_dict(sd[name])
    return int(sd["step_count"]), dict(sd["counters"])
