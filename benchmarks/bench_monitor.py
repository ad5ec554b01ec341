"""Monitor overhead on a small GPT training step, against the unmonitored step, in one run.

GPT: 4 layers, d=128, T=128, batch 16, on CPU; a step is forward + cross-entropy +
backward + SGD update. Contenders, each timed as the median over interleaved
rounds (so drift on a shared machine hits every contender alike):

- floatguard sentinel (default: proofs="all", outputs and gradients), with
  proofs="forward" (gradients read), and reading every tensor (``proofs=False``)
- floatguard stats on every step, and sampled every 10th and 100th step (the modules'
  hooks are on only on sampled steps; one monitor for the run, so the sampled steps
  fall among the timed ones in proportion; on CPU with the one-pass C kernel when a
  compiler is available; the header says which)
- torch.autograd.detect_anomaly
- a naive forward hook that calls ``.isnan().any().item()`` on every module output
- the monitor's hook wiring with no check in it (module pre/post hooks, input views
  with gradient hooks, autograd-node hooks, parameter hooks): the floor under any
  design that watches every module in both passes from Python

    python benchmarks/bench_monitor.py [--steps N] [--rounds R] [--tuned-malloc]

On a CPU the monitor's cost depends on glibc's allocator: keeping tensors (as the
proofs do) or not changes when freed memory is returned to the OS and faulted back
in. ``--tuned-malloc`` re-runs with glibc told to keep freed memory, for every
contender alike, which shows the compute cost without that effect.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
import torch.nn.functional as F

from floatguard import Monitor, _native
from floatguard.demo import GPT, GPTConfig, synthetic_batch


def make() -> tuple[GPT, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = synthetic_batch(cfg, 16, generator=torch.Generator().manual_seed(0))
    return model, opt, x, y


def step(model: GPT, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    opt.step()


@contextmanager
def nothing(model: GPT) -> Iterator[None]:
    yield


@contextmanager
def sentinel(model: GPT) -> Iterator[None]:
    with Monitor(model):
        yield


@contextmanager
def sentinel_reads(model: GPT) -> Iterator[None]:
    with Monitor(model, proofs=False):
        yield


@contextmanager
def sentinel_forward(model: GPT) -> Iterator[None]:
    with Monitor(model, proofs="forward"):
        yield


def stats_every(k: int) -> Callable[[GPT], AbstractContextManager[None]]:
    """One monitor for the whole run, attached for each timed block: its step count
    goes on across blocks, so every k-th step of the run is sampled (and timed)."""
    monitors: dict[int, Monitor] = {}

    @contextmanager
    def ctx(model: GPT) -> Iterator[None]:
        mon = monitors.setdefault(id(model), Monitor(model, mode="stats", every=k))
        mon.attach()
        try:
            yield
        finally:
            mon.detach()

    return ctx


@contextmanager
def anomaly(model: GPT) -> Iterator[None]:
    with torch.autograd.detect_anomaly():
        yield


def _nothing(*args: object) -> None:
    return None


@contextmanager
def hook_floor(model: GPT) -> Iterator[None]:
    """The monitor's hook wiring with no check in it: a pre-hook handing each module a
    view of its inputs (with a gradient hook), a post-hook putting a pre-hook on each
    output's autograd node, a hook on every parameter. What any per-module,
    both-pass design pays before it reads a single value."""

    def pre(mod: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
        if not torch.is_grad_enabled():
            return None
        views = []
        for a in args:
            if isinstance(a, torch.Tensor) and a.requires_grad:
                a = a.view_as(a)
                a.register_hook(_nothing)
            views.append(a)
        return tuple(views), kwargs

    def post(mod: torch.nn.Module, args: object, kwargs: object, out: object) -> None:
        if isinstance(out, torch.Tensor) and out.grad_fn is not None:
            out.grad_fn.register_prehook(_nothing)

    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True, always_call=True))
    handles += [p.register_hook(_nothing) for p in model.parameters()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def naive_hooks(model: GPT) -> Iterator[None]:
    def hook(module: torch.nn.Module, args: object, out: object) -> None:
        if isinstance(out, torch.Tensor) and out.is_floating_point() and out.isnan().any().item():
            raise RuntimeError("NaN")

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    parser.add_argument(
        "--tuned-malloc",
        action="store_true",
        help="re-run with glibc told to keep freed memory (no page faults from trimming)",
    )
    args = parser.parse_args()
    if args.tuned_malloc and "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        env = {
            **os.environ,
            "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
            "MALLOC_TRIM_THRESHOLD_": str(1 << 32),
            "MALLOC_TOP_PAD_": str(1 << 28),
        }
        argv = [a for a in sys.argv[1:] if a != "--tuned-malloc"]
        raise SystemExit(subprocess.call([sys.executable, __file__, *argv], env=env))
    import warnings

    warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
    contenders: dict[str, Callable[[GPT], AbstractContextManager[None]]] = {
        "unmonitored": nothing,
        "floatguard sentinel (default: proofs='all')": sentinel,
        "floatguard sentinel, proofs='forward'": sentinel_forward,
        "floatguard sentinel, proofs=False (reads all)": sentinel_reads,
        "floatguard stats every step": stats_every(1),
        "floatguard stats every 10th step": stats_every(10),
        "floatguard stats every 100th step": stats_every(100),
        "torch.autograd.detect_anomaly": anomaly,
        "naive hook .isnan().any().item()": naive_hooks,
        "hook wiring alone, no checks (the floor of any per-module design)": hook_floor,
    }
    model, opt, x, y = make()
    for _ in range(3):
        step(model, opt, x, y)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in contenders}
    order = list(contenders.items())
    shuffle = random.Random(0)
    for _ in range(args.rounds):
        shuffle.shuffle(order)  # no contender always runs after the same one
        for name, ctx in order:
            with ctx(model):
                sampled = "every" in name and "every step" not in name
                if not sampled:  # its sampled steps count wherever they fall
                    step(model, opt, x, y)  # first step under this contender: not timed
                start = time.perf_counter()
                for _ in range(args.steps):
                    step(model, opt, x, y)
                times[name].append((time.perf_counter() - start) / args.steps)
    base = statistics.median(times["unmonitored"])
    native = "one-pass C kernel" if _native.library() is not None else "torch path (no compiler)"
    print(
        f"# monitor benchmark: GPT 4 layers d=128 T=128 batch 16, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, median of {args.rounds} rounds x {args.steps} steps; "
        f"stats: {native}; glibc malloc "
        f"{'tuned (MALLOC_* set)' if 'MALLOC_TRIM_THRESHOLD_' in os.environ else 'default'}\n"
    )
    print("| contender | ms / step | vs unmonitored |")
    print("|---|---:|---:|")
    for name, ts in times.items():
        # Sampled contenders: the mean over every timed step (a median of blocks would
        # drop the blocks that hold a sampled step).
        sampled = "every" in name and "every step" not in name
        med = statistics.fmean(ts) if sampled else statistics.median(ts)
        print(f"| {name} | {med * 1e3:.1f} | {med / base:.3f}x |")
    print(
        "\n(sampled contenders: mean over all timed steps, which hold "
        f"{args.rounds * args.steps} steps of one run; the others: median of blocks)"
    )


if __name__ == "__main__":
    main()
