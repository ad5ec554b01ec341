"""nn.Conv1d/2d emulated as the implicit GEMMs they are, and the attention matmuls of
scaled_dot_product_attention, checked against torch's own conv and SDPA (with a
pass-through recipe the emulation must *be* the op) and against references written
from the formula (tensorwise scales do not depend on layout)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from floatguard.emulation import (
    EmulatedConv,
    EmulationRecipe,
    QuantResult,
    TensorRecipe,
    Tensorwise,
    emulate,
    emulated_sdpa,
    restore,
)


class PassThrough(TensorRecipe):
    """Quantizes nothing: the emulated op must then equal torch's op."""

    def __call__(self, x: torch.Tensor) -> QuantResult:
        return QuantResult(x, torch.ones(()), torch.zeros((), dtype=torch.long))


EXACT = EmulationRecipe(PassThrough(), PassThrough(), PassThrough())
TW = EmulationRecipe(Tensorwise("e4m3fn"), Tensorwise("e4m3fn"), Tensorwise("e5m2"))

CONVS = [
    lambda: nn.Conv2d(4, 6, 3),
    lambda: nn.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
    lambda: nn.Conv2d(4, 8, 3, groups=2, padding="same", bias=False),
    lambda: nn.Conv2d(4, 4, 4, padding="same", padding_mode="reflect"),  # asymmetric same
    lambda: nn.Conv2d(4, 6, 3, padding=1, padding_mode="circular"),
    lambda: nn.Conv2d(4, 6, 3, padding="valid"),
    lambda: nn.Conv1d(4, 6, 5, stride=2, padding=2),
    lambda: nn.Conv1d(4, 4, 3, groups=4, padding=1, padding_mode="replicate"),
]


@pytest.mark.parametrize("make", CONVS, ids=range(len(CONVS)))
@pytest.mark.parametrize("unbatched", [False, True])
def test_emulated_conv_is_the_conv_when_nothing_is_quantized(make: object, unbatched: bool) -> None:
    torch.manual_seed(0)
    conv = make()  # type: ignore[operator]
    shape = (4, 11, 9) if isinstance(conv, nn.Conv2d) else (4, 13)
    x = torch.randn(shape if unbatched else (2, *shape), requires_grad=True)
    want = conv(x)
    emu = EmulatedConv(conv, EXACT)
    got = emu(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(want)
    (gx_want, gw_want) = torch.autograd.grad(want, (x, conv.weight), g)
    (gx_got, gw_got) = torch.autograd.grad(got, (x, emu.weight), g)
    torch.testing.assert_close(gx_got, gx_want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw_got, gw_want, rtol=1e-5, atol=1e-5)


def test_emulated_conv_quantizes_the_gemm_operands() -> None:
    """Tensorwise scales do not depend on layout, so with stride 1 (every input element
    is in the unfolded GEMM operand) the emulation equals torch's conv of the quantized
    input and weight; the output gradient is quantized with the e5m2 recipe."""
    torch.manual_seed(1)
    conv = nn.Conv2d(3, 5, 3, padding=1)
    x = torch.randn(2, 3, 8, 8) * 3
    want = F.conv2d(
        Tensorwise()(x).values, Tensorwise()(conv.weight.detach()).values, conv.bias, padding=1
    )
    model = nn.Sequential(conv)
    covered = emulate(model, TW)
    assert list(covered) == ["0"] and isinstance(model[0], EmulatedConv)
    got = model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, F.conv2d(x, conv.weight, conv.bias, padding=1), atol=1e-3)
    xg = x.clone().requires_grad_()
    g = torch.randn(2, 5, 8, 8)
    model(xg).backward(g)
    gq = Tensorwise("e5m2")(g).values
    wq = Tensorwise()(conv.weight.detach()).values
    want_gx = torch.nn.grad.conv2d_input(x.shape, wq, gq, padding=1)
    torch.testing.assert_close(xg.grad, want_gx, rtol=1e-5, atol=1e-5)
    restore(model)
    assert type(model[0]) is nn.Conv2d and model[0] is conv


def _sdpa_cases() -> list[dict[str, object]]:
    b, h, n, e = 2, 4, 7, 16
    causal_bool = torch.ones(n, n, dtype=torch.bool).tril()
    float_mask = torch.zeros(n, n).masked_fill(~causal_bool, -math.inf)
    dead = causal_bool.clone()
    dead[3] = False  # a row with every key masked
    return [
        {"shape": (b, h, n, e)},
        {"shape": (b, h, n, e), "is_causal": True},
        {"shape": (b, h, n, e), "attn_mask": causal_bool, "scale": 0.3},
        {"shape": (b, h, n, e), "attn_mask": float_mask},
        {"shape": (b, h, n, e), "attn_mask": torch.randn(b, 1, n, n)},
        {"shape": (b, h, n, e), "attn_mask": dead},
        {"shape": (b, h, n, e), "kv_heads": 2, "enable_gqa": True},
    ]


