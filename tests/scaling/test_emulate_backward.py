"""The three GEMMs of an emulated layer, forward and backward, per preset.

Each preset's six operand quantizations are written out here from its reference (the
table in docs/fp8.md): the TensorRecipe objects are called directly on each operand in
its GEMM's layout (reduction dim last: X and W for fprop, dY and W^T for dgrad, dY^T and
X^T, tokens last, for wgrad), the three products are taken, and the emulated layer's
output, input gradient and weight gradient must equal them bit for bit. Shapes: M, N, K
multiples of 128 and not, 3-D inputs [B, T, K] (the tokens are B*T).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from floatguard.emulation import (
    MX,
    NVFP4,
    Block,
    EmulatedConv,
    EmulatedLinear,
    EmulationRecipe,
    QuantResult,
    Rowwise,
    TensorRecipe,
    Tensorwise,
    emulate,
    emulated_sdpa,
    restore,
)
from floatguard.emulation._gemm_tag import is_emulating

E4, E5 = "e4m3fn", "e5m2"
TE_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]  # TE get_wgrad_sign_vector


@dataclass(frozen=True)
class Ref:
    """One preset written out: the recipe of each operand (None: not quantized)."""

    fx: TensorRecipe | None  # fprop X [M, K]
    fw: TensorRecipe | None  # fprop W [N, K]
    dg: TensorRecipe | None  # dgrad dY [M, N]
    dw: TensorRecipe | None  # dgrad W^T [K, N]
    wg: TensorRecipe | None  # wgrad dY^T [N, M]
    wx: TensorRecipe | None  # wgrad X^T [K, M]
    acc: tuple[int, int] | None = None  # (mantissa bits, promotion interval)
    dw_from_fprop: bool = False  # dgrad's W is fprop's quantized W
    wx_from_fprop: bool = False  # wgrad's X is fprop's quantized X
    rht: bool = False  # 16-point RHT (TE's signs) of both wgrad operands along M


def q(recipe: TensorRecipe | None, t: torch.Tensor) -> torch.Tensor:
    return t if recipe is None else recipe(t).values.float()


def rne_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 rounded to ``bits`` mantissa bits, ties to even, on the bit pattern."""
    i = x.contiguous().view(torch.int32)
    drop = 23 - bits
    i = (i + ((1 << (drop - 1)) - 1) + ((i >> drop) & 1)) & ~((1 << drop) - 1)
    return i.view(torch.float32)


def mm(a: torch.Tensor, b: torch.Tensor, acc: tuple[int, int] | None) -> torch.Tensor:
    """a @ b.T, or with partial sums per chunk of the reduction rounded (DeepSeek-V3)."""
    if acc is None:
        return a @ b.T
    bits, every = acc
    out = rne_bits(a[:, :every] @ b[:, :every].T, bits)
    for s in range(every, a.shape[1], every):
        out = out + rne_bits(a[:, s : s + every] @ b[:, s : s + every].T, bits)
    return out


def hadamard16() -> torch.Tensor:
    """Sylvester's 16x16 Hadamard matrix / 4: entry (i, j) is (-1)**popcount(i & j) / 4."""
    i = torch.arange(16)
    both = i[:, None] & i[None, :]
    pop = sum((both >> b) & 1 for b in range(4))
    return (1.0 - 2.0 * (pop % 2)).double() / 4  # type: ignore[union-attr]


def rht_tokens(t: torch.Tensor) -> torch.Tensor:
    """t [R, M]: M zero-padded to a multiple of 16, each 16-block times diag(s) H."""
    pad = (-t.shape[1]) % 16
    t = torch.nn.functional.pad(t, (0, pad))
    r = torch.diag(torch.tensor(TE_SIGNS, dtype=torch.float64)) @ hadamard16()
    return (t.double().reshape(t.shape[0], -1, 16) @ r).reshape(t.shape).float()


