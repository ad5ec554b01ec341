"""EmulationRecipe.te_delayed(): Transformer Engine's DelayedScaling per layer and tensor
role, against a reference written from TE's recipe.

The reference (TE ``transformer_engine/pytorch/quantization.py`` and
``common/recipe/delayed_scaling.cu``, docs "FP8 Delayed Scaling"): each module keeps an
amax history and a scale for its input X, its weight W (forward, updated when the
autocast region exits with grad enabled) and its output gradient dY (backward, updated
when the backward ends); each tensor is cast once per step with the scale from the steps
before (values ``fp8(clip(x * s)) / s``, here from ml_dtypes) and the FP8 copy serves
both GEMMs it enters; a cast records its amax in slot 0 with a max; with
``reduce_amax`` the amaxes are MAX-reduced over the group before the update. The
history/scale rule per tensor is ``TEDelayed`` (test_delayed_te.py, TE's kernel_bulk).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import nn

from floatguard.emulation import Delayed, EmulationRecipe, emulate

from .._ranks import run_ranks
from .test_delayed_te import TEDelayed, te_amax

FMT = {"e4m3fn": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}
ROLES = ("input", "weight", "grad")
LAYERS = ("0", "2")


def ref_q(x: torch.Tensor, s: float, fmt: str) -> torch.Tensor:
    """fp8(clip(x * s)) / s in float32, the cast through ml_dtypes."""
    dt, mx = FMT[fmt]
    xs = (x.detach().to(torch.float32) * torch.tensor(s, dtype=torch.float32)).numpy()
    q = np.clip(xs, -mx, mx).astype(dt).astype(np.float32)
    return torch.from_numpy(q) / torch.tensor(s, dtype=torch.float32)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def data(step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Step ``step``'s input, output-gradient weights R and layer weights (magnitudes
    that change from step to step, so the histories matter)."""
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(8, 16, generator=g) * 2.0 ** ((step * 3) % 7 - 3)
    r = torch.randn(8, 8, generator=g) * 2.0 ** (step % 4 - 2)
    ws = [torch.randn(32, 16, generator=g) * 0.5**step, torch.randn(8, 32, generator=g)]
    return x, r, ws


class Reference:
    """The two-layer MLP under TE's DelayedScaling, written from the recipe."""

    def __init__(self, length: int, algo: str, margin: float, fmt_grad: str) -> None:
        self.fmt = {"input": "e4m3fn", "weight": "e4m3fn", "grad": fmt_grad}
        self.state = {
            (layer, role): TEDelayed(self.fmt[role], length, algo, margin)
            for layer in LAYERS for role in ROLES
        }  # fmt: skip
        self.slot0: dict[tuple[str, str], float] = {k: 0.0 for k in self.state}

    def scales(self) -> dict[str, dict[str, float]]:
        return {n: {r: self.state[(n, r)].scale for r in ROLES} for n in LAYERS}

    def cast(self, layer: str, role: str, t: torch.Tensor) -> torch.Tensor:
        k = (layer, role)
        self.slot0[k] = max(self.slot0[k], te_amax(t))  # atomicMax into slot 0
        return ref_q(t, self.state[k].scale, self.fmt[role])

    def update(self, roles: tuple[str, ...], amax: dict[tuple[str, str], float] | None = None
               ) -> None:  # fmt: skip
        for k in self.state:
            if k[1] in roles:
                self.state[k].step(self.slot0[k] if amax is None else amax[k])
                self.slot0[k] = 0.0

    def forward(self, x: torch.Tensor, ws: list[torch.Tensor], bs: list[torch.Tensor]
                ) -> dict[str, torch.Tensor]:  # fmt: skip
        xq1, wq1 = self.cast("0", "input", x), self.cast("0", "weight", ws[0])
        y1 = xq1 @ wq1.T + bs[0]
        h = torch.relu(y1)
        xq2, wq2 = self.cast("2", "input", h), self.cast("2", "weight", ws[1])
        out = xq2 @ wq2.T + bs[1]
        return {"xq1": xq1, "wq1": wq1, "y1": y1, "xq2": xq2, "wq2": wq2, "out": out}

    def backward(self, f: dict[str, torch.Tensor], r: torch.Tensor) -> list[torch.Tensor]:
        gq2 = self.cast("2", "grad", r)
        dw2 = gq2.T @ f["xq2"]
        dh = gq2 @ f["wq2"]
        dy1 = dh * (f["y1"] > 0)
        gq1 = self.cast("0", "grad", dy1)
        dw1 = gq1.T @ f["xq1"]
        return [dw1, dw2]


