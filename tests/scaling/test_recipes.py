"""Scale formulas against the references (TE, torchao, OCP MX, NVFP4), and the amax policy."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from floatguard.emulation import (
    MX,
    NVFP4,
    Block,
    Delayed,
    EMAScaler,
    Rowwise,
    Tensorwise,
    amax_to_scale,
    quant_metrics,
)
from floatguard.formats import FORMATS, quantize

E4M3_MAX = 448.0


# ---- references, written from the published formulas -------------------------------
def te_scale(amax: float, prev: float, fp8_max: float, margin: int = 0) -> float:
    """Transformer Engine: (fp8_max / amax) / 2**margin, keeping the previous scale when
    amax is 0 or not finite."""
    if not math.isfinite(amax) or amax <= 0:
        return prev
    return (fp8_max / amax) / 2.0**margin


def torchao_scale(amax: float, fp8_max: float, pow2: bool = False) -> float:
    """torchao tensorwise: fp8_max / clamp(amax, min=1e-12) in float32, optionally floored to
    a power of two."""
    s = float(
        torch.tensor(fp8_max, dtype=torch.float32) / torch.clamp(torch.tensor(amax), min=1e-12)
    )
    if pow2 and s > 0 and math.isfinite(s):
        s = 2.0 ** math.floor(math.log2(s))
    return s


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def mx_exponent_ref(amax: float, elem: str, mode: str) -> float:
    """OCP MX / torchao scale exponents from the float32 bit pattern of amax."""
    f = FORMATS[elem]
    target = math.floor(math.log2(f.max))
    if math.isnan(amax):
        return math.nan
    if amax == 0:
        return -127.0
    if mode == "rceil":
        r = struct.unpack("<f", struct.pack("<f", amax / f.max))[0]
        x = math.ceil(math.log2(r)) if r != 2.0 ** round(math.log2(r)) else round(math.log2(r))
        return float(max(-127, min(127, x)))
    bits = f32_bits(amax)
    if mode == "even":  # round half up at the element's mantissa width, keep only the exponent
        bits = (bits + (1 << (23 - f.mantissa_bits - 1))) & (0x1FF << 23)
    pow2 = ((bits >> 23) & 0xFF) - 127
    if mode == "ceil" and (bits & 0x7FFFFF):
        pow2 += 1
    return float(max(-127, min(127, pow2 - target)))


# ---- tests ---------------------------------------------------------------------------
AMAXES = [1e-3, 0.37, 1.0, 2.0, 3.0, 448.0, 500.0, 6e4, 1e-30, 3.4e38]


@pytest.mark.parametrize("amax", AMAXES)
def test_current_scaling_matches_te_and_torchao(amax: float) -> None:
    a = torch.tensor(amax)
    assert float(amax_to_scale(a, "e4m3fn")) == pytest.approx(
        te_scale(amax, 1.0, E4M3_MAX), rel=1e-6
    )
    assert float(amax_to_scale(a, "e4m3fn", eps=1e-12)) == pytest.approx(
        torchao_scale(amax, E4M3_MAX), rel=1e-6
    )
    assert float(amax_to_scale(a, "e4m3fn", eps=1e-12, power_of_two=True)) == pytest.approx(
        torchao_scale(amax, E4M3_MAX, pow2=True), rel=1e-6
    )
    assert float(amax_to_scale(a, "e5m2", margin=2)) == pytest.approx(
        te_scale(amax, 1.0, 57344.0, margin=2), rel=1e-6
    )


def test_degenerate_amax_policy() -> None:
    for bad in (0.0, math.inf, math.nan):
        s = float(amax_to_scale(torch.tensor(bad), "e4m3fn"))
        assert s == 1.0  # never NaN or inf
    # torchao's clamp gives a huge but finite scale for 0, and 0 for an inf amax:
    assert torchao_scale(0.0, E4M3_MAX) == pytest.approx(4.48e14)
    assert float(amax_to_scale(torch.tensor(0.0), "e4m3fn", eps=1e-12)) == pytest.approx(4.48e14)
    assert torchao_scale(math.inf, E4M3_MAX) == 0.0
    assert float(amax_to_scale(torch.tensor(math.inf), "e4m3fn", eps=1e-12)) == 1.0
    r = Tensorwise()(torch.zeros(5))
    assert r.values.tolist() == [0.0] * 5 and int(r.fallbacks) == 1
    x = torch.tensor([1.0, math.inf])
    r = Tensorwise()(x)
    assert bool(torch.isfinite(r.scales)) and int(r.fallbacks) == 1


def test_delayed_scaling_matches_te_history() -> None:
    g = torch.Generator().manual_seed(0)
    seq = [torch.randn(64, generator=g) * s for s in (1.0, 3.0, 0.5, 0.0, 10.0, 1.0)]
    seq.insert(6, torch.tensor([1.0, math.inf]))
    for algo in ("max", "most_recent"):
        for margin in (0, 1):
            scaler = Delayed("e4m3fn", history_len=3, algo=algo, margin=margin).scaler()  # type: ignore[arg-type]
            hist: list[float] = []
            scale = 1.0
            for x in seq:
                r = scaler(x)
                assert float(r.scales) == pytest.approx(scale, rel=1e-6)  # used the previous steps'
                expected = quantize(x.float() * scale, "e4m3fn", overflow="saturate") / scale
                assert torch.allclose(r.values, expected, equal_nan=True)
                amax = float(x.abs().max())
                if amax == 0:  # TE: a zero amax rolls nothing and keeps the scale
                    continue
                hist = [amax, *hist][:3]
                amax_h = (
                    (max(hist) if not any(math.isnan(h) for h in hist) else math.nan)
                    if algo == "max"
                    else hist[0]
                )
                scale = te_scale(amax_h, scale, E4M3_MAX, margin)
    sd = scaler.state_dict()
    other = Delayed().scaler()
    other.load_state_dict(sd)
    assert torch.equal(other.scale, scaler.scale)  # type: ignore[arg-type]


@pytest.mark.parametrize("elem", ["e4m3fn", "e5m2", "e2m1fn", "e2m3fn", "e3m2fn"])
@pytest.mark.parametrize("mode", ["floor", "ceil", "even", "rceil"])
def test_mx_exponents_match_reference(elem: str, mode: str) -> None:
    g = torch.Generator().manual_seed(1)
    amaxes = (
        (torch.rand(300, generator=g) * 8 - 4)
        .exp2()
        .mul(torch.exp2(torch.randint(-20, 20, (300,), generator=g).float()))
    )
    special = torch.tensor(
        [0.0, math.nan, 1.0, 2.0, 448.0, 6.0, 7.5, 28.0, 57344.0, 1.9999999, 2.0000002, 1e-38, 3e38]
    )
    amaxes = torch.cat([amaxes, special])
    got = MX(elem, scale_mode=mode).exponents(amaxes)  # type: ignore[arg-type]
    ref = torch.tensor([mx_exponent_ref(float(a), elem, mode) for a in amaxes])
    assert torch.equal(got.isnan(), ref.isnan())
    ok = ~ref.isnan()
    assert torch.equal(got[ok], ref[ok]), [
        (float(a), float(x), float(y))
        for a, x, y in zip(amaxes[ok], got[ok], ref[ok], strict=True)
        if x != y
    ][:5]


def test_mx_quantizes_blocks() -> None:
    x = torch.randn(4, 64)
    x[0, :32] *= 10
    x[0, 0] = 240.0  # 1.875 * 2**7: floor gives 2**-1, and 240 / 0.5 = 480 > 448
    r = MX("e4m3fn", scale_mode="floor")(x)
    assert r.scales.shape == (4, 2)
    blocks = x.reshape(4, 2, 32)
    scale = torch.exp2(MX("e4m3fn").exponents(blocks.abs().amax(-1, keepdim=True)))
    expected = (quantize(blocks / scale, "e4m3fn", overflow="saturate") * scale).reshape(4, 64)
    assert torch.equal(r.values, expected)
    # floor may put the block max above the element max (it saturates); rceil never does
    assert bool((blocks[0].abs() / scale[0] > 448).any())
    rc = MX("e4m3fn", scale_mode="rceil")
    sc = torch.exp2(rc.exponents(blocks.abs().amax(-1, keepdim=True)))
    assert bool((blocks.abs() / sc <= 448).all())


def test_nvfp4_two_level_scales() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 48, generator=g)
    x[3, 5] = 25.0
    r = NVFP4()(x)
    s_enc = torch.tensor(6 * 448.0) / x.abs().max()  # float32, TE's order (test_nvfp4_te.py)
    blocks = x.reshape(8, 3, 16)
    amax_b = blocks.abs().amax(-1, keepdim=True)
    stored = quantize(amax_b * (s_enc * (torch.tensor(1.0) / 6)), "e4m3fn", overflow="saturate")
    dec = stored * (torch.tensor(1.0) / s_enc)
    ref = (quantize(blocks * (1 / dec), "e2m1fn", overflow="saturate") * dec).reshape(8, 48)
    assert torch.equal(r.scales[0], s_enc)
    assert torch.equal(r.scales[1:], stored.reshape(-1))
    assert torch.equal(r.values, ref)
    assert NVFP4()(torch.zeros(2, 16)).values.abs().sum() == 0


def test_block_and_rowwise_scales() -> None:
    x = torch.randn(130, 260)
    r = Block("e4m3fn", (128, 128))(x)
    assert r.scales.shape == (2, 3)  # partial blocks at the edges
    assert float(r.scales[0, 0]) == pytest.approx(
        448.0 / float(x[:128, :128].abs().max()), rel=1e-6
    )
    a = Block("e4m3fn", (1, 128), scale="pow2")(x)
    assert bool((torch.log2(a.scales) == torch.log2(a.scales).round()).all())
    rw = Rowwise("e4m3fn")(x)
    assert rw.scales.shape == (130, 1)
    assert torch.allclose(rw.scales.squeeze(1), 448.0 / x.abs().amax(1))
    with pytest.raises(ValueError, match=r"Block.scale='fp16'"):
        Block(scale="fp16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="MX elements are"):
        MX("fp16")


def test_ema_scaler_uses_a_real_fp8_cast() -> None:
    s = EMAScaler("e4m3fn", margin=1, smoothing=0.5)
    x = torch.linspace(-3, 3, 101)
    r = s(x)
    scale = float(r.scales)
    assert scale == pytest.approx(448 / 3 / 2)
    # every value is a representable e4m3 value divided by the scale (int8 rounding is not)
    codes = quantize(r.values * scale, "e4m3fn")
    assert torch.allclose(codes, r.values * scale)
    s(torch.tensor([math.nan]))
    assert s.amax_ema is not None and math.isfinite(float(s.amax_ema))


def test_metrics() -> None:
    x = torch.tensor([1.0, 1e-6, -2.0, 500.0])
    q = quantize(x, "e4m3fn")
    m = quant_metrics(x, q, "e4m3fn")
    assert m["underflow_pct"] == 25.0 and m["overflow_pct"] == 25.0
    assert m["sqnr_db"] > 10 and 0 < m["rel_error"] < 1
    # In the scaled domain of a tensor-wise recipe: nothing overflows, small values go subnormal.
    y = torch.tensor([448.0 * 4, 1.0, 1e-2, -2.0])
    r = Tensorwise("e4m3fn")(y)
    ms = quant_metrics(y, r.values, "e4m3fn", scale=r.scales)
    assert ms["overflow_pct"] == 0.0 and ms["subnormal_pct"] == 25.0  # 1e-2 * 0.25: subnormal
    assert quant_metrics(y, r.values, "e4m3fn")["overflow_pct"] == 25.0  # unscaled view


def _nvfp4_tile_reference(x: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """NVFP4 from the formula, tile by tile, in Transformer Engine's operation order
    (``reference_nvfp4.py``: ``_quantize_blockwise_reference``), each step one float32
    rounding (numpy float32): S = 6*448 / amax_tensor, D = 1 / S, stored =
    e4m3(amax_tile * (S * (1/6))), dec = stored * D, elements e2m1(x * (1 / dec))
    (ml_dtypes' float4_e2m1fn, saturated to +-6), back q * dec."""
    import ml_dtypes
    import numpy as np

    f32 = np.float32
    s_enc = f32(6.0 * 448.0) / f32(float(x.abs().max()))
    d = f32(1.0) / s_enc
    mult = s_enc * (f32(1.0) / f32(6.0))
    out = torch.zeros_like(x)
    tr, tc = tile
    for i in range(0, x.shape[0], tr):
        for j in range(0, x.shape[1], tc):
            t = x[i : i + tr, j : j + tc].numpy()
            amax_b = f32(np.abs(t).max())
            stored = f32(torch.tensor(float(amax_b * mult)).to(torch.float8_e4m3fn).float())
            dec = stored * d
            enc = f32(1.0) / dec
            scaled = np.clip(t * enc, -6.0, 6.0).astype(np.float32)
            q = scaled.astype(ml_dtypes.float4_e2m1fn).astype(np.float32) * dec
            out[i : i + tr, j : j + tc] = torch.from_numpy(q.astype(np.float32))
    return out


def test_nvfp4_two_dimensional_weight_tiles() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 56, generator=g)  # partial tiles on both edges
    w[5, 7], w[33, 50] = 30.0, -0.001
    r = NVFP4(two_d=True)(w)
    assert torch.equal(r.values, _nvfp4_tile_reference(w, (16, 16)))
    assert r.scales.numel() == 1 + 3 * 4  # the tensor scale, then one e4m3 scale per tile
    one_d = NVFP4()(w)
    assert torch.equal(one_d.values, _nvfp4_tile_reference(w, (1, 16)))
    # Tiles are square: W and W^T quantize to transposes of each other (not so in 1-D).
    wt = NVFP4(two_d=True)(w[:32, :48].t().contiguous()).values
    assert torch.equal(wt, NVFP4(two_d=True)(w[:32, :48]).values.t())
    w1 = w[:32, :48]
    assert not torch.equal(NVFP4()(w1.t().contiguous()).values, NVFP4()(w1).values.t())


