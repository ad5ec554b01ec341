"""A step is applied whole or not at all, with every scheduler; the closure people write.

Issue 36, items 7 and 8: a metric-driven scheduler (ReduceLROnPlateau) is stepped with
the step's loss or the metric given; an exception raised anywhere in the apply phase
leaves the model, optimizer, scheduler and scaler as they were before the step; a
PyTorch-style closure that runs its own backward is supported (or refused at once).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from floatguard import ClipPolicy, DynamicLossScaler, Guard
from floatguard.guard.act import Actor, is_metric_scheduler
from floatguard.stability.clip import ZClip

pytestmark = pytest.mark.usefixtures("guard_sync")  # every test in both sync modes


def _setup(**kw: Any) -> tuple[nn.Module, torch.optim.Optimizer, list[tuple[torch.Tensor, ...]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **kw)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(12)]
    return model, opt, batches


def _state(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, guard: Guard) -> Any:
    return (
        copy.deepcopy(model.state_dict()),
        copy.deepcopy(opt.state_dict()),
        copy.deepcopy(sched.state_dict()) if sched is not None else None,
        guard.step_count,
        guard.zclip.state_dict() if guard.zclip is not None else None,
        copy.deepcopy(guard.loss_detector.state_dict()) if guard.loss_detector else None,
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.exact_only(
    "reads the LR right after step(); deferred, the scheduler steps when the step settles"
)
def test_reduce_lr_on_plateau_is_stepped_with_the_loss_or_the_metric_given() -> None:
    model, opt, batches = _setup()
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    assert is_metric_scheduler(sched)
    guard = Guard(model, opt, scheduler=sched)
    x, y = batches[0]
    r = guard.step(lambda: F.mse_loss(model(x), y))
    assert r.action == "applied" and sched.best == pytest.approx(r.loss)
    # a metric that does not improve: patience 0, the LR halves at once
    guard.step(lambda: F.mse_loss(model(x), y), metric=1e9)
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-3)
    guard.step(lambda: F.mse_loss(model(x), y), metric=torch.tensor(2e9))
    assert opt.param_groups[0]["lr"] == pytest.approx(2.5e-3)
    steps = guard.events.of_kind("step")
    assert [e["lr"] for e in steps] == pytest.approx([1e-2, 1e-2, 5e-3])  # what each used
    guard.close()


@pytest.mark.exact_only(
    "reads the LR right after step(); deferred, the scheduler steps when the step settles"
)
def test_a_stepped_scheduler_sets_the_next_lr_after_the_update_used_this_one() -> None:
    model, opt, batches = _setup()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    ref_model, ref_opt, _ = _setup()
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.1)
    guard = Guard(model, opt, scheduler=sched, clip=ClipPolicy(kind="none"))
    for x, y in batches[:3]:
        guard.step(lambda x=x, y=y: F.mse_loss(model(x), y))
        ref_opt.zero_grad()
        F.mse_loss(ref_model(x), y).backward()
        ref_opt.step()
        ref_sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    guard.close()


POINTS = ["snapshot", "clip", "schedule", "zclip", "scaler", "spikes", "fence", "optimizer"]


@pytest.mark.exact_only("patches the exact apply phase; the deferred one is test_guard_deferred's")
@pytest.mark.parametrize("point", POINTS)
def test_a_raise_anywhere_in_the_apply_phase_leaves_everything_as_before(point: str) -> None:
    model, opt, batches = _setup()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s)
    scaler = DynamicLossScaler(enabled=False)
    guard = Guard(model, opt, scheduler=sched, scaler=scaler)
    for x, y in batches[:4]:
        guard.step(lambda x=x, y=y: F.mse_loss(model(x), y))
    before = _state(model, opt, sched, guard)
    rng = torch.get_rng_state()
    boom = RuntimeError(f"injected at {point}")

    def fail(*a: Any, **k: Any) -> Any:
        raise boom

    actor: Actor = guard._c.actor  # the test reaches in to inject the failure
    patches: dict[str, tuple[Any, str]] = {
        "snapshot": (actor.keeper, "take"),
        "clip": (actor.clipper, "apply"),
        "schedule": (sched, "step"),
        "zclip": (ZClip, "update"),
        "scaler": (scaler, "update"),
        "spikes": (actor.spike_watch, "record"),
        "fence": (actor.keeper, "fence"),
        "optimizer": (opt, "step"),
    }
    obj, name = patches[point]
    if point == "snapshot":  # make the step a snapshot step
        guard._c.keeper.cadence.due = lambda good: True  # type: ignore[method-assign]
    had = name in vars(obj)
    original = getattr(obj, name)
    setattr(obj, name, fail)
    x, y = batches[5]
    with pytest.raises(RuntimeError, match=f"injected at {point}"):
        guard.step(lambda: F.mse_loss(model(x), y))
    if had:
        setattr(obj, name, original)
    else:
        delattr(obj, name)
    if point == "snapshot":
        del guard._c.keeper.cadence.due
    after = _state(model, opt, sched, guard)
    assert _same(before, after), point
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    # and the step then runs as it would have
    r = guard.step(lambda: F.mse_loss(model(x), y))
    assert r.action == "applied" and r.step == 4
    guard.close()


@pytest.mark.exact_only("the exact mode's answer; deferred, the step's own copies are put back")
def test_an_optimizer_that_raises_after_moving_weights_is_answered_by_the_snapshot() -> None:
    model, opt, batches = _setup()
    guard = Guard(model, opt)
    for x, y in batches[:3]:
        guard.step(lambda x=x, y=y: F.mse_loss(model(x), y))
    snap = guard.last_snapshot
    assert snap is not None
    kept = {k: v.clone() for k, v in snap.states["model"].items()}
    real_step = opt.step

    def half_step(*a: Any, **k: Any) -> Any:
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        raise RuntimeError("kernel failed")

    opt.step = half_step  # type: ignore[method-assign]
    x, y = batches[4]
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\) raised at step 3 after it "
                       r"changed weights \(RuntimeError: kernel failed\); the last clean "
                       r"snapshot \(step \d+\) was restored"):  # fmt: skip
        guard.step(lambda: F.mse_loss(model(x), y))
    opt.step = real_step  # type: ignore[method-assign]
    for k, v in model.state_dict().items():
        assert torch.equal(v, kept[k]), k
    guard.close()


def test_the_closure_people_write_runs_its_own_backward_once() -> None:
    model, opt, batches = _setup()
    ref, ref_opt, _ = _setup()
    guard = Guard(model, opt, clip=ClipPolicy(kind="none"))
    calls = {"backward": 0}

    def torch_style(x: torch.Tensor, y: torch.Tensor) -> Callable[[], torch.Tensor]:
        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            calls["backward"] += 1
            return loss

        return closure

    for x, y in batches[:5]:
        r = guard.step(torch_style(x, y))
        assert r.action == "applied"
        ref_opt.zero_grad()
        ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        assert r.loss == pytest.approx(float(ref_loss.detach()))
    assert calls["backward"] == 5
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    # its bad step is replayed and localized like any other
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    x, y = batches[6]
    r = guard.step(torch_style(x, y))
    assert (r.action, r.reason) == ("rolled_back", "nonfinite_param")
    guard.close()


def test_a_closure_with_its_own_backward_under_fp16_or_accumulation_is_refused_at_once() -> None:
    model, opt, batches = _setup()
    x, y = batches[0]

    def closure() -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    guard = Guard(model, opt, precision="fp16")
    with pytest.raises(RuntimeError, match=r"closure called loss.backward\(\) itself; under "
                       r"precision='fp16' the guard scales the loss .* return the loss "
                       r"without calling backward\(\)"):  # fmt: skip
        guard.step(closure)
    assert guard.step_count == 0 and all(p.grad is None for p in model.parameters())
    guard.close()
    guard = Guard(model, opt)
    with pytest.raises(RuntimeError, match="with a sequence of closures the guard accumulates"):
        guard.step([closure, closure])
    guard.close()


def test_a_first_snapshot_whose_write_failed_is_taken_again_by_the_retried_step(
    tmp_path: Path,
) -> None:
    """on_snapshot_error="raise" at step 0: the step is undone whole, the first snapshot
    forgotten, and the retried step 0 writes it once the folder is fixed."""
    import floatguard

    folder = tmp_path / "snaps"
    folder.write_text("not a folder")  # the write fails
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    g = floatguard.Guard(m, torch.optim.AdamW(m.parameters(), lr=1e-2),
                         response=floatguard.ResponsePolicy.durable(folder))  # fmt: skip
    x = torch.randn(8, 4)
    with pytest.raises(floatguard.SnapshotError):
        g.step(lambda: m(x).pow(2).mean())
    assert g.step_count == 0 and g.last_snapshot is None
    folder.unlink()
    folder.mkdir()
    assert g.step(lambda: m(x).pow(2).mean()).action == "applied"
    assert [(e.step, Path(e["where"]).name) for e in g.events.of_kind("snapshot")] == [
        (0, "snapshot-000000000.fgs")
    ]
    g.close()


def test_a_closed_guard_says_so_before_asking_for_a_loss() -> None:
    m = nn.Linear(4, 1)
    g = Guard(m, torch.optim.SGD(m.parameters(), lr=0.1))
    g.close()
    with pytest.raises(RuntimeError, match=r"guard.step\(\) after guard.close\(\)"):
        g.step()


@pytest.mark.parametrize("loop", ["closure", "three_call"])
def test_a_nan_batch_through_batchnorm_is_skipped_not_blamed_on_the_buffer(loop: str) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))
    g = Guard(m, torch.optim.SGD(m.parameters(), lr=0.01))
    for i in range(10):
        x = torch.randn(8, 8)
        if i in (6, 8):
            x[0, 0] = float("nan")
        before = m[1].running_mean.clone()
        if loop == "closure":
            r = g.step(lambda x=x: m(x).pow(2).mean())
        else:
            with g.autocast():
                loss = m(x).pow(2).mean()
            g.backward(loss)
            r = g.step(replay=[lambda x=x: m(x).pow(2).mean()])
        if i in (6, 8):
            assert (r.action, r.reason) == ("skipped", "nonfinite_input")
            assert torch.equal(m[1].running_mean, before)  # the NaN batch left no trace
        else:
            assert r.action == "applied"
    g.close()