def reference(
    ref: Ref, x2: torch.Tensor, w: torch.Tensor, g2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Y, dX, dW) of ``Y = X W^T``; the stochastic draws in the emulation's order."""
    xq, wq = q(ref.fx, x2), q(ref.fw, w)
    y = mm(xq, wq, ref.acc)
    w_src = wq if ref.dw_from_fprop else w
    dx = mm(q(ref.dg, g2), q(ref.dw, w_src.T.contiguous()), ref.acc)
    x_src = xq if ref.wx_from_fprop else x2
    gt, xt = g2.T.contiguous(), x_src.T.contiguous()
    if ref.rht:
        gt, xt = rht_tokens(gt), rht_tokens(xt)
    dw = mm(q(ref.wg, gt), q(ref.wx, xt), ref.acc)
    return y, dx, dw


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if torch.equal(got, want):
        return
    bad = (got != want).nonzero()[0].tolist()
    raise AssertionError(
        f"{what}: first difference at {bad}: {got[tuple(bad)].item()!r} != "
        f"{want[tuple(bad)].item()!r} ({int((got != want).sum())} of {got.numel()} differ)"
    )


B1 = Block(E4, (1, 128))
B128 = Block(E4, (128, 128))
TAO = Rowwise(E4, power_of_two=True, eps=1e-12)
DG1 = Block(E4, (1, 128), "fp32", 1e-4, "decode_mul")  # per_token / per_channel_cast_to_fp8
DG128 = Block(E4, (128, 128), "fp32", 1e-4, "decode_mul")  # per_block_cast_to_fp8
DU1 = Block(E4, (1, 128), "pow2", 1e-4, "decode_mul")  # the same, UE8M0
DU128 = Block(E4, (128, 128), "pow2", 1e-4, "decode_mul")
MXR = MX(E4, 32, "rceil")
MXF = MX(E4, 32, "floor")
NV, NV2 = NVFP4(), NVFP4(two_d=True)
NVSR = NVFP4(rounding="stochastic")

PRESETS: list[tuple[str, EmulationRecipe, Ref]] = [
    ("hybrid_tensorwise", EmulationRecipe.hybrid_tensorwise(), Ref(
        Tensorwise(E4), Tensorwise(E4), Tensorwise(E5), Tensorwise(E4), Tensorwise(E5),
        Tensorwise(E4))),
    ("hybrid_rowwise", EmulationRecipe.hybrid_rowwise(), Ref(
        Rowwise(E4), Rowwise(E4), Rowwise(E5), Rowwise(E4), Rowwise(E5), Rowwise(E4))),
    ("torchao_rowwise", EmulationRecipe.torchao_rowwise(), Ref(TAO, TAO, TAO, TAO, TAO, TAO)),
    # torchao/float8/config.py, ROWWISE_WITH_GW_HP: W tensor-wise for grad_input, and
    # grad_weight from the high-precision input and grad_output
    ("torchao_rowwise_with_gw_hp", EmulationRecipe.torchao_rowwise_with_gw_hp(), Ref(
        TAO, TAO, TAO, Tensorwise(E4, power_of_two=True, eps=1e-12), None, None)),
    # TE's default Float8BlockScaling(): Format.E4M3 (gradients too), power-of-two scales
    ("te_block_scaling", EmulationRecipe.te_block_scaling(), Ref(
        Block(E4, (1, 128), "pow2"), Block(E4, (128, 128), "pow2"), Block(E4, (1, 128), "pow2"),
        Block(E4, (128, 128), "pow2"), Block(E4, (1, 128), "pow2"), Block(E4, (1, 128), "pow2"))),
    ("hybrid_block", EmulationRecipe.hybrid_block(), Ref(
        B1, B128, Block(E5, (1, 128)), B128, Block(E5, (1, 128)), B1)),
    ("hybrid_block_pow2", EmulationRecipe.hybrid_block("pow2"), Ref(
        Block(E4, (1, 128), "pow2"), Block(E4, (128, 128), "pow2"), Block(E5, (1, 128), "pow2"),
        Block(E4, (128, 128), "pow2"), Block(E5, (1, 128), "pow2"), Block(E4, (1, 128), "pow2"))),
    ("deepseek_v3", EmulationRecipe.deepseek_v3(), Ref(
        B1, B128, B1, B128, B1, B1, acc=(13, 128), wx_from_fprop=True)),
    ("deepgemm", EmulationRecipe.deepgemm(), Ref(DG1, DG128, DG1, DG128, DG1, DG1)),
    ("deepgemm_ue8m0", EmulationRecipe.deepgemm(ue8m0=True), Ref(
        DU1, DU128, DU1, DU128, DU1, DU1)),
    ("mxfp8", EmulationRecipe.mxfp8(), Ref(MXR, MXR, MXR, MXR, MXR, MXR)),
    ("mxfp8_floor", EmulationRecipe.mxfp8("floor"), Ref(MXF, MXF, MXF, MXF, MXF, MXF)),
    ("nvfp4", EmulationRecipe.nvfp4(), Ref(
        NV, NV, None, None, None, None, dw_from_fprop=True, wx_from_fprop=True)),
    ("nvfp4_training", EmulationRecipe.nvfp4_training(), Ref(
        NV, NV2, NVSR, NV2, NVSR, NV, rht=True)),
    ("nvfp4_training_no_sr", EmulationRecipe.nvfp4_training(stochastic=False), Ref(
        NV, NV2, NV, NV2, NV, NV, rht=True)),
]  # fmt: skip

