"""The demo's terminal lines: one short line per step a person cares about.

Words: a *held* event (fault, rollback, overflow, spike, LR back-off) is kept until
its step's ``step`` event arrives, and the two print as one line: what the guard did
and why (``step 120: rolled back to step 116 (nonfinite_param): inf in
blocks.1.mlp.fc param:weight``). The first ``stats`` sample is one line; the others
are summed up in one line at the end (how many, the worst underflow, the steps with
non-finite values). Snapshots and the run's metadata print nothing; any other kind
is one line of its fields. The same line on consecutive steps (an unguarded run
skipping every step once its weights are dead) prints once, then once with the count.

Everything taken from an event is made printable first (:func:`printable`): a module
name read from a log may hold an ESC or a newline, and a terminal would obey it.

Used by the live view and by ``--no-live`` alike, so both show the same lines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EventLines", "Line", "printable"]

_HELD = ("fault", "rollback", "overflow", "spike", "lr_backoff")
_SILENT = ("snapshot", "run")
_MAX = 200  # characters of one free-text field (a warning's message, an error)


def printable(value: object, limit: int = _MAX) -> str:
    """``str(value)`` with every non-printable character escaped (``\\x1b``, ``\\n``)
    and cut to ``limit`` characters with an ellipsis."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(value))
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True)
class Line:
    """One line for the terminal: its text (plain, printable) and a rich style name."""

    text: str
    style: str = ""


