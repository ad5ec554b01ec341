"""The peer loops the benchmarks measure floatguard against (written once)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def gradscaler_clip_step(
    model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[[], torch.Tensor]
) -> Callable[[], None]:
    """PyTorch's recipe: fp16 autocast, ``GradScaler.scale(loss).backward(); unscale_;
    clip_grad_norm_(1.0); step; update``."""
    scaler = torch.amp.GradScaler("cpu")

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step
