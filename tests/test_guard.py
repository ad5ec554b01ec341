"""The Guard end to end: injected faults, recovery, one host read per step, events, bad input."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
from torch import nn

from floatguard import (
    ClipPolicy,
    DynamicLossScaler,
    Guard,
    GuardStopped,
    ResponsePolicy,
    SpikePolicy,
    clip_grad_norm_,
    clip_grad_value_,
    read_events,
)

from .monitor.test_sync_free import CountSyncs

pytestmark = pytest.mark.usefixtures("guard_sync")  # every test in both sync modes

D_IN, D_OUT = 8, 4


def make(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(D_IN, 32), nn.Tanh(), nn.Linear(32, D_OUT))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(123)
    w = torch.randn(D_IN, D_OUT, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(32, D_IN, generator=g)
        out.append((x, torch.tanh(x @ w) + 0.05 * torch.randn(32, D_OUT, generator=g)))
    return out


EVAL = batches(1)[0]


def eval_loss(model: nn.Module) -> float:
    with torch.no_grad():
        return float(((model(EVAL[0]) - EVAL[1]) ** 2).mean())


def flip_exponent_bit(model: nn.Module) -> None:
    """A cosmic-ray style fault: bit 30 (exponent MSB) of a weight in [1, 2) flips,
    which makes the exponent field all ones: the weight becomes NaN."""
    with torch.no_grad():
        w = model[0].weight
        v = 1.0 + abs(float(w[0, 0])) % 1.0
        bits = struct.unpack("<I", struct.pack("<f", v))[0] ^ (1 << 30)
        w[0, 0] = struct.unpack("<f", struct.pack("<I", bits))[0]


N = 800
FAULTS = {
    "nan_batch": 40,
    "inf_grad": 80,
    "bit_flip": 120,
    "spike_batch": 200,
    "bad_run": range(260, 268),
}


def run(
    guarded: bool, faults: bool = True, log: Path | None = None, closure: bool = True
) -> tuple[nn.Module, Guard | None]:
    model, opt = make()
    guard = (
        Guard(
            model,
            opt,
            clip=ClipPolicy(kind="norm", max_norm=5.0),
            spikes=SpikePolicy(window=30, z=8.0),
            response=ResponsePolicy(rollback_after=4),
            log=log,
            watch="replay" if closure else "hooks",
        )
        if guarded
        else None
    )
    hook_handle = None
    for i, (x, y) in enumerate(batches(N)):
        if faults:
            if i == FAULTS["nan_batch"] or i in FAULTS["bad_run"]:  # type: ignore[operator]
                x = x.clone()
                x[3, 2] = math.nan
            if i == FAULTS["spike_batch"]:
                y = y * 40.0
            if i == FAULTS["bit_flip"]:
                flip_exponent_bit(model)
            if i == FAULTS["inf_grad"]:
                hook_handle = model[2].weight.register_hook(lambda g: g * math.inf)

        def loss_fn(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            return ((model(x) - y) ** 2).mean()

        if guard is not None and closure:
            guard.step(loss_fn)
        elif guard is not None:
            guard.backward(loss_fn())
            guard.step()
        else:
            opt.zero_grad()
            loss_fn().backward()
            opt.step()
        if hook_handle is not None:
            if guard is not None:
                guard.settle()  # (deferred mode) decide the step before its fault is removed
            hook_handle.remove()
            hook_handle = None
    return model, guard


def _steps(guard: Guard) -> dict[int, tuple[str, str | None]]:
    return {e.step: (e["action"], e["reason"]) for e in guard.events.of_kind("step")}


def test_guarded_run_recovers_unguarded_run_dies(tmp_path: Path) -> None:
    clean, _ = run(guarded=False, faults=False)
    unguarded, _ = run(guarded=False)
    guarded, guard = run(guarded=True, log=tmp_path / "run.jsonl")
    assert guard is not None
    assert not all(bool(torch.isfinite(p).all()) for p in unguarded.parameters())
    assert all(bool(torch.isfinite(p).all()) for p in guarded.parameters())
    ref, got = eval_loss(clean), eval_loss(guarded)
    assert abs(got - ref) <= 0.05 * ref, (got, ref)
    # Each fault answered by its cause, on its own step.
    steps = _steps(guard)
    assert steps[FAULTS["nan_batch"]] == ("skipped", "nonfinite_input")
    assert steps[FAULTS["inf_grad"]] == ("skipped", "nonfinite_grad")
    assert steps[FAULTS["bit_flip"]] == ("rolled_back", "nonfinite_param")
    assert steps[FAULTS["spike_batch"]] == ("skipped", "loss_spike")
    for i in FAULTS["bad_run"]:  # type: ignore[attr-defined]
        assert steps[i] == ("skipped", "nonfinite_input")
    not_applied = [s for s, (a, _) in steps.items() if a != "applied"]
    assert len(not_applied) == 12, not_applied  # nothing else was lost
    assert guard.rollbacks == 1 and not guard.events.of_kind("lr_backoff")
    faults = {f.step: f for f in guard.events.of_kind("fault")}
    assert (faults[40]["phase"], faults[40]["tensor"], faults[40]["deterministic"]) == (
        "input", "input[0]", True,
    )  # fmt: skip
    assert (faults[80]["phase"], faults[80]["module"], faults[80]["tensor"]) == (
        "param_grad", "2", "param:weight",
    )  # fmt: skip
    assert faults[80]["source"] is not None and "g * math.inf" in faults[80]["source"]
    assert (faults[120]["phase"], faults[120]["module"], faults[120]["tensor"]) == (
        "param", "0", "param:weight",
    )  # fmt: skip
    # The JSONL stream round-trips.
    kinds = [e.kind for e in guard.events.events]
    on_disk = list(read_events(tmp_path / "run.jsonl"))
    assert [e.kind for e in on_disk] == kinds
    first = json.loads((tmp_path / "run.jsonl").read_text().splitlines()[0])
    assert first["schema"] == 2 and "time" in first and first["rank"] == 0
    guard.close()


def test_the_three_call_loop_with_hooks_names_the_faults_without_replay() -> None:
    clean, _ = run(guarded=False, faults=False)
    guarded, guard = run(guarded=True, closure=False)
    assert guard is not None and guard.monitor is not None
    ref, got = eval_loss(clean), eval_loss(guarded)
    assert abs(got - ref) <= 0.05 * ref, (got, ref)
    steps = _steps(guard)
    assert steps[FAULTS["nan_batch"]] == ("skipped", "nonfinite_input")
    assert steps[FAULTS["bit_flip"]] == ("rolled_back", "nonfinite_param")
    faults = {f.step: f for f in guard.events.of_kind("fault")}
    assert (faults[40]["phase"], faults[40]["tensor"]) == ("input", "input[0]")
    assert faults[40]["deterministic"] is None  # not replayed
    guard.close()


def test_rollback_restores_the_snapshot_bit_identically() -> None:
    model, opt = make()
    guard = Guard(
        model,
        opt,
        response=ResponsePolicy(rollback_after=2, snapshot_every=5),
        spikes=SpikePolicy(watch_loss=False),
    )
    data = batches(12)
    for x, y in data[:11]:
        assert guard.step(lambda x=x, y=y: ((model(x) - y) ** 2).mean()).action == "applied"
    snap = guard.last_snapshot
    # taken before step 10 was applied: the weights of 10 applied steps
    assert snap is not None and snap.step == 10
    saved = {k: v.clone() for k, v in snap.states["model"].items()}
    x, y = data[11]
    with torch.no_grad():
        model[2].weight[1, 1] = math.nan  # a corrupted weight: rolled back on this step
    r = guard.step(lambda: ((model(x) - y) ** 2).mean())
    assert (r.action, r.reason) == ("rolled_back", "nonfinite_param")
    assert r.fault is not None and (r.fault.module, r.fault.tensor) == ("2", "param:weight")
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    assert opt.state_dict()["state"][0]["step"] == 10
    guard.close()


def test_stops_after_max_rollbacks() -> None:
    model, opt = make()
    guard = Guard(
        model, opt, response=ResponsePolicy(rollback_after=1, max_rollbacks=2, skip_batches=0)
    )
    x, y = batches(1)[0]
    with pytest.raises(GuardStopped, match="2 rollbacks did not restore") as ei:
        for _ in range(10):
            guard.backward(((model(x * math.nan) - y) ** 2).mean())
            guard.step()
    assert ei.value.report["rollbacks"] == 2
    assert guard.events.of_kind("stop")


def test_one_host_read_per_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, 16), nn.Tanh(), nn.Linear(16, D_OUT))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # SGD itself never syncs
    guard = Guard(model, opt, precision="fp16")
    x, y = batches(1)[0]
    for _ in range(3):
        with CountSyncs() as counter:
            with guard.autocast():
                loss = ((model(x).float() - y) ** 2).mean()
            guard.backward(loss)
            r = guard.step()
        # exact: the one read; deferred: none on a step it ran deferred
        deferred = guard.sync == "deferred" and not r.settled
        assert counter.calls == ([] if deferred else ["tolist"]), counter.calls


def test_fp16_overflow_backs_off_the_scale_and_skips() -> None:
    model, opt = make()
    guard = Guard(model, opt, precision="fp16", spikes=SpikePolicy(watch_loss=False))
    x, y = batches(1)[0]
    before = [p.clone() for p in model.parameters()]
    with guard.autocast():
        loss = ((model(x).float() - y) ** 2).mean() * 1e30  # scaled by 65536: overflows
    guard.backward(loss)
    r = guard.step()
    assert (r.action, r.reason, r.scale) == ("skipped", "overflow", 65536.0)
    assert guard.scaler.get_scale() == 32768.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.exact_only(
    "reads the scheduler right after step(); deferred, it steps when the step settles"
)
def test_lr_backoff_and_recovery_leave_the_scheduler_alone() -> None:
    model, opt = make()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000, gamma=0.5)
    guard = Guard(
        model, opt, scheduler=sched, spikes=SpikePolicy(watch_loss=False),
        response=ResponsePolicy(lr_backoff_after=2, lr_recovery_steps=4, rollback_after=10),
    )  # fmt: skip
    data = batches(10)
    for i, (x, y) in enumerate(data):
        if i in (2, 3):
            x = x * math.nan
        guard.backward(((model(x) - y) ** 2).mean())
        r = guard.step()
        if i == 3:
            assert r.lr_factor == 0.5
    assert guard.lr_factor == 1.0  # restored after 4 good steps
    assert opt.param_groups[0]["lr"] == 1e-2 and sched.last_epoch == 8


def test_bad_input() -> None:
    model, opt = make()
    with pytest.raises(ValueError, match="optimizer has no parameters"):
        Guard(model, torch.optim.SGD([{"params": []}], lr=0.1))
    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not the model's"):
        Guard(model, torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="precision='fp8'"):
        Guard(model, opt, precision="fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ResponsePolicy.rollback_after=0"):
        ResponsePolicy(rollback_after=0)
    with pytest.raises(ValueError, match=r"ClipPolicy.kind='l2'"):
        ClipPolicy(kind="l2")  # type: ignore[arg-type]
    g = Guard(model, opt)
    with pytest.raises(RuntimeError, match=r"call guard.backward"):
        g.step()
    g.close()
    split = nn.Linear(2, 2)  # a model on two devices (meta stands in for an accelerator)
    split.bias = nn.Parameter(torch.zeros(2, device="meta"))
    with pytest.raises(ValueError, match="several devices"):
        Guard(split, torch.optim.SGD(split.parameters(), lr=0.1))


def test_gradient_accumulation_keeps_every_micro_batch_visible() -> None:
    model, opt = make()
    guard = Guard(model, opt, spikes=SpikePolicy(watch_loss=False), watch="hooks")
    data = batches(4)
    for i in range(2):  # two optimizer steps of two micro-batches each
        losses = []
        for j in range(2):
            x, y = data[2 * i + j]
            if i == 1 and j == 0:
                x = x.clone()
                x[0, 0] = math.nan  # NaN in the first micro-batch of step 1
            loss = ((model(x) - y) ** 2).mean() / 2
            losses.append(float(loss.detach()))
            guard.backward(loss)
        r = guard.step()
        if i == 0:
            assert r.action == "applied"
            assert r.loss == pytest.approx(sum(losses) / 2, rel=1e-6)  # the mean loss
        else:
            # The NaN was in the first micro-batch; the monitor still names it.
            assert r.action == "skipped" and r.fault is not None
            assert (r.fault.phase, r.fault.tensor) == ("input", "input[0]")
    guard.close()


def _embedding_net(sparse: bool) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 4, sparse=sparse), nn.Flatten(), nn.Linear(12, 1))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_sparse_gradients_are_guarded_like_dense_ones(precision: str) -> None:
    """A sparse Embedding gradient is unscaled, measured and clipped as the dense
    gradient it stands for (token 1 appears twice: its rows are summed)."""
    runs = []
    for sparse in (False, True):
        net = _embedding_net(sparse)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        guard = Guard(net, opt, precision=precision)  # type: ignore[arg-type]
        results = []
        for _ in range(4):
            with guard.autocast():
                loss = net(torch.tensor([[1, 2, 1]])).float().sum() * 3
            guard.backward(loss)
            results.append(guard.step())
        runs.append((net, results))
    (dense, r_dense), (sparse_net, r_sparse) = runs
    assert any(r.action == "applied" for r in r_sparse)
    for a, b in zip(r_dense, r_sparse, strict=True):
        assert a.action == b.action and a.scale == b.scale
        if a.action == "applied":
            assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-6)
            assert a.clip_coef == pytest.approx(b.clip_coef, rel=1e-6)
    for p, q in zip(dense.parameters(), sparse_net.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_clipping_sparse_gradients_matches_dense() -> None:
    grads = {}
    for sparse in (False, True):
        net = _embedding_net(sparse)
        (net(torch.tensor([[1, 2, 1]])).sum() * 50).backward()
        norm = clip_grad_norm_(net.parameters(), 1.0)
        clip_grad_value_(net.parameters(), 0.01)
        g = net[0].weight.grad
        assert g is not None
        grads[sparse] = (float(norm), g.to_dense() if sparse else g)
    assert grads[True][0] == pytest.approx(grads[False][0], rel=1e-6)
    torch.testing.assert_close(grads[True][1], grads[False][1])


def test_a_sparse_fp16_gradient_whose_rows_sum_past_the_range_overflows() -> None:
    emb = nn.Embedding(10, 4, sparse=True).half()
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=1.0)
    (emb(torch.tensor([1, 1])).float() * 40000.0).sum().backward()  # rows: 40000 each
    g = emb.weight.grad
    assert g is not None and g.is_sparse and bool(torch.isfinite(g._values()).all())
    found = scaler.unscale_(opt)
    assert float(found) == 1.0  # 80000 > 65504 once summed
    scaler.update()
    assert scaler.last_overflow is not None and scaler.last_overflow["kind"] == "inf"


@pytest.mark.parametrize("nonfinite", ["skip", "zero"])
def test_clipping_a_non_finite_sparse_gradient(nonfinite: str) -> None:
    net = _embedding_net(True)
    (net(torch.tensor([[1, 2, 1]])).sum() * float("inf")).backward()
    norm = clip_grad_norm_(net.parameters(), 1.0, nonfinite=nonfinite)  # type: ignore[arg-type]
    assert not math.isfinite(float(norm))
    g = net[0].weight.grad
    assert g is not None and g.is_sparse
    if nonfinite == "zero":
        assert float(g.to_dense().abs().sum()) == 0.0
    else:
        assert not bool(torch.isfinite(g.to_dense()).all())


@pytest.mark.parametrize("bad", [-1, 0, float("nan"), float("inf"), True, "10"])
def test_a_bad_peer_timeout_is_refused_at_construction(bad: object) -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"peer_timeout_s=.*give a number of seconds > 0"):
        Guard(model, opt, peer_timeout_s=bad)  # type: ignore[arg-type]


def test_a_model_on_the_meta_device_is_refused_at_construction() -> None:
    model = nn.Linear(2, 1, device="meta")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"'weight' is on the meta device.*to_empty"):
        Guard(model, opt)
