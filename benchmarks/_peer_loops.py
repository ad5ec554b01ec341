"""The peer loops the benchmarks measure floatguard against (written once)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def gradscaler_clip_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    loss_fn: Callable[[], torch.Tensor],
    device_type: str = "cpu",
) -> Callable[[], None]:
    """PyTorch's recipe: fp16 autocast, ``GradScaler.scale(loss).backward(); unscale_;
    clip_grad_norm_(1.0); step; update``."""
    return clip_step(model, opt, loss_fn, device_type, torch.float16)


def clip_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    loss_fn: Callable[[], torch.Tensor],
    device_type: str = "cpu",
    dtype: torch.dtype | None = None,
) -> Callable[[], None]:
    """The hand-written loop: autocast to ``dtype`` (None: none), ``backward;
    clip_grad_norm_(1.0); step``, with PyTorch's GradScaler recipe around it for fp16."""
    scaler = torch.amp.GradScaler(device_type) if dtype == torch.float16 else None

    def step() -> None:
        with torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
            loss = loss_fn()
        if scaler is None:
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        else:
            scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)

    return step