@pytest.mark.parametrize("case", _sdpa_cases(), ids=range(7))
def test_emulated_sdpa_is_sdpa_when_nothing_is_quantized(case: dict[str, object]) -> None:
    torch.manual_seed(2)
    case = dict(case)
    b, h, n, e = case.pop("shape")  # type: ignore[misc]
    kv = int(case.pop("kv_heads", h))  # type: ignore[call-overload]
    q = torch.randn(b, h, n, e, requires_grad=True)
    k = torch.randn(b, kv, n, e, requires_grad=True)
    v = torch.randn(b, kv, n, e, requires_grad=True)
    want = F.scaled_dot_product_attention(q, k, v, **case)  # type: ignore[arg-type]
    got = emulated_sdpa(q, k, v, recipe=EXACT, **case)  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(want)
    gw = torch.autograd.grad(want, (q, k, v), g)
    gg = torch.autograd.grad(got, (q, k, v), g)
    for a, w in zip(gg, gw, strict=True):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-5)


def test_emulated_sdpa_quantizes_both_matmuls() -> None:
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 5, 8) * 2 for _ in range(3))
    tw = Tensorwise()
    s = tw(q).values @ tw(k).values.transpose(-2, -1) / math.sqrt(8)
    p = torch.softmax(s, -1)
    want = tw(p).values @ tw(v).values  # tensorwise: the layout of v does not matter
    got = emulated_sdpa(q, k, v, recipe=TW)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, F.scaled_dot_product_attention(q, k, v), atol=1e-3)


def test_attention_opt_in_on_a_transformer_layer_and_restore(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(4)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    x = torch.randn(2, 6, 32)
    mask = nn.Transformer.generate_square_subsequent_mask(6)
    layer.train()  # the fast path (no SDPA call) is for eval only
    want = layer(x, src_mask=mask, is_causal=True)
    cov = emulate(layer, EXACT, attention=True)
    # MultiheadAttention applies its projections' parameters itself (F.linear): covered
    # as one module, its out_proj child never swapped
    assert list(cov) == ["self_attn", "linear1", "linear2"] and not cov.attention  # none ran
    torch.testing.assert_close(layer(x, src_mask=mask, is_causal=True), want, rtol=1e-5, atol=1e-5)
    assert cov.attention and cov.left == {} and "scaled_dot_product_attention" in cov.summary()
    restore(layer)
    emulate(layer, TW, attention=True)
    lossy = layer(x, src_mask=mask, is_causal=True)
    assert not torch.allclose(lossy, want, atol=1e-3) and torch.isfinite(lossy).all()
    lossy.sum().backward()  # trains through the emulated attention
    assert layer.self_attn.in_proj_weight.grad is not None
    with pytest.raises(ValueError, match="already applied"):
        emulate(layer, TW, attention=True)
    restore(layer)
    torch.testing.assert_close(layer(x, src_mask=mask, is_causal=True), want, rtol=0, atol=0)
    # A model whose forward never calls SDPA: one warning, not silence.
    mlp = nn.Sequential(nn.Linear(4, 4))
    emulate(mlp, TW, attention=True)
    with caplog.at_level(logging.WARNING, logger="floatguard"):
        mlp(torch.randn(2, 4))
        mlp(torch.randn(2, 4))
    assert sum("called no scaled_dot_product_attention" in r.message for r in caplog.records) == 1
    restore(mlp)


class _CountingRecipe(TensorRecipe):
    """Quantizes nothing, counts the GEMM operands it is asked for."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> QuantResult:
        self.calls += 1
        return QuantResult(x, torch.ones(()), torch.zeros((), dtype=torch.long))


@pytest.mark.parametrize("training", [True, False])
def test_multihead_attention_projections_are_emulated_in_train_and_eval(training: bool) -> None:
    """nn.Transformer: every MultiheadAttention's in- and out-projection runs as an
    emulated GEMM, also in eval mode, where torch's fused fast paths would skip them."""
    torch.manual_seed(5)
    t = nn.Transformer(d_model=32, nhead=4, num_encoder_layers=1, num_decoder_layers=1,
                       dim_feedforward=64, dropout=0.0, batch_first=True)  # fmt: skip
    t.train(training)
    src, tgt = torch.randn(2, 7, 32), torch.randn(2, 5, 32)
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    with torch.no_grad():
        want = t(src, tgt, tgt_mask=mask)
    counter = _CountingRecipe()
    cov = emulate(t, EmulationRecipe(counter, PassThrough(), None))
    mha = [n for n, m in t.named_modules() if isinstance(m, nn.MultiheadAttention)]
    assert set(mha) <= set(cov) and len(mha) == 3 and "MultiheadAttention" not in cov.left
    with torch.no_grad():
        got = t(src, tgt, tgt_mask=mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the same GEMMs
    # 3 attention blocks x (in-projection: 1 packed self-attn or 2 for cross-attn, +
    # out-projection) + 4 feed-forward Linears: every one went through the recipe
    assert counter.calls == (2 + 2 + 3) + 4
    assert torch.backends.mha.get_fastpath_enabled()  # put back after the forward
    restore(t)
    lossy = emulate(t, TW)
    assert "decoder.layers.0.multihead_attn" in lossy
    with torch.no_grad():
        assert not torch.allclose(t(src, tgt, tgt_mask=mask), want, atol=1e-3)
    restore(t)
    with torch.no_grad():
        torch.testing.assert_close(t(src, tgt, tgt_mask=mask), want, rtol=0, atol=0)
