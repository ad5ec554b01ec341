"""guard.resume() under torch.distributed, on 2 gloo ranks (CPU, loopback, DDP): the ranks
agree on the newest step every rank has a good snapshot of, each loads its own file of
it, and the run ends bit-identical to one never interrupted; when there is no such step,
or a rank cannot load its file, every rank raises the same SnapshotError and none hangs.
Every run is bounded by a hard timeout (``run_ranks``)."""

from __future__ import annotations

import math
import os
import shutil
import signal
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from floatguard import Guard, PeerFailed, ResponsePolicy, SnapshotError
from floatguard.events import read_events
from floatguard.stability.snapshot_folder import read_run_id

from ._ranks import run_ranks

pytestmark = pytest.mark.ranks

STEPS = 12  # the whole run
CUT = 9  # the interrupted run's steps: snapshots of steps 6 and 8 kept on every rank
NAN_BATCH = (1, 10)  # (rank, step): a NaN batch after the resume, skipped on every rank
TIMEOUT_S = 90.0


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of (step, rank), wherever the run starts."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
    if (rank, step) == NAN_BATCH:
        x = x * math.nan
    return x, y


def _kill_in_write(step: int) -> Any:
    """``os.replace`` that SIGKILLs this process as it is about to put the snapshot of
    ``step`` in place: its temp file is written and fsynced, the rename never happens."""
    replace = os.replace

    def maybe_die(src: Any, dst: Any) -> None:
        if Path(dst).name == f"snapshot-{step:09d}.fgs":
            os.kill(os.getpid(), signal.SIGKILL)
        replace(src, dst)

    return mock.patch.object(os, "replace", maybe_die)


