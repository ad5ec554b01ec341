"""The guard's persistence methods (:class:`GuardPersistence`, a base of
:class:`~floatguard.guard.core.Guard`): resume from a snapshot on disk, and the guard's
own state for a framework's checkpoint. Each settles a deferred step first."""

from __future__ import annotations

import os
from typing import Any

from floatguard.guard.types import StepResult
from floatguard.guard.views import GuardViews

__all__ = ["GuardPersistence"]


class GuardPersistence(GuardViews):
    """:meth:`resume`, :meth:`state_dict`, :meth:`load_state_dict` of the guard."""

    def settle(self) -> StepResult | None:  # (the guard's)
        raise NotImplementedError

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
        self.settle()
        return self._c.checkpoint.resume(path, foreign)

    def state_dict(self) -> dict[str, Any]:
        """The guard's own state, for a framework's checkpoint (Lightning keeps a
        callback's): step counter, counters, loss scaler, clipper and spike detectors.
        Not the model, optimizer or scheduler (the framework saves those)."""
        self.settle()
        return self._c.checkpoint.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (a guard configured the same way).
        The guard then continues the run its ``snapshot_dir`` belongs to (as after
        :meth:`resume`), so a framework's resume keeps the folder's snapshots its own."""
        self.settle()
        self._c.checkpoint.load_state_dict(sd)