def _num(v: Any) -> str:
    """A number short: 4 significant digits, a whole float (a loss scale) in full."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return printable(v, 40)
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, int) or (v.is_integer() and abs(v) < 1e15):
        return str(int(v))
    return f"{v:.4g}"


def _percent(u: float) -> str:
    return f"{u * 100:.2g}%"


def _get(fields: dict[str, Any], key: str) -> Any:
    return fields.get(key) if isinstance(fields, dict) else None


def _fault(f: dict[str, Any]) -> str:
    what = printable(_get(f, "kind_of_value") or "non-finite", 20)
    if what == "huge":
        what = "an absurd finite value"
    module = printable(_get(f, "module") or "", 80)
    tensor = printable(_get(f, "tensor") or "", 80)
    where = f"{module} {tensor}".strip() if module else f"the data ({tensor or 'input'})"
    op = _get(f, "op")
    made = {
        "outside": ", written outside the optimizer update",
        "update_or_outside": ", written by the update or outside it",
        "buffer": "",
        "magnitude": "",
    }.get(op, f", made by {printable(op, 60)}" if op and op not in ("input", "parameter") else "")
    return f"{what} in {where}{made}"


def _held(kind: str, f: dict[str, Any]) -> str:
    if kind == "fault":
        return _fault(f)
    if kind == "rollback":
        return f"to step {_num(_get(f, 'to_step'))}"
    if kind == "overflow":
        return f"loss scale {_num(_get(f, 'scale_before'))} -> {_num(_get(f, 'scale_after'))}"
    if kind == "spike":
        signal = printable(_get(f, "signal") or "loss", 20)
        again = " (reproduced)" if _get(f, "reproduced") else ""
        return f"{signal} spike {_num(_get(f, 'value'))}{again}"
    return f"LR x{_num(_get(f, 'factor'))}"  # lr_backoff


@dataclass
class _StatsSummary:
    """What the stats samples said, summed up: count, steps, worst underflow, the
    steps whose sample held a non-finite value."""

    fmt: str
    samples: int = 0
    tensors: int = 0
    first: int = -1
    last: int = -1
    worst: tuple[float, str, int] | None = None  # fraction, tensor, step
    nonfinite_at: list[int] = field(default_factory=list)

    def add(self, step: int, f: dict[str, Any]) -> str:
        """Count one sample; its own headline (the line the first sample prints)."""
        tensors = _get(f, "tensors")
        rows = [t for t in tensors if isinstance(t, dict)] if isinstance(tensors, list) else []
        worst: tuple[float, str] | None = None
        bad = 0
        for t in rows:
            u = _get(_get(_get(t, "formats") or {}, self.fmt) or {}, "underflow")
            name = f"{printable(t.get('module') or '-', 60)} {printable(t.get('role') or '', 40)}"
            if isinstance(u, (int, float)) and math.isfinite(u) and (worst is None or u > worst[0]):
                worst = (float(u), name.strip())
            n = t.get("nonfinite")
            bad += isinstance(n, int) and n > 0
        self.samples, self.tensors, self.last = self.samples + 1, max(self.tensors, len(rows)), step
        self.first = step if self.first < 0 else self.first
        if worst is not None and (self.worst is None or worst[0] > self.worst[0]):
            self.worst = (*worst, step)
        if bad:
            self.nonfinite_at.append(step)
        text = f"stats sample: {len(rows)} tensors"
        text += self._underflow(worst)
        return text + (f"; {bad} with non-finite values" if bad else "")

    def _underflow(self, worst: tuple[float, str] | tuple[float, str, int] | None) -> str:
        if worst is None:
            return ""
        if worst[0] <= 0:
            return f"; no {self.fmt} underflow"
        at = f", step {worst[2]}" if len(worst) == 3 else ""
        return f"; worst {self.fmt} underflow {_percent(worst[0])} ({worst[1]}{at})"

    def line(self) -> Line | None:
        if self.samples < 2:
            return None  # the first sample's own line said it all
        steps = f"steps {self.first}-{self.last}"
        text = f"stats: {self.samples} samples of {self.tensors} tensors, {steps}"
        text += self._underflow(self.worst)
        if self.nonfinite_at:
            at = ", ".join(str(s) for s in self.nonfinite_at[:8])
            more = f" and {len(self.nonfinite_at) - 8} more" if len(self.nonfinite_at) > 8 else ""
            text += f"; non-finite values at steps {at}{more}"
        return Line(text, "dim")


def _other(kind: str, f: dict[str, Any]) -> Line:
    if kind == "warning":
        return Line(f"warning: {printable(_get(f, 'message'))}", "yellow")
    if kind == "stop":
        fault = _get(f, "fault")
        why = printable(_get(f, "reason"), 80) + (f" ({printable(fault, 80)})" if fault else "")
        return Line(f"stopped: {why}", "bold red")
    if kind == "snapshot_error":
        where, err = printable(_get(f, "where"), 80), printable(_get(f, "error"))
        return Line(f"snapshot not taken ({where}): {err}", "yellow")
    if kind == "snapshot_fallback":
        bad, used = printable(_get(f, "bad"), 80), printable(_get(f, "used"), 80)
        return Line(f"snapshot {bad} unreadable; used {used}", "yellow")
    if kind == "resume":
        return Line(f"resumed from step {_num(_get(f, 'from_step'))}", "")
    if kind == "end":
        ends: list[Any] = list(_get(f, "nonfinite") or [])
        state = {True: "finite", False: "NOT finite", None: "not checked"}.get(
            _get(f, "state_finite"), "not checked"
        )
        listed = f" ({printable(', '.join(map(str, ends[:4])), 120)})" if ends else ""
        factor = _get(f, "lr_factor")
        lr = "" if factor in (None, 1, 1.0) else f"; LR factor {_num(factor)}"
        style = "" if _get(f, "state_finite") is True else "bold red"
        return Line(f"end: weights, optimizer state and buffers {state}{listed}{lr}", style)
    parts = [f"{printable(k, 30)}={_brief(v)}" for k, v in f.items() if v is not None]
    return Line(printable(f"{kind} " + ", ".join(parts)), "")


def _brief(v: Any) -> str:
    if isinstance(v, (dict, list, tuple)):
        return f"<{len(v)} {'fields' if isinstance(v, dict) else 'items'}>"
    return _num(v) if isinstance(v, (int, float)) else printable(v, 60)


@dataclass
class EventLines:
    """Turns the guard's events into terminal lines; feed every event, then ``close``.

    ``fmt``: the format whose underflow the stats lines name (the run's precision:
    fp16 or bf16)."""

    fmt: str = "fp16"
    _step: int | None = field(default=None, init=False)
    _held: list[tuple[str, str]] = field(default_factory=list, init=False)  # kind, text
    _last: tuple[int, str, str] | None = field(default=None, init=False)  # step, text, style
    _repeats: int = field(default=0, init=False)
    _stats: _StatsSummary | None = field(default=None, init=False)

    def feed(self, ev: Any) -> list[Line]:
        """The lines to print now for event ``ev`` (an :class:`~floatguard.events.Event`)."""
        kind, step = printable(getattr(ev, "kind", "?"), 30), getattr(ev, "step", None)
        f = getattr(ev, "fields", None)
        fields: dict[str, Any] = f if isinstance(f, dict) else {}
        step = step if isinstance(step, int) and not isinstance(step, bool) else -1
        out = self._flush() if self._held and step != self._step else []
        if kind in _HELD:
            self._step = step
            self._held.append((kind, _held(kind, fields)))
        elif kind == "step":
            out += self._step_line(step, fields)
        elif kind == "stats":
            if self._stats is None:
                self._stats = _StatsSummary(self.fmt)
                out += self._emit(step, self._stats.add(step, fields), "dim")
            else:
                self._stats.add(step, fields)
        elif kind not in _SILENT:
            line = _other(kind, fields)
            out += self._emit(step, line.text, line.style)
        return out

    def close(self) -> list[Line]:
        """The lines still pending at the end of the run, and the stats summary."""
        out = self._flush() + self._end_repeats()
        summary = self._stats.line() if self._stats is not None else None
        return [*out, summary] if summary is not None else out

    def _step_line(self, step: int, f: dict[str, Any]) -> list[Line]:
        action = printable(_get(f, "action") or "?", 30)
        held, self._held, self._step = self._held, [], None
        if action == "applied" and not held:
            return self._end_repeats()
        text = "" if action == "applied" else action.replace("_", " ")
        to = [t for k, t in held if k == "rollback"]
        if action == "rolled_back" and to:  # "rolled back to step 116"
            text += " " + to[0]
            held = [(k, t) for k, t in held if k != "rollback"]
        reason = _get(f, "reason")
        text += f" ({printable(reason, 40)})" if reason and action != "applied" else ""
        if held:
            text += (": " if text else "") + "; ".join(t for _, t in held)
        return self._emit(step, text, "yellow" if action != "applied" else "")

    def _flush(self) -> list[Line]:
        held, step, self._held, self._step = self._held, self._step, [], None
        text = "; ".join(t for _, t in held)
        return self._emit(step if step is not None else -1, text, "") if held else []

    def _emit(self, step: int, text: str, style: str) -> list[Line]:
        last = self._last
        if last is not None and last[1] == text and step == last[0] + 1 and step >= 0:
            self._last, self._repeats = (step, text, style), self._repeats + 1
            return []
        out = self._end_repeats()
        self._last = (step, text, style)
        return [*out, Line(f"step {step}: {text}" if step >= 0 else text, style)]

    def _end_repeats(self) -> list[Line]:
        if not self._repeats or self._last is None:
            return []
        step, text, style = self._last
        n, self._repeats = self._repeats, 0
        return [Line(f"steps {step - n + 1}-{step}: the same, {n} more time(s): {text}", style)]
