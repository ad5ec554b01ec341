"""Resume under torch.distributed: the newest step every rank has a good snapshot of, on every rank.

Words used here:

- *good steps*: the steps of a rank's snapshot files that verify (header, length,
  SHA-256, name and run: what a load checks before unpickling), newest first;
- *the step agreed*: the newest step in every rank's good steps, from one all-gather
  of them. Each rank loads its own file of that step: a rank killed while writing its
  snapshot of step 12 has only step 6's, and every rank goes back to step 6 (resumed
  apart, the ranks would stop at their first step with GuardDesync, or with snapshots
  far apart not be replicas any more);
- *together*: every rank raises, or none. A rank that cannot list its snapshots (a
  busy folder, a file named that does not verify) or load and fit the agreed one (a
  snapshot of another model) says so in the all-gather that follows, and every other
  rank raises a SnapshotError naming it; a rank's own SnapshotError is raised as it is,
  another error (a missing folder's FileNotFoundError) as a SnapshotError from it. Nothing
  is restored on any rank before both all-gathers agree, so no rank trains on alone and
  none waits for the others' first step.

Reading order: :func:`agreed_load`, then :func:`agree` and :func:`loaded`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from floatguard.guard.peers import ranks_text
from floatguard.stability.snapshot import Snapshot, SnapshotError, step_of

if TYPE_CHECKING:
    from floatguard.guard.peers import Peers
    from floatguard.stability.snapshot_disk import SnapshotDisk

__all__ = ["Agreement", "agree", "agreed_load", "loaded"]

_RECORD_BYTES = 16384  # one rank's record in the resume's all-gathers
_STEPS_SENT = 512  # the newest good steps a rank sends (a folder keeps snapshot_keep)
_ERRORS = (SnapshotError, OSError, ValueError)  # what a rank reports instead of raising alone
T = TypeVar("T")


@dataclass(frozen=True)
class Agreement:
    """The step every rank resumes from; ``newest``: this rank's newest good step;
    ``behind``: the ranks whose newest good step is older than another rank's newest."""

    step: int
    newest: int
    behind: tuple[int, ...] = ()


@dataclass
class _Found:
    """This rank's snapshots to resume from: the good ones and the others, newest first."""

    expected: str | None  # the run they must belong to
    good: list[tuple[int, Path]]
    bad: list[tuple[Path, str]] = field(default_factory=list)
    loaded: Snapshot | None = None  # a file named by ``path``: loaded to learn its step


def agreed_load(
    disk: SnapshotDisk,
    peers: Peers,
    path: str | os.PathLike[str] | None,
    device: torch.device,
    objects: dict[str, Any],
    *,
    foreign: bool = False,
) -> tuple[Snapshot, Path, Agreement]:
    """The snapshot of the step agreed (see the module), loaded and fitted to
    ``objects`` on every rank, or the same failure on every rank; nothing restored.
    In a folder, each newer file that does not verify is passed over (a
    ``snapshot_fallback`` event); newer good files another rank lacks are not."""
    found, mine = _attempt(lambda: _find(disk, path, device, foreign))
    steps = [s for s, _ in found.good][:_STEPS_SENT] if found is not None else []
    records = _together(peers, {"steps": steps}, mine, "guard.resume()'s snapshot steps")
    assert found is not None
    agreement = agree(records, peers.rank)
    used = dict(found.good)[agreement.step]
    newer = [(p, why) for p, why in found.bad if (step_of(p.name) or 0) > agreement.step]
    disk.passed_over(agreement.step, newer, used)
    snap, mine = _attempt(
        lambda: _load(disk, found, used, agreement.step, device, objects, foreign)
    )
    loads = _together(peers, {}, mine, f"guard.resume()'s load of step {agreement.step}")
    loaded(loads, peers.rank, agreement.step)
    assert snap is not None
    return snap, used, agreement


def _together(
    peers: Peers, record: dict[str, Any], mine: BaseException | None, what: str
) -> list[dict[str, Any]]:
    """Every rank's ``record`` with its error (rank order); this rank's own error is
    raised once the others know of it."""
    said = None if mine is None else f"{type(mine).__name__}: {mine}"[:2000]
    records = peers.all_gather_json({**record, "error": said}, what, _RECORD_BYTES)
    if isinstance(mine, SnapshotError):
        raise mine
    if mine is not None:  # a missing folder, say: a SnapshotError as on the other ranks
        raise SnapshotError(
            f"guard.resume() on rank {peers.rank} cannot resume ({type(mine).__name__}: {mine})"
        ) from mine
    return records


