"""The command line under hostile input (issue 22): every user mistake is one red line
and exit code 2, an internal error one line saying it is a bug (exit 1; --debug shows
the traceback), Ctrl-C "interrupted" (130); the demo's output is a screen or two, the
same in the live view, with a fault schedule valid for any --steps."""

from __future__ import annotations

import errno
import itertools
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import floatguard.cli as cli
from floatguard.demo.lines import EventLines, printable
from floatguard.demo.run import (
    FAULT_GAP,
    FAULTS,
    MAX_STEPS,
    MIN_STEPS,
    WARMUP,
    DemoResult,
    run_demo,
    schedule_for,
)
from floatguard.events import Event, EventLog

ROOT = Path(__file__).resolve().parents[1]
ME = __name__  # this module, importable as an audit TARGET's module


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``floatguard ARGS``, in this process."""
    with pytest.raises(SystemExit) as info:
        cli.main(list(args))
    out, err = capsys.readouterr()
    code = info.value.code
    return (code if isinstance(code, int) else 0), out, err


def _one_red_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "\x1b" not in err
    return lines[0]


# ------------------------------------------------------------------ audit targets
class _Weird(BaseException):
    pass


def target_exits() -> Any:
    sys.exit(3)


def target_base_exception() -> Any:
    raise _Weird("odd")


def target_runtime_error() -> Any:
    raise RuntimeError("boom")


def target_pair() -> Any:
    return (1, 2)


def target_string_model() -> Any:
    return ("gpt", [torch.zeros(2)])


def target_no_batches() -> Any:
    return torch.nn.Linear(4, 4), []


def target_tensor_batches() -> Any:
    return torch.nn.Linear(4, 4), torch.zeros(2, 4)


def target_bad_loss_fn() -> Any:
    return torch.nn.Linear(4, 4), [torch.zeros(2, 4)], "mse"


def target_broken_forward() -> Any:
    return torch.nn.Linear(4, 4), [torch.zeros(2, 5)]  # 5 features into a Linear(4, .)


MISTAKES = [
    (["explain", "1", "-f", "e99999999999999999999m1"], "'e99999999999999999999m1'"),
    (["explain", "[/red]"], "cannot read '[/red]' as a number"),  # not rich markup
    (["explain", "\x1b[31m1"], "\\x1b[31m1"),  # the ESC shown, not obeyed
    (["demo", "--seed", "1180591620717411303424"], "--seed 1180591620717411303424: use"),
    (["demo", "--seed", "-1"], "--seed -1: use an int in 0..9223372036854775807"),
    (["demo", "--steps", "99999999999999999999999999999"], f"use {MIN_STEPS}..1,000,000"),
    (["demo", "--steps", "19"], "--steps 19"),
    (["demo", "--out", ""], "--out is empty"),
    (["report", "run.jsonl", "--out", " "], "--out is empty"),
    (["audit", "tiny-gpt", "--out", ""], "--out is empty"),
    (["demo", "--stpes", "30"], "no such option: --stpes (did you mean"),
    (["nosuch"], "No such command 'nosuch'"),
    (["audit", f"{ME}:target_exits"], "target_exits' raised SystemExit: 3"),
    (["audit", f"{ME}:target_base_exception"], "raised _Weird: odd"),
    (["audit", f"{ME}:target_runtime_error"], "raised RuntimeError: boom"),
    (["audit", f"{ME}:target_pair"], "returned int 1 as the model"),
    (["audit", f"{ME}:target_string_model"], "returned str 'gpt' as the model"),
    (["audit", f"{ME}:target_no_batches"], "target_no_batches' returned no batches"),
    (["audit", f"{ME}:target_tensor_batches"], "returned Tensor"),
    (["audit", f"{ME}:target_bad_loss_fn"], "returned str 'mse' as the loss_fn"),
    (["audit", f"{ME}:target_broken_forward"], "the audit stopped at RuntimeError: mat1"),
]


@pytest.mark.parametrize(("args", "needle"), MISTAKES, ids=[" ".join(a) for a, _ in MISTAKES])
def test_a_mistake_is_one_red_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    code, _, err = _main(capsys, *args)
    line = _one_red_line(err)
    assert code == 2, err
    assert line.startswith("error: ") and needle in line, line


def test_no_arguments_prints_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _main(capsys)
    assert code == 2
    assert "Usage" in out + err and "demo" in out + err and "--debug" in out + err
    assert "Traceback" not in out + err


@pytest.mark.parametrize(
    "args",
    [
        ["explain", "-inf"],
        ["explain", "-inf", "-f", "fp16"],
        ["explain", "-f", "fp16", "-inf"],
        ["explain", "--format", "fp16", "--", "-inf"],
        ["explain", "--", "-inf"],
    ],
    ids=" ".join,
)
def test_explain_reads_minus_inf_as_a_value(
    capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    code, out, err = _main(capsys, *args)
    assert code == 0 and not err, err
    assert "-inf stored in" in out and "fp16" in out and "-65504" in out  # next up of -inf


def test_explain_reads_a_negative_hex_float_with_an_f(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _main(capsys, "explain", "-0x1.fp3", "-f", "fp16")  # -15.5
    assert code == 0 and not err, err
    assert "-15.5" in out


def _boom(*args: object, **kwargs: object) -> Any:
    raise RuntimeError("kaput\x1b[2J\nsecond line")


def test_an_internal_error_is_one_line_saying_it_is_a_bug(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FLOATGUARD_DEBUG", raising=False)
    monkeypatch.setattr(cli, "explain", _boom)
    code, _, err = _main(capsys, "explain", "1")
    line = _one_red_line(err)
    assert code == 1
    assert line.startswith("internal error: RuntimeError: kaput\\x1b[2J\\nsecond line")
    assert "this is a bug in floatguard" in line and "--debug" in line


@pytest.mark.parametrize("how", ["flag first", "flag last", "environment"])
def test_debug_shows_the_traceback(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    monkeypatch.delenv("FLOATGUARD_DEBUG", raising=False)
    monkeypatch.setattr(cli, "explain", _boom)
    args = {"flag first": ["--debug", "explain", "1"], "flag last": ["explain", "1", "--debug"]}
    if how == "environment":
        monkeypatch.setenv("FLOATGUARD_DEBUG", "1")
    with pytest.raises(RuntimeError, match="kaput"):
        cli.main(args.get(how, ["explain", "1"]))


def test_ctrl_c_in_process_prints_interrupted(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupt(*args: object, **kwargs: object) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "explain", interrupt)
    code, _, err = _main(capsys, "explain", "1")
    assert code == 130 and err.strip() == "interrupted"


def _sigint_as_a_shell_gives_it() -> None:
    # A child inherits an ignored SIGINT (Python then never raises KeyboardInterrupt),
    # and a library in this test process may have left it ignored: Lightning does, on
    # a KeyboardInterrupt during fit. A terminal's Ctrl-C reaches a fresh default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.subprocess
def test_ctrl_c_during_the_demo_prints_interrupted(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "floatguard.cli", "demo", "--no-live", "--out", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        preexec_fn=_sigint_as_a_shell_gives_it,
    )  # fmt: skip
    assert proc.stdout is not None
    header = proc.stdout.readline()  # printed before the first step
    assert header.startswith("floatguard demo:"), header
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip() == "interrupted"


# ------------------------------------------------------------------ the demo's --out
def test_the_demo_refuses_to_replace_a_runs_log(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "events.jsonl").write_text('{"an": "earlier run"}\n')
    code, _, err = _main(capsys, "demo", "--out", str(tmp_path), "--steps", "20")
    line = _one_red_line(err)
    assert code == 2
    assert str(tmp_path / "events.jsonl") in line and "--force" in line
    assert (tmp_path / "events.jsonl").read_text() == '{"an": "earlier run"}\n'


def test_the_demo_names_a_log_it_could_not_write(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(**kwargs: Any) -> DemoResult:
        r = DemoResult(True, kwargs["steps"], {}, 0.0, 1.0, True, None, 0.1, kwargs["log"])
        r.losses, r.log_error = [2.0] * 8, "[Errno 28] No space left on device"
        return r

    monkeypatch.setattr("floatguard.demo.run.run_demo", full_disk)
    code, _, err = _main(capsys, "demo", "--no-live", "--out", str(tmp_path), "--steps", "20")
    line = _one_red_line(err)
    assert code == 2
    assert f"cannot write '{tmp_path / 'events.jsonl'}': No space left on device" in line
    assert "stopped at step 7" in line


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_stops_the_demo_run_with_its_reason(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    log.symlink_to("/dev/full")  # every write: ENOSPC
    with pytest.warns(RuntimeWarning, match="cannot write events"):
        r = run_demo(steps=MIN_STEPS, log=log)
    assert r.log_error is not None and "No space left on device" in r.log_error
    assert len(r.losses) == 1  # the first step's events could not be written: stopped


def test_a_full_disk_under_the_report_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run.jsonl"
    log = EventLog(run)
    for i in range(3):
        log.emit("step", i, action="applied", reason=None, loss=1.0 / (i + 1), grad_norm=1.0,
                 clip_coef=1.0, scale=1.0, lr_factor=1.0, lr=None)  # fmt: skip
    log.close()
    out = tmp_path / "report"

    def full_disk(self: object, fname: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(fname))

    monkeypatch.setattr("matplotlib.figure.Figure.savefig", full_disk)
    code, _, err = _main(capsys, "report", str(run), "--out", str(out))
    line = _one_red_line(err)
    assert code == 2
    assert "cannot write" in line and "No space left on device" in line
    assert sorted(p.name for p in out.iterdir()) == []  # no temp file left behind


# ------------------------------------------------------------------ the report's --out
def _a_log(path: Path) -> bytes:
    log = EventLog(path)
    for i in range(3):
        log.emit("step", i, action="applied", reason=None, loss=1.0 / (i + 1), grad_norm=1.0,
                 clip_coef=1.0, scale=1.0, lr_factor=1.0, lr=None)  # fmt: skip
    log.close()
    return path.read_bytes()


@pytest.mark.parametrize("name", ["index.html", "timeline.png"])
def test_the_report_refuses_to_overwrite_its_input(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str
) -> None:
    """Issue 39, item 7: the log is one of the files the report writes."""
    log = tmp_path / name
    before = _a_log(log)
    code, _, err = _main(capsys, "report", str(log), "--out", str(tmp_path))
    line = _one_red_line(err)
    assert code == 2 and "overwrite its input" in line and "--out" in line
    assert log.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_the_report_refuses_an_output_linked_to_its_input(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    log = tmp_path / "run.jsonl"
    before = _a_log(log)
    out = tmp_path / "report"
    out.mkdir()
    (out / "index.html").symlink_to(log)
    code, _, err = _main(capsys, "report", str(log), "--out", str(out))
    assert code == 2 and "overwrite its input" in _one_red_line(err)
    assert log.read_bytes() == before


def test_the_report_never_writes_through_a_link(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A link at index.html (or a plot's name) to a user's file: the link is replaced
    by the page, the user's file stays byte-identical."""
    log = tmp_path / "run.jsonl"
    _a_log(log)
    victim = tmp_path / "notes.txt"
    victim.write_bytes(b"a user's notes\n" * 100)
    out = tmp_path / "report"
    out.mkdir()
    for name in ("index.html", "timeline.png"):
        (out / name).symlink_to(victim)
    code, _, _ = _main(capsys, "report", str(log), "--out", str(out))
    assert code == 0
    assert victim.read_bytes() == b"a user's notes\n" * 100
    for name in ("index.html", "timeline.png"):
        assert not (out / name).is_symlink() and (out / name).stat().st_size > 0
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp file left
    assert (out / "index.html").read_text().startswith("<!doctype html>")


