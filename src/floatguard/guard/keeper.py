"""The snapshot keeper: the in-memory snapshot, the disk store and its error policy, resume."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from floatguard.guard.emit import GuardEvents
from floatguard.stability.snapshot import Snapshot, SnapshotError, SnapshotStore, load_snapshot

if TYPE_CHECKING:
    from floatguard.stability.respond import ResponsePolicy

__all__ = ["SnapshotKeeper"]


class SnapshotKeeper:
    """Keeps the snapshot a rollback restores, and writes every ``disk_every``-th one
    to ``snapshot_dir`` (verified files, ``snapshot_keep`` kept).

    The keeper stores what it is given; the guard vets the state first (finite
    weights and optimizer state, the magnitudes kept in ``amax`` for the locator's
    magnitude rule), so a snapshot never vouches for a non-finite value.
    """

    def __init__(self, policy: ResponsePolicy, events: GuardEvents) -> None:
        self.policy = policy
        self.events = events
        self.snapshot: Snapshot | None = None
        self.taken = 0
        self.amax: dict[str, float] = {}
        self.store = (
            SnapshotStore(policy.snapshot_dir, policy.snapshot_keep)
            if policy.snapshot_dir is not None
            else None
        )

    def due(self, good_steps: int) -> bool:
        """Whether the step about to be applied is a snapshot step."""
        return good_steps > 0 and good_steps % self.policy.snapshot_every == 0

    def take(
        self,
        step: int,
        objects: dict[str, Any],
        meta: dict[str, Any],
        amax: dict[str, float],
        *,
        vetted: bool = True,
    ) -> None:
        """Snapshot ``objects`` before step ``step`` is applied, in memory (copied into
        the previous snapshot's memory) and, every ``disk_every``-th time, on disk.
        ``vetted=False``: the state's check comes later (:meth:`vouch` or :meth:`drop`)."""
        self.snapshot = Snapshot.capture(
            step, objects, meta={**meta, "snapshots": self.taken}, reuse=self.snapshot
        )
        self.taken += 1
        if vetted:
            self.vouch(step, amax)

    def vouch(self, step: int, amax: dict[str, float]) -> None:
        """The snapshot just taken was vetted: keep its magnitudes, write it to disk when
        due, and say so (a ``snapshot`` event)."""
        assert self.snapshot is not None
        self.amax = dict(amax)
        where = "memory"
        if self.store is not None and (self.taken - 1) % self.policy.disk_every == 0:
            where = self._write(step, self.snapshot)
        self.events.snapshot(step, where)

    def drop(self) -> None:
        """Forget a snapshot that failed its vetting (never restored, never written)."""
        self.snapshot = None
        self.taken -= 1

    def _write(self, step: int, snap: Snapshot) -> str:
        """Write ``snap`` to the store; a failure is an event, then the policy acts."""
        store = self.store
        assert store is not None
        try:
            return str(store.save(snap))
        except (OSError, RuntimeError, SnapshotError) as e:
            policy = self.policy.on_snapshot_error
            error = f"{type(e).__name__}: {e}"
            self.events.snapshot_error(step, str(store.folder), error, policy)
            if policy == "disable":
                self.store = None
            elif policy == "raise":
                raise SnapshotError(
                    f"cannot write the snapshot of step {step} to {store.folder} "
                    f"({error}); the step was not applied"
                ) from e
            return "memory"

    def restore(self, objects: dict[str, Any]) -> int:
        """Load the snapshot back into ``objects``; the step it was taken before."""
        if self.snapshot is None:
            raise SnapshotError("no clean snapshot to roll back to")
        self.snapshot.restore(objects)
        return self.snapshot.step

    def load(
        self, path: str | os.PathLike[str] | None, device: torch.device, names: set[str]
    ) -> tuple[Snapshot, Path]:
        """The newest good snapshot at ``path`` (a file, or a folder of them; default the
        policy's ``snapshot_dir``), holding a state for each of ``names``; a newest
        one that fails to verify is passed over for the one before (an event each)."""
        target = Path(path) if path is not None else None
        if target is None and self.policy.snapshot_dir is not None:
            target = Path(self.policy.snapshot_dir)
        if target is None:
            raise ValueError(
                "Guard.resume() needs a path, or ResponsePolicy(snapshot_dir=...) to look in"
            )
        if target.is_dir():
            store = SnapshotStore(target, self.policy.snapshot_keep)
            snap, used, bad = store.load_latest(map_location=device)
        else:
            snap, used, bad = load_snapshot(target, map_location=device), target, []
        for p, why in bad:
            self.events.snapshot_fallback(snap.step, str(p), why, str(used))
        missing = sorted(names - set(snap.states))
        if missing:
            raise SnapshotError(
                f"{used} holds no state for {missing} (it has {sorted(snap.states)}): it was "
                "written by a guard set up differently"
            )
        return snap, used

    def adopt(self, snap: Snapshot) -> None:
        """After a resume: ``snap`` is the snapshot a rollback restores."""
        self.snapshot = snap
        self.taken = int(snap.meta.get("snapshots", self.taken))
        self.amax = {}