# (B, T, K, N): tokens, in and out features multiples of 128, then none of them
SHAPES = [(2, 128, 256, 128), (3, 50, 136, 72)]


def _layer_and_data(b: int, t: int, k: int, n: int) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    lin = nn.Linear(k, n)
    # Magnitudes spread over channels and over tokens (4 decades): blocks along K and
    # blocks along M see different ranges, even with power-of-two scales.
    tokens = torch.logspace(-2, 2, b * t).reshape(b, t, 1)[:, torch.randperm(t)]
    x = torch.randn(b, t, k) * torch.logspace(-1, 1, k) * tokens
    g = torch.randn(b, t, n) * torch.logspace(-5, -2, n) * tokens.flip(1)
    return lin, x, g


@pytest.mark.parametrize("shape", SHAPES, ids=["aligned", "unaligned"])
@pytest.mark.parametrize(("name", "recipe", "ref"), PRESETS, ids=[p[0] for p in PRESETS])
def test_the_three_gemms_are_the_recipes_own_quantizers(
    name: str, recipe: EmulationRecipe, ref: Ref, shape: tuple[int, int, int, int]
) -> None:
    lin, x, g = _layer_and_data(*shape)
    emu = EmulatedLinear(lin, recipe)
    xg = x.clone().requires_grad_()
    torch.manual_seed(7)  # the stochastic draws (nvfp4_training) are replayed below
    y = emu(xg)
    y.backward(g)
    assert xg.grad is not None and lin.weight.grad is not None
    x2, g2, w = x.reshape(-1, shape[2]), g.reshape(-1, shape[3]), lin.weight.detach()
    torch.manual_seed(7)
    y_ref, dx_ref, dw_ref = reference(ref, x2, w, g2)
    assert_same_bits(y.detach(), (y_ref + lin.bias.detach()).reshape(y.shape), f"{name} Y")
    assert_same_bits(xg.grad, dx_ref.reshape(x.shape), f"{name} dX")
    assert_same_bits(lin.weight.grad, dw_ref, f"{name} dW")


