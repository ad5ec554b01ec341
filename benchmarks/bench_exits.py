"""Clean distributed runs, many times: how many exit 0, and which floatguard threads
are alive during the run and after ``guard.close()`` (issue 38's acceptance measure).

Each run is a fresh 2-rank gloo group on loopback (two ``python -c`` processes, the
way torchrun starts them), an MLP guarded for 20 steps (``--layout ddp``: wrapped in
DDP; ``tp``: tensor parallel, ``ColwiseParallel`` then ``RowwiseParallel`` on a CPU
device mesh), ``finish()``, ``close()``, a barrier and ``destroy_process_group()``.
A run counts as clean when both processes exit 0. Printed: exit codes by count, and
the names of the threads whose name starts with ``floatguard`` seen mid-run and after
close (counted per rank and run).

    python benchmarks/bench_exits.py [--runs 100] [--layout ddp|tp|both]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = r"""
import json, os, sys, threading
import torch, torch.distributed as dist
from torch import nn
from floatguard import Guard
rank, init, out, layout = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
if layout == "ddp":
    model = nn.parallel.DistributedDataParallel(model)
else:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    mesh = init_device_mesh("cpu", (2,))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.05))
g = torch.Generator().manual_seed(rank if layout == "ddp" else 0)  # TP: the same batch
def ours():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("floatguard"))
during = []
for i in range(20):
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
    guard.step(lambda x=x, y=y: ((model(x) - y) ** 2).mean())
    if i == 10:
        during = ours()
guard.finish()
guard.close()
after = ours()
with open(out, "w") as f:
    json.dump({"during": during, "after": after}, f)
dist.barrier()
dist.destroy_process_group()
"""


def one_run(tmp: Path, layout: str) -> tuple[tuple[int, int], list[dict[str, list[str]]]]:
    init = tmp / "init"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                WORKER,
                str(r),
                str(init),
                str(tmp / f"threads{r}.json"),
                layout,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        for r in (0, 1)
    ]
    codes = []
    for p in procs:
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        codes.append(p.returncode)
    seen = []
    for r in (0, 1):
        f = tmp / f"threads{r}.json"
        seen.append(json.loads(f.read_text()) if f.exists() else {"during": [], "after": []})
    return (codes[0], codes[1]), seen


def measure(runs: int, layout: str) -> None:
    exits: collections.Counter[tuple[int, int]] = collections.Counter()
    during: collections.Counter[str] = collections.Counter()
    after: collections.Counter[str] = collections.Counter()
    start = time.monotonic()
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as d:
            codes, seen = one_run(Path(d), layout)
        exits[codes] += 1
        for s in seen:
            during.update(s["during"])
            after.update(s["after"])
    clean = exits.get((0, 0), 0)
    name = "DDP" if layout == "ddp" else "tensor-parallel"
    print(f"{runs} clean 2-rank {name} runs in {time.monotonic() - start:.0f} s")
    print(f"both ranks exit 0: {clean} of {runs}")
    for codes, n in sorted(exits.items()):
        print(f"  exit codes {codes}: {n}")
    print(f"floatguard threads mid-run (rank-runs): {dict(during) or 'none'}")
    print(f"floatguard threads after close() (rank-runs): {dict(after) or 'none'}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--layout", choices=["ddp", "tp", "both"], default="both")
    args = ap.parse_args()
    for layout in ["ddp", "tp"] if args.layout == "both" else [args.layout]:
        measure(args.runs, layout)


if __name__ == "__main__":
    main()
