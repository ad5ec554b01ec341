"""The distributed guard's per-step cost against plain DDP with GradScaler and clipping,
2 gloo ranks on CPU (loopback), measured in one run: interleaved rounds, median.

Contenders (each rank: a DDP-wrapped GPT, AdamW, fp16 autocast on CPU, batch per rank):

- peer: ``GradScaler.scale(loss).backward(); unscale_; clip_grad_norm_; step; update``
- the peer plus one all-reduce of 9 float64s: what one separate small collective per
  step costs on gloo (the floor of a design that adds one)
- ``Guard.step(closure)`` under DDP: the step's read (loss, bad-rank bit, step counter
  and fingerprint) carried on DDP's own last gradient bucket by the guard's comm hook,
  the one host read per step, ZClip, spike detection, snapshots every 5 steps (the
  gradient all-reduce on the guard's group created with ``peer_timeout_s``; no thread)

The bench GPT (4 layers, d=128, T=128, batch 16 per rank) and a tiny GPT (1 layer, d=32,
T=16, batch 8), where fixed per-step costs show most. Figures are rank 0's (the ranks
step together).

Then DTensor layouts, fp32, AdamW, on an all-DTensor model (torch's ``clip_grad_norm_``
refuses DTensors mixed with plain tensors, or on two meshes): a residual MLP stack
(embedding, 4 blocks of LayerNorm + MLP with d=128, T=64, batch 8, a vocab-256 head)
with the MLPs column- then row-parallel, the head column-parallel, the embedding and
LayerNorms ``Replicate`` on the tp mesh:

- *tp=2*: 2 ranks, 1-D tensor parallelism;
- *dp=2 x tp=2*: 4 ranks (on this 2-core CPU: two processes a core), the same tp plan,
  then ``fully_shard`` over dp (torchtitan's layout: every parameter on the 2-D mesh).

Contenders: ``loss.backward(); torch.nn.utils.clip_grad_norm_(1.0); step`` (on DTensors:
its collectives), the same plus one small all-reduce, and ``Guard.step(closure)`` (its
read is one all-reduce of its own: no DDP bucket to ride; the norm by placement).

    python benchmarks/bench_distributed.py [--steps N] [--rounds R] [--only ddp|tp|2d]
        [--model "tiny GPT"]   (the DDP rows of one model only)
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


# ------------------------------------------------------------ DTensor layouts
TP_MODEL = {"vocab": 256, "d": 128, "blocks": 4, "T": 64, "batch": 8}


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.proj(F.gelu(self.fc(self.ln(x))))
        return out


class MLPStack(nn.Module):
    """Embedding, residual LayerNorm + MLP blocks, LayerNorm, head; returns logits."""

    def __init__(self, vocab: int, d: int, blocks: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(blocks))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for blk in self.blocks:
            x = blk(x)
        out: torch.Tensor = self.head(self.ln_f(x))
        return out


def _replicate(module: nn.Module, mesh: object) -> None:
    """``module``'s parameters as Replicate DTensors; plain tensors in and out."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def inputs(mod: nn.Module, args: tuple[torch.Tensor, ...], mesh: object) -> object:
        return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False) for a in args)

    def outputs(mod: nn.Module, out: DTensor, mesh: object) -> torch.Tensor:
        return out.to_local()

    distribute_module(module, mesh, input_fn=inputs, output_fn=outputs)  # type: ignore[arg-type]