def test_a_report_killed_midway_leaves_the_old_page_whole(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "run.jsonl"
    _a_log(log)
    out = tmp_path / "report"
    assert _main(capsys, "report", str(log), "--out", str(out))[0] == 0
    good = (out / "index.html").read_bytes()
    write_text = Path.write_text

    def killed(self: Path, data: str, *args: Any, **kwargs: Any) -> int:
        write_text(self, data[: len(data) // 2], *args, **kwargs)  # half the page, then
        raise KeyboardInterrupt  # Ctrl-C

    monkeypatch.setattr(Path, "write_text", killed)
    code, _, err = _main(capsys, "report", str(log), "--out", str(out))
    assert code == 130 and err.strip() == "interrupted"
    assert (out / "index.html").read_bytes() == good


# ------------------------------------------------------------------ the fault schedule
@pytest.mark.parametrize("steps", [20, 21, 37, 40, 400, 100_000, MAX_STEPS])
def test_the_schedule_is_valid_for_any_length(steps: int) -> None:
    at = schedule_for(steps, list(FAULTS))
    assert list(at) == list(FAULTS)
    when = list(at.values())
    assert when == sorted(when), at  # in the order of their fractions
    assert when[0] >= WARMUP and when[-1] <= steps - 2, at  # after warm-up, room after
    assert all(b - a >= FAULT_GAP for a, b in itertools.pairwise(when)), at
    for name in FAULTS:  # a subset strikes at the same steps
        assert schedule_for(steps, [name]) == {name: at[name]}


def test_the_schedule_keeps_the_fractions_of_a_long_run() -> None:
    assert list(schedule_for(400, list(FAULTS)).values()) == [60, 120, 180, 240, 300]
    assert list(schedule_for(20, list(FAULTS)).values()) == [10, 12, 14, 16, 18]


@pytest.mark.parametrize("steps", [MIN_STEPS - 1, MAX_STEPS + 1, 10**30, True, 40.0])
def test_the_schedule_and_the_run_refuse_a_bad_length(steps: Any) -> None:
    with pytest.raises(ValueError, match="steps="):
        schedule_for(steps, list(FAULTS))
    with pytest.raises(ValueError, match="steps="):
        run_demo(steps=steps)


@pytest.mark.parametrize("seed", [-1, 2**63, 1180591620717411303424])
def test_the_run_refuses_a_seed_torch_cannot_take(seed: int) -> None:
    with pytest.raises(ValueError, match="seed="):
        run_demo(steps=MIN_STEPS, seed=seed)


# ------------------------------------------------------------------ the demo's lines
def _lines(events: list[Event]) -> list[str]:
    lines = EventLines()
    out = [line.text for ev in events for line in lines.feed(ev)]
    return out + [line.text for line in lines.close()]


def _step(step: int, action: str = "applied", reason: str | None = None) -> Event:
    return Event("step", step, {"action": action, "reason": reason, "loss": 1.0})


def test_a_fault_and_its_answer_are_one_line() -> None:
    fault = Event("fault", 7, {"module": "blocks.0.attn", "tensor": "output",
                               "kind_of_value": "nan", "op": "aten._softmax.default"})  # fmt: skip
    roll = Event("rollback", 7, {"to_step": 5, "rollbacks": 1})
    assert _lines([_step(6), fault, roll, _step(7, "rolled_back", "nonfinite_loss"), _step(8)]) == [
        "step 7: rolled back to step 5 (nonfinite_loss): nan in blocks.0.attn output, "
        "made by aten._softmax.default"
    ]


def test_names_from_a_log_are_made_printable() -> None:
    fault = Event("fault", 3, {"module": "evil\x1b[2J\nname", "tensor": "out\x07"})
    (line,) = _lines([fault, _step(3, "skipped", "nonfinite_loss\r")])
    assert line == "step 3: skipped (nonfinite_loss\\r): non-finite in evil\\x1b[2J\\nname out\\x07"
    assert printable("x" * 500, 10) == "x" * 9 + "…"


def test_events_with_missing_or_odd_fields_still_print() -> None:
    odd = [
        Event("fault", 1, {}),
        Event("step", 1, {}),
        Event("overflow", 2, {"scale_before": "big"}),
        Event("stats", 3, {"tensors": "not a list"}),
        Event("stats", 4, {"tensors": [None, {"formats": {"fp16": {"underflow": "x"}}}]}),
        Event("warning", 5, {"message": "x\n" * 300}),
        Event("meteor", 6, {"size": 3.0, "shape": [1, 2], "blob": {"a": 1}}),
        Event("snapshot", 7, {"where": "memory"}),
        Event("stop", 8, {"reason": "budget", "fault": None}),
    ]
    lines = _lines(odd)
    assert lines[0] == "step 1: ?: non-finite in the data (input)"
    assert lines[1] == "step 2: loss scale big -> None"  # no step event: flushed by the next
    assert lines[2] == "step 3: stats sample: 0 tensors"
    assert lines[3].startswith("step 5: warning: x\\nx\\n") and lines[3].endswith("…")
    assert lines[4:] == [
        "step 6: meteor size=3, shape=<2 items>, blob=<1 fields>",
        "step 8: stopped: budget",
        "stats: 2 samples of 1 tensors, steps 3-4",
    ]
    assert all(len(line) < 300 and "\n" not in line for line in lines), lines


def test_the_same_line_on_consecutive_steps_prints_once_with_a_count() -> None:
    events = [_step(s, "skipped", "overflow") for s in range(10, 15)] + [_step(15)]
    assert _lines(events) == [
        "step 10: skipped (overflow)",
        "steps 11-14: the same, 4 more time(s): skipped (overflow)",
    ]


def test_stats_samples_are_one_line_and_a_summary() -> None:
    def sample(step: int, underflow: float, nonfinite: int = 0) -> Event:
        row = {"module": "fc", "role": "grad", "nonfinite": nonfinite,
               "formats": {"fp16": {"underflow": underflow}}}  # fmt: skip
        return Event("stats", step, {"tensors": [row, {"module": "x", "role": "w"}]})

    assert _lines([sample(0, 0.0), sample(20, 0.25, nonfinite=3), sample(40, 0.01)]) == [
        "step 0: stats sample: 2 tensors; no fp16 underflow",
        "stats: 3 samples of 2 tensors, steps 0-40; worst fp16 underflow 25% (fc grad, step 20); "
        "non-finite values at steps 20",
    ]


# ------------------------------------------------------------------ the demo, whole
FAULT_LINES = {
    "corrupt_batch": "step 10: skipped (nonfinite_input): nan in the data",
    "bit_flip": "step 12: rolled back to step 11 (nonfinite_param): inf in blocks.1.mlp.fc",
    "masked_row": "step 14: skipped (nonfinite_loss): nan in blocks.0.attn output, made by "
    "aten._softmax.default",
    "fp16_overflow": "step 18: skipped (overflow): loss scale",
}


def test_the_demo_output_fits_a_screen_and_the_live_view_shows_the_same(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, log_lines, err = _main(
        capsys, "demo", "--no-live", "--steps", "20", "--out", str(tmp_path / "a")
    )
    assert code == 0, err
    lines = log_lines.splitlines()
    assert len(lines) < 60, log_lines
    assert all(len(line) <= 400 for line in lines)
    events = [line for line in lines if line.startswith(("step ", "steps ", "stats: "))]
    for name, needle in FAULT_LINES.items():
        assert any(line.startswith(needle) for line in events), (name, events)
    assert any("loss spike" in line for line in events), events  # the lr_spike's answer
    assert "diagnosis" in log_lines and "report: " in log_lines
    code, live, err = _main(capsys, "demo", "--steps", "20", "--out", str(tmp_path / "b"))
    assert code == 0, err
    live_events = [line for line in live.splitlines() if line in events]
    assert live_events == events  # the same lines, in the same order


@pytest.mark.subprocess
def test_end_to_end_one_line_and_no_traceback(tmp_path: Path) -> None:
    for args, code, needle in [
        (["explain", "-inf", "-f", "fp16"], 0, "-inf stored in fp16"),
        (["demo", "--out", ""], 2, "error: --out is empty"),
        (["explain", "1", "-f", "e99999999999999999999m1"], 2, "'e99999999999999999999m1'"),
        ([], 2, "Usage"),
    ]:
        proc = subprocess.run(
            [str(ROOT / ".venv" / "bin" / "floatguard"), *args]
            if (ROOT / ".venv" / "bin" / "floatguard").exists()
            else [sys.executable, "-m", "floatguard.cli", *args],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )  # fmt: skip
        assert proc.returncode == code, (args, proc.stderr)
        assert needle in proc.stdout + proc.stderr, (args, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr
        if code == 2 and args:
            assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_names_from_a_log_cannot_drive_the_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ESC sequences in module and op names are shown escaped, never obeyed (issue 23)."""
    log = EventLog(tmp_path / "events.jsonl")
    for i in range(3):
        log.emit("fault", i, phase="forward", module="\x1b[2J\x1b[31mevil", tensor="output",
                 kind_of_value="nan", shape=[1], op="aten.exp.default\x07", source=None,
                 deterministic=True, stats=None, fault_rank=None, cause=None,
                 input_amax=None, batch=None)  # fmt: skip
    log.close()
    with open(tmp_path / "events.jsonl", "a") as fh:
        fh.write('{"kind": "step", "step": 9, "loss": "\\u001b[2J"}\n')  # mistyped: skipped
    rc, out, err = _main(capsys, "diagnose", str(tmp_path / "events.jsonl"))
    assert rc == 0 and "\x1b" not in out + err and "\x07" not in out + err
    assert "\\x1b[2J\\x1b[31mevil" in out  # shown, escaped
    flat = " ".join(out.split())  # (rich wraps long lines at the terminal's width)
    assert "could not be read" in flat and "'loss' must be num" in flat  # counted, named


@pytest.mark.parametrize("name", ["index.html", "timeline.png"])
def test_a_directory_in_the_way_of_an_output_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str
) -> None:
    log = tmp_path / "run.jsonl"
    _a_log(log)
    out = tmp_path / "report"
    (out / name).mkdir(parents=True)
    code, _, err = _main(capsys, "report", str(log), "--out", str(out))
    line = _one_red_line(err)
    assert code == 2 and f"cannot write '{out / name}'" in line, line
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temp file left


def test_the_demo_probes_its_folder_with_a_new_file(tmp_path: Path) -> None:
    """A link or a FIFO planted under any name in --out is never written through or
    opened: the write probe is a new temp file (issue 39, second hostile pass)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".floatguard-write-test").symlink_to(victim)
    os.mkfifo(out / ".floatguard-write-test.fifo")
    log = cli._demo_log(out, force=False)
    assert log == out / "events.jsonl" and victim.read_text() == "precious"
    assert sorted(p.name for p in out.iterdir()) == [
        ".floatguard-write-test", ".floatguard-write-test.fifo",
    ]  # fmt: skip


def test_the_demo_names_a_folder_where_its_log_or_out_should_be(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "a" / "events.jsonl").mkdir(parents=True)
    (tmp_path / "file").write_text("x")
    for out, words in ((tmp_path / "a", "is a folder"), (tmp_path / "file", "is a file")):
        code, _, err = _main(capsys, "demo", "--out", str(out), "--steps", "60", "--force")
        assert code == 2 and words in _one_red_line(err)
