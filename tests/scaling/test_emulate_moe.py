"""Grouped GEMMs of mixture-of-experts layers (issue 42 item 3): emulated expert by
expert, equal to the same experts written as separate nn.Linear layers under the same
recipe (the dense emulation is itself tested against TE, OCP MX and DeepGEMM
references), through ``torch._grouped_mm`` and through the per-expert ``F.linear``
loop; their FLOPs counted by the coverage audit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from floatguard.emulation import EmulationRecipe, coverage, emulate, restore

D, H, E = 32, 48, 4


class MoE(nn.Module):
    """A torchtitan-style MoE layer: top-1 routing, tokens sorted by expert, two grouped
    GEMMs with ``offs``; ``loop=True``: the per-expert F.linear loop instead."""

    def __init__(self, loop: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(D, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, H, D) * 0.2)  # [E, out, in]
        self.w2 = nn.Parameter(torch.randn(E, D, H) * 0.2)
        with torch.no_grad():  # experts of very different magnitudes: per-expert scales
            self.w1[1] *= 40
            self.w2[2] *= 1e-3
        self.loop = loop

    def route(self, x: torch.Tensor) -> torch.Tensor:
        top = self.router(x).argmax(-1)
        top[:3] = 0  # expert 3 gets no token
        return torch.where(top == 3, torch.zeros_like(top), top)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top = self.route(x)
        order = torch.argsort(top, stable=True)
        xs = x[order]
        counts = torch.bincount(top, minlength=E)
        if self.loop:
            outs, start = [], 0
            for e, n in enumerate(counts.tolist()):
                h = torch.relu(F.linear(xs[start : start + n], self.w1[e]))
                outs.append(F.linear(h, self.w2[e]))
                start += n
            y = torch.cat(outs)
        else:
            offs = torch.cumsum(counts, 0).to(torch.int32)
            h = torch.relu(torch._grouped_mm(xs, self.w1.transpose(-2, -1), offs=offs))
            y = torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)
        out = torch.empty_like(y)
        out[order] = y
        return out


class Dense(nn.Module):
    """The same experts as separate nn.Linear layers, applied to each expert's tokens."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.moe = [moe]
        self.up = nn.ModuleList(nn.Linear(D, H, bias=False) for _ in range(E))
        self.down = nn.ModuleList(nn.Linear(H, D, bias=False) for _ in range(E))
        with torch.no_grad():
            for e in range(E):
                self.up[e].weight.copy_(moe.w1[e])
                self.down[e].weight.copy_(moe.w2[e])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top = self.moe[0].route(x)
        out = torch.zeros(x.shape[0], D)
        for e in range(E):
            idx = (top == e).nonzero().squeeze(1)
            out[idx] = self.down[e](torch.relu(self.up[e](x[idx])))
        return out


RECIPES = {
    "hybrid_tensorwise": EmulationRecipe.hybrid_tensorwise,
    "mxfp8": EmulationRecipe.mxfp8,
    "hybrid_block": EmulationRecipe.hybrid_block,
    "nvfp4_training": lambda: EmulationRecipe.nvfp4_training(stochastic=False, skip=()),
    "torchao_rowwise": EmulationRecipe.torchao_rowwise,
}


def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(45, D, generator=g)


def run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = model(x)
    g = torch.Generator().manual_seed(4)
    (y * torch.randn(y.shape, generator=g)).sum().backward()
    return y.detach()


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("loop", [False, True], ids=["grouped_mm", "F.linear loop"])
def test_a_grouped_gemm_is_the_experts_as_dense_layers(name: str, loop: bool) -> None:
    recipe = RECIPES[name]()
    moe = MoE(loop)
    dense = Dense(moe)
    cov = emulate(moe, recipe)
    assert "w1" in cov and "w2" in cov
    emulate(dense, recipe)
    x = tokens()
    y = run(moe, x)
    want = run(dense, x)
    assert torch.equal(y, want)
    assert moe.w1.grad is not None and moe.w2.grad is not None
    assert torch.equal(moe.w1.grad, torch.stack([m.weight.grad for m in dense.up]))  # type: ignore[misc]
    assert torch.equal(moe.w2.grad, torch.stack([m.weight.grad for m in dense.down]))  # type: ignore[misc]
    assert not moe.w1.grad[3].any()  # the expert with no token
    # and emulated: not the high-precision product
    plain = MoE(loop)
    assert not torch.equal(run(plain, x), y)


