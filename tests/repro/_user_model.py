"""A user's model: torch only (a repro script may import it where floatguard is not)."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.mode: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.mode == "log":
            h = torch.log(h - 100.0)  # every element negative: NaN
        elif self.mode == "sqrt":
            h = h + torch.sqrt((h - h).abs())  # sqrt at 0: its backward divides by 0
        elif self.mode == "big":
            h = h * 1e6  # past fp16's 65504
        return self.norm(h) + x


class TwoBlocks(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a = Block(d)
        self.b = Block(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.b(self.a(x)))
        return out
