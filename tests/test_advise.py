"""floatguard.advise: planted bad layers rank first, the plan keeps to its budget and
reproduces, skipped layers are never proposed, and the model is left as it was."""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path

import numpy as np
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
    calm = advise(_net(), _data(), recipe, loss_fn=loss_fn, per_gemm=False, leave_one_out=False)
    assert calm.ranking[0] != "fc3"  # by the error alone, without the plant another leads
    alone = advise(_net("saturate"), _data(), recipe, loss_fn=loss_fn, per_gemm=False,
                   leave_one_out=False)  # fmt: skip
    assert alone.ranking[0] == "fc3"
    assert alone.layers[0].error > 2 * {la.name: la.error for la in calm.layers}["fc3"]
    a = advise(_net("saturate"), _data(), recipe, loss_fn=loss_fn)  # by the gain
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
        ({"budget": True}, TypeError, "budget=True"),
        ({"budget": "0.1"}, TypeError, "budget='0.1'"),
        ({"skip": "fc2"}, TypeError, "skip='fc2' is a string; give a tuple"),
        ({"skip": 5}, TypeError, "skip=5 must be None"),
        ({"seed": "a"}, TypeError, "seed='a' must be an int"),
        ({"per_gemm": "no"}, TypeError, "per_gemm='no' must be True or False"),
        ({"seeds": 0}, ValueError, "seeds=0"),
        ({"seeds": [1.5]}, TypeError, "seeds=[1.5]"),
        ({"train_steps": -1}, ValueError, "train_steps=-1"),
        ({"warmup_steps": 1.5}, TypeError, "warmup_steps=1.5"),
        ({"batches": None}, TypeError, "batches must be a list of batches, got NoneType"),
        ({"budget": -1}, ValueError, "budget=-1"),
        ({"batches": []}, ValueError, "non-empty list of batches"),
        ({"recipe": "nvfp4"}, TypeError, "EmulationRecipe.nvfp4()"),
        ({"loss_fn": nn.CrossEntropyLoss()}, TypeError, "criterion"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], error: type, words: str) -> None:
    args: dict[str, object] = {"batches": _data(1), "recipe": EmulationRecipe.nvfp4(),
                               "loss_fn": loss_fn, **kwargs}  # fmt: skip
    with pytest.raises(error, match=re.escape(words)):
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


def test_the_plan_is_the_best_set_within_the_budget() -> None:
    """Against brute force over every subset: the most error kept within the FLOP budget
    (a cheap sensitive layer beats an expensive, slightly more sensitive one)."""
    import itertools
    import random

    from floatguard.advise.plan import plan as _plan

    rng = random.Random(5)
    for _ in range(200):
        n = rng.randint(1, 8)
        names = [f"l{i}" for i in range(n)]
        share = {x: rng.choice([0.02, 0.037, 0.11, 0.146, 0.3]) for x in names}
        error = {x: rng.random() for x in names}
        ranking = sorted(names, key=lambda x: -error[x])
        budget = rng.choice([0.1, 0.2, 0.45])
        keep = _plan(ranking, share, budget, error)
        assert sum(share[x] for x in keep) <= budget + 1e-9

        def best(cap: float, error: dict = error, share: dict = share) -> float:
            return max(
                sum(error[x] for x in s)
                for k in range(len(share) + 1) for s in itertools.combinations(share, k)
                if sum(share[x] for x in s) <= cap + 1e-9
            )  # fmt: skip

        # optimal up to the shares' rounding (budget/20000 per layer, up)
        got = sum(error[x] for x in keep)
        assert best(budget * (1 - n / 20_000)) - 1e-12 <= got <= best(budget) + 1e-12
    # the cheap sensitive layer and a second one rather than the single expensive one
    share = {"big": 0.146, "head": 0.037, "proj": 0.037}
    error = {"big": 1.0, "head": 0.9, "proj": 0.5}
    assert _plan(["big", "head", "proj"], share, 0.15, error) == ["head", "proj"]


