"""softmax / log_softmax / logsumexp / LogSumExp against torch and float64."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from floatguard.ops import LogSumExp, log_softmax, logsumexp, softmax

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6, torch.float64: 1e-12}


def adversarial(dtype: torch.dtype) -> torch.Tensor:
    """Rows: ±1e4 logits, all equal, one huge among tiny, mixed -inf, ordinary."""
    big = 1e4
    rows = [
        [big, -big, 0.0, big / 2, -big / 3],
        [7.0] * 5,
        [big, 1e-6, -1e-6, 2e-6, 0.0],
        [-math.inf, 0.5, -math.inf, 1.5, -2.0],
        [0.1, -0.3, 2.2, 1.0, -1.7],
        [-big, -big, -big, -big, -big + 1],
    ]
    return torch.tensor(rows, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [-1, 0])
def test_match_float64_reference_and_torch(dtype: torch.dtype, dim: int) -> None:
    x = adversarial(dtype)
    x64 = x.double()
    tol = TOL[dtype]
    ref_sm = torch.softmax(x64, dim=dim)
    ref_lse = torch.logsumexp(x64, dim=dim)
    got_sm = softmax(x, dim)
    assert got_sm.dtype == dtype
    torch.testing.assert_close(got_sm.double(), ref_sm, atol=tol, rtol=tol)
    torch.testing.assert_close(logsumexp(x, dim).double(), ref_lse, atol=0, rtol=tol)
    ls = log_softmax(x, dim).double()
    ref_ls = torch.log_softmax(x64, dim=dim)
    finite = torch.isfinite(ref_ls)
    assert torch.equal(torch.isfinite(ls), finite)
    # Absolute error of log-probs scales with the logits' magnitude in half precision.
    torch.testing.assert_close(ls[finite], ref_ls[finite], atol=tol * 1e4, rtol=tol)
    if dtype in (torch.float32, torch.float64):
        torch.testing.assert_close(got_sm, torch.softmax(x, dim=dim))
        torch.testing.assert_close(logsumexp(x, dim), torch.logsumexp(x, dim=dim))


def test_lesson_numbers() -> None:
    assert softmax(torch.tensor([1000.0, 2000.0, 3000.0])).tolist() == [0.0, 0.0, 1.0]
    assert float(logsumexp(torch.tensor([1000.0] * 3, dtype=torch.float64))) == pytest.approx(
        1000 + math.log(3), abs=1e-12
    )
    assert float(logsumexp(torch.tensor([1000.0] * 3))) == pytest.approx(1001.0986, abs=1e-4)
    assert float(logsumexp(torch.tensor([-1000.0] * 3))) == pytest.approx(-998.9014, abs=1e-4)
    sm = softmax(torch.tensor([100.0, 101.0, 102.0]))
    assert [round(v, 3) for v in sm.tolist()] == [0.090, 0.245, 0.665]
    x16 = torch.tensor([6.0, -3.0, 15.0], dtype=torch.float16)
    naive = torch.exp(x16) / torch.exp(x16).sum()  # the lesson's unstable version
    assert bool(torch.isnan(naive).any())
    ours = softmax(x16)
    assert ours.dtype == torch.float16
    assert float(ours[0]) == pytest.approx(1.23e-4, rel=1e-2)
    assert float(ours[1]) == pytest.approx(0.0, abs=1e-6) and float(ours[2]) == pytest.approx(1.0)


def test_all_neg_inf_rows() -> None:
    x = torch.tensor([[-math.inf] * 3, [0.0, 1.0, 2.0]], dtype=torch.float64, requires_grad=True)
    assert bool(torch.isnan(torch.softmax(x, -1)[0]).all())  # torch's behaviour
    sm = softmax(x)
    assert sm[0].tolist() == [0.0, 0.0, 0.0]
    assert log_softmax(x)[0].tolist() == [-math.inf] * 3
    lse = logsumexp(x)
    assert float(lse[0].detach()) == -math.inf
    (sm.sum() + lse[1] + (lse[0] * 0)).backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())
    assert bool(torch.isnan(softmax(x, empty_rows="nan")[0]).all())
    assert bool(torch.isnan(log_softmax(x, empty_rows="nan")[0]).all())
    assert math.isnan(float(logsumexp(x.detach(), empty_rows="nan")[0]))
    with pytest.raises(ValueError, match="empty_rows='none'"):
        softmax(x, empty_rows="none")  # type: ignore[arg-type]


def test_inf_and_nan_propagate() -> None:
    x = torch.tensor([[math.inf, 0.0], [math.nan, 0.0]])
    assert bool(torch.isnan(softmax(x)).all()) and bool(torch.isnan(torch.softmax(x, -1)).all())
    assert bool(torch.isnan(log_softmax(x)).all())
    assert float(logsumexp(x)[0]) == math.inf and math.isnan(float(logsumexp(x)[1]))
    assert torch.equal(logsumexp(x).isnan(), torch.logsumexp(x, -1).isnan())


def test_shapes_dims_and_empty() -> None:
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    torch.testing.assert_close(logsumexp(x, (0, 2), keepdim=True), torch.logsumexp(x, (0, 2), True))
    torch.testing.assert_close(softmax(x, 1), torch.softmax(x, 1))
    assert softmax(torch.empty(3, 0)).shape == (3, 0)
    e = logsumexp(torch.empty(3, 0), -1)
    assert e.tolist() == [-math.inf] * 3 and torch.equal(e, torch.logsumexp(torch.empty(3, 0), -1))
    assert float(softmax(torch.tensor(3.0))) == 1.0
    with pytest.raises(IndexError, match="dim=2 is out of range"):
        softmax(torch.ones(3, 3), dim=2)
    with pytest.raises(TypeError, match=r"got torch.int64"):
        softmax(torch.ones(3, dtype=torch.long))


def test_gradients_match_autograd_gradcheck() -> None:
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: softmax(t, -1), (x,))
    assert torch.autograd.gradcheck(lambda t: log_softmax(t, 0), (x,))
    assert torch.autograd.gradcheck(lambda t: logsumexp(t, -1), (x,))
    assert torch.autograd.gradgradcheck(lambda t: logsumexp(t, -1), (x,))


class TestLogSumExpState:
    def test_streaming_equals_one_shot(self) -> None:
        x = torch.randn(4, 1000, dtype=torch.float64) * 50
        state = LogSumExp.empty((4,), dtype=torch.float64)
        for chunk in x.split(77, dim=1):
            state = state.absorb(chunk, dim=1)
        torch.testing.assert_close(state.value(), torch.logsumexp(x, dim=1))

    def test_empty_is_identity_and_no_nan(self) -> None:
        e = LogSumExp.empty((2,))
        assert e.value().tolist() == [-math.inf, -math.inf]
        both = e.merge(e)
        assert both.value().tolist() == [-math.inf, -math.inf]
        s = LogSumExp.of(torch.tensor([[1.0, 2.0], [-math.inf, -math.inf]]))
        merged = e.merge(s)
        assert torch.equal(merged.value(), s.value())
        assert float(merged.value()[1]) == -math.inf

    def test_half_inputs_accumulate_in_float32(self) -> None:
        s = LogSumExp.of(torch.full((1000,), 60000.0, dtype=torch.float16))
        assert s.max.dtype == torch.float32
        assert float(s.value()) == pytest.approx(60000 + math.log(1000), rel=1e-6)

    def test_merge_rejects_other_types(self) -> None:
        with pytest.raises(TypeError, match="can only merge a LogSumExp"):
            LogSumExp.empty().merge(3)  # type: ignore[arg-type]


block = st.lists(
    st.floats(min_value=-1e4, max_value=1e4, allow_nan=False) | st.just(-math.inf),
    min_size=0,
    max_size=20,
)


@settings(max_examples=200, deadline=None)
@given(a=block, b=block, c=block)
def test_merge_is_associative_and_commutative(
    a: list[float], b: list[float], c: list[float]
) -> None:
    sa, sb, sc = (LogSumExp.of(torch.tensor(v, dtype=torch.float64)) for v in (a, b, c))
    left = sa.merge(sb).merge(sc).value()
    right = sa.merge(sb.merge(sc)).value()
    swapped = sc.merge(sa).merge(sb).value()
    ref = torch.logsumexp(torch.tensor(a + b + c, dtype=torch.float64), 0)
    for v in (left, right, swapped):
        if math.isinf(float(ref)):
            assert float(v) == float(ref)
        else:
            assert float(v) == pytest.approx(float(ref), rel=1e-12, abs=1e-9)
