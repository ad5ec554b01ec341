"""quantize against ml_dtypes, torch's own casts, and a table-search reference."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from floatguard.formats import FORMATS, Format, quantize

from .reference import (
    ML_CUSTOM,
    ML_DTYPES,
    ML_E8M0_ROUNDS_SUBNORMALS_ON_BITS,
    brute_round,
    ml_cast,
    same_bits,
    special_values,
)

quantize_module = sys.modules["floatguard.formats.rounding"]

ML_CASES: list[tuple[Format, object]] = [(FORMATS[n], dt) for n, dt in ML_DTYPES.items()] + list(
    ML_CUSTOM.values()
)
ML_IDS = [f.name for f, _ in ML_CASES]
SMALL = [f for f in FORMATS.values() if f.bits <= 16] + [f for f, _ in ML_CUSTOM.values()]
SMALL_IDS = [f.name for f in SMALL]
TORCH_NATIVE = ["e4m3fn", "e5m2", "fp16", "bf16"]


@pytest.fixture(scope="module")
def random_f32() -> torch.Tensor:
    """10**6 random float32 bit patterns (every class: subnormals, inf, NaN payloads)."""
    g = torch.Generator().manual_seed(1234)
    bits = torch.randint(-(2**31), 2**31, (1_000_000,), generator=g, dtype=torch.int64)
    return bits.to(torch.int32).view(torch.float32)


@pytest.fixture(scope="module")
def scaled_f32() -> torch.Tensor:
    """Values spread over the ranges the small formats hold (random bits rarely land there)."""
    g = torch.Generator().manual_seed(99)
    mant = torch.randn(400_000, generator=g)
    exp = torch.randint(-40, 40, (400_000,), generator=g).float()
    return mant * torch.exp2(exp)


def _ml_reference(x: torch.Tensor, fmt: Format, dt: object) -> tuple[torch.Tensor, torch.Tensor]:
    """ml_dtypes' cast, and the mask of elements where we deliberately differ."""
    ref = ml_cast(x, dt)
    differ = torch.zeros_like(x, dtype=torch.bool)
    if not fmt.has_nan:
        differ |= torch.isnan(x)  # ml_dtypes turns NaN into -0 for FP6/FP4; we keep NaN
    if fmt.name == "e8m0fnu" and x.dtype == torch.float32 and ML_E8M0_ROUNDS_SUBNORMALS_ON_BITS:
        # ml_dtypes < 0.7 rounds float32 subnormals to e8m0 on the bit pattern, sending
        # all of [2**-127, 2**-126) to 2**-126; we (and ml_dtypes >= 0.7) round to the
        # nearest value.
        differ |= (x > 0) & (x < 2.0**-126)
    return ref, differ


@pytest.mark.parametrize(("fmt", "dt"), ML_CASES, ids=ML_IDS)
def test_nonsaturate_is_bit_identical_to_ml_dtypes(
    fmt: Format, dt: object, random_f32: torch.Tensor, scaled_f32: torch.Tensor
) -> None:
    specials = special_values(fmt).to(torch.float32)
    x = torch.cat([random_f32, scaled_f32, specials])
    got = quantize(x, fmt, overflow="nonsaturate")
    ref, differ = _ml_reference(x, fmt, dt)
    ok = same_bits(got, ref) | differ
    bad = (~ok).nonzero().flatten()[:5]
    assert bad.numel() == 0, [(x[i].item(), ref[i].item(), got[i].item()) for i in bad]
    # Where we differ on purpose, we agree with the table-search reference.
    if bool(differ.any()):
        xd = x[differ]
        assert bool(
            same_bits(
                quantize(xd, fmt, overflow="nonsaturate").double(),
                brute_round(xd, fmt, overflow="nonsaturate"),
            ).all()
        )


def test_e8m0_float32_subnormals_round_to_the_nearest_value() -> None:
    x = torch.tensor([1.4 * 2.0**-127, 1.6 * 2.0**-127, 0.3 * 2.0**-127], dtype=torch.float32)
    got = quantize(x, "e8m0fnu").double()
    nearest = [2.0**-127, 2.0**-126, 2.0**-127]
    assert got.tolist() == nearest
    ref = ml_cast(x, ML_DTYPES["e8m0fnu"]).double().tolist()
    if ML_E8M0_ROUNDS_SUBNORMALS_ON_BITS:
        # ml_dtypes < 0.7 gives 2**-126 for the first one, though 2**-127 is nearer.
        assert ref == [2.0**-126, 2.0**-126, 2.0**-127]
    else:
        assert ref == nearest


