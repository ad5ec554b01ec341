"""Low-precision emulation: training quality per recipe, and the cost of an emulated Linear.

1. The tiny GPT (2 layers, d=64, T=32) trained 300 steps with the same seed: held-out
   loss in fp32, bf16 autocast, and under emulated tensor-wise FP8, DeepSeek-style
   block FP8 (HYBRID: e5m2 gradients; also with the SDPA matmuls emulated), DeepGEMM's
   decode-scale casts, MXFP8 (scale rounded up, and OCP's floor), NVIDIA's NVFP4
   training recipe; with the layers and the share of GEMM FLOPs each run emulates.
   A GPT-2 built from a transformers config (Conv1D layers) shows its coverage too.
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


def coverage(attention: bool) -> tuple[str, str]:
    """Layers the emulated runs cover (the LM head stays high precision, as in
    train_tiny) and their share of the GEMM FLOPs per token: 2 * in * out per weight GEMM,
    2 * 2 * T * d per layer for the attention matmuls (q k^T and p v)."""
    from floatguard.demo import GPT, TINY

    model = GPT(TINY)
    total = {name: m.in_features * m.out_features for name, m in model.named_modules()
             if isinstance(m, nn.Linear)}  # fmt: skip
    attn = 2 * TINY.block_size * TINY.n_embd * TINY.n_layer
    covered = emulate(model, EmulationRecipe.hybrid_block(), skip=("head",), attention=attention)
    done = sum(total[n] for n in covered) + (attn if attention else 0)
    share = done / (sum(total.values()) + attn)
    return f"{len(covered)} of {len(total)}" + (" + SDPA" if attention else ""), f"{share:.0%}"


def gpt2_coverage() -> str | None:
    """emulate() on a GPT-2 built from a config (transformers' Conv1D), or None when
    transformers is not installed (the floatguard[hf] extra)."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    cfg = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(cfg)
    covered = emulate(model, EmulationRecipe.hybrid_block(), skip=("lm_head",), attention=True)
    return covered.summary()


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
        "the same + SDPA matmuls (HYBRID, attention=True)": lambda: train_tiny(
            EmulationRecipe.hybrid_block(), attention=True
        ),
        "DeepGEMM casts (decode scales, 1e-4 floor)": lambda: train_tiny(
            EmulationRecipe.deepgemm()
        ),
        "DeepGEMM casts (UE8M0 scales)": lambda: train_tiny(EmulationRecipe.deepgemm(ue8m0=True)),
        "MXFP8 (e4m3, 32-blocks, E8M0 rceil)": lambda: train_tiny(EmulationRecipe.mxfp8()),
        "MXFP8 (OCP floor scales)": lambda: train_tiny(EmulationRecipe.mxfp8("floor")),
        "NVFP4 training (16x16 weights, SR grads)": lambda: train_tiny(
            EmulationRecipe.nvfp4_training()
        ),
    }
    losses = {name: fn() for name, fn in runs.items()}
    ref = losses["fp32"]
    print("| tiny GPT, 300 steps, same seed | held-out loss | vs fp32 | layers emulated "
          "| GEMM FLOPs emulated |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    cov, cov_attn = coverage(False), coverage(True)
    for name, loss in losses.items():
        emulated = name not in ("fp32", "bf16 autocast")
        layers, share = (cov_attn if "SDPA" in name else cov) if emulated else ("-", "-")
        print(f"| {name} | {loss:.4f} | {(loss / ref - 1) * 100:+.2f}% | {layers} | {share} |")
    gpt2 = gpt2_coverage()
    print(f"\nGPT-2 from a config (Conv1D): {gpt2 or 'transformers not installed'}")
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
