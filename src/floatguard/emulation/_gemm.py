"""The emulated GEMM: forward and both backward GEMMs on operands quantized per recipe.

:class:`_EmulatedGemm` is a ``torch.autograd.Function`` for ``Y = A B^T`` (a linear
layer's ``X W^T``, an im2col conv, an attention matmul). Forward quantizes A and B
along K with the recipe's fprop recipes and saves the *high-precision* A and B (or the
forward's quantized copies where the recipe says so: ``*_from="fprop"``); backward
quantizes each operand of dgrad and wgrad afresh, along that GEMM's reduction dim, as
Transformer Engine's column-wise copies are made from the high-precision tensor
(``Float8BlockScaling`` / ``MXFP8BlockScaling`` / ``NVFP4BlockScaling`` docstrings:
"both versions are computed from the high precision input to avoid double
quantization errors"; ``custom_recipes/reference_nvfp4.py``: ``col_input =
tensor.t()``, RHT'd for Wgrad, with its own amax), as torchao's
``matmul_with_hp_or_float8_args`` does from its saved ``input_hp`` / ``weight_hp_t``.

Layouts (every operand reduction-last, see :mod:`floatguard.emulation.emulation_recipe`):
fprop ``A [.., M, K] @ B [.., N, K]^T``; dgrad ``dY [.., M, N] @ (B^T) [.., K, N]^T``;
wgrad ``(dY^T) [.., N, M] @ (A^T) [.., K, M]^T``. Leading batch dims (attention) are
GEMM batches: wgrad reduces over M within each batch. A linear layer's tokens are
flattened into M before (``_emulated_gemm``).

Every matmul here runs inside :func:`~floatguard.emulation._gemm_tag.emulated_gemm`
(the coverage audit counts those FLOPs as emulated); the RHT is a butterfly, not a
matmul. Order of the draws of stochastic rounding: fprop's, then dgrad's, then
wgrad's. No host-device sync anywhere.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from floatguard.emulation._core import QuantResult
from floatguard.emulation._delayed import Delayed
from floatguard.emulation._gemm_tag import emulated_gemm
from floatguard.emulation._scale_state import plain_cast
from floatguard.emulation.emulation_recipe import EmulationRecipe, Operand
from floatguard.emulation.hadamard import random_hadamard_transform
from floatguard.formats.registry import Format
from floatguard.formats.rounding import quantize

__all__: list[str] = []


class _Casts(Protocol):
    def cast(
        self, op: Operand, recipe: Any, t: torch.Tensor, source: torch.dtype | None = None
    ) -> QuantResult | None: ...


def _quantized(
    casts: _Casts | None,
    op: Operand,
    recipe: Any,
    t: torch.Tensor,
    source: torch.dtype | None,
) -> torch.Tensor:
    """t (float32, reduction dim last) fake-quantized for operand ``op``: through the
    layer's casts where it has state (delayed scaling, amax reduction), else by
    ``recipe`` itself; None: t itself."""
    res = casts.cast(op, recipe, t, source) if casts is not None else plain_cast(recipe, t, source)
    return t if res is None else res.values.to(torch.float32)


def _backward_copy(
    casts: _Casts | None, op: Operand, recipe: Any, t: torch.Tensor, source: torch.dtype | None
) -> torch.Tensor:
    """A backward GEMM's operand ``t``: as it is for a delayed-scaled tensor (its one
    cast per step, made earlier and passed in transposed), else quantized for ``op``."""
    return t if isinstance(recipe, Delayed) else _quantized(casts, op, recipe, t, source)


def _narrowed(t: torch.Tensor, source: torch.dtype | None) -> torch.Tensor:
    """t rounded to the operand's own dtype where the reference keeps an intermediate in
    it (bf16/fp16: TE's RHT kernels write their output in the input's type)."""
    if source in (torch.bfloat16, torch.float16):
        return t.to(source).to(torch.float32)
    return t


def _t(t: torch.Tensor) -> torch.Tensor:
    """The last two dims swapped, contiguous (the kernels' column-wise copy layout)."""
    return t.transpose(-1, -2).contiguous()


def _accumulated_matmul(a: torch.Tensor, b_t: torch.Tensor, bits: int, every: int) -> torch.Tensor:
    """``a @ b_t^T`` (both reduction-last, batch dims allowed) with the partial sums over
    each chunk of ``every`` elements of the reduction rounded to nearest even at
    ``bits`` mantissa bits (float32's exponent range), then added in float32 in order
    (the promotion to fp32 registers). Runs inside ``emulated_gemm()``."""
    acc_fmt = Format.custom(8, bits, name=f"acc_m{bits}")
    k = a.shape[-1]
    out: torch.Tensor | None = None
    with emulated_gemm():
        for start in range(0, k, every):
            part = a[..., start : start + every] @ b_t[..., start : start + every].transpose(-1, -2)
            part = quantize(part, acc_fmt)
            out = part if out is None else out + part
    if out is None:  # an empty reduction
        with emulated_gemm():
            out = a @ b_t.transpose(-1, -2)
    return out


def _matmul(a: torch.Tensor, b: torch.Tensor, r: EmulationRecipe) -> torch.Tensor:
    """``a @ b^T`` on quantized operands, as the recipe's GEMM accumulates it."""
    if r.accumulate_bits is not None:
        return _accumulated_matmul(a, b, r.accumulate_bits, r.accumulate_every)
    with emulated_gemm():
        return a @ b.transpose(-1, -2)


def _rht_pair(
    g_t: torch.Tensor, a_t: torch.Tensor, r: EmulationRecipe, source: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both wgrad operands (tokens last) zero-padded to a multiple of the Hadamard size
    and transformed (the padding cancels: its rows of dY and X are 0 before the
    transform, and the transform is orthogonal); the output rounded to the operands'
    bf16/fp16 ``source`` dtype, as TE's RHT kernels and its reference
    (``custom_recipes/reference_nvfp4.py``: ``x_mat @ transform`` in ``x.dtype``) give it."""
    n = r.wgrad_rht
    if n is None:
        return g_t, a_t
    pad = (-g_t.shape[-1]) % n
    if pad:
        g_t, a_t = F.pad(g_t, (0, pad)), F.pad(a_t, (0, pad))
    return (
        _narrowed(random_hadamard_transform(g_t, n, r.rht_seed), source),
        _narrowed(random_hadamard_transform(a_t, n, r.rht_seed), source),
    )


class _EmulatedGemm(torch.autograd.Function):
    """``a @ w^T`` (float32; a ``[.., M, K]``, w ``[.., N, K]`` with a's batch dims or
    none) with the six operand quantizations of an :class:`EmulationRecipe`; ``casts``:
    the layer's scaling state (None: stateless recipes only); ``source``: the dtype
    the operands had before they were widened to float32 (None: float32)."""

    @staticmethod
    def forward(
        ctx: Any,
        a: torch.Tensor,
        w: torch.Tensor,
        r: EmulationRecipe,
        casts: _Casts | None = None,
        source: torch.dtype | None = None,
    ) -> torch.Tensor:
        ops = r.operands()
        aq = _quantized(casts, "fprop_input", ops["fprop_input"], a, source)
        wq = _quantized(casts, "fprop_weight", ops["fprop_weight"], w, source)
        y = _matmul(aq, wq, r)
        # What the backward copies are made from: the high-precision tensors (TE,
        # torchao), or the forward's quantized ones where the recipe says so. A
        # delayed-scaled X or W is cast once: its backward copy is the forward's.
        reuse_a = r.wgrad_input_from == "fprop" or isinstance(ops["wgrad_input"], Delayed)
        reuse_w = r.dgrad_weight_from == "fprop" or isinstance(ops["dgrad_weight"], Delayed)
        a_src, w_src = (aq if reuse_a else a), (wq if reuse_w else w)
        ctx.save_for_backward(a_src, w_src)
        ctx.recipe, ctx.casts, ctx.source = r, casts, source
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        a_src, w_src = ctx.saved_tensors
        r: EmulationRecipe = ctx.recipe
        casts, source = ctx.casts, ctx.source
        ops = r.operands()
        g = g.to(torch.float32)
        da = dw = gq = None
        if ctx.needs_input_grad[0]:  # dgrad: dY [.., M, N] @ (W^T) [.., K, N]^T, reduces N
            gq = _quantized(casts, "dgrad_grad", ops["dgrad_grad"], g, source)
            wq_t = _backward_copy(casts, "dgrad_weight", ops["dgrad_weight"], _t(w_src), source)
            da = _matmul(gq, wq_t, r)
        if ctx.needs_input_grad[1]:  # wgrad: (dY^T) [.., N, M] @ (X^T) [.., K, M]^T, reduces M
            delayed_g = isinstance(ops["wgrad_grad"], Delayed)
            if delayed_g:  # dY is cast once (in dgrad when it ran): its transpose
                if gq is None or not isinstance(ops["dgrad_grad"], Delayed):
                    gq = _quantized(casts, "wgrad_grad", ops["wgrad_grad"], g, source)
                g_t, a_t = _t(gq), _t(a_src)
            else:
                g_t, a_t = _rht_pair(_t(g), _t(a_src), r, source)
            gq_t = _backward_copy(casts, "wgrad_grad", ops["wgrad_grad"], g_t, source)
            aq_t = _backward_copy(casts, "wgrad_input", ops["wgrad_input"], a_t, source)
            dw = _matmul(gq_t, aq_t, r)
        return da, dw, None, None, None


def _emulated_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    r: EmulationRecipe,
    casts: _Casts | None = None,
    source: torch.dtype | None = None,
) -> torch.Tensor:
    """``a @ w.T`` as the low-precision GEMMs compute it, forward and backward
    (``casts``, ``source``: see :class:`_EmulatedGemm`).

    ``w [N, K]`` (a layer's weight, float32): ``a [..., K]`` is flattened to the tokens
    ``[M, K]`` (M = the product of the leading dims, e.g. batch x sequence), so wgrad's
    blocks run along every token. ``w [*B, N, K]`` with ``a [*B, M, K]``: a batched GEMM
    (attention), batch by batch. Returns float32 ``[..., N]``.
    """
    if w.dim() == 2:
        lead = a.shape[:-1]
        out: torch.Tensor = _EmulatedGemm.apply(a.reshape(-1, a.shape[-1]), w, r, casts, source)  # type: ignore[no-untyped-call]
        return out.reshape(*lead, w.shape[0])
    if a.shape[:-2] != w.shape[:-2]:
        raise ValueError(
            f"batched emulated GEMM: operands' batch dims differ, {tuple(a.shape)} and "
            f"{tuple(w.shape)}; expand them to one shape first"
        )
    batched: torch.Tensor = _EmulatedGemm.apply(a, w, r, casts, source)  # type: ignore[no-untyped-call]
    return batched
