"""Snapshots with an identity: a folder's run, another run's files, snapshots that do not
fit, swapped files, one guard per folder, steps past nine digits, a full disk."""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from floatguard import Guard, ResponsePolicy, SnapshotError
from floatguard.stability._process import HOST
from floatguard.stability.snapshot import ForeignSnapshotError, load_snapshot
from floatguard.stability.snapshot_folder import (
    IDENTITY_FILE,
    LOCK_FILE,
    SnapshotFolderBusy,
    read_run_id,
)

Net = tuple[nn.Module, torch.optim.Optimizer]


def _net(hidden: int = 16) -> Net:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _guard(folder: Path, net: Net, **policy: Any) -> Guard:
    response = ResponsePolicy(snapshot_dir=str(folder), **policy)
    return Guard(net[0], net[1], response=response)


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def _train(guard: Guard, start: int, stop: int) -> list[Any]:
    model = guard.model
    results = []
    for i in range(start, stop):
        x, y = _batch(i)
        results.append(guard.step(lambda x=x, y=y: F.mse_loss(model(x), y)))
    return results


def _run(folder: Path, steps: int, **policy: Any) -> str:
    """A run of ``steps`` steps writing snapshots to ``folder``; its run id."""
    guard = _guard(folder, _net(), snapshot_every=5, **policy)
    _train(guard, 0, steps)
    guard.close()
    run = read_run_id(folder)
    assert run is not None
    return run


def _state(net: Net) -> dict[str, torch.Tensor]:
    """Every tensor a resume would overwrite: the model's and the optimizer's state."""
    model, opt = net
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"optimizer.{i}.{k}": v.clone() for k, v in st.items()})
    return out


def assert_same_state(before: dict[str, torch.Tensor], net: Net) -> None:
    """Nothing of ``net`` changed since ``before``; names the first tensor that did."""
    after = _state(net)
    assert after.keys() == before.keys(), sorted(after.keys() ^ before.keys())
    for name, t in before.items():
        assert torch.equal(t, after[name]), f"{name} changed: {t.flatten()[:4]} -> {after[name]}"


# ------------------------------------------------------------------ another run's files
def test_a_foreign_runs_newer_snapshot_is_passed_over(tmp_path: Path) -> None:
    run_a = _run(tmp_path / "a", 16, snapshot_keep=3)  # files 5, 10, 15
    run_b = _run(tmp_path / "b", 21)  # files 15, 20
    stray = tmp_path / "a" / "snapshot-000000020.fgs"
    shutil.copy(tmp_path / "b" / "snapshot-000000020.fgs", stray)
    net = _net()
    guard = _guard(tmp_path / "a", net, snapshot_every=5)
    assert guard.resume() == 15
    (fallback,) = guard.events.of_kind("snapshot_fallback")
    assert fallback.step == 15
    assert fallback["bad"] == str(stray)
    assert fallback["error"] == (
        f"{stray}: written by run {run_b}, not by the expected run {run_a} (another run's snapshot)"
    )
    assert fallback["used"] == str(tmp_path / "a" / "snapshot-000000015.fgs")
    # the resumed guard continues run a: its next snapshot is a's (replacing the stray)
    _train(guard, 15, 21)
    assert load_snapshot(stray).run_id == run_a
    assert read_run_id(tmp_path / "a") == run_a
    guard.close()


def test_a_named_foreign_file_is_refused_unless_taken_on_purpose(tmp_path: Path) -> None:
    run_a = _run(tmp_path / "a", 11)
    run_b = _run(tmp_path / "b", 21)
    theirs = tmp_path / "b" / "snapshot-000000020.fgs"
    net = _net()
    guard = _guard(tmp_path / "a", net, snapshot_every=5)
    before = _state(net)
    with pytest.raises(ForeignSnapshotError) as ei:
        guard.resume(theirs)
    assert str(ei.value) == (
        f"{theirs}: written by run {run_b}, not by the expected run {run_a} (another run's "
        "snapshot); nothing was loaded. resume(path=..., foreign=True) takes another run's "
        "snapshot on purpose"
    )
    assert_same_state(before, net)
    assert guard.step_count == 0 and guard.events.of_kind("resume") == []
    assert guard.resume(theirs, foreign=True) == 20
    written = load_snapshot(theirs)
    for name, t in net[0].state_dict().items():
        assert torch.equal(t, written.states["model"][name]), name
    # a branch of run b taken into run a's folder: it goes on as run a
    _train(guard, 20, 21)
    assert load_snapshot(tmp_path / "a" / "snapshot-000000020.fgs").run_id == run_a
    guard.close()


