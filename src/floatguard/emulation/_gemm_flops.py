"""The GEMM-like aten ops the coverage audit counts, and their FLOPs.

FLOPs: ``2 * M * N * K`` per matrix product (a multiply-add is 2 FLOPs; the bias, the
``beta``/``alpha`` epilogue and the activation of ``_addmm_activation`` are not
counted), as ``torch.utils.flop_counter`` counts them (``mm_flop``, ``bmm_flop``,
``addmm_flop``). Convolutions (``conv_flop_count``, ``conv_backward_flop``: each of the
input and weight gradients the backward computes costs one forward) and the CUDA
attention kernels (``sdpa_flop_count``; ``sdpa_backward_flop_count``: the backward
recomputes the scores, 5 products) are ``torch.utils.flop_counter``'s own formulas,
called through its ``flop_registry``. The CPU flash attention, the RNN layer, the
matrix-vector products and ``_trilinear`` are written here the same way.

Composite ops never reach the dispatcher and are not in the table: ``linear``,
``matmul``, ``einsum``, ``bilinear``, a GRU/RNN/LSTM cell and a CPU GRU or RNN (their
``mm``/``addmm``/``bmm``/``_trilinear`` are counted), SDPA's math backend
(``_scaled_dot_product_attention_math``: its ``bmm``). Not GEMMs: CUDA's fused LSTM/GRU
cells (``_thnn_fused_*_cell``: the pointwise gate update after the two GEMMs).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import flop_counter

__all__ = ["GEMM_OPS", "looks_like_gemm"]

aten = torch.ops.aten
_Formula = Callable[[tuple[Any, ...], dict[str, Any], Any], int]


def _numel(shape: Any) -> int:
    return math.prod(int(s) for s in shape)


def _mm(a: torch.Tensor, b: torch.Tensor) -> int:
    """``a [M, K] @ b [K, N]`` (or batched ``[B, M, K] @ [B, K, N]``): 2 B M N K."""
    return 2 * _numel(a.shape[:-1]) * int(b.shape[-1]) * int(a.shape[-1])


def _sdpa_shapes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[int, int, int, int, int]:
    """(batch x query heads, L_q, L_k, E, E_v): GQA's key heads are broadcast to the
    query's, as the kernels do (``flop_counter.sdpa_flop_count``)."""
    return (_numel(q.shape[:-2]), int(q.shape[-2]), int(k.shape[-2]), int(q.shape[-1]),
            int(v.shape[-1]))  # fmt: skip


def _sdpa_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """``S = q k^T`` and ``O = P v``: 2 B L_q L_k (E + E_v)."""
    b, lq, lk, e, ev = _sdpa_shapes(q, k, v)
    return 2 * b * lq * lk * (e + ev)


def _sdpa_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """A flash backward: S recomputed, then dP = dO v^T, dV = P^T dO, dQ = dS k, dK = dS^T q
    (``flop_counter.sdpa_backward_flop_count``): 2 B L_q L_k (3 E + 2 E_v)."""
    b, lq, lk, e, ev = _sdpa_shapes(q, k, v)
    return 2 * b * lq * lk * (3 * e + 2 * ev)


def _rnn_layer(inp: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor) -> int:
    """One mkldnn RNN layer and direction: every token's input and hidden GEMMs,
    ``2 * tokens * (G H) * (I + H)`` (G gates: ``w_ih`` is ``[G H, I]``, ``w_hh``
    ``[G H, H]``; tokens = T x B, or the packed sum of the batch sizes)."""
    tokens = _numel(inp.shape[:-1])
    return 2 * tokens * int(w_ih.shape[0]) * (int(w_ih.shape[1]) + int(w_hh.shape[1]))


def _trilinear(args: tuple[Any, ...]) -> int:
    """``_trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim)`` (F.bilinear: i1 x1,
    i2 the weight, i3 x2): a multiply-add per element of the broadcast product of the
    three operands, each unsqueezed at its expand dims (the CPU kernel's bmm): for
    nn.Bilinear ``2 * N * out * in1 * in2``."""
    shapes = []
    for t, expand in zip(args[:3], args[3:6], strict=True):
        shape = list(t.shape)
        for d in sorted(expand):
            shape.insert(d, 1)
        shapes.append(shape)
    return 2 * _numel(torch.broadcast_shapes(*shapes))  # type: ignore[no-untyped-call]


def _registry(packet: Any) -> _Formula:
    """``torch.utils.flop_counter``'s own formula for ``packet``."""
    formula = flop_counter.flop_registry[packet]
    return lambda a, k, out: int(formula(*a, **k, out_val=out))