@pytest.mark.parametrize("name", TORCH_NATIVE)
def test_default_mode_is_bit_identical_to_torch_cast(
    name: str, random_f32: torch.Tensor, scaled_f32: torch.Tensor
) -> None:
    fmt = FORMATS[name]
    assert fmt.torch_dtype is not None
    x = torch.cat([random_f32, scaled_f32, special_values(fmt).to(torch.float32)])
    got = quantize(x, fmt)
    ref = x.to(fmt.torch_dtype).to(torch.float32)
    ok = same_bits(got, ref)
    bad = (~ok).nonzero().flatten()[:5]
    assert bad.numel() == 0, [(x[i].item(), ref[i].item(), got[i].item()) for i in bad]


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("overflow", ["saturate", "nonsaturate"])
def test_branch_free_path_equals_native_cast(
    name: str,
    overflow: str,
    random_f32: torch.Tensor,
    scaled_f32: torch.Tensor,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fp16/bf16 from float32 use torch's IEEE cast; the generic path must agree with it."""
    fmt = FORMATS[name]
    x = torch.cat([random_f32, scaled_f32, special_values(fmt).to(torch.float32)])
    native = quantize(x, fmt, overflow=overflow)  # type: ignore[arg-type]
    monkeypatch.setattr(quantize_module, "_use_native_casts", False)
    generic = quantize(x, fmt, overflow=overflow)  # type: ignore[arg-type]
    assert bool(same_bits(native, generic).all())


@pytest.mark.parametrize("fmt", SMALL, ids=SMALL_IDS)
@pytest.mark.parametrize("rounding", ["nearest", "toward_zero", "ceil", "floor"])
@pytest.mark.parametrize("overflow", ["saturate", "nonsaturate"])
@pytest.mark.parametrize("subnormals", ["keep", "flush"])
def test_every_mode_matches_table_search(
    fmt: Format, rounding: str, overflow: str, subnormals: str
) -> None:
    g = torch.Generator().manual_seed(7)
    spread = torch.randn(3000, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(fmt.emin - fmt.mantissa_bits - 3, fmt.emax + 3, (3000,), generator=g)
        .clamp(-1070, 1020)
        .double()
    )
    x64 = torch.cat([special_values(fmt), spread])
    for x in (x64.float(), x64):
        got = quantize(x, fmt, rounding=rounding, overflow=overflow, subnormals=subnormals)  # type: ignore[arg-type]
        ref = brute_round(x, fmt, rounding, overflow, subnormals)
        ok = same_bits(got.double(), ref)
        bad = (~ok).nonzero().flatten()[:5]
        assert bad.numel() == 0, [(x[i].item(), ref[i].item(), got[i].item()) for i in bad]


@pytest.mark.parametrize("fmt", SMALL, ids=SMALL_IDS)
def test_float64_inputs_round_once(fmt: Format) -> None:
    """A float64 just above a tie must round up; via float32 it would hit the tie first."""
    vals = []
    m = fmt.mantissa_bits
    for e in range(fmt.emin, min(fmt.emax, fmt.emin + 12) + 1):
        ulp = math.ldexp(1.0, e - m)
        tie = math.ldexp(1.0, e) + ulp / 2
        vals += [tie + ulp * 2.0**-40, tie - ulp * 2.0**-40]
    x = torch.tensor(vals, dtype=torch.float64)
    got = quantize(x, fmt)
    assert bool(same_bits(got, brute_round(x, fmt)).all())
    assert not bool(same_bits(got, quantize(x.float(), fmt).double()).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["e4m3fn", "e5m2", "e2m1fn", "fp16", "bf16", "e3m2fn"])
def test_half_inputs(dtype: torch.dtype, name: str) -> None:
    codes = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = codes.view(dtype)  # every half value
    got = quantize(x, name)
    assert got.dtype == dtype
    ref = quantize(x.float(), name).to(dtype)
    assert bool(same_bits(got, ref).all())


def test_bf16_toward_zero_is_dropping_the_low_16_bits(random_f32: torch.Tensor) -> None:
    x = random_f32[~torch.isnan(random_f32)]
    got = quantize(x, "bf16", rounding="toward_zero")
    masked = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)
    assert torch.equal(got.view(torch.int32), masked.view(torch.int32))
    assert bool(torch.isnan(quantize(torch.tensor([math.nan]), "bf16", rounding="toward_zero")))


