"""The snapshot keeper: owns a guarded run's snapshot life-cycle.

One object holds the in-memory snapshot a rollback restores, the disk store with
its error policy, the folder's lock and resume. The guard drives it with a
step-shaped surface and nothing else: :meth:`SnapshotKeeper.begin_step` (the first
snapshot, or with ``snapshot_overlap`` the copy, as the step begins),
:meth:`~SnapshotKeeper.reads_state` (whether the step's one read carries the state's
magnitudes, to vet a snapshot), :meth:`~SnapshotKeeper.first_vetted`,
:meth:`~SnapshotKeeper.before_update` (the vetted snapshot of a snapshot step, taken
before the update overwrites the state), :meth:`~SnapshotKeeper.fence`,
:meth:`~SnapshotKeeper.end_step` / :meth:`~SnapshotKeeper.abort_step`, then
:meth:`~SnapshotKeeper.restore` (a rollback) and :meth:`~SnapshotKeeper.load` /
:meth:`~SnapshotKeeper.adopt` (a resume).

The folder (store, lock, run identity, resume loading) is its
:class:`~floatguard.stability.snapshot_disk.SnapshotDisk`, ``keeper.disk``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from floatguard.stability.snapshot import Snapshot, SnapshotError
from floatguard.stability.snapshot_cadence import SnapshotCadence
from floatguard.stability.snapshot_disk import SnapshotDisk, SnapshotEvents

if TYPE_CHECKING:
    from floatguard.stability.respond import ResponsePolicy

__all__ = ["SnapshotEvents", "SnapshotKeeper"]  # (SnapshotEvents: snapshot_disk's)

Capture = Callable[[], tuple[dict[str, Any], dict[str, Any]]]  # (objects, meta), now


def _tensors(objects: dict[str, Any]) -> list[torch.Tensor]:
    model = objects.get("model")
    return list(model.parameters()) if isinstance(model, torch.nn.Module) else []


class SnapshotKeeper:
    """Keeps the snapshot a rollback restores, and writes every ``disk_every``-th one
    to ``snapshot_dir`` (verified files, ``snapshot_keep`` kept).

    The keeper stores what it is given; the guard vets the state first (finite
    weights and optimizer state, the magnitudes kept in ``amax`` for the locator's
    magnitude rule), so a snapshot never vouches for a non-finite value.

    ``disk_step``: the step of the newest snapshot on disk (written, or resumed from);
    :meth:`age` says how far behind it is.
    """

    def __init__(self, policy: ResponsePolicy, events: SnapshotEvents) -> None:
        self.policy = policy
        self.events = events
        self.snapshot: Snapshot | None = None
        self.taken = 0
        self.amax: dict[str, float] = {}
        self.vouched_step: int | None = None  # the step whose vetting last found it good
        self.disk = SnapshotDisk(policy, events)  # the folder: store, lock, run, resume
        self._first: int | None = None  # the step of the first snapshot taken
        self.cadence = SnapshotCadence(policy.snapshot_every)
        self._accelerated = False  # the state is on an accelerator (set at the first take)
        self._on: Literal["host", "device"] | None = None  # where snapshots go (first take)
        # snapshot_overlap: the copy taken as its step began, until vetted (or dropped),
        # and the memory of the one before the current snapshot, reused for the next
        self.pending: Snapshot | None = None
        self._spare: Snapshot | None = None
        # The first snapshot is of the state the first step starts from (taken then,
        # vetted by that step's read): weights loaded after the guard was built (a
        # fine-tune's pretrained weights, a resume through load_state_dict) are kept.
        self.first_due = True
        self._vetting_first = False  # the first snapshot, taken as this step began

    # ------------------------------------------------------------ the step
    def begin_step(self, step: int, good_steps: int, capture: Capture) -> None:
        """Step ``step`` begins: its wall time feeds the snapshot budget; the first
        snapshot (unvetted until the step's read) or, with ``snapshot_overlap``, a due
        snapshot's copy is taken of the state ``capture()`` gives."""
        self.cadence.tick()
        if self.first_due:
            self.first_due, self._vetting_first = False, True
            objects, meta = capture()
            self.take(step, objects, meta, {}, vetted=False)
        elif self.opens(good_steps):
            objects, meta = capture()
            self.take(step, objects, meta, {}, pending=True)

    @property
    def vetting_first(self) -> bool:
        """Whether this step's read vets the first snapshot (:meth:`first_vetted`)."""
        return self._vetting_first

    def reads_state(self, good_steps: int) -> bool:
        """Whether this step's one read carries the state's magnitudes (to vet the first
        snapshot, or the snapshot of a snapshot step)."""
        return self._vetting_first or self.due(good_steps)

    def first_vetted(self, step: int, bad: object, amax: dict[str, float]) -> bool:
        """The first snapshot vetted with the step's read: kept (True), or dropped with a
        warning when the state was already bad (``bad``, not None, says why)."""
        if bad is not None:
            self._vetting_first = False
            self.drop()
            self.events.warning(step, f"no snapshot taken: {bad}", 0)
            return False
        self.vouch(step, amax)  # a write that raises: abort_step() drops it, retaken next
        self._vetting_first = False
        return True

    def before_update(
        self, step: int, objects: dict[str, Any], meta: dict[str, Any],
        amax: dict[str, float], good_steps: int,
    ) -> None:  # fmt: skip
        """A snapshot step about to be applied: the state (vetted, magnitudes ``amax``)
        is kept before the update overwrites it."""
        self.take(step, objects, meta, amax, good_steps=good_steps)

    def end_step(self) -> None:
        """The step is over: an overlapped copy it did not vouch for is let go."""
        self.settle()

    def abort_step(self) -> None:
        """The step raised before it was applied: as if it had not begun (a first
        snapshot it did not vet is forgotten and taken again by the next step)."""
        self.settle()
        if self._vetting_first:
            self._vetting_first = False
            self.drop()
            self.first_due = True

    def age(self, next_step: int) -> int | None:
        """How many steps a resume from the newest snapshot on disk would run again
        when ``next_step`` is the step to run next (from the first step on when none
        was written); None without a ``snapshot_dir`` or before the first step."""
        base = self.disk.disk_step if self.disk.disk_step is not None else self._first
        return None if self.disk.home is None or base is None else next_step - base

    def due(self, good_steps: int) -> bool:
        """Whether the step about to be applied is a snapshot step (with
        ``snapshot_overlap``: whether a copy was taken as it began, to be vetted)."""
        if self.policy.snapshot_overlap:
            return self.pending is not None
        return self.cadence.due(good_steps)

    def opens(self, good_steps: int) -> bool:
        """With ``snapshot_overlap``: whether the step beginning now starts a snapshot's
        copy (a snapshot is due and the first one was kept)."""
        return (
            self.policy.snapshot_overlap
            and self.snapshot is not None
            and self.pending is None
            and self.cadence.due(good_steps)
        )

    def settle(self) -> None:
        """The step is over: a copy it started and did not vouch for (the step was not
        applied, or raised) is waited for and its memory kept for the next one."""
        if self.pending is not None:
            self.pending.wait()
            self._spare, self.pending = self.pending, None

    def fence(self) -> None:
        """Before the optimizer step overwrites the state: a host snapshot's copy still
        in flight is waited for on the device (no host wait)."""
        for snap in (self.snapshot, self.pending):
            if snap is not None:
                snap.fence()

    def _budget(self, on: str) -> float | None:
        b = self.policy.snapshot_budget
        if b == "auto":
            return 0.01 if on == "host" and self._accelerated else None
        return b

    def take(
        self,
        step: int,
        objects: dict[str, Any],
        meta: dict[str, Any],
        amax: dict[str, float],
        *,
        vetted: bool = True,
        good_steps: int = 0,
        pending: bool = False,
    ) -> None:
        """Snapshot ``objects`` before step ``step`` is applied, in memory (copied into
        the previous snapshot's memory) and, every ``disk_every``-th time, on disk.
        ``vetted=False``: the state's check comes later (:meth:`vouch` or :meth:`drop`).
        ``pending``: with ``snapshot_overlap``, the copy as the step begins, into the
        spare memory; the current snapshot stays the one a rollback restores until
        the step is applied, when :meth:`take` makes this one current instead."""
        if self.pending is not None and not pending:  # vetted, the step applied
            snap, self.pending = self.pending, None
            self._spare, self.snapshot = self.snapshot, snap
            snap.meta = {**meta, "snapshots": self.taken}
            self._taken(step, good_steps, vetted, amax)
            return
        if self.snapshot is not None:  # what the last copy cost, for the budget
            self.cadence.cost(self.snapshot.copy_seconds())
        if self._on is None:  # "auto" decided once, from where the parameters are
            self._accelerated = any(p.device.type != "cpu" for p in _tensors(objects))
            place = self.policy.snapshot_on
            self._on = ("host" if self._accelerated else "device") if place == "auto" else place
        # Python's and NumPy's RNG states (~60 us) only in a snapshot bound for disk, for
        # a resume; a rollback in memory puts back torch's (see restore).
        to_disk = self.disk.writing and self.taken % self.policy.disk_every == 0
        snap = Snapshot.capture(
            step,
            objects,
            meta={**meta, "snapshots": self.taken},
            reuse=self._spare if pending else self.snapshot,
            on=self._on,
            rng=True if to_disk else "torch",
        )
        self._accelerated = self._accelerated and snap.on == "host"
        self.cadence.budget = self._budget(snap.on)
        if pending:
            self.pending, self._spare = snap, None
            return
        self.snapshot = snap
        self._taken(step, good_steps, vetted, amax)

    def _taken(self, step: int, good_steps: int, vetted: bool, amax: dict[str, float]) -> None:
        self.cadence.taken(good_steps)
        self.taken += 1
        if self._first is None:
            self._first = step
        if vetted:
            self.vouch(step, amax)

    def vouch(self, step: int, amax: dict[str, float]) -> None:
        """The snapshot just taken was vetted: keep its magnitudes, write it to disk when
        due, and say so (a ``snapshot`` event)."""
        assert self.snapshot is not None
        self.amax = dict(amax)
        self.vouched_step = step
        where, freed = "memory", None
        store = self.disk.store
        if store is not None and (self.taken - 1) % self.policy.disk_every == 0:
            where = self.disk.write(step, self.snapshot)
            freed = store.freed if self.disk.writing and where != "memory" else None
        self.events.snapshot(step, where, str(freed) if freed is not None else None)

    def drop(self) -> None:
        """Forget a snapshot that failed its vetting (never restored, never written)."""
        if self.pending is not None:
            self.settle()
            return
        if self.snapshot is not None:
            self.snapshot.wait()
        self.snapshot = None
        self.taken -= 1

    def restore(self, objects: dict[str, Any]) -> int:
        """Load the snapshot back into ``objects``; the step it was taken before."""
        self.settle()  # a copy still reading the state waits before it is overwritten
        if self.snapshot is None:
            raise SnapshotError("no clean snapshot to roll back to")
        # torch's RNG goes back with the weights; Python's and NumPy's belong to the
        # data pipeline, which a rollback does not rewind
        self.snapshot.restore(objects, rng="torch")
        return self.snapshot.step

    def close(self) -> None:
        """Let go of the snapshot folder's lock (taken again at the next write)."""
        self.disk.close()

    def adopt(self, snap: Snapshot, used: Path) -> None:
        """After a resume from ``used``: ``snap`` is the snapshot a rollback restores, and
        this guard continues the snapshot folder's run (:meth:`SnapshotDisk.adopt`)."""
        self.snapshot, self.first_due = snap, False  # the snapshot resumed from is kept
        self.taken = int(snap.meta.get("snapshots", self.taken))
        self.amax = {}
        self.disk.adopt(snap, used)

    def continue_run(self, snapshots: int) -> None:
        """A guard restored from a framework's checkpoint (``Guard.load_state_dict``,
        ``snapshots`` taken before) continues the snapshot folder's run, when the folder
        has one; its next step takes the first snapshot afresh."""
        self.taken, self.first_due = snapshots, True
        self.disk.continue_run()
