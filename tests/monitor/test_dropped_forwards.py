"""Forwards that get no backward (an evaluation with grad enabled, a common pattern) are
dropped from the step once their graph is gone, so they do not pile up; what a step's
forwards and backwards record is kept, and still localizes a fault exactly."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from floatguard import Fault, Guard, Monitor, SpikePolicy
from floatguard.demo import GPT, GPTConfig, synthetic_batch
from floatguard.monitor.hooks import Held

from .test_faults import NaNBackward
from .test_sync_free import CountSyncs

PROOFS = pytest.mark.parametrize("proofs", ["all", "off"])


def where(faults: list[Fault]) -> list[tuple[str, str, str, str]]:
    return [(f.module, f.phase, f.kind, f.tensor) for f in faults]


class Switch(nn.Module):
    """Identity, or a NaN born here in forward (log of a negative) or in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.fault: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fault == "forward":
            return torch.log(x - 100)
        if self.fault == "backward":
            return NaNBackward.apply(x)  # type: ignore[no-any-return]
        return x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.act = nn.GELU()
        self.bad = Switch()
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bad(self.act(self.inp(x))))


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
EXPECTED = {
    "forward": [("bad", "forward", "nan", "output[0]")],
    "backward": [("bad", "backward", "nan", "grad_input[0]")],
}


def _gpt() -> tuple[GPT, torch.Tensor, torch.Tensor]:
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=20)
    torch.manual_seed(0)
    x, y = synthetic_batch(cfg, 4, generator=torch.Generator().manual_seed(0))
    return GPT(cfg), x, y


