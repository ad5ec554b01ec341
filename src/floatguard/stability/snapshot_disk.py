"""A guarded run's snapshots on disk: the store and its error policy, the folder's
lock and run identity, and resume loading.

Whose snapshots a folder holds (see :mod:`floatguard.stability.snapshot_folder`): a
run has a *run id*, new for a guard that starts afresh, the folder's own for one that
resumes from it (:meth:`SnapshotDisk.load`, then :meth:`~SnapshotDisk.adopt`) or is
restored from a framework's checkpoint (:meth:`~SnapshotDisk.continue_run`). The
folder's lock is taken before the folder is read to resume or written, and let go on
:meth:`~SnapshotDisk.close`. The :class:`~floatguard.stability.snapshot_keeper.
SnapshotKeeper` owns one (``keeper.disk``) and decides which snapshots go to disk.
"""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from floatguard.stability.snapshot import (
    ForeignSnapshotError,
    Snapshot,
    SnapshotError,
    load_snapshot,
    read_identity,
)
from floatguard.stability.snapshot_fit import first_misfit
from floatguard.stability.snapshot_folder import (
    FolderLock,
    SnapshotFolderBusy,
    new_run_id,
    read_run_id,
    write_run_id,
)
from floatguard.stability.snapshot_store import SnapshotStore

if TYPE_CHECKING:
    from floatguard.stability.respond import ResponsePolicy

__all__ = ["SnapshotDisk", "SnapshotEvents"]

_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)  # a folder the lock cannot be made in


class SnapshotEvents(Protocol):
    """Where the keeper says what it did (the guard's event stream)."""

    def snapshot(self, step: int, where: str, freed: str | None = None) -> None: ...
    def snapshot_error(self, step: int, where: str, error: str, policy: str) -> None: ...
    def snapshot_fallback(self, step: int, bad: str, error: str, used: str) -> None: ...
    def warning(
        self, step: int, message: str, transients: int | None = None, *,
        code: str | None = None, evidence: dict[str, Any] | None = None,
    ) -> None: ...  # fmt: skip


def _run_of(path: Path) -> str | None:
    ident = read_identity(path)
    return ident[1] if ident is not None else None