def test_the_expected_gap_judges_a_gap() -> None:
    from floatguard import ExpectedGap

    e = ExpectedGap("trained", 10, (0, 1, 2), (0.01, 0.02, 0.015), (2.0, 2.1, 2.05))
    assert e.mean == pytest.approx(0.015) and e.spread == pytest.approx(0.005)
    assert e.upper == pytest.approx(0.03) and (e.low, e.high) == (0.01, 0.02)
    assert e.is_expected(0.025) and e.is_expected(-0.01)
    assert "is expected" in e.judge(0.025)
    assert not e.is_expected(0.05) and "larger than the recipe's numerics cost" in e.judge(0.05)
    assert not e.is_expected(math.nan) and "computed NaN" in e.judge(math.nan)
    assert not e.is_expected(math.inf) and "low-precision run diverged" in e.judge(math.inf)
    diverged = ExpectedGap("trained", 10, (0, 1), (0.02, math.inf))  # one emulated run
    for gap in (0.0, 5.0, math.inf):  # the recipe explains any gap, a divergence too
        assert diverged.is_expected(gap) and "emulated run itself diverged in 1 of 2" in (
            diverged.judge(gap)
        )
    assert str(diverged).startswith("diverged in 1 of 2; the others +0.02")
    assert e.is_expected(torch.tensor(0.01)) is True and e.is_expected(np.float32(0.5)) is False
    with pytest.raises(TypeError, match="observed gap must be a number"):
        e.judge("a")  # type: ignore[arg-type]
    assert "over 3 seed(s) after 10 step(s)" in str(e)


def _manual_run(model: nn.Module, data: list, recipe: EmulationRecipe | None, steps: int,
                seed: int) -> float:  # fmt: skip
    """The protocol expected_gap documents, written out: a copy, the batches reshuffled
    every pass by random.Random(seed), torch seeded with seed, AdamW lr 1e-3, the held-out
    loss in high precision in eval mode."""
    import copy
    import random

    work = copy.deepcopy(model)
    if recipe is not None:
        emulate(work, recipe)
    order, queue = random.Random(seed), []
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        opt = torch.optim.AdamW(work.parameters(), lr=1e-3)
        for _ in range(steps):
            if not queue:
                queue = list(data)
                order.shuffle(queue)
            loss_fn(work, queue.pop()).backward()
            opt.step()
            opt.zero_grad()
        if recipe is not None:
            restore(work)
        work.eval()
        with torch.no_grad():
            return sum(float(loss_fn(work, b)) for b in data) / len(data)


def test_expected_gap_is_the_documented_protocol_and_leaves_everything_as_it_was() -> None:
    from floatguard import expected_gap

    model = _net("underflow", dropout=0.1).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    recipe = EmulationRecipe.nvfp4()
    e = expected_gap(model, _data(3), recipe, loss_fn=loss_fn, steps=5, seeds=[4, 9])
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and model.training
    assert e.basis == "trained" and e.seeds == (4, 9) and e.steps == 5
    for i, seed in enumerate((4, 9)):
        ref = _manual_run(model, _data(3), None, 5, seed)
        low = _manual_run(model, _data(3), recipe, 5, seed)
        assert e.reference[i] == pytest.approx(ref, rel=1e-6)
        assert e.gaps[i] == pytest.approx(low - ref, abs=1e-6)
    assert e.mean > 0  # FP4 flushes fc2's input: the emulated run trains worse
    again = expected_gap(model, _data(3), recipe, loss_fn=loss_fn, steps=5, seeds=[4, 9])
    assert again == e
    with pytest.raises(ValueError, match="steps=0"):
        expected_gap(model, _data(1), recipe, loss_fn=loss_fn, steps=0)
    with pytest.raises(ValueError, match="seeds=0"):
        expected_gap(model, _data(1), recipe, loss_fn=loss_fn, seeds=0)


def test_advise_reports_the_expected_gap_untrained_and_trained() -> None:
    a = advise(_net("underflow"), _data(), EmulationRecipe.nvfp4(), loss_fn=loss_fn,
               budget=1, per_gemm=False, leave_one_out=False)  # fmt: skip
    assert a.expected is not None and a.expected_plan is not None
    assert a.expected.basis == "step" and len(a.expected.gaps) == 2
    assert a.expected.mean == pytest.approx(a.gap_all["loss_delta"])
    assert a.expected_plan.mean == pytest.approx(a.gap_plan["loss_delta"])
    t = advise(_net("underflow"), _data(), EmulationRecipe.nvfp4(), loss_fn=loss_fn,
               budget=1, per_gemm=False, leave_one_out=False, train_steps=4, seeds=2)  # fmt: skip
    assert t.expected is not None and t.expected_plan is not None
    assert t.expected.basis == "trained" and t.expected.seeds == (0, 1)
    assert t.passes == a.passes + 3 * 2 * 4  # reference, everything, the plan: per seed
    for i in range(2):  # the plan (fc2 kept) is the manual run with only fc2 in fp32
        ref = _manual_run(_net("underflow"), _data(), None, 4, i)
        assert t.expected.reference[i] == pytest.approx(ref, rel=1e-6)
    assert "expected loss gap, everything emulated" in t.summary()
    by = {la.name: la for la in t.layers}
    assert by["fc2"].recommendation.startswith("keep in high precision (the plan)")
    assert "fprop_input loses" in by["fc2"].recommendation
    assert by["fc1"].recommendation.startswith("nvfp4 safe at this budget")


