"""Delayed scaling against Transformer Engine's fused amax-and-scale update, re-implemented.

The reference is TE's ``kernel_bulk`` (``transformer_engine/common/recipe/delayed_scaling.cu``,
``amax_and_scale_update_impl``, the kernel ``fused_amax_and_scale_update_after_reduction``
runs), in TE's own layout: slot 0 of the history holds the step's amax; if that amax is
not 0 the history rolls (``new = [0, h[2], ..., h[L-1], h[0]]``) and the window max is
taken with ``fmaxf`` (NaN entries skipped, inf kept); a zero amax neither rolls the
history nor changes the scale. Then ``scale = fl(scaled_max / amax)`` with
``scaled_max = fl(fp8_max * fl(2**-margin))``, the previous scale for an amax that is 0
or not finite, FLT_MAX for an infinite quotient. TE's amax kernels
(``current_scaling.cu``: ``amax_kernel``) reduce ``fmaxf(|x|, max)``: NaN elements are
skipped. Each step quantizes with the scale from the steps before it.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch

from floatguard.emulation import Delayed

FLT_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]
FP8_MAX = {"e4m3fn": 448.0, "e5m2": 57344.0}


def to_f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


def f32_div(num: float, den: float) -> float:
    """The correctly rounded float32 quotient of two float32 numbers (inf past FLT_MAX +
    half an ulp), from exact rationals."""
    exact = Fraction(num) / Fraction(den)
    if exact >= Fraction(FLT_MAX) + Fraction(2) ** 103:
        return math.inf
    lo = to_f32(float(exact))
    best = None
    for cand in (lo, math.nextafter(lo, -math.inf), math.nextafter(lo, math.inf)):
        c = to_f32(cand)
        if not math.isfinite(c):
            continue
        err = abs(Fraction(c) - exact)
        key = (err, struct.unpack("<I", struct.pack("<f", c))[0] & 1)  # ties: even pattern
        if best is None or key < best[0]:
            best = (key, c)
    assert best is not None
    return best[1]


def fmaxf(a: float, b: float) -> float:
    if math.isnan(a):
        return b
    if math.isnan(b):
        return a
    return max(a, b)


def te_amax(x: torch.Tensor) -> float:
    m = 0.0
    for v in x.abs().reshape(-1).tolist():
        m = fmaxf(m, v)
    return m


class TEDelayed:
    """TE's DelayedScaling state for one tensor: amax history (slot 0 = this step) and scale."""

    def __init__(self, fmt: str, length: int, algo: str, margin: float) -> None:
        self.hist = [0.0] * length
        self.scale = 1.0
        self.algo = algo
        self.scaled_max = to_f32(FP8_MAX[fmt] * to_f32(2.0**-margin))

    def step(self, amax: float) -> float:
        used = self.scale
        self.hist[0] = amax  # the cast kernel records the amax in slot 0
        last = self.hist[0]
        a = 0.0
        n = len(self.hist)
        if last != 0.0:
            window = [self.hist[i + 1] if i < n - 1 else last for i in range(n)]
            for v in window:
                a = fmaxf(a, v)
            self.hist = [0.0, *window[1:]]
        if self.algo == "most_recent":
            a = last
        s = f32_div(self.scaled_max, a) if (math.isfinite(a) and a > 0) else self.scale
        self.scale = FLT_MAX if math.isinf(s) else s
        return used


def run(scaler: object, xs: list[torch.Tensor]) -> list[float]:
    return [float(scaler(x).scales) for x in xs]  # type: ignore[operator]


def test_the_issue_example_history_2_over_8_4_0_1_1() -> None:
    xs = [torch.full((4,), v) for v in (8.0, 4.0, 0.0, 1.0, 1.0)]
    got = run(Delayed("e4m3fn", history_len=2).scaler(), xs)
    assert got == [1.0, 56.0, 56.0, 56.0, 112.0]  # TE's; the old rolling gave 112, 448 last
    ref = TEDelayed("e4m3fn", 2, "max", 0)
    assert [ref.step(te_amax(x)) for x in xs] == got


