"""emulate() covers transformers' Conv1D as the GEMM it is, says what it left in high
precision, and refuses to cover nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from floatguard.emulation import EmulationRecipe, emulate, restore


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D as GPT-2 uses it: weight (in, out), x @ W + b."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.05)
        self.bias = nn.Parameter(torch.randn(nf) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


class GPT2Block(nn.Module):
    def __init__(self, d: int = 128) -> None:
        super().__init__()
        self.c_attn = Conv1D(3 * d, d)
        self.c_proj = Conv1D(d, 3 * d)
        self.conv = nn.Conv3d(1, 1, 3)  # a GEMM emulate does not cover
        self.lm_head = nn.Linear(d, 50, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.c_proj(torch.relu(self.c_attn(x))))


@pytest.mark.parametrize(
    "recipe",
    [EmulationRecipe.hybrid_tensorwise(), EmulationRecipe.hybrid_block(), EmulationRecipe.mxfp8()],
    ids=["tensorwise", "block", "mxfp8"],
)
def test_conv1d_is_emulated_exactly_as_the_equivalent_linear(recipe: EmulationRecipe) -> None:
    torch.manual_seed(0)
    block = GPT2Block()
    x = torch.randn(4, 128)
    ref = nn.Linear(128, 384)  # the same GEMM stored the nn.Linear way
    with torch.no_grad():
        ref.weight.copy_(block.c_attn.weight.t())
        ref.bias.copy_(block.c_attn.bias)
    covered = emulate(block, recipe, skip=("lm_head",))
    assert list(covered) == ["c_attn", "c_proj"]
    assert covered.left == {"Conv3d": ["conv"], "Linear": ["lm_head"]}
    assert "emulated 2 layer(s)" in covered.summary()
    emulate(wrapper := nn.Sequential(ref), recipe)
    got = block.c_attn(x)
    want = wrapper(x)
    assert torch.equal(got, want)  # bit for bit: the same quantization of the same GEMM
    assert not torch.equal(got, x @ block.c_attn.weight + block.c_attn.bias)  # and lossy
    got.sum().backward()
    assert block.c_attn.weight.grad is not None  # trains through it
    restore(block)
    assert isinstance(block.c_attn, Conv1D)


def test_covering_nothing_is_an_error_that_says_why() -> None:
    with pytest.raises(
        ValueError, match=r"no nn\.Linear, Conv1D, nn\.Conv1d or nn\.Conv2d \(it has: Conv3d"
    ):
        emulate(nn.Sequential(nn.Conv3d(1, 1, 3)), EmulationRecipe.hybrid_block())
    with pytest.raises(ValueError, match=r"every candidate was skipped"):
        emulate(nn.Sequential(nn.Linear(4, 4)), EmulationRecipe.hybrid_block(), skip=("0",))


def test_presets_and_the_renamed_tensor_recipe() -> None:
    import warnings

    import floatguard.emulation as scaling
    from floatguard.emulation import MX, NVFP4, Block, TensorRecipe

    r = EmulationRecipe.mxfp8()
    # TE's MXFP8BlockScaling: e4m3 gradients too (Format.E4M3); e5m2 is its HYBRID option
    assert r.activation == MX("e4m3fn", 32, "rceil") and r.grad == MX("e4m3fn", 32, "rceil")
    assert EmulationRecipe.mxfp8(grad_element="e5m2").grad == MX("e5m2", 32, "rceil")
    assert EmulationRecipe.mxfp8("floor").weight == MX("e4m3fn", 32, "floor")
    d = EmulationRecipe.deepgemm(ue8m0=True)
    assert d.weight == Block("e4m3fn", (128, 128), "pow2", 1e-4, "decode_mul")
    n = EmulationRecipe.nvfp4_training()
    assert n.weight == NVFP4(two_d=True) and n.grad == NVFP4(rounding="stochastic")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = scaling.Recipe  # type: ignore[attr-defined]
    assert old is TensorRecipe
    assert any("TensorRecipe" in str(w.message) for w in caught)


def test_a_transformers_gpt2_is_covered() -> None:
    """A GPT-2 built from a config (random weights, no download): every Conv1D and, with
    attention=True, its SDPA matmuls; the LM head skipped; it trains through."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, bos_token_id=0,
        eos_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg).eval()  # no dropout: losses comparable
    ids = torch.randint(0, 128, (2, 16))
    ref = model(ids, labels=ids).loss
    cov = emulate(model, EmulationRecipe.hybrid_block(), skip=("lm_head",), attention=True)
    per_layer = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
    assert list(cov) == [f"transformer.h.{i}.{n}" for i in range(2) for n in per_layer]
    assert cov.left == {"Linear": ["lm_head"]}
    # attention comes from what ran: nothing yet, then one emulated SDPA call per block
    assert not cov.attention and "attention requested, no SDPA call seen yet" in cov.summary()
    out = model(ids, labels=ids)
    assert cov.attention and (cov.sdpa_calls, cov.forwards) == (2, 1)
    assert "matmuls (2 SDPA call(s) in 1 forward(s))" in cov.summary()
    assert torch.isfinite(out.loss) and out.loss.item() != ref.item()
    out.loss.backward()
    assert model.transformer.h[0].attn.c_attn.weight.grad is not None
    restore(model)
    assert model(ids, labels=ids).loss.item() == ref.item()
