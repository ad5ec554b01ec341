"""floatguard.advise: planted bad layers rank first, the plan keeps to its budget and
reproduces, skipped layers are never proposed, and the model is left as it was."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from floatguard import EmulationRecipe, advise, emulate, restore
from floatguard.emulation.recipes import MX

FLOOR = MX(scale_mode="floor")  # OCP's scale: a block amax above e4m3's max saturates
RCEIL = MX(scale_mode="rceil")  # NVIDIA's: never saturates


class Net(nn.Module):
    """Four linear layers; ``plant`` makes one layer's input hard for a recipe."""

    def __init__(self, plant: str = "none", dropout: float = 0.0) -> None:
        super().__init__()
        self.plant = plant
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 64)
        self.fc3, self.fc4 = nn.Linear(64, 64), nn.Linear(64, 8)
        self.drop = nn.Dropout(dropout)
        self.register_buffer("seen", torch.zeros(()))
        if plant == "underflow":
            with torch.no_grad():
                self.fc2.weight[:, ::16] = 0.0  # the constant channel carries nothing on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        h = torch.relu(self.fc1(x))
        if self.plant == "underflow":  # one large constant per 16-block sets its FP4 scale:
            h = h.clone()  # the signal beside it flushes to zero in fc2's input
            h[:, ::16] = 60.0
        h = self.drop(torch.relu(self.fc2(h)))
        if self.plant == "saturate":  # an outlier channel just below a power of two:
            h = h.clone()  # x / 2**floor(log2 amax) lands above e4m3's 448 in fc3's input
            h[:, 7] = 1.99 * 2**4
        return self.fc4(torch.relu(self.fc3(h)))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _data(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 32, generator=g), torch.randint(0, 8, (32,), generator=g))
            for _ in range(n)]  # fmt: skip


def _net(plant: str = "none", dropout: float = 0.0) -> Net:
    torch.manual_seed(0)
    return Net(plant, dropout)


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.filterwarnings("ignore", message="Full backward hook is firing")


def test_a_layer_whose_input_underflows_in_fp4_ranks_first() -> None:
    calm = advise(_net(), _data(), EmulationRecipe.nvfp4(), loss_fn=loss_fn)
    assert calm.ranking[0] != "fc2"  # without the plant, another layer leads
    a = advise(_net("underflow"), _data(), EmulationRecipe.nvfp4(), loss_fn=loss_fn)
    assert a.ranking[0] == "fc2" and set(a.ranking) == {"fc1", "fc2", "fc3", "fc4"}
    by = {la.name: la for la in a.layers}
    flushed = by["fc2"].operands["fprop_input"]["underflow"]
    assert flushed > 0.8 and all(
        by[n].operands["fprop_input"]["underflow"] < 0.2 for n in ("fc1", "fc3", "fc4")
    )
    assert by["fc2"].error > 4 * max(by[n].error for n in ("fc1", "fc3", "fc4"))


def test_an_outlier_channel_that_saturates_e4m3_ranks_first() -> None:
    recipe = EmulationRecipe(FLOOR, FLOOR, FLOOR)
    calm = advise(_net(), _data(), recipe, loss_fn=loss_fn, per_gemm=False)
    assert calm.ranking[0] != "fc3"
    a = advise(_net("saturate"), _data(), recipe, loss_fn=loss_fn)
    assert a.ranking[0] == "fc3"
    fc3 = a.layers[0]
    # one channel in each 32-element block of every row is clamped, nothing else
    assert fc3.operands["fprop_input"]["saturation"] == pytest.approx(2 / 64, rel=0.1)
    assert set(fc3.gemms) == {"fprop", "dgrad", "wgrad"} and fc3.gemms["fprop"] > 0
    never = advise(_net("saturate"), _data(), EmulationRecipe(RCEIL, RCEIL, RCEIL),
                   loss_fn=loss_fn, per_gemm=False, leave_one_out=False)  # fmt: skip
    assert all(la.operands["fprop_input"]["saturation"] == 0 for la in never.layers)


