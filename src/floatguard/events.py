"""Typed event records and the JSONL sink: one stream for every observation and decision.

Schema 2: each line is one JSON object, the *envelope* ``schema`` (2), ``kind``,
``step`` (int), ``time`` (Unix seconds), ``rank`` (int, 0 without torch.distributed),
then the kind's own fields, exactly those of :data:`EVENT_FIELDS` (checked when an
event is emitted: a missing, extra or envelope-named field is an error).

Non-finite floats have no JSON literal; they are written tagged, ``{"$float": "nan"}``
(or ``"inf"``, ``"-inf"``), so a *string* ``"nan"`` stays a string. Schema 1 files
(non-finite floats as the bare strings ``"nan"``, ``"inf"``, ``"-inf"``) are still
read: there those strings become floats except in fields the schema says are
strings (``kind_of_value``, ``phase``, ...).

Crash safety: every line is written whole and flushed (a process kill loses at most
the line being written); ``fsync_every`` / ``fsync_seconds`` also fsync the file
(off by default: a power loss may lose what the OS had not written yet). A writer
appending to a file whose last line is torn starts on a new line; a reader skips a
torn line (an object cut short) with a warning, or raises with ``strict=True``. Every
other bad line is an error naming the file and line number.

Memory: :class:`EventLog` keeps the last ``keep`` events (10,000 by default) and a
count per kind; the file has them all.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import time
import warnings
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from floatguard._event_schema import FIELD_TYPES, conform_fields
from floatguard._safe_io import NotRegularFile, open_regular

__all__ = [
    "EVENT_FIELDS", "FIELD_TYPES", "SCHEMA_VERSION", "Event", "EventLog", "conform_events",
    "read_events",
]  # fmt: skip

SCHEMA_VERSION = 2
ENVELOPE = ("schema", "kind", "step", "time", "rank")
_MAX_DEPTH = 32

# Every kind and exactly its fields. A new kind is added here, with its fields.
EVENT_FIELDS: dict[str, frozenset[str]] = {
    k: frozenset(v)
    for k, v in {
        "run": ("precision", "loss_scaling", "param_dtypes", "optimizer", "world_size", "clip"),
        "step": (
            "action", "reason", "loss", "grad_norm", "clip_coef", "scale", "lr_factor", "lr",
        ),
        "fault": (
            "phase", "module", "tensor", "kind_of_value", "shape", "op", "source",
            "deterministic", "stats", "fault_rank", "cause", "input_amax", "batch",
        ),
        "overflow": ("scale_before", "scale_after"),
        "spike": ("signal", "value", "reproduced", "batch"),
        "lr_backoff": ("factor",),
        "rollback": ("to_step", "rollbacks", "skip_batches", "cause"),
        "snapshot": ("where", "freed"),
        "snapshot_error": ("where", "error", "policy"),
        "snapshot_fallback": ("bad", "error", "used"),
        "resume": (
        "from_step", "path", "newest_step", "ranks_behind", "written_world_size", "run_id"
    ),
        "warning": ("transients", "message", "code", "evidence"),
        "stats": ("tensors",),
        "stop": ("reason", "fault"),
        "end": ("state_finite", "nonfinite", "lr_factor", "lr", "scale"),
        "repro": ("path", "level", "bytes", "seconds", "tape_ops", "reproduced"),
        "advice": (
            "recipe", "budget", "keep", "kept_share", "gap_all", "gap_plan", "expected",
            "expected_plan", "notes", "layers",
        ),
    }.items()
}  # fmt: skip
# Fields that hold strings: in schema 1 files a string "nan" there stays a string.
_STRING_FIELDS = frozenset(
    {"kind_of_value", "phase", "module", "tensor", "op", "source", "action", "reason",
     "signal", "where", "cause", "message", "error", "path", "bad", "used", "policy", "fault",
     "level"}
) | frozenset(  # and every field the schema types as a string (a run's "optimizer": "inf")
    name for fields in FIELD_TYPES.values() for name, t in fields.items() if t.rstrip("?") == "str"
)  # fmt: skip


def _encode(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return {"$float": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
    if isinstance(v, (list, tuple)):
        return [_encode(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _encode(x) for k, x in v.items()}
    return v


def encode_value(v: Any) -> Any:
    """``v`` with non-finite floats tagged (``{"$float": "nan"}``), for strict JSON."""
    return _encode(v)


def _decode(v: Any, schema: int, name: str | None = None) -> Any:
    if isinstance(v, dict):
        if len(v) == 1 and "$float" in v and v["$float"] in ("nan", "inf", "-inf"):
            return float(v["$float"])
        return {k: _decode(x, schema) for k, x in v.items()}
    if isinstance(v, list):
        return [_decode(x, schema, name) for x in v]
    if schema < 2 and v in ("nan", "inf", "-inf") and name not in _STRING_FIELDS:
        return float(v)
    return v


@dataclass(frozen=True)
class Event:
    """One record of the stream: what happened (``kind``), when (``step``), and its fields."""

    kind: str
    step: int
    fields: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)
    rank: int = 0

    def to_json(self) -> str:
        record = {
            "schema": SCHEMA_VERSION, "kind": self.kind, "step": self.step,
            "time": self.time, "rank": self.rank,
        }  # fmt: skip
        record.update(_encode(self.fields))
        return json.dumps(record, allow_nan=False)

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]


def check_event(kind: str, fields: dict[str, Any]) -> None:
    """Raise ValueError unless ``fields`` are exactly ``kind``'s (and no envelope name)."""
    clash = sorted(set(fields) & set(ENVELOPE))
    if clash:
        raise ValueError(
            f"event field(s) {clash} would overwrite the envelope ({', '.join(ENVELOPE)}); "
            "rename them"
        )
    expected = EVENT_FIELDS.get(kind)
    if expected is None:
        raise ValueError(
            f"unknown event kind {kind!r}; known: {', '.join(sorted(EVENT_FIELDS))} "
            "(add a kind to floatguard.events.EVENT_FIELDS with its fields)"
        )
    got = set(fields)
    if got != expected:
        missing, extra = sorted(expected - got), sorted(got - expected)
        raise ValueError(f"event {kind!r}: missing fields {missing}, unexpected {extra}")