class SnapshotDisk:
    """The run's snapshot folder (``policy.snapshot_dir``; ``home`` None without one).

    ``disk_step``: the step of the newest snapshot on disk (written, or resumed from).
    """

    def __init__(self, policy: ResponsePolicy, events: SnapshotEvents) -> None:
        self.policy, self.events = policy, events
        self.run_id = new_run_id()
        self._notes: list[tuple[str, str]] = []  # said once a resume has chosen its snapshot
        self._identity_warned = False
        self.home = Path(policy.snapshot_dir) if policy.snapshot_dir is not None else None
        self.store = (
            SnapshotStore(self.home, policy.snapshot_keep, run_id=self.run_id)
            if self.home is not None
            else None
        )
        self.lock: FolderLock | None = None
        self.disk_step: int | None = None
        self._failing = False  # writes failing since the last one that worked (warned)

    @property
    def writing(self) -> bool:
        """Whether snapshots go to disk (a folder given, and writes not disabled)."""
        return self.store is not None

    def write(self, step: int, snap: Snapshot) -> str:
        """Write ``snap`` to the store (the folder locked, and made this run's first); a
        failure is an event and a warning, then the policy acts. Another live guard
        in the folder is refused whatever the policy."""
        store = self.store
        assert store is not None
        try:
            if store.folder.is_symlink() and not store.folder.exists():
                raise SnapshotError(f"snapshot_dir {store.folder} is a broken link")
            if store.folder.exists() and not store.folder.is_dir():
                raise SnapshotError(f"snapshot_dir {store.folder} is a file, not a folder")
            self._check_lock(step)
            self._claim()
            self._own_folder(step, store)
            path = str(store.save(snap))
        except SnapshotFolderBusy:
            raise
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
            self._warn_failing(step, store.folder, error, policy)
            return "memory"
        self.disk_step, self._failing = step, False
        return path

    def _warn_failing(self, step: int, folder: Path, error: str, policy: str) -> None:
        """Once per spell of failing writes, on stderr: the run's resume point is stale."""
        if self._failing:
            return
        self._failing = True
        kept = (
            f"the newest snapshot on disk is of step {self.disk_step}"
            if self.disk_step is not None
            else "no snapshot of this run is on disk"
        )
        then = (
            "retried at every snapshot step; until one is written, a crash loses every "
            "step since (StepResult.snapshot_age counts them)"
            if policy == "retry"
            else "disk snapshots are off for the rest of the run"
        )
        warnings.warn(
            f"floatguard: cannot write the snapshot of step {step} to {folder} ({error}); "
            f"{kept}; {then}. Rollbacks still work (in memory); further failures are "
            "snapshot_error events only",
            RuntimeWarning,
            stacklevel=2,
        )

    def _claim(self) -> None:
        """Take the snapshot folder's lock (SnapshotFolderBusy while another guard
        holds it); the store may then clean every other writer's temp files."""
        if self.lock is None and self.home is not None:
            try:
                self.lock = FolderLock.acquire(self.home)
            except SnapshotFolderBusy as e:
                import torch.distributed as dist

                if not (dist.is_available() and dist.is_initialized()):
                    raise
                raise SnapshotFolderBusy(
                    f"{e}. Under torch.distributed every rank's guard writes its own "
                    f"snapshots: give each rank its own folder (rank {dist.get_rank()}: "
                    f"snapshot_dir=f'{self.home}/rank{{rank}}')"
                ) from None
            if self.store is not None:
                self.store.exclusive = True

    def _warn(
        self,
        step: int,
        message: str,
        code: str | None,
        *,
        stacklevel: int,
        transients: int | None = None,
    ) -> None:
        """A RuntimeWarning on stderr and the same words as a ``warning`` event."""
        warnings.warn(f"floatguard: {message}", RuntimeWarning, stacklevel=stacklevel + 1)
        self.events.warning(step, message, transients, code=code)

    def _check_lock(self, step: int) -> None:
        """Before a write: the folder's lock file must still be the one this guard holds.
        One removed or replaced while held is taken again (a warning and an event), so a
        second guard that took the folder meanwhile is found here (SnapshotFolderBusy),
        not after both have pruned each other's snapshots."""
        if self.lock is None or self.lock.intact():
            return
        folder = self.lock.folder
        self.lock.release()
        self.lock = None
        if not folder.is_dir():
            return  # the folder itself is gone: the write says so (snapshot_error)
        message = (
            f"the lock file of snapshot_dir {folder} was removed or replaced while this "
            "guard held it (by hand, or a cleaner of old files); taken again. Another "
            "guard may have written there meanwhile: give each run its own snapshot_dir"
        )
        self._warn(step, message, code="lock_lost", stacklevel=4)

    def _own_folder(self, step: int, store: SnapshotStore) -> None:
        """Make the folder this run's before writing there; a guard that did not resume
        a folder holding another run's snapshots takes it over, warned."""
        found = read_run_id(store.folder)
        if found == self.run_id:
            return
        theirs = [p.name for p in store.paths() if _run_of(p) == found]
        if found is not None and theirs:
            names = ", ".join(theirs[:3]) + (", ..." if len(theirs) > 3 else "")
            message = (
                f"snapshot_dir {store.folder} holds the snapshots of another run ({found}: "
                f"{names}); this guard did not resume() "
                f"it and starts run {self.run_id} there. resume() will pass over that "
                "run's files (snapshot_fallback) and they are never pruned, but a file of "
                "a step this run also snapshots is replaced: call guard.resume() to "
                "continue that run, or give a new run an empty folder"
            )
            self._warn(step, message, code=None, transients=0, stacklevel=2)
        try:
            write_run_id(store.folder, self.run_id)
        except OSError as e:  # a directory by that name: the snapshots still carry the run
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
                raise  # the snapshot cannot be written either: the write's own error
            if not self._identity_warned:
                self._identity_warned = True
                message = (
                    f"cannot write {store.folder}/floatguard-run.json ({e.strerror or e}); "
                    "snapshots are written without it (each one's header names the run, "
                    "which is what resume() then goes by): remove what is in its place"
                )
                self._warn(step, message, code="identity_unwritable", stacklevel=2)

    def close(self) -> None:
        """Let go of the snapshot folder's lock (taken again at the next write)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        if self.store is not None:
            self.store.exclusive = False

    def load(
        self,
        path: str | os.PathLike[str] | None,
        device: torch.device,
        objects: dict[str, Any],
        *,
        foreign: bool = False,
    ) -> tuple[Snapshot, Path]:
        """The newest good snapshot at ``path`` (a file, or a folder of them; default the
        policy's ``snapshot_dir``) that fits ``objects`` (every state there; model and
        optimizer tensors of the same names, shapes and dtypes), checked before
        anything is loaded. In a folder, a newer file that fails to verify, is misnamed
        or is another run's is passed over for the one before (an event each); a file
        named is refused for those (another run's: unless ``foreign``)."""
        target, expected = self.open_target(path)
        if target.is_dir():
            store = SnapshotStore(target, self.policy.snapshot_keep, run_id=expected)
            snap, used, bad = store.load_latest(map_location=device, foreign=foreign)
        else:
            snap = self.load_file(target, device, expected, foreign=foreign)
            used, bad = target, []
        self.passed_over(snap.step, bad, used)
        self.check_fit(snap, used, objects)
        return snap, used

    def open_target(self, path: str | os.PathLike[str] | None) -> tuple[Path, str | None]:
        """What a resume reads (``path``: a file or a folder; default the policy's
        ``snapshot_dir``) and the run it continues; the snapshot folder's lock is taken
        first (SnapshotFolderBusy while another guard writes there)."""
        target = Path(path) if path is not None else self.home
        if target is None:
            raise ValueError(
                "Guard.resume() needs a path, or ResponsePolicy(snapshot_dir=...) to look in"
            )
        if self.home is not None and self.home.is_dir():
            try:
                self._claim()  # before reading: no other guard writes there meanwhile
            except OSError as e:
                if e.errno not in _READ_ONLY:
                    raise
                self._notes.append(
                    (
                        "read_only_folder",
                        f"snapshot_dir {self.home} is read-only ({e.strerror}): resumed from it "
                        "without its lock, and this run cannot write its snapshots there. To "
                        "go on writing, give a writable snapshot_dir and "
                        f"resume(path={str(self.home)!r})",
                    )
                )
        return target, self._expected_run(target)

    def verified_steps(
        self, folder: Path, expected: str | None, *, foreign: bool = False
    ) -> tuple[list[tuple[int, Path]], list[tuple[Path, str]]]:
        """The snapshots in ``folder`` that verify (:meth:`SnapshotStore.verify_all`:
        nothing unpickled), [(step, path)], and the others, [(path, why)], newest first."""
        store = SnapshotStore(folder, self.policy.snapshot_keep, run_id=expected)
        return store.verify_all(foreign=foreign)

    def load_file(
        self, target: Path, device: torch.device, expected: str | None, *, foreign: bool = False
    ) -> Snapshot:
        """The snapshot in the file ``target``, verified as run ``expected``'s (any run's
        with ``foreign``); SnapshotError (ForeignSnapshotError: saying how to take it on
        purpose) otherwise."""
        try:
            return load_snapshot(target, device, run_id=None if foreign else expected)
        except ForeignSnapshotError as e:
            raise ForeignSnapshotError(
                f"{e}; nothing was loaded. resume(path=..., foreign=True) takes "
                "another run's snapshot on purpose"
            ) from None

    def passed_over(self, step: int, bad: list[tuple[Path, str]], used: Path) -> None:
        """A ``snapshot_fallback`` event for each newer file a resume from ``used``
        (of step ``step``) passed over, saying why."""
        for p, why in bad:
            self.events.snapshot_fallback(step, str(p), why, str(used))
        for code, note in self._notes:
            self._warn(step, note, code, stacklevel=2)
        self._notes = []

    @staticmethod
    def check_fit(snap: Snapshot, used: Path, objects: dict[str, Any]) -> None:
        """SnapshotError unless ``snap`` (read from ``used``) holds a state for every one
        of ``objects`` and its tensors fit theirs (names, shapes, dtypes)."""
        missing = sorted(set(objects) - set(snap.states))
        if missing:
            raise SnapshotError(
                f"{used} holds no state for {missing} (it has {sorted(snap.states)}): it was "
                "written by a guard set up differently; nothing was loaded"
            )
        misfit = first_misfit(snap.states, objects)
        if misfit is not None:
            raise SnapshotError(
                f"{used} does not fit: {misfit}; nothing was loaded (a snapshot of another "
                "model or optimizer setup)"
            )

    def _expected_run(self, target: Path) -> str | None:
        """The run a resume continues: the snapshot folder's, else the one the files
        resumed from belong to (their folder's); in a folder with no identity file, the
        run most of its snapshots' headers name (SnapshotError when two runs have as
        many); None when nothing says."""
        if self.home is not None and self.home.is_dir():
            run = read_run_id(self.home)
            if run is not None:
                return run
        folder = target if target.is_dir() else target.parent
        run = read_run_id(folder)
        if run is None and target.is_dir():
            run = self._majority_run(target)
        return run

    def _majority_run(self, folder: Path) -> str | None:
        """The run most snapshot headers in ``folder`` name (one without an identity
        file); a warning for the passed-over runs is kept for :meth:`passed_over`."""
        counts: dict[str, int] = {}
        for p in SnapshotStore(folder).paths():
            run = _run_of(p)
            if run is not None:
                counts[run] = counts.get(run, 0) + 1
        if len(counts) < 2:
            return next(iter(counts), None)
        ranked = sorted(counts.items(), key=lambda rc: rc[1], reverse=True)
        found = ", ".join(f"{r} ({n} file{'s' * (n > 1)})" for r, n in ranked)
        if ranked[0][1] == ranked[1][1]:
            raise SnapshotError(
                f"{folder} has no floatguard-run.json and holds the snapshots of several "
                f"runs, none the majority: {found}; nothing was loaded. Name the file "
                "to continue: resume(path=.../snapshot-<step>.fgs), or put the run's "
                "floatguard-run.json back"
            )
        self._notes.append(
            (
                "foreign_snapshots",
                f"{folder} has no floatguard-run.json and holds the snapshots of several runs: "
                f"{found}; resumed run {ranked[0][0]}, which most of them belong to (the "
                "others' files are passed over and never pruned)",
            )
        )
        return ranked[0][0]

    def adopt(self, snap: Snapshot, used: Path) -> None:
        """After a resume from ``used``: ``snap`` is the newest snapshot on disk, and this
        run continues the snapshot folder's run (or, in a folder without an identity,
        the run of the file it resumed from there)."""
        self.disk_step = snap.step
        if self.home is not None and self.home.is_dir():
            run = read_run_id(self.home)
            if run is None and used.parent.resolve() == self.home.resolve():
                run = snap.run_id
            self._set_run(run)

    def continue_run(self) -> None:
        """A guard restored from a framework's checkpoint continues the snapshot
        folder's run, when the folder has one."""
        if self.home is not None and self.home.is_dir():
            self._set_run(read_run_id(self.home))

    def _set_run(self, run: str | None) -> None:
        if run is not None:
            self.run_id = run
            if self.store is not None:
                self.store.run_id = run