def test_flush_definition() -> None:
    f = FORMATS["e4m3fn"]
    x = torch.tensor(
        [f.tiny, f.tiny * 0.999, f.tiny * 0.5, -f.tiny * 0.5, f.smallest_subnormal, 1e-40, -1e-40]
    )
    got = quantize(x, f, subnormals="flush")
    # tiny*0.999 rounds up to tiny (tininess after rounding): kept.
    assert got.tolist() == [f.tiny, f.tiny, 0.0, -0.0, 0.0, 0.0, -0.0]
    assert torch.signbit(got).tolist() == [False, False, False, True, False, False, True]
    # Denormals-are-zero: float32 subnormal inputs are zero even for fp32 itself.
    sub = torch.tensor([1e-40, -1e-40, 1e-30])
    assert quantize(sub, "fp32", subnormals="flush").tolist() == [0.0, -0.0, sub[2].item()]
    assert quantize(sub, "fp32").tolist() == sub.tolist()


def test_overflow_modes() -> None:
    x = torch.tensor([500.0, -1e9, math.inf, -math.inf, math.nan, 464.0, 465.0])
    sat = quantize(x, "e4m3fn")
    assert sat[:4].tolist() == [448.0, -448.0, 448.0, -448.0] and math.isnan(sat[4])
    assert sat[5:].tolist() == [448.0, 448.0]  # 464 is the tie and rounds to the even 448
    ns = quantize(x, "e4m3fn", overflow="nonsaturate")
    assert bool(torch.isnan(ns[[0, 1, 2, 3, 4, 6]]).all()) and float(ns[5]) == 448.0
    e5 = quantize(torch.tensor([61440.0, 61439.0, -1e9, math.inf]), "e5m2")
    assert e5.tolist() == [math.inf, 57344.0, -math.inf, math.inf]
    e5s = quantize(torch.tensor([61440.0, -math.inf]), "e5m2", overflow="saturate")
    assert e5s.tolist() == [57344.0, -57344.0]
    fp4 = quantize(torch.tensor([100.0, -math.inf, math.nan]), "e2m1fn", overflow="nonsaturate")
    assert fp4[:2].tolist() == [6.0, -6.0] and math.isnan(fp4[2])


def test_fnuz_and_e8m0_special_rules() -> None:
    z = quantize(torch.tensor([-0.0, -1e-30, -1.0]), "e4m3fnuz")
    assert z.tolist() == [0.0, 0.0, -1.0] and not bool(torch.signbit(z[:2]).any())
    e8 = quantize(
        torch.tensor([0.0, -1.0, math.nan, 1.5, 3.0, 0.75, 1e-45, 2.0**127 * 1.5]), "e8m0fnu"
    )
    assert bool(torch.isnan(e8[:3]).all())
    assert e8[3:].tolist() == [2.0, 4.0, 1.0, 2.0**-127, 2.0**127]  # saturates by default
    ns = quantize(torch.tensor([2.0**127 * 1.5]), "e8m0fnu", overflow="nonsaturate")
    assert bool(torch.isnan(ns).all())
    x = torch.tensor([1.0, 1.1, 1.9, 3.0, 2.0**-130])
    assert quantize(x, "e8m0fnu", rounding="ceil").tolist() == [1.0, 2.0, 2.0, 4.0, 2.0**-127]
    assert quantize(x, "e8m0fnu", rounding="floor").tolist() == [1.0, 1.0, 1.0, 2.0, 2.0**-127]


def test_lesson_facts() -> None:
    stored = quantize(torch.tensor([0.1], dtype=torch.float64), "fp32")
    assert abs(float(stored) - 0.100000001490116) < 1e-15
    h = quantize(torch.tensor([1000.0 * 1000.0, 1e-10, 1000.0]), "fp16")
    assert h.tolist() == [math.inf, 0.0, 1000.0]
    assert torch.equal(h, torch.tensor([1e6, 1e-10, 1000.0]).half().float())


