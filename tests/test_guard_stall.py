"""A rank that stops making progress without failing (SIGSTOP, a stuck data loader) ends
every other rank with PeerFailed naming it, within the timeout + 5 s (``peer_timeout_s``
for the guard's own collectives, the process group's own timeout for DDP's buffer
broadcast), torch's monitored_barrier finding it missing, with a ``stop`` event in each
surviving rank's log; on 2 gloo ranks (CPU, loopback), every run bounded by a hard
timeout (``run_ranks``)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from floatguard import PeerFailed
from floatguard.events import read_events
from floatguard.guard import Guard

from ._ranks import run_ranks

pytestmark = pytest.mark.ranks

AT = 3  # the guard step before which rank 1 stalls
LIMIT_S = 2.0  # peer_timeout_s, and the process group's own timeout


class Net(nn.Module):
    """With a buffer, so DDP broadcasts buffers at every forward (a collective the guard
    does not own: the surviving rank waits there, in the step's region)."""

    def __init__(self, buffers: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.norm = nn.BatchNorm1d(16) if buffers else nn.Identity()
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def _stop_logged(log: Path) -> bool:
    return log.exists() and any(e.kind == "stop" for e in read_events(log))


def _worker(rank: int, world: int, out: str, case: str) -> dict[str, Any]:
    torch.manual_seed(0)
    ddp = case != "sigstop-allreduce"
    net = Net(buffers=ddp)
    model: nn.Module = nn.parallel.DistributedDataParallel(net) if ddp else net
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    logs = [Path(out, f"run-rank{r}.jsonl") for r in range(world)]
    guard = Guard(model, opt, log=str(logs[rank]), peer_timeout_s=LIMIT_S)
    g = torch.Generator().manual_seed(10 + rank)
    try:
        for i in range(6):
            x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
            if rank == 1 and i == AT:
                Path(out, "stalled").write_text(repr(time.time()))
                if case.startswith("sigstop"):
                    # killed once rank 0 logged its stop (bounded: 40 s at most)
                    killer = (
                        f"for i in $(seq 400); do grep -q '\"stop\"' {logs[0]} && break; "
                        f"sleep 0.1; done; kill -9 {os.getpid()}"
                    )
                    subprocess.Popen(["sh", "-c", killer], start_new_session=True)
                    os.kill(os.getpid(), signal.SIGSTOP)
                else:  # a stuck data loader: alive, answering, not stepping
                    while not _stop_logged(logs[0]):
                        time.sleep(0.05)
            guard.step(lambda x=x, y=y: ((model(x) - y) ** 2).mean())
        guard.finish()
    except PeerFailed as e:
        return {"outcome": (type(e).__name__, str(e), e.ranks, e.step)}
    guard.close()
    return {"outcome": None}


# case: the words of rank 0's stop message (DDP: rank 0 waits in DDP's buffer broadcast,
# a collective the guard does not own, until the process group's timeout; allreduce: in
# the guard's step read, until peer_timeout_s)
CASES = {
    "sigstop-ddp": ["rank 0 stops: no answer in a collective of the forward or backward of "
                    "guard step 3 (", "rank 1 does not answer", "monitored_barrier found it "
                    "missing", "init_process_group(timeout=...) bounds this wait"],
    "stuck-loader-ddp": ["rank 0 stops: no answer in a collective of the forward or backward "
                         "of guard step 3 (", "rank 1 does not answer", "a data loader",
                         "init_process_group(timeout=...) bounds this wait"],
    "sigstop-allreduce": ["rank 0 stops: no answer within 2 s in the guard's step read of "
                          "guard step 3 (Timed out", "rank 1 does not answer",
                          "Guard(peer_timeout_s=...) sets this limit"],
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_a_stalled_rank_ends_the_others_within_the_limit(tmp_path: Path, case: str) -> None:
    res = run_ranks(_worker, 2, tmp_path, case, timeout=90, pg_timeout_s=LIMIT_S)
    out = next(tmp_path.glob("ranks-*"))
    stops = [e for e in read_events(out / "run-rank0.jsonl") if e.kind == "stop"]
    assert len(stops) == 1, stops
    stop = stops[0]
    assert (stop.step, stop["reason"]) == (AT, "peer_failed")
    for w in CASES[case]:
        assert w in stop["fault"], (w, stop["fault"])
    name, msg, ranks, step = res[0]["outcome"]
    assert (name, ranks, step, msg) == ("PeerFailed", (1,), AT, stop["fault"])
    # within the limit: the timeout, then torch's monitored barrier (5 s at most); a
    # bound with slack for a loaded machine, far below gloo's 30 minutes
    stalled = float((out / "stalled").read_text())
    assert LIMIT_S <= stop.time - stalled < LIMIT_S + 5.0 + 10.0
    if case.startswith("sigstop"):
        assert res[1].get("exitcode") == -signal.SIGKILL, res[1]
    else:  # the loader came back: rank 1 stops with rank 0's error
        name, msg, ranks, step = res[1]["outcome"]
        assert name == "PeerFailed" and "rank 1 stops: rank 0 stopped at guard step 3" in msg


_STOPPED_PEER = """
import os, signal, sys, torch, torch.distributed as dist
from torch import nn
from floatguard import Guard
rank, init, log = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2)
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(6, 8), nn.Tanh(),
                                                          nn.Linear(8, 1)))
guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.05), log=log,
              peer_timeout_s=2)
x, y = torch.randn(8, 6), torch.randn(8, 1)
for i in range(6):
    if rank == 1 and i == 3:
        os.kill(os.getpid(), signal.SIGSTOP)
    guard.step(lambda: ((model(x) - y) ** 2).mean())  # rank 0 lets PeerFailed through
guard.finish()
"""


def test_a_rank_that_fails_exits_while_its_peer_is_stopped(tmp_path: Path) -> None:
    """Two interpreters, as torchrun starts them: rank 1 stops itself (SIGSTOP) in
    step 3; rank 0's PeerFailed (DDP's gradient all-reduce on the guard's timed group,
    ended by its timeout) ends its process with exit code 1 and the traceback: nothing
    is left pending for the interpreter's teardown to wait for."""
    import sys

    script = tmp_path / "stopped_peer.py"
    script.write_text(_STOPPED_PEER)
    init, logs = tmp_path / "init", [tmp_path / f"run-rank{r}.jsonl" for r in (0, 1)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(init), str(logs[r])],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for r in (0, 1)
    ]  # fmt: skip
    try:
        _out, err = procs[0].communicate(timeout=60)  # a hang before: far past this
        assert procs[1].poll() is None  # still stopped
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert procs[0].returncode == 1, err[-3000:]
    assert "Traceback" in err and "floatguard.distributed.PeerFailed: rank 0 stops" in err, err
    assert "rank 1 does not answer" in err, err
    assert "terminate called" not in err
    stops = [e for e in read_events(logs[0]) if e.kind == "stop"]
    assert [(e.step, e["reason"]) for e in stops] == [(AT, "peer_failed")], stops
