"""No finding rests on a field that was absent, and a line that was not read is counted
and named (issue 39, item 9): in the findings, the ``diagnose`` text and its JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import floatguard.cli as cli
from floatguard.diagnose import diagnose
from floatguard.report.verdict import verdict_of
from floatguard.runlog import RunLog


def _step(i: int, **fields: Any) -> dict[str, Any]:
    rec = {"schema": 2, "kind": "step", "step": i, "time": float(i), "rank": 0,
           "action": "applied", "reason": None, "loss": 2.0 - 0.01 * i, "grad_norm": 1.0,
           "clip_coef": 1.0, "scale": None, "lr_factor": 1.0, "lr": 1e-3}  # fmt: skip
    rec.update(fields)
    return rec


def _write(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _rules(path: Path) -> tuple[set[str], list[str]]:
    problems: list[str] = []
    log = RunLog.read([path], problems)
    return {f.rule for f in diagnose(log, problems)}, problems


def test_a_step_without_a_loss_is_not_a_nan_loss(tmp_path: Path) -> None:
    clean = [_step(i) for i in range(40)]
    last = _step(40)
    del last["loss"]
    path = _write(tmp_path / "run.jsonl", [*clean, last, {**_step(41), "loss": None}])
    rules, problems = _rules(path)
    assert "loss_nan" not in rules and not problems
    problems = []
    assert verdict_of(RunLog.read([path], problems)).state != "died"
    # the same log with a real NaN loss at its end: found
    # (json.dumps writes NaN as a bare literal, which the reader takes as a NaN)
    nan = _write(tmp_path / "nan.jsonl", [*clean, _step(40, loss=float("nan"))])
    assert "loss_nan" in _rules(nan)[0]


@pytest.mark.parametrize(
    ("event", "why"),
    [
        ({"kind": "fault"}, "a fault event without its 'phase'"),
        ({"kind": "step"}, "a step event without its 'action'"),
        ({"kind": "step", "action": None, "loss": 1.0}, "a step event without its 'action'"),
        ({"kind": "spike", "value": 9.0}, "a spike event without its 'signal'"),
        ({"kind": "stop"}, "a stop event without its 'reason'"),
    ],
)
def test_an_event_without_a_field_it_needs_is_unread_and_named(
    tmp_path: Path, event: dict[str, Any], why: str
) -> None:
    clean = [_step(i) for i in range(30)]
    base = _rules(_write(tmp_path / "clean.jsonl", clean))[0]
    rec = {"schema": 2, "step": 30, "time": 30.0, "rank": 0, **event}
    path = _write(tmp_path / "run.jsonl", [*clean, rec])
    rules, problems = _rules(path)
    assert problems == [f"{path}:31: {why}"]
    assert rules == base | {"unreadable_events"}  # nothing else made of it


def test_an_overflow_without_its_scales_says_no_scale() -> None:
    from floatguard.events import Event

    events = [Event("step", i, {"action": "applied", "loss": 1.0}) for i in range(10)]
    events.append(Event("overflow", 10, {}))
    (found,) = [f for f in diagnose(events) if f.rule == "fp16_overflow"]
    assert "nan" not in found.evidence and "scale" not in found.evidence.split("(")[0]
    assert "backed off" not in found.evidence


def test_diagnose_names_the_unread_lines_in_text_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records: list[Any] = [_step(i) for i in range(30)]
    records += ["not json at all", '{"kind": 5}', '{"schema": 2, "kind": "step", "step": 31}']
    path = _write(tmp_path / "run.jsonl", records)
    lines = [f"{path}:31: not a JSON line", f"{path}:32: 'kind' must be a string",
             f"{path}:33: a step event without its 'action'"]  # fmt: skip
    with pytest.raises(SystemExit):
        cli.main(["diagnose", "--json", str(path)])
    out = capsys.readouterr().out
    (unread,) = [f for f in json.loads(out) if f["rule"] == "unreadable_events"]
    assert unread["title"] == "Lines or events could not be read: 3 line(s) or event(s)"
    for line in lines:
        assert line in unread["evidence"]
    with pytest.raises(SystemExit):
        cli.main(["diagnose", str(path)])
    text = capsys.readouterr().out.replace("\n", "")
    assert "Lines or events could not be read: 3 line(s) or event(s)" in text
    for line in lines:
        assert line in text
