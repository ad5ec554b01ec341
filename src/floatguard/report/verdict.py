"""The report's verdict: one sentence on how the run ended, earned from the events.

"Healthy" and "the run ended healthy" are said only when all three hold:

1. the end state is finite: the ``end`` event (written when the guard closes) says the
   weights, optimizer state and floating buffers were all finite; a non-finite buffer
   reported (a ``nonfinite_buffer`` warning or fault) with no rollback after it, and no
   ``end`` event, counts against it;
2. the loss is back within the band of its pre-incident level: the median loss of the
   last 20 applied steps is at most 25% above the median of the 20 applied steps
   before the first incident (:data:`floatguard.diagnose.LEVEL_BAND`; an incident is a
   fault, a spike, a rollback, an LR back-off, a step not applied for a reason other
   than an fp16 overflow, or a trend warning (from its ``rise_step``));
3. the LR factor recovered: the guard's ``lr_factor`` is 1 at the end (the ``end``
   event's, else the last step's).

Otherwise the verdict says what is still wrong, or what it could not check (a log
without an ``end`` event: an older floatguard, or a guard never closed).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from floatguard._event_schema import finite as _finite
from floatguard.diagnose import (
    LEVEL_BAND,
    Level,
    applied_losses,
    end_lr_factor,
    end_nonfinite,
    ended,
    loss_level,
    reason_counts,
    warnings_of,
)
from floatguard.events import Event
from floatguard.runlog import RunLog

__all__ = ["Verdict", "verdict_of"]


@dataclass(frozen=True)
class Verdict:
    """``state``: "healthy" (earned), "recovered" (incidents, nothing known wrong at the
    end), "unchecked" (no incident, but the end state was not logged), "unresolved"
    (something still wrong at the end: ``still_wrong`` says what) or "died";
    ``text``: one sentence."""

    state: str
    text: str
    faults: int
    steps: int
    still_wrong: tuple[str, ...] = ()


def incidents(log: RunLog) -> list[int]:
    """The steps of the run's incidents (see the module), in order."""
    out = [
        e.step for kind in ("fault", "spike", "rollback", "lr_backoff") for e in log.of_kind(kind)
    ]
    out += [
        s for s, a, r in zip(log.steps.step, log.steps.column("action"), log.steps.reason,
                             strict=True)
        if a in ("skipped", "rolled_back") and r != "overflow"
    ]  # fmt: skip
    for w in warnings_of(log, "loss_trend", "grad_norm_trend"):
        ev = w.fields.get("evidence")
        rise = ev.get("rise_start", ev.get("rise_step")) if isinstance(ev, dict) else None
        out.append(rise if type(rise) is int and rise <= w.step else w.step)
    return sorted(set(out))


def _level_words(level: Level) -> str:
    assert level.before is not None and level.after is not None
    if level.before > 0 and level.after > 0:
        return f"{level.times()} its level before step {level.at}"
    return f"{level.after:.3g}, against {level.before:.3g} before step {level.at}"