class TestStochastic:
    def test_unbiased_within_four_sigma(self) -> None:
        g = torch.Generator().manual_seed(5)
        n = 200_000
        for name, value in [
            ("bf16", 1.0 + 2.0**-9),
            ("e4m3fn", 0.3),
            ("e4m3fn", -3.3e-3),
            ("e2m1fn", 2.6),
            ("fp16", 1e-6),
            ("e5m2", -1000.0),
        ]:
            fmt = FORMATS[name]
            x = torch.full((n,), value, dtype=torch.float32)
            q = quantize(x, fmt, rounding="stochastic", generator=g).double()
            lo = brute_round(x[:1], fmt, "toward_zero").item()
            hi = lo + math.copysign(fmt.ulp(lo if lo else value), value)
            assert set(q.unique().tolist()) <= {lo, hi}, name
            p = (float(x[0]) - lo) / (hi - lo)
            sigma = abs(hi - lo) * math.sqrt(p * (1 - p) / n)
            assert abs(float(q.mean()) - float(x[0])) <= 4 * sigma + 1e-15, name

    def test_seeds(self) -> None:
        x = torch.rand(10_000) * 10
        a = quantize(x, "e4m3fn", rounding="stochastic", generator=torch.Generator().manual_seed(1))
        b = quantize(x, "e4m3fn", rounding="stochastic", generator=torch.Generator().manual_seed(1))
        c = quantize(x, "e4m3fn", rounding="stochastic", generator=torch.Generator().manual_seed(2))
        assert torch.equal(a, b)
        assert not torch.equal(a, c)

    def test_large_tensor_reproducible_across_blocks(self) -> None:
        x = torch.rand(700_000)
        a = quantize(x, "bf16", rounding="stochastic", generator=torch.Generator().manual_seed(3))
        b = quantize(x, "bf16", rounding="stochastic", generator=torch.Generator().manual_seed(3))
        assert torch.equal(a, b)
        down = quantize(x, "bf16", rounding="toward_zero")
        up = quantize(x, "bf16", rounding="ceil")
        assert bool(((a == down) | (a == up)).all())


class TestInterface:
    def test_shapes_dtypes_and_layouts(self) -> None:
        x = torch.randn(6, 5, dtype=torch.float64).t()  # non-contiguous
        q = quantize(x, "e4m3fn")
        assert q.shape == x.shape and q.dtype == torch.float64
        assert torch.equal(q, quantize(x.contiguous(), "e4m3fn"))
        assert quantize(torch.tensor(3.3), "e2m1fn").shape == ()
        assert float(quantize(torch.tensor(3.3), "e2m1fn")) == 3.0
        assert quantize(torch.empty(0, 3), "fp16").shape == (0, 3)
        big = torch.randn(600_001)  # crosses CPU block boundaries
        assert torch.equal(quantize(big, "fp16"), big.half().float())

    def test_input_is_not_modified(self) -> None:
        x = torch.randn(1000) * 1000
        before = x.clone()
        for mode in ("nearest", "stochastic", "toward_zero"):
            quantize(x, "e4m3fn", rounding=mode, subnormals="flush")  # type: ignore[arg-type]
        assert torch.equal(x, before)

    def test_bad_input_errors(self) -> None:
        with pytest.raises(TypeError, match=r"got torch.int32; convert first"):
            quantize(torch.ones(3, dtype=torch.int32), "fp16")
        with pytest.raises(TypeError, match=r"expects a torch\.Tensor, got list"):
            quantize([1.0], "fp16")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"rounding='round' is not supported"):
            quantize(torch.ones(3), "fp16", rounding="round")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"overflow='clip' is not supported"):
            quantize(torch.ones(3), "fp16", overflow="clip")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"subnormals='ftz' is not supported"):
            quantize(torch.ones(3), "fp16", subnormals="ftz")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"'fp8' is ambiguous: e4m3fn .* or e5m2"):
            quantize(torch.ones(3), "fp8")

    def test_gradient_is_straight_through(self) -> None:
        x = torch.randn(10, requires_grad=True)
        q = quantize(x, "e4m3fn")
        assert torch.equal(q.detach(), quantize(x.detach(), "e4m3fn"))
        (q * torch.arange(10.0)).sum().backward()
        assert x.grad is not None and torch.equal(x.grad, torch.arange(10.0))


finite_f32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=300, deadline=None)
@given(xs=st.lists(finite_f32, min_size=1, max_size=50), name=st.sampled_from(list(ML_DTYPES)))
def test_properties_idempotent_monotone_bracketed(xs: list[float], name: str) -> None:
    fmt = FORMATS[name]
    x = torch.tensor(sorted(xs), dtype=torch.float32)
    q = quantize(x, fmt)
    assert bool(same_bits(quantize(q, fmt), q).all())  # idempotent
    finite = q[torch.isfinite(q)]
    assert bool((finite[1:] >= finite[:-1]).all())  # monotone in x
    down = quantize(x, fmt, rounding="floor").double()
    up = quantize(x, fmt, rounding="ceil").double()
    qd = q.double()
    inside = (qd == down) | (qd == up) | torch.isnan(qd) | torch.isinf(qd) | (qd.abs() == fmt.max)
    assert bool(inside.all())
    # Nearest: never farther from x than half the bracket (where the bracket is finite).
    xd = x.double()
    both = torch.isfinite(up) & torch.isfinite(down) & (xd.abs() <= fmt.max)
    if not fmt.has_zero:
        both &= xd >= fmt.tiny  # e8m0: nothing below 2**-127 to round down to
    assert bool(((qd - xd).abs() <= (up - down).abs() / 2)[both].all())


