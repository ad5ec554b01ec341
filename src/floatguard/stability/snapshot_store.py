"""The snapshot folder of a run: :class:`SnapshotStore`, its last ``keep`` files.

``snapshot-<step>.fgs`` files (:mod:`floatguard.stability.snapshot` writes and reads
one), pruned to the run's last ``keep``, with the leftovers of interrupted saves
removed and room made on a full disk (see the class).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
from pathlib import Path

import torch

from floatguard.stability._process import writer_gone, writer_tag
from floatguard.stability._snapshot_file import (
    TEMP_NAME,
    SnapshotError,
    check_name,
    check_run,
    read_identity,
    run_bytes,
    step_of,
    verified,
)
from floatguard.stability.snapshot import Snapshot, _read_file, load_snapshot

__all__ = ["SnapshotStore"]

# A save's temp file: ``.snapshot-<step>.fgs.<writer tag>.<random>.tmp`` (older
# floatguards: ``.snapshot-<step>.fgs.<random>.tmp``).
_ANY_TEMP = re.compile(r"^\.snapshot-\d+\.fgs\.[^/]*\.tmp$")


_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)  # a full disk, a full quota


class SnapshotStore:
    """The last ``keep`` snapshots of a run in ``folder``: ``snapshot-<step>.fgs``.

    ``run_id``: the run whose snapshots these are (None: a store without run ids).
    :meth:`save` stamps it in each file's header; :meth:`load_latest` skips files of
    other runs; only the run's own files count toward ``keep`` and are removed (another
    run's files, and files that are not snapshots, are left alone).

    ``exclusive``: the store's user holds the folder's lock (see
    :class:`~floatguard.stability.snapshot_folder.FolderLock`): no other process writes
    there, so any temp file of another process is a leftover. Otherwise only those of
    a writer known to be gone are (a dead pid of this host; a file from an older
    floatguard), and two stores writing one folder never remove each other's.

    :meth:`save` first removes the leftovers of interrupted saves (``.snapshot-*.tmp``;
    never read as snapshots), writes atomically, then removes the run's oldest
    snapshots beyond ``keep``. :meth:`load_latest` returns the newest one that
    verifies, and says which newer ones did not and why.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        keep: int = 2,
        *,
        run_id: str | None = None,
        exclusive: bool = False,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"SnapshotStore(keep={keep!r}) must be an int >= 1")
        run_bytes(run_id)  # a malformed run id is refused here, not at the first save
        self.folder = Path(folder)
        self.keep = keep
        self.run_id = run_id
        self.exclusive = exclusive
        self.freed: Path | None = None  # what the last save removed for room

    def path_for(self, step: int) -> Path:
        """``snapshot-<step>.fgs``, the step with at least 9 digits (more when it needs them)."""
        return self.folder / f"snapshot-{step:09d}.fgs"

    def paths(self) -> list[Path]:
        """The snapshot files (of any run), newest (highest step) first."""
        if not self.folder.is_dir():
            return []
        found = [(s, p) for p in self.folder.iterdir() if (s := step_of(p.name)) is not None]
        return [p for _, p in sorted(found, key=lambda sp: sp[0], reverse=True)]

    def own(self) -> list[Path]:
        """This run's snapshot files (by their header: the run id, and the step their
        name says), newest first."""
        mine = []
        for p in self.paths():
            ident = read_identity(p)
            if ident is None or ident[1] != self.run_id:
                continue
            if ident[0] is None or ident[0] == step_of(p.name):  # not a misnamed one
                mine.append(p)
        return mine

    def leftovers(self) -> list[Path]:
        """Temporary files of interrupted saves (never this process's own: it may be
        writing one in another thread)."""
        if not self.folder.is_dir():
            return []
        me = writer_tag()
        out = []
        for p in self.folder.iterdir():
            if not _ANY_TEMP.match(p.name) or not p.is_file() or p.is_symlink():
                continue  # only a save's temp file (any floatguard's), never a user's
            m = TEMP_NAME.match(p.name)
            tag = m.group(1) if m else None
            if tag != me and (self.exclusive or writer_gone(tag)):
                out.append(p)
        return out

    def save(self, snapshot: Snapshot) -> Path:
        """Write ``snapshot`` as this run's (its run id set to the store's; the
        snapshot given is not changed), then prune the run's files beyond ``keep``.
        A write the disk has no room for (ENOSPC, EDQUOT) removes the run's oldest
        snapshot that is not its newest verified one and is tried once more;
        :attr:`freed` names the file removed (None when none was)."""
        for p in self.leftovers():
            p.unlink(missing_ok=True)
        stamped = dataclasses.replace(snapshot, run_id=self.run_id)
        self.freed = None
        try:
            path = stamped.save(self.path_for(snapshot.step))
        except OSError as e:
            if e.errno not in _NO_ROOM or (room := self._room_for(snapshot.step)) is None:
                raise
            room.unlink()
            self.freed = room
            try:
                path = stamped.save(self.path_for(snapshot.step))  # once more
            except OSError as again:
                why = f"{again.strerror}, even after removing {room.name} to make room"
                raise OSError(again.errno, why) from again
        for old in self.own()[self.keep :]:
            old.unlink(missing_ok=True)
        return path

    def _room_for(self, step: int) -> Path | None:
        """The file to remove when a save finds the disk full: the run's oldest
        snapshot, never its newest one that verifies (the resume point), nor the file
        being written. None when there is no such file."""
        own = self.own()
        newest_good = None
        for p in own:  # (the file being replaced counts: it may be the resume point)
            try:
                verified(p, _read_file(p))
            except (SnapshotError, OSError):
                continue
            newest_good = p
            break
        spare = [p for p in own if p != newest_good and step_of(p.name) != step]
        return spare[-1] if spare else None

    def load_latest(
        self, map_location: str | torch.device | None = None, *, foreign: bool = False
    ) -> tuple[Snapshot, Path, list[tuple[Path, str]]]:
        """(snapshot, its path, [(newer path passed over, why)]): the newest file that
        verifies, is not misnamed, and is this run's (``foreign=True``: any run's).
        SnapshotError when there is none, with every file's reason."""
        bad: list[tuple[Path, str]] = []
        expected = None if foreign else self.run_id
        for p in self.paths():
            try:
                return load_snapshot(p, map_location, run_id=expected), p, bad
            except (SnapshotError, OSError) as e:
                bad.append((p, str(e)))
        why = "; ".join(f"{p.name}: {e}" for p, e in bad) or "the folder holds none"
        raise SnapshotError(f"no good snapshot in {self.folder} ({why})")

    def verify_all(
        self, *, foreign: bool = False
    ) -> tuple[list[tuple[int, Path]], list[tuple[Path, str]]]:
        """([(step, path)] of the files that pass what :func:`load_snapshot` checks
        before unpickling: header, length, SHA-256, the name's step and the run (any
        run's with ``foreign=True``), [(path, why)] of the others), newest first. Each
        file is read whole, one at a time; nothing is unpickled (a format 1 file's
        step is its name's, checked against its payload when it is loaded)."""
        good: list[tuple[int, Path]] = []
        bad: list[tuple[Path, str]] = []
        expected = None if foreign else self.run_id
        for p in self.paths():
            try:
                step, run, _ = verified(p, _read_file(p))
                if step is not None:
                    check_name(p, step)
                check_run(p, run, expected)
            except (SnapshotError, OSError) as e:
                bad.append((p, str(e)))
                continue
            named = step_of(p.name)
            assert named is not None  # paths() lists named files only
            good.append((named, p))
        return good, bad
