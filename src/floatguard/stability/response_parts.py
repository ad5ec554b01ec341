"""The parts :class:`~floatguard.stability.respond.ResponsePolicy` composes: the ladder,
snapshots, bad data, repro bundles. Each is a frozen policy of its own, checked when
built (the same checks and messages as the flat keywords), so a part can be kept,
shared and reused: ``ResponsePolicy(snapshots=SnapshotPolicy(dir=d, keep=3))`` is
``ResponsePolicy(snapshot_dir=d, snapshot_keep=3)``."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Literal

__all__ = ["PARTS", "BadDataPolicy", "LadderPolicy", "ReproPolicy", "SnapshotPolicy", "check"]


class _Part:
    """A part's fields are ResponsePolicy's fields by another name (``PARTS``)."""

    def __post_init__(self) -> None:
        try:
            check(self.flat())  # ResponsePolicy's checks, at construction
        except ValueError as e:  # said in this part's own names
            text, cls = str(e), type(self).__name__
            for own, flat in PARTS[_part_name(self)][1].items():
                text = text.replace(f"ResponsePolicy.{flat}=", f"{cls}.{own}=")
            raise ValueError(text) from None

    def flat(self) -> dict[str, Any]:
        """This part's values by ResponsePolicy's keyword names."""
        names = PARTS[_part_name(self)][1]
        return {names[f.name]: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]


@dataclass(frozen=True)
class LadderPolicy(_Part):
    """The response to repeated bad steps (see :class:`ResponsePolicy`): skip; after
    ``lr_backoff_after`` in a row back the LR off by ``lr_backoff_factor`` (restored
    over ``lr_recovery_steps`` good steps); after ``rollback_after`` roll back and skip
    ``skip_batches``; stop after ``max_rollbacks`` rollbacks fewer than
    ``rollback_window`` good steps apart; warn after ``transient_warn_after`` transients."""

    lr_backoff_after: int = 2
    lr_backoff_factor: float = 0.5
    lr_recovery_steps: int = 50
    rollback_after: int = 5
    skip_batches: int = 0
    max_rollbacks: int = 3
    rollback_window: int = 1000
    transient_warn_after: int = 3


@dataclass(frozen=True)
class SnapshotPolicy(_Part):
    """Snapshots: every ``every`` good steps in memory (``on``: "auto", "host",
    "device"; ``budget``: a fraction of step time, "auto" or None; ``overlap``: copied
    as the step begins); with ``dir``, every ``disk_every``-th on disk, ``keep`` kept;
    a failed write: ``on_error`` "retry", "disable" or "raise"."""

    every: int = 5
    dir: str | None = None
    keep: int = 2
    disk_every: int = 1
    on_error: Literal["retry", "disable", "raise"] = "retry"
    on: Literal["auto", "host", "device"] = "auto"
    budget: float | Literal["auto"] | None = "auto"
    overlap: bool = False


@dataclass(frozen=True)
class BadDataPolicy(_Part):
    """Non-finite batches: a warning after ``warn_after`` in a row; a stop after
    ``stop_after`` in a row, or ``stop_fraction`` of the last ``window`` decided steps."""

    warn_after: int = 3
    stop_after: int = 10
    window: int = 50
    stop_fraction: float = 0.5


@dataclass(frozen=True)
class ReproPolicy(_Part):
    """Repro bundles: written to ``dir`` (None: off) at ``level`` "minimal" or "step",
    ``keep`` kept."""

    dir: str | os.PathLike[str] | None = None
    level: Literal["minimal", "step"] = "minimal"
    keep: int = 5


def _names(prefix: str, cls: type, **special: str) -> dict[str, str]:
    return {f.name: special.get(f.name, prefix + f.name) for f in fields(cls)}


# ResponsePolicy's keyword for each part, the part's class, and its field names there
PARTS: dict[str, tuple[type, dict[str, str]]] = {
    "ladder": (LadderPolicy, _names("", LadderPolicy)),
    "snapshots": (SnapshotPolicy, _names("snapshot_", SnapshotPolicy, disk_every="disk_every",
                                         on_error="on_snapshot_error")),
    "bad_data": (BadDataPolicy, _names("bad_data_", BadDataPolicy)),
    "repro": (ReproPolicy, _names("repro_", ReproPolicy)),
}  # fmt: skip


def _part_name(part: object) -> str:
    return next(k for k, (cls, _) in PARTS.items() if isinstance(part, cls))


_COUNTS = ("lr_backoff_after", "lr_recovery_steps", "rollback_after", "max_rollbacks",
           "rollback_window", "snapshot_every", "snapshot_keep", "disk_every",
           "transient_warn_after", "bad_data_warn_after", "bad_data_stop_after",
           "bad_data_window", "repro_keep")  # fmt: skip
_CHOICES = {
    "on_snapshot_error": (("retry", "disable", "raise"), "use 'retry', 'disable' or 'raise'"),
    "snapshot_on": (("auto", "host", "device"), "use 'auto', 'host' or 'device'"),
    "repro_level": (("minimal", "step"), "use 'minimal' (the birth's module) or 'step' "
                    "(the whole step, with the pre-step state)"),
}  # fmt: skip


def check(values: dict[str, Any]) -> None:
    """ValueError naming the first of ``values`` (by ResponsePolicy's keyword names; any
    subset of them) that is out of range, and what it must be."""

    def bad(name: str, must: str) -> ValueError:
        return ValueError(f"ResponsePolicy.{name}={values[name]!r} {must}")

    for name in _COUNTS:
        v = values.get(name, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise bad(name, "must be an int >= 1")
    v = values.get("skip_batches", 0)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise bad("skip_batches", "must be an int >= 0")
    for name, (allowed, use) in _CHOICES.items():
        if name in values and values[name] not in allowed:
            raise ValueError(f"ResponsePolicy.{name}={values[name]!r}; {use}")
    if not _number_in(values.get("bad_data_stop_fraction", 1), 0, 1, closed=True):
        raise bad("bad_data_stop_fraction", "must be in (0, 1]")
    b = values.get("snapshot_budget")
    if b is not None and b != "auto" and not _number_in(b, 0, 1):
        raise bad("snapshot_budget", "must be a fraction in (0, 1) of step time (0.01: 1%), "
                  "'auto' or None (a snapshot every snapshot_every good steps)")  # fmt: skip
    for name in ("repro_dir", "snapshot_dir"):
        d = values.get(name)
        if d is not None and not isinstance(d, (str, os.PathLike)):
            raise bad(name, "must be a folder path or None")
    if not isinstance(values.get("snapshot_overlap", False), bool):
        raise bad("snapshot_overlap", "must be True or False")
    if not _number_in(values.get("lr_backoff_factor", 0.5), 0, 1):
        raise bad("lr_backoff_factor", "must be in (0, 1)")


def _number_in(v: object, lo: float, hi: float, closed: bool = False) -> bool:
    """Whether ``v`` is a real number (not a bool) in (lo, hi), or (lo, hi] if ``closed``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return lo < v <= hi if closed else lo < v < hi
