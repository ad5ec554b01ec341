"""A snapshot folder's run identity and its lock: whose snapshots it holds, who writes.

Words used here:

- *run id*: 32 hex digits (``uuid4().hex``) naming one training run across its
  restarts; every snapshot file's header carries the run id of the run that wrote it.
- *identity file* (``floatguard-run.json``): the run id of the run that owns the
  folder. The first guard that writes a snapshot there creates it; a guard that
  resumes from the folder adopts its run id (it continues that run); a guard that
  starts afresh there takes the folder over with a new run id (warned).
- *lock file* (``floatguard.lock``): held by the one guard that writes in the folder
  (``flock``: the kernel drops it when the process dies), holding that guard's pid,
  host and start time for the message a second guard gets; removed on release. A file
  left by a killed process is taken over with a warning naming it.

Reading order: :class:`FolderLock` (``acquire``, ``release``), then
:func:`read_run_id` / :func:`write_run_id`.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import re
import stat
import sys
import time
import uuid
import warnings
import weakref
from pathlib import Path
from typing import Any

from floatguard._safe_io import read_regular, replacing
from floatguard.stability._process import HOST, process_start
from floatguard.stability._snapshot_file import SnapshotError

__all__ = [
    "IDENTITY_FILE",
    "LOCK_FILE",
    "FolderLock",
    "SnapshotFolderBusy",
    "new_run_id",
    "read_run_id",
    "write_run_id",
]

IDENTITY_FILE = "floatguard-run.json"
_RUN_ID = re.compile(r"[0-9a-f]{32}")  # what new_run_id() makes: uuid4().hex
LOCK_FILE = "floatguard.lock"

# The locks this process holds, by folder: a second guard of this process on a folder
# is told apart from a guard that was dropped without close() (collected, it lets go).
_HELD: dict[str, weakref.ref[FolderLock]] = {}


class SnapshotFolderBusy(SnapshotError):
    """Another live guard writes snapshots in this folder."""


def new_run_id() -> str:
    return uuid.uuid4().hex


def _owner() -> dict[str, Any]:
    pid = os.getpid()
    return {"pid": pid, "host": HOST, "started": process_start(pid), "since": time.time()}


def _read_owner(fd: int) -> dict[str, Any] | None:
    """What the lock file says of its holder; None when empty (released, or not yet
    written) or unreadable."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 4096)
        owner = json.loads(raw.decode()) if raw else None
    except (OSError, ValueError, RecursionError):  # unreadable, not JSON, nested too deep
        return None
    return owner if isinstance(owner, dict) else None


def _who(owner: dict[str, Any]) -> str:
    """The holder in words; what a lock file says is a stranger's data: any value is
    shown, none is trusted to be a number."""
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(owner.get("since", 0))))
    except (TypeError, ValueError, OverflowError, OSError):
        since = "an unknown time"
    pid, host = str(owner.get("pid"))[:40], str(owner.get("host"))[:80]
    return f"pid {pid} on host {host}, since {since}"


def _mine(owner: dict[str, Any] | None) -> bool:
    return (
        owner is not None
        and owner.get("pid") == os.getpid()
        and owner.get("host") == HOST
        and owner.get("started") == process_start(os.getpid())
    )


def _release(fd: int, path: Path, inode: tuple[int, int]) -> None:
    """Empty the lock file (a released lock says nothing), remove it when it is still
    ours, and close it (the lock goes)."""
    try:
        os.ftruncate(fd, 0)
        st = path.stat()
        if (st.st_dev, st.st_ino) == inode:
            path.unlink()
    except OSError:
        pass  # the folder is gone, or (Windows) an open file cannot be removed
    os.close(fd)


