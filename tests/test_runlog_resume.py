"""A resume supersedes the events its rank logged for the steps it redoes."""

from __future__ import annotations

from floatguard.diagnose import diagnose
from floatguard.events import Event
from floatguard.report.page import verdict_of
from floatguard.runlog import RunLog, global_view


def _step(i: int, rank: int = 0, t: float = 0.0, action: str = "applied") -> Event:
    return Event("step", i, {"action": action, "loss": float(i), "grad_norm": 1.0}, t, rank)


def _run(rank: int, cut: int, resume_at: int, n: int) -> list[Event]:
    """Rank ``rank`` runs steps 0..cut-1 (a fault at 3, a snapshot every 2 steps), dies,
    resumes at ``resume_at`` and runs to ``n``."""
    t = 0.0
    out: list[Event] = [Event("run", 0, {}, t, rank)]
    for i in range(cut):
        t += 1
        out.append(_step(i, rank, t, "skipped" if i == 3 else "applied"))
        if i == 3:
            out.append(Event("fault", 3, {"phase": "input"}, t, rank))
        if i % 2 == 0:
            out.append(Event("snapshot", i, {"where": "memory"}, t, rank))
        out.append(Event("stats", i, {"tensors": []}, t, rank))
    t += 1
    out.append(Event("stop", cut - 1, {"reason": "peer_failed", "fault": None}, t, rank))
    out.append(Event("run", resume_at, {}, t + 1, rank))
    out.append(Event("resume", resume_at, {"from_step": resume_at, "path": "x"}, t + 2, rank))
    t += 2
    for i in range(resume_at, n):
        t += 1
        out.append(_step(i, rank, t, "skipped" if i == 3 else "applied"))
        if i == 3:
            out.append(Event("fault", 3, {"phase": "input"}, t, rank))
    return out


def test_a_resume_supersedes_the_redone_steps() -> None:
    log = RunLog.from_events(_run(0, cut=8, resume_at=2, n=10))
    assert log.steps.column("step") == list(range(10))
    assert log.counts["step"] == 10
    assert [e.step for e in log.of_kind("fault")] == [3]  # the redone fault once
    assert [e.step for e in log.of_kind("stats")] == [0, 1]  # stats of steps 2..7 dropped
    assert log.counts["snapshot"] == 1  # the snapshot of step 0; those of 2, 4, 6 redone
    # 6 steps, 1 fault, 3 snapshots, 6 stats superseded; run, stop, resume kept
    assert log.superseded == 6 + 1 + 3 + 6
    assert [e.kind for e in log.of_kind("stop")] == ["stop"]
    assert log.rank_counts[0] == len(log) + log.counts["snapshot"]


def test_a_stop_before_a_resume_is_history() -> None:
    findings = {f.rule: f for f in diagnose(_run(0, cut=8, resume_at=2, n=10))}
    stopped = findings["stopped"]
    assert stopped.severity == 1
    assert "resumed from step 2" in stopped.evidence
    events = [e for e in _run(0, cut=8, resume_at=2, n=10) if e.kind != "resume"]
    assert diagnose(events)[0].rule == "stopped"  # never resumed: how the run ended


def test_each_rank_supersedes_its_own() -> None:
    # rank 0 resumed from step 4, rank 1 from step 2 (a merged log of two ranks)
    events = _run(0, cut=8, resume_at=4, n=10) + _run(1, cut=6, resume_at=2, n=10)
    log = RunLog.from_events(events)
    for rank in (0, 1):
        steps = [
            s
            for s, r in zip(log.steps.column("step"), log.steps.column("rank"), strict=True)
            if r == rank
        ]
        assert steps == list(range(10))
    view = global_view(events)
    assert view.steps.column("step") == list(range(10))
    assert [e.step for e in view.of_kind("fault")] == [3]


def test_the_report_verdict_of_a_resumed_run() -> None:
    events = _run(0, cut=8, resume_at=2, n=10)
    # a steady loss and a finite end state: the verdict is earned (issue 36, item 9)
    flat = [
        Event(e.kind, e.step, {**e.fields, "loss": 1.0}, e.time, e.rank) if e.kind == "step" else e
        for e in events
    ]
    end = {"state_finite": True, "nonfinite": [], "lr_factor": 1.0}
    flat.append(Event("end", 10, end, 99.0, 0))
    v = verdict_of(flat)
    assert (v.state, v.steps, v.faults) == ("recovered", 10, 1)
    assert v.text.endswith(
        "the run ended healthy: the end state is finite, the loss is back within 25% (1.0x "
        "its level before step 3) and the LR factor is back to 1; resumed 1 time(s), from "
        "step 2"
    )
    # the rising loss of the raw log (0, 1, ... 9) did not come back: not healthy
    assert "healthy" not in verdict_of(events).text
    never_resumed = verdict_of([e for e in events if e.kind != "resume"])
    assert never_resumed.state == "died" and never_resumed.text.startswith("Stopped at step 7")