def _grouped(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> int:
    """``_grouped_mm`` / ``_scaled_grouped_mm``: every group's product, ``2 M N K`` summed.
    2-D x 2-D (the MoE weight gradient, ``[K, M_total] x [M_total, N]`` grouped along
    the tokens): ``2 K M_total N``; every other layout: the output's elements times
    ``2 K`` (K = ``a``'s last dim)."""
    if a.dim() == 2 and b.dim() == 2:
        return 2 * int(a.shape[0]) * int(a.shape[1]) * int(b.shape[1])
    return 2 * _numel(out.shape) * int(a.shape[-1])


GEMM_OPS: dict[Any, _Formula] = {
    aten.mm: lambda a, k, out: _mm(a[0], a[1]),
    aten.bmm: lambda a, k, out: _mm(a[0], a[1]),
    aten._int_mm: lambda a, k, out: _mm(a[0], a[1]),
    aten._scaled_mm: lambda a, k, out: _mm(a[0], a[1]),
    aten.addmm: lambda a, k, out: _mm(a[1], a[2]),
    aten.addmm_: lambda a, k, out: _mm(a[1], a[2]),
    aten._addmm_activation: lambda a, k, out: _mm(a[1], a[2]),
    aten.baddbmm: lambda a, k, out: _mm(a[1], a[2]),
    aten.baddbmm_: lambda a, k, out: _mm(a[1], a[2]),
    aten.addbmm: lambda a, k, out: _mm(a[1], a[2]),  # the batch summed into one [M, N]
    aten.addbmm_: lambda a, k, out: _mm(a[1], a[2]),
    aten.mv: lambda a, k, out: 2 * _numel(a[0].shape),
    aten.addmv: lambda a, k, out: 2 * _numel(a[1].shape),
    aten.addmv_: lambda a, k, out: 2 * _numel(a[1].shape),
    aten.dot: lambda a, k, out: 2 * _numel(a[0].shape),
    aten.vdot: lambda a, k, out: 2 * _numel(a[0].shape),
    aten._trilinear: lambda a, k, out: _trilinear(a),
    aten.mkldnn_rnn_layer: lambda a, k, out: _rnn_layer(a[0], a[1], a[2]),
    # dgrad (input and hidden state) and wgrad (both weights): twice the forward
    aten.mkldnn_rnn_layer_backward: lambda a, k, out: 2 * _rnn_layer(a[0], a[1], a[2]),
    aten._scaled_dot_product_flash_attention_for_cpu: lambda a, k, out: _sdpa_forward(*a[:3]),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: lambda a, k, out: _sdpa_backward(
        *a[1:4]
    ),
    aten._scaled_dot_product_fused_attention_overrideable: lambda a, k, out: _sdpa_forward(*a[:3]),
    aten._scaled_dot_product_fused_attention_overrideable_backward: (
        lambda a, k, out: _sdpa_backward(*a[1:4])
    ),
    aten.mkldnn_convolution: lambda a, k, out: flop_counter.conv_flop_count(
        list(a[0].shape), list(a[1].shape), list(out.shape), transposed=False
    ),
}
"""The GEMM-like aten ops the audit counts, each with its FLOP formula ``(args, kwargs,
output) -> FLOPs``; convolutions and the CUDA attention kernels are
``torch.utils.flop_counter``'s."""

for _packet in (
    aten.convolution, aten._convolution, aten.convolution_overrideable, aten.cudnn_convolution,
    aten._slow_conv2d_forward, aten.convolution_backward,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_cudnn_attention,
    aten._scaled_dot_product_cudnn_attention_backward,
    aten._flash_attention_forward, aten._flash_attention_backward,
    aten._efficient_attention_forward, aten._efficient_attention_backward,
):  # fmt: skip
    GEMM_OPS[_packet] = _registry(_packet)

for _name in ("_grouped_mm", "_scaled_grouped_mm"):  # torch >= 2.8 (MoE grouped GEMMs)
    if hasattr(aten, _name):
        GEMM_OPS[getattr(aten, _name)] = lambda a, k, out: _grouped(a[0], a[1], out)

# Ops that look like GEMMs by name but are not: pointwise cell updates, the SDPA backend choice.
_NOT_GEMMS = frozenset({
    "_thnn_fused_lstm_cell", "_thnn_fused_lstm_cell_backward_impl",
    "_thnn_fused_lstm_cell_backward", "_thnn_fused_gru_cell", "_thnn_fused_gru_cell_backward",
    "_fused_sdp_choice", "_convert_weight_to_int4pack", "_cudnn_rnn_flatten_weight",
})  # fmt: skip
_GEMM_NAME = re.compile(
    r"(^|_)(\w*mm|mv|addmv|dot|vdot|matmul|conv\w*|\w*attention\w*|rnn|lstm|gru|\w*linear"
    r"|einsum|gemm|transformer)(_|$)"
)


def looks_like_gemm(packet_name: str) -> bool:
    """An aten op not in :data:`GEMM_OPS` whose name says it may multiply matrices."""
    return packet_name not in _NOT_GEMMS and bool(_GEMM_NAME.search(packet_name))
