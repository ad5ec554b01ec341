"""A run's event log held compactly, for the report and the diagnosis of logs of any size.

Step events are kept as columns (about 80 bytes a step: arrays of floats and ints, the
action as a byte), the rare kinds (faults, spikes, rollbacks, ...) as events, snapshot
events only counted, and ``stats`` samples slimmed to what the report and the
diagnosis read: each tensor's counts, amax and fp16 underflow, with the exponent
histogram and every format's fractions kept only for the latest sample of each rank
(the one the histograms plot). Reading streams the file line by line, so memory is
bounded by the number of steps and samples, not by the log's bytes.

A ``resume`` event supersedes what its rank logged before it for the steps it redoes
(a crash cut them short, or a run resumed from an older snapshot): those steps'
events (steps, faults, spikes, statistics, ...) are dropped when the ``resume`` is
read, so a redone step counts once; the run's history of its edges (``run``,
``stop``, ``resume``, snapshot errors and fallbacks) is kept.
"""

from __future__ import annotations

import math
import os
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, overload

from floatguard._event_schema import finite as _finite
from floatguard.events import Event, conform_events, read_events

__all__ = ["RunLog", "Steps", "global_view", "reduce_stats", "tensor_fields"]

_ACTIONS = (None, "applied", "skipped", "rolled_back")
_CODE = {a: i for i, a in enumerate(_ACTIONS)}
_FLOATS = ("loss", "grad_norm", "clip_coef", "scale", "lr_factor", "lr")
# What a step logs; a resume supersedes its rank's events of these kinds for the steps
# it redoes (the rest are the run's edges, kept: run, stop, resume, snapshot errors).
_REDONE = frozenset({"step", "overflow", "spike", "lr_backoff", "rollback", "snapshot",
                     "stats", "fault", "warning", "end"})  # fmt: skip