class FolderLock:
    """The lock of one snapshot folder, held from :meth:`acquire` to :meth:`release`
    (or until this object is collected, or the process ends)."""

    def __init__(self, folder: Path, fd: int, inode: tuple[int, int]) -> None:
        self.folder = folder
        self.path = folder / LOCK_FILE
        self._fd = fd
        self._key = str(folder.resolve())
        self._inode = inode
        self._finalizer = weakref.finalize(self, _release, fd, self.path, inode)
        _HELD[self._key] = weakref.ref(self)

    @classmethod
    def acquire(cls, folder: str | os.PathLike[str]) -> FolderLock:
        """Create the folder when needed and take its lock.

        Raises :class:`SnapshotFolderBusy` naming the folder and the holder (pid, host,
        since when) while another guard (of this process or another) holds it. A lock
        file left by a process that died is taken over, with a RuntimeWarning naming it.
        """
        where = Path(folder)
        where.mkdir(parents=True, exist_ok=True)
        for _ in range(20):
            taken = _try_lock(where / LOCK_FILE)
            if isinstance(taken, str):  # the holder let go as we looked, or is still writing
                time.sleep(0.05)
                continue
            if isinstance(taken, tuple):
                fd, inode, left = taken
                lock = cls(where, fd, inode)
                if left is not None:
                    warnings.warn(
                        f"floatguard: took over the lock of {where} left by {_who(left)} "
                        "(no longer running)",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                return lock
            if _mine(taken) and _collected(str(where.resolve())):
                continue  # a guard of this process dropped without close(): let go now
            here = " (another Guard in this process: close() it first)" if _mine(taken) else ""
            raise SnapshotFolderBusy(
                f"snapshot_dir {where} is in use by another guard: {_who(taken)}{here}. "
                "Two guards writing one folder would prune and resume each other's "
                "snapshots: give each run its own snapshot_dir, or close() the other first"
            )
        raise SnapshotFolderBusy(f"snapshot_dir {where}: its lock keeps changing hands")

    @property
    def held(self) -> bool:
        return self._finalizer.alive

    def intact(self) -> bool:
        """Whether the lock file's name still names the file this lock holds. Removed or
        replaced (by hand, or by a cleaner), another guard could take a new lock on the
        folder while this one still writes there."""
        try:
            st = os.lstat(self.path)
        except OSError:
            return False
        return self.held and (st.st_dev, st.st_ino) == self._inode

    def release(self) -> None:
        """Let go of the folder (removes the lock file). Idempotent."""
        if _HELD.get(self._key) is not None and _HELD[self._key]() is self:
            del _HELD[self._key]
        self._finalizer()


def _forget_in_child() -> None:
    """In a forked child (a DataLoader worker): drop the copies of the parent's lock
    files. Holding them, a worker orphaned by its killed parent would keep the folder
    locked, and one that exits normally would remove the parent's lock file."""
    for ref in list(_HELD.values()):
        lock = ref()
        if lock is not None:
            lock._finalizer.detach()
            try:
                os.close(lock._fd)  # the parent's lock stays: it has its own reference
            except OSError:
                pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _collected(key: str) -> bool:
    """Whether this process's holder of ``key`` was a guard dropped without close():
    collected now (its finalizer lets the lock go), or already gone."""
    ref = _HELD.get(key)
    if ref is not None and ref() is not None:
        gc.collect()  # a dropped guard sits in reference cycles until the collector runs
    ref = _HELD.get(key)
    return ref is None or ref() is None


def _try_lock(
    path: Path,
) -> tuple[int, tuple[int, int], dict[str, Any] | None] | dict[str, Any] | str:
    """(fd, inode, what a dead holder left or None) when the lock was taken; what the
    lock file says of its live holder when not; "again" when it cannot tell yet."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EMLINK):  # a symlink (or a FIFO)
            _unlink_stranger(path)
            return "again"
        if e.errno == errno.EISDIR:
            raise SnapshotError(
                f"{path} is a directory: the snapshot folder's lock cannot be taken "
                "(remove it, or use another snapshot_dir)"
            ) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        # Not a file of ours (a FIFO, or a hard link to someone's file): never write
        # into it; its name is taken away (the file it links to is left as it is).
        os.close(fd)
        _unlink_stranger(path)
        return "again"
    try:
        if not _lock_fd(fd):
            owner = _read_owner(fd)
            os.close(fd)
            return "again" if owner is None else owner
        st = os.fstat(fd)
        inode = (st.st_dev, st.st_ino)
        try:
            now = path.stat()
        except FileNotFoundError:
            now = None
        if now is None or (now.st_dev, now.st_ino) != inode:
            os.close(fd)  # the holder removed the file as we opened it
            return "again"
        left = _read_owner(fd)
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(_owner()).encode())
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd, inode, left


def _unlink_stranger(path: Path) -> None:
    """Remove the name ``path`` when it is a link or a special file (a link's target,
    a hard link's other names, keep their data); a regular file of one link stays."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        if not stat.S_ISDIR(st.st_mode):
            warnings.warn(
                f"floatguard: {path} was a {'link' if stat.S_ISLNK(st.st_mode) else 'stranger'}"
                " (not a lock file floatguard wrote); its name is replaced, what it points "
                "to is left as it is",
                RuntimeWarning,
                stacklevel=4,
            )
            path.unlink(missing_ok=True)


def _lock_fd(fd: int) -> bool:
    """Lock ``fd`` without waiting (the kernel drops it when the process ends); False
    when another holds it."""
    if sys.platform == "win32":
        import msvcrt

        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def read_run_id(folder: str | os.PathLike[str]) -> str | None:
    """The run id in ``folder``'s identity file; None when there is none (a folder no
    guard has written yet, or one written before run ids). An unreadable identity
    file is warned about and read as none (a resume then checks no run)."""
    path = Path(folder) / IDENTITY_FILE
    try:  # without blocking, a regular file only, a small one
        raw = read_regular(path, 1 << 16).decode("utf-8", errors="replace")
    except (FileNotFoundError, NotADirectoryError):  # no file; the folder is gone
        return None
    except OSError:  # a FIFO, a device, a directory by that name; unreadable
        raw = ""
    try:
        run = json.loads(raw)["run_id"]
        if isinstance(run, str) and _RUN_ID.fullmatch(run):
            return run
    except (ValueError, KeyError, TypeError, RecursionError):
        pass
    if _warned_once(f"unreadable {path.resolve()}"):
        warnings.warn(
            f"floatguard: {path} is unreadable; a resume tells the run from the "
            "snapshots' headers (the next snapshot written there rewrites it)",
            RuntimeWarning,
            stacklevel=2,
        )
    return None


_SAID: set[str] = set()


def _warned_once(key: str) -> bool:
    """True the first time ``key`` is seen in this process (a warning said once, not at
    every read of the same file)."""
    if key in _SAID:
        return False
    _SAID.add(key)
    return True


def write_run_id(folder: str | os.PathLike[str], run_id: str) -> None:
    """Make ``run_id`` the folder's run: the identity file written atomically."""
    record = {"run_id": run_id, "created": time.time(), "host": HOST, "pid": os.getpid()}
    with replacing(Path(folder) / IDENTITY_FILE) as tmp, open(tmp, "w") as fh:
        json.dump(record, fh)  # a new temp file (never a name planted before), renamed over
        fh.flush()
        os.fsync(fh.fileno())
