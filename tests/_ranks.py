"""Run a function on N gloo ranks on CPU (loopback), every run bounded by a timeout.

The ranks are forked from a forkserver that imported torch and floatguard once (a spawn
imports them anew in every rank: seconds per run on a small machine); the server never
ran a torch op, so its forks start clean."""

from __future__ import annotations

import atexit
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

_CTX = mp.get_context("forkserver")
# torch._dynamo: imported by the first optimizer a process builds (seconds on its own)
_CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "floatguard"])


def _entry(
    rank: int, fn: Callable[..., Any], world: int, init: str, out: str, args: tuple,  # type: ignore[type-arg]
    pg_timeout_s: float | None,
) -> None:  # fmt: skip
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    # stderr to a file per rank, so a test can read what the watchdog said
    err = open(os.path.join(out, f"stderr{rank}.txt"), "w", buffering=1)
    os.dup2(err.fileno(), 2)
    limit = None if pg_timeout_s is None else timedelta(seconds=pg_timeout_s)
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=limit
    )
    try:
        result = fn(rank, world, out, *args)
    except BaseException as e:
        traceback.print_exc()  # into this rank's stderr file, for the test to show
        sys.stderr.flush()
        # As the interpreter does when a script's main raises (torchrun's ranks), which
        # multiprocessing's children skip: the error kept as sys.last_value, then the
        # atexit handlers.
        sys.last_value = e
        atexit._run_exitfuncs()
        raise
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    if isinstance(result, dict) and result.get("outcome") is not None:
        # A rank stopped mid-collective: the group is unusable (a collective was left
        # pending), as after any failure. Exit without tearing it down.
        os._exit(0)
    # Leave together: a rank tearing gloo down while a peer still talks to it can abort
    # the peer.
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    tmp: Path,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout_s: float | None = None,
) -> dict[int, Any]:
    """``fn(rank, world, out_dir, *args)`` on ``world`` processes; its return values by
    rank, or for a rank that died, ``{"exitcode": code, "stderr": text}``. A run past
    ``timeout`` seconds is killed and fails the test. ``pg_timeout_s``: the process
    group's own timeout (``init_process_group(timeout=...)``; None: torch's default)."""
    out = tmp / f"ranks-{time.monotonic_ns()}"
    out.mkdir()
    init = out / "init"
    ctx = mp.start_processes(
        _entry, args=(fn, world, str(init), str(out), args, pg_timeout_s), nprocs=world, join=False,
        start_method="forkserver",
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    for p in ctx.processes:
        p.join(max(0.1, deadline - time.monotonic()))
    alive = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
            p.join()
    if alive:
        raise AssertionError(f"ranks {alive} still running after {timeout} s: a hang")
    results: dict[int, Any] = {}
    for r, p in enumerate(ctx.processes):
        path = out / f"rank{r}.pt"
        err = (out / f"stderr{r}.txt").read_text() if (out / f"stderr{r}.txt").exists() else ""
        if p.exitcode == 0 and path.exists():
            results[r] = torch.load(path, weights_only=False)
        else:
            results[r] = {"exitcode": p.exitcode, "stderr": err}
    return results