class Steps(Sequence[Event]):
    """The step events as columns; indexing makes an :class:`Event` on demand, and
    :meth:`column` gives one field for all steps (the fast path for whole-run scans)."""

    def __init__(self) -> None:
        self.step = array("q")
        self.time = array("d")
        self.rank = array("q")
        self.action = bytearray()
        self.reason: list[str | None] = []
        self._floats = {name: array("d") for name in _FLOATS}
        self._none = {name: bytearray() for name in _FLOATS}  # 1 where the field was null
        self._reasons: dict[str, str] = {}  # one string object per distinct reason

    def append(self, e: Event) -> None:
        f = e.fields
        self.step.append(e.step)
        self.time.append(e.time)
        self.rank.append(e.rank)
        self.action.append(_CODE.get(f.get("action"), 0))
        reason = f.get("reason")
        self.reason.append(None if reason is None else self._reasons.setdefault(reason, reason))
        for name in _FLOATS:
            v = f.get(name)
            self._floats[name].append(math.nan if v is None else float(v))
            self._none[name].append(v is None)

    def __len__(self) -> int:
        return len(self.step)

    @overload
    def __getitem__(self, i: int) -> Event: ...
    @overload
    def __getitem__(self, i: slice) -> list[Event]: ...
    def __getitem__(self, i: int | slice) -> Event | list[Event]:
        if isinstance(i, slice):
            return [self._event(j) for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._event(i)

    def __iter__(self) -> Iterator[Event]:
        return (self._event(j) for j in range(len(self)))

    def _event(self, j: int) -> Event:
        fields: dict[str, Any] = {"action": _ACTIONS[self.action[j]], "reason": self.reason[j]}
        for name in _FLOATS:
            fields[name] = None if self._none[name][j] else self._floats[name][j]
        return Event("step", self.step[j], fields, self.time[j], self.rank[j])

    def column(self, name: str) -> list[Any]:
        """One field for every step, in order (None where the event had none)."""
        if name in ("step", "rank", "time"):
            return list(getattr(self, name))
        if name == "action":
            return [_ACTIONS[c] for c in self.action]
        if name == "reason":
            return list(self.reason)
        values, none = self._floats[name], self._none[name]
        return [None if n else v for v, n in zip(values, none, strict=True)]

    def drop_redone(self, rank: int, step: int) -> int:
        """Drop ``rank``'s steps from ``step`` on (a resume redoes them); how many."""
        if not any(r == rank and s >= step for r, s in zip(self.rank, self.step, strict=True)):
            return 0
        kept = self.where(lambda j: not (self.rank[j] == rank and self.step[j] >= step))
        dropped = len(self) - len(kept)
        self.__dict__.update(kept.__dict__)
        return dropped

    def where(self, keep: Callable[[int], bool]) -> Steps:
        """The steps at the indices ``keep`` accepts (a rank's, say), as new columns."""
        out = Steps()
        for j in range(len(self)):
            if keep(j):
                out.append(self._event(j))
        return out


def _slim(tensors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stats sample's tensors without the parts only the latest sample needs."""
    out = []
    for t in tensors:
        fp16 = (t.get("formats") or {}).get("fp16")
        slim = {k: t.get(k) for k in ("module", "role", "numel", "amax", "nonfinite", "zeros")}
        slim["formats"] = {"fp16": {"underflow": fp16.get("underflow")}} if fp16 else {}
        slim["hist"], slim["hist_from"] = [], 0
        out.append(slim)
    return out


class RunLog:
    """A run's events, compact (see the module): ``steps`` (:class:`Steps`), ``events``
    (every other kind kept, in log order), ``counts`` (events per kind, all of them but
    the ``superseded``: the events of steps a ``resume`` redid, see the module)."""

    def __init__(self) -> None:
        self.steps = Steps()
        self.events: list[Event] = []
        self.counts: Counter[str] = Counter()
        self.rank_counts: Counter[int] = Counter()  # events per rank, all of them
        self._latest_stats: dict[int, int] = {}  # rank -> index in events of its last sample
        self._by_kind: dict[str, list[Event]] | None = None
        self._snapshots: Counter[tuple[int, int]] = Counter()  # (rank, step) -> count
        self.superseded = 0  # events of redone steps, dropped (see the module)

    def add(self, e: Event) -> None:
        """One event (conformed: see :func:`floatguard.events.conform_events`)."""
        if e.kind == "resume":
            self._supersede(e.rank, e.step)
        self.counts[e.kind] += 1
        self.rank_counts[e.rank] += 1
        if e.kind == "step":
            self.steps.append(e)
            return
        if e.kind == "snapshot":
            self._snapshots[e.rank, e.step] += 1
            return  # counted: nothing reads them one by one
        self._by_kind = None
        if e.kind == "stats":
            before = self._latest_stats.get(e.rank)
            if before is not None:  # the rank's previous sample: slim it now
                old = self.events[before]
                tensors = _slim(old.fields.get("tensors") or [])
                self.events[before] = Event("stats", old.step, {"tensors": tensors},
                                            old.time, old.rank)  # fmt: skip
            self._latest_stats[e.rank] = len(self.events)
        self.events.append(e)

    def _supersede(self, rank: int, step: int) -> None:
        """A resume of ``rank`` at ``step``: drop its earlier events of steps >= step."""
        dropped = self.steps.drop_redone(rank, step)
        self.counts["step"] -= dropped
        n = 0
        for key in [k for k in self._snapshots if k[0] == rank and k[1] >= step]:
            n += self._snapshots.pop(key)
        self.counts["snapshot"] -= n
        dropped += n
        redone = [i for i, e in enumerate(self.events)
                  if e.rank == rank and e.step >= step and e.kind in _REDONE]  # fmt: skip
        if redone:
            gone = set(redone)
            for i in redone:
                self.counts[self.events[i].kind] -= 1
            latest = self._latest_stats.get(rank)
            if latest in gone:
                del self._latest_stats[rank]
            kept: list[Event] = []
            for i, ev in enumerate(self.events):
                if i in gone:
                    continue
                if ev.kind == "stats" and self._latest_stats.get(ev.rank) == i:
                    self._latest_stats[ev.rank] = len(kept)
                kept.append(ev)
            self.events = kept
            self._by_kind = None
            dropped += len(redone)
        self.rank_counts[rank] -= dropped
        self.superseded += dropped

    @classmethod
    def from_events(cls, events: Iterable[Event], problems: list[str] | None = None) -> RunLog:
        """Events built in code (checked and completed as the reader does)."""
        if isinstance(events, RunLog):
            return events
        log = cls()
        for e in conform_events(events, problems):
            log.add(e)
        return log

    @classmethod
    def read(
        cls,
        paths: Sequence[str | os.PathLike[str]],
        problems: list[str] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> RunLog:
        """The logs at ``paths`` (one per rank, or one), streamed; unreadable lines go to
        ``problems``; ``progress(bytes_read, total_bytes)`` is called as it goes."""
        log = cls()
        total = sum(Path(p).stat().st_size for p in paths)
        done = 0
        errors = problems if problems is not None else []

        def step(n: int, _total: int) -> None:
            if progress is not None:
                progress(done + n, total)

        for p in paths:
            for e in read_events(p, errors=errors, progress=step):
                log.add(e)
            done += Path(p).stat().st_size
        if progress is not None:
            progress(total, total)
        return log

    def of_kind(self, kind: str) -> Sequence[Event]:
        """The events of one kind, in log order (the steps as :class:`Steps`)."""
        if kind == "step":
            return self.steps
        if self._by_kind is None:
            by: dict[str, list[Event]] = {}
            for e in self.events:
                by.setdefault(e.kind, []).append(e)
            self._by_kind = by
        return self._by_kind.get(kind, [])

    @property
    def ranks(self) -> list[int]:
        return sorted(set(self.steps.rank) | {e.rank for e in self.events})

    def __iter__(self) -> Iterator[Event]:
        """Every kept event, steps first (for small logs and tests; rules use of_kind)."""
        yield from self.steps
        yield from self.events

    def __len__(self) -> int:
        return len(self.steps) + len(self.events)


# Under torch.distributed the guard's decisions are the same on every rank, so these
# kinds are read from one rank (the lowest); the rest are each rank's own.
_AGREED = frozenset({"step", "overflow", "spike", "lr_backoff", "rollback", "snapshot",
                     "resume", "stop", "fault"})  # fmt: skip


def reduce_stats(tensors_by_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One ``stats`` event's tensors reduced over ranks (the global view): per
    ``(module, role)``, counts and exponent histograms summed, amax the maximum, format
    fractions weighted by each rank's element count."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for tensors in tensors_by_rank:
        for raw in tensors:
            t = tensor_fields(raw)
            key = (t["module"], t["role"])
            m = merged.get(key)
            if m is None:
                merged[key] = t
                continue
            n0, n1 = m["numel"], t["numel"]
            for f, v in t["formats"].items():
                mine = m["formats"].setdefault(f, dict.fromkeys(v, 0.0))
                for k, x in v.items():
                    if _finite(x) and _finite(mine.get(k)):
                        mine[k] = (mine[k] * n0 + x * n1) / max(n0 + n1, 1)
            if not t["hist"]:
                hist, lo = m["hist"], m["hist_from"]
            elif not m["hist"]:
                hist, lo = t["hist"], t["hist_from"]
            else:
                lo = min(m["hist_from"], t["hist_from"])
                hi = max(m["hist_from"] + len(m["hist"]), t["hist_from"] + len(t["hist"]))
                hist = [0] * (hi - lo)
                for src in (m, t):
                    for i, c in enumerate(src["hist"]):
                        hist[src["hist_from"] - lo + i] += c
            a, b = m["amax"], t["amax"]
            # NaN (a NaN seen) wins, then the larger of what is known
            known = [x for x in (a, b) if x is not None]
            amax = a if _is_nan(a) else b if _is_nan(b) else (max(known) if known else None)
            m.update(numel=n0 + n1, nonfinite=m["nonfinite"] + t["nonfinite"],
                     zeros=m["zeros"] + t["zeros"], hist_from=lo, hist=hist, amax=amax)  # fmt: skip
    return list(merged.values())


def _is_nan(v: object) -> bool:
    return isinstance(v, float) and math.isnan(v)


def tensor_fields(t: dict[str, Any]) -> dict[str, Any]:
    """A stats tensor entry with its optional parts filled (counts 0, no histogram)."""

    def count(k: str) -> int:
        v = t.get(k)
        return v if type(v) is int and v >= 0 else 0

    return {
        **t,
        "numel": count("numel"), "nonfinite": count("nonfinite"), "zeros": count("zeros"),
        "formats": {f: dict(v) for f, v in (t.get("formats") or {}).items() if isinstance(v, dict)},
        "hist": list(t.get("hist") or []),
        "hist_from": t.get("hist_from") if type(t.get("hist_from")) is int else 0,
        "amax": t.get("amax"),
    }  # fmt: skip


def global_view(events: Iterable[Event]) -> RunLog:
    """The run as one stream: the agreed kinds from the lowest rank, every rank's own
    events (warnings, snapshot errors), ``stats`` reduced over ranks per step
    (:func:`reduce_stats`), and a fault seen only on another rank (logs written before
    every rank logged faults) kept too. One rank's events come back as they are."""
    log = RunLog.from_events(events)
    ranks = log.ranks
    if len(ranks) <= 1:
        return log
    lead = ranks[0]
    out = RunLog()
    lead_steps = log.steps.where(lambda j: log.steps.rank[j] == lead)
    out.steps = lead_steps
    out.counts, out.rank_counts = log.counts, log.rank_counts
    fault_steps = {e.step for e in log.of_kind("fault") if e.rank == lead}
    stats: dict[int, list[list[dict[str, Any]]]] = {}
    kept: list[Event] = []
    for e in log.events:
        if e.kind == "stats":
            stats.setdefault(e.step, []).append(e["tensors"] or [])
        elif e.kind in _AGREED:
            if e.rank == lead:
                kept.append(e)
            elif e.kind == "fault" and e.step not in fault_steps:
                fault_steps.add(e.step)
                kept.append(e)
        else:
            kept.append(e)
    for step, parts in stats.items():
        kept.append(Event("stats", step, {"tensors": reduce_stats(parts)}, rank=lead))
    kept.sort(key=lambda e: (e.step, e.time))
    out.events = kept
    return out
