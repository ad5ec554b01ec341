"""TensorStats against direct counts, quantize, and the lesson's audit test block."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from floatguard import TensorStats, audit_tensor_numerics, quantize, tensor_stats
from floatguard.formats import FORMATS
from floatguard.stats import EXP_MIN


def sample() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20_000, generator=g) * torch.exp2(
        torch.randint(-30, 30, (20_000,), generator=g).float()
    )
    x[:5] = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0])
    x[5:10] = torch.tensor([1e-40, -3e-45, 3e38, 60000.0, 448.0])
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_counts_and_extremes(dtype: torch.dtype) -> None:
    """float32 takes the bit-pattern fast path, float64 the generic one: same answers."""
    x = sample().to(dtype)
    s = tensor_stats(x)
    finite = x[torch.isfinite(x)]
    nz = finite[finite != 0]
    assert int(s.numel) == x.numel() and int(s.nan) == 1
    assert (int(s.posinf), int(s.neginf), int(s.zeros)) == (1, 1, 2)
    assert float(s.amax) == float(finite.abs().max())
    assert float(s.min_nonzero) == float(nz.abs().min())
    assert (float(s.min), float(s.max)) == (float(finite.min()), float(finite.max()))
    expo = np.floor(np.log2(np.abs(nz.double().numpy()))).astype(int)
    ref = np.bincount(expo - EXP_MIN, minlength=277)
    assert s.hist.tolist() == ref.tolist()
    assert int(s.finite_nonzero) == nz.numel()


@pytest.mark.parametrize("name", ["fp16", "bf16", "e4m3fn", "e5m2", "e2m1fn"])
def test_format_fractions_match_quantize(name: str) -> None:
    fmt = FORMATS[name]
    x = sample()
    x = x[torch.isfinite(x)]
    s = tensor_stats(x)
    q = quantize(x, fmt, overflow="nonsaturate")
    underflow = int(((q == 0) & (x != 0)).sum())
    # Ties at exactly half the smallest subnormal round to zero but sit in the kept bin.
    assert abs(int(s.underflow_count(fmt)) - underflow) <= int(
        (x.abs() == fmt.smallest_subnormal / 2).sum()
    )
    overflow = int((x.abs() > fmt.max).sum())
    assert int(s.overflow_count(fmt)) >= overflow
    top = ((x.abs() >= 2.0**fmt.emax) & (x.abs() < 2.0 ** (fmt.emax + 1))).sum()
    assert int(s.overflow_count(fmt)) - overflow <= int(top)
    sub = int(((q.abs() < fmt.tiny) & (q != 0)).sum())
    # Values within half a subnormal step of tiny round up to it (normal), and values at
    # half the smallest subnormal round to zero: the binade counts cannot see either.
    edge = (x.abs() >= fmt.tiny * (1 - 2.0 ** -(fmt.mantissa_bits + 1))) & (x.abs() < fmt.tiny)
    edge |= x.abs() == fmt.smallest_subnormal / 2
    assert abs(int(s.subnormal_count(fmt)) - sub) <= int(edge.sum())
    assert 0.0 <= s.fraction(s.underflow_count(fmt)) <= 1.0


def test_recommended_scale() -> None:
    s = tensor_stats(torch.tensor([3.0, -10.0, math.nan]))
    assert float(s.recommended_scale("e4m3fn")) == pytest.approx(44.8)
    assert float(s.recommended_scale("e4m3fn", power_of_two=True)) == 32.0
    assert float(tensor_stats(torch.zeros(3)).recommended_scale("e4m3fn")) == 1.0


@settings(max_examples=50, deadline=None)
@given(
    a=st.lists(st.floats(width=32), max_size=40),
    b=st.lists(st.floats(width=32), max_size=40),
)
def test_merge_equals_stats_of_concatenation(a: list[float], b: list[float]) -> None:
    ta, tb = torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)
    merged = tensor_stats(ta).merge(tensor_stats(tb)).to_dict()
    whole = tensor_stats(torch.cat([ta, tb])).to_dict()
    assert merged == whole


def test_dict_round_trip_and_half_inputs() -> None:
    s = tensor_stats(sample().half())
    d = s.to_dict()
    assert isinstance(d["hist"], list) and isinstance(d["nan"], int)
    assert TensorStats.from_dict(d).to_dict() == d
    with pytest.raises(ValueError, match="missing fields"):
        TensorStats.from_dict({"numel": 3})
    with pytest.raises(TypeError, match="floating-point tensor"):
        tensor_stats(torch.ones(3, dtype=torch.long))
    e = tensor_stats(torch.empty(0))
    assert int(e.numel) == 0 and float(e.amax) == 0.0


def test_lesson_audit_block_unchanged() -> None:
    # The lesson's own test block, verbatim.
    np.random.seed(42)
    t_embed = np.random.normal(0, 0.5, size=(100, 100))
    t_layer1 = np.random.normal(0, 1e-5, size=(100, 100))
    t_layer2 = np.copy(t_embed)
    t_layer2[10, 20] = np.nan
    t_layer3 = t_layer2 * 2.0

    mock_layers = {
        "embed": t_embed,
        "layer1_norm": t_layer1,
        "layer2_attn": t_layer2,
        "layer3_ffn": t_layer3,
    }

    res = audit_tensor_numerics(mock_layers, target_fp_max=448.0, underflow_thresh=1e-4)
    assert res["first_nan_layer"] == "layer2_attn", (
        f"Expected root cause layer2_attn, got {res['first_nan_layer']}"
    )
    assert res["layer_reports"]["embed"]["has_nan"] == False  # noqa: E712
    assert res["layer_reports"]["layer1_norm"]["underflow_ratio"] > 0.95
    assert res["layer_reports"]["layer2_attn"]["has_nan"] == True  # noqa: E712
    assert res["layer_reports"]["layer3_ffn"]["has_nan"] == True  # noqa: E712
    # And the numbers themselves, against a direct computation.
    emb = res["layer_reports"]["embed"]
    assert emb["optimal_scale"] == pytest.approx(448.0 / np.abs(t_embed).max())
    assert res["layer_reports"]["layer1_norm"]["underflow_ratio"] == pytest.approx(
        float(np.mean(np.abs(t_layer1) < 1e-4))
    )
    assert res["layer_reports"]["layer2_attn"]["has_inf"] is False


def test_audit_accepts_torch_and_rejects_non_mappings() -> None:
    res = audit_tensor_numerics({"a": torch.tensor([1.0, math.inf]), "b": torch.zeros(3)})
    assert res["layer_reports"]["a"]["has_inf"] is True and res["first_nan_layer"] is None
    assert res["layer_reports"]["b"]["optimal_scale"] == 1.0
    with pytest.raises(TypeError, match="must be a mapping"):
        audit_tensor_numerics([torch.ones(2)])  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["coo", "coo_uncoalesced", "csr"])
def test_sparse_tensor_stats_are_those_of_the_dense_tensor(layout: str) -> None:
    idx = torch.tensor([[0, 1, 1, 2], [2, 0, 0, 1]])
    val = torch.tensor([-3e38, 3e38, 3e38, 1e-42])  # (1, 0) twice: sums to inf
    coo = torch.sparse_coo_tensor(idx, val, (4, 3), check_invariants=True)
    x = {"coo": coo.coalesce(), "coo_uncoalesced": coo, "csr": coo.to_dense().to_sparse_csr()}[
        layout
    ]
    got, want = tensor_stats(x), tensor_stats(x.to_dense())
    for f in ("numel", "nan", "posinf", "neginf", "zeros", "amax", "min_nonzero", "min", "max"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    assert torch.equal(got.hist, want.hist)
    assert int(got.posinf) == 1 and int(got.zeros) == 9


def test_packed_fp4_stats_match_ml_dtypes() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no packed FP4 dtype")
    codes = np.arange(256, dtype=np.uint8)  # every pair of E2M1 codes
    packed = torch.from_numpy(codes.copy()).view(torch.float4_e2m1fn_x2)
    low = (codes & 0xF).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    high = (codes >> 4).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    got, want = tensor_stats(packed), tensor_stats(torch.from_numpy(np.concatenate([low, high])))
    for f in ("numel", "nan", "posinf", "zeros", "amax", "min_nonzero", "min", "max", "hist"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    assert int(got.numel) == 512 and float(got.amax) == 6.0


@pytest.mark.parametrize("shape", [(5, 3), (4, 3, 2)])
@pytest.mark.parametrize("sparse_dim", [1, 2])
def test_dense_sum_is_the_dense_tensor_a_sparse_one_stands_for(
    shape: tuple[int, ...], sparse_dim: int
) -> None:
    from floatguard._values import dense_sum

    torch.manual_seed(0)
    nnz = 7
    idx = torch.stack([torch.randint(0, shape[d], (nnz,)) for d in range(sparse_dim)])
    idx[:, 1] = idx[:, 0]  # at least one duplicate
    vals = torch.randn(nnz, *shape[sparse_dim:])
    coo = torch.sparse_coo_tensor(idx, vals, shape, check_invariants=True)
    assert not coo.is_coalesced()
    torch.testing.assert_close(dense_sum(coo), coo.to_dense())
    empty = torch.sparse_coo_tensor(idx[:, :0], vals[:0], shape, check_invariants=True)
    assert torch.equal(dense_sum(empty), torch.zeros(shape))
