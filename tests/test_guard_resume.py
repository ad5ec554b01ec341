"""Guard state survives: a killed run resumes bit-identically; a failing snapshot write
never leaves a step half done."""

from __future__ import annotations

import math
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from floatguard import Guard, ResponsePolicy, SnapshotError, read_events
from floatguard.report import render_report
from floatguard.runlog import RunLog

_TRAIN = textwrap.dedent(
    """
    import math, sys, time, torch
    import torch.nn.functional as F
    from torch import nn
    from floatguard import Guard, ResponsePolicy

    folder, log, mode, n, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = Guard(model, opt, response=ResponsePolicy(snapshot_dir=folder), log=log)
    start = guard.resume() if mode == "resume" else 0
    for i in range(start, n):
        g = torch.Generator().manual_seed(1000 + i)  # the data of step i, wherever it runs
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        if i == 23:
            x = x * math.nan
        if i == 41:
            with torch.no_grad():
                model[0].weight[0, 0] = math.nan
        guard.step(lambda x=x, y=y: F.mse_loss(model(x), y))
        print(i, flush=True)
        if mode == "slow":
            time.sleep(0.02)
    torch.save([p.detach().clone() for p in model.parameters()], out)
    guard.close()
    """
)
N = 60


def _train(tmp: Path, name: str, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _TRAIN, str(tmp / name), str(tmp / f"{name}.jsonl"), mode,
         str(N), str(tmp / f"{name}.pt")],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def _comparable(events: list) -> list[tuple[str, int, str]]:  # type: ignore[type-arg]
    """Events without their time; snapshot paths by file name; NaN equal to NaN."""
    out = []
    for e in events:
        fields = dict(e.fields)
        if "where" in fields and fields["where"] != "memory":
            fields["where"] = Path(fields["where"]).name
        out.append((e.kind, e.step, repr(sorted(fields.items()))))
    return out


@pytest.mark.subprocess
@pytest.mark.parametrize("kill_after", [27, 44])
def test_a_killed_run_resumes_bit_identically(tmp_path: Path, kill_after: int) -> None:
    full = _train(tmp_path, "full", "full")
    assert full.wait(timeout=120) == 0
    victim = _train(tmp_path, "cut", "slow")
    assert victim.stdout is not None
    for line in victim.stdout:
        if int(line) >= kill_after:
            victim.send_signal(signal.SIGKILL)  # kill -9, mid-run
            break
    victim.wait()
    assert not (tmp_path / "cut.pt").exists()
    resumed = _train(tmp_path, "cut", "resume")
    assert resumed.wait(timeout=120) == 0
    a = torch.load(tmp_path / "full.pt")
    b = torch.load(tmp_path / "cut.pt")
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    ev_full = list(read_events(tmp_path / "full.jsonl"))
    ev_cut = list(read_events(tmp_path / "cut.jsonl"))
    marks = [i for i, e in enumerate(ev_cut) if e.kind == "resume"]
    assert len(marks) == 1
    start = ev_cut[marks[0]]["from_step"]
    assert 0 < start <= kill_after  # the newest snapshot before the kill
    after = ev_cut[marks[0] + 1 :]
    same_span = [e for e in ev_full if e.step >= start][: len(after)]
    assert _comparable(after) == _comparable(same_span)
    assert len(after) == len([e for e in ev_full if e.step >= start])
    # the report and the diagnosis read the resumed log as the uninterrupted run: the
    # steps the kill cut short (logged before the resume) are superseded by it
    full_log, cut_log = (
        RunLog.read([tmp_path / "full.jsonl"]),
        RunLog.read([tmp_path / "cut.jsonl"]),
    )
    assert len(cut_log.steps) == N
    for column in ("step", "action", "reason", "loss", "grad_norm"):
        assert repr(cut_log.steps.column(column)) == repr(full_log.steps.column(column))
    assert cut_log.superseded == len(
        [e for e in ev_cut[: marks[0]] if e.step >= start and e.kind not in ("run", "stop")]
    )
    assert [(e.kind, e.step) for e in cut_log.of_kind("fault")] == [
        (e.kind, e.step) for e in full_log.of_kind("fault")
    ]
    assert cut_log.counts["step"] == N
    html = render_report([tmp_path / "cut.jsonl"], tmp_path / "report").read_text()
    assert f"of {N} steps" in html


def _net() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


