"""Diagnosis: rules over the event stream, each a finding with evidence, cause and fix.

Each rule reads the events (``run``, ``step``, ``fault``, ``overflow``, ``spike``,
``rollback``, ``warning`` ...) and returns zero or more :class:`Finding`;
:func:`diagnose` runs them all and ranks the findings (what stops a run first, then
what costs it most). The rules are the common numerical bugs of deep-learning training
(the lessons' table, `docs/lessons.md`): each tells its causes apart by the evidence
where it can, and states the evidence it needs (the run's precision comes from its
``run`` event; a log without one is judged by what its steps show, and says so).

Any log the reader accepts can be diagnosed: fields a schema 1 file lacks are unknown
(None) and every rule reads them as such; events with a mistyped field are left out
and reported as a finding of their own (``unreadable_events``).

Words used here: an *applied* step is one whose update was kept; a *level* is the
median loss of up to LEVEL_STEPS applied steps (:class:`Level`: back within
LEVEL_BAND of the level before an incident, or not); the *schedule's LR* is a step's
``lr`` with the guard's ``lr_factor`` taken out (:func:`schedule_lrs`); an *episode*
is spikes fewer than 20 steps apart (:func:`spike_episodes`: isolated, a burst, or
sustained); a batch's *identity* is its position and content fingerprint
(:func:`batch_words`).

Reading order: :class:`Finding`, :func:`run_info`, the levels and LR changes, then the
rules in registry order (each ``@_rule`` names the finding ids it may return:
:data:`RULE_IDS`, the table of ``docs/report.md``), then :func:`diagnose`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from floatguard.events import Event
from floatguard.runlog import RunLog, global_view

# isort: off
# The rule families register in this order (the ranking's tie-break: registry order).
from floatguard.diagnose import faults, spikes, losses, silent  # noqa: F401

# isort: on
from floatguard.diagnose._base import (
    _RULES,
    LEVEL_BAND,
    OWN_IDS,
    RULE_IDS,
    Finding,
    Level,
    RunInfo,
    applied_losses,
    clipped_steps,
    end_lr_factor,
    end_nonfinite,
    ended,
    loss_level,
    run_info,
    warnings_of,
)
from floatguard.diagnose.spikes import reason_counts

__all__ = [
    "LEVEL_BAND", "OWN_IDS", "RULE_IDS", "Finding", "Level", "RunInfo", "applied_losses",
    "clipped_steps", "diagnose", "end_lr_factor", "end_nonfinite", "ended", "loss_level",
    "reason_counts", "run_info", "warnings_of",
]  # fmt: skip


def diagnose(events: Iterable[Event], unread: Sequence[str] = ()) -> list[Finding]:
    """Run every rule over ``events`` (a :class:`~floatguard.runlog.RunLog`, or any
    events: checked and completed as the reader does); the findings, most severe first
    (then earliest). ``unread``: the lines the reader could not read (its
    ``problems``); they, and any event given here that cannot be read, are counted
    and named in an ``unreadable_events`` finding, and no other finding rests on them.
    A field absent from an event that was read is unknown: no rule reads it as a
    value (a step without a loss is not a NaN loss)."""
    problems: list[str] = list(unread)
    log = global_view(RunLog.from_events(events, problems))  # several ranks: the agreed view
    found: list[Finding] = []
    for rule in _RULES:
        try:
            found.extend(rule(log))
        except Exception as e:  # a rule's bug must not hide the others' findings
            found.append(Finding(
                "rule_failed", f"the {rule.__name__} rule",
                f"{type(e).__name__}: {e}",
                "a floatguard bug: the rule met a log it did not expect",
                "report it with the log (floatguard's issue tracker); the other findings stand",
                1, (),
            ))  # fmt: skip
    if problems:
        found.append(Finding(
            "unreadable_events", f"{len(problems)} line(s) or event(s)",
            "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5
                                       else ""),
            "a line cut short (a run killed mid-write), an event without a field it needs "
            "or with a field of the wrong type (a log written by another tool, or edited "
            "by hand)",
            "the diagnosis left them out and rests on the rest; fix or remove those lines",
            1, (),
        ))  # fmt: skip
    return sorted(found, key=lambda f: (-f.severity, f.steps[0] if f.steps else math.inf))
