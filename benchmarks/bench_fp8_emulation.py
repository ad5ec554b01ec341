"""Low-precision emulation: training quality per recipe, and the cost of an emulated Linear.

1. The tiny GPT (2 layers, d=64, T=32) trained 300 steps with the same seed: held-out
   loss in fp32, bf16 autocast, and under emulated tensor-wise FP8, DeepSeek-style
   block FP8 (HYBRID: e5m2 gradients) and MXFP8.
2. An emulated Linear (4096 x 4096 weight, 2048 tokens, HYBRID block recipe) forward +
   backward vs a plain float32 Linear, median of a few repeats.

    python benchmarks/bench_fp8_emulation.py [--repeats R]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from floatguard.demo import train_tiny
from floatguard.scaling import EmulationRecipe, emulate
from floatguard.scaling.fake_quant import EmulatedLinear


def linear_seconds(module: nn.Module, x: torch.Tensor, repeats: int) -> float:
    def once() -> None:
        module.zero_grad(set_to_none=True)
        module(x).sum().backward()

    once()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def coverage() -> tuple[str, str]:
    """Layers the emulated runs cover (the LM head stays high precision, as in
    train_tiny) and their share of the weight-GEMM FLOPs per token (2 * in * out each;
    the attention matmuls, not emulated, are not counted)."""
    from floatguard.demo import GPT, TINY

    model = GPT(TINY)
    total = {name: m.in_features * m.out_features for name, m in model.named_modules()
             if isinstance(m, nn.Linear)}  # fmt: skip
    covered = emulate(model, EmulationRecipe.hybrid_block(), skip=("head",))
    share = sum(total[n] for n in covered) / sum(total.values())
    return f"{len(covered)} of {len(total)}", f"{share:.0%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(
        f"# FP8 emulation benchmark: torch {torch.__version__}, {torch.get_num_threads()} threads\n"
    )
    runs = {
        "fp32": lambda: train_tiny(None),
        "bf16 autocast": lambda: train_tiny(None, precision=torch.bfloat16),
        "e4m3 tensorwise (HYBRID)": lambda: train_tiny(EmulationRecipe.hybrid_tensorwise()),
        "e4m3 1x128 / 128x128 blocks (HYBRID)": lambda: train_tiny(EmulationRecipe.hybrid_block()),
        "MXFP8 (e4m3, 32-blocks, E8M0)": lambda: train_tiny(EmulationRecipe.mxfp8()),
    }
    losses = {name: fn() for name, fn in runs.items()}
    ref = losses["fp32"]
    print("| tiny GPT, 300 steps, same seed | held-out loss | vs fp32 | layers emulated "
          "| GEMM FLOPs emulated |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    cov = coverage()
    for name, loss in losses.items():
        layers, share = cov if "(" in name else ("-", "-")
        print(f"| {name} | {loss:.4f} | {(loss / ref - 1) * 100:+.2f}% | {layers} | {share} |")
    torch.manual_seed(0)
    lin = nn.Linear(4096, 4096)
    x = torch.randn(2048, 4096)
    plain = linear_seconds(lin, x, args.repeats)
    emu = linear_seconds(EmulatedLinear(lin, EmulationRecipe.hybrid_block()), x, args.repeats)
    print("\n| Linear 4096x4096, 2048 tokens, forward + backward | seconds | vs plain fp32 |")
    print("|---|---:|---:|")
    print(f"| plain float32 nn.Linear | {plain:.3f} | 1.00x |")
    print(f"| emulated HYBRID block FP8 | {emu:.3f} | {emu / plain:.2f}x |")


if __name__ == "__main__":
    main()