def test_skip_keeps_experts_in_high_precision_and_restore_undoes_it() -> None:
    moe = MoE()
    cov = emulate(moe, EmulationRecipe.mxfp8(), skip=("router",))
    assert list(cov) == ["w1", "w2"]  # the router is skipped, the experts are not
    x = tokens()
    emulated = run(moe, x)
    assert sorted(restore(moe)) == ["w1", "w2"]
    assert torch.equal(run(moe, x), run(MoE(), x)) and not torch.equal(emulated, run(MoE(), x))
    kept = MoE()
    # the root owns w1 and w2: a predicate naming "" keeps them (and the router) as they are
    cov = emulate(
        kept, EmulationRecipe.mxfp8(), skip=lambda n, m: n in ("", "router"), attention=True
    )
    assert cov.left["grouped GEMM"] == ["w1", "w2"] and list(cov) == []
    assert torch.equal(run(kept, x), run(MoE(), x))


def test_the_coverage_audit_counts_grouped_gemm_flops() -> None:
    x = tokens()
    plain = coverage(MoE(), x, None, loss_fn=lambda m, b: m(b).square().mean(), backward=False)
    m_tokens = x.shape[0]
    # router 2*M*D*E, then both grouped GEMMs over every routed token: 2*M*D*H each
    assert plain.total_flops == 2 * m_tokens * D * E + 2 * (2 * m_tokens * D * H)
    assert plain.by_op()["aten._grouped_mm"].total == 4 * m_tokens * D * H
    assert "aten._grouped_mm" not in dict(plain.unmeasured)
    emu = coverage(MoE(), x, EmulationRecipe.mxfp8(), loss_fn=lambda m, b: m(b).square().mean())
    assert emu.share == 1.0, emu.summary()


def test_a_bad_grouped_call_is_named() -> None:
    from floatguard.emulation._grouped import emulated_grouped_mm

    r: Any = EmulationRecipe.mxfp8()
    with pytest.raises(ValueError, match="needs offs"):
        emulated_grouped_mm(torch.ones(4, 32), torch.ones(2, 32, 8), recipe=r)
    with pytest.raises(ValueError, match="offs has 3 groups, mat_b 2 experts"):
        emulated_grouped_mm(torch.ones(4, 32), torch.ones(2, 32, 8),
                            offs=torch.tensor([1, 2, 4], dtype=torch.int32), recipe=r)  # fmt: skip


def test_a_transformers_moe_is_emulated_in_both_experts_implementations() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32,
    )  # fmt: skip
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = {}
    for impl in ("grouped_mm", "eager"):
        torch.manual_seed(0)
        model = transformers.MixtralForCausalLM(cfg)
        model.set_experts_implementation(impl)
        plain = float(model(input_ids=ids, labels=ids).loss.detach())
        audit = coverage(model, {"input_ids": ids, "labels": ids}, EmulationRecipe.mxfp8())
        experts = audit.by_module()["model.layers.0.mlp.experts"]
        assert experts.emulated == experts.total > 0, audit.summary()
        cov = emulate(model, EmulationRecipe.mxfp8())
        assert "model.layers.0.mlp.experts.gate_up_proj" in cov
        losses[impl] = float(model(input_ids=ids, labels=ids).loss.detach())
        assert losses[impl] != plain
    assert losses["grouped_mm"] == pytest.approx(losses["eager"], rel=1e-6)