def _val_loss(model: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _held_over_evaluations(
    mon: Monitor, forward: Callable[[], torch.Tensor], keep: bool, n: int = 200
) -> list[Held]:
    """``mon.held`` after each of ``n`` evaluation forwards with grad enabled; ``keep``:
    the loop's variable keeps the last loss (and its graph) alive, as a loop does."""
    held = []
    loss = None
    for _ in range(n):
        if keep:
            loss = forward()
            assert math.isfinite(loss.item())
        else:
            assert math.isfinite(forward().item())
        held.append(mon.held)
    del loss
    return held


def _assert_flat(held: list[Held]) -> None:
    """At most two forwards held (the one the loop still names, the one running),
    the same from the tenth on: not one more per forward."""
    one = held[0]
    assert one.records > 0 and one.slots > 0 and one.device_bytes > 0
    for h in held:
        assert h.records <= 2 * one.records
        assert h.slots <= 2 * one.slots
        assert h.awaited <= 2 * one.awaited
        assert h.device_bytes <= 2 * one.device_bytes
    assert held[-1] == held[10]


@PROOFS
@pytest.mark.parametrize("auto_step", [True, False])
@pytest.mark.parametrize("keep", [True, False], ids=["loss_kept", "loss_dropped"])
def test_grad_enabled_forwards_without_backward_do_not_pile_up(
    proofs: str, auto_step: bool, keep: bool
) -> None:
    """200 evaluation forwards with grad enabled hold at most the last two, not 200."""
    net = Net()
    net.eval()
    with Monitor(net, proofs=proofs, auto_step=auto_step) as mon:  # type: ignore[arg-type]
        _assert_flat(_held_over_evaluations(mon, lambda: net(X).pow(2).mean(), keep))


def test_a_gpt_validation_loop_with_grad_enabled_does_not_pile_up() -> None:
    """The reported case: a transformer's validation loss in eval mode without
    no_grad, under the guard's driving (auto_step=False)."""
    model, x, y = _gpt()
    model.eval()
    with Monitor(model, auto_step=False) as mon:
        _assert_flat(_held_over_evaluations(mon, lambda: _val_loss(model, x, y), True, n=100))


def test_dropping_makes_no_sync() -> None:
    """Dropping forwards (in the next forward's pre-hook) and reading ``held`` copy
    nothing to the host."""
    net = Net()
    with Monitor(net) as mon:
        alive = net(X).sum()
        with CountSyncs() as counter:
            for _ in range(5):
                alive = net(X).sum()  # each drops the one before last
                held = mon.held
            alive.backward()
            assert len(mon._rec.forwards) == 2  # the last two: the others were dropped
        assert counter.calls == []
    assert held.records > 0


def test_a_forward_without_a_graph_is_dropped() -> None:
    """Grad enabled, but nothing requires grad (a frozen model): no backward can come."""
    model, x, y = _gpt()
    model.requires_grad_(False)
    with Monitor(model, auto_step=False) as mon:
        _val_loss(model, x, y)
        first = mon.held
        assert first.records > 0 and first.awaited == 0
        for _ in range(20):
            _val_loss(model, x, y)
            assert mon.held == first  # the previous forward dropped, this one recorded


@PROOFS
@pytest.mark.parametrize("fault", ["forward", "backward"])
@pytest.mark.parametrize("auto_step", [True, False])
def test_a_fault_after_dropped_forwards_is_localized(
    proofs: str, fault: str, auto_step: bool
) -> None:
    """After 50 evaluation forwards (their parameter records aliased, then dropped and
    renumbered), a training step's NaN is localized as on a fresh monitor."""
    net = Net()
    with Monitor(net, proofs=proofs, auto_step=auto_step) as mon:  # type: ignore[arg-type]
        net.eval()
        for _ in range(50):
            net(X).sum().item()
        assert mon.faults == []
        net.train()
        net.bad.fault = fault
        net(X).sum().backward()
        after = where(mon.faults)
        assert bool(mon.found_nonfinite)
    net.zero_grad()
    with Monitor(net, proofs=proofs) as fresh:  # type: ignore[arg-type]
        net(X).sum().backward()
    assert after == where(fresh.faults) == EXPECTED[fault]


@PROOFS
def test_micro_batches_whose_graph_is_gone_are_kept_until_the_step(proofs: str) -> None:
    """Gradient accumulation driven by next_step (as the guard does): the first micro-
    batch's graph is freed by its backward, yet its records stay for the step, through
    evaluation forwards (dropped) and the second micro-batch."""
    net = Net()
    with Monitor(net, proofs=proofs, auto_step=False) as mon:  # type: ignore[arg-type]
        net.bad.fault = "forward"
        net(X).sum().backward()  # micro-batch 1: a NaN born in forward
        net.bad.fault = None
        one = mon.held
        for _ in range(10):
            net(X).sum().item()  # evaluation, grad enabled
        net(X).sum().backward()  # micro-batch 2, clean
        two = mon.held
        for _ in range(10):
            net(X).sum().item()
        ten = mon.held
        for _ in range(10):
            net(X).sum().item()
        assert mon.held == ten  # the evaluations come and go (the last one stays)
        assert one.records < two.records < ten.records < two.records + one.records
        assert where(mon.faults) == EXPECTED["forward"]
        mon.next_step()
        assert mon.held == Held(0, 0, 0, 0)


@PROOFS
def test_forwards_before_one_backward_are_kept(proofs: str) -> None:
    """Several forwards before one backward (their graphs alive until it): none is
    dropped, and a NaN in the first is found."""
    net = Net()
    with Monitor(net, proofs=proofs) as mon:  # type: ignore[arg-type]
        net.bad.fault = "forward"
        first = net(X).sum()
        net.bad.fault = None
        rest = [net(X).sum() for _ in range(3)]
        (first + sum(rest)).backward()
        assert where(mon.faults) == EXPECTED["forward"]


@pytest.mark.parametrize("fault", [None, "backward"])
def test_a_live_forward_is_renumbered_with_its_frames(fault: str | None) -> None:
    """Dropping evaluation forwards renumbers the slots of a later forward still waiting
    for its backward: each of its frames still reads its own call's input and parameters,
    and its backward is proved and localized as on a fresh monitor."""
    net = Net()
    names = {id(m): n for n, m in net.named_modules()}

    def run(mon: Monitor, evaluations: int) -> list[tuple[str, str, str, str]]:
        alive = [net(X.clone()).sum() for _ in range(evaluations)]  # graphs kept for now
        net.bad.fault = fault
        first = net(X.clone()).sum()  # a new input: its slots come after theirs
        net.bad.fault = None
        alive.clear()  # the evaluations' graphs are gone: they will get no backward
        second = net(X.clone()).sum()  # its start drops them, renumbering the first
        for f in mon._rec.forwards[0].frames:
            own = {
                (r.paths[0][0][-1], r.paths[0][1])
                for r in mon._rec.book.records
                if r.slot in f.deps
            }
            assert (names[id(f.module)], "input[0]") in own
            if isinstance(f.module, nn.Linear):
                assert (names[id(f.module)], "param:weight") in own
        (first + second).backward()
        return where(mon.faults)

    with Monitor(net) as mon:
        got = run(mon, evaluations=5)
        assert mon._rec.forwards[0].start == 0  # the evaluations were dropped
        assert len(mon._rec.forwards[0].frames) == 3  # inp, act and out
    net.zero_grad()
    with Monitor(net) as fresh:
        assert run(fresh, evaluations=0) == got
    assert got == ([] if fault is None else EXPECTED["backward"])


def test_guard_with_hooks_and_grad_enabled_evaluation() -> None:
    """Guard(watch="hooks"): evaluation forwards with grad enabled between steps hold
    nothing for long, and a NaN in a later step's input is still named."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, opt, spikes=SpikePolicy(watch_loss=False), watch="hooks")
    assert guard.monitor is not None
    y = torch.zeros(4, 2)
    peak = []
    for step in range(3):
        model.eval()
        for _ in range(50):
            val = ((model(X) - y) ** 2).mean()
            assert math.isfinite(val.item())
            peak.append(guard.monitor.held.records)
        model.train()
        x = X.clone()
        if step == 2:
            x[0, 0] = math.nan
        guard.backward(((model(x) - y) ** 2).mean())
        r = guard.step()
        if step < 2:
            assert r.action == "applied"
    assert r.action == "skipped" and r.fault is not None
    assert (r.fault.phase, r.fault.tensor) == ("input", "input[0]")
    assert max(peak) <= 2 * peak[0]
    guard.close()