def test_nvfp4_stochastic_rounding_is_unbiased_between_neighbours() -> None:
    x = torch.linspace(-5.0, 5.0, 160).reshape(10, 16)
    x[0, 0] = 6.0  # every block's scale is the same: amax 6 per block keeps the grid at 1x
    x[:, 0] = 6.0
    nearest = NVFP4()(x)
    torch.manual_seed(0)
    n = 5000  # the rows repeated: every copy has the same scales, one call draws them all
    draws = NVFP4(rounding="stochastic")(x.repeat(n, 1)).values.reshape(n, 10, 16)
    dec = nearest.scales[1:].reshape(10, 1) / nearest.scales[0]
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    v = (x / dec).abs()
    lo = grid[(grid.reshape(1, 1, -1) <= v.unsqueeze(-1)).sum(-1) - 1] * dec
    hi = grid[torch.clamp((grid.reshape(1, 1, -1) < v.unsqueeze(-1)).sum(-1), max=7)] * dec
    mag = draws.abs()
    assert bool(((mag == lo) | (mag == hi)).all())  # always one of the two neighbours
    mean = draws.mean(0)
    assert torch.allclose(mean, x, atol=0.06)  # unbiased (sd of a mean <= 1/sqrt(n) = 0.014)
    assert not torch.allclose(nearest.values, x, atol=0.06)  # nearest is biased here
    with pytest.raises(ValueError, match="rounding"):
        NVFP4(rounding="up")  # type: ignore[arg-type]