def test_the_advice_is_logged_and_the_report_shows_it(tmp_path: Path) -> None:
    from floatguard import EventLog, read_events
    from floatguard.report import render_report

    a = advise(_net("underflow"), _data(), EmulationRecipe.nvfp4(), loss_fn=loss_fn,
               budget=1, per_gemm=False, leave_one_out=False)  # fmt: skip
    path = tmp_path / "run.jsonl"
    log = EventLog(path)
    log.emit("step", 1, action="applied", reason=None, loss=1.0, grad_norm=1.0,
             clip_coef=None, scale=None, lr_factor=1.0, lr=None)  # fmt: skip
    a.log(log, step=1)
    log.close()
    a.log(tmp_path / "only-advice.jsonl")
    (ev,) = [e for e in read_events(path) if e.kind == "advice"]
    assert ev["keep"] == ["fc2"] and [la["name"] for la in ev["layers"]] == list(a.ranking)
    assert ev["expected"]["basis"] == "step"
    for src in (path, tmp_path / "only-advice.jsonl"):
        page = render_report(src, tmp_path / f"report-{src.stem}").read_text()
        assert "<h2>Precision plan</h2>" in page and "<code>fc2</code>" in page
        assert (
            "keep in high precision (the plan)" in page and 'alt="gradient SQNR per layer' in page
        )
        assert (tmp_path / f"report-{src.stem}" / "advice-0.png").stat().st_size > 1000
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"schema": 2, "kind": "advice", "step": 0, "time": 1.0,
                               "rank": 0, "recipe": "MX", "budget": 0.1, "keep": [],
                               "kept_share": 0.0, "gap_all": None, "gap_plan": None,
                               "expected": None, "expected_plan": None, "notes": None,
                               "layers": [{"name": "a", "share": 0.5, "sqnr_db": 20.0},
                                          "junk", {"name": 3}]}) + "\n")  # fmt: skip
    page = render_report(bad, tmp_path / "report-bad").read_text()
    assert "2 layer entries unreadable" in page and "<td>a</td>" in page
    with pytest.raises(TypeError, match="EventLog or a path"):
        a.log(3)  # type: ignore[arg-type]
    with pytest.raises((OSError, ValueError), match="is a directory"):
        a.log(tmp_path)  # a folder


def test_the_cli_judges_an_observed_gap_and_logs(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import sys
    import types

    from floatguard import read_events

    mod = types.ModuleType("advise_target2")
    mod.build = lambda: (_net("underflow"), _data(1), loss_fn)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "advise_target2", mod)
    log = tmp_path / "a.jsonl"
    code, out, err = _cli(capsys, "advise_target2:build", "--recipe", "nvfp4", "--budget", "1",
                          "--train-steps", "3", "--seeds", "2", "--observed", "5",
                          "--log", str(log), "--json")  # fmt: skip
    assert code == 0, err
    got = json.loads(out)
    assert got["expected"]["basis"] == "trained" and got["expected"]["seeds"] == [0, 1]
    assert got["observed"]["expected"] is False and "larger" in got["observed"]["judgment"]
    assert [e.kind for e in read_events(log)] == ["advice"]
    code, out, err = _cli(capsys, "advise_target2:build", "--recipe", "nvfp4", "--budget", "1",
                          "--observed", "0")  # fmt: skip
    assert code == 0 and "against the recipe as given: a gap of +0 is expected" in out
    assert "against the plan: a gap of +0" in out and "measured on one step, untrained" in out
    for bad, words in ((["--budget", "0.0"], "--budget '0.0'"), (["--seeds", "0"], "--seeds 0"),
                       (["--train-steps", "-2"],
                       "--train-steps -2"), (["--observed", "nan"], "--observed nan"),
                       (["--log", str(tmp_path)], "--log")):  # fmt: skip
        code, out, err = _cli(capsys, "advise_target2:build", "--budget", "1", *bad)
        assert code == 2 and words in err, err


