"""Monitor overhead on a small GPT training step, against the unmonitored step, in one run.

GPT: 4 layers, d=128, T=128, batch 16, on CPU; a step is forward + cross-entropy +
backward + SGD update. Contenders, each timed as the median over interleaved
rounds (so drift on a shared machine hits every contender alike):

- floatguard sentinel (default mode)
- floatguard stats on every step, and stats every 10th step
- torch.autograd.detect_anomaly
- a naive forward hook that calls ``.isnan().any().item()`` on every module output

    python benchmarks/bench_monitor.py [--steps N] [--rounds R]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
import torch.nn.functional as F

from floatguard import Monitor
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


def stats_every(k: int) -> Callable[[GPT], AbstractContextManager[None]]:
    @contextmanager
    def ctx(model: GPT) -> Iterator[None]:
        with Monitor(model, mode="stats", every=k):
            yield

    return ctx


@contextmanager
def anomaly(model: GPT) -> Iterator[None]:
    with torch.autograd.detect_anomaly():
        yield


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
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    args = parser.parse_args()
    import warnings

    warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
    contenders: dict[str, Callable[[GPT], AbstractContextManager[None]]] = {
        "unmonitored": nothing,
        "floatguard sentinel": sentinel,
        "floatguard stats every step": stats_every(1),
        "floatguard stats every 10th step": stats_every(10),
        "torch.autograd.detect_anomaly": anomaly,
        "naive hook .isnan().any().item()": naive_hooks,
    }
    model, opt, x, y = make()
    for _ in range(3):
        step(model, opt, x, y)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(args.rounds):
        for name, ctx in contenders.items():
            with ctx(model):
                step(model, opt, x, y)  # first step under this contender: not timed
                start = time.perf_counter()
                for _ in range(args.steps):
                    step(model, opt, x, y)
                times[name].append((time.perf_counter() - start) / args.steps)
    base = statistics.median(times["unmonitored"])
    print(
        f"# monitor benchmark: GPT 4 layers d=128 T=128 batch 16, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, median of {args.rounds} rounds x {args.steps} steps\n"
    )
    print("| contender | ms / step | vs unmonitored |")
    print("|---|---:|---:|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.1f} | {med / base:.3f}x |")


if __name__ == "__main__":
    main()