def test_the_plan_keeps_to_its_budget_and_pastes_into_emulate() -> None:
    a = advise(_net("underflow"), _data(), EmulationRecipe.nvfp4(), loss_fn=loss_fn,
               budget=0.45)  # fmt: skip
    shares = {la.name: la.share for la in a.layers}
    assert abs(sum(shares.values()) - 1) < 1e-9 and a.kept_share <= 0.45
    assert a.keep[0] == "fc2" and a.kept_share == pytest.approx(sum(shares[n] for n in a.keep))
    # greedy in ranking order: no layer left out would still have fitted
    assert all(shares[n] > 0.45 - a.kept_share for n in a.ranking if n not in a.keep)
    assert a.gap_plan["error"] < a.gap_all["error"]  # the plan measured, not assumed
    model = _net("underflow")
    swapped = emulate(model, EmulationRecipe.nvfp4(), skip=a.skip())
    assert sorted(swapped) == sorted(n for n in a.ranking if n not in a.keep)
    restore(model)
    two = advise(_net(), _data(), EmulationRecipe.nvfp4(), loss_fn=loss_fn, budget=2,
                 per_gemm=False, leave_one_out=False)  # fmt: skip
    assert two.keep == two.ranking[:2] and two.predicted_plan is None


def test_a_layer_already_kept_is_never_proposed() -> None:
    a = advise(_net("underflow"), _data(), EmulationRecipe.nvfp4(), loss_fn=loss_fn,
               skip=("fc2",), budget=3)  # fmt: skip
    assert "fc2" not in a.ranking and "fc2" not in a.keep and len(a.keep) == 3
    recipe = EmulationRecipe.nvfp4()
    kept = EmulationRecipe(recipe.activation, recipe.weight, recipe.grad, skip=("fc4",))
    b = advise(_net(), _data(), kept, loss_fn=loss_fn, per_gemm=False, leave_one_out=False)
    assert "fc4" not in b.ranking  # the recipe's own skip


def test_advise_reproduces_and_leaves_the_model_as_it_was() -> None:
    model = _net("underflow", dropout=0.2).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    a = advise(model, _data(), EmulationRecipe.nvfp4(), loss_fn=loss_fn, budget=0.3, seed=3)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and model.training
    assert type(model.fc1) is nn.Linear  # not swapped
    b = advise(model, _data(), EmulationRecipe.nvfp4(), loss_fn=loss_fn, budget=0.3, seed=3)
    assert a.to_dict() == b.to_dict()
    assert a.passes == 2 * (3 + 4 * (1 + 0 + 1)) + 2  # nvfp4(): the forward GEMM only
    assert a.agreement is not None and -1 <= a.agreement <= 1
    assert all(math.isfinite(la.loss_delta) for la in a.layers)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"budget": 1.5}, ValueError, "budget=1.5"),
        ({"budget": True}, ValueError, "budget=True"),
        ({"budget": -1}, ValueError, "budget=-1"),
        ({"batches": []}, ValueError, "non-empty list of batches"),
        ({"recipe": "nvfp4"}, TypeError, "EmulationRecipe.nvfp4()"),
        ({"loss_fn": nn.CrossEntropyLoss()}, TypeError, "criterion"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], error: type, words: str) -> None:
    args: dict[str, object] = {"batches": _data(1), "recipe": EmulationRecipe.nvfp4(),
                               "loss_fn": loss_fn, **kwargs}  # fmt: skip
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        advise(_net(), **args)  # type: ignore[arg-type]


def test_an_emulated_model_is_refused() -> None:
    model = _net()
    emulate(model, EmulationRecipe.nvfp4())
    with pytest.raises(ValueError, match="already emulate"):
        advise(model, _data(1), EmulationRecipe.nvfp4(), loss_fn=loss_fn)


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    import floatguard.cli as cli

    with pytest.raises(SystemExit) as info:
        cli.main(["advise", *args])
    out, err = capsys.readouterr()
    code = info.value.code
    return (code if isinstance(code, int) else 0), out, err


def test_the_cli_prints_the_plan_as_json(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import json
    import sys
    import types

    mod = types.ModuleType("advise_target")
    mod.build = lambda: (_net("underflow"), _data(1), loss_fn)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "advise_target", mod)
    code, out, err = _cli(capsys, "advise_target:build", "--recipe", "nvfp4", "--budget", "1",
                          "--json")  # fmt: skip
    assert code == 0, err
    got = json.loads(out)
    assert got["keep"] == ["fc2"] and got["ranking"][0] == "fc2" and got["budget"] == 1
    code, out, err = _cli(capsys, "advise_target:build", "--recipe", "fp8")
    assert code == 2 and "--recipe 'fp8': use one of nvfp4" in err
    code, out, err = _cli(capsys, "advise_target:build", "--budget", "lots")
    assert code == 2 and "--budget 'lots'" in err
