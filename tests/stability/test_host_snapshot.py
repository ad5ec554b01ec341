"""Host snapshots (issue 26.1): buffers in host memory, reused, an asynchronous copy with a
completion event, and the snapshot cadence a cost budget sets."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import nn

from floatguard import Guard, ResponsePolicy
from floatguard.stability._host_copy import HostCopy
from floatguard.stability.snapshot import Snapshot
from floatguard.stability.snapshot_cadence import MAX_INTERVAL, SnapshotCadence


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    return model, opt


def _tensors(states: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_flatten(states)[0] if isinstance(t, torch.Tensor)]


def test_a_host_snapshot_holds_copies_in_host_buffers_reused_in_place() -> None:
    model, opt = _trained()
    objs = {"model": model, "optimizer": opt}
    snap = Snapshot.capture(3, objs, on="host")
    assert snap.on == "host"
    live = _tensors({"m": model.state_dict(), "o": opt.state_dict()})
    kept = _tensors(snap.states)
    assert len(kept) == len(live)
    assert all(k.device.type == "cpu" for k in kept)
    assert not {k.data_ptr() for k in kept} & {t.data_ptr() for t in live}
    assert all(torch.equal(k, t) for k, t in zip(kept, live, strict=True))
    ptrs = [k.data_ptr() for k in kept]
    # train on, snapshot again into the same buffers
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    again = Snapshot.capture(4, objs, on="host", reuse=snap)
    assert again is snap and again.step == 4
    assert [k.data_ptr() for k in _tensors(again.states)] == ptrs
    live = _tensors({"m": model.state_dict(), "o": opt.state_dict()})
    assert all(torch.equal(k, t) for k, t in zip(_tensors(again.states), live, strict=True))
    assert again.copy_seconds() is not None  # a CPU copy is complete when capture returns


def test_a_host_snapshot_restores_bit_identical_state() -> None:
    model, opt = _trained()
    objs = {"model": model, "optimizer": opt}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in opt.state.values()]
    snap = Snapshot.capture(1, objs, on="host")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    for s in opt.state.values():
        s["exp_avg"].fill_(float("nan"))
    snap.restore(objs)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(
        torch.equal(s["exp_avg"], m) for s, m in zip(opt.state.values(), moments, strict=True)
    )
    # the restored optimizer state does not alias the snapshot's buffers
    kept = {t.data_ptr() for t in _tensors(snap.states)}
    assert not kept & {s["exp_avg"].data_ptr() for s in opt.state.values()}


def test_auto_keeps_cpu_state_where_it_is_and_a_bad_place_is_refused() -> None:
    model, opt = _trained()
    snap = Snapshot.capture(0, {"model": model, "optimizer": opt}, on="auto")
    assert snap.on == "device" and snap.copier is None
    with pytest.raises(ValueError, match="on='gpu'"):
        Snapshot.capture(0, {"model": model}, on="gpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="snapshot_on='gpu'"):
        ResponsePolicy(snapshot_on="gpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"snapshot_budget=1\.5"):
        ResponsePolicy(snapshot_budget=1.5)


class _Event:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name, self.complete, self.t = log, name, False, 0.0

    def record(self, stream: Any) -> None:
        self.log.append(f"record {self.name} on {stream}")

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.log.append(f"host waits for {self.name}")
        self.complete = True

    def elapsed_time(self, end: _Event) -> float:
        return (end.t - self.t) * 1e3  # milliseconds, as CUDA's


class _Stream:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")

    def wait_event(self, event: _Event) -> None:
        self.log.append(f"{self.name} waits for {event.name}")

    def __str__(self) -> str:
        return self.name


class _Runtime:
    """A CUDA stand-in: every source counts as on the accelerator."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.events: list[_Event] = []
        self.main = _Stream(self.log, "main")

    def asynchronous(self, src: list[torch.Tensor]) -> torch.device | None:
        return torch.device("cpu") if src else None

    def stream(self, device: torch.device) -> _Stream:
        self.log.append("new side stream")
        return _Stream(self.log, "side")

    def current_stream(self, device: torch.device) -> _Stream:
        return self.main

    def event(self) -> _Event:
        e = _Event(self.log, ["begin", "done"][len(self.events) % 2])
        self.events.append(e)
        return e

    def use(self, stream: _Stream) -> Any:
        self.log.append(f"copies on {stream}")
        return nullcontext()

    def keep(self, t: torch.Tensor, stream: _Stream) -> None:
        self.log.append(f"keep {tuple(t.shape)} for {stream}")