def _and(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


@dataclass
class _Checks:
    wrong: list[str]
    unknown: list[str]
    good: list[str]


def _end_state(log: RunLog, checks: _Checks) -> None:
    ends = ended(log)
    names = end_nonfinite(log)
    if ends:
        if names or any(e.fields.get("state_finite") is False for e in ends):
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            checks.wrong.append(f"the run ended with non-finite state ({shown or 'not named'})")
        elif all(e.fields.get("state_finite") is True for e in ends):
            checks.good.append("the end state is finite")
        else:
            checks.unknown.append("the end state was not checked (the end event does not say)")
        return
    rollbacks = [r.step for r in log.of_kind("rollback")]
    bad = [
        e for e in [*warnings_of(log, "nonfinite_buffer"), *log.of_kind("fault")]
        if e.kind == "warning" or str(e.fields.get("tensor") or "").startswith("buffer:")
        or e.fields.get("cause") == "nonfinite_buffer"
    ]  # fmt: skip
    open_ = [e for e in bad if not any(r >= e.step for r in rollbacks)]
    if open_:
        checks.wrong.append(
            f"a non-finite buffer reported at step {open_[0].step} was never rolled back"
        )
    checks.unknown.append(
        "the end state was not checked (no end event: the guard was not closed, or an older "
        "floatguard wrote the log)"
    )


def _loss(log: RunLog, first: int, checks: _Checks) -> None:
    level = loss_level(applied_losses(log.steps), first)
    if level.back is True:
        checks.good.append(f"the loss is back within {LEVEL_BAND:.0%} ({_level_words(level)})")
    elif level.back is False:
        checks.wrong.append(
            f"the loss ended at {_level_words(level)} (the median of the last {level.n_after} "
            f"applied steps against the {level.n_before} before it)"
        )
    else:
        checks.unknown.append(
            f"the loss cannot be compared with its level before step {first} ({level.n_before} "
            f"applied step(s) before it, {level.n_after} after)"
        )


def _lr_factor(log: RunLog, checks: _Checks) -> None:
    factor = end_lr_factor(log)
    if factor is None:
        return
    if factor < 1.0 - 1e-6:
        checks.wrong.append(f"the LR factor is {factor:.2g}")
    else:
        checks.good.append("the LR factor is back to 1")


def _not_applied(log: RunLog) -> str:
    by = Counter(
        str(r or "unknown") for a, r in zip(log.steps.column("action"), log.steps.reason,
                                            strict=True)
        if a in ("skipped", "rolled_back")
    )  # fmt: skip
    return reason_counts(by)


def verdict_of(events: Iterable[Event]) -> Verdict:
    """The run's :class:`Verdict` (see the module for what "healthy" takes)."""
    log = RunLog.from_events(events)
    steps, faults, stops = log.steps, log.of_kind("fault"), log.of_kind("stop")
    losses = [v for v in steps.column("loss") if v is not None]  # a missing loss: unknown
    bad_tail = bool(losses[-5:]) and all(not _finite(v) for v in losses[-5:])
    resumes = log.of_kind("resume")
    # a stop a later resume of its rank went on from is history, not how the run ended
    stops = [s for s in stops if not any(r.rank == s.rank and r.time >= s.time for r in resumes)]
    resumed = ""
    if resumes:
        froms = ", ".join(str(r.step) for r in resumes[:5]) + (", ..." if len(resumes) > 5 else "")
        resumed = f"; resumed {len(resumes)} time(s), from step {froms}"
    n = len(steps)
    if stops:
        s = stops[-1]
        why = f" ({s['fault']})" if s["fault"] else ""
        return Verdict("died", f"Stopped at step {s.step}: {s['reason']}{why}{resumed}",
                       len(faults), n)  # fmt: skip
    if bad_tail:
        first = next(
            s for s, v in zip(steps.step, steps.column("loss"), strict=True)
            if v is not None and not _finite(v)
        )  # fmt: skip
        return Verdict("died", f"Died at step {first}: the loss stayed non-finite to the end",
                       len(faults), n)  # fmt: skip
    checks = _Checks([], [], [])
    _end_state(log, checks)
    hit = incidents(log)
    if hit:
        _loss(log, hit[0], checks)
    _lr_factor(log, checks)
    if not hit:  # nothing to recover from: only a factor still below 1 is worth saying
        checks.good = []
    stalled = warnings_of(log, "stalled_updates")
    if stalled:
        checks.wrong.append(
            f"the weights' updates were lost to rounding (warned at step {stalled[-1].step})"
        )
    not_applied = n - steps.column("action").count("applied")
    if faults:
        head = f"Recovered from {len(faults)} fault(s): " + (
            f"{not_applied} of {n} steps not applied ({_not_applied(log)})"
            if not_applied else f"all {n} steps applied"
        )  # fmt: skip
    elif not_applied:
        head = f"{not_applied} of {n} steps not applied ({_not_applied(log)}); no fault"
    else:
        head = f"All {n} steps applied, no fault"
    if checks.wrong:
        state, text = "unresolved", f"{head}; but {_and(checks.wrong)}"
    elif checks.unknown:
        state = "recovered" if hit or faults or not_applied else "unchecked"
        text = f"{head}; {_and(checks.unknown)}"
    elif hit or faults or not_applied:
        state, text = "recovered", f"{head}; the run ended healthy: {_and(checks.good)}"
    else:
        state, text = "healthy", f"Healthy: all {n} steps applied; the end state is finite"
    return Verdict(state, text + resumed, len(faults), n, tuple(checks.wrong))
