"""Blocked attention against scaled_dot_product_attention and float64."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from floatguard.ops import attention


def _ref_lse(
    q: torch.Tensor, k: torch.Tensor, scale: float, bias: torch.Tensor | None
) -> torch.Tensor:
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias
    return torch.logsumexp(s, dim=-1)


@pytest.mark.parametrize("n_q,n_k,block", [(50, 50, 16), (33, 70, 128), (64, 64, 64), (5, 129, 32)])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_sdpa(n_q: int, n_k: int, block: int, causal: bool) -> None:
    q = torch.randn(2, 3, n_q, 16, dtype=torch.float64)
    k = torch.randn(2, 3, n_k, 16, dtype=torch.float64)
    v = torch.randn(2, 3, n_k, 8, dtype=torch.float64)
    out, lse = attention(q, k, v, causal=causal, block_size=block)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, ref)
    bias = None
    if causal:
        bias = torch.zeros(n_q, n_k, dtype=torch.float64).masked_fill(
            torch.ones(n_q, n_k, dtype=torch.bool).triu(1), -math.inf
        )
    torch.testing.assert_close(lse, _ref_lse(q, k, 1 / math.sqrt(16), bias))


def test_masks_scale_and_broadcast() -> None:
    q = torch.randn(2, 1, 20, 8, dtype=torch.float64)
    k = torch.randn(1, 4, 30, 8, dtype=torch.float64)
    v = torch.randn(1, 4, 30, 8, dtype=torch.float64)
    bool_mask = torch.rand(20, 30) > 0.3
    bool_mask[:, 0] = True
    out, _ = attention(q, k, v, mask=bool_mask, scale=0.3, block_size=7)
    ref = F.scaled_dot_product_attention(
        q.expand(2, 4, 20, 8),
        k.expand(2, 4, 30, 8),
        v.expand(2, 4, 30, 8),
        attn_mask=bool_mask,
        scale=0.3,
    )
    torch.testing.assert_close(out, ref)
    float_mask = torch.randn(20, 30, dtype=torch.float64)
    out, _ = attention(q, k, v, mask=float_mask, block_size=9)
    ref = F.scaled_dot_product_attention(
        q.expand(2, 4, 20, 8), k.expand(2, 4, 30, 8), v.expand(2, 4, 30, 8), attn_mask=float_mask
    )
    torch.testing.assert_close(out, ref)


def test_fully_masked_rows_are_zero_with_finite_grads() -> None:
    q = torch.randn(1, 6, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 10, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 10, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(6, 10, dtype=torch.bool)
    mask[2] = False
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out, lse = attention(q, k, v, mask=mask, block_size=4)
    assert bool(torch.isnan(ref[0, 2]).all()) or bool((ref[0, 2] == 0).all())
    assert out[0, 2].tolist() == [0.0] * 4 and float(lse[0, 2].detach()) == -math.inf
    keep = torch.arange(6) != 2
    torch.testing.assert_close(out[0, keep], ref[0, keep])
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and bool(torch.isfinite(t.grad).all())
    assert q.grad is not None and q.grad[0, 2].tolist() == [0.0] * 4


def test_gradcheck_and_grads_match_sdpa() -> None:
    q = torch.randn(1, 7, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 9, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 9, 2, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(7, 9) > 0.2
    mask[:, 0] = True

    def f(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return attention(a, b, c, mask=mask, causal=True, block_size=4)

    assert torch.autograd.gradcheck(f, (q, k, v))
    out, _ = attention(q, k, v, block_size=4)
    ref = F.scaled_dot_product_attention(q, k, v)
    g = torch.randn_like(out)
    torch.testing.assert_close(
        torch.autograd.grad((out * g).sum(), (q, k, v)),
        torch.autograd.grad((ref * g).sum(), (q, k, v)),
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_inputs(dtype: torch.dtype) -> None:
    q, k, v = (torch.randn(2, 40, 32).to(dtype) for _ in range(3))
    out, lse = attention(q, k, v, block_size=16)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_bad_input() -> None:
    q = torch.randn(4, 8)
    with pytest.raises(ValueError, match="feature sizes differ: 8 vs 6"):
        attention(q, torch.randn(5, 6), torch.randn(5, 6))
    with pytest.raises(ValueError, match="key counts differ: 5 vs 3"):
        attention(q, torch.randn(5, 8), torch.randn(3, 8))
    with pytest.raises(ValueError, match="block_size=0"):
        attention(q, q, q, block_size=0)
    with pytest.raises(ValueError, match="does not broadcast"):
        attention(q, q, q, mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="q, k, v dtypes differ"):
        attention(q, q.double(), q)


def test_no_keys_gives_zeros() -> None:
    out, lse = attention(torch.randn(3, 4), torch.empty(0, 4), torch.empty(0, 2))
    assert out.tolist() == [[0.0, 0.0]] * 3 and lse.tolist() == [-math.inf] * 3
