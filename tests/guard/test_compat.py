"""What the move into ``floatguard/guard/`` must keep: snapshots written before it resume,
and the keys of ``Guard.state_dict()`` and of a snapshot's metadata."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from floatguard import DynamicLossScaler, Guard, ResponsePolicy
from floatguard.stability.snapshot import load_snapshot

pytestmark = pytest.mark.usefixtures("guard_sync")  # every test in both sync modes

FIXTURE = Path(__file__).parent / "fixtures" / "before-the-move-step11.fgs"
# The counters snapshots have always held (written by the guard at caaec06), and the
# ones added since (the bad-data rule's).
OLD_COUNTERS = {
    "good", "consecutive_bad", "rollbacks", "transients", "rollback_streak",
    "good_since_rollback", "skip_remaining", "lr_factor", "lr_recover_from",
    "lr_recover_step", "snapshots",
}  # fmt: skip
NEW_COUNTERS = {"input_streak", "input_recent"}


def _setup() -> tuple[nn.Module, torch.optim.Optimizer, Guard]:
    # The set-up the fixture was written with (see the fixture's test below).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
    guard = Guard(model, opt, scheduler=sched, precision="bf16")
    return model, opt, guard


def test_a_snapshot_written_before_the_move_resumes() -> None:
    written = load_snapshot(FIXTURE)
    assert set(written.meta) == OLD_COUNTERS | {"step_rng"}
    model, opt, guard = _setup()
    assert guard.resume(FIXTURE) == 11
    assert guard.step_count == 11 and guard.good_steps == 10 and guard.rollbacks == 0
    for name, p in model.state_dict().items():
        assert torch.equal(p, written.states["model"][name]), name
    assert opt.state_dict()["state"][0]["step"] == written.states["optimizer"]["state"][0]["step"]
    assert guard.scheduler.last_epoch == written.states["scheduler"]["last_epoch"]
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        assert guard.step(lambda x=x, y=y: F.mse_loss(model(x).float(), y)).action == "applied"
    assert guard.step_count == 14 and guard.good_steps == 13
    guard.close()


def test_state_dict_and_snapshot_meta_keys(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = Guard(
        model, opt, precision="fp16", scaler=DynamicLossScaler(init_scale=8.0),
        response=ResponsePolicy(snapshot_dir=str(tmp_path), snapshot_every=2),
    )  # fmt: skip
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    for i in range(5):
        xi = x * math.nan if i == 1 else x
        guard.step(lambda xi=xi: F.mse_loss(model(xi).float(), y))
    sd = guard.state_dict()
    assert set(sd) == {"step_count", "counters", "scaler", "zclip", "loss_detector", "trend"}
    # a state saved before the trend watch (issue 36) has no "trend": still loaded
    older = {k: v for k, v in sd.items() if k != "trend"}
    again = Guard(model, opt, precision="fp16", scaler=DynamicLossScaler(init_scale=8.0))
    again.load_state_dict(older)
    assert again.step_count == 5
    again.close()
    assert set(sd["counters"]) == OLD_COUNTERS | NEW_COUNTERS
    assert sd["step_count"] == 5 and sd["counters"]["good"] == 4
    snap = guard.last_snapshot
    assert snap is not None
    assert set(snap.meta) == OLD_COUNTERS | NEW_COUNTERS | {"step_rng", "layout"}
    # the world it was written in (issue 38): a snapshot without it (older) still loads
    assert snap.meta["layout"] == {"world_size": 1, "meshes": []}
    # A state saved by a guard set up differently is refused by name.
    other = Guard(model, opt, spikes=None)
    del sd["loss_detector"]
    with pytest.raises(ValueError, match="loss_detector"):
        other.load_state_dict(sd)
    guard.close()
    other.close()
