"""Guard(sync="deferred"): no host read on a healthy step, the same decisions as the exact
mode a step later, and a bad step that never moves a weight (issue 43)."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from floatguard import ClipPolicy, Guard, GuardStopped, ResponsePolicy, SpikePolicy

READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__")


class _ScalarReads(TorchDispatchMode):
    """aten._local_scalar_dense: what every scalar read of a tensor lowers to."""

    def __init__(self, log: list[tuple[str, str]]) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.log.append(("_local_scalar_dense", _who()))
        return func(*args, **(kwargs or {}))


def _who() -> str:
    """Who read: "floatguard" when a frame of the package is on the stack below the
    read (the optimizer's own reads come from torch/optim)."""
    frames = traceback.extract_stack()[:-2]
    for f in reversed(frames):
        if "/floatguard/" in f.filename and "/tests/" not in f.filename:
            return f"floatguard ({f.filename.rsplit('/', 1)[-1]}:{f.lineno})"
        if "/torch/optim/" in f.filename:
            return "torch.optim"
    return "other"


@contextmanager
def host_reads() -> Iterator[list[tuple[str, str]]]:
    """Every host read of a tensor made inside: the Tensor methods that read (patched,
    so the autograd engine's threads are seen too) and aten._local_scalar_dense."""
    log: list[tuple[str, str]] = []
    saved = {n: getattr(torch.Tensor, n) for n in READS}

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            log.append((name, _who()))
            return fn(*args, **kwargs)

        return call

    for n, fn in saved.items():
        setattr(torch.Tensor, n, counted(n, fn))
    try:
        with _ScalarReads(log):
            yield log
    finally:
        for n, fn in saved.items():
            setattr(torch.Tensor, n, fn)


def make(opt: str = "sgd", seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    if opt == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    if opt == "adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    if opt == "adamw_fused":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    if opt == "sgd_fused":
        return model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, fused=True)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1)


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(n)]


