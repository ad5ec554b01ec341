"""NVFP4: 16-element e2m1 blocks with e4m3 block scales under one float32 tensor scale.

Transformer Engine's arithmetic, in its order (each step one float32 rounding):
``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``
(``NVFP4QuantizerRef._quantize_blockwise_reference``) and the CUDA kernel
(``transformer_engine/common/cast/nvfp4/core_nvfp4.cuh``:
``compute_global_encode_scaling_factor_FP4``, ``compute_decoding_scaling_factor``;
``quantize_transpose_nvfp4.cuh``: ``block_scale_inverse``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from floatguard.emulation._core import (
    FLT_MAX,
    QuantResult,
    TensorRecipe,
    _blocks_last,
    _f32_quotient,
    tensor_to_amax,
)
from floatguard.formats.registry import get
from floatguard.formats.rounding import quantize

__all__ = ["NVFP4", "NVFP4Rounding"]

NVFP4Rounding = Literal["nearest", "stochastic"]
_E2M1_MAX = 6.0
_E4M3_MAX = 448.0


@dataclass(frozen=True)
class NVFP4(TensorRecipe):
    """NVIDIA NVFP4 as Transformer Engine quantizes it: 16-element blocks of e2m1, each
    with an e4m3 scale, under one float32 tensor scale. In TE's operation order, each
    step rounded once to float32 (``fl``):

    - tensor scale ``S = fl(2688 / amax_tensor)`` (2688 = 6 * 448; a correctly rounded
      division); ``FLT_MAX`` where it overflows, ``1.0`` for an amax of 0 or inf (TE's
      ``compute_global_encode_scaling_factor_FP4``); both counted in ``fallbacks``.
      Its decode scale ``D = fl(1 / S)``;
    - a block's stored scale ``e4m3(fl(amax_block * fl(S * fl(1/6))))``, saturating at
      448 (TE folds 1/6 into the tensor scale; ``amax_block / 6 * S`` rounds
      differently); its decode scale ``dec = fl(stored * D)``;
    - elements ``e2m1(fl(x * enc))`` with ``enc = min(fl(1 / dec), FLT_MAX)``,
      saturating at +-6, nearest-even (or stochastic); values come back as
      ``fl(q * dec)``, the inverse of the encoding. (TE's ``dequantize_fp4_kernel`` and
      its GEMM decode with ``amax / 2688`` in place of ``D``: the same value within an
      ulp or two, except where S fell back.)

    Edges, all as TE computes them: a block whose e4m3 scale rounds to 0 gets
    ``enc = FLT_MAX`` and decodes to zeros that keep their sign (``-0.0`` and negative
    tiny inputs give ``-0.0``). A tensor whose amax is below ``2688 / FLT_MAX`` (~7.9e-36)
    gets ``S = FLT_MAX``; ``D`` is then subnormal and many of its values flush to zero.
    An inf element makes ``S = 1.0`` and saturates to ``6 * stored``.

    NaN: the tensor and block amaxes skip NaN elements (TE's kernels reduce with
    ``fmaxf``), so the scales, and every other value of the tensor, of the block and of
    the other rows of a 2-D tile, are what they would be with the NaN at 0; the NaN
    element itself comes back NaN (e2m1 has no NaN code, a NaN input still gives NaN
    out: TE's reference table would store code 0). ``QuantResult.nan_skipped`` counts
    them. TE's PyTorch reference uses ``torch.amax``, which would make every scale NaN.

    ``two_d``: square ``block x block`` tiles over the last two dims (a 2-D weight's
    16x16 tiles, as NVIDIA's NVFP4 training recipe scales weights so that W and W^T
    quantize alike); otherwise 1 x ``block`` along the last dim (activations, gradients).
    ``rounding="stochastic"``: the e2m1 elements round stochastically (the recipe's
    choice for gradients); the scales still round to nearest. The draws come from
    torch's default generator (seed it with ``torch.manual_seed``). Stochastic rounding
    is unbiased except at a saturated block maximum: when the block's e4m3 scale rounds
    down, its largest magnitude lands above 6 and saturates there, and no draw can round
    it up, so it is biased toward zero. On Gaussian data (512 x 1024, 64 draws) the block
    maxima come out 1.14% small on average and the other elements within 0.01%, 0.19%
    of the magnitude overall (measured here; ``tests/scaling/test_nvfp4_training.py``
    checks the sign and size).

    ``scales``: ``S``, then every stored e4m3 block scale (as float32). No sync."""

    block: int = 16
    two_d: bool = False
    rounding: NVFP4Rounding = "nearest"

    def __post_init__(self) -> None:
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"NVFP4.block={self.block!r} must be a positive int")
        if self.rounding not in get_args(NVFP4Rounding):
            raise ValueError(f"NVFP4.rounding={self.rounding!r}; use 'nearest' or 'stochastic'")

    def _tiles(
        self, xf: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]]:
        """(tiles, the dims a tile spans, a function back to x's shape)."""
        if not self.two_d:
            blocks, _ = _blocks_last(xf, self.block)
            cols = xf.shape[-1]

            def back_1d(q: torch.Tensor) -> torch.Tensor:
                return q.reshape(*q.shape[:-2], -1)[..., :cols].reshape(xf.shape)

            return blocks, (-1,), back_1d
        x2 = xf.reshape(-1, xf.shape[-1]) if xf.dim() >= 2 else xf.reshape(1, -1)
        rows, cols = x2.shape
        b = self.block
        pr, pc = (-rows) % b, (-cols) % b
        xp = torch.nn.functional.pad(x2, (0, pc, 0, pr))
        tiles = xp.reshape((rows + pr) // b, b, (cols + pc) // b, b)

        def back_2d(q: torch.Tensor) -> torch.Tensor:
            return q.reshape(rows + pr, cols + pc)[:rows, :cols].reshape(xf.shape)

        return tiles, (1, 3), back_2d

    def __call__(self, x: torch.Tensor) -> QuantResult:
        e2m1, e4m3 = get("e2m1fn"), get("e4m3fn")
        xf = x.float()
        amax_t = tensor_to_amax(xf, nan_policy="skip_elements")
        s_enc, fell = _tensor_scale(amax_t)
        s_dec = torch.div(torch.ones_like(s_enc), s_enc)  # D = fl(1 / S)
        mult = s_enc * torch.div(torch.ones_like(s_enc), _E2M1_MAX)  # fl(S * fl(1/6))
        tiles, dims, back = self._tiles(xf)
        amax_b = tensor_to_amax(tiles, dims, keepdim=True, nan_policy="skip_elements")
        # fminf(.., FLT_MAX) in TE's transposing cast; e4m3 then saturates at 448.
        b_dec = torch.clamp(amax_b * mult, max=FLT_MAX)
        stored = quantize(b_dec, e4m3, overflow="saturate")
        dec = stored * s_dec  # the block's decode scale, fl(stored * D)
        # 1 / 0 = inf for an underflowed block scale: FLT_MAX, so its zeros keep their sign
        enc = torch.clamp(torch.div(torch.ones_like(dec), dec), max=FLT_MAX)
        q = quantize(tiles * enc, e2m1, rounding=self.rounding, overflow="saturate")
        values = back(q * dec).to(x.dtype)  # NaN * dec stays NaN; -0 * dec stays -0
        scales = torch.cat([s_enc.reshape(1), stored.reshape(-1)])
        return QuantResult(values, scales, fell.to(torch.int64), torch.isnan(xf).sum())


def _tensor_scale(amax_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """S = fl(2688 / amax): FLT_MAX where it overflows, 1.0 for an amax of 0 or inf
    (``compute_global_encode_scaling_factor_FP4``); and whether it fell back."""
    q, overflow = _f32_quotient(_E2M1_MAX * _E4M3_MAX, amax_t)
    ok = torch.isfinite(amax_t) & (amax_t > 0)
    s = torch.where(overflow, torch.full_like(q, FLT_MAX), q).to(torch.float32)
    s = torch.where(ok, s, torch.ones_like(s))
    return s, ~ok | overflow
