"""A small decoder-only transformer (GPT-2 layout) and a synthetic next-token task."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "synthetic_batch"]


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the model; the defaults are the benchmark's (4 layers, d=128, T=128)."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    attention: Literal["sdpa", "explicit"] = "sdpa"
    """"sdpa": F.scaled_dot_product_attention (a fully masked row gives 0); "explicit":
    softmax(q k^T / sqrt(d) + mask) v, as hand-written attention does it (a fully
    masked row gives NaN)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"GPTConfig.{name}={v!r} must be a positive int")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.attention not in ("sdpa", "explicit"):
            raise ValueError(f"attention={self.attention!r}; use 'sdpa' or 'explicit'")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.explicit = cfg.attention == "explicit"
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        if self.explicit or pad is not None:
            masked = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            if pad is not None:  # keys that are padding: no query may look at them
                masked = masked | pad[:, None, None, :]
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
            att = att.masked_fill(masked, float("-inf")).softmax(dim=-1)
            y = att @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, c))
        return out


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(self.act(self.fc(x)))
        return out


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), pad)
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """Token + position embeddings, pre-LN blocks, tied-free LM head; returns logits."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or GPTConfig()
        c = self.cfg
        self.tok = nn.Embedding(c.vocab_size, c.n_embd)
        self.pos = nn.Embedding(c.block_size, c.n_embd)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for ``idx`` ([batch, T] token ids); ``pad`` ([batch, T] bool): keys
        that are padding, masked out of attention."""
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.cfg.block_size}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x, pad)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


def synthetic_batch(
    cfg: GPTConfig, batch: int, *, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable synthetic task: sequences of a noisy arithmetic progression mod vocab.

    Returns ``(inputs, targets)`` of shape ``[batch, block_size]`` (targets shifted by one).
    """
    start = torch.randint(0, cfg.vocab_size, (batch, 1), generator=generator)
    step = torch.randint(1, 8, (batch, 1), generator=generator)
    pos = torch.arange(cfg.block_size + 1)[None, :]
    seq = (start + step * pos) % cfg.vocab_size
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