@pytest.mark.parametrize("policy", ["retry", "disable", "raise"])
def test_a_snapshot_folder_that_breaks_mid_run(tmp_path: Path, policy: str) -> None:
    folder = tmp_path / "snaps"
    model, opt = _net()
    guard = Guard(
        model, opt,
        response=ResponsePolicy(snapshot_dir=str(folder), on_snapshot_error=policy),  # type: ignore[arg-type]
    )  # fmt: skip
    for i in range(7):
        x, y = _batch(i)
        assert guard.step(lambda x=x, y=y: F.mse_loss(model(x), y)).action == "applied"
    shutil.rmtree(folder)
    folder.write_text("no longer a folder")  # every write there now fails
    results = []
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")  # every warning recorded: once is the guard's doing
        for i in range(7, 12):
            x, y = _batch(i)
            before = ([p.detach().clone() for p in model.parameters()], guard.step_count)
            opt_before = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
            try:
                results.append(guard.step(lambda x=x, y=y: F.mse_loss(model(x), y)).action)
            except SnapshotError as e:
                assert "the step was not applied" in str(e)
                results.append("raised")
                # nothing of the step happened
                assert all(
                    torch.equal(a, b) for a, b in zip(before[0], model.parameters(), strict=True)
                )
                assert guard.step_count == before[1]
                assert all(p.grad is None for p in model.parameters())
                after = opt.state_dict()["state"][0]
                assert all(torch.equal(after[k], v) for k, v in opt_before.items())
                break
    errors = guard.events.of_kind("snapshot_error")
    if policy == "raise":
        assert results == ["applied", "applied", "applied", "raised"]  # step 10 snapshots
        assert warned == []  # the exception says it
    else:
        assert results == ["applied"] * 5
        assert len(errors) == 1 and errors[0].step == 10 and errors[0]["policy"] == policy
        assert "is a file, not a folder" in errors[0]["error"]
        (w,) = warned  # once, on stderr
        assert w.category is RuntimeWarning
        assert str(w.message).startswith(
            f"floatguard: cannot write the snapshot of step 10 to {folder} ("
        )
        assert "the newest snapshot on disk is of step 5" in str(w.message)
    guard.close()


def test_resume_falls_back_past_a_corrupted_newest_snapshot(tmp_path: Path) -> None:
    folder = tmp_path / "snaps"
    model, opt = _net()
    guard = Guard(model, opt, response=ResponsePolicy(snapshot_dir=str(folder), snapshot_keep=3))
    for i in range(16):
        x, y = _batch(i)
        guard.step(lambda x=x, y=y: F.mse_loss(model(x), y))
    guard.close()
    newest = sorted(folder.iterdir())[-1]
    assert newest.name == "snapshot-000000015.fgs"
    raw = bytearray(newest.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    newest.write_bytes(bytes(raw))
    model2, opt2 = _net()
    fresh = Guard(model2, opt2, response=ResponsePolicy(snapshot_dir=str(folder)))
    assert fresh.resume() == 10
    fallback = fresh.events.of_kind("snapshot_fallback")
    assert len(fallback) == 1 and "corrupted" in fallback[0]["error"]
    assert fallback[0]["used"].endswith("snapshot-000000010.fgs")
    assert fresh.good_steps == 10 and fresh.step_count == 10
    with pytest.raises(ValueError, match="needs a path"):
        Guard(model2, opt2).resume()
    fresh.close()


def test_a_nan_weight_after_resume_still_rolls_back(tmp_path: Path) -> None:
    folder = tmp_path / "snaps"
    model, opt = _net()
    guard = Guard(model, opt, response=ResponsePolicy(snapshot_dir=str(folder)))
    for i in range(6):
        x, y = _batch(i)
        guard.step(lambda x=x, y=y: F.mse_loss(model(x), y))
    guard.close()
    model2, opt2 = _net()
    g2 = Guard(model2, opt2, response=ResponsePolicy(snapshot_dir=str(folder)))
    start = g2.resume()
    with torch.no_grad():
        model2[0].weight[0, 0] = math.nan
    x, y = _batch(start)
    r = g2.step(lambda: F.mse_loss(model2(x), y))
    assert (r.action, r.reason) == ("rolled_back", "nonfinite_param")
    assert all(bool(torch.isfinite(p).all()) for p in model2.parameters())
    g2.close()


@pytest.mark.filterwarnings("ignore:floatguard. cannot write the snapshot:RuntimeWarning")
def test_every_event_the_guard_writes_has_exactly_its_kinds_fields(tmp_path: Path) -> None:
    from floatguard import DynamicLossScaler, SpikePolicy
    from floatguard.events import EVENT_FIELDS

    folder = tmp_path / "snaps"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = Guard(
        model, opt, precision="fp16", log=tmp_path / "run.jsonl",
        scaler=DynamicLossScaler(init_scale=16.0),
        spikes=SpikePolicy(window=10, warmup=5, z=5.0),
        response=ResponsePolicy(snapshot_dir=str(folder), rollback_after=2,
                                transient_warn_after=1),
    )  # fmt: skip
    first_call: set[int] = set()
    for i in range(40):
        x, y = _batch(i)
        if i == 12:
            x = x * math.nan
        if i == 15:
            y = y * 30.0
        if i == 18:
            with torch.no_grad():
                model[0].weight[0, 0] = math.nan
        if i == 30:
            shutil.rmtree(folder)
            folder.write_text("x")

        def closure(x: torch.Tensor = x, y: torch.Tensor = y, i: int = i) -> torch.Tensor:
            if i == 21 and i not in first_call:  # only the first call: transient
                first_call.add(i)
                return F.mse_loss(model(x * math.nan).float(), y)
            factor = 1e30 if i in (24, 25) else 1.0  # fp16 gradient overflow
            return F.mse_loss(model(x).float(), y) * factor

        guard.step(closure)
    guard.close()
    events = list(read_events(tmp_path / "run.jsonl"))
    kinds = {e.kind for e in events}
    assert kinds >= {"step", "fault", "overflow", "spike", "rollback", "snapshot",
                     "snapshot_error", "warning"}, kinds  # fmt: skip
    for e in events:
        assert set(e.fields) == EVENT_FIELDS[e.kind], (e.kind, sorted(e.fields))
