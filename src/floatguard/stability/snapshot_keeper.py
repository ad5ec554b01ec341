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

Whose snapshots a folder holds (see :mod:`floatguard.stability.snapshot_folder`): the
keeper has a *run id*, new for a guard that starts afresh, the folder's own for one
that resumes from it (:meth:`SnapshotKeeper.load`, then :meth:`~SnapshotKeeper.adopt`)
or is restored from a framework's checkpoint (:meth:`~SnapshotKeeper.continue_run`).
It takes the folder's lock before it reads the folder to resume or writes there, and
lets it go on :meth:`~SnapshotKeeper.close`.
"""

from __future__ import annotations

import errno
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from floatguard.stability.snapshot import (
    ForeignSnapshotError,
    Snapshot,
    SnapshotError,
    load_snapshot,
    read_identity,
)
from floatguard.stability.snapshot_cadence import SnapshotCadence
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

__all__ = ["SnapshotEvents", "SnapshotKeeper"]

Capture = Callable[[], tuple[dict[str, Any], dict[str, Any]]]  # (objects, meta), now

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


def _tensors(objects: dict[str, Any]) -> list[torch.Tensor]:
    model = objects.get("model")
    return list(model.parameters()) if isinstance(model, torch.nn.Module) else []


def _run_of(path: Path) -> str | None:
    ident = read_identity(path)
    return ident[1] if ident is not None else None


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
        self._first: int | None = None  # the step of the first snapshot taken
        self._failing = False  # writes failing since the last one that worked (warned)
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
        self._vetting_first = False
        if bad is not None:
            self.drop()
            self.events.warning(step, f"no snapshot taken: {bad}", 0)
            return False
        self.vouch(step, amax)
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
        base = self.disk_step if self.disk_step is not None else self._first
        return None if self.home is None or base is None else next_step - base

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
        to_disk = self.store is not None and self.taken % self.policy.disk_every == 0
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
        if self.store is not None and (self.taken - 1) % self.policy.disk_every == 0:
            where = self._write(step, self.snapshot)
            freed = self.store.freed if self.store is not None and where != "memory" else None
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

    def _write(self, step: int, snap: Snapshot) -> str:
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

    def restore(self, objects: dict[str, Any]) -> int:
        """Load the snapshot back into ``objects``; the step it was taken before."""
        self.settle()  # a copy still reading the state waits before it is overwritten
        if self.snapshot is None:
            raise SnapshotError("no clean snapshot to roll back to")
        # torch's RNG goes back with the weights; Python's and NumPy's belong to the
        # data pipeline, which a rollback does not rewind
        self.snapshot.restore(objects, rng="torch")
        return self.snapshot.step

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
        """After a resume from ``used``: ``snap`` is the snapshot a rollback restores, and
        this guard continues the snapshot folder's run (or, in a folder without an
        identity, the run of the file it resumed from there)."""
        self.snapshot, self.first_due = snap, False  # the snapshot resumed from is kept
        self.taken = int(snap.meta.get("snapshots", self.taken))
        self.amax = {}
        self.disk_step = snap.step
        if self.home is not None and self.home.is_dir():
            run = read_run_id(self.home)
            if run is None and used.parent.resolve() == self.home.resolve():
                run = snap.run_id
            self._set_run(run)

    def continue_run(self, snapshots: int) -> None:
        """A guard restored from a framework's checkpoint (``Guard.load_state_dict``,
        ``snapshots`` taken before) continues the snapshot folder's run, when the folder
        has one; its next step takes the first snapshot afresh."""
        self.taken, self.first_due = snapshots, True
        if self.home is not None and self.home.is_dir():
            self._set_run(read_run_id(self.home))

    def _set_run(self, run: str | None) -> None:
        if run is not None:
            self.run_id = run
            if self.store is not None:
                self.store.run_id = run
