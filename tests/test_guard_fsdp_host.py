"""FSDP2 shards on the host snapshot path (issue 26.1): each rank keeps its own shard in
host buffers (no DTensor copy left on the device), reused in place; a rollback rebuilds
the DTensors bit-exactly with their placements; a snapshot written to disk from them
resumes."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from floatguard import Guard, ResponsePolicy
from floatguard.stability._host_copy import HostShard

from ._ranks import run_ranks
from .test_distributed_ranks import Net

pytestmark = pytest.mark.ranks


def _leaves(v: Any) -> list[Any]:
    if isinstance(v, dict):
        return [y for x in v.values() for y in _leaves(x)]
    if isinstance(v, (list, tuple)):
        return [y for x in v for y in _leaves(x)]
    return [v]


def _worker(rank: int, world: int, out: str) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = Net()
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    folder = os.path.join(out, f"snapshots-rank{rank}")
    policy = ResponsePolicy(snapshot_every=2, snapshot_on="host", snapshot_dir=folder)
    model, opt = build()
    guard = Guard(model, opt, response=policy)
    g = torch.Generator().manual_seed(10 + rank)
    batches = [(torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)) for _ in range(9)]
    actions, buffers, kept, rolled_ok = [], [], {}, False
    for step, (x, y) in enumerate(batches):
        if step == 6 and rank == 1:
            with torch.no_grad():  # this rank's shard of a weight goes bad
                model.fc1.weight.to_local()[0, 0] = math.nan  # type: ignore[operator]
        if step == 6:
            snap = guard.last_snapshot
            assert snap is not None
            kept = {k: v.local.clone() for k, v in snap.states["model"].items()}
        r = guard.step(lambda x=x, y=y: ((model(x) - y) ** 2).mean())
        actions.append((r.action, r.reason))
        if step == 6:  # rolled back: every shard as the snapshot kept it, a DTensor again
            back = dict(model.named_parameters())
            rolled_ok = all(
                isinstance(back[k], DTensor) and torch.equal(back[k].to_local(), v)
                for k, v in kept.items()
            )
        snap = guard.last_snapshot
        assert snap is not None and snap.on == "host"
        buffers.append([s.local.data_ptr() for s in snap.states["model"].values()])
    leaves = _leaves(guard.last_snapshot.states)  # type: ignore[union-attr]
    shards = [v for v in leaves if isinstance(v, HostShard)]
    # the model's parameters and the moments: every one a host shard, no DTensor kept
    no_dtensor = not any(isinstance(v, DTensor) for v in leaves)
    host_only = all(s.local.device.type == "cpu" for s in shards)
    restored_ok = placements_ok = True
    guard.close()
    # A fresh run resumes from the newest snapshot on disk (written from host shards).
    model2, opt2 = build()
    guard2 = Guard(model2, opt2, response=policy)
    resumed_at = guard2.resume()
    snap = guard.last_snapshot
    assert snap is not None
    for name, p in model2.named_parameters():
        assert isinstance(p, DTensor)
        placements_ok &= tuple(p.placements) == snap.states["model"][name].placements
        restored_ok &= torch.equal(p.to_local(), snap.states["model"][name].local)
    guard2_state = guard2.step(lambda: ((model2(batches[0][0]) - batches[0][1]) ** 2).mean())
    guard2.close()
    return {
        "actions": actions,
        "shards": len(shards),
        "no_dtensor": no_dtensor,
        "host_only": host_only,
        # (the first snapshot, before step 0, has no moments yet: the next one is new)
        "reused": all(b == buffers[2] for b in buffers[2:]),
        "kept_rows": {k: v.shape[0] for k, v in kept.items()},
        "resumed_at": resumed_at,
        "last_snapshot": snap.step,
        "resumed_ok": restored_ok and placements_ok,
        "rolled_ok": rolled_ok,
        "after_resume": guard2_state.action,
    }


def test_fsdp2_shards_live_on_the_host_and_roll_back_and_resume(tmp_path: Path) -> None:
    res = run_ranks(_worker, 2, tmp_path, timeout=240)
    assert "actions" in res[0] and "actions" in res[1], res
    a, b = res[0], res[1]
    assert a["actions"] == b["actions"]
    assert a["actions"][6] == ("rolled_back", "nonfinite_param")
    assert all(act == ("applied", None) for i, act in enumerate(a["actions"]) if i != 6)
    for r in (a, b):
        # 4 parameters, and AdamW's two moments of each: 12 shards, all in host memory
        assert r["shards"] == 12 and r["no_dtensor"] and r["host_only"]
        assert r["reused"]  # the same host buffers at every snapshot
        assert r["rolled_ok"]  # bit-exact, on every rank
        assert r["resumed_ok"] and r["after_resume"] == "applied"
    assert a["resumed_at"] == b["resumed_at"] == a["last_snapshot"] == b["last_snapshot"]
    # each rank kept its own rows of every parameter (dim-0 shards), together all of them
    rows = {k: a["kept_rows"][k] + b["kept_rows"][k] for k in a["kept_rows"]}
    assert rows == {"fc1.weight": 16, "fc1.bias": 16, "fc2.weight": 1, "fc2.bias": 1}
    assert a["kept_rows"]["fc1.weight"] == b["kept_rows"]["fc1.weight"] == 8
