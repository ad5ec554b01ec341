"""Guard overhead on the small GPT, against a plain step and a GradScaler + clip loop; and a
recovery scenario with injected faults. One run, interleaved rounds.

    python benchmarks/bench_guard.py [--steps N] [--rounds R]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from floatguard import Guard, ResponsePolicy, SpikePolicy
from floatguard.demo import GPT, GPTConfig, synthetic_batch

Step = Callable[[], None]


def gpt_setup() -> tuple[GPT, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = synthetic_batch(cfg, 16, generator=torch.Generator().manual_seed(0))
    return model, opt, x, y


def lm_loss(model: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def plain() -> Step:
    model, opt, x, y = gpt_setup()

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def gradscaler_clip() -> Step:
    model, opt, x, y = gpt_setup()
    scaler = torch.amp.GradScaler("cpu")

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = lm_loss(model, x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


def guarded(monitor: bool) -> Callable[[], Step]:
    def make() -> Step:
        model, opt, x, y = gpt_setup()
        guard = Guard(model, opt, precision="fp16", monitor=monitor)

        def step() -> None:
            with guard.autocast():
                loss = lm_loss(model, x, y)
            guard.backward(loss)
            guard.step()

        return step

    return make


def recovery() -> dict[str, float]:
    """A tiny regression with a NaN batch, a NaN weight, a loss spike and a run of bad batches."""

    def data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(7)
        w = torch.randn(8, 4, generator=g)
        out = []
        for _ in range(n):
            xb = torch.randn(32, 8, generator=g)
            out.append((xb, torch.tanh(xb @ w) + 0.05 * torch.randn(32, 4, generator=g)))
        return out

    batches, test = data(800), data(1)[0]

    def train(faulty: bool, guard_on: bool) -> tuple[float, int]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        guard = (
            Guard(model, opt, spikes=SpikePolicy(window=30, z=8.0),
                  response=ResponsePolicy(rollback_after=4, snapshot_every=10))
            if guard_on else None
        )  # fmt: skip
        for i, (xb, yb) in enumerate(batches):
            if faulty and (i == 40 or 260 <= i < 268):
                xb = xb * math.nan
            if faulty and i == 200:
                yb = yb * 40.0
            if faulty and i == 120:
                with torch.no_grad():
                    model[0].weight[0, 0] = math.nan
            loss = ((model(xb) - yb) ** 2).mean()
            if guard is None:
                opt.zero_grad()
                loss.backward()
                opt.step()
            else:
                guard.backward(loss)
                guard.step()
        with torch.no_grad():
            final = float(((model(test[0]) - test[1]) ** 2).mean())
        lost = 0 if guard is None else guard.step_count - guard.good_steps
        return final, lost

    clean, _ = train(False, False)
    broken, _ = train(True, False)
    healed, lost = train(True, True)
    return {"clean": clean, "unguarded": broken, "guarded": healed, "steps_lost": lost}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    contenders: dict[str, Callable[[], Step]] = {
        "plain fp16 autocast step": plain,
        "GradScaler + clip_grad_norm_": gradscaler_clip,
        "Guard (scaler + ZClip + sentinel monitor)": guarded(True),
        "Guard without the monitor": guarded(False),
    }
    steps = {name: make() for name, make in contenders.items()}
    for s in steps.values():
        for _ in range(2):
            s()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.rounds):
        for name, s in steps.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                s()
            times[name].append((time.perf_counter() - start) / args.steps)
    base = statistics.median(times["plain fp16 autocast step"])
    ref = statistics.median(times["GradScaler + clip_grad_norm_"])
    print(
        f"# guard benchmark: GPT 4 layers d=128 T=128 batch 16, fp16 autocast on CPU, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"median of {args.rounds} rounds x {args.steps} steps\n"
    )
    print("| contender | ms / step | vs plain | vs GradScaler+clip |")
    print("|---|---:|---:|---:|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.1f} | {med / base:.3f}x | {med / ref:.3f}x |")
    r = recovery()
    print(
        "\n| recovery scenario (800 steps: NaN batch, NaN weight, loss spike, 8 bad batches) "
        "| value |"
    )
    print("|---|---:|")
    print(f"| final test loss, fault-free run | {r['clean']:.5f} |")
    print(f"| final test loss, unguarded run with faults | {r['unguarded']} |")
    print(f"| final test loss, guarded run with faults | {r['guarded']:.5f} |")
    print(f"| guarded vs fault-free | {(r['guarded'] / r['clean'] - 1) * 100:+.1f}% |")
    print(f"| steps not applied (skipped or rolled back) | {int(r['steps_lost'])} |")


if __name__ == "__main__":
    main()
