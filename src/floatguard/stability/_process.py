"""Which process wrote a file (host, pid, start time), and whether that process still runs.

A pid alone does not name a process for long: pids are reused, and a restarted
container often gives its training process the pid the killed one had. With the
start time (Linux ``/proc/<pid>/stat``, in clock ticks since boot) it does. A
*writer tag* ``<host tag>-<pid>-<start>`` in a temporary file's name lets a save
tell the leftovers of a dead writer from the file a live writer is still writing.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import sys
from pathlib import Path

__all__ = ["HOST", "process_start", "running", "writer_gone", "writer_tag"]

HOST = socket.gethostname()
_HOST_TAG = hashlib.sha1(HOST.encode(), usedforsecurity=False).hexdigest()[:8]
_TAG = re.compile(r"^([0-9a-f]{8})-(\d+)-(\d+)$")


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in ticks) from ``/proc/<pid>/stat``; None off Linux
    or when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after
    # its last ")"; the start time is field 22, the 20th after the state's field 3.
    fields = text.rsplit(")", 1)[-1].split()
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def process_start(pid: int) -> int:
    """When process ``pid`` started (clock ticks since boot); 0 when unknown."""
    st = _stat(pid)
    return st[1] if st is not None else 0


def running(pid: int, start: int = 0) -> bool:
    """Whether process ``pid`` of this host runs (a zombie does not) and, when ``start``
    is known, is the one that started then (not a later process given the same pid).
    On Windows it cannot be told without a dependency: True (assumed running)."""
    if pid <= 0:
        return False
    if sys.platform == "win32":
        return True
    try:
        os.kill(pid, 0)  # signal 0: no signal, only the check that the pid exists
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    st = _stat(pid)
    if st is None:
        return True  # no /proc (macOS): the pid exists, which is all we can tell
    state, now = st
    return state != "Z" and not (start and now != start)


def writer_tag(pid: int | None = None) -> str:
    """``<host tag>-<pid>-<start>`` of process ``pid`` (default: this one)."""
    pid = os.getpid() if pid is None else pid
    return f"{_HOST_TAG}-{pid}-{process_start(pid)}"


def writer_gone(tag: str | None) -> bool:
    """Whether the writer a tag names is known to be gone: no tag (a file from a
    floatguard before writer tags), or a process of this host that no longer runs. A
    writer on another host cannot be checked: not gone."""
    m = _TAG.match(tag or "")
    if m is None:
        return True
    host, pid, start = m.group(1), int(m.group(2)), int(m.group(3))
    return host == _HOST_TAG and not running(pid, start)
