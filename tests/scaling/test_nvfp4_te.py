"""NVFP4 against Transformer Engine's quantizer, re-implemented here in TE's operation order.

The reference follows TE's PyTorch reference quantizer
(``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``,
``NVFP4QuantizerRef._quantize_blockwise_reference``) and its CUDA kernel
(``transformer_engine/common/cast/nvfp4/core_nvfp4.cuh``:
``compute_global_encode_scaling_factor_FP4``, ``compute_decoding_scaling_factor``;
``quantize_transpose_nvfp4.cuh``: ``block_scale_inverse``), every step one float32
rounding, in this order:

    S      = fl(2688 / amax_tensor), min(S, FLT_MAX); 1.0 when amax is 0 or S is 0 (inf amax)
    D      = fl(1 / S)                                  (the global decode scale)
    stored = e4m3(clamp(fl(amax_block * fl(S * fl(1/6))), +-448))
    dec    = fl(stored * D)                             (the block's decode scale)
    enc    = min(fl(1 / dec), FLT_MAX)                  (1/0 = inf -> FLT_MAX)
    q      = e2m1(clamp(fl(x * enc), +-6))              (nearest, ties to even)
    value  = fl(q * dec)

Where floatguard's contract goes past TE's reference, on purpose, the reference here
says so: amaxes skip NaN elements (TE's kernels reduce with ``fmaxf``; its PyTorch
reference's ``torch.amax`` would make the block scale, and the tensor scale, NaN), a
NaN element comes back NaN (e2m1 has no NaN code; TE's reference table sends it to
code 0), and the sign of zero is kept (TE's table sends -0.0 to +0; IEEE rounding and
the hardware cast keep it).
"""

from __future__ import annotations

import math

import pytest
import torch

from floatguard.emulation import NVFP4

FLT_MAX = torch.finfo(torch.float32).max
E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def e2m1_nearest(v: torch.Tensor) -> torch.Tensor:
    """Round to e2m1, nearest with ties to even, from the thresholds of TE's
    ``cast_to_fp4x2`` applied to the magnitude (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
    2.5 -> 2, 3.5 -> 4, 5 -> 4), the sign put back with copysign (so -0.0 stays -0.0)
    and NaN kept. Input already clamped to +-6."""
    m = v.abs()
    code = torch.zeros_like(m, dtype=torch.long)
    code = torch.where((m > 0.25) & (m < 0.75), 1, code)
    code = torch.where((m >= 0.75) & (m <= 1.25), 2, code)
    code = torch.where((m > 1.25) & (m < 1.75), 3, code)
    code = torch.where((m >= 1.75) & (m <= 2.5), 4, code)
    code = torch.where((m > 2.5) & (m < 3.5), 5, code)
    code = torch.where((m >= 3.5) & (m <= 5.0), 6, code)
    code = torch.where(m > 5.0, 7, code)
    out = torch.copysign(torch.tensor(E2M1_GRID)[code], v)
    return torch.where(torch.isnan(v), v, out)


