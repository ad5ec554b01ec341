"""Memory over a long guarded run: RSS of a 200,000-step run of a tiny model with faults.

Every 997th batch is NaN, every 4,999th step a weight turns NaN (rolled back), every
3,001st batch is a loss spike; events go to a JSONL file (the in-memory ring keeps
the last 10,000), snapshots every 5 good steps (in memory; on disk every 1,000th
snapshot, 2 kept). Prints RSS every ``--every`` steps and the growth after warm-up.

    python benchmarks/bench_soak.py [--steps N] [--every K]
"""

from __future__ import annotations

import argparse
import math
import resource
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from floatguard import Guard, ResponsePolicy


def rss_mb() -> float:
    """Resident set size now (Linux /proc), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--every", type=int, default=20_000)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x_all, y_all = torch.randn(64, 8, 8), torch.randn(64, 8, 4)
    with tempfile.TemporaryDirectory() as tmp:
        guard = Guard(
            model, opt,
            response=ResponsePolicy(snapshot_dir=tmp, disk_every=1000),
            log=Path(tmp) / "run.jsonl",
        )  # fmt: skip
        print(f"# soak: {args.steps} guarded steps, tiny MLP, torch {torch.__version__}\n")
        print("| step | RSS MiB | events in memory | events written | rollbacks |")
        print("|---:|---:|---:|---:|---:|")
        start = time.perf_counter()
        curve = []
        for i in range(args.steps):
            x, y = x_all[i % 64], y_all[i % 64]
            if i % 997 == 996:
                x = x * math.nan
            if i % 3001 == 3000:
                y = y * 1e3
            if i % 4999 == 4998:
                with torch.no_grad():
                    model[0].weight[0, 0] = math.nan
            guard.step(lambda x=x, y=y: F.mse_loss(model(x), y))
            if (i + 1) % args.every == 0 or i == 0:
                rss = rss_mb()
                curve.append((i + 1, rss))
                written = sum(guard.events.counts.values())
                print(
                    f"| {i + 1} | {rss:.1f} | {len(guard.events.events)} | {written} | "
                    f"{guard.rollbacks} |",
                    flush=True,
                )
        guard.close()
        seconds = time.perf_counter() - start
    warm = next((r for s, r in curve if s >= args.every), curve[0][1])
    print(
        f"\nRSS growth after warm-up (step {args.every} to the end): "
        f"{curve[-1][1] - warm:+.1f} MiB; {seconds:.0f} s, "
        f"{seconds / args.steps * 1e6:.0f} us per guarded step"
    )


if __name__ == "__main__":
    main()
