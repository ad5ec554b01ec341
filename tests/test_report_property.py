"""The report and the diagnosis hold on any log the reader accepts: generated event
streams, valid by the schema (any kinds and orders, non-finite and extreme values,
fields a schema 1 file lacks, empty runs, one-step runs, stopped runs, several ranks),
render and diagnose without an exception, and a mistyped line is named as unreadable."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from floatguard._event_schema import FIELD_TYPES, REQUIRED, STATS_TENSOR_TYPES
from floatguard.diagnose import _RULES, diagnose
from floatguard.events import SCHEMA_VERSION, encode_value, read_events
from floatguard.report import render_report
from floatguard.runlog import RunLog

EXTREME = [0.0, -0.0, 5e-324, 1e-308, 1.0, 65504.0, 1.7976931348623157e308, -1e308, 709.8]
numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([*EXTREME, math.nan, math.inf, -math.inf]),
    st.integers(min_value=-(2**62), max_value=2**62),
)
WORDS: dict[str, list[str]] = {
    "action": ["applied", "skipped", "rolled_back"],
    "phase": ["input", "param", "forward", "backward", "loss", "param_grad"],
    "op": ["aten._softmax.default", "aten.exp.default", "aten.native_layer_norm.default",
           "aten.rsqrt.default", "optimizer.step", "magnitude", "parameter", "input"],
    "module": ["", "ln_f", "blocks.0.attn.qkv", "fc", "norm", "<b>x</b>", "\x1b[2J"],
    "tensor": ["input[0]", "output", "param:weight", "optimizer:weight.exp_avg_sq"],
    "kind_of_value": ["nan", "inf"],
    "precision": ["fp32", "bf16", "fp16", "fp8"],
    "signal": ["loss", "grad_norm"],
    "reason": ["nonfinite_input", "loss_spike", "bad_data", "repeated_fault", "overflow"],
    "role": ["output[0]", "param:weight.grad", "input[0]"],
    "code": ["stalled_updates", "loss_trend", "grad_norm_trend", "nonfinite_buffer",
             "transients"],
}  # fmt: skip
text = st.text(max_size=12)
WORDS["op"] += ["update_or_outside", "outside"]
WORDS["tensor"] += ["buffer:bn.running_var"]
WORDS["cause"] = ["nonfinite_buffer", "optimizer_update", "nonfinite_param"]
# what the guard's warnings, batches and end events hold, with any part missing or wild
wild = st.one_of(numbers, text, st.none(), st.booleans(), st.lists(numbers, max_size=3),
                 st.lists(st.integers(-5, 10**6), max_size=3))  # fmt: skip
EVIDENCE_KEYS = [
    "layers", "fraction", "window", "samples", "lr", "buffers", "signal", "best_window",
    "best_mean", "windows", "ratio", "slope_per_step", "rise_step", "changed", "best_start",
    "best_end", "best_value", "window_starts", "window_values", "rise_start", "lr_best",
    "lr_rise", "lr_jump", "lr_jump_step", "scale_best", "scale_rise",
]  # fmt: skip
evidence = st.dictionaries(
    st.sampled_from(EVIDENCE_KEYS),
    st.one_of(
        wild,
        st.lists(st.fixed_dictionaries({}, optional={"name": wild, "dtype": wild,
                                                     "fraction": wild, "numel": wild}),
                 max_size=3),
        st.lists(st.lists(numbers, max_size=3), max_size=3),
        st.fixed_dictionaries({}, optional={"lr": wild, "scale": wild}),
    ),
)  # fmt: skip
batches = st.fixed_dictionaries(
    {}, optional={"position": wild, "micro_batches": wild, "fingerprint": wild, "shapes": wild}
)


def _string(name: str) -> st.SearchStrategy[str]:
    words = WORDS.get(name)
    if name == "action":  # the schema's one closed set of words
        return st.sampled_from(WORDS["action"])
    return st.one_of(st.sampled_from(words), text) if words else text


def _value(name: str, kind: str) -> st.SearchStrategy[Any]:
    base = kind.rstrip("?")
    if base == "num":
        strategy: st.SearchStrategy[Any] = numbers
    elif base == "int":
        strategy = st.integers(min_value=-(2**62), max_value=2**62)
    elif base == "str":
        strategy = _string(name)
    elif base == "bool":
        strategy = st.booleans()
    elif name == "shape":
        strategy = st.lists(st.integers(0, 2**40), max_size=4)
    elif name == "param_dtypes":
        strategy = st.lists(st.sampled_from(["float32", "float16", "bfloat16", "x"]), max_size=3)
    elif name == "tensors":
        strategy = st.lists(_tensor_entry(), max_size=4)
    elif name == "evidence":
        strategy = evidence
    elif name == "batch":
        strategy = batches
    elif name == "clip":
        strategy = st.fixed_dictionaries({}, optional={
            "kind": wild, "max_norm": wild, "norm_measured": st.sampled_from(
                ["before_clip", "after_clip", "x"])})  # fmt: skip
    elif name == "nonfinite":
        names = st.sampled_from(["buffer:bn.running_var", "param:fc.weight"])
        strategy = st.lists(st.one_of(names, text), max_size=3)
    elif base == "list":
        strategy = st.lists(numbers, max_size=3)
    else:  # dict: a fault's value statistics
        strategy = st.dictionaries(st.sampled_from(["numel", "nan", "amax", "min"]), numbers)
    return st.one_of(st.none(), strategy)


@st.composite
def _tensor_entry(draw: st.DrawFn) -> dict[str, Any]:
    entry: dict[str, Any] = {}
    for name, kind in STATS_TENSOR_TYPES.items():
        if kind.endswith("?") and draw(st.booleans()):
            continue  # an optional part left out
        if name in ("module", "role"):
            entry[name] = draw(_string(name))
        elif name == "hist":
            entry[name] = draw(st.lists(st.integers(0, 2**40), max_size=6))
        elif name == "hist_from":
            entry[name] = draw(st.integers(-10_000, 10_000))
        elif name == "formats":
            fit = st.dictionaries(st.sampled_from(["underflow", "overflow", "subnormal"]), numbers)
            entry[name] = draw(st.dictionaries(st.sampled_from(["fp16", "bf16", "e4m3fn"]), fit))
        elif kind.startswith("int"):
            entry[name] = draw(st.integers(0, 2**40))
        else:
            entry[name] = draw(numbers)
    if entry.get("hist") and "hist_from" not in entry:
        entry["hist_from"] = -3
    return entry


@st.composite
def _event(draw: st.DrawFn, step: int) -> dict[str, Any]:
    kind = draw(st.sampled_from(sorted(FIELD_TYPES)))
    rec: dict[str, Any] = {
        "schema": draw(st.sampled_from([1, SCHEMA_VERSION])),
        "kind": kind,
        "step": step,
        "time": draw(st.floats(0, 2e9)),
        "rank": draw(st.integers(0, 3)),
    }
    for name, field_kind in FIELD_TYPES[kind].items():
        if name in REQUIRED.get(kind, ()):  # every writer had it: an event without it is
            rec[name] = draw(_value(name, field_kind).filter(lambda v: v is not None))
            continue  # unreadable (test_a_required_field_missing_is_named_unreadable)
        if draw(st.integers(0, 5)) == 0:
            continue  # a field this (older) writer did not have
        rec[name] = draw(_value(name, field_kind))
    if rec["schema"] == 1:  # schema 1 wrote non-finite floats as bare strings
        rec = {k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in rec.items()}
        rec = {k: v for k, v in rec.items() if not (isinstance(v, float) and math.isinf(v))}
    return rec


@st.composite
def streams(draw: st.DrawFn) -> list[dict[str, Any]]:
    shape = draw(st.sampled_from(["empty", "one", "run", "stopped"]))
    if shape == "empty":
        return []
    n = 1 if shape == "one" else draw(st.integers(2, 24))
    steps = draw(
        st.one_of(
            st.just(list(range(n))),
            st.lists(st.integers(0, 2**62), min_size=n, max_size=n),  # any order, repeats
        )
    )
    out = [draw(_event(s)) for s in steps]
    if shape == "stopped":
        out.append({"schema": 2, "kind": "stop", "step": steps[-1], "time": 1.0, "rank": 0,
                    "reason": draw(_string("reason")), "fault": None})  # fmt: skip
    return out


def _write(path: Path, records: list[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(encode_value(rec), allow_nan=False) + "\n")


_SETTINGS = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.slow
@_SETTINGS
@given(streams())
def test_any_valid_stream_renders_and_every_rule_runs(records: list[dict[str, Any]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "events.jsonl"
        _write(log, records)
        problems: list[str] = []
        events = list(read_events(log, errors=problems))
        assert problems == []  # valid by the schema: every line reads
        assert len(events) == len(records)
        log = RunLog.from_events(events)
        for rule in _RULES:  # each rule on its own: none raises
            rule(log)
        found = diagnose(events)
        assert all(f.rule != "rule_failed" for f in found), [f.evidence for f in found]
        page = render_report(log, Path(tmp) / "report").read_text(encoding="utf-8")
        assert "<h2>Diagnosis" in page
        assert "Unreadable lines" not in page
        if not any(r["kind"] == "step" for r in records):
            assert "No step events: nothing to plot." in page


BAD_VALUES: dict[str, list[Any]] = {
    "num": ["high", [1.0], {"$float": "banana"}, True, 10**400],
    "int": ["3", 2.5, [1], 10**400],
    "str": [3, [None], {"a": 1}],
    "bool": ["yes", 1],
    "list": ["[1]", 3],
    "dict": [[1], "x"],
}


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), st.data())
def test_a_mistyped_field_is_named_unreadable_and_the_rest_renders(
    records: list[dict[str, Any]], data: st.DataObject
) -> None:
    kind = data.draw(st.sampled_from(sorted(FIELD_TYPES)))
    name, field_kind = data.draw(st.sampled_from(sorted(FIELD_TYPES[kind].items())))
    bad = data.draw(st.sampled_from(BAD_VALUES[field_kind.rstrip("?")]))
    records = [*records, {"schema": 2, "kind": kind, "step": 5, "time": 1.0, "rank": 0,
                          name: bad}]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "events.jsonl"
        _write(log, records)
        line = len(records)
        problems: list[str] = []
        events = list(read_events(log, errors=problems))
        assert len(events) == len(records) - 1
        assert len(problems) == 1 and f"{log}:{line}" in problems[0]
        assert repr(name) in problems[0] or name in problems[0]
        page = render_report(log, Path(tmp) / "report").read_text(encoding="utf-8")
        assert "Unreadable lines" in page and f"events.jsonl:{line}" in page


def _step(step: int, **kw: Any) -> dict[str, Any]:
    rec = {"schema": 2, "kind": "step", "step": step, "time": 1.0, "rank": 0,
           "action": "skipped", "reason": "nonfinite_grad", "loss": 1.0,
           "grad_norm": math.nan, "clip_coef": None, "scale": 65536.0,
           "lr_factor": 1.0}  # fmt: skip
    rec.update(kw)
    return rec


def test_a_run_with_no_step_applied_and_every_norm_nan_is_reported(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    _write(log, [_step(i) for i in range(30)])
    page = render_report(log, tmp_path / "r").read_text(encoding="utf-8")
    assert "No finite gradient norm in 30 step(s): that curve is left out." in page
    assert page.count("<img") == 2  # the loss panel and the loss scale
    _write(log, [_step(i, loss=math.inf) for i in range(30)])
    page = render_report(log, tmp_path / "r2").read_text(encoding="utf-8")
    assert "No finite loss or gradient norm in 30 step(s)" in page
    _write(log, [_step(i, loss=-1.0 - i, grad_norm=0.0) for i in range(30)])  # not log-able
    page = render_report(log, tmp_path / "r3").read_text(encoding="utf-8")
    assert (tmp_path / "r3" / "timeline.png").exists() and "left out" not in page


def test_a_stats_sample_with_parts_missing_is_reported(tmp_path: Path) -> None:
    tensors = [{"module": "fc", "role": "output[0]"},  # no counts, amax or histogram
               {"module": "fc", "role": "param:weight.grad", "amax": math.nan, "hist": [3],
                "hist_from": -20}]  # fmt: skip
    stats = {"schema": 2, "kind": "stats", "step": 0, "time": 1.0, "tensors": tensors}
    recs = [_step(0, action="applied", grad_norm=1.0), {**stats, "rank": 0}, {**stats, "rank": 1}]
    log = tmp_path / "events.jsonl"
    _write(log, recs)
    page = render_report(log, tmp_path / "r").read_text(encoding="utf-8")
    assert "No sampled module output had a positive finite amax" in page


def test_control_and_bidi_characters_from_a_log_are_shown_escaped_in_the_page(
    tmp_path: Path,
) -> None:
    evil = "a\x1b[2J\x07\r\x08\u202egnp.exe"
    recs = [_step(0, action="applied", grad_norm=1.0),
            {"schema": 2, "kind": "fault", "step": 0, "time": 1.0, "rank": 0, "phase": "forward",
             "module": evil, "tensor": "output", "kind_of_value": "nan", "op": "aten.log.default",
             "source": evil}]  # fmt: skip
    log = tmp_path / "events.jsonl"
    _write(log, recs)
    page = render_report(log, tmp_path / "r").read_text(encoding="utf-8")
    assert not any(c in page for c in "\x1b\x07\x08\u202e")
    assert "a\\x1b[2J\\x07\\r\\x08\\u202egnp.exe" in page
