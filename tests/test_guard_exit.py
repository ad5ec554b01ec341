"""A rank's process ends cleanly after a good run, whatever its peers do meanwhile: no
receive of the peer channel is left pending while the interpreter finalizes (a message
arriving then woke the listener's thread inside gloo's wait, and the interpreter ended
that thread in the middle of C++ code: SIGABRT, "terminate called without an active
exception", about one torchrun launch of 2 nodes in ten on a loaded machine).

Two interpreters, as torchrun starts them (the at-exit handlers run, as in a script);
rank 0's teardown is made slow (an object whose finalizer sleeps), so a peer's message
would land inside it every time, not by chance."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = """
import sys, time, torch, torch.distributed as dist
from torch import nn
from floatguard import Guard

rank, init, how, late = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2)
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.05))
x, y = torch.randn(8, 4), torch.randn(8, 1)
for _ in range(3):
    guard.step(lambda: ((model(x) - y) ** 2).mean())
if how == "kill" and rank == 1:
    import os, signal
    os.kill(os.getpid(), signal.SIGKILL)
if how == "kill":
    time.sleep(late)  # rank 1 is gone before rank 0 asks (not killed after answering)
if how == "raise" and rank == 1:
    with guard:  # left by an error raised outside guard.step
        raise ValueError("bad batch file")
if how == "raise":
    time.sleep(late)
    try:
        guard.step(lambda: ((model(x) - y) ** 2).mean())
    except Exception as e:
        print(f"rank 0 stops: {type(e).__name__}: {e}", flush=True)
if rank == 1:
    time.sleep(late)  # rank 1 ends later than rank 0: its messages come after rank 0's end
if how in ("close", "destroy", "kill", "late"):
    guard.close()
if how == "destroy":  # the pattern of a training script's end (README)
    import threading
    alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("floatguard"))
    print(f"rank {rank} after close: {alive}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


class SlowTeardown:
    def __del__(self) -> None:  # runs while the interpreter finalizes
        time.sleep(3.0)


if rank == 0 and how != "late":
    teardown = SlowTeardown()
print(f"rank {rank} done", flush=True)
"""


def _run(tmp_path: Path, how: str, late: float) -> list[tuple[int, str]]:
    script = tmp_path / "ends.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "init"), how,
                          str(late)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=env)
        for r in (0, 1)
    ]  # fmt: skip
    ends = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=90)
            ends.append((p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return ends


@pytest.mark.parametrize(("how", "late"), [("close", 1.0), ("close", 4.0), ("exit", 4.0)])
def test_a_peers_later_end_does_not_abort_a_rank_in_teardown(
    tmp_path: Path, how: str, late: float
) -> None:
    """Rank 1 closes its guard (or, ``exit``, just exits: its at-exit handler tells the
    peers) ``late`` seconds after rank 0's: rank 0 waits for rank 1's bye (in its own
    guard.close(), or at exit), then finalizes with nothing pending, exit code 0 on
    both. At 4 s rank 1's listener has long had rank 0's bye and ended (it answers no
    question): rank 0 must not take that silence for a peer that is gone."""
    ends = _run(tmp_path, how, late=late)
    if late > 2:  # rank 0 says why it lingers: in its guard.close(), or at its exit
        where = "in guard.close()" if how == "close" else "at exit"
        said = f"floatguard: rank 0 waits {where} (at most 10 s) for rank(s) 1 to close"
        assert said in ends[0][1], ends[0][1]
    for rank, (rc, out) in enumerate(ends):
        assert "terminate called" not in out, out
        assert rc == 0 and f"rank {rank} done" in out, (rank, rc, out)


def test_close_returns_once_every_peer_said_bye(tmp_path: Path) -> None:
    """guard.close() waits for the peers' byes, so that nothing of the channel is left
    running when the script goes on to ``dist.barrier()`` and
    ``dist.destroy_process_group()``: rank 1 closes 1.5 s after rank 0, and when rank
    0's close returns, its threads (listener, watchdog, waiter) have ended (before, the listener was
    still in gloo's wait; the bye landing around the destroy aborted rank 0 about one
    run in thirty on a loaded machine, "terminate called without an active
    exception")."""
    ends = _run(tmp_path, "destroy", late=1.5)
    for rank, (rc, out) in enumerate(ends):
        assert "terminate called" not in out, out
        assert rc == 0 and f"rank {rank} done" in out, (rank, rc, out)
        alive = [line for line in out.splitlines() if line.startswith(f"rank {rank} after close")]
        assert alive == [f"rank {rank} after close: []"], out
    assert "floatguard: rank 0 waits in guard.close() (at most 10 s) for rank(s) 1" in ends[0][1]


def test_a_wait_given_up_in_close_is_not_waited_again_at_exit(tmp_path: Path) -> None:
    """Rank 1 closes 12 s after rank 0: rank 0's close waits 10 s, says it gives up,
    and its exit does not wait again (close and exit share the 10 s); both end with 0."""
    ends = _run(tmp_path, "late", late=12.0)
    out = ends[0][1]
    assert "floatguard: rank 0 waits in guard.close() (at most 10 s) for rank(s) 1" in out
    assert "floatguard: rank 0 stops waiting in guard.close() for rank(s) 1 after 10 s" in out
    assert "waits at exit" not in out, out
    assert [rc for rc, _ in ends] == [0, 0], ends


def test_close_does_not_wait_for_a_killed_peer(tmp_path: Path) -> None:
    """Rank 1 is killed (SIGKILL) after its steps; rank 0's close asks it where it is
    before saying bye (a live peer answers then: it has not had rank 0's bye, so its
    listener runs), takes the silence for a peer that is gone, and waits for nothing,
    in close or at exit."""
    ends = _run(tmp_path, "kill", late=1.0)
    rc, out = ends[0]
    assert rc == 0 and "rank 0 done" in out, out
    assert "waits in guard.close()" not in out and "waits at exit" not in out, out
    assert ends[1][0] == -9


def test_an_error_raised_outside_the_step_is_what_the_peers_hear(tmp_path: Path) -> None:
    """Rank 1 leaves ``with guard:`` by an error of its own (not in guard.step): rank 0
    stops at its next step with PeerFailed naming that error (before, close() told the
    peers rank 1 had finished, and rank 0 raised a GuardDesync)."""
    ends = _run(tmp_path, "raise", late=1.0)
    out = ends[0][1]
    said = ("rank 0 stops: PeerFailed: rank 0 begins guard step 3, but rank 1 exited after 3 "
            "guard steps without guard.finish() (ValueError: bad batch file)")  # fmt: skip
    assert said in out, out
    assert "ValueError: bad batch file" in ends[1][1] and ends[1][0] == 1, ends[1]