def _sequence(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(14):
        k = int(torch.randint(0, 5, (1,), generator=g))
        mag = float(torch.exp2(torch.randint(-20, 20, (1,), generator=g).float()))
        if k == 0:
            out.append(torch.zeros(32))  # an expert with no tokens, a frozen path
        else:
            out.append(torch.randn(32, generator=g) * mag)
    out.insert(3, torch.full((8,), 1e-40))  # 448 / amax overflows: FLT_MAX
    out.insert(7, torch.zeros(0))  # empty: amax 0
    return out


STEPS = [
    (fmt, length, algo, margin)
    for fmt in ("e4m3fn", "e5m2")
    for length in (1, 2, 3, 16)
    for algo in ("max", "most_recent")
    for margin in (0, 1, 0.5)
]


@pytest.mark.parametrize(
    ("fmt", "length", "algo", "margin"),
    STEPS,
    ids=[f"{f}-h{n}-{a}-m{m}" for f, n, a, m in STEPS],
)
def test_delayed_scales_and_values_match_te(
    fmt: str, length: int, algo: str, margin: float
) -> None:
    xs = _sequence(length * 7 + int(margin * 2))
    scaler = Delayed(fmt, history_len=length, algo=algo, margin=margin).scaler()  # type: ignore[arg-type]
    ref = TEDelayed(fmt, length, algo, margin)
    for i, x in enumerate(xs):
        r = scaler(x)
        used = ref.step(te_amax(x))
        assert float(r.scales) == used, (i, float(r.scales), used)
        dt = torch.float8_e4m3fn if fmt == "e4m3fn" else torch.float8_e5m2
        m = FP8_MAX[fmt]
        expected = torch.clamp(x.float() * used, -m, m).to(dt).float() / used  # saturating cast
        assert torch.equal(r.values, expected), i
    assert float(scaler.scale) == ref.scale  # type: ignore[arg-type]


def test_a_zero_step_is_counted_and_leaves_the_history_alone() -> None:
    s = Delayed("e4m3fn", history_len=3).scaler()
    s(torch.full((4,), 2.0))
    before = s.state_dict()
    r = s(torch.zeros(4))
    assert int(r.fallbacks) == 1  # the scale was not updated from data
    after = s.state_dict()
    assert torch.equal(after["history"], before["history"])
    assert torch.equal(after["scale"], before["scale"])


def _nan_sequence() -> list[torch.Tensor]:
    base = [torch.full((8,), v) for v in (2.0, 4.0, 1.0, 0.5, 3.0, 1.0)]
    base[1] = base[1].clone()
    base[1][3] = math.nan  # one NaN element: TE's amax is still 4.0
    base[3] = torch.full((8,), math.nan)  # all NaN: TE's amax is 0, a zero step
    base[4] = base[4].clone()
    base[4][0] = math.inf  # inf is kept: the window max is inf for a while
    return base


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("length", [1, 3])
def test_skip_elements_reproduces_te_and_counts_what_it_skipped(algo: str, length: int) -> None:
    xs = _nan_sequence()
    scaler = Delayed("e4m3fn", history_len=length, algo=algo, nan_policy="skip_elements").scaler()  # type: ignore[arg-type]
    ref = TEDelayed("e4m3fn", length, algo, 0)
    for i, x in enumerate(xs):
        r = scaler(x)
        assert float(r.scales) == ref.step(te_amax(x)), i
        assert int(r.nan_skipped) == int(torch.isnan(x).sum()), i  # type: ignore[arg-type]
        assert torch.equal(torch.isnan(r.values), torch.isnan(x))  # NaN values stay NaN


def test_propagate_keeps_the_nan_visible() -> None:
    xs = _nan_sequence()[:3]
    prop = Delayed("e4m3fn", history_len=3).scaler()  # nan_policy="propagate", the default
    skip = Delayed("e4m3fn", history_len=3, nan_policy="skip_elements").scaler()
    got_p = [prop(x) for x in xs]
    got_s = [skip(x) for x in xs]
    # The NaN amax of step 1 is recorded: the window max is NaN while it is in the window,
    # so the scale from step 0 (448 / 2) is kept, and each of those updates is a fallback.
    assert [float(r.scales) for r in got_p] == [1.0, 224.0, 224.0]
    assert [int(r.fallbacks) for r in got_p] == [0, 1, 1]
    assert prop.history is not None and math.isnan(float(prop.history[1]))  # most recent first
    assert int(got_p[1].nan_skipped) == 0  # type: ignore[arg-type]
    # TE skips the element: step 1's amax is 4, the next scale 448 / 4.
    assert [float(r.scales) for r in got_s] == [1.0, 224.0, 112.0]
    assert [int(r.fallbacks) for r in got_s] == [0, 0, 0]


def test_skip_nonfinite_skips_history_entries_not_elements() -> None:
    # skip_nonfinite (kept for compatibility) drops NaN *and inf* entries from the history
    # maximum; TE keeps an inf amax (the scale stays put while it is in the window) and
    # skips NaN per element. Same 6 steps, history 3:
    xs = _nan_sequence()
    old = Delayed("e4m3fn", history_len=3, skip_nonfinite=True).scaler()
    te = Delayed("e4m3fn", history_len=3, nan_policy="skip_elements").scaler()
    old_scales = run(old, xs)
    te_scales = run(te, xs)
    ref = TEDelayed("e4m3fn", 3, "max", 0)
    assert te_scales == [ref.step(te_amax(x)) for x in xs]
    # step 1 (a NaN element): skip_nonfinite drops the step's whole amax (4.0), TE keeps it;
    # the inf of step 4 stays in TE's window (the scale is held at 112), skip_nonfinite
    # ignores it and moves to 448 / 1.
    assert te_scales == [1.0, 224.0, 112.0, 112.0, 112.0, 112.0]
    assert old_scales == [1.0, 224.0, 224.0, 224.0, 448.0, 448.0]
    assert float(te.scale) == 112.0 and float(old.scale) == 448.0  # type: ignore[arg-type]


def test_nan_policy_is_checked() -> None:
    with pytest.raises(ValueError, match=r"Delayed\.nan_policy='skip'.*propagate.*skip_elements"):
        Delayed(nan_policy="skip")  # type: ignore[arg-type]