@pytest.mark.parametrize(
    ("name", "share"),
    [("hybrid_block", 0.5), ("hybrid_rowwise", 0.5), ("deepgemm", 0.5),
     ("nvfp4_training_no_sr", 0.5), ("mxfp8", 0.005)],
)  # fmt: skip
def test_wgrad_is_not_the_forward_quantization_reused(name: str, share: float) -> None:
    """The old backward (dY quantized once along N, X's forward K-blocks reused for
    wgrad) gives another dW, past float32 accumulation rounding (M u sum |dY^T| |X|)
    in at least ``share`` of its elements: the test above tells the two apart. (MXFP8's
    power-of-two scales only differ where a block pushes values into subnormals.)"""
    ref = next(p[2] for p in PRESETS if p[0] == name)
    lin, x, g = _layer_and_data(*SHAPES[1])
    x2, g2, w = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1]), lin.weight.detach()
    _, _, dw_ref = reference(ref, x2, w, g2)
    old = q(ref.dg, g2).T @ q(ref.fx, x2)
    bound = x2.shape[0] * 2**-23 * (g2.abs().T @ x2.abs())
    differ = float(((old - dw_ref).abs() > bound).float().mean())
    assert differ >= share, f"{name}: {differ:.2%} of dW beyond rounding"


def test_defaults_derive_the_backward_operands() -> None:
    """EmulationRecipe(activation, weight, grad): every GEMM quantizes X with
    activation, W with weight and dY with grad ('auto'), re-derived on replace()."""
    a, w, g = Block(E4, (1, 128)), Block(E4, (128, 128)), Block(E5, (1, 128))
    r = EmulationRecipe(a, w, g)
    assert r.operands() == {
        "fprop_input": a, "fprop_weight": w, "dgrad_grad": g, "dgrad_weight": w,
        "wgrad_grad": g, "wgrad_input": a,
    }  # fmt: skip
    g2 = Tensorwise(E5)
    assert dataclasses.replace(r, grad=g2).operands()["wgrad_grad"] == g2
    r2 = EmulationRecipe(a, w, g, wgrad_grad=None, dgrad_weight=Tensorwise())
    ops = r2.operands()
    assert ops["wgrad_grad"] is None and ops["dgrad_grad"] == g
    assert ops["dgrad_weight"] == Tensorwise()
    assert EmulationRecipe.nvfp4().operands()["wgrad_input"] is None


