"""A bad state on one rank that no step shows (finite losses and gradients) is found by
the snapshot step's state check, agreed on every rank (a count of the ranks' findings,
then their all-gather) and rolled back everywhere; 2 gloo ranks under DDP."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from floatguard.events import read_events
from floatguard.guard import Guard

from ._ranks import run_ranks
from .test_guard_stall import Net

pytestmark = pytest.mark.ranks


def _state_worker(rank: int, world: int, out: str) -> dict[str, Any]:
    """Rank 1's weight turns absurd (1e37: a flipped exponent bit) with finite losses
    and gradients: only the snapshot step's state check sees it."""
    torch.manual_seed(0)
    net = Net(buffers=False)
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(model, opt, log=os.path.join(out, f"run-rank{rank}.jsonl"))
    g = torch.Generator().manual_seed(10 + rank)
    actions = []
    for i in range(12):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        if rank == 1 and i == 8:
            with torch.no_grad():
                net.fc1.weight[0, 0] = 1e37
        actions.append(guard.step(lambda x=x, y=y: ((model(x) - y) ** 2).mean()).action)
    guard.finish()
    guard.close()
    return {"actions": actions, "params": [p.detach().clone() for p in net.parameters()]}


def test_a_bad_state_on_one_rank_found_at_a_snapshot_step_rolls_back_every_rank(
    tmp_path: Path,
) -> None:
    res = run_ranks(_state_worker, 2, tmp_path, timeout=90)
    out = next(tmp_path.glob("ranks-*"))
    assert res[0]["actions"] == res[1]["actions"]
    assert res[0]["actions"][10] == "rolled_back", res[0]["actions"]
    assert res[0]["actions"].count("rolled_back") == 1
    for a, b in zip(res[0]["params"], res[1]["params"], strict=True):
        assert torch.equal(a, b)
    assert float(res[1]["params"][0].abs().max()) < 1e3
    for rank in (0, 1):
        faults = [e for e in read_events(out / f"run-rank{rank}.jsonl") if e.kind == "fault"]
        assert [(e.step, e["fault_rank"], e["kind_of_value"]) for e in faults] == [(10, 1, "huge")]
