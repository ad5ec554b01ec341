"""The demo GPT and its synthetic task: shapes, validation, and that it learns."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from floatguard.demo import GPT, GPTConfig, synthetic_batch


def test_shapes_and_learning() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(60):
        x, y = synthetic_batch(cfg, 16, generator=g)
        assert x.shape == y.shape == (16, 16)
        assert torch.equal(x[:, 1:], y[:, :-1])
        logits = model(x)
        assert logits.shape == (16, 16, 32)
        loss = F.cross_entropy(logits.reshape(-1, 32), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="n_embd=30 must be divisible by n_head=4"):
        GPTConfig(n_embd=30)
    with pytest.raises(ValueError, match=r"GPTConfig\.n_layer=0"):
        GPTConfig(n_layer=0)
    with pytest.raises(ValueError, match="exceeds block_size"):
        GPT(GPTConfig(block_size=4, n_embd=8, n_head=2))(torch.zeros(1, 5, dtype=torch.long))