def _worker(
    rank: int, world: int, out: str, root: str, steps: int, resume: Any, kill_at: int | None
) -> dict[str, Any]:
    """Train ``steps`` steps under DDP (``resume``: False, True for the rank's folder, or
    a file name in it); ``kill_at``: rank 1 is killed writing that step's snapshot."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    folder = Path(root, f"rank{rank}")
    guard = Guard(
        model, opt, log=Path(root, f"rank{rank}.jsonl"), peer_timeout_s=30.0,
        response=ResponsePolicy(snapshot_dir=str(folder), snapshot_every=2, snapshot_keep=2),
    )  # fmt: skip
    start = 0
    try:
        if resume:
            start = guard.resume(folder / resume if isinstance(resume, str) else None)
    except SnapshotError as e:
        guard.close()
        return {"resume_error": (type(e).__name__, str(e))}
    killing = _kill_in_write(kill_at) if kill_at is not None and rank == 1 else nullcontext()
    try:
        with killing:
            for i in range(start, steps):
                x, y = _batch(i, rank)
                guard.step(lambda x=x, y=y: F.mse_loss(model(x), y))
        guard.finish()
    except PeerFailed as e:
        return {"outcome": (type(e).__name__, e.ranks)}
    params = [p.detach().clone() for p in net.parameters()]
    guard.close()
    return {"start": start, "params": params}


def _run(
    root: Path, tmp: Path, steps: int, resume: Any = False, kill_at: int | None = None
) -> dict[int, Any]:
    res = run_ranks(_worker, 2, tmp, str(root), steps, resume, kill_at, timeout=TIMEOUT_S)
    for r, got in res.items():
        assert "exitcode" not in got or (kill_at is not None and r == 1), (r, got)
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, Any], Path]:
    """The uninterrupted run's results, and a folder of the interrupted run's files
    (CUT steps; every rank's snapshots of steps 6 and 8) for each test to copy."""
    tmp = tmp_path_factory.mktemp("resume-ranks")
    full = _run(tmp / "full", tmp, STEPS)
    _run(tmp / "cut", tmp, CUT)
    return full, tmp / "cut"


def _copy(cut: Path, tmp: Path) -> Path:
    root = tmp / "run"
    shutil.copytree(cut, root)
    return root


def _snap(root: Path, rank: int, step: int) -> Path:
    return root / f"rank{rank}" / f"snapshot-{step:09d}.fgs"


def assert_same_bits(got: list[torch.Tensor], ref: list[torch.Tensor], what: str) -> None:
    """Every tensor bit-identical (NaN equal to NaN); else the first element that differs."""
    assert len(got) == len(ref), what
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        ia, ib = a.view(torch.int32), b.view(torch.int32)
        if not torch.equal(ia, ib):
            j = int((ia != ib).flatten().nonzero()[0])
            raise AssertionError(
                f"{what}: tensor {i}, element {j}: {a.flatten()[j].item()!r} != "
                f"{b.flatten()[j].item()!r}"
            )


def _assert_same_as_full(full: dict[int, Any], res: dict[int, Any]) -> None:
    for r in (0, 1):
        assert_same_bits(res[r]["params"], full[r]["params"], f"rank {r} against the full run")
    assert_same_bits(res[1]["params"], res[0]["params"], "rank 1 against rank 0")


def _resume_events(root: Path, rank: int) -> list[dict[str, Any]]:
    return [
        {"step": e.step, **e.fields}
        for e in read_events(root / f"rank{rank}.jsonl")
        if e.kind in ("resume", "snapshot_fallback")
    ]


# how rank 1 lost its newest snapshot (step 8): the file it would resume from is gone,
# cut short, or has a flipped bit
LOSSES = ["deleted", "truncated", "corrupted"]


@pytest.mark.parametrize("loss", LOSSES)
def test_ranks_with_different_newest_snapshots_resume_from_the_common_step(
    runs: tuple[dict[int, Any], Path], tmp_path: Path, loss: str
) -> None:
    full, cut = runs
    root = _copy(cut, tmp_path)
    newest = _snap(root, 1, 8)
    if loss == "deleted":
        newest.unlink()
    elif loss == "truncated":
        newest.write_bytes(newest.read_bytes()[:-100])
    else:
        raw = bytearray(newest.read_bytes())
        raw[len(raw) // 2] ^= 0x04
        newest.write_bytes(bytes(raw))
    res = _run(root, tmp_path, STEPS, resume=True)
    assert res[0]["start"] == res[1]["start"] == 6
    _assert_same_as_full(full, res)
    ev0, ev1 = _resume_events(root, 0), _resume_events(root, 1)
    path0, path1 = str(_snap(root, 0, 6)), str(_snap(root, 1, 6))
    run0, run1 = read_run_id(Path(path0).parent), read_run_id(Path(path1).parent)
    assert run0 is not None and run1 is not None  # each rank's folder its own run
    assert ev0 == [{"step": 6, "from_step": 6, "path": path0, "newest_step": 8,
                    "ranks_behind": [1], "written_world_size": 2, "run_id": run0}]  # fmt: skip
    resume1 = {"step": 6, "from_step": 6, "path": path1, "newest_step": None,
               "ranks_behind": [1], "written_world_size": 2, "run_id": run1}  # fmt: skip
    if loss == "deleted":
        assert ev1 == [resume1]
    else:  # passed over, saying why
        (fallback,) = [e for e in ev1 if "bad" in e]
        assert fallback["bad"] == str(newest) and fallback["used"] == path1
        assert ("truncated" if loss == "truncated" else "corrupted") in fallback["error"]
        assert ev1[-1] == resume1


def test_a_rank_killed_inside_its_snapshot_write(
    runs: tuple[dict[int, Any], Path], tmp_path: Path
) -> None:
    """Rank 1 is SIGKILLed as it puts its snapshot of step 8 in place (the temp file
    written, the rename not done); rank 0 wrote its own and stops at the next step."""
    full, _ = runs
    root = tmp_path / "killed"
    first = _run(root, tmp_path, STEPS, kill_at=8)
    assert first[1]["exitcode"] == -signal.SIGKILL
    assert first[0]["outcome"] == ("PeerFailed", (1,))
    assert _snap(root, 0, 8).exists() and not _snap(root, 1, 8).exists()
    assert any(p.name.startswith(".snapshot-000000008.fgs.") for p in (root / "rank1").iterdir())
    res = _run(root, tmp_path, STEPS, resume=True)
    assert res[0]["start"] == res[1]["start"] == 6
    _assert_same_as_full(full, res)
    (resume0,) = [e for e in _resume_events(root, 0) if e.get("from_step") is not None]
    assert (resume0["newest_step"], resume0["ranks_behind"]) == (8, [1])


@pytest.mark.parametrize(
    "case", ["no common step", "a named file does not verify", "a rank's folder is gone"]
)
def test_a_resume_that_cannot_agree_fails_on_every_rank(
    runs: tuple[dict[int, Any], Path], tmp_path: Path, case: str
) -> None:
    _, cut = runs
    root = _copy(cut, tmp_path)
    resume: Any = True
    if case == "no common step":
        _snap(root, 0, 8).unlink()
        _snap(root, 1, 6).unlink()
    elif case == "a rank's folder is gone":
        shutil.rmtree(root / "rank1")
    else:
        resume = _snap(root, 1, 8).name
        raw = bytearray(_snap(root, 1, 8).read_bytes())
        raw[-1] ^= 0x01
        _snap(root, 1, 8).write_bytes(bytes(raw))
    res = _run(root, tmp_path, STEPS, resume=resume)  # both ranks return: no hang
    errors = {r: res[r]["resume_error"] for r in (0, 1)}
    if case == "no common step":
        for r in (0, 1):
            name, msg = errors[r]
            assert name == "SnapshotError"
            assert msg.startswith(
                f"guard.resume() on rank {r}: no step has a good snapshot on every rank (the "
                "good snapshots' steps, newest first: rank 0: 6; rank 1: 8); nothing was "
                "loaded on any rank"
            )
    elif case == "a rank's folder is gone":  # a SnapshotError on every rank, also its own
        name, msg = errors[1]
        assert name == "SnapshotError"
        assert msg.startswith("guard.resume() on rank 1 cannot resume (FileNotFoundError: ")
        name, msg = errors[0]
        assert name == "SnapshotError"
        assert msg.startswith("guard.resume() on rank 0: rank 1 cannot resume (FileNotFoundError")
    else:
        name, msg = errors[1]  # its own error, as without torch.distributed
        assert name == "SnapshotError" and "corrupted snapshot" in msg
        name, msg = errors[0]
        assert name == "SnapshotError"
        assert msg.startswith("guard.resume() on rank 0: rank 1 cannot resume (SnapshotError: ")
        assert "corrupted snapshot" in msg and msg.endswith("nothing was loaded on any rank")
    for r in (0, 1):  # nothing of the run was touched
        assert [e for e in _resume_events(root, r) if e.get("from_step") is not None] == []


def _one_resumes(rank: int, world: int, out: str, root: str) -> dict[str, Any]:
    """Only rank 0 calls resume(); rank 1 waits until rank 0 gave up."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    folder = Path(root, f"rank{rank}")
    guard = Guard(
        net, opt, peer_timeout_s=2.0,
        response=ResponsePolicy(snapshot_dir=str(folder), snapshot_every=2, snapshot_keep=2),
    )  # fmt: skip
    if rank == 0:
        try:
            guard.resume()
        except PeerFailed as e:
            Path(out, "gave-up").touch()
            return {"outcome": (type(e).__name__, str(e))}
        return {"outcome": None}
    while not Path(out, "gave-up").exists():
        time.sleep(0.02)
    return {"outcome": "waited"}


def test_resume_on_one_rank_only_says_it_is_collective(
    runs: tuple[dict[int, Any], Path], tmp_path: Path
) -> None:
    _, cut = runs
    root = _copy(cut, tmp_path)
    res = run_ranks(_one_resumes, 2, tmp_path, str(root), timeout=60)
    name, msg = res[0]["outcome"]
    assert name == "PeerFailed"
    assert "(before the first guard step)" in msg and "guard step -1" not in msg
    assert "guard.resume() runs on every rank together: call it on every rank or on none" in msg
