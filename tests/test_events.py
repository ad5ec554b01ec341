"""The event stream: round trips, a corpus of malformed files, torn lines, bounded memory."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import pytest

from floatguard import EventLog, read_events
from floatguard.events import EVENT_FIELDS, check_event


def fields_of(kind: str, **over: object) -> dict[str, object]:
    base: dict[str, object] = dict.fromkeys(EVENT_FIELDS[kind], None)
    base.update(over)
    return base


def test_every_field_type_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    values = {
        "phase": "nan",  # a string "nan" stays a string
        "module": "inf",
        "tensor": "-inf",
        "kind_of_value": "nan",
        "shape": [3, 4],
        "op": None,
        "source": 'x.py:3: y = "quoted" \\ back',
        "deterministic": True,
        "stats": {"numel": 12, "nan": 1, "amax": 3.5, "min": -math.inf},
        "fault_rank": 3,
        "cause": "nonfinite_loss",
        "input_amax": 2.5e19,
        "batch": {"position": 7, "fingerprint": "00ff"},
    }
    log = EventLog(path)
    log.emit("fault", 7, **values)
    step = fields_of(
        "step", loss=math.nan, grad_norm=math.inf, scale=-math.inf, clip_coef=1e-300,
        lr_factor=0.5, action="skipped",
    )  # fmt: skip
    log.emit("step", 8, **step)
    log.close()
    got = list(read_events(path))
    assert got[0].fields == values and got[0].step == 7 and got[0].rank == 0
    s = got[1]
    assert math.isnan(s["loss"]) and s["grad_norm"] == math.inf and s["scale"] == -math.inf
    assert s["clip_coef"] == 1e-300 and s["action"] == "skipped" and s["reason"] is None
    raw = [json.loads(line) for line in path.read_text().splitlines()]
    assert raw[1]["loss"] == {"$float": "nan"} and raw[0]["phase"] == "nan"
    assert all(r["schema"] == 2 for r in raw)


def test_schema_1_files_are_still_read(tmp_path: Path) -> None:
    path = tmp_path / "old.jsonl"
    lines = [
        {"schema": 1, "kind": "fault", "step": 3, "time": 1.0, "phase": "input",
         "kind_of_value": "nan", "module": "", "tensor": "input[0]", "shape": [2]},
        {"schema": 1, "kind": "step", "step": 3, "time": 1.0, "action": "skipped",
         "reason": "nonfinite", "loss": "nan", "grad_norm": "inf"},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    fault, step = read_events(path)
    assert fault["kind_of_value"] == "nan"  # the schema says it is a string
    assert math.isnan(step["loss"]) and step["grad_norm"] == math.inf


def test_the_envelope_cannot_be_overwritten_and_fields_are_exact() -> None:
    log = EventLog()
    for name in ("schema", "kind", "step", "time", "rank"):
        with pytest.raises(ValueError, match=rf"\['{name}'\] would overwrite the envelope"):
            log.emit("snapshot", 0, where="memory", **{name: 7})
    with pytest.raises(ValueError, match=r"unknown event kind 'stpe'.*known: advice, end, fault"):
        log.emit("stpe", 0)
    with pytest.raises(
        ValueError, match=r"missing fields \['batch', 'value'\], unexpected \['threshold'\]"
    ):
        check_event("spike", {"signal": "loss", "reproduced": None, "threshold": 3.0})
    assert log.events == [] and not log.counts


CORPUS: list[tuple[bytes, str]] = [
    (b"[1, 2]", "must be a JSON object, got list"),
    (b'"text"', "must be a JSON object, got str"),
    (b"not json at all", "not a JSON line"),
    (b'{"kind": "step", "step": 1} trailing', "not a JSON line"),
    (b'{"schema": 2, "step": 1, "time": 0}', "no 'kind' field"),
    (b'{"schema": 2, "kind": "step", "time": 0}', "no 'step' field"),
    (b'{"schema": 2, "kind": 5, "step": 1}', "'kind' must be a string"),
    (b'{"schema": 2, "kind": "step", "step": 1.7}', "'step' must be an int, got 1.7"),
    (b'{"schema": 2, "kind": "step", "step": true}', "'step' must be an int, got True"),
    (b'{"schema": 2, "kind": "step", "step": "3"}', "'step' must be an int"),
    (b'{"schema": 2, "kind": "step", "step": 1, "time": "noon"}', "'time' must be a number"),
    (b'{"schema": 2, "kind": "step", "step": 1, "rank": 0.5}', "'rank' must be an int"),
    (b'{"schema": "2", "kind": "step", "step": 1}', "schema must be a positive int"),
    (b'{"schema": 9, "kind": "step", "step": 1}', "schema 9 is newer"),
    (b'{"schema": 2, "kind": "st\xff\xfe", "step": 1}', "not UTF-8"),
    (b'{"schema": 2, "kind": "s", "step": 1, "x": ' + b"[" * 100 + b"]" * 100 + b"}",
     "nested deeper than 32"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
]  # fmt: skip


@pytest.mark.parametrize(("line", "message"), CORPUS, ids=[m for _, m in CORPUS])
def test_a_bad_line_is_an_error_naming_file_and_line(
    tmp_path: Path, line: bytes, message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    good = b'{"schema": 2, "kind": "snapshot", "step": 0, "time": 1.0, "where": "memory"}\n'
    path.write_bytes(good + line + b"\n" + good)
    with pytest.raises(ValueError, match=rf"bad\.jsonl:2: .*{message.split(',')[0]}"):
        list(read_events(path))


def test_torn_lines_are_skipped_with_a_warning_or_raise_when_strict(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    log = EventLog(path)
    for i in range(3):
        log.emit("snapshot", i, where="memory", freed=None)
    log.close()
    whole = path.read_bytes()
    line = json.dumps({"schema": 2, "kind": "lr_backoff", "step": 3, "time": 1.0, "factor": 0.5})
    for cut in (5, 20, len(line) - 1):  # cut inside a key, a value, before the brace
        path.write_bytes(whole + line.encode()[:cut])
        with pytest.warns(RuntimeWarning, match=r"run\.jsonl:4: a torn line"):
            assert [e.step for e in read_events(path)] == [0, 1, 2]
        with pytest.raises(ValueError, match=r"run\.jsonl:4: a torn line"):
            list(read_events(path, strict=True))
    # a multi-byte character cut at the end of the file
    path.write_bytes(whole + '{"schema": 2, "kind": "é'.encode()[:-1])
    with pytest.warns(RuntimeWarning, match="torn"):
        assert len(list(read_events(path))) == 3


def test_an_appending_writer_starts_after_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    path.write_bytes(b'{"schema": 2, "kind": "snapshot", "step": 0, "time": 1.0, "where": "mem')
    log = EventLog(path)
    log.emit("snapshot", 1, where="memory", freed=None)
    log.close()
    with pytest.warns(RuntimeWarning, match=r"run\.jsonl:1: a torn line"):
        events = list(read_events(path))
    assert [(e.kind, e.step) for e in events] == [("snapshot", 1)]


def test_memory_is_bounded_and_counts_run_on(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "run.jsonl", keep=100)
    for i in range(10_000):
        log.emit("snapshot", i, where="memory", freed=None)
    assert len(log.events) == 100 and log.events[0].step == 9_900
    assert log.counts["snapshot"] == 10_000
    log.close()
    assert sum(1 for _ in read_events(tmp_path / "run.jsonl")) == 10_000


def test_fsync_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(fd) or real(fd))
    log = EventLog(tmp_path / "a.jsonl")  # default: never
    for i in range(10):
        log.emit("snapshot", i, where="memory", freed=None)
    log.close()
    assert calls == []
    log = EventLog(tmp_path / "b.jsonl", fsync_every=4)
    for i in range(10):
        log.emit("snapshot", i, where="memory", freed=None)
    assert len(calls) == 2
    log.close()  # and once at close
    assert len(calls) == 3
    with pytest.raises(ValueError, match="fsync_every=0"):
        EventLog(fsync_every=0)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_failed_write_warns_once_and_keeps_going() -> None:
    log = EventLog("/dev/full")  # every write: "No space left on device"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            log.emit("snapshot", i, where="memory", freed=None)
    assert len([w for w in caught if "cannot write events" in str(w.message)]) == 1
    assert len(log.events) == 3 and log.write_error is not None
    log.close()


# ------------------------------------------- torn, zero-filled and marked files (issue 23)
def _one_of_each_kind(path: Path) -> list[bytes]:
    """A real line of every kind, with the values that make cuts interesting: floats
    with a fraction and an exponent, null, true, escapes (\\uXXXX, quotes) and NaN."""
    values: dict[str, object] = {
        "loss": 3.25, "grad_norm": 1.5e-300, "value": -2.5e19, "scale_before": 65536.0,
        "message": 'quote " back \\ snow \u2603 e\u0301', "module": "blocks.0.ln\u00e9",
        "shape": [2, 3], "stats": {"amax": 3.5, "min": -math.inf}, "deterministic": True,
        "tensors": [{"module": "m", "role": "output[0]", "numel": 4, "amax": math.nan,
                     "hist": [1, 3], "hist_from": -3, "formats": {"fp16": {"underflow": 0.5}}}],
        "param_dtypes": ["float32"], "world_size": 1, "precision": "fp16",
        "loss_scaling": True, "action": "applied", "phase": "forward",
        "to_step": 5, "rollbacks": 1, "skip_batches": 0, "from_step": 3, "transients": 0,
        "factor": 0.5, "scale_after": 32768.0, "clip": {"kind": "zclip", "max_norm": 1.0},
    }  # fmt: skip
    log = EventLog(path)
    for kind, names in sorted(EVENT_FIELDS.items()):
        log.emit(kind, 7, **{n: values.get(n) for n in names})
    log.close()
    return path.read_bytes().splitlines()


def test_every_cut_point_of_every_kinds_line_is_a_torn_line(tmp_path: Path) -> None:
    lines = _one_of_each_kind(tmp_path / "all.jsonl")
    good = b"\n".join(lines[:2]) + b"\n"
    cuts = 0
    for line in lines:
        for k in range(1, len(line)):
            for tail, after in ((b"", b""), (b"\x00" * 37, b""), (b"", b"\n" + lines[0] + b"\n")):
                path = tmp_path / "cut.jsonl"
                path.write_bytes(good + line[:k] + tail + after)
                problems: list[str] = []
                got = list(read_events(path, errors=problems))
                assert len(got) == 2 + bool(after), (line[:k], problems)
                assert len(problems) == 1 and "torn line" in problems[0], (line[:k], problems)
                cuts += 1
    assert cuts > 3 * 2000  # every kind's line, cut at every byte


def test_a_zero_filled_tail_and_a_bom_are_read_and_the_writer_starts_clean(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.jsonl"
    log = EventLog(path)
    log.emit("snapshot", 1, where="memory", freed=None)
    log.close()
    with open(path, "ab") as fh:
        fh.write(b'{"schema": 2, "kind": "step", "st' + b"\x00" * 4096)  # a crash's zeros
    log = EventLog(path)  # a resumed run appends: on a clean line, after the zeros
    log.emit("snapshot", 2, where="memory", freed=None)
    log.close()
    with pytest.warns(RuntimeWarning, match=r"run\.jsonl:2: a torn line"):
        assert [e.step for e in read_events(path)] == [1, 2]
    path.write_bytes(b"\x00" * 512)
    with pytest.warns(RuntimeWarning, match="zero-filled line"):
        assert list(read_events(path)) == []
    bom = b"\xef\xbb\xbf" + b'{"schema": 2, "kind": "snapshot", "step": 3, "where": "memory"}\n'
    path.write_bytes(bom)
    assert [e.step for e in read_events(path)] == [3]
    path.write_bytes(b'{"schema": 2, "kind": "snapshot", "step": 3,\x00 "where": "m"}\n')
    with pytest.raises(ValueError, match="NUL bytes inside the line"):
        list(read_events(path))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"kind": "step", "step": 1, "loss": "high"}',
            "step field 'loss' must be num, got 'high'",
        ),
        ('{"kind": "step", "step": 1, "action": 3}', "step field 'action' must be str, got 3"),
        ('{"kind": "step", "step": 1, "loss": [1.0]}', "'loss' must be num, got [1.0]"),
        ('{"kind": "step", "step": 1, "loss": {"$float": "banana"}}', "'loss' must be num"),
        ('{"kind": "step", "step": 1, "time": 1' + "0" * 400 + "}", "'time' is out of range"),
        ('{"kind": "fault", "step": 1, "shape": [-1]}', "'shape' must be a list of sizes"),
        ('{"kind": "stats", "step": 1, "tensors": [{"module": 1}]}', "tensors'[0].module"),
        ('{"kind": "step", "step": -10}', "'step' must be an int >= 0, got -10"),
        ('{"kind": "step", "step": 1, "loss": ' + "9" * 5000 + "}", "a value out of range"),
    ],
)
def test_a_mistyped_field_is_an_error_naming_file_line_and_field(
    tmp_path: Path, line: str, message: str
) -> None:
    path = tmp_path / "run.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=r"run\.jsonl:1: ") as err:
        list(read_events(path))
    assert message in str(err.value)


def test_a_log_that_cannot_be_opened_for_room_or_rights_warns_and_keeps_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only folder (EROFS) at construction, as mid-run: a warning, the events in
    memory, training goes on (a FIFO or a directory is a user's mistake: raised)."""
    import errno

    import floatguard.events as events_module

    def read_only(path: Path) -> Any:
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(events_module, "_open_log", read_only)
    with pytest.warns(RuntimeWarning, match="Read-only file system.*from the start"):
        log = EventLog(tmp_path / "events.jsonl")
    log.emit("snapshot", 0, where="memory", freed=None)
    log.close()
    assert log.write_error is not None and len(log.events) == 1


def test_a_schema_1_string_field_reading_inf_stays_a_string(tmp_path: Path) -> None:
    """Schema 1 wrote non-finite floats as bare strings ("inf"); a field the schema types
    as a string (a run's optimizer, its precision) keeps such a word as it is (found by
    the report's property test: an optimizer class named "inf" made the run unreadable)."""
    from floatguard.events import encode_value

    rec = {"schema": 1, "kind": "run", "step": 0, "time": 0.0, "rank": 0,
           "optimizer": "inf", "precision": "nan"}  # fmt: skip
    log = tmp_path / "events.jsonl"
    log.write_text(json.dumps(encode_value(rec)) + "\n")
    problems: list[str] = []
    (event,) = read_events(log, errors=problems)
    assert problems == [] and event["optimizer"] == "inf" and event["precision"] == "nan"
