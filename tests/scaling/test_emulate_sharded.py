"""Scales of sharded tensors: tensor parallelism (DTensor, torch's ColwiseParallel /
RowwiseParallel) with and without the amax reduction, and FSDP2, on 2 gloo ranks.

The reference is the unsharded model emulated in one process with the same recipe:
tensor-wise scales are the whole tensor's (Transformer Engine reduces the amax over its
``amax_reduction_group``; torchao's tensor-wise Float8 on DTensor computes the amax of
the DTensor, a global reduction; torchao's FSDP2 FP8 all-gather casts each shard with
the scale of the whole weight, which equals casting the gathered weight with it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from floatguard.emulation import EmulationRecipe, emulate

from .._ranks import run_ranks


def net() -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    with torch.no_grad():  # the shards' amaxes differ: rank 1's half of each weight is big
        m[0].weight[16:] *= 16
        m[2].weight[:, 16:] *= 16
    return m


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(6, 16, generator=g), torch.randn(6, 8, generator=g)


def reference() -> dict[str, torch.Tensor]:
    m = net()
    emulate(m, EmulationRecipe.hybrid_tensorwise())
    x, r = batch()
    out = m(x)
    (out * r).sum().backward()
    return {"out": out.detach(), "g0": m[0].weight.grad, "g2": m[2].weight.grad}


def _tp(rank: int, world: int, out: str, reduce: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    m = net()
    parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    group = mesh.get_group() if reduce else None
    emulate(m, EmulationRecipe.hybrid_tensorwise(), amax_group=group)
    x, r = batch()
    y = m(x)
    (y * r).sum().backward()
    return {
        "out": torch.as_tensor(y).detach().clone(),
        "g0": m[0].weight.grad.to_local().clone(),
        "g2": m[2].weight.grad.to_local().clone(),
    }


def _fsdp(rank: int, world: int, out: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    m = net()
    emulate(m, EmulationRecipe.hybrid_tensorwise())
    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    x, r = batch()
    y = m(x)
    (y * r).sum().backward()
    return {
        "out": y.detach().clone(),
        "g0": m[0].weight.grad.full_tensor().clone(),
        "g2": m[2].weight.grad.full_tensor().clone(),
    }


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.ranks
def test_tensor_parallel_shards_get_the_whole_tensors_scale_with_the_reduction(
    tmp_path: Path,
) -> None:
    ref = reference()
    glob = run_ranks(_tp, 2, tmp_path, True)
    local = run_ranks(_tp, 2, tmp_path, False)
    for rank in (0, 1):
        assert "out" in glob[rank] and "out" in local[rank], (glob[rank], local[rank])
        cols = slice(16 * rank, 16 * rank + 16)
        g, loc = glob[rank], local[rank]
        # with the amax reduction: the unsharded emulation (up to the order of the
        # row-parallel partial sums)
        torch.testing.assert_close(g["out"], ref["out"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g["g0"], ref["g0"][cols], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g["g2"], ref["g2"][:, cols], rtol=1e-5, atol=1e-5)
        # without it each shard is scaled from its own amax (rank 0's small shards on a
        # finer grid than the whole tensor's scale gives): the output moves on both ranks
        assert rel(loc["out"], ref["out"]) > 1e-4
        assert rel(loc["out"], ref["out"]) > 10 * rel(g["out"], ref["out"])


@pytest.mark.ranks
def test_fsdp2_sees_the_gathered_weight_and_its_global_scale(tmp_path: Path) -> None:
    ref = reference()
    res = run_ranks(_fsdp, 2, tmp_path)
    for rank in (0, 1):
        assert "out" in res[rank], res[rank]
        torch.testing.assert_close(res[rank]["out"], ref["out"], rtol=0, atol=0)
        # FSDP2 averages the gradients over the ranks: both saw the same batch
        torch.testing.assert_close(res[rank]["g0"], ref["g0"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(res[rank]["g2"], ref["g2"], rtol=1e-6, atol=1e-7)