class EventLog:
    """The last ``keep`` events in memory (and a count per kind) and, given a path,
    every event appended to a JSONL file, one flushed line each.

    ``fsync_every``: fsync after that many events; ``fsync_seconds``: fsync when that
    long has passed since the last one (both None: never, the default; the OS writes
    the data out on its own schedule, so a kill loses nothing flushed, a power loss
    may). ``rank`` goes in every envelope. A failed write (a full or read-only disk)
    warns once and keeps the events in memory: it never breaks a training step.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        keep: int = 10_000,
        fsync_every: int | None = None,
        fsync_seconds: float | None = None,
        rank: int = 0,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ValueError(f"EventLog(keep={keep!r}) must be an int >= 0")
        if fsync_every is not None and (not isinstance(fsync_every, int) or fsync_every < 1):
            raise ValueError(f"EventLog(fsync_every={fsync_every!r}) must be an int >= 1 or None")
        if fsync_seconds is not None and not fsync_seconds > 0:
            raise ValueError(f"EventLog(fsync_seconds={fsync_seconds!r}) must be > 0 or None")
        self._ring: deque[Event] = deque(maxlen=keep)
        self.counts: Counter[str] = Counter()
        self.path = Path(path) if path is not None else None
        self.rank = int(rank)
        self.fsync_every, self.fsync_seconds = fsync_every, fsync_seconds
        self._unsynced = 0
        self._last_sync = time.monotonic()
        self._fh: IO[str] | None = None
        self._listeners: list[Callable[[Event], None]] = []
        self.write_error: str | None = None
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                torn = _ends_torn(self.path)
                self._fh = _open_log(self.path)  # closed in close()
            except OSError as e:
                if e.errno not in _NO_WRITE:
                    raise
                self._cannot_write(e, "from the start", 2)
                return
            if torn:
                self._fh.write("\n")  # a crash left half a line: start on a fresh one

    @property
    def events(self) -> list[Event]:
        """The events kept in memory (the last ``keep``), oldest first."""
        return list(self._ring)

    def emit(self, kind: str, step: int, /, **fields: Any) -> Event:
        check_event(kind, fields)
        ev = Event(kind, int(step), fields, rank=self.rank)
        self._ring.append(ev)
        self.counts[kind] += 1
        if self._fh is not None:
            self._write(ev)
        for listener in self._listeners:
            listener(ev)
        return ev

    def subscribe(self, listener: Callable[[Event], None]) -> None:
        """Call ``listener`` with every event from now on (a live view, a logger)."""
        self._listeners.append(listener)

    def _write(self, ev: Event) -> None:
        assert self._fh is not None
        try:
            self._fh.write(ev.to_json() + "\n")
            self._fh.flush()
            self._unsynced += 1
            now = time.monotonic()
            if (self.fsync_every is not None and self._unsynced >= self.fsync_every) or (
                self.fsync_seconds is not None and now - self._last_sync >= self.fsync_seconds
            ):
                os.fsync(self._fh.fileno())
                self._unsynced, self._last_sync = 0, now
        except OSError as e:
            self._cannot_write(e, "from now on", 4)

    def _cannot_write(self, e: OSError, since: str, stacklevel: int) -> None:
        why = (
            "its reader is not reading: a FIFO that stays full would stop training"
            if isinstance(e, BlockingIOError)
            else str(e)
        )
        warnings.warn(
            f"floatguard: cannot write events to {self.path} ({why}); {since} they "
            f"are kept in memory only (the last {self._ring.maxlen}); training goes on",
            RuntimeWarning,
            stacklevel=stacklevel,
        )
        self.write_error = str(e)
        self._drop_file()

    def _drop_file(self) -> None:
        fh, self._fh = self._fh, None
        if fh is not None:
            try:
                fh.close()
            except OSError:
                pass  # what it still buffered cannot be written either

    def of_kind(self, kind: str) -> list[Event]:
        """The kept events of one kind, oldest first."""
        return [e for e in self._ring if e.kind == kind]

    def close(self) -> None:
        if self._fh is not None:
            try:
                self._fh.flush()
                if self.fsync_every is not None or self.fsync_seconds is not None:
                    os.fsync(self._fh.fileno())
            except OSError as e:
                self.write_error = str(e)
            self._drop_file()


_NO_WRITE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT)


def _open_log(path: Path) -> IO[str]:
    """``path`` open for appending. The path is the user's: a link is followed, a device
    (``/dev/null``) or a FIFO with a reader is written to (without blocking: a reader
    that stops reading ends the file's writes, with a warning, not training); a FIFO
    with no reader (a plain open would wait for one forever) and a directory are
    refused, naming it."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0), 0o644)
    except IsADirectoryError:
        raise IsADirectoryError(
            f"log={str(path)!r} is a directory; give a file, e.g. {str(path / 'events.jsonl')!r}"
        ) from None
    except OSError as e:
        if e.errno != errno.ENXIO:
            raise
        raise NotRegularFile(
            f"log={str(path)!r} is a FIFO with no reader: writing would wait for one "
            "forever; start its reader first, or give a file"
        ) from None
    if stat.S_ISREG(os.fstat(fd).st_mode) and hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)  # a FIFO stays non-blocking: a stalled reader cannot
    return os.fdopen(fd, "a", encoding="utf-8")  # stop training (the writes stop instead)