def emulated_step(model: nn.Module, x: torch.Tensor, r: torch.Tensor, ws: list[torch.Tensor]
                  ) -> list[torch.Tensor]:  # fmt: skip
    lin = [model[0], model[2]]
    with torch.no_grad():
        for layer, w in zip(lin, ws, strict=True):
            layer.weight.copy_(w)
    model.zero_grad()
    (model(x) * r).sum().backward()
    return [layer.weight.grad.clone() for layer in lin]


def as_floats(scales: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, float]]:
    return {n: {k: float(v) for k, v in d.items()} for n, d in scales.items()}


@pytest.mark.parametrize(
    ("length", "algo", "margin", "fp8_format"),
    [(3, "max", 0, "HYBRID"), (1, "most_recent", 1, "HYBRID"), (4, "max", 0.5, "E4M3"),
     (2, "most_recent", 0, "E4M3")],
)  # fmt: skip
def test_scales_per_layer_and_role_step_by_step(
    length: int, algo: Any, margin: float, fp8_format: Any
) -> None:
    model = mlp()
    recipe = EmulationRecipe.te_delayed(margin, fp8_format, length, algo)
    cov = emulate(model, recipe)
    state = cov.scaling
    assert state is not None and sorted(state.layers) == ["0", "2"]
    ref = Reference(length, algo, margin, "e5m2" if fp8_format == "HYBRID" else "e4m3fn")
    bs = [model[0].bias.detach().clone(), model[2].bias.detach().clone()]
    for step in range(6):
        x, r, ws = data(step)
        assert as_floats(state.scales()) == ref.scales(), step
        grads = emulated_step(model, x, r, ws)
        f = ref.forward(x, ws, bs)
        ref.update(("input", "weight"))  # the autocast region exits
        expect = ref.backward(f, r)
        ref.update(("grad",))  # the backward ends
        for got, want in zip(grads, expect, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        assert as_floats(state.scales()) == ref.scales(), step
        # one history entry per tensor per step (not one shared history for all)
        hist = state.histories()
        for n in LAYERS:
            for role in ROLES:
                assert int((hist[n][role] != 0).sum()) == min(step + 1, length)
    # the roles and layers did get different scales
    final = as_floats(state.scales())
    assert len({v for d in final.values() for v in d.values()}) == 6


def test_an_evaluation_forward_records_into_the_next_update() -> None:
    """Under torch.no_grad() TE's autocast exit does not update: the amaxes stay in slot
    0 and the next training update takes the larger."""
    model = mlp()
    cov = emulate(model, EmulationRecipe.te_delayed(amax_history_len=4))
    state = cov.scaling
    assert state is not None
    ref = Reference(4, "max", 0, "e5m2")
    bs = [model[0].bias.detach().clone(), model[2].bias.detach().clone()]
    for step in range(3):
        x, r, ws = data(step)
        if step == 1:
            big = x * 64
            with torch.no_grad():
                for layer, w in zip([model[0], model[2]], ws, strict=True):
                    layer.weight.copy_(w)
                model(big)
            ref.forward(big, ws, bs)
            assert state.updates["forward"] == 1  # no update from the evaluation
        grads = emulated_step(model, x, r, ws)
        f = ref.forward(x, ws, bs)
        ref.update(("input", "weight"))
        expect = ref.backward(f, r)
        ref.update(("grad",))
        for got, want in zip(grads, expect, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        assert as_floats(state.scales()) == ref.scales(), step


def test_checkpointed_state_resumes_the_same_scales() -> None:
    a, b = mlp(), mlp()
    ca = emulate(a, EmulationRecipe.te_delayed(amax_history_len=3))
    cb = emulate(b, EmulationRecipe.te_delayed(amax_history_len=3))
    assert ca.scaling is not None and cb.scaling is not None
    for step in range(2):
        x, r, ws = data(step)
        emulated_step(a, x, r, ws)
    cb.scaling.load_state_dict(ca.scaling.state_dict())
    x, r, ws = data(2)
    ga, gb = emulated_step(a, x, r, ws), emulated_step(b, x, r, ws)
    assert all(torch.equal(u, v) for u, v in zip(ga, gb, strict=True))
    assert as_floats(ca.scaling.scales()) == as_floats(cb.scaling.scales())
    with pytest.raises(ValueError, match="layers/roles differ"):
        cb.scaling.load_state_dict({"0": ca.scaling.state_dict()["0"]})


def test_a_delayed_operand_is_refused_where_it_has_no_state() -> None:
    d = Delayed("e4m3fn")
    with pytest.raises(ValueError, match=r"wgrad_input=.*cast once per step"):
        EmulationRecipe(Delayed("e4m3fn", history_len=2), d, d, wgrad_input=d)
    with pytest.raises(ValueError, match="delayed scaling of the attention matmuls"):
        emulate(mlp(), EmulationRecipe.te_delayed(), attention=True)
    with pytest.raises(ValueError, match="fp8_format='E5M2'"):
        EmulationRecipe.te_delayed(fp8_format="E5M2")  # type: ignore[arg-type]
    from floatguard.emulation._gemm import _emulated_gemm

    with pytest.raises(ValueError, match="keeps state per layer"):
        _emulated_gemm(torch.ones(2, 4), torch.ones(3, 4), EmulationRecipe.te_delayed())


def _ranks_delayed(rank: int, world: int, out: str, reduce: bool) -> dict[str, Any]:
    model = mlp()
    cov = emulate(model, EmulationRecipe.te_delayed(amax_history_len=3, reduce_amax=reduce))
    assert cov.scaling is not None
    scales, grads = [], []
    for step in range(3):
        x, r, ws = data(step, rank)
        grads.append(emulated_step(model, x, r, ws))
        scales.append(as_floats(cov.scaling.scales()))
    return {"scales": scales, "grads": grads}


@pytest.mark.ranks
def test_amaxes_are_reduced_across_ranks_as_te_does(tmp_path: Path) -> None:
    """reduce_amax (TE's default): every rank's scales come from the amax over both
    ranks, step by step; without it each rank's from its own data (they differ)."""
    res = run_ranks(_ranks_delayed, 2, tmp_path, True)
    local = run_ranks(_ranks_delayed, 2, tmp_path, False)
    for r in (0, 1):
        assert "scales" in res[r] and "scales" in local[r], (res[r], local[r])
    refs = [Reference(3, "max", 0, "e5m2") for _ in range(2)]  # one per rank, shared scales
    bs = [mlp()[0].bias.detach().clone(), mlp()[2].bias.detach().clone()]
    for step in range(3):
        fs, batch = [], []
        for rank, ref in enumerate(refs):
            x, r, ws = data(step, rank)
            fs.append(ref.forward(x, ws, bs))
            batch.append(r)
        fwd = {k: max(ref.slot0[k] for ref in refs) for k in refs[0].slot0}
        for ref in refs:
            ref.update(("input", "weight"), fwd)
        expect = [ref.backward(f, r) for ref, f, r in zip(refs, fs, batch, strict=True)]
        bwd = {k: max(ref.slot0[k] for ref in refs) for k in refs[0].slot0}
        for ref in refs:
            ref.update(("grad",), bwd)
        for rank in (0, 1):
            assert res[rank]["scales"][step] == refs[rank].scales()
            for got, want in zip(res[rank]["grads"][step], expect[rank], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    # the difference users hit without the reduction: the ranks' scales disagree
    assert local[0]["scales"][-1] != local[1]["scales"][-1]
    assert res[0]["scales"][-1] == res[1]["scales"][-1]


def test_attention_projections_of_nn_transformer_get_delayed_state() -> None:
    """nn.MultiheadAttention's projections (cross-attention splits in_proj_weight into
    q and kv views) are delayed-scaled per projection weight."""
    torch.manual_seed(0)
    m = nn.Transformer(d_model=32, nhead=4, num_encoder_layers=1, num_decoder_layers=1,
                       dim_feedforward=64, batch_first=True, dropout=0.0)  # fmt: skip
    cov = emulate(m, EmulationRecipe.te_delayed(amax_history_len=4))
    assert cov.scaling is not None
    for _ in range(2):
        m(torch.randn(2, 5, 32), torch.randn(2, 4, 32)).square().mean().backward()
    hist = cov.scaling.histories()
    name = "decoder.layers.0.multihead_attn"
    assert int((hist[f"{name}.in_proj_weight"]["weight"] != 0).sum()) == 2  # one per step
    assert int((hist[f"{name}.out_proj.weight"]["grad"] != 0).sum()) == 2
    # (a gradient below e5m2's range at the first step's scale of 1 flushes to zero and
    # records nothing upstream: TE's delayed scaling does the same)


def test_bad_delayed_settings_are_named() -> None:
    with pytest.raises(ValueError, match=r"margin=200: .* is 0 in float32"):
        EmulationRecipe.te_delayed(margin=200)
    with pytest.raises(ValueError, match=r"fmt='e9m9': its max .* past float32's range"):
        Delayed("e9m9")
    with pytest.raises(TypeError, match=r"amax_group=.world. must be a torch\.distributed"):
        emulate(mlp(), EmulationRecipe.te_delayed(), amax_group="world")
    a, b = mlp(), mlp()
    ca = emulate(a, EmulationRecipe.te_delayed(amax_history_len=16))
    cb = emulate(b, EmulationRecipe.te_delayed(amax_history_len=4))
    assert ca.scaling is not None and cb.scaling is not None
    with pytest.raises(ValueError, match=r"history of \(16,\) into a recipe with history_len=4"):
        cb.scaling.load_state_dict(ca.scaling.state_dict())


def test_an_activation_checkpoint_recompute_uses_the_forwards_scales() -> None:
    """torch.utils.checkpoint recomputes the forward inside the backward, after the
    forward scales updated: the recompute must use the scales the forward used and
    record nothing (TE copies the forward's scales for it), so the gradients equal the
    model's without checkpointing, step after step."""
    from torch.utils.checkpoint import checkpoint

    class Ck(nn.Module):
        def __init__(self, ck: bool) -> None:
            super().__init__()
            self.m = mlp()
            self.ck = ck

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.ck:
                out: torch.Tensor = checkpoint(self.m, x, use_reentrant=False)
                return out
            return self.m(x)

    plain, ck = Ck(False), Ck(True)
    cp = emulate(plain, EmulationRecipe.te_delayed(amax_history_len=4))
    cc = emulate(ck, EmulationRecipe.te_delayed(amax_history_len=4))
    for step in range(4):
        x, r, _ = data(step)
        for model in (plain, ck):
            model.zero_grad()
            (model(x) * r).sum().backward()
        for p, q in zip(plain.parameters(), ck.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            assert torch.equal(p.grad, q.grad), step
        assert cp.scaling is not None and cc.scaling is not None
        assert as_floats(cp.scaling.scales()) == as_floats(cc.scaling.scales())