def _tp_setup(layout: str, rank: int) -> Setup:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    c = TP_MODEL
    torch.manual_seed(0)
    model = MLPStack(c["vocab"], c["d"], c["blocks"])
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")) if layout == "2d" else None
    tp = mesh["tp"] if mesh is not None else init_device_mesh("cpu", (2,))
    plan: dict[str, object] = {"head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(c["blocks"]):
        plan[f"blocks.{i}.fc"], plan[f"blocks.{i}.proj"] = ColwiseParallel(), RowwiseParallel()
    parallelize_module(model, tp, plan)  # type: ignore[arg-type]
    for m in [model.tok, model.ln_f, *(b.ln for b in model.blocks)]:  # type: ignore[union-attr]
        _replicate(m, tp)
    data_rank = 0
    if mesh is not None:
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        data_rank = rank // 2  # the tp ranks of a dp group see the same batch
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(data_rank)
    x = torch.randint(0, c["vocab"], (c["batch"], c["T"]), generator=g)
    return model, opt, x, torch.roll(x, -1, dims=1)


def tp_peer(layout: str, rank: int) -> Callable[[], None]:
    model, opt, x, y = _tp_setup(layout, rank)

    def step() -> None:
        _loss(model, x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def tp_peer_plus_one(layout: str, rank: int) -> Callable[[], None]:
    step = tp_peer(layout, rank)
    small = torch.zeros(9, dtype=torch.float64)

    def both() -> None:
        step()
        dist.all_reduce(small)

    return both


def tp_guarded(layout: str, rank: int) -> Callable[[], None]:
    model, opt, x, y = _tp_setup(layout, rank)
    guard = Guard(model, opt)

    def step() -> None:
        guard.step(lambda: _loss(model, x, y))

    return step


_DDP_PEER = "DDP + GradScaler + clip_grad_norm_"
_TP_PEER = "clip_grad_norm_ on DTensors"
ROWS: dict[str, tuple[int, list[tuple[str, dict[str, Callable[[str, int], Callable[[], None]]]]]]]
ROWS = {
    "ddp": (2, [(name, {_DDP_PEER: peer,
                        "the same + one separate small all-reduce": peer_plus_one,
                        "Guard.step(closure), distributed": guarded}) for name in MODELS]),
    "tp": (2, [("tp=2", {_TP_PEER: tp_peer,
                         "the same + one separate small all-reduce": tp_peer_plus_one,
                         "Guard.step(closure), distributed": tp_guarded})]),
    "2d": (4, [("2d", {_TP_PEER: tp_peer,
                       "the same + one separate small all-reduce": tp_peer_plus_one,
                       "Guard.step(closure), distributed": tp_guarded})]),
}  # fmt: skip
_LABELS = {"tp=2": "MLP stack, tp=2", "2d": "MLP stack, dp=2 x tp=2"}


def _worker(
    rank: int, world: int, init: str, out: str, steps: int, rounds: int, which: str,
    model: str | None = None,
) -> None:  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    lines = []
    for name, makers in ROWS[which][1]:
        if model is not None and which == "ddp" and name != model:
            continue
        contenders = {label: make(name, rank) for label, make in makers.items()}
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
        ref = next(iter(med.values()))  # the peer
        for label, ms in med.items():
            lines.append(f"| {_LABELS.get(name, name)} | {label} | {ms:.2f} | {ms / ref:.3f}x |")
    if rank == 0:
        with open(out, "w") as fh:
            fh.write("\n".join(lines) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", choices=sorted(ROWS), default=None, help="one set of rows")
    parser.add_argument("--model", choices=sorted(MODELS), default=None, help="one DDP model")
    args = parser.parse_args()

    tmp = tempfile.mkdtemp()
    print(f"# distributed guard benchmark: torch {torch.__version__}, gloo ranks on CPU "
          f"(2, the dp x tp rows 4), 1 thread each, median of {args.rounds} interleaved "
          f"rounds of {args.steps} steps\n")  # fmt: skip
    print("| model | contender | ms / step | vs peer |")
    print("|---|---|---:|---:|")
    for which in [args.only] if args.only else list(ROWS):
        world = ROWS[which][0]
        out = os.path.join(tmp, f"result-{which}.md")
        init = os.path.join(tmp, f"init-{which}")
        mp.spawn(_worker, args=(world, init, out, args.steps, args.rounds, which, args.model),
                 nprocs=world, join=True)  # fmt: skip
        with open(out) as fh:
            sys.stdout.write(fh.read())
        sys.stdout.flush()


if __name__ == "__main__":
    main()