def test_the_old_constructor_with_tensorwise_scales_computes_what_it_did() -> None:
    """Tensor-wise scales do not depend on layout: dgrad and wgrad on fresh copies equal
    0.1's reuse of the forward's quantized X and W (and dY quantized once)."""
    lin, x, g = _layer_and_data(2, 8, 40, 24)
    xg = x.clone().requires_grad_()
    tw4, tw5 = Tensorwise(E4), Tensorwise(E5)
    EmulatedLinear(lin, EmulationRecipe(tw4, tw4, tw5))(xg).backward(g)
    xq, wq, gq = tw4(x).values, tw4(lin.weight.detach()).values, tw5(g).values
    assert xg.grad is not None and lin.weight.grad is not None
    torch.testing.assert_close(xg.grad, gq @ wq, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(
        lin.weight.grad, gq.reshape(-1, 24).T @ xq.reshape(-1, 40), rtol=1e-6, atol=1e-9
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"wgrad_input_from": "fp8"}, ValueError, "wgrad_input_from='fp8'; use one of"),
        ({"dgrad_weight_from": "x"}, ValueError, "dgrad_weight_from='x'"),
        ({"wgrad_rht": 12}, ValueError, "wgrad_rht=12 must be None or a power of two"),
        ({"wgrad_rht": 32}, ValueError, "pass rht_seed="),
        ({"dgrad_grad": "same"}, TypeError, "dgrad_grad='same' must be a TensorRecipe"),
        ({"skip": "head"}, TypeError, "skip='head' must be None, a tuple"),
        ({"accumulate_every": 0}, ValueError, "accumulate_every=0"),
    ],
)
def test_bad_fields_are_named(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        EmulationRecipe(Tensorwise(), Tensorwise(), None, **kwargs)
    with pytest.raises(TypeError, match=r"activation='auto' must be a TensorRecipe, None"):
        EmulationRecipe("auto", Tensorwise())  # type: ignore[arg-type]
    EmulationRecipe(Tensorwise(), Tensorwise(), wgrad_rht=32, rht_seed=1)  # fine


def test_a_conv_is_the_same_gemm_with_im2col_tokens() -> None:
    """EmulatedConv's wgrad reduces over batch x positions, blocks along them."""
    torch.manual_seed(3)
    conv = nn.Conv2d(4, 6, 3, bias=False)
    x = torch.randn(2, 4, 12, 12) * 2
    g = torch.randn(2, 6, 10, 10)
    recipe = EmulationRecipe.hybrid_block()
    y = EmulatedConv(conv, recipe)(x)
    y.backward(g)
    cols = torch.nn.functional.unfold(x, 3).transpose(1, 2).reshape(-1, 36)  # [N*L, C*k]
    g2 = g.reshape(2, 6, 100).transpose(1, 2).reshape(-1, 6)  # [N*L, out]
    w = conv.weight.detach().reshape(6, 36)
    _, _, dw = reference(next(p[2] for p in PRESETS if p[0] == "hybrid_block"), cols, w, g2)
    assert conv.weight.grad is not None
    assert_same_bits(conv.weight.grad.reshape(6, 36), dw, "conv dW")


class _Shapes(TensorRecipe):
    """Quantizes nothing; records the shape of every operand it is given."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, ...]] = []

    def __call__(self, x: torch.Tensor) -> QuantResult:
        self.seen.append(tuple(x.shape))
        return QuantResult(x, torch.ones(()), torch.zeros((), dtype=torch.long))


def test_multihead_attention_projections_get_the_same_backward() -> None:
    """nn.MultiheadAttention's F.linear path is the emulated GEMM: its wgrad X is the
    tokens-last X^T [E, B*T]."""
    torch.manual_seed(4)
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    wx = _Shapes()
    model = nn.Sequential(mha)
    emulate(model, EmulationRecipe(None, None, None, wgrad_input=wx))
    x = torch.randn(3, 5, 16)
    out, _ = mha(x, x, x, need_weights=False)
    out.sum().backward()
    assert wx.seen == [(16, 15), (16, 15)]  # out-projection, then the packed in-projection
    restore(model)


class _GemmLog(TorchDispatchMode):
    """Every GEMM-like aten op run, and whether it ran inside emulated_gemm()."""

    GEMMS = ("mm", "addmm", "bmm", "baddbmm")

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in self.GEMMS:
            self.log.append((name, is_emulating()))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("recipe", "n_gemms"),
    [
        (EmulationRecipe.hybrid_block(), 3),
        (EmulationRecipe.deepseek_v3(), 2 + 2 + 3),  # K=256, N=200, M=384 in 128-chunks
        (EmulationRecipe.nvfp4_training(), 3),  # the RHT is a butterfly, not a matmul
    ],
    ids=["block", "deepseek_v3", "nvfp4_training"],
)
def test_every_gemm_runs_inside_emulated_gemm(recipe: EmulationRecipe, n_gemms: int) -> None:
    torch.manual_seed(5)
    emu = EmulatedLinear(nn.Linear(256, 200), recipe)
    x = torch.randn(3, 128, 256, requires_grad=True)
    with _GemmLog() as mode:
        emu(x).sum().backward()
    assert len(mode.log) == n_gemms and all(inside for _, inside in mode.log), mode.log
    q_, k_, v_ = (torch.randn(2, 2, 6, 8, requires_grad=True) for _ in range(3))
    with _GemmLog() as mode:
        emulated_sdpa(q_, k_, v_, recipe=EmulationRecipe.hybrid_tensorwise()).sum().backward()
    # q k^T and P v, and their four backward matmuls
    assert len(mode.log) == 6 and all(inside for _, inside in mode.log), mode.log