def _ends_torn(path: Path) -> bool:
    """Whether a non-empty regular file's last byte is not a newline (a line cut by a
    crash); False for anything else (a FIFO, a device: never opened to read)."""
    try:
        with open_regular(path) as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell() == 0:
                return False
            fh.seek(-1, os.SEEK_END)
            return fh.read(1) != b"\n"
    except (FileNotFoundError, NotRegularFile):
        return False


def _depth(v: Any, limit: int) -> int:
    """Nesting depth of a decoded JSON value, stopping past ``limit``."""
    stack, deepest = [(v, 1)], 0
    while stack:
        x, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        if isinstance(x, dict):
            stack.extend((y, d + 1) for y in x.values())
        elif isinstance(x, list):
            stack.extend((y, d + 1) for y in x)
    return deepest


class _TornLine(ValueError):
    """A line cut short by a crash mid-write: valid JSON up to where it stops."""


_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_NUMBER_NEXT = {  # a JSON number as a state machine: state -> {class: next state}
    "start": {"-": "sign", "0": "zero", "d": "int"},
    "sign": {"0": "zero", "d": "int"},
    "zero": {".": "dot", "e": "exp"},
    "int": {"d": "int", "0": "int", ".": "dot", "e": "exp"},
    "dot": {"d": "frac", "0": "frac"},
    "frac": {"d": "frac", "0": "frac", "e": "exp"},
    "exp": {"+": "esign", "-": "esign", "d": "edig", "0": "edig"},
    "esign": {"d": "edig", "0": "edig"},
    "edig": {"d": "edig", "0": "edig"},
}


