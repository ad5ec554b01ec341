"""The guard under torchrun: a small GPT under DDP, one snapshot folder and one event log
per rank, elastic restarts resumed, and flags that inject faults (copy it as a start).

One machine, two processes (gloo on CPU; nccl, one GPU per process, when CUDA is there):

    torchrun --standalone --nproc-per-node=2 examples/torchrun_guard.py --out run \\
        --nan-batch 1:4 --nan-weight 0:8
    floatguard report run/rank*.jsonl --out run/report     # the ranks' agreed view

Several machines: the same command on every node, meeting at one rendezvous (with the
snapshot folders on a filesystem every node sees: after a restart a rank may be placed
on another node):

    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=node0:29400 --rdzv-id=job7 examples/torchrun_guard.py --out /shared/run

A worker that dies (``--kill 1:6``: rank 1 SIGKILLs itself at step 6, in the first
attempt only) ends the others with PeerFailed within seconds (or torchrun ends them
first); with ``--max-restarts=1`` torchrun starts the group again, every rank resumes
from the newest snapshot step that every rank has, and the run ends with the weights it
would have had uninterrupted (the data is a function of the step, and the guard restores
everything else):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node=2 \\
        --max-restarts=1 examples/torchrun_guard.py --out run --kill 1:6

(torchrun shares its rendezvous store with the workers, and the keys of a killed attempt
outlive it: a process group built again after the restart can read the dead workers'
addresses and fail to connect, about one restart in two here (pytorch/pytorch#135712);
that variable gives each attempt a store of its own.) Run alone (``python
examples/torchrun_guard.py``) it is one rank.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from floatguard import Guard, ResponsePolicy
from floatguard.demo import GPT, GPTConfig, synthetic_batch

CONFIG = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=32)
BATCH = 4  # sequences per rank and step


def rank_step(text: str) -> tuple[int, int]:
    """``"1:6"`` -> (rank 1, step 6), for the fault flags."""
    rank, _, step = text.partition(":")
    return int(rank), int(step)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="torchrun-guard", help="folder for logs and snapshots")
    p.add_argument("--steps", type=int, default=20, help="training steps")
    p.add_argument("--snapshot-every", type=int, default=5, help="good steps between snapshots")
    p.add_argument("--nan-batch", type=rank_step, help="RANK:STEP: a batch with a NaN loss mask")
    p.add_argument("--nan-weight", type=rank_step, help="RANK:STEP: a NaN weight on that replica")
    p.add_argument("--kill", type=rank_step, help="RANK:STEP: SIGKILL that worker (first attempt)")
    return p.parse_args()


def init_distributed(out: Path) -> torch.device:
    """torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), or one rank alone."""
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:  # run without torchrun: a group of one
        out.mkdir(parents=True, exist_ok=True)
        init = f"file://{(out / 'pg-init').resolve()}"
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=0, world_size=1)
    else:
        dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def warn_if_restarts_share_the_store() -> None:
    """Restarts asked for, with the rendezvous store shared: say how to launch instead."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        print("note: a restart may fail to reconnect with torchrun's shared store; launch "
              "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (pytorch/pytorch#135712)",
              file=sys.stderr, flush=True)  # fmt: skip


def batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of (step, rank): a resumed run sees what an uninterrupted one saw."""
    g = torch.Generator().manual_seed(1_000_003 * rank + step)
    x, y = synthetic_batch(CONFIG, BATCH, generator=g)
    return x.to(device), y.to(device)


def anyone_has_snapshots(folder: Path, device: torch.device) -> bool:
    """Whether any rank's folder holds a snapshot. guard.resume() is collective (the ranks
    agree on a step), so every rank must decide alike whether to call it."""
    mine = torch.tensor([float(any(folder.glob("snapshot-*.fgs")))], device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return bool(mine.item())


def weights_digest(model: nn.Module) -> str:
    """SHA-256 of every weight's bytes: equal digests are bit-identical replicas."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    device = init_distributed(out)
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts them too)
    net = GPT(CONFIG).to(device)
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    folder = out / "snapshots" / f"rank{rank}"  # one guard per folder: one folder per rank
    guard = Guard(
        model,
        opt,
        log=out / f"rank{rank}.jsonl",  # appended to after a restart
        response=ResponsePolicy(snapshot_dir=str(folder), snapshot_every=args.snapshot_every),
    )
    start = guard.resume() if anyone_has_snapshots(folder, device) else 0
    if rank == 0:
        print(f"world size {world}, attempt {attempt}, starting at step {start}", flush=True)
        if attempt == 0:
            warn_if_restarts_share_the_store()

    counts = {"applied": 0, "skipped": 0, "rolled_back": 0}
    for step in range(start, args.steps):
        if args.kill == (rank, step) and attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no exception, no cleanup
        x, y = batch(step, rank, device)
        mask = torch.ones_like(y, dtype=torch.float32)
        if args.nan_batch == (rank, step):
            mask[0, 0] = math.nan  # a corrupted loss mask, on this rank only
        if args.nan_weight == (rank, step):
            with torch.no_grad():
                net.blocks[0].mlp.fc.weight[0, 0] = math.nan  # this replica only

        def loss(x: Tensor = x, y: Tensor = y, mask: Tensor = mask) -> Tensor:  # its batch kept
            logits = model(x)
            per_token = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
            return (per_token * mask.flatten()).mean()

        result = guard.step(loss)  # the same decision on every rank
        counts[result.action] += 1
        if result.fault is not None and rank == 0:
            f = result.fault
            where = f"{f.module} ({f.phase})" if f.module else f"the {f.phase}"
            print(f"step {step}: {result.action}, {f.kind} in {where} on rank {f.rank}", flush=True)

    guard.finish()  # every rank took as many steps (else GuardDesync on every rank)
    guard.close()
    done = ", ".join(f"{v} {k}" for k, v in counts.items())
    print(f"rank {rank}: steps {start}..{args.steps} ({done}); weights {weights_digest(net)}",
          flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