def test_a_new_run_in_a_used_folder_takes_it_over_with_a_warning(tmp_path: Path) -> None:
    folder = tmp_path / "snaps"
    run_a = _run(folder, 16, snapshot_keep=3)  # files 5, 10, 15
    guard = _guard(folder, _net(), snapshot_every=5, snapshot_keep=3)
    with pytest.warns(RuntimeWarning, match="holds the snapshots of another run") as caught:
        _train(guard, 0, 1)  # no resume(): a new run
    run_b = read_run_id(folder)
    assert run_b is not None and run_b != run_a
    message = (
        f"snapshot_dir {folder} holds the snapshots of another run ({run_a}: "
        "snapshot-000000015.fgs, snapshot-000000010.fgs, snapshot-000000005.fgs); this "
        f"guard did not resume() it and starts run {run_b} there. resume() will pass over "
        "that run's files (snapshot_fallback) and they are never pruned, but a file of a "
        "step this run also snapshots is replaced: call guard.resume() to continue that "
        "run, or give a new run an empty folder"
    )
    assert [str(w.message) for w in caught] == [f"floatguard: {message}"]
    (event,) = guard.events.of_kind("warning")
    assert (event.step, event["message"]) == (0, message)
    _train(guard, 1, 7)  # files 0, 5 of run b (its 5 replaces a's)
    guard.close()
    names = sorted(p.name for p in folder.glob("snapshot-*.fgs"))
    assert names == [f"snapshot-0000000{s:02d}.fgs" for s in (0, 5, 10, 15)]
    fresh = _guard(folder, _net(), snapshot_every=5)
    assert fresh.resume() == 5
    passed = [
        (Path(e["bad"]).name, run_a in e["error"])
        for e in fresh.events.of_kind("snapshot_fallback")
    ]
    assert passed == [("snapshot-000000015.fgs", True), ("snapshot-000000010.fgs", True)]
    fresh.close()


# ---------------------------------------------------------------- snapshots that don't fit
def _wider() -> Net:
    return _net(hidden=32)


def _double() -> Net:
    model, _ = _net()
    model.double()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _deeper() -> Net:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4), nn.Linear(4, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _two_groups() -> Net:
    model, _ = _net()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return model, torch.optim.AdamW([{"params": weights}, {"params": biases}], lr=1e-2)


def _reordered() -> Net:
    model, _ = _net()
    return model, torch.optim.AdamW(list(model.parameters())[::-1], lr=1e-2)


MISFITS: list[tuple[Callable[[], Net], str]] = [
    (_wider, "model: 0.weight is (16, 8) float32 in the snapshot, (32, 8) float32 in the model"),
    (_double, "model: 0.weight is (16, 8) float32 in the snapshot, (16, 8) float64 in the model"),
    (_deeper, "model: 3.weight (4, 4) float32 is not in the snapshot"),
    (_two_groups, "optimizer: param groups: 1 in the snapshot, 2 in the optimizer"),
    (
        _reordered,
        "optimizer: state 'exp_avg' of parameter 0 is (16, 8) float32 in the snapshot; the "
        "parameter is (4,) float32",
    ),
]


@pytest.mark.parametrize(
    ("build", "why"), MISFITS, ids=["shape", "dtype", "missing", "param_groups", "moment_order"]
)
def test_a_snapshot_that_does_not_fit_is_refused_with_nothing_loaded(
    tmp_path: Path, build: Callable[[], Net], why: str
) -> None:
    folder = tmp_path / "snaps"
    _run(folder, 11)
    net = build()
    guard = _guard(folder, net)
    before = _state(net)
    with pytest.raises(SnapshotError) as ei:
        guard.resume()
    assert str(ei.value) == (
        f"{folder / 'snapshot-000000010.fgs'} does not fit: {why}; nothing was loaded (a "
        "snapshot of another model or optimizer setup)"
    )
    assert_same_state(before, net)
    assert guard.step_count == 0 and guard.events.of_kind("resume") == []
    guard.close()


def test_a_live_optimizers_state_is_checked_tensor_by_tensor(tmp_path: Path) -> None:
    folder = tmp_path / "snaps"
    _run(folder, 6)
    model, _ = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True)
    x, y = _batch(0)
    F.mse_loss(model(x), y).backward()
    opt.step()  # the live optimizer has state now: every tensor of it is compared
    opt.state[model[0].weight]["exp_avg"] = torch.zeros(16, 8, dtype=torch.float64)
    opt.zero_grad()
    guard = _guard(folder, (model, opt))
    before = _state((model, opt))
    with pytest.raises(SnapshotError, match=r"does not fit: optimizer: state 'exp_avg' of "
                       r"parameter 0 is \(16, 8\) float32 in the snapshot, \(16, 8\) float64 "
                       r"in the optimizer; nothing was loaded"):  # fmt: skip
        guard.resume()
    assert_same_state(before, (model, opt))
    guard.close()


