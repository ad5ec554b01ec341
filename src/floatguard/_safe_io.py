"""Reading files in folders floatguard does not control: never block, never read past
a file's real size, never read what is not a regular file.

A FIFO named like a snapshot would block an ``open`` forever; a link to ``/dev/zero``
would be read until memory runs out; a directory under a file's name raises
``IsADirectoryError`` from deep inside. :func:`read_regular` opens without blocking
(``O_NONBLOCK``), checks the opened file's type (``fstat``: what was opened, not what a
name pointed to a moment before), and reads at most its size (and at most ``limit``).
A non-regular file raises :class:`NotRegularFile` (an ``OSError``) naming what it is.

Writing into such a folder, :func:`replacing` writes a temp file beside the target and
renames it over the target's name: a link there is replaced, never written through, and
a writer killed midway leaves the old file whole (and a hidden temp file), never half
of a new one.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from floatguard.errors import FloatguardError

__all__ = ["NotRegularFile", "file_kind", "open_regular", "read_regular", "replacing"]

_CHUNK = 1 << 24


class NotRegularFile(FloatguardError, OSError):
    """A path that names a FIFO, a device, a directory or a socket where a file was
    expected."""


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)


def file_kind(mode: int) -> str:
    """Words for a file type (``st_mode``)."""
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """The regular file at ``path`` (links followed to it) open for reading, binary;
    FileNotFoundError when there is none; NotRegularFile for anything else, without
    blocking (a FIFO with no writer would block a plain ``open`` forever)."""
    p = Path(path)
    fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(f"{p} is {file_kind(mode)}, not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike[str], limit: int | None = None) -> bytes:
    """The bytes of the regular file at ``path`` (links followed to it), at most its
    size and at most ``limit``; FileNotFoundError when there is none; NotRegularFile
    for anything else, without blocking."""
    p = Path(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(p, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(f"{p} is {file_kind(st.st_mode)}, not a regular file")
        left = st.st_size if limit is None else min(st.st_size, limit)
        chunks = []
        while left > 0:
            chunk = os.read(fd, min(left, _CHUNK))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


@contextmanager
def replacing(target: str | os.PathLike[str]) -> Iterator[Path]:
    """A new temp file's path in ``target``'s folder (same suffix) to write; when the
    block ends without an error it is renamed over ``target`` (readable by all, as a
    file made with the usual umask), else removed. The rename replaces whatever name
    ``target`` is (a link: the link, not its target); a directory there raises
    IsADirectoryError with nothing changed."""
    dest = Path(target)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=dest.suffix, dir=dest.parent)
    except OSError as e:  # a read-only or full folder: named by the file meant
        raise _named(e, dest) from None
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise _named(e, dest) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _named(e: OSError, dest: Path) -> OSError:
    """``e`` naming ``dest`` (the file a user knows), not the temp file beside it."""
    if e.errno is None:
        return e
    return type(e)(e.errno, e.strerror or str(e), str(dest))
