"""NVIDIA's NVFP4 training recipe (arXiv 2509.25149; TE's NVFP4BlockScaling): the
16-point random Hadamard transform of the wgrad inputs, stochastic rounding of the
gradients, 16x16 weight tiles, the layers kept in high precision; references written
here from the published formulas."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from floatguard.emulation import (
    NVFP4,
    EmulatedLinear,
    EmulationRecipe,
    emulate,
    random_hadamard_transform,
    restore,
    rht_matrix,
)

TE_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]  # TE get_wgrad_sign_vector


def hadamard(n: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix / sqrt(n): entry (i, j) is (-1)**popcount(i & j)."""
    i = torch.arange(n)
    both = i[:, None] & i[None, :]
    pop = torch.zeros_like(both)
    for b in range(n.bit_length()):
        pop += (both >> b) & 1
    return (1.0 - 2.0 * (pop % 2)).double() / n**0.5


def test_the_rht_matrix_is_orthonormal_and_tes() -> None:
    r = rht_matrix(16)
    assert r.dtype == torch.float32
    assert torch.equal(r @ r.T, torch.eye(16))  # entries +-1/4: exact in float32
    want = (torch.diag(torch.tensor(TE_SIGNS, dtype=torch.float64)) @ hadamard(16)).float()
    assert torch.equal(r, want)
    seeded = rht_matrix(16, seed=3)
    assert torch.equal(seeded, rht_matrix(16, seed=3)) and not torch.equal(seeded, r)
    assert torch.equal(seeded.abs(), hadamard(16).abs().float())
    big = rht_matrix(32, seed=0)  # 1/sqrt(32) is rounded: orthonormal to float32
    torch.testing.assert_close(big @ big.T, torch.eye(32), rtol=0, atol=2e-7)
    with pytest.raises(ValueError, match="16 entries, not 32: pass seed="):
        rht_matrix(32)
    with pytest.raises(ValueError, match="Hadamard size 12 must be a power of two"):
        rht_matrix(12)


def test_the_transform_is_blocks_times_the_matrix() -> None:
    x = torch.randn(3, 5, 48) * torch.logspace(-3, 3, 48)
    want = (x.double().reshape(3, 5, 3, 16) @ rht_matrix(16).double()).reshape(x.shape).float()
    got = random_hadamard_transform(x)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    # orthogonal: the transform cancels in a dot product over the blocks' dim
    y = torch.randn(4, 48)
    torch.testing.assert_close(
        random_hadamard_transform(x.reshape(15, 48)) @ random_hadamard_transform(y).T,
        x.reshape(15, 48) @ y.T, rtol=1e-5, atol=1e-4,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"last dim 40 is not a multiple .* zero-pad it to 48"):
        random_hadamard_transform(torch.randn(2, 40))


def _rht_tokens(t: torch.Tensor) -> torch.Tensor:
    """t [R, M] with M zero-padded to a multiple of 16, each 16-block along M times D H."""
    t = torch.nn.functional.pad(t, (0, (-t.shape[1]) % 16))
    r = torch.diag(torch.tensor(TE_SIGNS, dtype=torch.float64)) @ hadamard(16)
    return (t.double().reshape(t.shape[0], -1, 16) @ r).reshape(t.shape).float()


