"""A reproducible tiny training run (for the FP8 emulation test, benchmark and demo)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from floatguard.demo.model import GPT, GPTConfig, synthetic_batch
from floatguard.emulation.fake_quant import EmulationRecipe, emulate

__all__ = ["TINY", "train_tiny"]

TINY = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=64)
"""The tiny GPT of the emulation test: 2 layers, d=64, T=32."""


def train_tiny(
    recipe: EmulationRecipe | None = None,
    *,
    steps: int = 300,
    seed: int = 0,
    cfg: GPTConfig = TINY,
    batch: int = 16,
    lr: float = 3e-3,
    precision: torch.dtype | None = None,
    attention: bool = False,
) -> float:
    """Train the tiny GPT for ``steps`` (AdamW, 30-step warmup, linear decay), optionally
    under an emulated recipe (the LM head stays in high precision, as DeepSeek-V3 keeps it)
    or bf16 autocast (``precision=torch.bfloat16``); ``attention``: emulate the SDPA
    matmuls too (see :func:`~floatguard.emulation.emulate`). Returns the mean held-out loss."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    if recipe is not None:
        # the layers the recipe keeps in high precision, else the LM head
        skip = ("head",) if recipe.skip is None else recipe.skip
        emulate(model, recipe, skip=skip, attention=attention)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 30) * max(0.1, 1 - s / steps)
    )
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = synthetic_batch(cfg, batch, generator=g)
        with torch.autocast(
            "cpu", dtype=precision or torch.bfloat16, enabled=precision is not None
        ):
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), y.reshape(-1))
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        sched.step()
    gv = torch.Generator().manual_seed(seed + 99)
    losses = []
    with torch.no_grad():
        for _ in range(4):
            x, y = synthetic_batch(cfg, 64, generator=gv)
            logits = model(x).float()
            losses.append(float(F.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1))))
    return sum(losses) / len(losses)
