"""Guard(sync="deferred"): the next step's work begun before the host settled the step
before it (issue 43). The guard runs a closure step's forward and backward first and
settles after (the host waits for the read while the device works); a three-call loop
whose forward the guard did not see begin is settled at the step with its work held
apart. Either way the decisions, events and weights are the exact mode's, or, where the
settling changed what the begun work used, the work is run again (or named skipped)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from floatguard import Guard, ResponsePolicy, SpikePolicy
from tests.test_guard_deferred import SCENARIOS, Batch, batches, closure, make, same

Outcome = tuple[list[tuple[Any, ...]], list[torch.Tensor], list[str]]


class Wrapped(nn.Module):
    """A model whose loop calls a submodule, never the guarded root's forward (a
    LightningModule's ``training_step`` calling ``self.net(x)`` does so)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net


def _policy() -> dict[str, Any]:
    return {"spikes": SpikePolicy(window=10, z=6.0), "response": ResponsePolicy(rollback_after=3)}


def _closure_run(sync: str, scenario: Callable[[int, Batch], Batch], opt: str) -> Outcome:
    model, optimizer = make(opt)
    guard = Guard(model, optimizer, sync=sync, **_policy())  # type: ignore[arg-type]
    seen = []
    for i, b in enumerate(batches(24)):
        r = guard.step(closure(model, *scenario(i, b)))
        seen.append(r)
    guard.close()
    if sync == "deferred":
        assert guard._deferred is not None
        ahead = guard._deferred.ahead_steps
        assert ahead >= 15, ahead  # most steps ran ahead of the settling
    rows = [(r.step, r.action, r.reason, r.loss, r.grad_norm, r.lr_factor) for r in seen]
    return (
        rows,
        [p.detach().clone() for p in model.parameters()],
        [e.kind for e in guard.events.events],
    )


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_step_run_ahead_of_the_settling_decides_what_exact_decides(name: str, opt: str) -> None:
    """The closure step's forward and backward run before the previous step is settled;
    a rollback (or a spike's undo) decided then drops that work and runs it again."""
    exact = _closure_run("exact", SCENARIOS[name], opt)
    deferred = _closure_run("deferred", SCENARIOS[name], opt)
    assert [r[1] for r in exact[0]] != ["applied"] * 24
    assert same(deferred[0], exact[0]), (deferred[0], exact[0])
    assert deferred[2] == exact[2]
    assert all(torch.equal(a, b) for a, b in zip(exact[1], deferred[1], strict=True))