def test_a_model_already_nan_in_high_precision_is_refused_naming_the_batch() -> None:
    class Nan(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.log(self.a(x) - 100))

    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"high-precision loss of batch 0 is already non-fin"):
        advise(Nan(), [torch.randn(8, 16)], EmulationRecipe.mxfp8(), budget=1)


def test_the_pasted_skip_keeps_the_recipe_s_and_the_user_s_skip() -> None:
    recipe = EmulationRecipe.nvfp4()
    own = EmulationRecipe(recipe.activation, recipe.weight, recipe.grad, skip=("fc4",))
    for r, user in ((own, None), (recipe, ("fc1",)), (recipe, lambda n, m: n == "fc3")):
        a = advise(_net("underflow"), _data(1), r, loss_fn=loss_fn, budget=1, skip=user,
                   per_gemm=False, leave_one_out=False)  # fmt: skip
        model = _net("underflow")
        swapped = emulate(model, r, skip=a.skip())
        assert sorted(swapped) == sorted(n for n in a.ranking if n not in a.keep), (r, user)
        restore(model)
    assert a.skip()("fc3", nn.Linear(1, 1)) and "and what" in repr(a.skip())  # type: ignore[operator]


def test_the_judgment_of_gaps_at_and_below_zero() -> None:
    from floatguard import ExpectedGap

    noise = ExpectedGap("trained", 5, (0, 1), (-0.0017, -0.0012))  # seed noise only
    assert noise.upper > 0 and noise.is_expected(0.0) and "is expected" in noise.judge(0.0)
    assert "smaller than the recipe costs" in noise.judge(-0.3)
    assert "high-precision run diverged" in noise.judge(-math.inf)
    assert "low-precision run diverged" in noise.judge(math.inf)
    assert "nothing was measured" in ExpectedGap("step", 0, (0,), ()).judge(0.1)


def test_recipes_are_named_and_each_gets_its_report_section(tmp_path: Path) -> None:
    from floatguard.report import render_report

    log = tmp_path / "two.jsonl"
    got = []
    for r in (EmulationRecipe.nvfp4(), EmulationRecipe.nvfp4_training(skip=())):
        a = advise(_net(), _data(1), r, loss_fn=loss_fn, budget=1, per_gemm=False,
                   leave_one_out=False)  # fmt: skip
        a.log(log)
        got.append(a.recipe)
    assert got == ["nvfp4", "custom NVFP4"]  # the training preset skips "head" by default
    page = render_report(log, tmp_path / "r").read_text()
    assert "<h3>nvfp4</h3>" in page and "<h3>custom NVFP4</h3>" in page
    assert (tmp_path / "r" / "advice-1.png").exists()
    named = advise(_net(), _data(1), EmulationRecipe.mxfp8(), loss_fn=loss_fn, budget=1,
                   per_gemm=False, leave_one_out=False, name="my fp8")  # fmt: skip
    assert named.recipe == "my fp8" and named.layers[-1].recommendation.startswith("my fp8 safe")


def test_stochastic_rounding_leaves_torch_s_rng_and_reproduces() -> None:
    recipe = EmulationRecipe.nvfp4_training(skip=())
    net = _net()  # (seeds torch's RNG itself)
    rng = torch.get_rng_state()
    a = advise(net, _data(1), recipe, loss_fn=loss_fn, budget=1, leave_one_out=False)
    assert torch.equal(rng, torch.get_rng_state())
    b = advise(_net(), _data(1), recipe, loss_fn=loss_fn, budget=1, leave_one_out=False)
    assert a.to_dict() == b.to_dict()


def test_the_expected_gap_trains_each_submodule_in_its_own_mode() -> None:
    from floatguard import expected_gap

    class WithNorm(Net):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(self.bn(x))

    torch.manual_seed(0)
    net = WithNorm().train()
    net.bn.eval()  # a frozen norm inside a training model
    modes: list[bool] = []
    net.bn.register_forward_pre_hook(lambda m, a: modes.append(m.training))
    expected_gap(net, _data(2), EmulationRecipe.mxfp8(), loss_fn=loss_fn, steps=2, seeds=1)
    assert modes and not any(modes)  # never trained as a training-mode BatchNorm