def _number_end(text: str, i: int) -> tuple[int, bool]:
    """Scan a number from ``i``: (where it stops, whether the text ended inside it)."""
    state = "start"
    while i < len(text):
        c = text[i]
        cls = "0" if c == "0" else "d" if c.isdigit() else "e" if c in "eE" else c
        nxt = _NUMBER_NEXT[state].get(cls)
        if nxt is None:
            return i, False
        state, i = nxt, i + 1
    return i, True


def _is_json_prefix(text: str) -> bool:
    """Whether ``text`` is a proper prefix of some JSON object (what a crash mid-write
    leaves: cut anywhere, in a string, an escape, a number or a literal)."""
    stack: list[str] = []  # "{" or "[" still open
    i, n = 0, len(text)
    while i < n and text[i].isspace():
        i += 1
    if i >= n or text[i] != "{":
        return False
    while i < n:
        c = text[i]
        if c.isspace() or c in ",:":
            i += 1
        elif c in "{[":
            stack.append(c)
            i += 1
        elif c in "}]":
            if not stack or {"{": "}", "[": "]"}[stack.pop()] != c:
                return False
            i += 1
            if not stack:  # the object closed: the rest must be blank (else not a prefix)
                return not text[i:].strip()
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                if text[i] == "\\":
                    esc = text[i + 1 : i + 2]
                    if not esc:
                        return True  # cut after the backslash
                    if esc == "u":
                        hexes = text[i + 2 : i + 6]
                        if any(h not in "0123456789abcdefABCDEF" for h in hexes):
                            return False
                        if len(hexes) < 4:
                            return True  # cut inside \uXXXX
                        i += 6
                        continue
                    if esc not in '"\\/bfnrt':
                        return False
                    i += 2
                    continue
                i += 1
            if i >= n:
                return True  # cut inside a string
            i += 1
        elif c == "-" or c.isdigit():
            i, ended = _number_end(text, i)
            if ended:
                return True
        else:
            rest = text[i:]
            word = next((w for w in _LITERALS if rest.startswith(w)), None)
            if word is not None:
                i += len(word)
            elif any(w.startswith(rest) for w in _LITERALS):
                return True  # cut inside a literal (nul, tr, ...)
            else:
                return False
    return bool(stack)


def _is_truncated(text: str, e: json.JSONDecodeError) -> bool:
    """A JSON object cut short: a proper prefix of one (what a crash mid-write leaves)."""
    del e
    return _is_json_prefix(text)


