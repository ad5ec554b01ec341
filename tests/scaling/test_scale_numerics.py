"""Scale numerics against references written from the formulas (exact rationals).

Transformer Engine computes ``scale = fp8_max / amax`` with a correctly rounded float32
division (``__fdiv_rn``), replaces an infinite quotient by FLT_MAX (``value_for_inf``),
and for power-of-two scales keeps the exponent bits; OCP MX v1.0 (section 5.4.1) gives
a block holding inf or NaN the E8M0 NaN code. Each contract is checked on random and
edge-case amaxes: zero, subnormal, tiny normal, just above/below powers of two and
``fmt.max * 2**k``, inf, NaN.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from floatguard.emulation import MX, NVFP4, Block, Rowwise, Tensorwise, amax_to_scale_and_fallbacks
from floatguard.formats import get

FLT_MAX = float(np.finfo(np.float32).max)


def f32_nearest(x: Fraction) -> float:
    """The float32 nearest to the exact rational ``x`` (ties to even): the reference."""
    f = np.float32(float(x))
    best = None
    for cand in (np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))):
        if not np.isfinite(cand):
            continue
        err = abs(Fraction(float(cand)) - x)
        key = (err, int(np.array(cand).view(np.int32)) & 1)  # ties: the even pattern
        if best is None or key < best[0]:
            best = (key, float(cand))
    assert best is not None
    return best[1]


def edge_amaxes(fmt_max: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    rnd = torch.exp2(torch.rand(3000, generator=g) * 200 - 100)  # spread over many binades
    special = []
    for k in range(-20, 21):
        for base in (1.0, fmt_max):
            v = np.float32(base * 2.0**k)
            special += [v, np.nextafter(v, np.float32(0)), np.nextafter(v, np.float32(np.inf))]
    special += [3.0, 5.0, 7.0, 1e-45, 1e-40, 1.17549435e-38, 1e-30]  # subnormal, tiny normal
    return torch.cat([rnd, torch.tensor(np.array(special, dtype=np.float32))])


@pytest.mark.parametrize("name", ["e4m3fn", "e5m2", "e2m1fn"])
def test_every_scale_is_the_correctly_rounded_quotient(name: str) -> None:
    f = get(name)
    amax = edge_amaxes(f.max)
    scale, fell = amax_to_scale_and_fallbacks(amax, f)
    for a, s, fb in zip(amax.tolist(), scale.tolist(), fell.tolist(), strict=True):
        exact = Fraction(f.max) / Fraction(a)
        if exact > Fraction(FLT_MAX):
            assert s == FLT_MAX and fb, a  # TE's value_for_inf, counted
        else:
            assert s == f32_nearest(exact), (a, s, f32_nearest(exact))
            assert not fb
    # torch's own scalar / tensor is two roundings: about a third of these are 1 ulp off
    naive = (f.max / amax.float()).tolist()
    off = sum(1 for a, n, s in zip(amax.tolist(), naive, scale.tolist(), strict=True)
              if math.isfinite(n) and n != s)  # fmt: skip
    assert off > 0


@pytest.mark.parametrize("name", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("margin", [0, 2])
def test_power_of_two_scales_come_from_the_exponent_bits(name: str, margin: int) -> None:
    f = get(name)
    amax = edge_amaxes(f.max)
    scale, _ = amax_to_scale_and_fallbacks(amax, f, power_of_two=True, margin=margin)
    limit = Fraction(f.max) / 2**margin
    for a, s in zip(amax.tolist(), scale.tolist(), strict=True):
        # the largest power of two s with a * s <= max / 2**margin (capped at 2**127)
        k = math.floor(math.log2(limit / Fraction(a)))
        while Fraction(a) * Fraction(2) ** (k + 1) <= limit:
            k += 1
        while Fraction(a) * Fraction(2) ** k > limit:
            k -= 1
        assert s == 2.0 ** min(k, 127), (a, s, k)
        assert Fraction(a) * Fraction(s) <= limit or k > 127


def test_just_above_max_times_a_power_of_two_does_not_overflow() -> None:
    f = get("e4m3fn")
    a = np.nextafter(np.float32(448 * 2.0**-3), np.float32(np.inf))  # a hair above 56
    t = Tensorwise("e4m3fn", power_of_two=True)
    x = torch.tensor([float(a), -1.0, 0.5])
    r = t(x)
    assert float(r.scales) == 4.0  # not 8: 56.0000x * 8 would pass 448 and saturate
    assert float(torch.tensor(float(a)) * r.scales) <= f.max


def test_a_tiny_amax_keeps_its_values_and_counts_the_fallback() -> None:
    x = torch.tensor([1e-40, -5e-41, 3e-41])  # float32 subnormals: 448 / amax overflows
    r = Tensorwise("e4m3fn")(x)
    assert float(r.scales) == FLT_MAX and int(r.fallbacks) == 1
    assert bool((r.values != 0).all())  # not flushed to zero by a scale of 1
    r0 = Tensorwise("e4m3fn")(torch.zeros(3))
    assert float(r0.scales) == 1.0 and int(r0.fallbacks) == 1
    # NVFP4's tensor scale 2688 / amax overflows too: FLT_MAX, counted, never inf. As in TE
    # (tests/scaling/test_nvfp4_te.py), D = 1 / FLT_MAX is then subnormal, the block encode
    # scale saturates at FLT_MAX and values this small flush to zeros that keep their sign.
    xs = torch.tensor([1e-40, -2e-40] * 8)
    nv = NVFP4()(xs)
    assert float(nv.scales[0]) == FLT_MAX and int(nv.fallbacks) == 1
    assert bool((nv.values == 0).all()) and torch.equal(nv.values.signbit(), xs.signbit())


def test_mx_blocks_holding_inf_or_nan_get_a_nan_scale() -> None:
    x = torch.randn(2, 32)
    x[0, 5] = math.inf
    x[1, 7] = math.nan
    for mode in ("floor", "ceil", "even", "rceil"):
        r = MX("e4m3fn", scale_mode=mode)(x)  # type: ignore[arg-type]
        assert bool(torch.isnan(r.scales).all()), mode
        assert bool(torch.isnan(r.values).all()), mode  # the whole block decodes to NaN
        assert int(r.fallbacks) == 2
    ok = MX("e4m3fn")(torch.randn(1, 32))
    assert bool(torch.isfinite(ok.scales).all()) and int(ok.fallbacks) == 0


def test_mx_rceil_of_a_tiny_amax_is_minus_127() -> None:
    mx = MX("e4m3fn", scale_mode="rceil")
    amax = torch.tensor([1e-45, 1e-40, 2.0**-130, 448.0, 449.0, 0.0])
    x = mx.exponents(amax).tolist()
    assert x[:3] == [-127.0, -127.0, -127.0]  # the quotient underflows float32; not 0
    assert x[3:] == [0.0, 1.0, -127.0]


def test_block_pow2_inherits_the_exact_power_of_two() -> None:
    a = float(np.nextafter(np.float32(448.0 * 2.0**-4), np.float32(np.inf)))
    x = torch.full((1, 128), 0.01)
    x[0, 0] = a
    r = Block("e4m3fn", (1, 128), scale="pow2")(x)
    assert float(r.scales.reshape(-1)[0]) == 8.0  # 2**4 would overflow 448 by a hair


def test_ema_scaler_state_round_trips_and_rowwise_checks_eps() -> None:
    from floatguard.emulation import EMAScaler, Rowwise

    a = EMAScaler("e4m3fn", margin=1, smoothing=0.5)
    for v in (2.0, 8.0, 4.0):
        a(torch.full((4,), v))
    b = EMAScaler()
    b.load_state_dict(a.state_dict())
    x = torch.randn(16) * 3
    ra, rb = a(x), b(x)
    assert torch.equal(ra.values, rb.values) and torch.equal(ra.scales, rb.scales)
    assert (b.fmt, b.margin, b.smoothing) == ("e4m3fn", 1, 0.5)
    with pytest.raises(ValueError, match=r"Rowwise\.eps=-1\.0 must be a number >= 0"):
        Rowwise(eps=-1.0)
    with pytest.raises(ValueError, match=r"Rowwise\.eps=nan"):
        Rowwise(eps=math.nan)


def test_delayed_scaling_nan_skipping_history_and_fractional_margin() -> None:
    from floatguard.emulation import Delayed

    plain = Delayed("e4m3fn", history_len=4).scaler()
    skip = Delayed("e4m3fn", history_len=4, skip_nonfinite=True).scaler()
    for v in (2.0, math.nan, 4.0):
        rp = plain(torch.full((8,), v))
        rs = skip(torch.full((8,), v))
    # TE's plain max: the NaN in the history freezes the scale of step 1 (448 / 2)
    assert float(plain.scale) == 224.0 and int(rp.fallbacks) == 1  # type: ignore[arg-type]
    # NaN-skipping: the largest finite entry, 4.0
    assert float(skip.scale) == f32_nearest(Fraction(448) / 4) and int(rs.fallbacks) == 0  # type: ignore[arg-type]
    half = Delayed("e4m3fn", history_len=2, margin=0.5).scaler()
    half(torch.full((4,), 3.0))
    expected = np.float32(448.0 / 3.0 / 2.0**0.5)  # margin 0.5: sqrt(2) of headroom
    assert float(half.scale) == pytest.approx(float(expected), rel=2**-23)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Delayed\.margin=inf must be a finite number"):
        Delayed(margin=math.inf)


# --- Decode-scale storage: DeepGEMM and DeepSeek-V3 ------------------------------------
# References written from the published formulas (DeepGEMM deep_gemm/utils:
# per_token_cast_to_fp8 / per_block_cast_to_fp8, ceil_to_ue8m0; DeepSeek-V3 inference
# kernel.py act_quant): amax over a 1x128 (128x128) tile clamped to 1e-4, sf = amax / 448
# in float32, optionally sf = 2**ceil(log2 sf) (UE8M0), q = e4m3(x * (1 / sf)) (DeepGEMM)
# or e4m3(x / sf) (DeepSeek-V3), dequantized q * sf. torch's float32 division is the
# correctly rounded IEEE one, so these torch expressions *are* the references' arithmetic.


def _ceil_pow2_exact(v: torch.Tensor) -> torch.Tensor:
    out = []
    for a in v.reshape(-1).tolist():
        k = math.frexp(a)[1]  # a = m * 2**k, m in [0.5, 1)
        out.append(2.0 ** (k - 1) if a == 2.0 ** (k - 1) else 2.0**k)
    return torch.tensor(out, dtype=torch.float32).reshape(v.shape)


def _deepgemm_reference(
    x: torch.Tensor, block: tuple[int, int], ue8m0: bool, divide: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = x.shape
    br, bc = block
    xb = x.view(m // br, br, n // bc, bc)
    amax = xb.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    sf = amax / 448.0
    if ue8m0:
        sf = _ceil_pow2_exact(sf)
    xs = xb / sf if divide else xb * (1.0 / sf)
    q = xs.to(torch.float8_e4m3fn).float() * sf
    return q.view(m, n), sf.reshape(m // br, n // bc)


def _tiles_with_edge_amaxes(rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    spread = torch.exp2(torch.randint(-30, 30, (rows, 1), generator=g))
    x = torch.randn(rows, 256, generator=g) * spread
    edge = [0.0, 1e-45, 1e-40, 1.17549435e-38, 1e-5, 1e-4, 448.0, 448.0 * 2**-3, 3.0, 7.0]
    up = np.float32(np.inf)
    edge += [float(np.nextafter(np.float32(448.0 * 2.0**k), up)) for k in (-5, 0, 4)]
    edge += [float(np.nextafter(np.float32(2.0**k), np.float32(0))) for k in (-12, 0, 7)]
    for i, a in enumerate(edge):
        x[i] = x[i] / x[i].abs().max() * a if a else 0.0  # row i's amax is exactly a
    return x


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_decode_storage_is_bit_exact_with_deepgemm(ue8m0: bool, block: tuple[int, int]) -> None:
    x = _tiles_with_edge_amaxes(256)
    r = (Block.deepgemm_activation if block == (1, 128) else Block.deepgemm_weight)(ue8m0)
    got = r(x)
    ref_q, ref_sf = _deepgemm_reference(x, block, ue8m0, divide=False)
    assert torch.equal(got.scales, ref_sf)  # the decode scales, as stored
    assert torch.equal(got.values, ref_q)
    assert int(got.fallbacks) == 0  # the eps floor keeps every tile usable


def test_decode_div_is_bit_exact_with_deepseek_act_quant() -> None:
    x = _tiles_with_edge_amaxes(64)
    r = Block("e4m3fn", (1, 128), eps=1e-4, storage="decode_div")
    ref_q, ref_sf = _deepgemm_reference(x, (1, 128), False, divide=True)
    got = r(x)
    assert torch.equal(got.scales, ref_sf) and torch.equal(got.values, ref_q)
    # x / sf and x * (1 / sf) are different roundings: a value whose quotient sits next to
    # an e4m3 midpoint (2.625, between 2.5 and 2.75) goes different ways in the two modes.
    pair = torch.tensor([[0.005770162679255009, 0.9847743511199951]])
    div = Block("e4m3fn", (1, 128), eps=1e-4, storage="decode_div")(pair).values
    mul = Block("e4m3fn", (1, 128), eps=1e-4, storage="decode_mul")(pair).values
    sf = pair[0, 1] / 448.0
    assert torch.equal(div[0, 0], (pair[0, 0] / sf).to(torch.float8_e4m3fn).float() * sf)
    assert torch.equal(mul[0, 0], (pair[0, 0] * (1.0 / sf)).to(torch.float8_e4m3fn).float() * sf)
    assert not torch.equal(div[0, 0], mul[0, 0])


def test_decode_storage_in_tensorwise_and_rowwise_and_its_edges() -> None:
    x = _tiles_with_edge_amaxes(32)
    for r, amax in (
        (Tensorwise(storage="decode_mul"), x.abs().amax()),
        (Rowwise(storage="decode_mul"), x.abs().amax(-1, keepdim=True)),
    ):
        res = r(x)
        sf = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        sf = torch.clamp(sf, min=2.0**-126)  # below it, 1 / sf would overflow
        ref = (x * (1.0 / sf)).to(torch.float8_e4m3fn).float() * sf
        assert torch.equal(res.values, ref) and torch.equal(res.scales, sf)
    # An all-zero row without eps falls back to 1.0 and stays zero; a subnormal amax whose
    # decode scale is below the smallest normal keeps its values and counts.
    z = Rowwise(storage="decode_mul")(torch.tensor([[0.0, 0.0], [1e-40, -5e-41]]))
    assert z.scales.reshape(-1).tolist() == [1.0, 2.0**-126]
    assert z.values[1, 0].item() != 0 and int(z.fallbacks) == 2
    # inf/NaN amax: the fallback scale, counted; NaN stays NaN
    nanres = Tensorwise(storage="decode_div")(torch.tensor([1.0, math.nan]))
    assert nanres.scales.item() == 1.0 and math.isnan(nanres.values[1].item())
    for bad in ({"storage": "decode"}, {"eps": -1.0}, {"eps": math.nan}, {"eps": True}):
        with pytest.raises(ValueError, match=r"storage|eps"):
            Block(**bad)  # type: ignore[arg-type]