def agree(records: list[dict[str, Any]], rank: int) -> Agreement:
    """The step agreed from every rank's ``{"steps": [...], "error": ...}`` (rank order):
    the newest step in every rank's list; SnapshotError (the same on every rank) when a
    rank could not list its snapshots or no step is in every list."""
    failed = _failed(records)
    if failed:
        raise SnapshotError(
            f"guard.resume() on rank {rank}: {_failed_text(failed, 'cannot resume')}; "
            "nothing was loaded on any rank"
        )
    lists = [[int(s) for s in rec.get("steps") or ()] for rec in records]
    common = set(lists[0]).intersection(*lists[1:])
    if not common:
        raise SnapshotError(
            f"guard.resume() on rank {rank}: no step has a good snapshot on every rank "
            f"(the good snapshots' steps, newest first: {_steps_text(lists)}); nothing was "
            "loaded on any rank. A rank keeps its last ResponsePolicy.snapshot_keep "
            "snapshots (keep more to have one in common); to start afresh, give every "
            "rank an empty snapshot folder"
        )
    newest = [steps[0] for steps in lists]
    top = max(newest)
    behind = tuple(r for r, n in enumerate(newest) if n < top)
    return Agreement(max(common), newest[rank], behind)


def loaded(records: list[dict[str, Any]], rank: int, step: int) -> None:
    """SnapshotError (the same on every rank) when a rank could not load and fit its
    snapshot of the step agreed, from every rank's ``{"error": ...}``."""
    failed = _failed(records)
    if failed:
        whose = "its" if len(failed) == 1 else "their"
        what = f"cannot load {whose} snapshot of the step agreed, {step}"
        raise SnapshotError(
            f"guard.resume() on rank {rank}: {_failed_text(failed, what)}; nothing was "
            "loaded on any rank"
        )


def _find(
    disk: SnapshotDisk,
    path: str | os.PathLike[str] | None,
    device: torch.device,
    foreign: bool,
) -> _Found:
    """This rank's snapshots at ``path`` (a folder: verified, none unpickled; a file:
    loaded, its step is what it holds)."""
    target, expected = disk.open_target(path)
    if target.is_dir():
        good, bad = disk.verified_steps(target, expected, foreign=foreign)
        return _Found(expected, good, bad)
    snap = disk.load_file(target, device, expected, foreign=foreign)
    return _Found(expected, [(snap.step, target)], loaded=snap)


def _load(
    disk: SnapshotDisk,
    found: _Found,
    used: Path,
    step: int,
    device: torch.device,
    objects: dict[str, Any],
    foreign: bool,
) -> Snapshot:
    """The snapshot of ``step`` (at ``used``), checked against ``objects``."""
    snap = found.loaded
    if snap is None or snap.step != step:
        snap = disk.load_file(used, device, found.expected, foreign=foreign)
    disk.check_fit(snap, used, objects)
    return snap


def _attempt(fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    """``fn()``, or the error a rank reports to the others before raising it."""
    try:
        return fn(), None
    except _ERRORS as e:
        return None, e


def _failed(records: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return [(r, str(rec["error"])) for r, rec in enumerate(records) if rec.get("error")]


def _failed_text(failed: list[tuple[int, str]], what: str) -> str:
    """ "rank 1 cannot resume (SnapshotError: ...)"; several ranks: each one's error."""
    if len(failed) == 1:
        return f"rank {failed[0][0]} {what} ({failed[0][1]})"
    said = "; ".join(f"rank {r}: {e}" for r, e in failed[:4]) + ("; ..." if len(failed) > 4 else "")
    return f"{ranks_text([r for r, _ in failed][:16])} {what} ({said})"


def _steps_text(lists: list[list[int]]) -> str:
    """Every rank's steps, ranks with the same list together: "rank 0: 12, 10; rank 1: 6"."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for r, steps in enumerate(lists):
        groups.setdefault(tuple(steps), []).append(r)
    parts = []
    for listed, ranks in list(groups.items())[:8]:
        shown = ", ".join(map(str, listed[:6])) + (", ..." if len(listed) > 6 else "")
        parts.append(f"{ranks_text(ranks)}: {shown or 'none'}")
    return "; ".join(parts) + ("; ..." if len(groups) > 8 else "")