def closure(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: nn.functional.mse_loss(model(x), y)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_a_healthy_step_makes_no_host_read_in_deferred_mode(opt: str) -> None:
    """Counted, not claimed: every read of a tensor during guard.step(), attributed. The
    exact mode makes one per step (its packed read); the deferred mode none, but on the
    steps it runs exactly and names: the first (the optimizer has no state to gate yet)
    and the snapshot steps (their state is vetted in the read). AdamW's own reads of
    its step counter (torch.optim, a host tensor on CUDA) are the optimizer's."""
    counts: dict[str, list[int]] = {}
    for sync in ("exact", "deferred"):
        model, optimizer = make(opt)
        guard = Guard(model, optimizer, sync=sync)  # type: ignore[arg-type]
        assert guard.sync == sync
        ours = []
        for x, y in batches(23):
            snapshot_step = guard.last_snapshot  # (settles the previous step, outside)
            with host_reads() as log:
                guard.step(closure(model, x, y))
            del snapshot_step
            ours.append(sum(who.startswith("floatguard") for _, who in log))
            assert all(who in ("torch.optim",) or who.startswith("floatguard")
                       for _, who in log), log  # fmt: skip
        guard.close()
        counts[sync] = ours
    assert counts["exact"] == [1] * 23
    # the deferred steps: no read; the exact ones: the first (no optimizer state to gate
    # yet), then the snapshot steps, every snapshot_every (5) good steps
    exact_steps = [i for i, n in enumerate(counts["deferred"]) if n]
    assert exact_steps == [0, 5, 10, 15, 20], counts["deferred"]
    assert all(counts["deferred"][i] == 1 for i in exact_steps)


Batch = tuple[torch.Tensor, torch.Tensor]
Scenario = Callable[[int, Batch], Batch]


def same(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> bool:
    """Equal, field by field, a NaN equal to a NaN (the numbers are the same bits)."""

    def eq(u: Any, v: Any) -> bool:
        return u == v or (isinstance(u, float) and isinstance(v, float) and u != u and v != v)

    return len(a) == len(b) and all(
        len(r) == len(q) and all(eq(u, v) for u, v in zip(r, q, strict=True))
        for r, q in zip(a, b, strict=True)
    )


def _nan_input(i: int, b: Batch) -> Batch:
    return (b[0] * float("nan"), b[1]) if i in (6, 13) else b


def _spike(i: int, b: Batch) -> Batch:
    return (b[0], b[1] * 300) if i in (14, 19) else b


def _burst(i: int, b: Batch) -> Batch:
    return (b[0] * float("inf"), b[1]) if 9 <= i <= 12 else b


SCENARIOS: dict[str, Scenario] = {"nan input": _nan_input, "loss spike": _spike,
                                  "inf burst (rollback)": _burst}  # fmt: skip


Outcome = tuple[list[tuple[Any, ...]], list[torch.Tensor], list[str]]


def run(
    sync: Any, scenario: Scenario, opt: str, precision: Any = "fp32", clip: ClipPolicy | None = None
) -> Outcome:
    model, optimizer = make(opt)
    guard = Guard(
        model, optimizer, precision=precision, sync=sync, clip=clip,
        spikes=SpikePolicy(window=10, z=6.0), response=ResponsePolicy(rollback_after=3),
    )  # fmt: skip
    results = []
    for i, b in enumerate(batches(24)):
        results.append(guard.step(closure(model, *scenario(i, b))))
    guard.close()
    seen = [(r.step, r.action, r.reason, r.loss, r.grad_norm, r.clip_coef, r.lr_factor)
            for r in results]  # fmt: skip
    kinds = [e.kind for e in guard.events.events]
    return seen, [p.detach().clone() for p in model.parameters()], kinds


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_deferred_decides_what_exact_decides(name: str, opt: str) -> None:
    """The same actions, causes, numbers, events and final weights (bit for bit) as the
    exact mode: a step is decided a call later, never differently."""
    exact = run("exact", SCENARIOS[name], opt)
    deferred = run("deferred", SCENARIOS[name], opt)
    assert [r[1] for r in exact[0]] != ["applied"] * 24  # the scenario did something
    assert same(deferred[0], exact[0]), (deferred[0], exact[0])
    assert deferred[2] == exact[2]
    for a, b in zip(exact[1], deferred[1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("clip", [ClipPolicy(kind="norm", max_norm=0.5),
                                  ClipPolicy(kind="value", max_value=0.01), ClipPolicy()],
                         ids=["norm", "value", "zclip"])  # fmt: skip
def test_clipping_on_the_device_is_the_hosts_bit_for_bit(clip: ClipPolicy) -> None:
    exact = run("exact", _spike, "adam", clip=clip)
    deferred = run("deferred", _spike, "adam", clip=clip)
    assert same(deferred[0], exact[0]), (deferred[0], exact[0])
    assert any(r[5] != 1.0 for r in exact[0]) or clip.kind == "value"
    for a, b in zip(exact[1], deferred[1], strict=True):
        assert torch.equal(a, b)


def test_fp16_overflow_backs_off_the_scale_as_exact_mode() -> None:
    def overflow(i: int, b: Batch) -> Batch:
        return (b[0], b[1] * 3e4) if i in (8, 15) else b  # the scaled gradients overflow

    exact = run("exact", overflow, "adam", precision="fp16")
    deferred = run("deferred", overflow, "adam", precision="fp16")
    assert "overflow" in [r[2] for r in exact[0]]
    assert same(deferred[0], exact[0]), (deferred[0], exact[0])
    for a, b in zip(exact[1], deferred[1], strict=True):
        assert torch.equal(a, b)


def test_a_bad_step_moves_no_weight_before_the_host_has_looked() -> None:
    model, optimizer = make("adam")
    guard = Guard(model, optimizer, sync="deferred")
    data = batches(8)
    for x, y in data[:4]:
        guard.step(closure(model, x, y))
    guard.settle()
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in optimizer.state[model[0].weight].items()}
    x, y = data[4]
    result = guard.step(closure(model, x * float("nan"), y))
    assert not result.settled  # the host has not looked
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert all(torch.equal(state[k], v) for k, v in optimizer.state[model[0].weight].items())
    # answered when the next step begins (before it runs), or when the result is read
    assert result.action == "skipped" and result.reason == "nonfinite_input"
    assert result.settled
    guard.close()


def test_the_result_is_decided_at_the_next_call_without_a_read_of_it() -> None:
    model, optimizer = make()
    guard = Guard(model, optimizer, sync="deferred")
    results = [guard.step(closure(model, x, y)) for x, y in batches(7)]
    assert [r.settled for r in results] == [True] * 6 + [False]
    assert [r.step for r in results] == list(range(7))
    assert results[-1].action == "applied"
    guard.close()


def test_a_fault_is_localized_and_a_stop_raised_before_the_step_after_it() -> None:
    """A NaN born in a module's forward on step t: localized by replay when settled
    (the same fault as the exact mode names); a stop decided for step t is raised when
    step t+1 is asked for, before it runs, with the weights as they were."""

    class Bomb(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(8, 8)
            self.armed = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.inner(x)
            return y.log() if self.armed else y  # log of negatives: NaN born here

    faults = {}
    for sync in ("exact", "deferred"):
        torch.manual_seed(0)
        bomb = Bomb()
        model = nn.Sequential(bomb, nn.Linear(8, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        guard = Guard(model, optimizer, sync=sync,  # type: ignore[arg-type]
                      response=ResponsePolicy(rollback_after=1, max_rollbacks=1))  # fmt: skip
        data = batches(10)
        with pytest.raises(GuardStopped) as stopped:
            for i, (x, y) in enumerate(data):
                bomb.armed = i >= 4
                guard.step(closure(model, x, y))
        faults[sync] = (str(stopped.value.fault), stopped.value.report["step"], i,
                        [p.detach().clone() for p in model.parameters()])  # fmt: skip
        guard.close()
    assert faults["exact"][0] == faults["deferred"][0] and "born in 0 " in faults["exact"][0]
    assert faults["exact"][1] == faults["deferred"][1]
    # raised at the latest when the step after it is asked for (a step the guard runs
    # exactly, a snapshot step, raises in its own call), the model restored alike
    assert faults["exact"][2] <= faults["deferred"][2] <= faults["exact"][2] + 1
    assert all(torch.equal(a, b) for a, b in zip(faults["exact"][3], faults["deferred"][3],
                                                  strict=True))  # fmt: skip


def test_the_three_call_loop_and_gradient_accumulation_are_deferred_too() -> None:
    out = {}
    for sync in ("exact", "deferred"):
        model, optimizer = make("adam")
        guard = Guard(model, optimizer, sync=sync)  # type: ignore[arg-type]
        data = batches(12)
        for i in range(0, 12, 2):
            for x, y in data[i : i + 2]:  # two micro-batches
                with guard.autocast():
                    loss = nn.functional.mse_loss(model(x * (float("nan") if i == 6 else 1)), y)
                guard.backward(loss)
            guard.step()
        guard.close()
        out[sync] = (
            [e.kind for e in guard.events.events],
            [p.detach().clone() for p in model.parameters()],
        )
    assert out["exact"][0] == out["deferred"][0]
    assert all(torch.equal(a, b) for a, b in zip(out["exact"][1], out["deferred"][1], strict=True))


def test_bad_sync_settings_are_named() -> None:
    model, optimizer = make()
    with pytest.raises(ValueError, match="sync='later'"):
        Guard(model, optimizer, sync="later")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_three_call_loop_decides_what_exact_decides(name: str) -> None:
    """The caller runs the next forward before any guard call: the pending step is
    settled when that forward begins, so a rollback or a spike lands before it reads the
    weights (the watch="hooks" records of the step are still whole then)."""
    out = {}
    for sync in ("exact", "deferred"):
        model, optimizer = make("adam")
        guard = Guard(model, optimizer, sync=sync, watch="hooks",  # type: ignore[arg-type]
                      spikes=SpikePolicy(window=10, z=6.0),
                      response=ResponsePolicy(rollback_after=3))  # fmt: skip
        for i, b in enumerate(batches(24)):
            x, y = SCENARIOS[name](i, b)
            with guard.autocast():
                loss = nn.functional.mse_loss(model(x), y)
            guard.backward(loss)
            guard.step()
        guard.close()
        steps = [(e.step, e["action"], e["reason"]) for e in guard.events.of_kind("step")]
        out[sync] = (steps, [p.detach().clone() for p in model.parameters()])
    assert out["exact"][0] == out["deferred"][0]
    assert any(a != "applied" for _, a, _ in out["exact"][0])
    assert all(torch.equal(a, b) for a, b in zip(out["exact"][1], out["deferred"][1], strict=True))


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out += [v.clone() for v in optimizer.state[p].values() if isinstance(v, torch.Tensor)]
    return out


def _three_settled_steps(opt: str) -> tuple[Any, ...]:
    """A deferred guard with a LambdaLR scheduler after three steps, all settled: model,
    optimizer, scheduler, guard and the run's batches."""
    model, optimizer = make(opt)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9**s)
    guard = Guard(model, optimizer, scheduler=sched, sync="deferred")
    data = batches(10)
    for x, y in data[:3]:
        guard.step(closure(model, x, y))
    guard.settle()
    return model, optimizer, sched, guard, data


@pytest.mark.parametrize("where", ["optimizer.step", "scheduler.step (at settling)"])
def test_a_raise_in_a_deferred_step_leaves_no_trace(where: str) -> None:
    """Whole or not at all: an optimizer that raises mid-update (its copies put back), or
    a scheduler that raises when the host settles the step (the device's update undone,
    the step count and gradients as if the step had not begun)."""
    model, optimizer, sched, guard, data = _three_settled_steps("adam")
    before, count = _state(model, optimizer), guard.step_count
    boom = RuntimeError("injected")

    def fail(*a: Any, **k: Any) -> Any:
        raise boom

    x, y = data[3]
    if where == "optimizer.step":
        original = optimizer.step
        optimizer.step = fail  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match=r"deferred update raised .*injected.*put back"):
            guard.step(closure(model, x, y))
        optimizer.step = original  # type: ignore[method-assign]
    else:
        sched.step = fail  # type: ignore[method-assign]
        guard.step(closure(model, x, y))  # the device applied it; the host has not looked
        moved = _state(model, optimizer)
        assert not all(torch.equal(a, b) for a, b in zip(before, moved, strict=True))
        with pytest.raises(RuntimeError, match="injected"):
            guard.settle()
        del sched.step
    assert guard.step_count == count
    assert all(torch.equal(a, b) for a, b in zip(before, _state(model, optimizer), strict=True))
    assert all(p.grad is None for p in model.parameters())
    r = guard.step(closure(model, x, y))  # and the step then runs as it would have
    assert r.action == "applied"
    guard.close()


def test_batchnorm_statistics_of_a_bad_step_are_gated_before_the_host_looks() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = Guard(model, optimizer, sync="deferred")
    data = batches(9)
    for x, y in data[:7]:
        guard.step(closure(model, x, y))
    guard.settle()
    bn = model[1]
    before = [bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()]
    x, y = data[7]
    result = guard.step(closure(model, x * float("nan"), y))
    assert not result.settled
    now = [bn.running_mean, bn.running_var, bn.num_batches_tracked]
    assert all(torch.equal(a, b) for a, b in zip(before, now, strict=True))
    model.eval()
    with torch.no_grad():  # an evaluation between the steps (it does not settle)
        assert torch.isfinite(model(data[8][0])).all()
    assert not result.settled
    model.train()
    assert result.reason == "nonfinite_input"
    guard.close()


LOOP = """
def train(guard, model, data, crit):
    out = []
    for x, y in data:  # the closure reads the loop's variables when it is called
        out.append(guard.step(lambda: crit(model(x), y)))
    return [(r.action, r.reason) for r in out]
"""

SCRIPT = """
out = []
for x, y in data:  # module globals, as in a script
    out.append(guard.step(lambda: crit(model(x), y)))
result = [(r.action, r.reason) for r in out]
"""


@pytest.mark.parametrize("scope", ["function", "script"])
def test_a_closure_that_reads_the_loop_variables_replays_its_own_batch(scope: str) -> None:
    """docs/guard.md's first example binds its batch late: the step settles a call later,
    when ``x`` and ``y`` are the next batch's; the guard freezes the closure's
    variables when the step runs, so its replay sees its own batch (the cause is the
    exact mode's, not a clean "transient" replay of the next batch)."""
    causes = {}
    for sync in ("exact", "deferred"):
        model, optimizer = make("adam")
        guard = Guard(model, optimizer, sync=sync)  # type: ignore[arg-type]
        data = batches(10)
        data[6] = (data[6][0] * float("nan"), data[6][1])
        ns: dict[str, Any] = {"guard": guard, "model": model, "data": data,
                              "crit": nn.MSELoss()}  # fmt: skip
        if scope == "function":
            exec(LOOP, ns)
            causes[sync] = ns["train"](guard, model, data, nn.MSELoss())
        else:
            exec(SCRIPT, ns)
            causes[sync] = ns["result"]
        guard.close()
    assert causes["exact"][6] == ("skipped", "nonfinite_input")
    assert causes["deferred"] == causes["exact"]


def test_a_dropped_deferred_guard_lets_go_of_its_snapshot_folder(tmp_path: Any) -> None:
    """As in the exact mode, a guard dropped without close() is collected and lets go of
    its folder (its forward hook holds it weakly, a decided result not at all), so a
    crash-resume in the same process works; an unread result keeps its guard until it
    is read (it can still settle its step) or dropped."""
    import gc

    from floatguard import SnapshotFolderBusy

    model, optimizer = make("adam")
    response = ResponsePolicy(snapshot_dir=str(tmp_path / "snaps"), snapshot_every=2)
    guard = Guard(model, optimizer, sync="deferred", response=response)
    results = [guard.step(closure(model, x, y)) for x, y in batches(6)]
    unread = results.pop()
    assert not unread.settled and all(r.settled for r in results)
    del guard
    gc.collect()
    model2, optimizer2 = make("adam", seed=1)
    with pytest.raises(SnapshotFolderBusy):  # the unread step's guard is alive
        Guard(model2, optimizer2, sync="deferred", response=response).resume()
    assert unread.action == "applied"  # it settles, then lets its guard go
    del unread
    gc.collect()
    guard2 = Guard(model2, optimizer2, sync="deferred", response=response)
    assert guard2.resume() == 4  # the newest snapshot on disk
    guard2.close()
    hooks = [getattr(h, "__name__", "") for h in model._forward_pre_hooks.values()]
    assert "before_forward" not in hooks  # the dropped deferred stepper's hook went with it


def test_reading_a_stopped_steps_result_raises_the_stop() -> None:
    model, optimizer = make()
    guard = Guard(model, optimizer, sync="deferred",
                  response=ResponsePolicy(rollback_after=1, max_rollbacks=1))  # fmt: skip
    results = []
    with pytest.raises(GuardStopped) as stopped:
        for i, (x, y) in enumerate(batches(20)):
            if i >= 8:
                with torch.no_grad():
                    model[0].weight[0, 0] = float("nan")  # a bad weight, again and again
            results.append(guard.step(closure(model, x, y)))
    last = results[-1]
    with pytest.raises(GuardStopped) as again:
        _ = last.action
    assert again.value is stopped.value
    guard.close()


@pytest.mark.parametrize("opt", ["adamw_fused", "sgd_fused"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_fused_optimizer_skips_on_the_device_with_found_inf(name: str, opt: str) -> None:
    """torch's fused Adam/AdamW/SGD take found_inf and skip on the device: the deferred
    mode hands them ``not ok`` and keeps no copies (no spike detector the host could
    overrule the device with), with the exact mode's decisions and weights."""
    exact = run("exact", SCENARIOS[name], opt)
    deferred = run("deferred", SCENARIOS[name], opt)
    assert same(deferred[0], exact[0]), (deferred[0], exact[0])
    assert deferred[2] == exact[2]
    for a, b in zip(exact[1], deferred[1], strict=True):
        assert torch.equal(a, b)
    model, optimizer = make(opt)
    guard = Guard(model, optimizer, sync="deferred")
    for x, y in batches(4):
        guard.step(closure(model, x, y))
    update = guard._deferred.update  # the test looks inside: no copies were made
    assert update.fused() and update.uncopied and not update._buffers
    guard.close()


def test_plain_sgd_without_state_is_deferred_too() -> None:
    """An optimizer that keeps no state (SGD without momentum) is gated from its second
    step on, as the others: no read on those steps, the exact mode's weights."""
    torch.manual_seed(0)
    out = {}
    for sync in ("exact", "deferred"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        guard = Guard(model, optimizer, sync=sync)  # type: ignore[arg-type]
        reads = []
        for i, b in enumerate(batches(8)):
            with host_reads() as log:
                guard.step(closure(model, *_nan_input(i, b)))
            reads.append(sum(who.startswith("floatguard") for _, who in log))
        guard.close()
        out[sync] = (reads, [p.detach().clone() for p in model.parameters()])
    assert out["deferred"][0][2:5] == [0, 0, 0], out["deferred"][0]
    assert all(torch.equal(a, b) for a, b in zip(out["exact"][1], out["deferred"][1], strict=True))


def test_a_settling_that_raises_after_a_fused_update_says_it_stands() -> None:
    """A fused optimizer skips on the device and keeps no copies: when the host's
    bookkeeping raises after the device kept the update, the error is raised and a
    RuntimeWarning says the weights hold the update (it cannot be undone)."""
    model, _, sched, guard, data = _three_settled_steps("adamw_fused")

    def fail(*a: Any, **k: Any) -> Any:
        raise RuntimeError("injected")

    sched.step = fail  # type: ignore[method-assign]
    x, y = data[3]
    guard.step(closure(model, x, y))
    with pytest.warns(RuntimeWarning, match="cannot be undone"):
        with pytest.raises(RuntimeError, match="injected"):
            guard.settle()
    del sched.step
    guard.close()