# ----------------------------------------------------------------------- swapped files
def test_swapped_files_are_passed_over_and_a_named_one_refused(tmp_path: Path) -> None:
    folder = tmp_path / "snaps"
    _run(folder, 16, snapshot_keep=3)  # files 5, 10, 15
    ten, fifteen = folder / "snapshot-000000010.fgs", folder / "snapshot-000000015.fgs"
    a, b = ten.read_bytes(), fifteen.read_bytes()
    ten.write_bytes(b)
    fifteen.write_bytes(a)
    net = _net()
    guard = _guard(folder, net, snapshot_every=5)
    before = _state(net)
    for path in (fifteen, ten):
        for foreign in (False, True):  # foreign=True is about runs, not names
            with pytest.raises(SnapshotError) as ei:
                guard.resume(path, foreign=foreign)
            held = 10 if path == fifteen else 15
            assert str(ei.value) == (
                f"{path}: holds the snapshot of step {held}, not of step {25 - held} "
                "(renamed, or swapped with another file)"
            )
    assert_same_state(before, net)
    assert guard.resume() == 5
    events = guard.events.of_kind("snapshot_fallback")
    assert [(e.step, e["bad"], e["used"]) for e in events] == [
        (5, str(fifteen), str(folder / "snapshot-000000005.fgs")),
        (5, str(ten), str(folder / "snapshot-000000005.fgs")),
    ]
    assert events[0]["error"] == (
        f"{fifteen}: holds the snapshot of step 10, not of step 15 (renamed, or swapped "
        "with another file)"
    )
    guard.close()


# ------------------------------------------------------------------ one guard per folder
def test_a_second_guard_in_this_process_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "snaps"
    first = _guard(folder, _net())
    _train(first, 0, 3)
    assert (folder / LOCK_FILE).exists()
    net = _net()
    second = _guard(folder, net)
    before = _state(net)
    expected = (
        rf"^snapshot_dir {re.escape(str(folder))} is in use by another guard: pid "
        rf"{os.getpid()} on host {re.escape(HOST)}, since [-0-9 :]+ \(another Guard in "
        r"this process: close\(\) it first\)\. "
        r"Two guards writing one folder would prune and resume each other's snapshots: "
        r"give each run its own snapshot_dir, or close\(\) the other first$"
    )
    with pytest.raises(SnapshotFolderBusy, match=expected):
        second.resume()
    with pytest.raises(SnapshotFolderBusy, match=expected):
        _train(second, 0, 1)  # a fresh start is refused at its first snapshot write
    assert_same_state(before, net)
    assert second.step_count == 0 and all(p.grad is None for p in net[0].parameters())
    first.close()
    assert not (folder / LOCK_FILE).exists()
    assert second.resume() == 0
    _train(second, 0, 1)
    second.close()


# A guard on the folder given as argv[1], one step taken (then each script goes on).
_ONE_STEP = """
    import torch.nn.functional as F
    from torch import nn
    from floatguard import Guard, ResponsePolicy
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = Guard(model, opt, response=ResponsePolicy(snapshot_dir=sys.argv[1]))
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    guard.step(lambda: F.mse_loss(model(x), y))
"""

_HOLDER = textwrap.dedent(
    """
    import sys, torch
"""
    + _ONE_STEP
    + """    print("ready", flush=True)
    sys.stdin.read()  # hold the folder until killed
    """
)


@pytest.mark.subprocess
def test_a_guard_of_another_process_holds_the_folder_until_it_dies(tmp_path: Path) -> None:
    folder = tmp_path / "snaps"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        net = _net()
        guard = _guard(folder, net)
        before = _state(net)
        with pytest.raises(SnapshotFolderBusy) as ei:
            guard.resume()
        assert str(ei.value).startswith(
            f"snapshot_dir {folder} is in use by another guard: pid {holder.pid} on host {HOST}"
        )
        assert "this process" not in str(ei.value)
        assert_same_state(before, net)
    finally:
        holder.send_signal(signal.SIGKILL)  # killed: its lock file stays behind
        holder.wait()
    assert (folder / LOCK_FILE).exists()
    with pytest.warns(RuntimeWarning) as caught:
        assert guard.resume() == 0
    (w,) = caught
    assert str(w.message).startswith(
        f"floatguard: took over the lock of {folder} left by pid {holder.pid} on host {HOST}"
    )
    assert str(w.message).endswith("(no longer running)")
    guard.close()
    assert not (folder / LOCK_FILE).exists()


