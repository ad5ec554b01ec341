"""Resuming in another world (issue 38, item 4): FSDP2 shards written by 2 ranks are
refused on 1 before anything is touched, naming both worlds; a DDP snapshot written by
2 ranks resumes on 1, and the ``resume`` event says who wrote it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from floatguard import Guard, ResponsePolicy, SnapshotError, read_events

from ._ranks import run_ranks
from .test_distributed_ranks import Net

pytestmark = pytest.mark.ranks


def _write(rank: int, world: int, out: str, kind: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model: nn.Module = Net()
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    folder = os.path.join(out, f"snapshots-rank{rank}")
    guard = Guard(model, opt, response=ResponsePolicy(snapshot_every=2, snapshot_dir=folder))
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        x = torch.randn(8, 6, generator=g)
        guard.step(lambda x=x: model(x).pow(2).mean())
    guard.close()
    return {"folder": folder}


def _resume(rank: int, world: int, out: str, kind: str, folder: str) -> dict[str, Any]:
    torch.manual_seed(1)
    model: nn.Module = Net()
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone()
              for p in model.parameters()]  # fmt: skip
    log = os.path.join(out, "resume.jsonl")
    guard = Guard(model, opt, log=log, response=ResponsePolicy(snapshot_dir=folder))
    error = None
    try:
        step = guard.resume()
    except SnapshotError as e:
        error, step = str(e), None
    after = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
             for p in model.parameters()]  # fmt: skip
    guard.close()
    untouched = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    resumes = [dict(e.fields) for e in read_events(log) if e.kind == "resume"]
    return {"error": error, "step": step, "untouched": untouched, "resumes": resumes}


def _copy_of_rank0(tmp: Path, kind: str) -> str:
    res = run_ranks(_write, 2, tmp / "write", kind, timeout=120)
    return str(res[0]["folder"])


def test_fsdp2_shards_of_two_ranks_are_refused_on_one(tmp_path: Path) -> None:
    (tmp_path / "write").mkdir()
    folder = _copy_of_rank0(tmp_path, "fsdp")
    (tmp_path / "resume").mkdir()
    res = run_ranks(_resume, 1, tmp_path / "resume", "fsdp", folder, timeout=120)[0]
    assert res["step"] is None and res["untouched"], res
    err = res["error"]
    assert "was written by 2 rank(s) on mesh (2,)" in err, err
    assert "this run has 1 rank(s) on mesh (1,)" in err and "nothing was loaded" in err
    assert "torch.distributed.checkpoint" in err


def test_a_ddp_snapshot_of_two_ranks_resumes_on_one_and_says_so(tmp_path: Path) -> None:
    (tmp_path / "write").mkdir()
    folder = _copy_of_rank0(tmp_path, "ddp")
    (tmp_path / "resume").mkdir()
    res = run_ranks(_resume, 1, tmp_path / "resume", "ddp", folder, timeout=120)[0]
    assert res["error"] is None and res["step"] == 4, res
    (ev,) = res["resumes"]
    assert ev["written_world_size"] == 2 and ev["from_step"] == 4
