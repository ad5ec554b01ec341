"""Two ranks, two faults in one step (issue 38, item 5): rank 0's fc1 and rank 1's fc2
weights turn NaN between steps. The rollback is one decision on every rank, and both
faults are events on every rank: a second bad host is not invisible."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from floatguard import Guard, read_events
from tests._ranks import run_ranks

pytestmark = pytest.mark.ranks


def _worker(rank: int, world: int, out: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    guard = Guard(ddp, opt, log=Path(out) / f"run-rank{rank}.jsonl")
    g = torch.Generator().manual_seed(rank)
    actions = []
    for step in range(8):
        if step == 6:
            with torch.no_grad():  # a bad write of each host's own
                (model[0] if rank == 0 else model[2]).weight[0, 0] = math.nan
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        actions.append(guard.step(lambda x=x, y=y: ((ddp(x) - y) ** 2).mean()).action)
    guard.close()
    return {"actions": actions}


def test_two_ranks_two_faults_two_events(tmp_path: Path) -> None:
    res = run_ranks(_worker, 2, tmp_path, timeout=120)
    assert res[0]["actions"] == res[1]["actions"]
    assert res[0]["actions"][6] == "rolled_back"
    out = next(tmp_path.glob("ranks-*"))
    for rank in (0, 1):
        faults = [e for e in read_events(out / f"run-rank{rank}.jsonl") if e.kind == "fault"]
        got = sorted((e["fault_rank"], e["module"], e["tensor"]) for e in faults)
        assert got == [(0, "0", "param:weight"), (1, "2", "param:weight")], got
        assert {e.step for e in faults} == {6}