_FORKER = textwrap.dedent(
    """
    import multiprocessing, os, sys, time, torch
"""
    + _ONE_STEP
    + """    child = os.fork()
    if child == 0:
        sys.exit(0)  # a forked child that exits normally: its exit handlers run
    os.waitpid(child, 0)
    print(os.path.exists(os.path.join(sys.argv[1], "floatguard.lock")), flush=True)
    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,))
    worker.start()  # a DataLoader-like worker that outlives its parent
    print(worker.pid, flush=True)
    sys.stdin.read()
    """
)


@pytest.mark.subprocess
@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_forked_children_neither_hold_nor_remove_the_parents_lock(tmp_path: Path) -> None:
    folder = tmp_path / "snaps"
    parent = subprocess.Popen(
        [sys.executable, "-c", _FORKER, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    worker = 0
    try:
        assert parent.stdout.readline() == "True\n"  # the child's exit left the lock alone
        worker = int(parent.stdout.readline())
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        guard = _guard(folder, _net())
        with pytest.warns(RuntimeWarning, match=f"left by pid {parent.pid} on host"):
            assert guard.resume() == 0  # the orphaned worker does not hold the folder
        guard.close()
    finally:
        parent.kill()
        parent.wait()
        if worker:
            os.kill(worker, signal.SIGKILL)


# ------------------------------------------------------------------ steps past 9 digits
def test_steps_past_nine_digits_are_resumed_and_pruned(tmp_path: Path) -> None:
    folder = tmp_path / "snaps"
    guard = _guard(folder, _net(), snapshot_every=1)
    sd = guard.state_dict()
    sd["step_count"] = 999_999_998
    guard.load_state_dict(sd)
    _train(guard, 999_999_998, 1_000_000_002)
    guard.close()
    names = sorted(p.name for p in folder.glob("snapshot-*.fgs"))
    assert names == ["snapshot-1000000000.fgs", "snapshot-1000000001.fgs"]  # keep=2
    fresh = _guard(folder, _net(), snapshot_every=1)
    assert fresh.resume() == 1_000_000_001
    assert fresh.events.of_kind("snapshot_fallback") == []
    fresh.close()


# -------------------------------------------------------------------------- a full disk
def _enospc(fd: int) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("policy", ["retry", "disable"])
def test_a_full_disk_warns_once_and_the_results_say_how_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    folder = tmp_path / "snaps"
    guard = _guard(folder, _net(), snapshot_every=5, on_snapshot_error=policy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning recorded: once is the guard's doing
        assert [r.snapshot_age for r in _train(guard, 0, 1)] == [1]
        monkeypatch.setattr(os, "fsync", _enospc)  # the disk is full from here on
        ages = [r.snapshot_age for r in _train(guard, 1, 30)]
        monkeypatch.undo()
        assert ages == list(range(2, 31))  # nothing newer than step 0's snapshot on disk
        then = (
            "retried at every snapshot step; until one is written, a crash loses every step "
            "since (StepResult.snapshot_age counts them)"
            if policy == "retry"
            else "disk snapshots are off for the rest of the run"
        )
        assert [str(w.message) for w in caught] == [
            f"floatguard: cannot write the snapshot of step 5 to {folder} (OSError: [Errno "
            f"28] {os.strerror(errno.ENOSPC)}); the newest snapshot on disk is of step 0; "
            f"{then}. Rollbacks still work (in memory); further failures are "
            "snapshot_error events only"
        ]
        assert all(w.category is RuntimeWarning for w in caught)
        errors = guard.events.of_kind("snapshot_error")
        steps = [5, 10, 15, 20, 25] if policy == "retry" else [5]
        assert [(e.step, e["policy"]) for e in errors] == [(s, policy) for s in steps]
        assert {e["error"] for e in errors} == {f"OSError: [Errno 28] {os.strerror(errno.ENOSPC)}"}
        assert sorted(p.name for p in folder.iterdir()) == [
            IDENTITY_FILE, LOCK_FILE, "snapshot-000000000.fgs"
        ]  # fmt: skip
        # the disk has room again
        recovered = [r.snapshot_age for r in _train(guard, 30, 32)]
        if policy == "retry":
            assert recovered == [1, 2]  # step 30's snapshot was written
            monkeypatch.setattr(os, "fsync", _enospc)
            _train(guard, 32, 36)  # full again: a new spell of failures, warned again
            monkeypatch.undo()
            assert len(caught) == 2 and "snapshot of step 35" in str(caught[1].message)
        else:
            assert recovered == [31, 32] and len(caught) == 1
    guard.close()


def test_without_a_snapshot_dir_there_is_no_snapshot_age() -> None:
    model, opt = _net()
    guard = Guard(model, opt)
    assert [r.snapshot_age for r in _train(guard, 0, 2)] == [None, None]
    guard.close()
