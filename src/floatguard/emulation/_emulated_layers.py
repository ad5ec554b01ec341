"""The emulated layers: GEMMs computed as an FP8/MX/NVFP4 GEMM would, on a CPU.

:mod:`floatguard.emulation.fake_quant` is the public face (these, and ``emulate`` /
``restore`` from :mod:`floatguard.emulation._emulate`, which swaps them in).

``emulate(model, EmulationRecipe.hybrid_block())`` swaps, in place, every
``nn.Linear`` (and transformers' ``Conv1D``) for an :class:`EmulatedLinear` and
every ``nn.Conv1d``/``nn.Conv2d`` for an :class:`EmulatedConv`, each sharing the
original's parameters (the optimizer keeps working). Each of the layer's three GEMMs
(forward, dgrad, wgrad) quantizes its two operands along its own reduction dim with
the recipe's choice for that operand (:class:`EmulationRecipe`, six operand recipes;
the GEMM itself is :mod:`floatguard.emulation._gemm`) and multiplies in float32. A
convolution is computed as the implicit
GEMM it is (im2col: the reduction runs over ``in_channels / groups * kernel``), so
block scales run along the same dim as a GEMM kernel's. With ``attention=True``
the two matmuls inside ``F.scaled_dot_product_attention`` (``q k^T`` and ``p v``)
are emulated too, as FP8 attention kernels compute them. ``restore(model)`` undoes
all of it.

Optional accumulation emulation, in all three GEMMs: round the partial sums to
``accumulate_bits`` mantissa bits every ``accumulate_every`` elements of the reduction
(DeepSeek-V3 promotes Tensor Core partial sums to fp32 every 128 elements because the
FP8 GEMM accumulator keeps about 14 bits).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from floatguard.emulation._gemm import _emulated_gemm
from floatguard.emulation._scale_state import LayerCasts
from floatguard.emulation.emulation_recipe import EmulationRecipe
from floatguard.emulation.recipes import TensorRecipe

__all__ = ["EmulatedConv", "EmulatedLinear", "FakeQuant", "emulated_sdpa", "fake_quant"]


class FakeQuant(torch.autograd.Function):
    """Forward: quantize with a recipe. Backward: straight-through, or quantize the
    incoming gradient with ``grad_recipe``."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, recipe: TensorRecipe | None, grad_recipe: TensorRecipe | None
    ) -> torch.Tensor:
        ctx.grad_recipe = grad_recipe
        return x if recipe is None else recipe(x).values

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        gr: TensorRecipe | None = ctx.grad_recipe
        return (g if gr is None else gr(g).values), None, None


def fake_quant(
    x: torch.Tensor, recipe: TensorRecipe | None, grad_recipe: TensorRecipe | None = None
) -> torch.Tensor:
    """Differentiable fake quantization (see :class:`FakeQuant`)."""
    out: torch.Tensor = FakeQuant.apply(x, recipe, grad_recipe)  # type: ignore[no-untyped-call]
    return out


class _Emulated(nn.Module):
    """Common part of the emulated modules: the original (outside the module tree) and
    its parameters, shared."""

    def __init__(
        self, original: nn.Module, recipe: EmulationRecipe, casts: LayerCasts | None = None
    ) -> None:
        super().__init__()
        self.original = [original]  # a list keeps it out of the module tree
        self.casts = casts  # the layer's scaling state (delayed scaling, amax reduction)
        weight = getattr(original, "weight", None)
        if not isinstance(weight, nn.Parameter):
            raise TypeError(f"cannot emulate {type(original).__name__}: no weight parameter")
        self.weight = weight
        self.bias = getattr(original, "bias", None)
        self.recipe = recipe
        if _is_dtensor(weight):
            # torch's tensor-parallel styles hook the module they parallelized (inputs to
            # DTensors, outputs back to local tensors): the emulated module runs them too.
            self._forward_pre_hooks = original._forward_pre_hooks
            self._forward_hooks = original._forward_hooks

    def original_module(self) -> nn.Module:
        """The module this one replaced (what :func:`restore` puts back)."""
        return self.original[0]


def _is_dtensor(t: object) -> bool:
    """Whether t is a DTensor (without importing torch.distributed.tensor when unused)."""
    return type(t).__name__ == "DTensor" or any(c.__name__ == "DTensor" for c in type(t).__mro__)


