"""MasterWeights: fp32 masters for half models, every parameter written back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from floatguard import MasterWeights


def test_matches_fp32_training_and_writes_every_param_back() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    half = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    half.load_state_dict(ref.state_dict())
    half = half.to(torch.bfloat16)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    mw = MasterWeights(torch.optim.SGD(half.parameters(), lr=0.1))
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    for _ in range(20):
        ref_opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ref_opt.step()
        mw.zero_grad()
        ((half(x.bfloat16()).float() - y) ** 2).mean().backward()
        mw.step()
    for p_ref, p_half, (_, m) in zip(ref.parameters(), half.parameters(), mw.pairs, strict=True):
        assert torch.equal(p_half, m.to(torch.bfloat16))  # every parameter written back
        assert torch.allclose(m, p_ref, atol=2e-2)
        assert m.dtype == torch.float32


def test_tiny_updates_survive_only_with_masters() -> None:
    """An update below half a bf16 ulp vanishes when applied to bf16 weights directly."""
    w = nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
    opt = torch.optim.SGD([w], lr=1e-4)
    for _ in range(10):
        w.grad = torch.ones_like(w)
        opt.step()
    assert bool((w == 1).all())  # 1 - 1e-4 rounds back to 1 in bf16 every time
    v = nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
    mw = MasterWeights(
        torch.optim.SGD([v], lr=1e-4),
        stochastic_rounding=True,
        generator=torch.Generator().manual_seed(0),
    )
    for _ in range(10):
        v.grad = torch.ones_like(v)
        mw.step()
    master = mw.pairs[0][1]
    assert torch.allclose(master, torch.full_like(master, 1 - 1e-3))
    assert (
        abs(float(v.detach().float().mean()) - (1 - 1e-3)) < 2e-4
    )  # stochastic rounding: unbiased


def test_errors() -> None:
    with pytest.raises(ValueError, match="no float16/bfloat16 parameters"):
        MasterWeights(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"needs a torch.optim.Optimizer"):
        MasterWeights([1])  # type: ignore[arg-type]
