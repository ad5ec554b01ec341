"""``nan_policy`` of the current-scaling recipes (Tensorwise, Rowwise, Block).

``"propagate"`` (the default): a NaN element makes its amax NaN, the scale falls back to
1.0 and is counted, so the guard sees it. ``"skip_elements"``: Transformer Engine's
amax, ``fmaxf(|x|, max)`` over the elements (``current_scaling.cu``: ``amax_kernel``;
``quantize_transpose_vector_blockwise.cu``: the tile amax), which skips NaN and keeps
inf; the scale is then TE's ``compute_scale_from_amax`` (``recipe_common.cuh``): 1.0 for
an amax that is 0 or inf. In both, a NaN element comes back NaN, and
``QuantResult.nan_skipped`` counts the elements the amax skipped (a device int).
"""

from __future__ import annotations

import math

import pytest
import torch

from floatguard.emulation import Block, Rowwise, Tensorwise


def fmaxf_amax(x: torch.Tensor, dims: tuple[int, ...] | None) -> torch.Tensor:
    """TE's amax: NaN elements never win (fmaxf returns the other operand)."""
    m = torch.where(torch.isnan(x), torch.zeros_like(x), x.abs())
    return m.amax() if dims is None else m.amax(dim=dims, keepdim=True)


def te_scale(amax: torch.Tensor) -> torch.Tensor:
    """compute_scale_from_amax (epsilon 0): 448 / amax, 1.0 for an amax of 0, inf or NaN."""
    ok = torch.isfinite(amax) & (amax > 0)
    return torch.where(ok, torch.tensor(448.0) / torch.where(ok, amax, 1.0), 1.0)


def fake_quant(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.clamp(x * s, -448.0, 448.0).to(torch.float8_e4m3fn).float() / s


def with_nans() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 256, generator=g) * torch.exp2(torch.randint(-6, 6, (6, 1), generator=g))
    x[0, 3] = math.nan
    x[2, 200] = math.nan
    x[2, 201] = math.nan
    x[3, :] = math.nan  # a row (and its tiles) of NaN only: amax 0 under skip_elements
    x[4, 9] = math.inf
    return x


def test_tensorwise_skip_elements_is_te_current_scaling() -> None:
    x = with_nans()
    x[4, 9] = 1.0  # no inf here: one finite amax for the whole tensor
    r = Tensorwise(nan_policy="skip_elements")(x)
    s = te_scale(fmaxf_amax(x, None))
    assert torch.equal(r.scales, s) and int(r.fallbacks) == 0
    assert torch.equal(r.values.nan_to_num(7.0), fake_quant(x, s).nan_to_num(7.0))
    assert torch.equal(torch.isnan(r.values), torch.isnan(x))
    assert int(r.nan_skipped) == int(torch.isnan(x).sum()) == 259  # type: ignore[arg-type]
    p = Tensorwise()(x)  # propagate: NaN amax, scale 1.0, counted, nothing skipped
    assert float(p.scales) == 1.0 and int(p.fallbacks) == 1
    assert int(p.nan_skipped) == 0  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("recipe", "dims"),
    [
        (Rowwise(nan_policy="skip_elements"), (1,)),
        (Block("e4m3fn", (1, 128), nan_policy="skip_elements"), (1, 3)),
        (Block("e4m3fn", (2, 128), nan_policy="skip_elements"), (1, 3)),
    ],
    ids=["rowwise", "block-1x128", "block-2x128"],
)
def test_per_slice_skip_elements_matches_te(recipe: object, dims: tuple[int, ...]) -> None:
    x = with_nans()
    r = recipe(x)  # type: ignore[operator]
    if isinstance(recipe, Block):
        br, bc = recipe.block
        xt = x.reshape(6 // br, br, 256 // bc, bc)
    else:
        xt = x
    amax = fmaxf_amax(xt, dims)
    s = te_scale(amax)
    ref = fake_quant(xt, s).reshape(x.shape)
    assert torch.equal(r.values.nan_to_num(7.0), ref.nan_to_num(7.0))
    assert torch.equal(r.scales.reshape(-1), s.reshape(-1))
    fell = int(((amax == 0) | torch.isinf(amax)).sum())  # the all-NaN slices and the inf one
    assert int(r.fallbacks) == fell and fell >= 1
    assert int(r.nan_skipped) == int(torch.isnan(x).sum())  # type: ignore[arg-type]


def test_propagate_is_the_default_and_falls_back_per_slice() -> None:
    x = with_nans()
    r = Block("e4m3fn", (1, 128))(x)
    amax = x.reshape(6, 1, 2, 128).abs().amax(dim=(1, 3))
    assert r.scales[0, 0] == 1.0 and r.scales[2, 1] == 1.0  # the NaN tiles fell back
    assert int(r.fallbacks) == int((~torch.isfinite(amax)).sum())
    assert int(r.nan_skipped) == 0  # type: ignore[arg-type]
    assert torch.equal(torch.isnan(r.values), torch.isnan(x))


def test_nan_policy_is_checked_everywhere() -> None:
    for cls in (Tensorwise, Rowwise, Block):
        with pytest.raises(ValueError, match=rf"{cls.__name__}\.nan_policy='fmax'"):
            cls(nan_policy="fmax")  # type: ignore[arg-type]
