"""What the guard saves and restores (composed, not a mixin): its run state, snapshots'
contents, resume, its framework state dict."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from floatguard.guard import policy
from floatguard.guard.layout import check_layout, layout_of
from floatguard.guard.resume_agree import agreed_load
from floatguard.stability.step_state import set_rng_state

if TYPE_CHECKING:
    from floatguard.guard.channel import ReadChannel
    from floatguard.guard.emit import GuardEvents
    from floatguard.guard.judge import Judge
    from floatguard.stability.snapshot_keeper import SnapshotKeeper
    from floatguard.stability.step_state import StepState
    from floatguard.stability.trend import TrendWatch

__all__ = [
    "GuardCheckpoint",
    "RunState",
    "Stage",
    "guard_state_dict",
    "load_guard_state_dict",
]

_OPTIONAL = ("zclip", "loss_detector", "norm_detector")


Stage = Literal["idle", "running", "deciding", "applied"]


@dataclass
class RunState:
    """The guard's own run state, one object shared by the guard, its actor and its
    checkpoint: the step counter, the response policy's counters, whether the last
    step was applied, and the *stage* of the step in flight (one value, as
    GradScaler's ``OptState``): ``"idle"`` between steps, ``"running"`` its closures,
    ``"deciding"`` its read and judgement (a raise then undoes the step), ``"applied"``
    once ``optimizer.step()`` ran whole (from then on nothing undoes it)."""

    step_count: int = 0
    ladder: policy.LadderState = field(default_factory=policy.LadderState)
    previous_applied: bool = False
    stage: Stage = "idle"

    def applied(self) -> bool:
        """Whether the step in flight was applied (nothing undoes it any more)."""
        return self.stage == "applied"


class GuardCheckpoint:
    """What the guard saves and restores, composed (torchtitan's ``Stateful`` shape):
    the objects a snapshot holds and its metadata, the vetted snapshot of a snapshot
    step, ``resume`` from disk, and ``state_dict`` / ``load_state_dict`` for a
    framework's checkpoint. It reads and writes the run's :class:`RunState`; the
    snapshot life-cycle itself is the keeper's."""

    def __init__(
        self, run: RunState, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
        scheduler: Any, own: Callable[[], dict[str, Any]], keeper: SnapshotKeeper,
        judge: Judge, channel: ReadChannel, state: StepState, trend: TrendWatch,
        emit: GuardEvents, device: torch.device,
    ) -> None:  # fmt: skip
        self.run, self.optimizer, self.scheduler, self._own = run, optimizer, scheduler, own
        self.keeper, self.judge, self.channel, self.state = keeper, judge, channel, state
        self.trend, self.emit, self.model, self.device = trend, emit, model, device
        self._layout_memo: dict[str, Any] | None = None

    def objects(self) -> dict[str, Any]:
        """Everything a snapshot captures and a rollback restores, by the names snapshot
        files have always used (the optional ones only when configured)."""
        own = self._own()
        objs = {"model": self.model, "optimizer": self.optimizer, "scaler": own.pop("scaler")}
        objs.update(
            {k: v for k, v in {"scheduler": self.scheduler, **own}.items() if v is not None}
        )
        return objs

    def capture(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The objects a snapshot holds and its metadata, now."""
        return self.objects(), self.meta()

    def meta(self, ladder: policy.LadderState | None = None) -> dict[str, Any]:
        """A snapshot's metadata: the policy's counters, the step's RNG, the layout."""
        ladder = ladder or self.run.ladder
        return {**ladder.to_meta(), "step_rng": dict(self.state.rng), "layout": self.layout()}

    def layout(self) -> dict[str, Any]:
        """The world this rank's snapshots are written in: the world size and the
        DTensor meshes of the model's parameters (FSDP2, tensor parallelism), so that
        a resume in another world can refuse what it cannot load, or say what changed."""
        if self._layout_memo is None:
            self._layout_memo = layout_of(self.model, self.channel.peers)
        return self._layout_memo

    def first_vetted(self, step: int, magnitudes: Any) -> None:
        """The first snapshot (taken as the first step began) vetted with the magnitudes
        that step's read carried: kept, or dropped when the state was already bad."""
        vetting = self.judge.vet(step, False, magnitudes)
        if self.keeper.first_vetted(step, vetting.bad, vetting.amax):
            self.run.ladder = policy.snapshot_taken(self.run.ladder)

    def before_update(
        self, step: int, amax: dict[str, float], state: policy.LadderState
    ) -> policy.LadderState:
        """A snapshot step's state, vetted (magnitudes ``amax``), kept before the update;
        the policy's state after it (the guard's :class:`Actor` calls it)."""
        ladder = policy.snapshot_taken(state)
        self.keeper.before_update(step, self.objects(), self.meta(ladder), amax, ladder.good_steps)
        self.run.ladder = ladder
        return ladder

    def resume(self, path: str | os.PathLike[str] | None, foreign: bool) -> int:
        """:meth:`Guard.resume <floatguard.guard.Guard.resume>`."""
        objects, peers = self.objects(), self.channel.peers
        newest: int | None = None
        behind: list[int] | None = None
        if peers is None:
            snap, used = self.keeper.disk.load(path, self.device, objects, foreign=foreign)
        else:
            snap, used, agreed = agreed_load(
                self.keeper.disk, peers, path, self.device, objects, foreign=foreign
            )
            newest = agreed.newest if agreed.newest != agreed.step else None
            behind = list(agreed.behind) or None
        written = check_layout(snap.meta.get("layout"), self.layout(), used)
        snap.restore(objects)
        self._load_counters(snap.meta)
        self.run.step_count = snap.step
        self.keeper.adopt(snap, used)
        self.run.previous_applied = False
        self.state.save()
        self.emit.resume(snap.step, str(used), newest, behind, written, snap.run_id)
        return snap.step

    def _load_counters(self, meta: dict[str, Any]) -> None:
        self.run.ladder = policy.LadderState.from_meta(meta)
        if meta.get("step_rng"):
            set_rng_state(meta["step_rng"])

    def state_dict(self) -> dict[str, Any]:
        """:meth:`Guard.state_dict <floatguard.guard.Guard.state_dict>`."""
        counters = {**self.run.ladder.to_meta(), "snapshots": self.keeper.taken}
        sd = guard_state_dict(self.run.step_count, counters, self._own())
        sd["trend"] = self.trend.state_dict()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """:meth:`Guard.load_state_dict <floatguard.guard.Guard.load_state_dict>`."""
        step_count, counters = load_guard_state_dict(sd, self._own())
        if "trend" in sd:  # (a state saved before the trend watch has none)
            self.trend.load_state_dict(sd["trend"])
        self.keeper.continue_run(int(counters.get("snapshots", 0)))
        self.run.step_count = step_count
        self._load_counters(counters)


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
