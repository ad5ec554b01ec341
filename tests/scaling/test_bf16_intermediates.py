"""BF16 where the reference rounds to BF16 (issue 42 item 4), on bf16 models.

- Transformer Engine's NVFP4 weight-gradient operands: the random Hadamard transform's
  output is written in the input's type (its fused kernel, the unfused path, and the
  Python reference ``custom_recipes/reference_nvfp4.py``: ``x_mat @ (H * scale)`` in
  ``x.dtype``) and then quantized: the reference here is the transform in float64,
  rounded once to bf16, then TE's NVFP4 cast (``te_nvfp4_reference``, written from TE).
- Block scaling's ``value_for_inf`` is the *input* type's max
  (``compute_scale_from_types``): an emulated bf16 layer's operands reach the quantizer
  as bf16 values, so a block whose quotient overflows gets bf16's max, not FLT_MAX.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch
from torch import nn

from floatguard.emulation import EmulatedLinear, EmulationRecipe

from .test_nvfp4_te import te_nvfp4_reference
from .test_nvfp4_training import TE_SIGNS, hadamard


def rht_bf16(t: torch.Tensor) -> torch.Tensor:
    """t [R, M] (bf16, M a multiple of 16): each 16-block along M times D H / 4, exact
    in float64, rounded once to bf16, as float32."""
    r = torch.diag(torch.tensor(TE_SIGNS, dtype=torch.float64)) @ hadamard(16)
    out = t.double().reshape(t.shape[0], -1, 16) @ r
    return out.reshape(t.shape).to(torch.bfloat16).float()


def rht_f32(t: torch.Tensor) -> torch.Tensor:
    r = torch.diag(torch.tensor(TE_SIGNS, dtype=torch.float64)) @ hadamard(16)
    return (t.double().reshape(t.shape[0], -1, 16) @ r).reshape(t.shape).float()


def test_nvfp4_wgrad_operands_are_quantized_from_the_bf16_rounded_transform() -> None:
    torch.manual_seed(0)
    m = 64
    lin = nn.Linear(48, 32, bias=False).to(torch.bfloat16)
    x = (torch.randn(m, 48) * torch.logspace(-2, 1, m)[:, None]).to(torch.bfloat16)
    g = (torch.randn(m, 32) * 1e-2).to(torch.bfloat16)
    layer = EmulatedLinear(lin, EmulationRecipe.nvfp4_training(stochastic=False))
    layer(x.requires_grad_()).backward(g)
    gt, xt = g.T.contiguous(), x.detach().T.contiguous()
    qg = te_nvfp4_reference(rht_bf16(gt), (1, 16))[0]
    qx = te_nvfp4_reference(rht_bf16(xt), (1, 16))[0]
    want = (qg @ qx.T).to(torch.bfloat16)
    assert lin.weight.grad is not None and torch.equal(lin.weight.grad, want)
    # the transform kept in float32 (what floatguard did) quantizes to other codes
    qx32 = te_nvfp4_reference(rht_f32(xt), (1, 16))[0]
    assert not torch.equal(qx32, qx)


def test_block_value_for_inf_is_bf16s_max_on_a_bf16_layer() -> None:
    """A 1x128 tile of X whose amax is so small that 448 / amax overflows float32: TE
    scales it by bf16's max (0x7f7f0000) on a bf16 layer; W is the identity (exact in
    e4m3), so Y = the quantized X."""
    bf16_max = float(torch.finfo(torch.bfloat16).max)
    tiny = torch.full((1, 128), 34.1 / 3.4028234663852886e38).to(torch.bfloat16)
    tiny[0, ::2] *= -0.7
    lin = nn.Linear(128, 128, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(128))
    y = EmulatedLinear(lin, EmulationRecipe.hybrid_block())(tiny)

    def ref(scale: float) -> torch.Tensor:
        s = np.float32(scale)
        xs = tiny.float().numpy() * s
        q = np.clip(xs, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) / s
        return torch.from_numpy(q).to(torch.bfloat16)

    assert torch.equal(y, ref(bf16_max))
    assert not torch.equal(ref(bf16_max), ref(3.4028234663852886e38))  # the test can fail