def test_losses_that_cannot_be_measured_are_named() -> None:
    recipe = EmulationRecipe.mxfp8()
    with pytest.raises(ValueError, match=r"loss of batch 0 has shape \(32, 8\)"):
        advise(_net(), _data(1), recipe, loss_fn=lambda m, b: m(b[0]), budget=1)
    with pytest.raises(ValueError, match="does not require grad"):
        advise(_net(), _data(1), recipe, loss_fn=lambda m, b: loss_fn(m, b).detach(), budget=1)
    with pytest.raises(RuntimeError) as info:  # the model's own error, with where and why
        advise(_net(), [(torch.randn(4, 7), torch.zeros(4, dtype=torch.long))], recipe,
               loss_fn=loss_fn, budget=1)  # fmt: skip
    if hasattr(info.value, "__notes__"):
        assert "high-precision pass on batch 0" in info.value.__notes__[0]
    with pytest.warns(UserWarning, match="returned no loss"):
        advise(_net(), [torch.randn(8, 32)], recipe, budget=1, per_gemm=False,
               leave_one_out=False)  # fmt: skip
    with pytest.raises(TypeError, match=r"optimizer\(params\) returned NoneType"):
        advise(_net(), _data(1), recipe, loss_fn=loss_fn, budget=1, train_steps=1, seeds=1,
               optimizer=lambda p: None)  # type: ignore[arg-type,return-value]  # fmt: skip


def test_a_warm_up_measures_a_trained_copy_and_the_error_alone_ranks() -> None:
    import copy
    import random

    model = _net("underflow")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    recipe = EmulationRecipe.nvfp4()
    warm = advise(model, _data(2), recipe, loss_fn=loss_fn, budget=1, seed=3, warmup_steps=4)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    trained = copy.deepcopy(model)  # the documented protocol: AdamW lr 1e-3, seeded order
    order, queue = random.Random(3), []
    with torch.random.fork_rng():
        torch.manual_seed(3)
        opt = torch.optim.AdamW(trained.parameters(), lr=1e-3)
        for _ in range(4):
            if not queue:
                queue = list(_data(2))
                order.shuffle(queue)
            loss_fn(trained, queue.pop()).backward()
            opt.step()
            opt.zero_grad()
    for p in trained.parameters():
        p.grad = None
    by_hand = advise(trained, _data(2), recipe, loss_fn=loss_fn, budget=1, seed=3)
    got, want = warm.to_dict(), by_hand.to_dict()
    assert got.pop("passes") == want.pop("passes") + 4
    for key in ("expected", "expected_plan"):  # one step of the warmed copy, said so
        assert (got[key].pop("steps"), want[key].pop("steps")) == (4, 0)
    assert got == want
    errors = {la.name: la.error for la in warm.layers}
    assert list(warm.ranking) == sorted(errors, key=lambda n: -errors[n])
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        advise(model, _data(1), recipe, loss_fn=loss_fn, warmup_steps=-1)


def test_training_needs_a_real_loss_and_something_to_train() -> None:
    from floatguard import expected_gap

    recipe = EmulationRecipe.mxfp8()
    no_loss = [torch.randn(8, 32)]  # the model returns logits, no loss of its own
    with pytest.raises(ValueError, match="returned no loss of its own"):
        expected_gap(_net(), no_loss, recipe, steps=2, seeds=1)
    with pytest.raises(ValueError, match="returned no loss of its own"):
        advise(_net(), no_loss, recipe, budget=1, warmup_steps=2)
    frozen = _net().requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter of the model requires grad"):
        expected_gap(frozen, _data(1), recipe, loss_fn=loss_fn, steps=2, seeds=1)
    warm = advise(_net(), _data(1), recipe, loss_fn=loss_fn, budget=np.int64(1),
                  warmup_steps=np.int64(2), seed=np.int64(1), per_gemm=False,
                  leave_one_out=False)  # type: ignore[arg-type]  # fmt: skip
    assert warm.expected is not None and "one step after a 2-step warm-up" in str(warm.expected)
    assert "measured on one step:" in warm.expected.judge(0.0)
    everything = advise(_net(), _data(1), recipe, loss_fn=loss_fn, budget=99,
                        per_gemm=False, leave_one_out=False)  # fmt: skip
    assert "nothing is left to emulate" in everything.summary()
