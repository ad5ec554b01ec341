"""The guard's added memory: peak resident memory of a 25M-parameter MLP trained with
AdamW, plain and under the guard with its snapshots in each place, each in a fresh
process (peak RSS growth over the process after the model, optimizer state and one
step exist). On a CPU host and device memory are the same, so ``snapshot_on="host"``
and ``"device"`` cost the same here: what the guard adds is one copy of weights and
moments (the snapshot, reused in place) plus its per-step saves; with
``snapshot_overlap=True`` (``host+overlap``) two copies, used in turn. On CUDA the device
side is measured by ``benchmarks/gpu_check.py`` (peak allocated with and without it).

    python benchmarks/bench_snapshot_memory.py [--steps N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, torch
from torch import nn
torch.manual_seed(0)
variant, steps = sys.argv[1], int(sys.argv[2])
model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(6)])  # 25.2M parameters
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(64, 2048)
def closure():
    return model(x).square().mean()
closure().backward(); opt.step(); opt.zero_grad(set_to_none=True)  # moments exist
def rss_mib():
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")  # reset the peak mark to the current RSS
base = rss_mib()
if variant == "plain":
    for _ in range(steps):
        closure().backward(); opt.step(); opt.zero_grad(set_to_none=True)
else:
    from floatguard import Guard, ResponsePolicy
    place, _, overlap = variant.partition("+")
    g = Guard(model, opt, response=ResponsePolicy(snapshot_on=place, snapshot_every=2,
                                                  snapshot_overlap=bool(overlap)))
    for _ in range(steps):
        g.step(closure)
state = sum(p.numel() * 4 * 3 for p in model.parameters()) / 2**20
print(json.dumps({"growth": rss_mib() - base, "state": state}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    print("| 25M-parameter MLP, AdamW, CPU | peak RSS growth MiB | weights + moments MiB |")
    print("|---|---:|---:|")
    for variant in ("plain", "device", "host", "host+overlap"):
        out = subprocess.run(
            [sys.executable, "-c", CHILD, variant, str(args.steps)],
            check=True,
            capture_output=True,
            text=True,
            env={"MALLOC_MMAP_THRESHOLD_": "65536", "PATH": "/usr/bin:/bin"},
        ).stdout
        r = json.loads(out.strip().splitlines()[-1])
        place, _, overlap = variant.partition("+")
        name = "plain loop" if variant == "plain" else f'Guard, snapshot_on="{place}"'
        if overlap:
            name += ", snapshot_overlap=True"
        print(f"| {name} | {r['growth']:.0f} | {r['state']:.0f} |")


if __name__ == "__main__":
    main()
