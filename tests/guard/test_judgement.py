"""The guard off the beaten path: each situation planted the way a user meets it, with
the exact decision sequence asserted (the rules: docs/guard.md, "The judgement")."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from floatguard import Guard, GuardStopped, SpikePolicy
from floatguard.diagnose import diagnose
from floatguard.guard.vetting import FLOOR, JUMP

pytestmark = pytest.mark.usefixtures("guard_sync")  # every test in both sync modes

Batch = tuple[torch.Tensor, torch.Tensor]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.ln = nn.LayerNorm(16)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.ln(self.fc(x))))


def _batches(n: int, seed: int = 0) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)) for _ in range(n)]


def _setup(**kw: object) -> tuple[Block, torch.optim.Optimizer, Guard]:
    torch.manual_seed(0)
    model = Block()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, Guard(model, opt, **kw)  # type: ignore[arg-type]


def _finite(model: nn.Module, opt: torch.optim.Optimizer) -> bool:
    tensors = [p.detach() for p in model.parameters()]
    tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return all(bool(t.isfinite().all()) for t in tensors)


def _run(
    model: nn.Module, guard: Guard, batches: list[Batch],
    before: Callable[[int], None] = lambda i: None,
) -> list[tuple[str, str | None]]:  # fmt: skip
    out = []
    for i, (x, y) in enumerate(batches):
        before(i)
        r = guard.step(lambda x=x, y=y: F.mse_loss(model(x), y))
        out.append((r.action, r.reason))
    return out


# 1. A poisoned rollback ------------------------------------------------------------
def test_a_nan_moment_just_before_a_snapshot_is_never_captured() -> None:
    model, opt, guard = _setup()

    def poison(i: int) -> None:
        if i == 10:  # good_steps == 10: this step takes a snapshot before applying
            opt.state[model.fc.weight]["exp_avg_sq"][0, 0] = math.nan

    got = _run(model, guard, _batches(14), poison)
    assert (
        got
        == [("applied", None)] * 10
        + [("rolled_back", "nonfinite_optimizer_state")]
        + [("applied", None)] * 3
    )
    fault = guard.events.of_kind("fault")[0]
    assert (fault["module"], fault["tensor"], fault["cause"]) == (
        "fc", "optimizer:weight.exp_avg_sq", "nonfinite_optimizer_state"
    )  # fmt: skip
    assert guard.events.of_kind("rollback")[0]["to_step"] == 5  # the clean snapshot
    assert _finite(model, opt)
    guard.close()


@pytest.mark.parametrize("how", ["moment replaced", "state reloaded", "weight .data replaced"])
def test_state_replaced_between_snapshots_is_the_state_vetted(how: str) -> None:
    """The vetting's list of state tensors (and, on CPU, its native plan) is kept between
    snapshot steps: a tensor replaced meanwhile must be the one read."""
    model, opt, guard = _setup()

    def poison(i: int) -> None:
        if i != 10:  # a snapshot step: the state it would capture is vetted first
            return
        if how == "moment replaced":
            bad = opt.state[model.fc.weight]["exp_avg_sq"].clone()
            bad[0, 0] = math.nan
            opt.state[model.fc.weight]["exp_avg_sq"] = bad
        elif how == "state reloaded":
            sd = opt.state_dict()
            sd["state"][0]["exp_avg_sq"] = sd["state"][0]["exp_avg_sq"].clone()
            sd["state"][0]["exp_avg_sq"][0, 0] = math.nan
            opt.load_state_dict(sd)
        else:
            bad = model.fc.weight.detach().clone()
            bad[0, 0] = math.inf
            model.fc.weight.data = bad

    got = _run(model, guard, _batches(12), poison)
    assert got[:10] == [("applied", None)] * 10
    want = "nonfinite_param" if how == "weight .data replaced" else "nonfinite_optimizer_state"
    assert got[10] == ("rolled_back", want)
    assert got[11] == ("applied", None)
    assert _finite(model, opt)
    guard.close()


def test_a_nan_moment_between_snapshots_is_named_before_the_weight_it_poisoned() -> None:
    model, opt, guard = _setup()

    def poison(i: int) -> None:
        if i == 7:
            opt.state[model.fc.weight]["exp_avg_sq"][0, 0] = math.nan

    got = _run(model, guard, _batches(12), poison)
    # step 7 is applied (its read was clean) and its update makes fc.weight NaN; step 8
    # names the moment, not the weight, and rolls back to the snapshot of step 5
    assert got[7] == ("applied", None)
    assert got[8] == ("rolled_back", "nonfinite_optimizer_state")
    assert got[9:] == [("applied", None)] * 3
    assert guard.events.of_kind("fault")[0]["tensor"] == "optimizer:weight.exp_avg_sq"
    assert _finite(model, opt)
    guard.close()


def test_a_state_that_keeps_going_bad_stops_with_the_model_at_its_last_clean_state() -> None:
    model, opt, guard = _setup()

    def poison(*_: object) -> None:
        if guard.step_count >= 6:
            opt.state[model.fc.weight]["exp_avg_sq"][0, 0] = math.nan

    opt.register_step_post_hook(poison)
    with pytest.raises(GuardStopped) as stopped:
        _run(model, guard, _batches(30))
    assert stopped.value.report["reason"] == "repeated_fault"
    assert stopped.value.report["cause"] == "nonfinite_optimizer_state"
    assert stopped.value.report["restored_to"] == 5
    assert _finite(model, opt)  # never left NaN
    assert [a for a, _ in _steps(guard)].count("rolled_back") == 1
    guard.close()


def _steps(guard: Guard) -> list[tuple[str, str | None]]:
    return [(e["action"], e["reason"]) for e in guard.events.of_kind("step")]


# 2. Data errors in later micro-batches -----------------------------------------------
@pytest.mark.parametrize("bad", [0, 1, 2])
def test_a_nan_batch_in_any_micro_batch_is_bad_data(bad: int) -> None:
    model, _, guard = _setup()
    (x, y), *_ = _batches(1)
    closures = [
        (lambda x=x * math.nan if i == bad else x: F.mse_loss(model(x), y)) for i in range(3)
    ]
    r = guard.step(closures)
    assert (r.action, r.reason) == ("skipped", "nonfinite_input")
    assert r.fault is not None and (r.fault.phase, r.fault.op) == ("input", "input")
    assert guard.lr_factor == 1.0 and guard.consecutive_bad == 0
    guard.close()


# 3. A model bug is not data; bad data is not skipped forever --------------------------
class Buggy(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h[:, 0] = float("nan")  # a bug in the model, not in the data
        return self.head(torch.tanh(self.ln(h)))


def test_a_module_writing_nan_climbs_the_ladder_and_stops() -> None:
    torch.manual_seed(0)
    model = Buggy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = Guard(model, opt)
    with pytest.raises(GuardStopped) as stopped:
        _run(model, guard, _batches(10))
    assert _steps(guard) == [("skipped", "nonfinite_loss")] * 4 + [
        ("rolled_back", "nonfinite_loss")
    ]
    assert stopped.value.report["reason"] == "repeated_fault"
    f = stopped.value.fault
    assert f is not None and f.phase == "forward" and f.module == ""  # the root's forward
    assert f.op is not None and f.op != "input"
    assert [e["factor"] for e in guard.events.of_kind("lr_backoff")] == [0.5, 0.25, 0.125, 0.0625]
    guard.close()


def test_a_data_pipeline_that_keeps_producing_nan_is_stopped() -> None:
    model, _, guard = _setup()
    batches = [(x * math.nan, y) for x, y in _batches(12)]
    with pytest.raises(GuardStopped, match="data pipeline produces non-finite values") as e:
        _run(model, guard, batches)
    assert _steps(guard) == [("skipped", "nonfinite_input")] * 9
    assert e.value.report["reason"] == "bad_data" and e.value.report["step"] == 9
    warnings = guard.events.of_kind("warning")
    assert [w.step for w in warnings] == [2] and "in a row" in warnings[0]["message"]
    assert any(f.rule == "bad_input" and f.severity == 3 for f in diagnose(guard.events.events))
    guard.close()


def test_rare_bad_batches_are_skipped_and_training_goes_on() -> None:
    model, _, guard = _setup()
    batches = [(x * math.nan, y) if i % 7 == 3 else (x, y) for i, (x, y) in enumerate(_batches(40))]
    got = _run(model, guard, batches)
    assert [r for _, r in got if r is not None] == ["nonfinite_input"] * 6
    assert not guard.events.of_kind("stop") and not guard.events.of_kind("warning")
    guard.close()


# 4. A flipped bit ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_flipped_exponent_bit_is_a_bad_parameter_rolled_back(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = Block().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = Guard(model, opt)

    def flip(i: int) -> None:
        if i == 8:
            with torch.no_grad():
                w = model.fc.weight
                ints, bit = (torch.int32, 30) if dtype == torch.float32 else (torch.int16, 14)
                w.view(ints)[0, 0] ^= 1 << bit  # the top exponent bit: ~1e37, still finite
                assert bool(w.isfinite().all()) and float(w.abs().max()) > 1e30

    batches = [(x.to(dtype), y.to(dtype)) for x, y in _batches(12)]
    got = []
    for i, (x, y) in enumerate(batches):
        flip(i)
        r = guard.step(lambda x=x, y=y: F.mse_loss(model(x).float(), y.float()))
        got.append((r.action, r.reason))
    assert (
        got
        == [("applied", None)] * 8 + [("rolled_back", "nonfinite_param")] + [("applied", None)] * 3
    )
    f = guard.events.of_kind("fault")[0]
    assert (f["module"], f["tensor"], f["op"]) == ("fc", "param:weight", "magnitude")
    assert f["kind_of_value"] == "huge"  # finite: not called inf
    assert float(model.fc.weight.detach().abs().max()) < 10
    assert any("flipped" in d.cause for d in diagnose(guard.events.events))
    guard.close()


def test_the_magnitude_rule_never_trips_on_clean_training() -> None:
    """Largest magnitudes of every parameter at each snapshot of clean runs (AdamW and a
    large-LR SGD, the demo GPT): no growth between snapshots comes near the rule."""
    from floatguard.demo import GPT, GPTConfig, synthetic_batch

    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32)
    for make_opt in (
        lambda p: torch.optim.AdamW(p, lr=3e-3),
        lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9),
    ):
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = make_opt(model.parameters())
        g = torch.Generator().manual_seed(0)
        before = {n: float(p.detach().abs().max()) for n, p in model.named_parameters()}
        margin = 0.0  # how close any growth came to the rule (1: it would trip)
        for step in range(150):
            x, y = synthetic_batch(cfg, 8, generator=g)
            logits = model(x)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
            if step % 5 == 4:
                now = {n: float(p.detach().abs().max()) for n, p in model.named_parameters()}
                for n, v in now.items():
                    assert not (v > FLOOR and v > JUMP * before[n]), (n, v, before[n])
                    margin = max(margin, v / max(JUMP * before[n], FLOOR))
                before = now
        assert margin < 0.01, margin  # far below the rule, not only under it


# 5. The optimizer made it -------------------------------------------------------------
def test_pure_fp16_adamw_is_named_the_optimizer_update() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # eps=1e-8 is 0 in fp16
    guard = Guard(model, opt)
    x, y = torch.randn(16, 8).half(), (torch.randn(16, 2) * 1e-3).half()
    with pytest.raises(GuardStopped) as stopped:
        for _ in range(20):
            guard.step(lambda: F.mse_loss(model(x).float(), y.float()))
    steps = _steps(guard)
    assert steps[0] == ("applied", None)
    assert steps[1] == ("rolled_back", "optimizer_update")
    assert stopped.value.report["cause"] == "optimizer_update"
    assert stopped.value.fault is not None and stopped.value.fault.op == "optimizer.step"
    assert all(bool(p.isfinite().all()) for p in model.parameters())  # left at the snapshot
    findings = {d.rule: d for d in diagnose(guard.events.events)}
    assert "optimizer_update" in findings and "bad_parameter" not in findings
    assert "MasterWeights" in findings["optimizer_update"].fix
    guard.close()


# 6. Spikes that are not spikes --------------------------------------------------------
def test_a_hinge_loss_that_is_mostly_zero_is_learned_from() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    guard = Guard(model, opt, spikes=SpikePolicy(watch_grad_norm=True))
    g = torch.Generator().manual_seed(3)
    w_true = torch.randn(8, generator=g)
    w_true = w_true / w_true.norm()
    zero = 0
    for _ in range(300):
        x = torch.randn(16, 8, generator=g)
        y = torch.sign(x @ w_true)
        x = x + 2.0 * y[:, None] * w_true  # separable with a margin: the loss reaches 0
        r = guard.step(lambda x=x, y=y: F.relu(1 - y * model(x).squeeze(1)).mean())
        zero += r.loss == 0.0
        assert r.action == "applied", r
    assert zero > 150  # most batches carry no loss, and the others were all learned from
    assert not guard.events.of_kind("spike")
    guard.close()


# 7. A spike is replayed too ----------------------------------------------------------
def test_a_spike_that_does_not_reproduce_is_transient_and_one_that_does_is_the_batch() -> None:
    model, _, guard = _setup(spikes=SpikePolicy(window=20, warmup=10))
    batches = _batches(30)
    calls: dict[int, int] = {}
    got = []
    for i, (x, y) in enumerate(batches):
        y = y * 40.0 if i == 25 else y  # a bad batch: reproduces

        def closure(i: int = i, x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            calls[i] = calls.get(i, 0) + 1
            loss = F.mse_loss(model(x), y)
            return loss * 50.0 if i == 20 and calls[i] == 1 else loss  # a glitch: once

        r = guard.step(closure)
        got.append((r.action, r.reason))
    assert got[20] == ("skipped", "transient") and got[25] == ("skipped", "loss_spike")
    assert [g for j, g in enumerate(got) if j not in (20, 25)] == [("applied", None)] * 28
    spikes = guard.events.of_kind("spike")
    assert [(e.step, e["reproduced"]) for e in spikes] == [(20, False), (25, True)]
    assert guard.transients == 1
    guard.close()


# A resume through load_state_dict, weights loaded after the guard was built -----------
def test_a_rollback_after_a_rebuild_and_load_goes_back_to_the_loaded_weights() -> None:
    model, opt, guard = _setup()
    _run(model, guard, _batches(12))
    saved = (model.state_dict(), opt.state_dict(), guard.state_dict())
    guard.close()
    trained = {k: v.clone() for k, v in model.state_dict().items()}

    model2, opt2, guard2 = _setup()  # the usual resume: build everything, then load
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    guard2.load_state_dict(saved[2])
    (x, y), (x2, y2) = _batches(2, seed=9)
    assert guard2.step(lambda: F.mse_loss(model2(x), y)).action == "applied"
    with torch.no_grad():
        model2.head.weight[0, 0] = math.nan
    r = guard2.step(lambda: F.mse_loss(model2(x2), y2))
    assert (r.action, r.reason) == ("rolled_back", "nonfinite_param")
    # the snapshot is of the loaded weights (taken when the first step after the load
    # began), not of the random ones the guard was built with
    assert guard2.events.of_kind("rollback")[0]["to_step"] == 12
    for k, v in model2.state_dict().items():
        assert torch.equal(v, trained[k]), k
    guard2.close()


def test_an_absurd_lr_for_one_step_is_the_optimizer_update_not_a_flipped_bit() -> None:
    model, opt, guard = _setup()

    def lr(i: int) -> None:
        for group in opt.param_groups:
            group["lr"] = 1e30 if i == 6 else 1e-2

    got = _run(model, guard, _batches(9), lr)
    assert got[:7] == [("applied", None)] * 7
    assert got[7] == ("rolled_back", "optimizer_update")
    assert guard.events.of_kind("fault")[0]["op"] == "optimizer.step"
    findings = {d.rule for d in diagnose(guard.events.events)}
    assert "optimizer_update" in findings and "bad_parameter" not in findings
    guard.close()


def test_a_minus_inf_in_the_batch_that_nothing_else_explains_is_bad_data() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(0)
    got = []
    for i in range(6):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        if i >= 3:
            x[3, 1] = -math.inf  # not a mask: a broken feature (log(0) in preprocessing)
        r = guard.step(lambda x=x, y=y: F.mse_loss(model(x), y))
        got.append((r.action, r.reason))
        if i >= 3:
            assert r.fault is not None and (r.fault.phase, r.fault.tensor) == ("input", "input[0]")
    assert got == [("applied", None)] * 3 + [("skipped", "nonfinite_input")] * 3
    assert guard.lr_factor == 1.0 and guard.rollbacks == 0
    guard.close()


def test_a_first_step_that_raises_leaves_no_unvetted_snapshot() -> None:
    model, _, guard = _setup()
    (x, y), *_ = _batches(1)

    def broken() -> torch.Tensor:
        raise RuntimeError("the data loader failed")

    with pytest.raises(RuntimeError, match="data loader"):
        guard.step(broken)
    assert guard.last_snapshot is None and not guard.events.of_kind("snapshot")
    assert guard.step(lambda: F.mse_loss(model(x), y)).action == "applied"
    snap = guard.last_snapshot
    assert snap is not None and snap.step == 0
    assert [e.step for e in guard.events.of_kind("snapshot")] == [0]
    guard.close()