def source_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype an operand is quantized from, where it is not float32: bf16 or fp16."""
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16) else None


class EmulatedLinear(_Emulated):
    """``nn.Linear`` (or transformers' ``Conv1D``) computed under an :class:`EmulationRecipe`;
    shares ``weight`` and ``bias`` with the module it replaces (``original``)."""

    def __init__(
        self, original: nn.Module, recipe: EmulationRecipe, casts: LayerCasts | None = None
    ) -> None:
        super().__init__(original, recipe, casts)
        if self.weight.dim() != 2:
            raise TypeError(f"cannot emulate {type(original).__name__}: no 2-D weight")
        # transformers' Conv1D (GPT-2) stores the weight as (in, out): y = x @ W + b
        self.transposed = not isinstance(original, nn.Linear)
        shape = self.weight.shape
        out_f, in_f = (shape[1], shape[0]) if self.transposed else shape
        self.in_features, self.out_features = int(in_f), int(out_f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _is_dtensor(self.weight):
            return self._sharded(x)
        # Blocks of the weight run along the reduction dim, as for nn.Linear's (out, in).
        w = self.weight.float().t() if self.transposed else self.weight.float()
        y = _emulated_gemm(x.float(), w, self.recipe, self.casts, source_dtype(x))
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def _sharded(self, x: torch.Tensor) -> torch.Tensor:
        """A tensor-parallel layer (its weight a DTensor on a 1-D mesh, as torch's
        ``ColwiseParallel`` / ``RowwiseParallel`` leave it): the emulated GEMM runs on the
        local shards, as each rank's kernel does. Column-wise (W ``Shard(0)``, X
        replicated): the output is ``Shard(-1)``; row-wise (W ``Shard(1)``, X
        ``Shard(-1)``): a ``Partial`` sum, reduced when the bias (replicated) is added
        or by the layer's output hook. Each shard's tensor-wise scale comes from its own
        amax unless ``emulate(amax_group=)`` names the mesh's group."""
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        w = self.weight
        assert isinstance(w, DTensor)
        mesh, (wp,) = w.device_mesh, w.placements if len(w.placements) == 1 else (None,)
        xp = x.placements[0] if isinstance(x, DTensor) and len(x.placements) == 1 else None
        dim = (wp.dim % 2) if isinstance(wp, Shard) else None
        if self.transposed and dim is not None:
            dim = 1 - dim  # Conv1D stores (in, out)
        colwise = dim == 0 and (xp is None or isinstance(xp, Replicate))
        rowwise = dim == 1 and isinstance(xp, Shard) and xp.dim % x.dim() == x.dim() - 1
        if mesh.ndim != 1 or not (colwise or rowwise):
            raise NotImplementedError(
                f"emulate: tensor-parallel layer with weight placements {w.placements} and "
                f"input placements {getattr(x, 'placements', 'plain tensor')}; emulated are "
                "a 1-D mesh with W Shard(0) and X replicated (ColwiseParallel) or W Shard(1) "
                "and X Shard(-1) (RowwiseParallel)"
            )
        xl = x.to_local() if isinstance(x, DTensor) else x
        wl = w.to_local().float()
        wl = wl.t() if self.transposed else wl
        y = _emulated_gemm(xl.float(), wl, self.recipe, self.casts, source_dtype(xl)).to(xl.dtype)
        b = self.bias
        if colwise:
            if b is not None:
                bl = b.to_local() if isinstance(b, DTensor) else b
                y = y + bl.to(y.dtype)
            return DTensor.from_local(y, mesh, [Shard(y.dim() - 1)], run_check=False)
        out: torch.Tensor = DTensor.from_local(y, mesh, [Partial()], run_check=False)
        if b is not None:
            bd = b if isinstance(b, DTensor) else DTensor.from_local(b, mesh, [Replicate()])
            out = out + bd
        return out

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, recipe={self.recipe}"


def _pair(v: Any, n: int) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