@pytest.mark.parametrize("m", [48, 40], ids=["M=48", "M=40 (padded)"])
def test_wgrad_is_nvfp4_of_both_operands_after_the_rht(m: int) -> None:
    """dW = Q(RHT(dY^T)) Q(RHT(X^T))^T, blocks along the tokens; fprop and dgrad are
    untouched by the transform (TE applies it to the column-wise copies only)."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 24, bias=False)
    x = torch.randn(m, 32) * torch.logspace(-2, 1, m)[:, None]  # outlier tokens
    g = torch.randn(m, 24) * 1e-2
    with_rht = EmulatedLinear(lin, EmulationRecipe.nvfp4_training(stochastic=False))
    xg = x.clone().requires_grad_()
    y = with_rht(xg)
    y.backward(g)
    nv = NVFP4()
    want = nv(_rht_tokens(g.T.contiguous())).values @ nv(_rht_tokens(x.T.contiguous())).values.T
    assert lin.weight.grad is not None and torch.equal(lin.weight.grad, want)
    no_rht = EmulatedLinear(lin, EmulationRecipe.nvfp4_training(rht=False, stochastic=False))
    xg2 = x.clone().requires_grad_()
    lin.weight.grad = None
    y2 = no_rht(xg2)
    y2.backward(g)
    assert torch.equal(y, y2) and xg.grad is not None and torch.equal(xg.grad, xg2.grad)
    plain = nv(g.T.contiguous()).values @ nv(x.T.contiguous()).values.T
    assert torch.equal(lin.weight.grad, plain) and not torch.equal(plain, want)
    # the transform cancels: both are estimates of the same dY^T X
    exact = g.T @ x
    err = (want - exact).norm() / exact.norm()
    assert err < 0.2, f"relative error of the RHT'd NVFP4 dW {err:.3f}"


def _exact_block_maxima(m: int, n: int, a: float) -> torch.Tensor:
    """[m, n] values in (-a, a) with one +-a in every 16-block of every row and of every
    column: every block's e4m3 scale is exactly 448 * a / amax, nothing saturates, so
    stochastic rounding is unbiased element by element (E[Q(x)] = x)."""
    v = (torch.rand(m, n) * 2 - 1) * a * 0.999
    i, j = torch.meshgrid(torch.arange(m), torch.arange(n), indexing="ij")
    on = (i % 16) == (j % 16)
    return torch.where(on, torch.where(torch.rand(m, n) < 0.5, -a, a), v)


def test_stochastic_rounding_of_the_gradients_is_unbiased() -> None:
    """dX = Q_sr(dY) Q(W^T)^T and dW = Q_sr(dY^T) Q(X^T)^T: over 400 draws (seeded by
    the autouse fixture) the summed error of each has mean within 4 standard errors of
    0; round-to-nearest is biased by more than that; the forward is deterministic."""
    lin = nn.Linear(32, 32, bias=False)
    x = torch.randn(64, 32)
    g = _exact_block_maxima(64, 32, 0.5)
    emu = EmulatedLinear(lin, EmulationRecipe.nvfp4_training(rht=False))
    nv, nv2 = NVFP4(), NVFP4(two_d=True)
    dx_mean = g @ nv2(lin.weight.detach().T.contiguous()).values.T  # E[dX]
    dw_mean = g.T @ nv(x.T.contiguous()).values.T  # E[dW]
    trials = 400
    dx_err, dw_err, outputs = [], [], []
    for _ in range(trials):
        xg = x.clone().requires_grad_()
        lin.weight.grad = None
        y = emu(xg)
        y.backward(g)
        assert xg.grad is not None and lin.weight.grad is not None
        dx_err.append(float((xg.grad - dx_mean).sum()))
        dw_err.append(float((lin.weight.grad - dw_mean).sum()))
        outputs.append(y.detach())
    for name, errs in (("dX", torch.tensor(dx_err)), ("dW", torch.tensor(dw_err))):
        sem = errs.std() / trials**0.5
        assert sem > 0, f"{name}: no randomness"
        assert errs.mean().abs() <= 4 * sem, f"{name}: mean {errs.mean():.3g}, sem {sem:.3g}"
    assert all(torch.equal(o, outputs[0]) for o in outputs)  # X and W round to nearest
    nearest = EmulatedLinear(lin, EmulationRecipe.nvfp4_training(rht=False, stochastic=False))
    xg = x.clone().requires_grad_()
    nearest(xg).backward(g)
    assert xg.grad is not None
    bias = float((xg.grad - dx_mean).sum())
    assert abs(bias) > 4 * float(torch.tensor(dx_err).std()) / trials**0.5, bias


def test_the_preset_options_and_its_high_precision_layers() -> None:
    r = EmulationRecipe.nvfp4_training()
    ops = r.operands()
    assert ops["fprop_input"] == NVFP4() and ops["fprop_weight"] == NVFP4(two_d=True)
    assert ops["dgrad_weight"] == NVFP4(two_d=True) and ops["wgrad_input"] == NVFP4()
    assert ops["dgrad_grad"] == ops["wgrad_grad"] == NVFP4(rounding="stochastic")
    assert r.wgrad_rht == 16 and r.rht_seed is None and r.skip == ("head",)
    ablated = EmulationRecipe.nvfp4_training(rht=False, stochastic=False, two_d=False)
    assert ablated.wgrad_rht is None and ablated.grad == NVFP4() and ablated.weight == NVFP4()

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(16, 16)
            self.last = nn.Linear(16, 16)
            self.head = nn.Linear(16, 8)

    model = LM()
    cov = emulate(model, r)  # no skip given: the preset's
    assert list(cov) == ["body", "last"] and cov.left == {"Linear": ["head"]}
    restore(model)
    cov = emulate(model, EmulationRecipe.nvfp4_training(skip=("head", "last")))
    assert list(cov) == ["body"]
    restore(model)
    assert list(emulate(model, r, skip=())) == ["body", "last", "head"]  # an explicit skip wins
    restore(model)


def test_stochastic_rounding_is_biased_only_at_a_saturated_block_maximum() -> None:
    """The documented bias: unbiased except where the e4m3 block scale rounded down and
    the block's largest magnitude saturated at 6 (then no draw rounds it up)."""
    from floatguard.emulation.recipes import NVFP4 as Nv

    torch.manual_seed(0)
    x = torch.randn(256, 512, dtype=torch.float32)
    r = Nv(rounding="stochastic")
    draws = 64
    mean = sum(r(x).values.double() for _ in range(draws)) / draws
    blocks = x.abs().reshape(256, -1, 16)
    top = (blocks == blocks.amax(-1, keepdim=True)).reshape(x.shape)
    bias = (mean - x.double()) * x.sign().double()
    at_max = float(bias[top].sum() / x.abs()[top].double().sum())
    elsewhere = float(bias[~top].sum() / x.abs()[~top].double().sum())
    assert -0.02 < at_max < -0.005  # about 1% toward zero
    assert abs(elsewhere) < 0.002  # unbiased within the draws' noise
