"""The demo: the guarded run finds, localizes and answers every fault and learns the task;
the unguarded run dies. The report renders (in headless Chromium where installed)."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from floatguard.demo.run import EXPECTED, MAX_GRAD_NORM, run_demo
from floatguard.diagnose import clipped_steps, diagnose, run_info
from floatguard.events import read_events
from floatguard.report import render_report
from floatguard.runlog import RunLog

pytestmark = pytest.mark.subprocess

STEPS = 240


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    out = tmp_path_factory.mktemp("demo")
    r = run_demo(steps=STEPS, log=out / "events.jsonl")
    return r, out


def test_the_guarded_demo_finds_every_fault_and_learns(guarded: tuple[object, Path]) -> None:
    r, out = guarded
    assert r.finite and r.accuracy > 0.8, (r.accuracy, r.final_loss)  # type: ignore[attr-defined]
    events = list(read_events(out / "events.jsonl"))
    steps = {e.step: e for e in events if e.kind == "step"}
    faults = {e.step: e for e in events if e.kind == "fault"}
    sched = r.schedule  # type: ignore[attr-defined]
    for name, (module, phase) in EXPECTED.items():
        f = faults[sched[name]]
        assert (f["module"], f["phase"], f["deterministic"]) == (module, phase, True), name
    assert steps[sched["corrupt_batch"]]["reason"] == "nonfinite_input"
    assert steps[sched["bit_flip"]]["action"] == "rolled_back"
    assert faults[sched["masked_row"]]["op"] == "aten._softmax.default"
    assert steps[sched["fp16_overflow"]]["reason"] == "overflow"
    after_spike = [steps[s]["reason"] for s in range(sched["lr_spike"] + 1, sched["lr_spike"] + 8)]
    assert "loss_spike" in after_spike
    rules = {f.rule for f in diagnose(events)}
    assert {"bad_parameter", "bad_input", "masked_softmax", "loss_spikes"} <= rules


def test_the_demo_cap_clips_no_clean_step(guarded: tuple[object, Path]) -> None:
    """The demo's own diagnosis does not criticise its clipping: the absolute cap is set
    above the demo GPT's healthy gradient norms, so no clean step (before the first fault)
    is clipped to it, nor most steps of the run (ZClip's default cap of 1.0 clipped 382
    of 390), and there is no clipped_most_steps finding."""
    r, out = guarded
    log = RunLog.from_events(read_events(out / "events.jsonl"))
    info = run_info(log)
    assert (info.clip_kind, info.clip_cap) == ("zclip", MAX_GRAD_NORM)
    by_cap, _ = clipped_steps(log.steps, info)
    first_fault = min(r.schedule.values())  # type: ignore[attr-defined]
    steps = log.steps.column("step")
    assert [steps[j] for j in by_cap if steps[j] < first_fault] == []
    assert len(by_cap) < 0.5 * log.steps.column("action").count("applied")
    assert "clipped_most_steps" not in {f.rule for f in diagnose(log)}


def test_the_unguarded_demo_dies() -> None:
    r = run_demo(steps=STEPS, guarded=False)
    assert r.died_at == r.schedule["bit_flip"]
    assert not math.isfinite(r.final_loss)


def test_the_report_renders_everything(guarded: tuple[object, Path]) -> None:
    _, out = guarded
    index = render_report(out / "events.jsonl", out)
    page = index.read_text()
    assert "Recovered from 3 fault(s)" in page
    assert page.count("data:image/png;base64,") == 4  # timeline, scale, heatmap, histograms
    assert (out / "timeline.png").stat().st_size > 10_000
    assert "blocks.1.mlp.fc" in page and "aten._softmax.default" in page
    assert "Softmax over a row with every entry masked" in page
    assert "value statistics: numel" in page  # the birth's counts on its card


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(
    _chromium() is None, reason="chromium is not installed (apt-get install chromium)"
)
def test_the_report_loads_in_headless_chromium(guarded: tuple[object, Path]) -> None:
    _, out = guarded
    index = render_report(out / "events.jsonl", out)
    browser = _chromium()
    assert browser is not None
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--virtual-time-budget=5000", "--enable-logging=stderr", "--v=0",
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as profile:
        shot = out / "screenshot.png"
        subprocess.run(
            [browser, *flags, f"--user-data-dir={profile}", "--window-size=1100,1400",
             f"--screenshot={shot}", index.as_uri()],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        dom = subprocess.run(
            [browser, *flags, f"--user-data-dir={profile}", "--dump-dom", index.as_uri()],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
    assert shot.stat().st_size > 20_000  # a page with plots, not a blank one
    assert 'data-images="4/4"' in dom.stdout  # every image decoded
    console = [line for line in dom.stderr.splitlines() if "CONSOLE" in line]
    assert not [c for c in console if "rror" in c or "Uncaught" in c], console


def test_the_report_escapes_and_survives_a_broken_log(tmp_path: Path) -> None:
    from floatguard.events import EventLog

    log = EventLog(tmp_path / "run.jsonl")
    for i in range(3):
        log.emit("step", i, action="applied", reason=None, loss=1.0 / (i + 1), grad_norm=1.0,
                 clip_coef=1.0, scale=1.0, lr_factor=1.0, lr=None)  # fmt: skip
    log.emit("fault", 2, phase="forward", module="<script>alert(1)</script>", tensor="output",
             kind_of_value="nan", shape=[2], op="aten.log.default",
             source='x.py:1: y = "<b>"', deterministic=True, stats=None,
             fault_rank=None, cause="nonfinite_loss", input_amax=None, batch=None)  # fmt: skip
    log.close()
    with open(tmp_path / "run.jsonl", "a") as fh:
        fh.write("not json\n")
    page = render_report(tmp_path / "run.jsonl", tmp_path / "out").read_text()
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)" in page
    assert "run.jsonl:5: not a JSON line" in page


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["demo", "--bogus"], "no such option: --bogus"),
        (["demo", "--steps", "5"], "--steps 5"),
        (["demo", "--steps", "-3"], "--steps -3"),
        (["demo", "--precision", "fp8"], "--precision 'fp8'"),
        (["demo", "--faults", "meteor"], "unknown fault 'meteor'"),
        (["demo", "--out", "/dev/full/x"], "is not a writable folder"),
        (["report", "/nonexistent.jsonl"], "no such file"),
        (["diagnose", "/nonexistent.jsonl"], "no such file"),
        (["nosuch"], "No such command 'nosuch'"),
        (["explain", "1e-8", "--format"], "requires an argument"),
        (["explain", "0x1p99999", "-f", "fp16"], "beyond float64's range"),
        (["explain", "1e400"], "it would read as inf"),
        (["audit", "junk"], "give package.module:function"),
        (["audit", "nosuch.mod:fn"], "cannot import it"),
        (["audit", "json:dumps"], "raised TypeError"),
        (["audit", "math:pi"], "is not a function"),
        (["audit", "os:getcwd"], "must return (model, batches)"),
    ],
)
def test_cli_mistakes_are_one_red_line_and_exit_2(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "floatguard.cli", *args], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_negative_values_and_a_malformed_log(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "floatguard.cli", "explain", "-0.5", "-f", "fp16"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0 and "-0.5" in proc.stdout, proc.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2]\n")
    proc = subprocess.run(
        [sys.executable, "-m", "floatguard.cli", "diagnose", str(bad)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "holds no readable event" in proc.stderr
    assert "bad.jsonl:1" in proc.stderr


def test_cli_audit_of_the_built_in_target(tmp_path: Path) -> None:
    import json

    proc = subprocess.run(
        [sys.executable, "-m", "floatguard.cli", "audit", "tiny-gpt", "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # strict JSON
    assert [la["layer"] for la in report["layers"]][-1] == "head"
    proc = subprocess.run(
        [sys.executable, "-m", "floatguard.cli", "audit", "tiny-gpt", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and (tmp_path / "audit.html").exists()
    assert "blocks.0.attn.qkv" in (tmp_path / "audit.html").read_text()
