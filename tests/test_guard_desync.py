"""Ranks out of step, on 2 gloo ranks (CPU, loopback), under DDP and with the guard's own
all-reduce: every desync and failure ends every surviving rank with the exact exception
(GuardDesync or PeerFailed), a message naming the rank, the step and what happened, and a
``stop`` event in its log. Every run is bounded by a hard timeout (``run_ranks``)."""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from floatguard import GuardDesync, PeerFailed, ResponsePolicy
from floatguard.events import read_events
from floatguard.guard import Guard

from ._ranks import run_ranks

pytestmark = pytest.mark.ranks

STEPS = 6  # batches per rank (the uneven cases give rank 1 fewer)
AT = 3  # the iteration where rank 1 goes wrong
IDLE_TIMEOUT_S = 2.0  # peer_timeout_s of the case that waits for a silent rank
TIMEOUT_S = 60.0  # of every other case (a generous bound, never reached)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _wait_for(path: Path) -> None:
    """Until the other rank wrote ``path`` (bounded: run_ranks' timeout kills a hang)."""
    while not path.exists():
        time.sleep(0.01)


def _worker(rank: int, world: int, out: str, case: str, ddp: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    net = Net()
    model: nn.Module = nn.parallel.DistributedDataParallel(net) if ddp else net
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(
        model, opt, log=os.path.join(out, f"run-rank{rank}.jsonl"),
        # 3 and 4: the fingerprints the old check compared modulo 16 were equal
        response=ResponsePolicy(max_rollbacks=3 + rank if case == "config" else 3),
        peer_timeout_s=IDLE_TIMEOUT_S if case == "idle" else TIMEOUT_S,
    )  # fmt: skip
    if case == "resumed" and rank == 1:
        guard.step_count += 16  # resumed from a checkpoint 16 steps later
    batches = 4 if case in ("uneven", "idle") and rank == 1 else STEPS
    g = torch.Generator().manual_seed(10 + rank)
    before = [p.detach().clone() for p in net.parameters()]
    try:
        for i in range(batches):
            x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                return ((model(x) - y) ** 2).mean()

            if rank == 1 and i == AT:
                if case == "skip":
                    continue  # one guard.step() call skipped
                if case == "extra":
                    guard.step(closure)  # one guard.step() call too many
                if case == "outside":  # a training step the guard does not see
                    closure().backward()
                    opt.step()
                    opt.zero_grad()
                    continue
                if case == "raise":
                    raise ValueError("rank 1's data loader failed")
                if case == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
            guard.step(closure)
        if case == "idle" and rank == 1:  # out of data, alive, silent: no finish() yet
            _wait_for(Path(out, "stopped0"))
        guard.finish()
    except (PeerFailed, GuardDesync) as e:
        Path(out, f"stopped{rank}").touch()
        return {"outcome": (type(e).__name__, str(e), e.ranks, e.step)}
    try:
        guard.step(lambda: ((model(x) - y) ** 2).mean())
        after_finish = "no error"
    except RuntimeError as e:
        after_finish = str(e)
    guard.close()
    moved = any(not torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    return {"outcome": None, "after_finish": after_finish, "moved": moved}


def _stops(out: Path, rank: int) -> list[dict[str, Any]]:
    return [
        {"step": e.step, **e.fields}
        for e in read_events(out / f"run-rank{rank}.jsonl")
        if e.kind == "stop"
    ]


# case, ddp, {rank: (exception, step, named ranks, words in its message)}; a rank not in
# the table died (its exit code is checked by the test).
Want = dict[int, tuple[str, int, tuple[int, ...], list[str]]]
CASES: list[tuple[str, bool, Want]] = [
    *[
        (
            "resumed",
            ddp,
            {
                0: ("GuardDesync", 0, (1,), ["rank 0 stops at guard step 0", "not on the same "
                    "guard step (rank 0 at guard step 0, rank 1 at guard step 16)"]),
                1: ("GuardDesync", 16, (1,), ["rank 1 stops at guard step 16", "not on the "
                    "same guard step (rank 0 at guard step 0, rank 1 at guard step 16)"]),
            },
        )
        for ddp in (True, False)
    ],
    *[
        (
            "config",
            ddp,
            {
                0: ("GuardDesync", 0, (1,), ["configured differently from rank 1's: "
                    "response.max_rollbacks is 3 on rank 0 and 4 on rank 1"]),
                1: ("GuardDesync", 0, (0,), ["configured differently from rank 0's: "
                    "response.max_rollbacks is 4 on rank 1 and 3 on rank 0"]),
            },
        )
        for ddp in (True, False)
    ],
    *[
        (
            "extra",  # rank 1 took 7 steps: at its 7th, rank 0 had finished after 6
            ddp,
            {
                0: ("GuardDesync", STEPS, (0,), ["rank 0 stops: rank 1 stopped at guard step 6",
                    "guard step 6, but rank 0 finished after 6 guard steps (guard.finish())"]),
                1: ("GuardDesync", STEPS, (0,), ["rank 1 ", "guard step 6, but rank 0 "
                    "finished after 6 guard steps (guard.finish())"]),
            },
        )
        for ddp in (True, False)
    ],
    *[
        (
            case,  # rank 1 took 5 / 4 steps, then finished; rank 0 went on
            ddp,
            {
                0: ("GuardDesync", n, (1,), [f"guard step {n}, but rank 1 finished after {n} "
                    "guard steps (guard.finish()): the ranks took different numbers"]),
                1: ("GuardDesync", n, (1,), [f"rank 1 stops: rank 0 stopped at guard step {n}",
                    f"but rank 1 finished after {n} guard steps"]),
            },
        )
        for case, n, ddp in (
            ("skip", STEPS - 1, True), ("skip", STEPS - 1, False), ("uneven", 4, True),
            ("uneven", 4, False),
            # no DDP: the step outside the guard had no collective; the guard steps paired
            # off in order, and rank 1 finished a step short
            ("outside", STEPS - 1, False),
        )
    ],
    (
        "outside",  # DDP: rank 1's backward outside the guard met rank 0's guard step 3
        True,
        {
            0: ("GuardDesync", AT, (1,), ["rank 0 stops at guard step 3: DDP's gradient "
                "all-reduce of this guard step met a backward that rank(s) 1 ran outside "
                "guard.step()"]),
            1: ("GuardDesync", AT, (1,), ["rank 1 stops: rank 0 stopped at guard step 3",
                "rank(s) 1 ran outside guard.step()"]),
        },
    ),
    *[
        (
            "idle",  # rank 1 ran out of data and stays alive without guard.finish()
            ddp,
            {
                0: ("PeerFailed", 4, (1,), [f"rank 0 stops: no answer within {IDLE_TIMEOUT_S:g} "
                    f"s in {what} of guard step 4 (Timed out waiting 2000ms",
                    "rank 1 does not answer", "monitored_barrier "
                    "found it missing", "A rank out of data must call guard.finish()"]),
                1: ("PeerFailed", 4, (1,), ["rank 1 stops: rank 0 stopped at guard step 4"]),
            },
        )
        for ddp, what in ((True, "DDP's gradient all-reduce"), (False, "the guard's step read"))
    ],
    *[
        (
            case,  # rank 1 raised outside its guard (its process ended), or was SIGKILLed:
            ddp,  # only its closed connection tells, and torch's barrier
            {0: ("PeerFailed", AT, (1,), ["rank 0 stops at guard step 3: rank 1 is gone "
                 f"(exited or killed): its connection closed in {what} (", "left no note and "
                 "did not pass torch.distributed.monitored_barrier"])},
        )
        for case in ("raise", "kill")
        for ddp, what in ((True, "DDP's gradient all-reduce"), (False, "the guard's step read"))
    ],
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "ddp", "want"), CASES, ids=[f"{c}-{'ddp' if d else 'allreduce'}" for c, d, _ in CASES]
)
def test_every_rank_stops_with_the_exact_error_and_a_stop_event(
    tmp_path: Path,
    case: str,
    ddp: bool,
    want: Want,
) -> None:
    res = run_ranks(_worker, 2, tmp_path, case, ddp, timeout=60)
    out = next(tmp_path.glob("ranks-*"))
    for rank in (0, 1):
        if rank not in want:  # the rank that raised or was killed
            code = -signal.SIGKILL if case == "kill" else 1
            assert res[rank].get("exitcode") == code, res[rank]
            continue
        assert "outcome" in res[rank], res[rank]
        name, msg, ranks, step = res[rank]["outcome"]
        exc, at, named, words = want[rank]
        assert (name, step, ranks) == (exc, at, named), (rank, name, step, ranks, msg)
        for w in words:
            assert w in msg, (rank, w, msg)
        reason = "desync" if exc == "GuardDesync" else "peer_failed"
        assert _stops(out, rank) == [{"step": at, "reason": reason, "fault": msg}]


@pytest.mark.parametrize("ddp", [True, False], ids=["ddp", "allreduce"])
def test_finish_ends_a_run_together(tmp_path: Path, ddp: bool) -> None:
    """Every rank after the same number of steps: finish() returns, no stop event, and
    the guard refuses a step after it."""
    res = run_ranks(_worker, 2, tmp_path, "clean", ddp, timeout=60)
    out = next(tmp_path.glob("ranks-*"))
    for rank in (0, 1):
        assert res[rank]["outcome"] is None, res[rank]
        assert res[rank]["moved"]
        assert res[rank]["after_finish"] == (
            "guard.step() after guard.finish(): the run ended after 6 guard steps"
        )
        assert _stops(out, rank) == []


@pytest.mark.parametrize("mantissa", [24, 53], ids=["float32", "float64"])
@pytest.mark.parametrize("world", [2, 3, 4, 35, 36, 64, 4095])
def test_the_step_check_is_exact(world: int, mantissa: int) -> None:
    """Steps and fingerprints the old check compared modulo 16 (or 4096) are told apart,
    whichever rank holds the odd one; equal ones agree; every sum is an exact integer."""
    from floatguard.guard.step_check import differing, encode, slot_count

    n = slot_count(world, mantissa)
    assert 0 < n <= 128 and all(len(encode(s, 3, world, mantissa)) == n for s in (0, 2**64 - 1))
    pairs = [(0, 16), (5, 5 + 4096), (7, 7 + 2**40), (2**63 - 1, 2**63 - 2), (0, 2**64 - 1)]
    for a, b in pairs:
        for what, (sa, fa), (sb, fb) in (
            ("step", (a, 1), (b, 1)),
            ("configuration", (1, a), (1, b)),
        ):
            odd = world // 2  # the rank that differs
            slots = [encode(sb, fb, world, mantissa) if r == odd else
                     encode(sa, fa, world, mantissa) for r in range(world)]  # fmt: skip
            summed = [sum(col) for col in zip(*slots, strict=True)]
            assert all(v < 2**mantissa and v == int(v) for v in summed)
            for r in (0, odd):  # every rank reaches the same verdict
                assert differing(summed, slots[r], world, mantissa) == (what,)
        same = encode(a, b, world, mantissa)
        assert differing([world * v for v in same], same, world, mantissa) == ()


def test_the_step_check_refuses_what_is_not_its_sum() -> None:
    from floatguard.guard.step_check import differing, encode, slot_count

    mine = encode(3, 4, 2, 24)
    assert differing([0.5, *mine[1:]], mine, 2, 24) == ("garbled",)
    assert differing([math.nan] * len(mine), mine, 2, 24) == ("garbled",)
    assert differing([3.0**15, *mine[1:]], mine, 2, 24) == ("garbled",)  # beyond 2 ranks' sums
    assert slot_count(2**24, 24) == 0  # no exact check in float32 beyond this world


_SCRIPT = """
import sys, torch, torch.distributed as dist
from torch import nn
from floatguard import Guard
rank, init, log = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2)
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(6, 1))
guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.05), log=log)
x, y = torch.randn(8, 6), torch.randn(8, 1)
for _ in range(4 if rank == 1 else 6):  # uneven data
    guard.step(lambda: ((model(x) - y) ** 2).mean())
guard.finish()
"""


def test_a_script_that_stops_exits_with_its_error_not_sigabrt(tmp_path: Path) -> None:
    """Two interpreters, as torchrun starts them (the multiprocessing ranks above skip
    the interpreter's teardown): uneven data ends both with the GuardDesync traceback
    and exit code 1, not gloo's SIGABRT at teardown with a collective left pending."""
    import subprocess
    import sys

    script = tmp_path / "uneven.py"
    script.write_text(_SCRIPT)
    init = tmp_path / "init"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def start(r: int) -> subprocess.Popen[str]:
        log = tmp_path / f"run-rank{r}.jsonl"
        args = [sys.executable, str(script), str(r), str(init), str(log)]
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env)  # fmt: skip

    procs = [start(0), start(1)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=90)[0])
    finally:
        for p in procs:
            p.kill()
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 1, (r, p.returncode, out[-2000:])
        assert "terminate called" not in out and "floatguard.distributed.GuardDesync" in out
        assert [e.fields["reason"] for e in read_events(tmp_path / f"run-rank{r}.jsonl")
                if e.kind == "stop"] == ["desync"]  # fmt: skip


