"""layer_norm / rms_norm against torch and float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from floatguard.ops import DEFAULT_EPS, layer_norm, rms_norm


def test_match_torch_float64() -> None:
    x = torch.randn(4, 6, 8, dtype=torch.float64) * 10 + 3
    w, b = torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)
    torch.testing.assert_close(layer_norm(x, (6, 8), w, b), F.layer_norm(x, (6, 8), w, b, 1e-5))
    torch.testing.assert_close(layer_norm(x, 8), F.layer_norm(x, (8,), eps=1e-5))
    torch.testing.assert_close(rms_norm(x, 8, w[0], eps=1e-6), F.rms_norm(x, (8,), w[0], eps=1e-6))
    xg = x[:2, :2, :3].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: layer_norm(t, 3), (xg,))
    assert torch.autograd.gradcheck(lambda t: rms_norm(t, 3), (xg,))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_statistics_in_float32(dtype: torch.dtype) -> None:
    # A large common offset: half-precision statistics would cancel; float32 ones do not.
    x = (torch.randn(8, 64) + 1000).to(dtype)
    ref = F.layer_norm(x.double(), (64,), eps=DEFAULT_EPS[dtype])
    out = layer_norm(x, 64)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=1e-2)
    r = rms_norm(x, 64)
    ref_r = x.double() * torch.rsqrt((x.double() ** 2).mean(-1, keepdim=True) + DEFAULT_EPS[dtype])
    torch.testing.assert_close(r.double(), ref_r, atol=1e-2, rtol=1e-2)


def test_default_eps_per_dtype() -> None:
    assert DEFAULT_EPS[torch.float32] == 1e-5 and DEFAULT_EPS[torch.float16] == 1e-4
    assert DEFAULT_EPS[torch.float16] > torch.finfo(torch.float16).tiny > 1e-5
    const = torch.full((2, 16), 7.0, dtype=torch.float16)
    assert bool(torch.isfinite(layer_norm(const, 16)).all())


def test_bad_input() -> None:
    with pytest.raises(ValueError, match=r"normalized_shape \(5,\) does not match"):
        layer_norm(torch.randn(3, 4), 5)
    with pytest.raises(ValueError, match="eps=-1"):
        rms_norm(torch.randn(3, 4), 4, eps=-1)
    with pytest.raises(TypeError, match=r"got torch.int64"):
        layer_norm(torch.ones(3, 4, dtype=torch.long), 4)
