"""Repro bundles under torch.distributed: the rank whose step went bad writes its own
bundle, named with its rank; a peer that only agreed to skip writes none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from floatguard import Guard, ResponsePolicy
from floatguard.repro import load_bundle, reproduce
from tests._ranks import run_ranks
from tests.repro._scenarios import TwoBlocks

pytestmark = pytest.mark.ranks


def _worker(rank: int, world: int, out: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TwoBlocks()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    folder = Path(out) / "bundles"
    guard = Guard(ddp, opt, response=ResponsePolicy(repro_dir=folder))
    g = torch.Generator().manual_seed(10 + rank)
    actions = []
    for step in range(6):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        model.b.mode = "log" if rank == 1 and step == 3 else None
        actions.append(guard.step(lambda x=x, y=y: F.mse_loss(ddp(x), y)).action)
    guard.close()
    return {"actions": actions}


def test_the_bad_rank_writes_a_bundle_named_with_its_rank(tmp_path: Path) -> None:
    res = run_ranks(_worker, 2, tmp_path, timeout=120)
    assert res[0]["actions"] == res[1]["actions"] == ["applied"] * 3 + ["skipped"] + ["applied"] * 2
    bundles = sorted(tmp_path.glob("ranks-*/bundles/*.fgr"))
    assert [p.name[:25] for p in bundles] == ["repro-step000000003-rank1"], bundles
    b = load_bundle(bundles[0])
    assert b.payload["rank"] == 1 and b.payload["world_size"] == 2
    assert b.fault is not None and (b.fault["module"], b.fault["op"]) == ("b", "aten.log.default")
    out = reproduce(b)
    assert out.reproduced and out.found_op == "aten.log.default"
