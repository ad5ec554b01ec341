"""The verdict is earned: "healthy" only with a finite end state, the loss back within
its band and the LR factor recovered; otherwise it says what is still wrong."""

from __future__ import annotations

import pytest

from floatguard.events import Event
from floatguard.report import verdict_of

from . import _runs as runs

NO_END = (
    "the end state was not checked (no end event: the guard was not closed, or an older "
    "floatguard wrote the log)"
)


@pytest.mark.parametrize(
    ("events", "state", "text"),
    [
        (runs.clean(), "healthy", "Healthy: all 100 steps applied; the end state is finite"),
        (runs.clean(end=False), "unchecked", f"All 100 steps applied, no fault; {NO_END}"),
        (runs.memorized(), "healthy", "Healthy: all 60 steps applied; the end state is finite"),
        (runs.corrupt_batch(), "recovered",
         "1 of 120 steps not applied (loss spikes: 1); no fault; the run ended healthy: the "
         "end state is finite, the loss is back within 25% (1.0x its level before step 50) "
         "and the LR factor is back to 1"),
        (runs.weight_fault("update_or_outside"), "recovered",
         "Recovered from 1 fault(s): 1 of 60 steps not applied (bad updates: 1); the run "
         "ended healthy: the end state is finite, the loss is back within 25% (1.0x its "
         "level before step 45) and the LR factor is back to 1"),
        (runs.lr_x40(), "unresolved",
         "13 of 100 steps not applied (loss spikes: 5, after rollback: 8); no fault; but the "
         "loss ended at 4.1x its level before step 61 (the median of the last 20 applied "
         "steps against the 20 before it) and the LR factor is 0.34"),
        (runs.nan_buffer(rolled_back=False), "unresolved",
         "All 20 steps applied, no fault; but the run ended with non-finite state "
         "(buffer:bn.running_var)"),
        (runs.nan_buffer(rolled_back=True), "recovered",
         "Recovered from 1 fault(s): 1 of 20 steps not applied (bad buffers: 1); the run "
         "ended healthy: the end state is finite, the loss is back within 25% (1.0x its "
         "level before step 7) and the LR factor is back to 1"),
        (runs.lr_creep(), "unresolved",
         "All 300 steps applied, no fault; but the loss ended at 3.3x its level before step "
         "100 (the median of the last 20 applied steps against the 20 before it)"),
        (runs.stalled(), "unresolved",
         "All 151 steps applied, no fault; but the weights' updates were lost to rounding "
         "(warned at step 150)"),
    ],
    ids=["clean", "no-end-event", "memorized", "corrupt-batch", "update-or-outside",
         "lr-x40", "nan-buffer-kept", "nan-buffer-rolled-back", "lr-creep", "stalled"],
)  # fmt: skip
def test_the_verdict(events: list[Event], state: str, text: str) -> None:
    v = verdict_of(events)
    assert (v.state, v.text) == (state, text)
    assert ("healthy" in v.text.lower()) == (state in ("healthy", "recovered")
                                            and "not checked" not in v.text)  # fmt: skip


def _without_end(events: list[Event]) -> list[Event]:
    return [e for e in events if e.kind != "end"]


def test_a_nan_buffer_never_rolled_back_counts_against_a_log_without_an_end() -> None:
    events = [e for e in _without_end(runs.nan_buffer(rolled_back=False))
              if not (e.kind == "warning" and e.step == 20)]  # fmt: skip
    run = runs.Run()
    run.warning(7, "nonfinite_buffer", {"buffers": ["bn.running_var"]})
    v = verdict_of([*events, *run.events[1:]])
    assert v.state == "unresolved"
    assert v.text == (
        "All 20 steps applied, no fault; but a non-finite buffer reported at step 7 was "
        "never rolled back"
    )


def test_a_factor_below_one_at_the_end_is_still_wrong_and_one_is_not_said_otherwise() -> None:
    events = runs.corrupt_batch()
    lowered = [e if e.kind != "end" else Event("end", e.step, {**e.fields, "lr_factor": 0.5})
               for e in events]  # fmt: skip
    v = verdict_of(lowered)
    assert v.state == "unresolved" and v.still_wrong == ("the LR factor is 0.5",)


def test_too_few_steps_before_the_incident_cannot_be_compared() -> None:
    run = runs.Run()
    run.step(0, 2.0)
    run.spike(1, 9.0)
    run.step(1, 9.0, action="skipped", reason="loss_spike")
    for i in range(2, 30):
        run.step(i, 2.0)
    run.end(30)
    v = verdict_of(run.events)
    assert v.state == "recovered"
    assert v.text == (
        "1 of 30 steps not applied (loss spikes: 1); no fault; the loss cannot be compared "
        "with its level before step 1 (1 applied step(s) before it, 20 after)"
    )
