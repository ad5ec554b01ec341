"""Guard overhead against the hand-written GradScaler + clip_grad_norm_ loop, measured in
one run (interleaved rounds, median); the cost of one localization by replay; and a
recovery scenario with injected faults.

Models: the bench GPT (4 layers, d=128, T=128, batch 16) and a tiny GPT (1 layer, d=32,
T=16, batch 8), where the fixed per-step costs show most. Precisions: fp32 and fp16
autocast (CPU). Contenders per model and precision:

- peer: ``loss.backward(); clip_grad_norm_; opt.step()`` in fp32, and
  ``GradScaler.scale(loss).backward(); unscale_; clip_grad_norm_; step; update`` in fp16
- ``Guard.step(closure)`` with its defaults (ZClip, loss-spike detection, detection
  by one host read, localization by replay on bad steps only, snapshots every 5 steps)
- ``Guard(watch="hooks")``: the hook-based sentinel monitor on every step (for reference)
- ``Guard(sync="deferred")``: no host read on a healthy step (the verdict on the device,
  the update gated by ``where``, the read settled at the next step). On a CPU nothing
  runs ahead of the host, so this row shows the deferred mode's own cost (a copy of the
  parameters and optimizer state per step, the gating); what it saves (the host waiting
  for the device every step) shows only on a GPU (``gpu_check``).

    python benchmarks/bench_guard.py [--steps N] [--rounds R] [--quick]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from floatguard import Guard, ResponsePolicy, SpikePolicy
from floatguard.demo import GPT, GPTConfig, synthetic_batch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _peer_loops import gradscaler_clip_step

Step = Callable[[], None]
MODELS = {
    "bench GPT": (GPTConfig(), 16),
    "tiny GPT": (GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32), 8),
}


def setup(model_name: str) -> tuple[GPT, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    cfg, batch = MODELS[model_name]
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = synthetic_batch(cfg, batch, generator=torch.Generator().manual_seed(0))
    return model, opt, x, y


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def peer(model_name: str, precision: str) -> Step:
    model, opt, x, y = setup(model_name)
    if precision == "fp32":

        def step() -> None:
            lm_loss(model, x, y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step
    return gradscaler_clip_step(model, opt, lambda: lm_loss(model, x, y))


def guarded(model_name: str, precision: str, watch: str = "replay", sync: str = "exact") -> Step:
    model, opt, x, y = setup(model_name)
    guard = Guard(model, opt, precision=precision, watch=watch, sync=sync)  # type: ignore[arg-type]

    def step() -> None:
        guard.step(lambda: lm_loss(model, x, y))

    return step


def time_rounds(steps: dict[str, Step], n: int, rounds: int) -> dict[str, float]:
    for s in steps.values():
        for _ in range(3):
            s()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, s in steps.items():
            start = time.perf_counter()
            for _ in range(n):
                s()
            times[name].append((time.perf_counter() - start) / n)
    return {k: statistics.median(v) for k, v in times.items()}


def replay_cost(model_name: str, rounds: int) -> tuple[float, float]:
    """Seconds of a clean guarded step, and of a bad one (localized by replay)."""
    model, opt, x, y = setup(model_name)
    guard = Guard(model, opt, spikes=SpikePolicy(watch_loss=False))
    bad = x
    clean_t, bad_t = [], []
    for _ in range(2):
        guard.step(lambda: lm_loss(model, x, y))
    for _ in range(rounds):
        start = time.perf_counter()
        guard.step(lambda: lm_loss(model, x, y))
        clean_t.append(time.perf_counter() - start)
        # a NaN born in the LM head's output (log(-1) in a hook of the user's)
        h = model.head.register_forward_hook(
            lambda m, i, o: o + torch.log(-torch.ones_like(o[..., :1]))
        )
        start = time.perf_counter()
        r = guard.step(lambda: lm_loss(model, bad, y))
        bad_t.append(time.perf_counter() - start)
        h.remove()
        assert r.fault is not None and r.fault.module == "head", r.fault
    return statistics.median(clean_t), statistics.median(bad_t)


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
                  response=ResponsePolicy(rollback_after=4))
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

            def closure(xb: torch.Tensor = xb, yb: torch.Tensor = yb) -> torch.Tensor:
                return ((model(xb) - yb) ** 2).mean()

            if guard is None:
                opt.zero_grad()
                closure().backward()
                opt.step()
            else:
                guard.step(closure)
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
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="3 rounds, fewer steps")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 3, 5
    print(
        f"# guard benchmark: torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"median of {args.rounds} interleaved rounds; tiny GPT runs 10x the steps\n"
    )
    print("| model | precision | contender | ms / step | vs peer |")
    print("|---|---|---|---:|---:|")
    for model_name in MODELS:
        n = args.steps * (10 if model_name == "tiny GPT" else 1)
        for precision in ("fp32", "fp16"):
            peer_name = "clip_grad_norm_ loop" if precision == "fp32" else "GradScaler + clip"
            steps = {
                peer_name: peer(model_name, precision),
                "Guard.step(closure), defaults": guarded(model_name, precision),
                'Guard(watch="hooks") (sentinel)': guarded(model_name, precision, "hooks"),
                'Guard(sync="deferred"), defaults': guarded(model_name, precision, sync="deferred"),
            }
            med = time_rounds(steps, n, args.rounds)
            ref = med[peer_name]
            for name, t in med.items():
                print(f"| {model_name} | {precision} | {name} | {t * 1e3:.2f} | {t / ref:.3f}x |")
    print("\n| localization by replay | clean step ms | bad step ms | in clean steps |")
    print("|---|---:|---:|---:|")
    for model_name in MODELS:
        clean, bad = replay_cost(model_name, max(3, args.rounds // 2))
        print(f"| {model_name} | {clean * 1e3:.1f} | {bad * 1e3:.1f} | {bad / clean:.1f} |")
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