class EmulatedConv(_Emulated):
    """``nn.Conv1d`` / ``nn.Conv2d`` computed as the implicit GEMM a low-precision conv
    kernel runs: the input unfolded (im2col) into ``[N, L, C/groups * k]`` rows, the weight
    as ``[out/groups, C/groups * k]``, both quantized along that reduction dim, multiplied
    per group in float32. Any padding mode, stride, dilation, groups, ``padding="same"``
    and unbatched inputs. Memory: the unfolded input is ``k`` times the input (this is an
    emulator, not a fast conv)."""

    def __init__(
        self, original: nn.Module, recipe: EmulationRecipe, casts: LayerCasts | None = None
    ) -> None:
        super().__init__(original, recipe, casts)
        if not isinstance(original, (nn.Conv1d, nn.Conv2d)):
            raise TypeError(
                f"EmulatedConv emulates nn.Conv1d/nn.Conv2d, not {type(original).__name__}"
            )
        self.conv: nn.Conv1d | nn.Conv2d = original
        self.spatial = 1 if isinstance(original, nn.Conv1d) else 2

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        """x with the conv's padding applied (the GEMM then runs with padding 0)."""
        c, n = self.conv, self.spatial
        k, d = _pair(c.kernel_size, n), _pair(c.dilation, n)
        if c.padding == "valid":
            return x
        if c.padding == "same":  # total d*(k-1), the extra one on the right (as torch does)
            total = [di * (ki - 1) for di, ki in zip(d, k, strict=True)]
            pads: list[int] = []
            for t in reversed(total):
                pads += [t // 2, t - t // 2]
        else:
            pads = []
            for p in reversed(_pair(c.padding, n)):
                pads += [int(p), int(p)]
        if not any(pads):
            return x
        mode = "constant" if c.padding_mode == "zeros" else c.padding_mode
        return F.pad(x, pads, mode=mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, n = self.conv, self.spatial
        unbatched = x.dim() == n + 1
        xb = x.unsqueeze(0) if unbatched else x
        xp = self._padded(xb.float())
        k, s, d = _pair(c.kernel_size, n), _pair(c.stride, n), _pair(c.dilation, n)
        if n == 1:  # a 1-D conv is a 2-D one over a height of 1
            xp, k, s, d = xp.unsqueeze(2), (1, *k), (1, *s), (1, *d)
        batch, _, h, w_in = xp.shape
        h_out = (h - d[0] * (k[0] - 1) - 1) // s[0] + 1
        w_out = (w_in - d[1] * (k[1] - 1) - 1) // s[1] + 1
        cols = F.unfold(xp, k, dilation=d, stride=s)  # [N, C*kh*kw, L], C-major like weight
        g = c.groups
        cols = cols.reshape(batch, g, -1, h_out * w_out).transpose(-1, -2)  # [N, g, L, K]
        wg = self.weight.float().reshape(g, c.out_channels // g, -1)  # [g, out/g, K]
        src = source_dtype(x)
        ys = [_emulated_gemm(cols[:, i], wg[i], self.recipe, self.casts, src) for i in range(g)]
        y = torch.cat(ys, dim=-1).transpose(1, 2)  # [N, out, L]
        y = y.reshape(batch, c.out_channels, h_out, w_out)
        if n == 1:
            y = y.squeeze(2)
        if self.bias is not None:
            y = y + self.bias.float().reshape(-1, *([1] * n))
        if unbatched:
            y = y.squeeze(0)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.conv.extra_repr()}, recipe={self.recipe}"  # type: ignore[no-untyped-call]


def emulated_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    recipe: EmulationRecipe,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with its two matmuls emulated, as FP8 attention
    kernels compute them, forward and backward: ``S = q k^T`` (q and k along the head
    dim E) and ``O = P v`` (P and v along the keys), each the emulated GEMM of
    :mod:`floatguard.emulation._gemm`, so their four backward matmuls quantize their
    operands along their own reduction dims too (``dq = dS k``: dS and k along the keys;
    ``dk = dS^T q``: dS and q along the queries; ``dP = dO v^T``: along E; ``dv = P^T
    dO``: along the queries). Every non-gradient operand (q, k, P, v) uses the recipe's
    ``activation``, dS and dO its ``dgrad_grad`` / ``wgrad_grad``; no Hadamard
    transform, no accumulator emulation. The scale ``1/sqrt(E)``, the mask and the
    softmax run in float32; a row with every key masked gives 0 (torch's math
    backend's safe softmax). Batch dims broadcast as in SDPA; a 2-D (16x16 / 128x128)
    recipe would tile across heads (the batch is flattened), use 1-D ones here."""
    r = _attention_recipe(recipe)
    q, k, v = query.float(), key.float(), value.float()
    if enable_gqa and k.size(-3) != q.size(-3):
        rep = q.size(-3) // k.size(-3)
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])  # type: ignore[no-untyped-call]
    q, k, v = (t.expand(*batch, *t.shape[-2:]) for t in (q, k, v))
    n_q, n_k = q.size(-2), k.size(-2)
    sc = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    src = source_dtype(query)
    s = _emulated_gemm(q, k, r, None, src) * sc
    if is_causal:
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, -math.inf)
        else:
            s = s + attn_mask.float()
    dead = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.softmax(s, dim=-1).masked_fill(dead, 0.0)
    if dropout_p > 0.0:
        p = F.dropout(p, dropout_p, training=True)
    out = _emulated_gemm(
        p, v.transpose(-2, -1), r, None, src
    )  # P [.., n_q, n_k] @ (v^T) [.., E, n_k]^T
    return out.to(query.dtype)


def _attention_recipe(r: EmulationRecipe) -> EmulationRecipe:
    """The attention matmuls' operand recipes: ``activation`` for q, k, P and v in
    every GEMM, the layer recipe's gradient recipes for dS and dO."""
    ops = r.operands()
    return EmulationRecipe(
        r.activation, r.activation, r.grad, dgrad_grad=ops["dgrad_grad"],
        wgrad_grad=ops["wgrad_grad"],
    )  # fmt: skip
