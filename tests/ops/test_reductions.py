"""Moments, compensated_sum and pairwise_sum against float64 / math.fsum."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from floatguard.ops import Moments, compensated_sum, pairwise_sum


def test_lesson_variance() -> None:
    x = torch.tensor([1e6, 1e6 + 1, 1e6 + 2], dtype=torch.float32)
    naive = float((x * x).mean() - x.mean() ** 2)
    assert abs(naive - 2 / 3) > 0.1  # the lesson's catastrophic cancellation
    m = Moments.of(x)
    assert float(m.var()) == pytest.approx(2 / 3, rel=1e-6)
    # Streaming, one value at a time, gives the same.
    s = Moments.empty()
    for v in x:
        s = s.update(v.reshape(1))
    assert float(s.var()) == pytest.approx(2 / 3, rel=1e-6)
    assert float(s.mean) == 1e6 + 1


def test_streaming_and_merging_match_torch_var() -> None:
    x = torch.randn(1000, 5, dtype=torch.float64) * 3 + 1e4
    parts = [Moments.of(c, dim=0) for c in x.split(137)]
    total = Moments.empty((5,), dtype=torch.float64)
    for p in parts:
        total = total.merge(p)
    torch.testing.assert_close(total.mean, x.mean(0))
    torch.testing.assert_close(total.var(), x.var(0, correction=0))
    torch.testing.assert_close(total.var(1), x.var(0, correction=1))
    torch.testing.assert_close(total.std(1), x.std(0))
    assert total.count.tolist() == [1000.0] * 5


def test_half_inputs_and_small_counts() -> None:
    m = Moments.of(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float16))
    assert m.mean.dtype == torch.float32 and float(m.var(1)) == 1.0
    one = Moments.of(torch.tensor([5.0]))
    assert math.isnan(float(one.var(1))) and float(one.var()) == 0.0
    empty = Moments.of(torch.empty(0, 3), dim=0)
    assert empty.count.tolist() == [0.0] * 3
    assert bool(torch.isnan(empty.var()).all())


@settings(max_examples=100, deadline=None)
@given(
    a=st.lists(st.floats(-1e6, 1e6), min_size=0, max_size=30),
    b=st.lists(st.floats(-1e6, 1e6), min_size=0, max_size=30),
    c=st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=30),
)
def test_merge_matches_numpy(a: list[float], b: list[float], c: list[float]) -> None:
    ma, mb, mc = (Moments.of(torch.tensor(v, dtype=torch.float64)) for v in (a, b, c))
    left = ma.merge(mb).merge(mc)
    right = ma.merge(mb.merge(mc))
    ref = np.array(a + b + c)
    for m in (left, right):
        assert float(m.count) == len(ref)
        assert float(m.mean) == pytest.approx(ref.mean(), rel=1e-9, abs=1e-6)
        assert float(m.var()) == pytest.approx(ref.var(), rel=1e-7, abs=1e-4)


def _hard_sum(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-20, 20, (n,), generator=g).double()
    )
    return torch.cat([x, -x[: n // 2]]).to(torch.float32)  # heavy cancellation


def test_compensated_sum_is_near_exact() -> None:
    x = _hard_sum(100_000, 0)
    exact = math.fsum(x.double().tolist())
    scale = float(x.abs().sum())
    naive = float(np.cumsum(x.numpy(), dtype=np.float32)[-1])  # left-to-right in float32
    ours = float(compensated_sum(x))
    assert ours == pytest.approx(exact, abs=4 * 2**-24 * abs(exact) + 1e-6 * 2**-24 * scale)
    assert abs(naive - exact) > 10 * abs(ours - exact)


def test_pairwise_sum_beats_sequential() -> None:
    x = torch.full((2**20,), 0.1, dtype=torch.float32)
    exact = math.fsum(x.double().tolist())
    seq = float(np.cumsum(x.numpy(), dtype=np.float32)[-1])  # torch.cumsum accumulates in double
    pw = float(pairwise_sum(x))
    assert abs(pw - exact) < abs(seq - exact) / 100
    assert abs(pw - exact) <= 20 * 2**-24 * exact  # O(eps log n)


def test_sums_over_dims_match_fsum_and_propagate_specials() -> None:
    x = torch.randn(4, 333, 5, dtype=torch.float64)
    ref = torch.tensor(
        [[math.fsum(x[i, :, j].tolist()) for j in range(5)] for i in range(4)], dtype=torch.float64
    )
    torch.testing.assert_close(compensated_sum(x, dim=1), ref, rtol=1e-15, atol=1e-14)
    torch.testing.assert_close(pairwise_sum(x, dim=1), ref, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(compensated_sum(x, dim=(0, 2)), x.sum((0, 2)))
    assert float(compensated_sum(torch.tensor([1.0, math.inf, 2.0]))) == math.inf
    assert math.isnan(float(compensated_sum(torch.tensor([1.0, math.nan]))))
    assert math.isnan(float(compensated_sum(torch.tensor([math.inf, -math.inf]))))
    assert (
        float(pairwise_sum(torch.empty(0))) == 0.0 and float(compensated_sum(torch.empty(0))) == 0.0
    )
    assert (
        float(compensated_sum(torch.tensor([1.0, 2.0], dtype=torch.float16), dtype=torch.float64))
        == 3.0
    )


def test_sums_are_differentiable() -> None:
    x = torch.randn(50, dtype=torch.float64, requires_grad=True)
    for fn in (compensated_sum, pairwise_sum):
        (g,) = torch.autograd.grad(fn(x) * 2, x)
        assert torch.equal(g, torch.full_like(x, 2.0))
