"""FP32 master weights for a model stored in fp16/bf16, done right.

The lessons referred to here: docs/lessons.md.
"""

from __future__ import annotations

from typing import Any

import torch

from floatguard.formats.rounding import quantize

__all__ = ["MasterWeights"]


class MasterWeights:
    """Keep float32 copies of an optimizer's half-precision parameters.

    The optimizer is re-pointed at the float32 masters. ``step()`` copies each model
    gradient into its master's ``.grad`` (in float32), runs the optimizer on the
    masters (which subtracts the update: the lesson's loop *added* ``lr * grad``), and
    writes *every* master back into its model parameter (the lesson wrote back only
    the last one, outside the loop). Write-back rounds to nearest, or stochastically
    with ``stochastic_rounding=True`` (via :func:`floatguard.quantize`; unbiased, so
    updates smaller than half an ulp of bf16 still move the weights on average).
    float32 parameters are used as they are.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        stochastic_rounding: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"MasterWeights needs a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.stochastic_rounding = stochastic_rounding
        self.generator = generator
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (model param, master)
        for group in optimizer.param_groups:
            masters = []
            for p in group["params"]:
                if p.dtype in (torch.float16, torch.bfloat16):
                    m = p.detach().clone().float().requires_grad_(True)
                    self.pairs.append((p, m))
                    masters.append(m)
                else:
                    masters.append(p)
            group["params"] = masters
        if not self.pairs:
            raise ValueError("MasterWeights: the optimizer has no float16/bfloat16 parameters")
        # Optimizer state is keyed by parameter; it is empty before the first step.
        if any(optimizer.state.values()):
            raise ValueError("MasterWeights must wrap the optimizer before its first step")

    def step(self) -> None:
        """Copy grads to the masters, step the optimizer, write every master back."""
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.detach().float()
        self.optimizer.step()
        with torch.no_grad():
            for p, m in self.pairs:
                if self.stochastic_rounding:
                    p.copy_(quantize(m, p.dtype, rounding="stochastic", generator=self.generator))
                else:
                    p.copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear model and master gradients."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p, _ in self.pairs:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        return {"masters": [m.detach().clone() for _, m in self.pairs]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        with torch.no_grad():
            for (p, m), saved in zip(self.pairs, sd["masters"], strict=True):
                m.copy_(saved)
                p.copy_(saved)