def test_finish_without_torch_distributed_ends_the_run() -> None:
    model = nn.Linear(3, 1)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 3)
    guard.step(lambda: model(x).pow(2).mean())
    guard.finish()
    with pytest.raises(RuntimeError, match=r"guard.step\(\) after guard.finish\(\): the run ended "
                       "after 1 guard steps"):  # fmt: skip
        guard.step(lambda: model(x).pow(2).mean())
    assert guard.step_count == 1 and guard.events.of_kind("stop") == []


def test_a_closed_guard_refuses_steps_and_closes_once() -> None:
    """After close() (finish() or not) a step or a finish is refused at once, naming
    close; a second close() is a no-op; the parameters stay as the one step left them."""
    model = nn.Linear(3, 1)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 3)
    guard.step(lambda: model(x).pow(2).mean())
    after = [p.detach().clone() for p in model.parameters()]
    guard.close()
    with pytest.raises(RuntimeError, match=r"guard.step\(\) after guard.close\(\): the guard "
                       "ended after 1 guard steps"):  # fmt: skip
        guard.step(lambda: model(x).pow(2).mean())
    with pytest.raises(RuntimeError, match=r"guard.finish\(\) after guard.close\(\)"):
        guard.finish()
    guard.close()
    assert guard.step_count == 1
    assert all(torch.equal(a, p) for a, p in zip(after, model.parameters(), strict=True))


def _stage_worker(rank: int, world: int, out: str) -> dict[str, Any]:
    """Pipeline stages: each rank holds other parameters (not a supported layout)."""
    torch.manual_seed(rank)
    model = nn.Linear(6, 16) if rank == 0 else nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(model, opt, log=os.path.join(out, f"run-rank{rank}.jsonl"))
    x = torch.randn(8, 6 if rank == 0 else 16)
    try:
        guard.step(lambda: model(x).square().mean())
    except GuardDesync as e:
        return {"outcome": (type(e).__name__, str(e), e.ranks, e.step)}
    return {"outcome": None}


def test_pipeline_stages_are_refused_at_the_first_step(tmp_path: Path) -> None:
    res = run_ranks(_stage_worker, 2, tmp_path, timeout=60)
    for rank in (0, 1):
        name, msg, _ranks, step = res[rank]["outcome"]
        assert (name, step) == ("GuardDesync", 0), msg
        assert "parameter shapes" in msg, msg
