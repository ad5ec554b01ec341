"""Rank-consistent decisions: two gloo ranks on CPU, a fault on one rank only."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from floatguard import Guard, ResponsePolicy, SpikePolicy

pytestmark = pytest.mark.ranks


def _worker(
    rank: int, world: int, init_file: str, out_dir: str, consistent: bool, sync: str = "exact"
) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(
        model, opt, distributed=consistent, spikes=SpikePolicy(window=10, z=5.0, warmup=5),
        response=ResponsePolicy(rollback_after=10), sync=sync,  # type: ignore[arg-type]
    )  # fmt: skip
    g = torch.Generator().manual_seed(100 + rank)
    actions = []
    for step in range(16):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        if rank == 1 and step == 8:
            x = x * math.nan  # a NaN batch on rank 1 only
        if rank == 1 and step == 12:
            y = y * 1000.0  # a loss spike on rank 1 only
        guard.backward(((model(x) - y) ** 2).mean())
        actions.append(guard.step().action)
    torch.save({"actions": actions, "params": [p.detach() for p in model.parameters()]},
               os.path.join(out_dir, f"rank{rank}.pt"))  # fmt: skip
    guard.close()
    # Both ranks leave together: a rank that tears gloo down while its peer still talks
    # to it can abort the peer ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


def _run(tmp_path: Path, consistent: bool, sync: str = "exact") -> tuple[dict, dict]:  # type: ignore[type-arg]
    init = tmp_path / f"init-{consistent}-{sync}"
    out = tmp_path / f"out-{consistent}-{sync}"
    out.mkdir()
    mp.spawn(_worker, args=(2, str(init), str(out), consistent, sync), nprocs=2, join=True)
    return torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")


@pytest.mark.parametrize("sync", ["exact", "deferred"])
def test_a_fault_on_one_rank_is_a_fault_on_every_rank(tmp_path: Path, sync: str) -> None:
    r0, r1 = _run(tmp_path, consistent=True, sync=sync)
    assert r0["actions"] == r1["actions"]
    assert r0["actions"][8] == "skipped" and r0["actions"][12] == "skipped"
    assert r0["actions"].count("applied") == 14
    # Without the all-reduce, rank 0 applies the steps rank 1 skips.
    u0, u1 = _run(tmp_path, consistent=False, sync=sync)
    assert u0["actions"][8] == "applied" and u1["actions"][8] == "skipped"