def test_tf32_matches_a_float64_reference(
    random_f32: torch.Tensor, scaled_f32: torch.Tensor
) -> None:
    """tf32 (8-bit exponent, 10-bit mantissa): round to nearest even at 2**(e - 10), with
    e clamped at -126 (subnormals), computed exactly in float64 by numpy."""
    import numpy as np

    x = torch.cat([random_f32[:200_000], scaled_f32]).double().numpy()
    fmt = FORMATS["tf32"]
    with np.errstate(all="ignore"):
        e = np.floor(np.log2(np.abs(x)))
        e = np.where(np.isfinite(e), np.maximum(e, -126), -126)
        q = np.exp2(e - 10)
        ref = np.round(x / q) * q  # numpy rounds half to even
        ref = np.where(np.abs(ref) > fmt.max, np.copysign(np.inf, x), ref)
        ref = np.where(np.isinf(x), x, ref)
    got = quantize(torch.from_numpy(x).float(), "tf32").double().numpy()
    same = (got == ref) | (np.isnan(got) & np.isnan(ref))
    assert bool(same.all()), x[~same][:5]


def test_fp32_of_float64_inputs_equals_ieee_conversion() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300_000, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-160, 140, (300_000,), generator=g).double()
    )
    x = torch.cat(
        [x, torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 3.4028235677973366e38])]
    )
    got = quantize(x, "fp32")
    ref = x.float().double()  # IEEE round-to-nearest-even, subnormals and overflow included
    assert bool(same_bits(got, ref).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rounding", ["nearest", "toward_zero", "ceil", "floor"])
@pytest.mark.parametrize("overflow", ["saturate", "nonsaturate"])
def test_formats_wider_than_the_input_round_in_float64(
    dtype: torch.dtype, rounding: str, overflow: str
) -> None:
    """fp64 (and wide custom formats) from narrower inputs: computed exactly in float64,
    never 'value cannot be converted to type float without overflow'."""
    x = torch.tensor([1.0, -3.3, 1e-3, 0.0, math.inf, math.nan], dtype=dtype)
    q = quantize(x, "fp64", rounding=rounding, overflow=overflow)  # type: ignore[arg-type]
    fin = torch.isfinite(x)
    assert torch.equal(q[fin], x[fin]) and bool(torch.isnan(q[-1]))
    wide = Format.custom(9, 3, bias=-200)  # every float32 value is below its smallest normal
    got = quantize(torch.tensor([-4.8, 1.0]), wide)
    ref = quantize(torch.tensor([-4.8, 1.0], dtype=torch.float64), wide).float()
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("exp_bits", [5, 8, 9])
def test_no_mantissa_ties_go_up_for_every_input_dtype(dtype: torch.dtype, exp_bits: int) -> None:
    """With m = 0 the kept significand is the implied 1 (odd): a tie between 2**k and
    2**(k+1) goes up, as docs/formats.md says, whatever the input dtype (float32 inputs
    went down on the bit-pattern path: Format.custom(8, 0) gave 3.0 -> 2.0)."""
    fmt = Format.custom(exp_bits, 0)
    g = torch.Generator().manual_seed(exp_bits)
    k = torch.randint(-12, 12, (2000,), generator=g).double()
    ties = torch.exp2(k) * 1.5
    x = torch.cat([ties, -ties, torch.tensor([3.0, 0.75, 2.9, 3.1, math.inf, -math.inf])])
    x = x.to(dtype)
    got = quantize(x, fmt)
    ref = quantize(x.double(), fmt)  # computed on the float64 grid (magic add, ties even)
    assert torch.equal(got.double(), ref.to(dtype).double())
    head = got[:2000].double()
    assert torch.equal(head, torch.exp2(k + 1).to(dtype).double())  # every tie went up
    assert got[-6:-2].tolist() == [4.0, 1.0, 2.0, 4.0]
    assert got[-2].item() == math.inf and got[-1].item() == -math.inf  # inf stays inf


def test_the_name_quantize_is_the_function_not_a_module() -> None:
    """The rounding engine lives in floatguard.formats.rounding; nothing shadows the
    function floatguard.formats.quantize (it was also the module's name)."""
    import importlib.util

    import floatguard.formats as formats

    assert formats.quantize is quantize and callable(formats.quantize)
    assert importlib.util.find_spec("floatguard.formats.quantize") is None
    assert quantize_module.quantize is quantize
