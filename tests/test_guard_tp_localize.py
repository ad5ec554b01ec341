"""Localizing a forward NaN under tensor parallelism (2 gloo ranks, CPU): a NaN born on
rank 1 reaches rank 0 through RowwiseParallel's all-reduce (a functional collective,
wrapped in an AsyncCollectiveTensor, then the local part of DTensors). Rank 0's replay
must take neither the delivered value nor what DTensor ops compute from it for the
step's data: every rank names rank 1's birth, in ``mlp1.act``'s forward."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from floatguard import Guard

from ._ranks import run_ranks

pytestmark = pytest.mark.ranks


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.act = nn.Tanh()
        self.proj = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class _Net(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.mlps = depth
        self.mlp1 = _MLP()
        self.mlp2 = _MLP()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mlp1(x)
        if self.mlps == 2:
            h = self.mlp2(h)
        return self.head(h)


def _two_mlps(rank: int, world: int, out: str, depth: int) -> list[Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = _Net(depth)
    plan: dict[str, Any] = {}
    for i in (1, 2):
        plan[f"mlp{i}.fc"] = ColwiseParallel()
        plan[f"mlp{i}.proj"] = RowwiseParallel()
    parallelize_module(model, init_device_mesh("cpu", (world,)), plan)
    poison = {"on": False}

    def hook(m: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        if not poison["on"]:
            return output
        mask = torch.ones_like(output)
        mask.view(-1)[0] = math.nan
        return output * mask  # born here, on the last rank only

    model.mlp1.act.register_forward_hook(hook)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.01))
    seen = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        poison["on"] = rank == world - 1 and step == 1
        r = guard.step(lambda x=x, y=y: ((model(x) - y) ** 2).mean())
        f = r.fault
        fault = (
            None if f is None else (f.rank, f.module, f.tensor, f.phase, f.source, f.deterministic)
        )
        seen.append((r.action, r.reason, fault))
    guard.finish()
    guard.close()
    return seen


def test_tp_forward_nan_through_all_reduce_is_named_on_its_rank(tmp_path: Path) -> None:
    """Two stacked column/row MLPs: rank 0 runs the second on the NaN rank 1's first one
    made; before the fix rank 0 claimed it as its data ('input', nonfinite_input)."""
    res = run_ranks(_two_mlps, 2, tmp_path, 2, timeout=60)
    for rank in (0, 1):
        steps = res[rank]
        assert steps[0][0] == "applied" and steps[2][0] == "applied", (rank, steps)
        action, reason, fault = steps[1]
        assert (action, reason) == ("skipped", "nonfinite_loss"), (rank, steps[1])
        assert fault is not None, rank
        assert fault[:4] == (1, "mlp1.act", "output", "forward"), (rank, fault)
        # the hook's line that wrote the NaN into the mask; reproduced by the replay
        assert fault[4] is not None and "mask.view(-1)[0] = math.nan" in fault[4], (rank, fault)
        assert fault[5] is True, (rank, fault)
    assert res[0][1] == res[1][1]


def _reduced_batch(rank: int, world: int, out: str) -> list[Any]:
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1))
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.01))
    group = dist.group.WORLD
    seen = []
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        if rank == 1 and step == 1:
            x[0, 0] = math.nan  # this rank's data
        r = guard.step(
            lambda x=x: model(funcol.wait_tensor(funcol.all_reduce(x, "sum", group))).mean()
        )
        f = r.fault
        seen.append((r.action, r.reason, None if f is None else (f.rank, f.phase)))
    guard.finish()
    guard.close()
    return seen


def test_nan_data_all_reduced_into_the_model_is_the_data_of_its_rank(tmp_path: Path) -> None:
    """A NaN in rank 1's batch, summed over the ranks before the model: the batch every
    rank's model gets holds it, but it is rank 1's data (read by the all-reduce, which
    no op made), not rank 0's: one bad batch, on rank 1."""
    res = run_ranks(_reduced_batch, 2, tmp_path, timeout=60)
    for rank in (0, 1):
        assert res[rank][0][0] == "applied", (rank, res[rank])
        assert res[rank][1] == ("skipped", "nonfinite_input", (1, "input")), (rank, res[rank])