def test_dropout_draws_are_the_exact_modes_when_the_step_runs_ahead() -> None:
    """The settling of the step before (a spike's replay draws) sees the RNG as if the
    next step had not begun, and the next step continues with its own draws."""
    out = {}
    for sync in ("exact", "deferred"):
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.Tanh(), nn.Linear(32, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        guard = Guard(model, optimizer, sync=sync, **_policy())  # type: ignore[arg-type]
        rows = []
        for i, b in enumerate(batches(20)):
            x, y = SCENARIOS["loss spike"](i, b)
            rows.append(guard.step(closure(model, x, y)))
        guard.close()
        out[sync] = (
            [(r.action, r.reason, r.loss) for r in rows],
            [p.detach().clone() for p in model.parameters()],
            torch.rand(3),  # where the RNG is after the run
        )
    assert out["exact"][0] == out["deferred"][0]
    assert any(a != "applied" for a, _, _ in out["exact"][0])
    assert all(torch.equal(a, b) for a, b in zip(out["exact"][1], out["deferred"][1], strict=True))
    assert torch.equal(out["exact"][2], out["deferred"][2])


def test_a_closure_that_raises_while_running_ahead_still_settles_the_step_before() -> None:
    model, optimizer = make("adamw")
    guard = Guard(model, optimizer, sync="deferred")
    data = batches(6)
    for x, y in data[:3]:
        guard.step(closure(model, x, y))
    pending = guard.step(closure(model, data[3][0] * float("nan"), data[3][1]))
    assert not pending.settled
    before = [p.detach().clone() for p in model.parameters()]

    def broken() -> torch.Tensor:
        nn.functional.mse_loss(model(data[4][0]), data[4][1]).backward()  # work begun
        raise ValueError("a bad batch")

    with pytest.raises(ValueError, match="a bad batch"):
        guard.step(broken)
    assert pending.settled and pending.action == "skipped"
    assert pending.reason == "nonfinite_input"
    assert all(p.grad is None for p in model.parameters())  # the begun work: dropped
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert guard.step(closure(model, *data[5])).step == 4
    guard.close()


def _three_call_bypassing_root(
    sync: str, scenario: Callable[[int, Batch], Batch], replay: bool, precision: str = "fp32"
) -> tuple[list[tuple[Any, ...]], list[torch.Tensor]]:
    model, optimizer = make("adam")
    wrapped = Wrapped(model)
    guard = Guard(wrapped, optimizer, sync=sync, precision=precision, **_policy())  # type: ignore[arg-type]
    for i, b in enumerate(batches(24)):
        x, y = scenario(i, b)
        with guard.autocast():
            loss = nn.functional.mse_loss(wrapped.net(x), y)  # the root's forward: not called
        guard.backward(loss)
        guard.step(replay=[closure(wrapped.net, x, y)] if replay else None)
    guard.close()
    steps = [(e.step, e["action"], e["reason"]) for e in guard.events.of_kind("step")]
    return steps, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_three_call_loop_that_bypasses_the_root_forward_is_settled_at_the_step(
    name: str,
) -> None:
    """The caller's forward and backward ran on the device's verdict before the host
    settled the step before: the work is held apart while it settles, then stands (it
    used the weights the host kept). Where the settling rolled back, the work used the
    weights before the rollback: run again from ``replay=`` (then exactly the exact
    mode's run), or, without it, skipped as an ``after_rollback`` batch."""
    exact = _three_call_bypassing_root("exact", SCENARIOS[name], replay=True)
    again = _three_call_bypassing_root("deferred", SCENARIOS[name], replay=True)
    assert again[0] == exact[0]
    assert all(torch.equal(a, b) for a, b in zip(exact[1], again[1], strict=True))
    bare = _three_call_bypassing_root("deferred", SCENARIOS[name], replay=False)
    exact_bare = _three_call_bypassing_root("exact", SCENARIOS[name], replay=False)
    after = {s + 1 for s, a, _ in exact_bare[0] if a == "rolled_back"}
    # the batch after a rollback: its work used the weights the rollback replaced
    expected = [(s, "skipped", "after_rollback") if s in after else row
                for s, *_ in exact_bare[0] for row in [exact_bare[0][s]]]  # fmt: skip
    assert bare[0] == expected
    assert after or all(torch.equal(a, b) for a, b in zip(exact_bare[1], bare[1], strict=True))
    if name == "inf burst (rollback)":
        assert after  # (the scenario rolls back without replay closures)
        # that batch was bad too: skipped either way, the same weights after
        assert all(torch.equal(a, b) for a, b in zip(exact_bare[1], bare[1], strict=True))


def test_a_loss_scale_change_settled_under_begun_work_rescales_its_gradients() -> None:
    """fp16: the caller's backward scaled by the loss scale before the settling backed
    it off (an overflow): its gradients are rescaled by the ratio (a power of two:
    exact), so the step decides what the exact mode does."""

    def overflow(i: int, b: Batch) -> Batch:
        return (b[0] * 3e4, b[1]) if i in (7, 13) else b

    exact = _three_call_bypassing_root("exact", overflow, replay=False, precision="fp16")
    deferred = _three_call_bypassing_root("deferred", overflow, replay=False, precision="fp16")
    assert any(a != "applied" for _, a, _ in exact[0]), exact[0]
    assert deferred[0] == exact[0]
    assert all(torch.equal(a, b) for a, b in zip(exact[1], deferred[1], strict=True))


def _corrupted_run(sync: str, spikes: SpikePolicy) -> tuple[list[Any], list[torch.Tensor], int]:
    model, optimizer = make("adamw")
    guard = Guard(model, optimizer, sync=sync, spikes=spikes)  # type: ignore[arg-type]
    rows = []
    for i, b in enumerate(batches(22)):
        x, y = b
        if i in (15, 19):  # a loss spike
            y = y * 3000
        rows.append(guard.step(closure(model, x, y)))
        if i == 2:  # a flipped bit in a weight between two steps
            with torch.no_grad():
                model[0].weight[0, 0] = float("nan")
    guard.close()
    ahead = guard._deferred.ahead_steps if guard._deferred is not None else 0
    seen = [(r.step, r.action, r.reason, r.loss) for r in rows]
    return seen, [p.detach().clone() for p in model.parameters()], ahead


@pytest.mark.parametrize("detector", ["robust", "lesson"])
def test_a_settling_that_rolls_back_or_undoes_runs_the_begun_step_again(detector: str) -> None:
    """A weight turned NaN between steps: the next step (run on it) is answered by a
    rollback when it settles, after the step after it ran ahead on the NaN weight; and
    with the lesson detector (no bar the device can compare with) a spike's update,
    kept by the device, is undone when it settles, after the next step ran ahead on it.
    Both times the begun step is dropped and run again: the exact mode's run."""
    spikes = SpikePolicy(window=10, z=6.0, threshold=2.5, detector=detector)  # type: ignore[arg-type]
    exact = _corrupted_run("exact", spikes)
    deferred = _corrupted_run("deferred", spikes)
    actions = [a for _, a, _, _ in exact[0]]
    assert "rolled_back" in actions
    assert same(deferred[0], exact[0]), (deferred[0], exact[0])
    assert all(torch.equal(a, b) for a, b in zip(exact[1], deferred[1], strict=True))
    assert deferred[2] >= 12


def _loop(sync: str, body: Callable[[Guard, nn.Module, int, Batch], Any], n: int = 20,
          precision: str = "fp32", **kw: Any) -> tuple[list[Any], list[torch.Tensor]]:  # fmt: skip
    model, optimizer = make("adamw")
    guard = Guard(model, optimizer, sync=sync, precision=precision,  # type: ignore[arg-type]
                  **{**_policy(), **kw})  # fmt: skip
    rows = [body(guard, model, i, b) for i, b in enumerate(batches(n))]
    guard.close()
    steps = [(e.step, e["action"], e["reason"]) for e in guard.events.of_kind("step")]
    del rows
    return steps, [p.detach().clone() for p in model.parameters()]


def test_a_settling_inside_the_callers_autocast_does_not_leave_stale_casts() -> None:
    """bf16, three-call loop through the root: the step before is settled at the
    forward's pre-hook, inside the caller's ``with guard.autocast()``; its spike replay
    fills autocast's cache of bf16 weight casts and the rollback then writes the
    weights: the cache is cleared, so the forward reads the restored weights."""

    def body(guard: Guard, model: nn.Module, i: int, b: Batch) -> Any:
        x, y = b
        if i in (12, 13):
            y = y * 1e3
        with guard.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        guard.backward(loss)
        return guard.step(replay=[lambda: nn.functional.mse_loss(model(x).float(), y)])

    kw = {"spikes": SpikePolicy(window=8, z=6.0, warmup=5),
          "response": ResponsePolicy(rollback_after=2)}  # fmt: skip
    exact = _loop("exact", body, precision="bf16", **kw)
    deferred = _loop("deferred", body, precision="bf16", **kw)
    assert "rolled_back" in {a for _, a, _ in exact[0]}, exact[0]
    assert deferred[0] == exact[0]
    assert all(torch.equal(a, b) for a, b in zip(exact[1], deferred[1], strict=True))


@pytest.mark.parametrize("how", ["reads the result", "calls settle()"])
def test_a_closure_that_settles_the_step_before_runs_after_it(how: str) -> None:
    """The closure of step t+1 reads step t's result (logging it) while running ahead
    of step t's settling: the run ahead is dropped, step t settled, step t+1 run from
    the start (on the weights step t's rollback restored)."""
    last: list[Any] = [None]

    def body(guard: Guard, model: nn.Module, i: int, b: Batch) -> Any:
        x, y = b
        if i == 8:
            with torch.no_grad():
                model[0].weight[0, 0] = float("nan")

        def closure(prev: Any = last[0]) -> torch.Tensor:
            loss = nn.functional.mse_loss(model(x), y)
            if prev is not None:
                _ = prev.action if how == "reads the result" else guard.settle()
            return loss

        last[0] = guard.step(closure)
        return last[0]

    exact = _loop("exact", body)
    deferred = _loop("deferred", body)
    assert "rolled_back" in {a for _, a, _ in exact[0]}
    assert deferred[0] == exact[0]
    assert all(torch.equal(a, b) for a, b in zip(exact[1], deferred[1], strict=True))


def test_a_write_to_the_weights_undone_with_a_step_is_warned() -> None:
    """With the lesson detector (no bar the device compares with), a spike's update is
    kept by the device and undone when the host settles it; a write the caller made to
    the weights in between is undone with it: a RuntimeWarning says so."""
    model, optimizer = make("sgd")
    lesson = SpikePolicy(window=8, warmup=5, detector="lesson", threshold=2.5)
    guard = Guard(model, optimizer, sync="deferred", spikes=lesson)
    data = batches(16)
    with pytest.warns(RuntimeWarning, match=r"written in place after the step returned"):
        for i, (x, y) in enumerate(data):
            guard.step(closure(model, x, y * (3000 if i == 12 else 1)))
            with torch.no_grad():
                model[0].weight.mul_(0.99)  # a weight projection after every step
    guard.close()


def test_a_refilled_input_buffer_is_warned_when_its_step_is_replayed() -> None:
    model, optimizer = make("adamw")
    guard = Guard(model, optimizer, sync="deferred")
    buf_x, buf_y = torch.empty(16, 8), torch.empty(16, 4)
    with pytest.warns(RuntimeWarning, match=r"step 6's inputs were written in place"):
        for i, (x, y) in enumerate(batches(10)):
            buf_x.copy_(x * float("nan") if i == 6 else x)  # a reused buffer
            buf_y.copy_(y)
            guard.step(closure(model, buf_x, buf_y))
    guard.close()


class _RareNaN(nn.Module):
    """A NaN drawn at random (p=0.05 per forward): a fault a replay reproduces only with
    the step's own RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        return out * float("nan") if bool(torch.rand(()) < 0.05) else out


def test_a_bypassing_loops_bad_step_is_replayed_with_its_own_draws() -> None:
    """The three-call loop bypassing the root: the step before settles after this
    step's forward drew; this step's replay still starts from the draws it began with
    (deterministic, as in the exact mode; not 'transient')."""
    out = {}
    for sync in ("exact", "deferred"):
        torch.manual_seed(0)
        net = _RareNaN()
        wrapped = Wrapped(net)
        guard = Guard(wrapped, torch.optim.SGD(net.parameters(), lr=0.01), sync=sync)  # type: ignore[arg-type]
        for x, y in batches(40):
            loss = nn.functional.mse_loss(wrapped.net(x), y)
            guard.backward(loss)
            guard.step(replay=[lambda x=x, y=y, w=wrapped: nn.functional.mse_loss(w.net(x), y)])
        guard.close()
        out[sync] = [(e.step, e["action"], e["reason"]) for e in guard.events.of_kind("step")]
        faults = [e["deterministic"] for e in guard.events.of_kind("fault")]
        assert faults and all(faults), (sync, faults)  # every replay reproduced its NaN
    bad = [r for r in out["exact"] if r[1] != "applied"]
    assert bad and all(reason == "nonfinite_loss" for _, _, reason in bad), bad
    assert out["deferred"] == out["exact"]