def te_nvfp4_reference(x: torch.Tensor, tile: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """(values, S, stored block scales) for a 2-D float32 x, tiles ``tile`` (1x16 or 16x16),
    partial tiles zero-padded as TE's ``_pad_tensor``."""
    rows, cols = x.shape
    tr, tc = tile
    pr, pc = (-rows) % tr, (-cols) % tc
    xp = torch.nn.functional.pad(x, (0, pc, 0, pr))
    mag = torch.where(torch.isnan(xp), torch.zeros_like(xp), xp.abs())  # fmaxf: NaN skipped
    amax = mag.max()
    s = f32(2688.0) / amax  # 6 * 448, exact; a correctly rounded float32 division
    s = torch.minimum(s, f32(FLT_MAX))
    if float(amax) == 0.0 or float(s) == 0.0:
        s = f32(1.0)
    d = f32(1.0) / s
    mult = s * (f32(1.0) / f32(6.0))
    r, c = xp.shape
    t = xp.reshape(r // tr, tr, c // tc, tc)
    vec_max = mag.reshape(r // tr, tr, c // tc, tc).amax(dim=(1, 3), keepdim=True)
    dec_f = torch.minimum(vec_max * mult, f32(FLT_MAX))
    stored = torch.clamp(dec_f, -448.0, 448.0).to(torch.float8_e4m3fn).float()
    dec = stored * d
    enc = torch.minimum(f32(1.0) / dec, f32(FLT_MAX))
    q = e2m1_nearest(torch.clamp(t * enc, -6.0, 6.0))
    values = (q * dec).reshape(r, c)[:rows, :cols]
    return values, s, stored.reshape(-1)


def assert_same_bits(got: torch.Tensor, ref: torch.Tensor, x: torch.Tensor) -> None:
    """Bit-exact, NaN-aware (any NaN matches any NaN); names the first differing element."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    g = got.float().reshape(-1)
    r = ref.float().reshape(-1)
    gn, rn = torch.isnan(g), torch.isnan(r)
    gi = torch.where(gn, torch.zeros_like(g), g).view(torch.int32)
    ri = torch.where(rn, torch.zeros_like(r), r).view(torch.int32)
    bad = (gn != rn) | (gi != ri)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{int(bad.sum())} of {g.numel()} differ; first at flat index {i}: "
            f"x={float(x.reshape(-1)[i])!r} got={float(g[i])!r} ref={float(r[i])!r}"
        )


def many_magnitudes(rows: int, cols: int, seed: int, block: tuple[int, int]) -> torch.Tensor:
    """Blocks spread over 2**-60 .. 2**60, with some blocks placed on both sides of the
    e4m3 scale's underflow (stored = e4m3(amax_b * S / 6) rounding to 0 or to the
    smallest subnormal 2**-9) and of its overflow (448)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    br, bc = block
    nbr, nbc = math.ceil(rows / br), math.ceil(cols / bc)
    spread = torch.exp2(torch.randint(-60, 60, (nbr, nbc), generator=g).float())
    spread = spread.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
    x = x * spread
    x[0, 0] = 3.0 * 2.0**60  # the tensor amax sets S; some blocks sit at its edges
    s = float(f32(2688.0) / x.abs().max())
    # amax_b * S / 6 near 2**-10 (the e4m3 rounding boundary to 0) and 2**-9, 448
    edges = [2.0**-10 * (1 - 2**-8), 2.0**-10, 2.0**-10 * (1 + 2**-8), 2.0**-9, 447.9, 448.0]
    for k, target in enumerate(edges, start=1):
        i, j = (k * br) % (nbr * br), (k * bc) % (nbc * bc)
        blk = x[i : i + br, j : j + bc]
        blk.mul_(target * 6.0 / s / blk.abs().max())
    return x


CASES = [
    ("1d", (1, 16), (48, 80)),
    ("1d-partial", (1, 16), (9, 70)),
    ("2d", (16, 16), (48, 64)),
    ("2d-partial", (16, 16), (40, 56)),
]


@pytest.mark.parametrize(("name", "tile", "shape"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nvfp4_is_bit_exact_with_te_on_many_magnitudes(
    name: str, tile: tuple[int, int], shape: tuple[int, int], seed: int
) -> None:
    x = many_magnitudes(*shape, seed=seed, block=tile)
    got = NVFP4(two_d=tile == (16, 16))(x)
    values, s, stored = te_nvfp4_reference(x, tile)
    assert_same_bits(got.values, values, x)
    assert torch.equal(got.scales[0], s), (float(got.scales[0]), float(s))
    assert torch.equal(got.scales[1:], stored)
    assert int(got.fallbacks) == 0


# The tensor scale's extremes: an amax whose 2688 / amax overflows float32 (S = FLT_MAX,
# counted), a huge amax (S ~ 1e-35), an inf element (S = 1.0, counted), all zeros.
EXTREMES = [
    ("subnormal-amax", lambda x: x * (1e-40 / x.abs().max()), 1),
    ("tiny-normal-amax", lambda x: x * (2.0**-115 / x.abs().max()), 0),
    ("s-overflow-edge", lambda x: x * (2688.0 / FLT_MAX * 0.999 / x.abs().max()), 1),
    ("huge-amax", lambda x: x * (3.0e38 / x.abs().max()), 0),
    ("inf-element", lambda x: torch.cat([x[:, :-1], torch.full_like(x[:, :1], math.inf)], 1), 1),
    ("zeros", lambda x: torch.zeros_like(x), 1),
    ("signed-zeros", lambda x: torch.where(x < 0, -0.0, 0.0), 1),
]


@pytest.mark.parametrize(("name", "make", "fell"), EXTREMES, ids=[e[0] for e in EXTREMES])
@pytest.mark.parametrize("tile", [(1, 16), (16, 16)], ids=["1d", "2d"])
def test_nvfp4_tensor_scale_extremes_match_te(
    name: str, make: object, fell: int, tile: tuple[int, int]
) -> None:
    g = torch.Generator().manual_seed(5)
    base = torch.randn(32, 48, generator=g) * torch.exp2(torch.randint(-8, 8, (32, 1), generator=g))
    x = make(base)  # type: ignore[operator]
    got = NVFP4(two_d=tile == (16, 16))(x)
    values, s, stored = te_nvfp4_reference(x, tile)
    assert_same_bits(got.values, values, x)
    assert torch.equal(got.scales[0], s) and torch.equal(got.scales[1:], stored)
    assert int(got.fallbacks) == fell


@pytest.mark.parametrize("two_d", [False, True], ids=["1d", "2d"])
def test_a_block_whose_e4m3_scale_underflows_keeps_the_sign_of_zero(two_d: bool) -> None:
    x = torch.zeros(16, 32)
    x[0, 0] = 1.0  # amax 1: S = 2688, blocks below 6 * 2**-10 / 2688 get a zero e4m3 scale
    x[1:, :16] = -1e-7  # stored = e4m3(1e-7 * 448) = 0: these blocks underflow
    x[1:, 16:] = -0.0
    x[3, 20] = 1e-7
    got = NVFP4(two_d=two_d)(x).values
    ref, _, _ = te_nvfp4_reference(x, (16, 16) if two_d else (1, 16))
    assert_same_bits(got, ref, x)
    under = got[1:]
    assert bool((under == 0).all())
    neg = torch.signbit(x[1:])
    assert torch.equal(torch.signbit(under), neg)  # -1e-7 and -0.0 give -0.0, +1e-7 gives +0.0
    assert bool(neg.sum() > 0) and not bool(neg.all())


def test_a_nan_comes_back_nan_and_its_1d_block_keeps_its_values() -> None:
    g = torch.Generator().manual_seed(9)
    x = torch.randn(4, 48, generator=g)
    x[1, 20] = math.nan  # block (1, 1)
    r = NVFP4()(x)
    clean = x.clone()
    clean[1, 20] = 0.0  # what the scales see: NaN skipped, as TE's fmaxf amax
    ref_clean, s, stored = te_nvfp4_reference(clean, (1, 16))
    assert math.isnan(float(r.values[1, 20]))  # NaN in, NaN out
    keep = ~torch.isnan(x)
    assert torch.equal(r.values[keep], ref_clean[keep])  # every other value, its own block's too
    assert torch.equal(r.scales[0], s) and torch.equal(r.scales[1:], stored)
    blk = r.values[1, 16:32][keep[1, 16:32]]
    assert int((blk != 0).sum()) > blk.numel() // 2  # the block was not zeroed
    assert int(r.nan_skipped) == 1 and int(r.fallbacks) == 0  # type: ignore[arg-type]
    values, _, _ = te_nvfp4_reference(x, (1, 16))
    assert_same_bits(r.values, values, x)


def test_a_nan_in_a_2d_tile_leaves_the_tiles_other_rows_alone() -> None:
    g = torch.Generator().manual_seed(10)
    w = torch.randn(32, 32, generator=g)
    w[17, 3] = math.nan  # tile (1, 0): rows 16..31, cols 0..15
    w[20, 30] = math.nan  # tile (1, 1)
    r = NVFP4(two_d=True)(w)
    nan = torch.isnan(w)
    assert torch.equal(torch.isnan(r.values), nan)  # exactly the NaN elements are NaN
    clean = torch.where(nan, torch.zeros_like(w), w)
    ref_clean, _, stored = te_nvfp4_reference(clean, (16, 16))
    assert torch.equal(r.values[~nan], ref_clean[~nan])
    tile = r.values[16:32, 0:16]
    kept = tile[~nan[16:32, 0:16]]
    assert int((kept != 0).sum()) > kept.numel() // 2  # rows with no NaN: not zeroed
    assert torch.equal(r.scales[1:], stored)  # no NaN scale, no zero scale
    assert int(r.nan_skipped) == 2  # type: ignore[arg-type]
    # Transposing still commutes with quantizing, NaN and all.
    rt = NVFP4(two_d=True)(w.t().contiguous()).values
    assert_same_bits(rt, r.values.t(), w.t())


def test_stochastic_nvfp4_keeps_nan_and_te_scales() -> None:
    x = torch.randn(8, 32)
    x[2, 2] = math.nan
    torch.manual_seed(3)
    r = NVFP4(rounding="stochastic")(x)
    near = NVFP4()(x)
    assert math.isnan(float(r.values[2, 2])) and torch.equal(r.scales, near.scales)
    assert int(torch.isnan(r.values).sum()) == 1