def test_the_copy_runs_on_a_side_stream_and_its_event_fences_and_waits() -> None:
    rt = _Runtime()
    copy = HostCopy(rt)  # type: ignore[arg-type]
    src = [torch.arange(4.0), torch.ones(2, 3)]
    dst = [torch.empty(4), torch.empty(2, 3)]
    copy.start(dst, src)
    assert rt.log == [
        "new side stream",
        "side waits for main",  # the step's values, not older ones
        "copies on side",
        "record begin on side",
        "record done on side",
        "keep (4,) for side",
        "keep (2, 3) for side",
    ]
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
    assert not copy.ready() and copy.seconds() is None  # in flight: nothing waits
    copy.fence()  # before the optimizer step: a device-side wait only
    assert rt.log[-1] == "main waits for done"
    begin, done = rt.events
    begin.t, done.t = 1.0, 1.25
    done.complete = True
    assert copy.ready() and copy.seconds() == pytest.approx(0.25)
    copy.start(dst, src)  # the next snapshot: same side stream, new events
    assert rt.log.count("new side stream") == 1
    copy.wait()
    assert rt.log[-1] == "host waits for done"


def _tick(c: SnapshotCadence, n: int, step_s: float) -> None:
    for i in range(n + 1):
        c.tick(now=i * step_s)


@pytest.mark.parametrize(
    "budget, copy_s, step_s, interval",
    [
        (None, 0.5, 0.01, 5),  # no budget: every snapshot_every good steps
        (0.01, 0.0001, 0.01, 5),  # cheap copies: the floor, snapshot_every
        (0.01, 0.005, 0.01, 50),  # 5 ms copy, 10 ms step, 1%: every 50 good steps
        (0.01, 0.0051, 0.01, 51),  # rounded up, never over the budget
        (0.05, 0.005, 0.01, 10),
        (0.01, 2.2, 1.0, 220),  # 7B on PCIe: 112 GB at ~50 GB/s, a 1 s step
        (0.01, 100.0, 0.01, MAX_INTERVAL),  # capped: a rollback loses at most that
    ],
    ids=["none", "floor", "50", "ceil", "5pct", "7b", "cap"],
)
def test_the_budget_sets_the_interval(
    budget: float | None, copy_s: float, step_s: float, interval: int
) -> None:
    c = SnapshotCadence(5)
    _tick(c, 10, step_s)
    c.budget = budget
    c.cost(copy_s)
    c.taken(10)
    assert c.interval == interval
    due = [g for g in range(11, 11 + 2 * MAX_INTERVAL) if c.due(g)]
    expected = 10 + interval if budget is not None else 15
    assert due[0] == expected


def test_without_a_budget_the_cadence_is_the_fixed_one_and_goes_back_after_a_rollback() -> None:
    c = SnapshotCadence(4)
    assert [g for g in range(0, 13) if c.due(g)] == [4, 8, 12]
    c.budget = 0.01
    _tick(c, 5, 0.01)
    c.cost(0.01)  # interval 100
    c.taken(12)
    assert not c.due(50) and c.due(112)
    assert c.due(8)  # good steps went back (a rollback restored the ladder): fixed cadence


def test_a_guard_with_host_snapshots_rolls_back_to_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(
        model, opt, response=ResponsePolicy(snapshot_every=2, snapshot_on="host"), clip=None
    )
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def closure() -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)

    fences: list[int] = []
    real_fence = Snapshot.fence

    def spy(self: Snapshot) -> None:
        fences.append(guard.step_count)
        real_fence(self)

    monkeypatch.setattr(Snapshot, "fence", spy)
    for _ in range(4):
        assert guard.step(closure).action == "applied"
    snap = guard.last_snapshot
    assert snap is not None and snap.on == "host" and snap.step == 2
    kept = {k: v.clone() for k, v in snap.states["model"].items()}
    assert fences == [1, 2, 3, 4]  # before every optimizer step
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    result = guard.step(closure)
    assert result.action == "rolled_back" and result.reason == "nonfinite_param"
    for k, v in model.state_dict().items():
        assert torch.equal(v, kept[k]), k