def _parse(raw: bytes, where: str) -> Event:
    """One line to an Event, or ValueError naming ``where`` (file:line) and the fault."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.end >= len(raw):  # a multi-byte character cut at the end of the line
            raise _TornLine(f"{where}: a torn line (cut inside a character)") from None
        raise ValueError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        if text.lstrip().startswith("{") and _is_truncated(text, e):
            raise _TornLine(f"{where}: a torn line (cut short: {e.msg})") from None
        raise ValueError(f"{where}: not a JSON line ({e.msg})") from None
    except RecursionError:
        raise ValueError(f"{where}: nested too deeply") from None
    except ValueError as e:  # json's own limits: an integer of thousands of digits
        raise ValueError(f"{where}: a value out of range ({str(e)[:60]})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: a line must be a JSON object, got {type(rec).__name__}")
    # (a line with fewer brackets than the limit cannot nest deeper: skip the walk)
    if raw.count(b"[") + raw.count(b"{") > _MAX_DEPTH and _depth(rec, _MAX_DEPTH) > _MAX_DEPTH:
        raise ValueError(f"{where}: nested deeper than {_MAX_DEPTH} levels")
    schema = rec.get("schema", 1)
    if isinstance(schema, bool) or not isinstance(schema, int) or schema < 1:
        raise ValueError(f"{where}: schema must be a positive int, got {schema!r}")
    if schema > SCHEMA_VERSION:
        raise ValueError(
            f"{where}: schema {schema} is newer than this floatguard ({SCHEMA_VERSION}); "
            "upgrade floatguard to read it"
        )
    for name, ok, want in (
        ("kind", isinstance(rec.get("kind"), str), "a string"),
        ("step", type(rec.get("step")) is int, "an int"),
    ):
        if name not in rec:
            raise ValueError(f"{where}: no {name!r} field")
        if not ok:
            raise ValueError(f"{where}: {name!r} must be {want}, got {rec[name]!r}")
    t = rec.get("time", 0.0)
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        raise ValueError(f"{where}: 'time' must be a number, got {t!r}")
    rank = rec.get("rank", 0)
    if type(rank) is not int or not 0 <= rank < 2**31:
        raise ValueError(f"{where}: 'rank' must be an int >= 0, got {str(rank)[:40]}")
    try:
        when = float(t)
    except OverflowError:
        raise ValueError(f"{where}: 'time' is out of range ({str(t)[:20]}...)") from None
    if not 0 <= rec["step"] < 2**63:
        raise ValueError(f"{where}: 'step' must be an int >= 0, got {str(rec['step'])[:20]}")
    if schema >= 2 and b'"$float"' not in raw:  # nothing tagged: the values are as read
        fields = {k: v for k, v in rec.items() if k not in ENVELOPE}
    else:
        fields = {k: _decode(v, schema, k) for k, v in rec.items() if k not in ENVELOPE}
    fields, why = conform_fields(rec["kind"], fields)
    if why is not None:
        raise ValueError(f"{where}: {why}")
    return Event(rec["kind"], rec["step"], fields, when, rank)


def conform_events(events: Iterable[Event], problems: list[str] | None = None) -> list[Event]:
    """The events a report or diagnosis can read: each known kind with all its fields
    (a missing one, as in schema 1 files, is None) and each field of its type; an event
    with a mistyped field is left out, its reason appended to ``problems``. Events read
    by :func:`read_events` already conform; this is for events built in code."""
    out = []
    for ev in events:
        if not isinstance(ev, Event):
            if problems is not None:
                problems.append(f"not an Event: {type(ev).__name__}")
            continue
        fields, why = conform_fields(ev.kind, ev.fields)
        if why is not None:
            if problems is not None:
                problems.append(f"step {ev.step}, rank {ev.rank}: {why}; left out")
            continue
        out.append(ev if fields == ev.fields else Event(ev.kind, ev.step, fields, ev.time, ev.rank))
    return out


def _without_nuls(raw: bytes, where: str) -> bytes:
    """``raw`` with the zero bytes a crash leaves removed: a zero-filled line, or a line
    cut short and zero-filled after, is torn; zeros before a line (an older writer
    appended after them) are dropped. A NUL inside the text is an error."""
    body = raw.lstrip(b"\x00")
    head, nul, tail = body.partition(b"\x00")
    if nul and tail.strip(b"\x00"):
        raise ValueError(f"{where}: NUL bytes inside the line")
    if not head.strip():
        raise _TornLine(f"{where}: a zero-filled line (what a crash leaves on some filesystems)")
    return head


MAX_LINE = 64 << 20  # no event comes near it (a stats sample of a large model: ~1 MiB)


def _bounded_lines(fh: IO[bytes]) -> Iterator[tuple[bytes | None, int]]:
    """(line, its size) for each line of ``fh``; (None, size) for a line longer than
    :data:`MAX_LINE`, which is read past in chunks and never held whole."""
    while True:
        raw = fh.readline(MAX_LINE + 1)
        if not raw:
            return
        if len(raw) <= MAX_LINE or raw.endswith(b"\n"):
            yield raw, len(raw)
            continue
        size = len(raw)
        del raw
        while True:
            more = fh.readline(1 << 20)
            size += len(more)
            if not more or more.endswith(b"\n"):
                break
        yield None, size


def read_events(
    path: str | os.PathLike[str],
    *,
    strict: bool = False,
    errors: list[str] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Iterator[Event]:
    """Events of a JSONL file written by :class:`EventLog` (schema 1 or 2), streamed (one
    line in memory at a time).

    Every bad line raises ValueError naming the file and line, unless ``errors`` is a
    list: then its message is appended there and the line skipped (a report renders
    the rest). A line is bad when it is not a JSON object, its envelope is wrong, or a
    field has the wrong type for its kind (:data:`FIELD_TYPES`). A torn line (a JSON
    object cut short by a crash mid-write, anywhere: in a string, an escape, a number,
    a literal), a zero-filled line, or one cut short and zero-filled (what a crash
    leaves on some filesystems) is skipped with a RuntimeWarning, or raises with
    ``strict=True``. A UTF-8 byte-order mark is ignored; blank lines are skipped.
    ``progress(bytes_read, total_bytes)`` is called every few MB (a progress bar).
    """
    read, reported = 0, 0
    with open_regular(path) as fh:  # a FIFO or a device: NotRegularFile, never a hang
        total = os.fstat(fh.fileno()).st_size
        for n, (raw, size) in enumerate(_bounded_lines(fh), 1):
            read += size
            if progress is not None and read - reported >= 4 << 20:
                progress(read, total)
                reported = read
            where = f"{path}:{n}"
            if raw is None:  # longer than any event: read past in chunks, never held
                e = _TornLine(
                    f"{where}: a line of {size} bytes, over the {MAX_LINE >> 20} MiB any event "
                    "takes (a file cut and zero-filled, or not an event log)"
                )
                if strict:
                    raise e
                if errors is not None:
                    errors.append(f"{e}; skipped")
                else:
                    warnings.warn(f"{e}; skipped", RuntimeWarning, stacklevel=2)
                continue
            raw = raw.rstrip(b"\r\n")
            if n == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a BOM (an editor's)
                raw = raw[3:]
            if not raw.strip():
                continue
            try:
                if b"\x00" in raw:
                    raw = _without_nuls(raw, where)
                ev = _parse(raw, where)
            except _TornLine as e:
                if strict:
                    raise
                if errors is not None:
                    errors.append(f"{e}; skipped")
                else:
                    warnings.warn(f"{e}; skipped", RuntimeWarning, stacklevel=2)
                continue
            except ValueError as e:
                if errors is None:
                    raise
                errors.append(str(e))
                continue
            yield ev
