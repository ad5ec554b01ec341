"""Blocked attention with an online softmax: FlashAttention's algorithm as a readable reference.

For each block of keys the scores ``q @ k_j^T * scale`` are computed, the running
row max ``m``, row mass ``l`` and output accumulator are rescaled by
``exp(m_old - m_new)``, and the block's ``exp(s - m_new) @ v_j`` is added (Dao
et al. 2022, Algorithm 1; Milakov & Gimelshein 2018 for the online softmax).
The backward pass recomputes each block from the saved per-row log-sum-exp
(Algorithm 2), so memory is ``O(N * block_size)`` in both passes, never
``O(N^2)``.

Where the lessons' (docs/lessons.md) sketch breaks, this does not: the last block may be partial,
and a row whose keys are all masked gets output 0 and log-sum-exp ``-inf`` (its
gradient is 0), where the naive version computes ``exp(-inf - (-inf)) = NaN``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from floatguard.ops._common import acc_dtype, broadcast_shapes, check_float

__all__ = ["attention"]


def _block_bias(
    mask: torch.Tensor | None,
    causal: bool,
    n_q: int,
    start: int,
    stop: int,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """Additive bias for keys ``start:stop``: 0 where allowed, -inf where masked."""
    bias: torch.Tensor | None = None
    if mask is not None:
        block = mask[..., start:stop]
        if block.dtype == torch.bool:
            zero = torch.zeros((), dtype=dtype, device=device)
            ninf = torch.full((), -math.inf, dtype=dtype, device=device)
            bias = torch.where(block, zero, ninf)
        else:
            bias = block.to(dtype)
    if causal:
        # Top-left aligned, as scaled_dot_product_attention(is_causal=True): query i sees keys <= i.
        qi = torch.arange(n_q, device=device)[:, None]
        kj = torch.arange(start, stop, device=device)[None, :]
        causal_bias = torch.zeros((n_q, stop - start), dtype=dtype, device=device)
        causal_bias = causal_bias.masked_fill(kj > qi, -math.inf)
        bias = causal_bias if bias is None else bias + causal_bias
    return bias


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
        scale: float,
        block_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        acc = acc_dtype(q.dtype)
        qf, kf, vf = q.to(acc), k.to(acc), v.to(acc)
        n_q, n_k = qf.shape[-2], kf.shape[-2]
        batch = broadcast_shapes(qf.shape[:-2], kf.shape[:-2], vf.shape[:-2])
        m = torch.full((*batch, n_q), -math.inf, dtype=acc, device=q.device)
        l = torch.zeros((*batch, n_q), dtype=acc, device=q.device)  # noqa: E741
        out = torch.zeros((*batch, n_q, vf.shape[-1]), dtype=acc, device=q.device)
        for start in range(0, n_k, block_size):
            stop = min(start + block_size, n_k)  # the last block may be partial
            s = (qf @ kf[..., start:stop, :].transpose(-1, -2)) * scale
            bias = _block_bias(mask, causal, n_q, start, stop, q.device, acc)
            if bias is not None:
                s = s + bias
            m_new = torch.maximum(m, s.amax(dim=-1))
            # Rows with nothing visible yet keep m = -inf; shift them by 0 instead of -inf.
            m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            p = torch.exp(s - m_safe[..., None])
            corr = torch.exp(m - m_safe)
            l = l * corr + p.sum(dim=-1)  # noqa: E741
            out = out * corr[..., None] + p @ vf[..., start:stop, :]
            m = m_new
        has_mass = l != 0
        out = out / torch.where(has_mass, l, torch.ones_like(l))[..., None]
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        lse = torch.where(
            has_mass,
            m_safe + torch.log(torch.where(has_mass, l, torch.ones_like(l))),
            torch.full_like(l, -math.inf),
        )
        ctx.save_for_backward(q, k, v, out, lse, *([] if mask is None else [mask]))
        ctx.has_mask = mask is not None
        ctx.causal, ctx.scale, ctx.block_size = causal, scale, block_size
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor, d_lse: torch.Tensor | None) -> tuple[Any, ...]:
        saved = ctx.saved_tensors
        q, k, v, out, lse = saved[:5]
        mask = saved[5] if ctx.has_mask else None
        acc = acc_dtype(q.dtype)
        qf, kf, vf = q.to(acc), k.to(acc), v.to(acc)
        do = d_out.to(acc)
        n_q, n_k = qf.shape[-2], kf.shape[-2]
        scale = ctx.scale
        lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        # D_i = sum_j P_ij dP_ij = rowsum(dO * O), minus the lse output's own gradient.
        delta = (do * out).sum(dim=-1)
        if d_lse is not None:
            delta = delta - d_lse.to(acc)
        batch = broadcast_shapes(qf.shape[:-2], kf.shape[:-2], vf.shape[:-2])
        dq = torch.zeros((*batch, n_q, qf.shape[-1]), dtype=acc, device=q.device)
        dk = torch.zeros((*batch, n_k, kf.shape[-1]), dtype=acc, device=q.device)
        dv = torch.zeros((*batch, n_k, vf.shape[-1]), dtype=acc, device=q.device)
        for start in range(0, n_k, ctx.block_size):
            stop = min(start + ctx.block_size, n_k)
            kj, vj = kf[..., start:stop, :], vf[..., start:stop, :]
            s = (qf @ kj.transpose(-1, -2)) * scale
            bias = _block_bias(mask, ctx.causal, n_q, start, stop, q.device, acc)
            if bias is not None:
                s = s + bias
            p = torch.exp(s - lse_safe[..., None])  # masked entries: exp(-inf) = 0
            dv[..., start:stop, :] = p.transpose(-1, -2) @ do
            dp = do @ vj.transpose(-1, -2)
            ds = p * (dp - delta[..., None])
            dq += (ds @ kj) * scale
            dk[..., start:stop, :] = (ds.transpose(-1, -2) @ qf) * scale

        def fit(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
            # Sum over broadcast batch dims so each gradient has its input's shape.
            while grad.dim() > like.dim():
                grad = grad.sum(dim=0)
            for i, n in enumerate(like.shape[:-2]):
                if n == 1 and grad.shape[i] != 1:
                    grad = grad.sum(dim=i, keepdim=True)
            return grad.to(like.dtype)

        return fit(dq, q), fit(dk, k), fit(dv, v), None, None, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    block_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocked softmax attention; returns ``(output, lse)``.

    Shapes as ``scaled_dot_product_attention``: ``q`` is ``[..., Nq, d]``, ``k``
    ``[..., Nk, d]``, ``v`` ``[..., Nk, dv]`` (batch dims broadcast). ``mask``
    broadcasts to ``[..., Nq, Nk]``: boolean (True = may attend) or additive
    float. ``causal=True`` lets query i see keys ``<= i`` (top-left aligned, as
    torch). ``scale`` defaults to ``1/sqrt(d)``: without it the scores of
    unit-variance q and k have variance d and the softmax saturates.

    Returns the output ``[..., Nq, dv]`` in q's dtype and the per-row
    log-sum-exp of the scaled scores ``[..., Nq]`` in the accumulation dtype
    (float32 for half inputs). Fully masked rows give output 0 and lse ``-inf``
    (torch gives NaN). Differentiable in q, k and v with an O(N * block_size)
    recomputing backward; no dropout.
    """
    op = "attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(t, name, op)
        if t.dim() < 2:
            raise ValueError(f"{op}: {name} must be at least 2-d [..., N, d], got {tuple(t.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{op}: q and k feature sizes differ: {q.shape[-1]} vs {k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"{op}: k and v key counts differ: {k.shape[-2]} vs {v.shape[-2]}")
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise TypeError(f"{op}: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    try:
        broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"{op}: batch dims of q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
            "do not broadcast"
        ) from None
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{op}: block_size={block_size!r} must be a positive int")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"{op}: mask must be a tensor or None, got {type(mask).__name__}")
        try:
            broadcast_shapes(mask.shape, (*q.shape[:-1], k.shape[-2]))
        except RuntimeError:
            raise ValueError(
                f"{op}: mask of shape {tuple(mask.shape)} does not broadcast to "
                f"{(*q.shape[:-1], k.shape[-2])}"
            ) from None
        if mask.shape[-1] == 1 and k.shape[-2] != 1:
            mask = mask.expand(*mask.shape[:-1], k.shape[-2])
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] > 0 else 1.0
    res: tuple[torch.Tensor, torch.Tensor] = _Attention.apply(  # type: ignore[no-untyped-call]
        q, k, v, mask, bool(causal), float(scale), block_size
    )
    return res
