"""The distributed guard's per-step cost against plain DDP with GradScaler and clipping,
2 gloo ranks on CPU (loopback), measured in one run: interleaved rounds, median.

Contenders (each rank: a DDP-wrapped GPT, AdamW, fp16 autocast on CPU, batch per rank):

- peer: ``GradScaler.scale(loss).backward(); unscale_; clip_grad_norm_; step; update``
- the peer plus one all-reduce of 9 float64s: what one separate small collective per
  step costs on gloo (the floor of a design that adds one)
- ``Guard.step(closure)`` under DDP: the step's read (loss, bad-rank bit, step counter
  and fingerprint) carried on DDP's own last gradient bucket by the guard's comm hook,
  the one host read per step, ZClip, spike detection, snapshots every 5 steps, the
  peer channel's listener

The bench GPT (4 layers, d=128, T=128, batch 16 per rank) and a tiny GPT (1 layer, d=32,
T=16, batch 8), where fixed per-step costs show most. Figures are rank 0's (the ranks
step together).

    python benchmarks/bench_distributed.py [--steps N] [--rounds R]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from floatguard import Guard
from floatguard.demo import GPT, GPTConfig, synthetic_batch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _peer_loops import gradscaler_clip_step

MODELS = {
    "bench GPT": (GPTConfig(), 16),
    "tiny GPT": (GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32), 8),
}


Setup = tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]


def _setup(name: str, rank: int) -> Setup:
    cfg, batch = MODELS[name]
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(GPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = synthetic_batch(cfg, batch, generator=torch.Generator().manual_seed(rank))
    return model, opt, x, y


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def peer(name: str, rank: int) -> Callable[[], None]:
    model, opt, x, y = _setup(name, rank)
    return gradscaler_clip_step(model, opt, lambda: _loss(model, x, y))


def peer_plus_one(name: str, rank: int) -> Callable[[], None]:
    """The peer plus one all-reduce of 9 float64s per step: the floor of any design that
    decides from one small collective per step (what gloo's latency costs here)."""
    step = peer(name, rank)
    small = torch.zeros(9, dtype=torch.float64)

    def both() -> None:
        step()
        dist.all_reduce(small)

    return both


def guarded(name: str, rank: int) -> Callable[[], None]:
    model, opt, x, y = _setup(name, rank)
    guard = Guard(model, opt, precision="fp16")

    def step() -> None:
        guard.step(lambda: _loss(model, x, y))

    return step


def _worker(rank: int, world: int, init: str, out: str, steps: int, rounds: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    lines = []
    for name in MODELS:
        contenders = {"DDP + GradScaler + clip_grad_norm_": peer(name, rank),
                      "the same + one separate small all-reduce": peer_plus_one(name, rank),
                      "Guard.step(closure), distributed": guarded(name, rank)}  # fmt: skip
        times: dict[str, list[float]] = {k: [] for k in contenders}
        for fn in contenders.values():
            for _ in range(3):
                fn()  # warm-up
        for _ in range(rounds):
            for label, fn in contenders.items():
                dist.barrier()
                start = time.perf_counter()
                for _ in range(steps):
                    fn()
                times[label].append((time.perf_counter() - start) / steps * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        ref = med["DDP + GradScaler + clip_grad_norm_"]
        for label, ms in med.items():
            lines.append(f"| {name} | {label} | {ms:.2f} | {ms / ref:.3f}x |")
    if rank == 0:
        with open(out, "w") as fh:
            fh.write("\n".join(lines) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    tmp = tempfile.mkdtemp()
    out = os.path.join(tmp, "result.md")
    mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), out, args.steps, args.rounds),
             nprocs=2, join=True)  # fmt: skip
    print(f"# distributed guard benchmark: torch {torch.__version__}, 2 gloo ranks on CPU, "
          f"1 thread each, median of {args.rounds} interleaved rounds of {args.steps} "
          "steps\n")  # fmt: skip
    print("| model | contender | ms / step | vs peer |")
    print("|---|---|---:|---:|")
    with open(out) as fh:
        sys.stdout.write(fh.read())


if __name__ == "__main__":
    main()
