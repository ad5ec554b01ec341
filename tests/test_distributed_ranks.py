"""The guard under DDP and FSDP2 on 2 and 4 gloo ranks (CPU, loopback): a fault on one
rank only is the same decision on every rank, named with its rank; one rank's exception
ends the others with a clear error, not a hang; a rank off by a step is caught."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from floatguard import Guard, ResponsePolicy, SpikePolicy
from floatguard.events import read_events

from ._ranks import run_ranks

pytestmark = pytest.mark.ranks

NAN_BATCH, NAN_WEIGHT, NAN_FORWARD = 5, 9, 13
STEPS = 16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _ddp_worker(rank: int, world: int, out: str, faulty: int) -> dict[str, Any]:
    torch.manual_seed(0)
    net = Net()
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = Guard(
        model, opt, log=os.path.join(out, f"run-rank{rank}.jsonl"),
        spikes=SpikePolicy(window=8, z=6.0, warmup=4), response=ResponsePolicy(snapshot_every=2),
    )  # fmt: skip
    g = torch.Generator().manual_seed(10 + rank)
    poison = {"on": False}

    def hook(m: nn.Module, a: Any, out_: torch.Tensor) -> torch.Tensor:
        return out_ * math.nan if poison["on"] else out_

    net.act.register_forward_hook(hook)
    results = []
    for step in range(STEPS):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        if rank == faulty and step == NAN_BATCH:
            x[0, 0] = math.nan  # a NaN batch on one rank only
        if rank == faulty and step == NAN_WEIGHT:
            with torch.no_grad():
                net.fc2.weight[0, 3] = math.nan  # a corrupted replica on one rank only
        poison["on"] = rank == faulty and step == NAN_FORWARD  # born in a module forward
        r = guard.step(lambda x=x, y=y: ((model(x) - y) ** 2).mean())
        results.append((r.action, r.reason, None if r.fault is None else r.fault.rank,
                        None if r.fault is None else r.fault.module))  # fmt: skip
    guard.close()
    return {"results": results, "params": [p.detach().clone() for p in net.parameters()]}


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_fault_on_one_rank_is_one_decision_everywhere(tmp_path: Path, world: int) -> None:
    faulty = world - 1
    res = run_ranks(_ddp_worker, world, tmp_path, faulty, timeout=180)
    for r in range(world):
        assert "results" in res[r], res[r]
    seq = res[0]["results"]
    for r in range(1, world):
        assert res[r]["results"] == seq  # the same action, reason, rank and module
        for a, b in zip(res[r]["params"], res[0]["params"], strict=True):
            assert torch.equal(a, b)  # bit-identical replicas after a skip and a rollback
    assert seq[NAN_BATCH] == ("skipped", "nonfinite_input", faulty, "")
    assert seq[NAN_WEIGHT] == ("rolled_back", "nonfinite_param", faulty, "fc2")
    assert seq[NAN_FORWARD][0] == "skipped" and seq[NAN_FORWARD][2:] == (faulty, "act")
    assert all(torch.isfinite(p).all() for p in res[0]["params"])
    applied = [s for s, (a, *_rest) in enumerate(seq) if a == "applied"]
    assert len(applied) >= STEPS - 4
    # Every rank logs the fault, with the rank it was born on and its own rank.
    logs = sorted(tmp_path.glob("ranks-*/run-rank*.jsonl"))
    assert len(logs) == world
    for path in logs:
        events = list(read_events(path))
        faults = {e.step: e for e in events if e.kind == "fault"}
        assert set(faults) == {NAN_BATCH, NAN_WEIGHT, NAN_FORWARD}
        assert {f.fields["fault_rank"] for f in faults.values()} == {faulty}
        assert len({e.rank for e in events}) == 1
    from typer.testing import CliRunner

    from floatguard.cli import app

    cli = CliRunner().invoke(app, ["report", *map(str, logs), "--out", str(tmp_path / "rep")])
    assert cli.exit_code == 0, cli.output
    page = (tmp_path / "rep" / "index.html").read_text()
    assert f"Ranks ({world})" in page and f"on <b>rank {faulty}</b>" in page
    assert page.count('<div class="card"><b>step') == 3  # each fault once, not once per rank


def _fsdp_worker(rank: int, world: int, out: str, watch: str) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net()
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(model, opt, spikes=SpikePolicy(window=8, z=6.0, warmup=4), watch=watch,
                  stats_every=3, response=ResponsePolicy(snapshot_every=2))  # fmt: skip
    g = torch.Generator().manual_seed(20 + rank)
    results = []
    for step in range(10):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        if rank == 1 and step == 4:
            x[2, 1] = math.inf
        if rank == 1 and step == 7:
            with torch.no_grad():  # this rank's shard of a weight goes bad
                model.fc1.weight.to_local()[0, 0] = math.nan  # type: ignore[operator]
        before = [p.full_tensor().clone() for p in model.parameters()]  # type: ignore[attr-defined]
        r = guard.step(lambda x=x, y=y: ((model(x) - y) ** 2).mean())
        after = [p.full_tensor() for p in model.parameters()]  # type: ignore[attr-defined]
        unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        norm = round(r.grad_norm, 5) if math.isfinite(r.grad_norm) else None
        results.append((r.action, r.reason, None if r.fault is None else r.fault.rank,
                        unchanged, norm))  # fmt: skip
    stats = len(guard.events.of_kind("stats"))
    guard.close()
    full = [p.full_tensor() for p in model.parameters()]  # type: ignore[attr-defined]
    return {
        "results": results,
        "stats": stats,
        "finite": all(bool(p.isfinite().all()) for p in full),
    }


@pytest.mark.parametrize("watch", ["replay", "hooks"])
def test_fsdp2_fault_on_one_rank(tmp_path: Path, watch: str) -> None:
    """FSDP2 (fully_shard) on 2 ranks, with sampled statistics (the hooks read each
    rank's shards, never a collective inside a hook): a bad input and one rank's bad
    shard are one decision everywhere, named with the rank."""
    res = run_ranks(_fsdp_worker, 2, tmp_path, watch, timeout=180)
    assert "results" in res[0] and "results" in res[1], res
    a, b = res[0]["results"], res[1]["results"]
    assert a == b  # same actions, reasons, faulting rank, global gradient norm
    assert a[4][:4] == ("skipped", "nonfinite_input", 1, True)  # nothing changed anywhere
    assert a[7][:3] == ("rolled_back", "nonfinite_param", 1)
    assert all(r[0] == "applied" and not r[3] for i, r in enumerate(a) if i not in (4, 7))
    assert res[0]["finite"] and res[1]["finite"] and res[0]["stats"] >= 2


def _raising_worker(rank: int, world: int, out: str, mode: str) -> dict[str, Any]:
    """Rank 1 raises in its closure at guard step 3. ``mode``: "plain" (the guard's own
    all-reduce), "ddp" (the read on DDP's all-reduce, through the guard's comm hook) or
    "own_hook" (DDP with the user's comm hook: a collective the guard does not own)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    net = Net()
    model: nn.Module = nn.parallel.DistributedDataParallel(net) if mode != "plain" else net
    if mode == "own_hook":
        model.register_comm_hook(None, default_hooks.allreduce_hook)  # type: ignore[operator]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    log = os.path.join(out, f"run-rank{rank}.jsonl")
    guard = Guard(model, opt, peer_timeout_s=60.0, log=log)
    x, y = torch.randn(8, 6), torch.randn(8, 1)

    def closure() -> torch.Tensor:
        if rank == 1 and guard.step_count == 3:
            time.sleep(1.0)  # rank 0 is inside its step (in DDP's backward) by now
            raise ValueError("a user error on rank 1")
        return ((model(x) - y) ** 2).mean()

    try:
        for _ in range(6):
            guard.step(closure)
    except Exception as e:
        outcome = (type(e).__name__, str(e), guard.step_count)
        if rank == 0:
            Path(out, "stopped0").touch()
        elif mode == "own_hook":
            time.sleep(3)  # alive a while: rank 0 stays blocked until this process ends
        else:  # alive until rank 0 stopped: it must not wait for this rank's exit
            while not Path(out, "stopped0").exists():
                time.sleep(0.01)
        return {"outcome": outcome}
    return {"outcome": None}


@pytest.mark.parametrize("mode", ["plain", "ddp"])
def test_one_ranks_exception_ends_the_others_with_a_clear_error(tmp_path: Path, mode: str) -> None:
    """Under DDP too: rank 0 waits in DDP's gradient all-reduce (the guard's comm hook),
    which the guard ends with rank 1's failure: PeerFailed out of the backward."""
    res = run_ranks(_raising_worker, 2, tmp_path, mode, timeout=90)
    name, msg, step = res[0]["outcome"]
    assert name == "PeerFailed" and step == 3
    assert "rank 1 failed at guard step 3 (ValueError: a user error on rank 1)" in msg
    assert res[1]["outcome"][0] == "ValueError"
    stops = [e for e in read_events(next(tmp_path.glob("ranks-*/run-rank0.jsonl")))
             if e.kind == "stop"]  # fmt: skip
    assert [(e.step, e.fields["reason"], e.fields["fault"]) for e in stops] == [
        (3, "peer_failed", msg)
    ]


def test_a_rank_blocked_in_a_collective_the_guard_does_not_own_hears_why(
    tmp_path: Path,
) -> None:
    """Rank 0 is inside DDP's gradient all-reduce run by the user's own comm hook (the
    default group: not the guard's), which rank 1 (raised in its forward) never joins:
    torch ends that wait when rank 1's process exits (or at the group's own timeout),
    and rank 0's guard explains it with rank 1's note: PeerFailed out of the backward,
    no thread of floatguard's and no forced exit."""
    res = run_ranks(_raising_worker, 2, tmp_path, "own_hook", timeout=90)
    name, msg, step = res[0]["outcome"]
    assert (name, step) == ("PeerFailed", 3)
    assert "rank 1 failed at guard step 3 (ValueError: a user error on rank 1)" in msg
    stops = [e for e in read_events(next(tmp_path.glob("ranks-*/run-rank0.jsonl")))
             if e.kind == "stop"]  # fmt: skip
    assert [(e.step, e.fields["reason"], e.fields["fault"]) for e in stops] == [
        (3, "peer_failed", msg)
    ]


def _desync_worker(rank: int, world: int, out: str, mode: str, ddp: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    net = Net()
    model: nn.Module = nn.parallel.DistributedDataParallel(net) if ddp else net
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    spikes = SpikePolicy(z=5.0 if (mode == "config" and rank == 1) else 6.0)
    guard = Guard(model, opt, distributed=True, spikes=spikes)
    x, y = torch.randn(8, 6), torch.randn(8, 1)
    try:
        for step in range(6):
            if mode == "step" and rank == 1 and step == 2:
                guard.step_count += 1  # as if this rank had made one more guard.step() call
            guard.step(lambda: ((model(x) - y) ** 2).mean())
    except Exception as e:
        return {"outcome": (type(e).__name__, str(e))}
    return {"outcome": None}


@pytest.mark.parametrize(
    ("mode", "ddp", "words"),
    [
        ("step", False, "not on the same guard step (rank 0 at guard step 2, rank 1 at "),
        ("config", False, "spikes.z is "),
        # under DDP the read rides on DDP's gradient all-reduce (the guard's comm hook)
        ("step", True, "not on the same guard step (rank 0 at guard step 2, rank 1 at "),
        ("config", True, "configured differently"),
    ],
)
def test_a_rank_on_another_step_or_configuration_stops_every_rank(
    tmp_path: Path, mode: str, ddp: bool, words: str
) -> None:
    res = run_ranks(_desync_worker, 2, tmp_path, mode, ddp, timeout=90)
    for r in (0, 1):
        name, msg = res[r]["outcome"]
        assert name == "GuardDesync" and words in msg


def test_the_fingerprint_ignores_memory_addresses() -> None:
    from floatguard.distributed import config_fingerprint

    class P:
        def __init__(self, f: object) -> None:
            self.f = f

        def __repr__(self) -> str:
            return f"P({self.f!r})"

    a, b = P(lambda: 1), P(lambda: 1)  # reprs differ only by address
    assert repr(a) != repr(b) and config_fingerprint(a) == config_fingerprint(b)
    assert config_fingerprint(("fp16", 1)) != config_fingerprint(("bf16", 1))


def test_the_packed_read_is_exact() -> None:
    """The step check and the norm combination, on the host (no processes)."""
    from floatguard.guard.step_check import encode, pack, unpack

    z = torch.zeros(())

    def summed(parts: list[torch.Tensor]) -> list[float]:
        return torch.stack(parts).sum(0).tolist()  # type: ignore[no-any-return]

    mine = encode(4095 + 4096 * 3, 77, 3, 53)
    four, nine, one, no = (
        torch.tensor(4.0),
        torch.tensor(9.0),
        torch.tensor(1.0),
        torch.tensor(False),
    )
    agreed = unpack(summed([pack(z, four, nine, one, no, r, mine) for r in range(3)]), 3, mine)
    # shards add up, replicas average
    assert agreed.grad_norm == pytest.approx(math.sqrt(3 * 4.0 + 9.0))
    assert agreed.loss == 1.0 and not agreed.found and agreed.bad_ranks == ()
    assert agreed.differs == ()
    # steps 100 and 100 + 4096: equal modulo 4096 (the old check), told apart now
    off = [pack(z, z, z, z, torch.tensor(r == 1), r, encode(100 + 4096 * (r == 2), 77, 3, 53))
           for r in range(3)]  # fmt: skip
    assert unpack(summed(off), 3, encode(100, 77, 3, 53)).differs == ("step",)
    cfg = [pack(z, z, z, z, z, r, encode(5, 77 + 2**40 * (r == 0), 3, 53)) for r in range(3)]
    assert unpack(summed(cfg), 3, encode(5, 77, 3, 53)).differs == ("configuration",)
    nan = torch.tensor(math.nan)
    bad = [pack(z, z, z, nan if r == 2 else z, torch.tensor(r == 2), r, encode(5, 1, 3, 53))
           for r in range(3)]  # fmt: skip
    a = unpack(summed(bad), 3, encode(5, 1, 3, 53))
    assert math.isnan(a.loss) and a.bad_ranks == (2,) and a.differs == ()


def _own_hook_worker(rank: int, world: int, out: str) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    net = Net()
    model = nn.parallel.DistributedDataParallel(net)
    model.register_comm_hook(None, default_hooks.allreduce_hook)  # the user's own hook
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(model, opt)
    g = torch.Generator().manual_seed(30 + rank)
    actions = []
    for step in range(6):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        if rank == 1 and step == 3:
            x[1, 1] = math.nan
        r = guard.step(lambda x=x, y=y: ((model(x) - y) ** 2).mean())
        actions.append((r.action, r.reason, None if r.fault is None else r.fault.rank))
    guard.close()
    return {"actions": actions}


def test_a_ddp_model_with_its_own_comm_hook_keeps_it(tmp_path: Path) -> None:
    """The guard's read rides on DDP's all-reduce only through its own comm hook; a model
    that has one already keeps it, and the guard all-reduces its read separately."""
    res = run_ranks(_own_hook_worker, 2, tmp_path, timeout=120)
    assert res[0]["actions"] == res[1]["actions"]
    assert res[0]["actions"][3] == ("skipped", "nonfinite_input", 1)


def _two_guards_worker(rank: int, world: int, out: str) -> dict[str, Any]:
    import copy

    import torch.distributed as dist

    torch.manual_seed(0)
    net = Net()
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(40 + rank)

    def run(guard: Guard, steps: int, nan_at: int) -> list[tuple[str, str | None, int | None]]:
        actions = []
        for step in range(steps):
            x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
            if rank == 1 and step == nan_at:
                x[2, 0] = math.nan
            r = guard.step(lambda x=x, y=y: ((model(x) - y) ** 2).mean())
            actions.append((r.action, r.reason, None if r.fault is None else r.fault.rank))
        return actions

    first = Guard(model, opt)
    before = run(first, 3, nan_at=1)
    first.close()
    # The closed guard's model trains under plain DDP: its gradient is DDP's average.
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
    local = copy.deepcopy(net)
    ((local(x) - y) ** 2).mean().backward()
    expected = [p.grad.div_(world) for p in local.parameters()]
    for e in expected:
        dist.all_reduce(e)
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    pairs = zip(model.parameters(), expected, strict=True)
    plain_ddp = all(torch.equal(p.grad, e) for p, e in pairs)
    opt.zero_grad()
    second = Guard(model, opt)  # on the same DDP model
    after = run(second, 4, nan_at=2)
    second.finish()
    second.close()
    return {"before": before, "after": after, "plain_ddp": plain_ddp}


def test_a_second_guard_on_the_same_ddp_model(tmp_path: Path) -> None:
    """DDP takes one comm hook per model, for good: the first guard's stays registered,
    runs DDP's default all-reduce once that guard is closed (a plain DDP step's gradient
    is exactly the ranks' average), and the next guard takes it over. Before, the
    closed guard's hook answered the second guard's steps: GuardDesync on every rank."""
    res = run_ranks(_two_guards_worker, 2, tmp_path, timeout=120)
    for r in (0, 1):
        assert res[r]["plain_ddp"], r
        assert res[r]["before"][1] == ("skipped", "nonfinite_input", 1), res[r]
        assert res[r]["after"][2] == ("skipped", "nonfinite_input", 1), res[r]
        assert [a for a, _, _ in res[r]["after"]] == ["applied", "applied", "skipped", "applied"]
    assert res[0] == res[1]
