"""Guard(sync="deferred") under torch.distributed (2 gloo ranks): the device verdict is
made from the same reduced read on every rank (the guard's all-reduce, or the read
carried on DDP's gradient all-reduce), so every rank gates alike; settled a call later,
the decisions, causes and weights equal the exact mode's, and no rank reads the device
on a deferred step."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from floatguard import Guard, ResponsePolicy, SpikePolicy
from floatguard.guard.deferred import PendingResult

from ._ranks import run_ranks
from .test_guard_deferred import host_reads

pytestmark = pytest.mark.ranks


def _train(rank: int, world: int, out: str, sync: str, ddp: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    guard = Guard(model, opt, sync=sync, spikes=SpikePolicy(window=10, z=5.0, warmup=5),  # type: ignore[arg-type]
                  response=ResponsePolicy(rollback_after=3))  # fmt: skip
    g = torch.Generator().manual_seed(100 + rank)
    steps, reads = [], []
    for step in range(18):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        if rank == 1 and step in (8, 13):
            x = x * math.nan  # a NaN batch on rank 1 only
        if rank == 0 and step == 11:
            y = y * 1000.0  # a loss spike on rank 0 only
        with host_reads() as log:
            r = guard.step(lambda x=x, y=y: ((model(x) - y) ** 2).mean())
        reads.append(sum(who.startswith("floatguard") for _, who in log))
        steps.append(r)
    guard.finish()
    guard.close()
    return {
        "deferred": sum(isinstance(r, PendingResult) for r in steps),
        "steps": [(r.step, r.action, r.reason) for r in steps],
        "params": [p.detach().clone() for p in model.parameters()],
        "reads": reads,
    }


@pytest.mark.parametrize("ddp", [False, True], ids=["all-reduce", "DDP"])
def test_deferred_ranks_decide_what_exact_ranks_decide(tmp_path: Path, ddp: bool) -> None:
    exact = run_ranks(_train, 2, tmp_path, "exact", ddp)
    deferred = run_ranks(_train, 2, tmp_path, "deferred", ddp)
    for rank in (0, 1):
        assert "steps" in exact[rank] and "steps" in deferred[rank], (exact[rank], deferred[rank])
        assert deferred[rank]["steps"] == exact[rank]["steps"]
        for a, b in zip(exact[rank]["params"], deferred[rank]["params"], strict=True):
            assert torch.equal(a, b)
    assert deferred[0]["steps"] == deferred[1]["steps"]
    actions = [a for _, a, _ in exact[0]["steps"]]
    assert actions[8] == "skipped" and actions[11] == "skipped" and actions[13] == "skipped"
    # The deferred run makes no read on the steps it runs deferred, and every other read
    # of the exact run (a bad step's localization and agreement, read when it settles a
    # call later; a spike's replay; a snapshot step's vetting): exactly one read fewer
    # per deferred step.
    for rank in (0, 1):
        reads, exact_reads = deferred[rank]["reads"], exact[rank]["reads"]
        n = deferred[rank]["deferred"]
        assert n >= 12 and reads.count(0) >= 10, reads
        assert sum(reads) == sum(exact_reads) - n, (reads, exact_reads)


def _tp_run(rank: int, world: int, out: str, layout: str) -> dict[str, Any]:
    """The tensor-parallel fault run (a NaN batch on rank 1, a NaN in rank 1's piece of
    a weight) in both modes, from the same build: actions and full weights."""
    from .test_guard_tensor_parallel import _batch, _build, _full

    runs = {}
    for sync in ("exact", "deferred"):
        model, seed = _build(layout, rank)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        guard = Guard(model, opt, sync=sync, response=ResponsePolicy(snapshot_every=2))  # type: ignore[arg-type]
        g = torch.Generator().manual_seed(seed)
        for step in range(9):
            x, y = _batch(layout, g, rank)
            if rank == 1 and step == 3:
                x[0, 0] = math.nan
            if rank == 1 and step == 6:
                with torch.no_grad():
                    model.up.weight.to_local()[0, 0] = math.nan  # type: ignore[operator]
            guard.step(lambda x=x, y=y, m=model: ((m(x) - y) ** 2).mean())
        guard.finish()
        guard.close()
        runs[sync] = (
            [(e.step, e["action"], e["reason"]) for e in guard.events.of_kind("step")],
            [_full(t) for t in [*model.parameters(), *model.buffers()]],
        )
    return runs


@pytest.mark.parametrize(("layout", "world"), [("tp", 2), ("2d", 4)], ids=["tp-1d", "dp-x-tp"])
def test_deferred_tensor_parallel_ranks_decide_what_exact_ranks_decide(
    tmp_path: Path, layout: str, world: int
) -> None:
    """DTensor parameters and buffers (TP, DP x TP): the copies, the gate and the undo go
    through their local parts (a foreach over DTensors and plain tensors mixed was
    refused by torch); the same actions and full weights as the exact mode, bit for bit."""
    res = run_ranks(_tp_run, world, tmp_path, layout, timeout=180)
    assert all("exact" in res[r] for r in range(world)), res
    for r in range(world):
        exact, deferred = res[r]["exact"], res[r]["deferred"]
        assert deferred[0] == exact[0] == res[0]["exact"][0]
        assert {a for _, a, _ in exact[0]} == {"applied", "skipped", "rolled_back"}
        assert all(torch.equal(a, b) for a, b in zip(exact[1], deferred[1], strict=True))
