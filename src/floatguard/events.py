"""Typed event records and the JSONL sink: one stream for every observation and decision.

Schema (version 1): each line is a JSON object with ``schema`` (1), ``kind``,
``step`` and ``time`` (Unix seconds), plus the kind's fields:

``step``      action ("applied" | "skipped" | "rolled_back"), reason, loss, grad_norm,
              clip_coef, scale, lr_factor
``fault``     phase, module, tensor, kind_of_value ("nan" | "inf"), shape
``overflow``  scale_before, scale_after (loss-scaler back-off)
``spike``     signal ("loss" | "grad_norm"), value, threshold, detector
``rollback``  to_step, rollbacks, skip_batches
``lr_backoff`` factor
``snapshot``  where ("memory" | path)
``stop``      reason

Non-finite floats are written as the strings "nan", "inf", "-inf" (JSON has no
literal for them) and read back as floats by :func:`read_events`.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = ["SCHEMA_VERSION", "Event", "EventLog", "read_events"]

SCHEMA_VERSION = 1


def _encode(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, (list, tuple)):
        return [_encode(x) for x in v]
    if isinstance(v, dict):
        return {k: _encode(x) for k, x in v.items()}
    return v


def _decode(v: Any) -> Any:
    if v in ("nan", "inf", "-inf"):
        return float(v)
    if isinstance(v, list):
        return [_decode(x) for x in v]
    if isinstance(v, dict):
        return {k: _decode(x) for k, x in v.items()}
    return v


@dataclass(frozen=True)
class Event:
    """One record of the stream: what happened (``kind``), when (``step``), and its fields."""

    kind: str
    step: int
    fields: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    def to_json(self) -> str:
        record = {"schema": SCHEMA_VERSION, "kind": self.kind, "step": self.step, "time": self.time}
        record.update(_encode(self.fields))
        return json.dumps(record, sort_keys=False)

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]


class EventLog:
    """Collects events in memory and, if given a path, appends them to a JSONL file
    (line-buffered, flushed per event so a crash loses at most the line being written)."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.events: list[Event] = []
        self.path = Path(path) if path is not None else None
        self._fh: IO[str] | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")  # closed in close()

    def emit(self, kind: str, step: int, **fields: Any) -> Event:
        ev = Event(kind, step, fields)
        self.events.append(ev)
        if self._fh is not None:
            self._fh.write(ev.to_json() + "\n")
            self._fh.flush()
        return ev

    def of_kind(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_events(path: str | os.PathLike[str]) -> Iterator[Event]:
    """Events of a JSONL file written by :class:`EventLog` (any schema version <= ours)."""
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e.msg})") from None
            if rec.get("schema", 0) > SCHEMA_VERSION:
                raise ValueError(
                    f"{path}:{n}: schema {rec['schema']} is newer than this floatguard "
                    f"({SCHEMA_VERSION}); upgrade floatguard to read it"
                )
            kind, step, t = rec.pop("kind"), rec.pop("step"), rec.pop("time", 0.0)
            rec.pop("schema", None)
            yield Event(kind, int(step), _decode(rec), float(t))
