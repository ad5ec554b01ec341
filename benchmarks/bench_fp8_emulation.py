"""Low-precision emulation: training quality per recipe, and the cost of an emulated Linear.

1. The tiny GPT (2 layers, d=64, T=32) trained 300 steps with the same seed: held-out
   loss in fp32, bf16 autocast, and under every EmulationRecipe preset (each of its
   three GEMMs per layer quantized as its reference does, docs/fp8.md): tensor-wise and
   row-wise FP8, TE's block scaling (also with the SDPA matmuls emulated), DeepSeek-V3,
   DeepGEMM's casts, MXFP8 (scale rounded up, and OCP's floor), NVFP4 forward-only, and
   NVIDIA's NVFP4 training recipe with its ablations (without the Hadamard transform,
   without stochastic rounding, without 16x16 weight tiles, with a BF16 last layer);
   with the layers and the share of GEMM FLOPs each run emulates.
   A GPT-2 built from a transformers config (Conv1D layers) shows its coverage too.
   TE's delayed scaling (``te_delayed``: an amax history and scale per layer and
   tensor) is a row too.
2. A mixture-of-experts model (transformers' Mixtral from a config: 2 layers, d=64, 4
   experts, top-2, its experts multiplied by ``F.grouped_mm``) trained 150 steps on the
   same synthetic task: fp32 against MXFP8 and NVFP4 training with every expert's GEMMs
   emulated (the LM head kept), with the GEMM FLOP share emulated. Needs transformers
   (the floatguard[hf] extra).
3. An emulated Linear (4096 x 4096 weight, 2048 tokens, HYBRID block recipe) forward +
   backward vs a plain float32 Linear, median of a few repeats.

    python benchmarks/bench_fp8_emulation.py [--repeats R] [--rows delayed,moe]

``--rows``: only the rows whose name contains one of these (case-insensitive; fp32 is
always run), and ``moe`` for the MoE table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

from floatguard.demo import train_tiny
from floatguard.emulation import EmulationRecipe
from floatguard.emulation import coverage as audit_coverage
from floatguard.emulation.fake_quant import EmulatedLinear


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


def run_recipe(run: Callable[[], float]) -> tuple[EmulationRecipe | None, bool]:
    """What a row's run trains under: the recipe and ``attention`` its ``train_tiny`` call
    is given (the call is recorded, not run)."""
    calls: list[tuple[EmulationRecipe | None, bool]] = []

    def record(recipe: EmulationRecipe | None = None, **kwargs: Any) -> float:
        calls.append((recipe, bool(kwargs.get("attention", False))))
        return 0.0

    with mock.patch.object(sys.modules[__name__], "train_tiny", record):
        run()
    return calls[0]


def coverage(recipe: EmulationRecipe, attention: bool) -> tuple[str, str]:
    """The "layers emulated" and "GEMM FLOPs emulated" columns, measured: one training
    step of the tiny GPT (train_tiny's model, batch and loss; the recipe's skip, else the
    LM head, as train_tiny keeps it) under the dispatch-level audit
    (floatguard.emulation.coverage), forward + backward. A layer counts as emulated when
    every GEMM FLOP it ran was (an attention module's SDPA matmuls are its own)."""
    from floatguard.demo import GPT, TINY
    from floatguard.demo.model import synthetic_batch

    torch.manual_seed(0)
    model = GPT(TINY)
    batch = synthetic_batch(TINY, 16, generator=torch.Generator().manual_seed(0))
    skip = ("head",) if recipe.skip is None else recipe.skip  # as train_tiny does

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(b[0]).float().reshape(-1, TINY.vocab_size), b[1].reshape(-1))

    cov = audit_coverage(model, batch, recipe, loss_fn=loss_fn, skip=skip, attention=attention)
    per_module = cov.by_module()
    full = sum(f.emulated == f.total for f in per_module.values())
    return f"{full} of {len(per_module)}", f"{cov.share:.1%}"


def gpt2_coverage() -> str | None:
    """The audit on a GPT-2 built from a config (transformers' Conv1D; the LM head
    skipped, attention=True), with SDPA and with eager attention (torch.matmul: no SDPA
    call to emulate); None when transformers is not installed (the floatguard[hf] extra)."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    lines = []
    for impl in ("sdpa", "eager"):
        cfg = GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0,
            eos_token_id=0, attn_implementation=impl,
        )  # fmt: skip
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg)
        ids = torch.randint(0, 128, (4, 32))
        cov = audit_coverage(
            model, {"input_ids": ids, "labels": ids}, EmulationRecipe.hybrid_block(),
            skip=("lm_head",), attention=True,
        )  # fmt: skip
        lines.append(f"- {impl} attention: {cov.summary()}")
    return "\n".join(lines)


def moe_rows(steps: int = 150) -> list[str] | None:
    """The MoE table's rows (None without transformers): held-out loss after ``steps``
    AdamW steps on the tiny GPT's synthetic task, same seed, batches and order."""
    try:
        from transformers import MixtralConfig, MixtralForCausalLM
    except ImportError:
        return None
    from floatguard.demo import TINY
    from floatguard.demo.model import synthetic_batch
    from floatguard.emulation import emulate

    cfg = MixtralConfig(
        vocab_size=TINY.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=TINY.block_size,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    train = [synthetic_batch(TINY, 16, generator=gen) for _ in range(steps)]
    held = [synthetic_batch(TINY, 16, generator=gen) for _ in range(4)]

    def loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        logits = m(input_ids=b[0]).logits
        return F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), b[1].reshape(-1))

    def run(recipe: EmulationRecipe | None, reorder: bool = False) -> tuple[float, str]:
        torch.manual_seed(0)
        model = MixtralForCausalLM(cfg)
        model.set_experts_implementation("grouped_mm")
        share = "-"
        if recipe is not None:
            cov = audit_coverage(model, train[0], recipe, loss_fn=loss, skip=("lm_head",))
            share = f"{cov.share:.1%}"
            emulate(model, recipe, skip=("lm_head",))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        order = list(reversed(train)) if reorder else train  # the noise row: another order
        for b in order:
            opt.zero_grad(set_to_none=True)
            loss(model, b).backward()
            opt.step()
        with torch.no_grad():
            return statistics.fmean(float(loss(model, b)) for b in held), share

    e = EmulationRecipe
    rows = {"fp32": None, "MXFP8 (e4m3, 32-blocks, E8M0 rceil)": e.mxfp8(),
            "NVFP4 training (RHT wgrad, 16x16 weights, SR grads)": e.nvfp4_training(
                skip=("lm_head",))}  # fmt: skip
    results = {name: run(r) for name, r in rows.items()}
    results["fp32, the batches in reverse order (noise)"] = run(None, reorder=True)
    ref = results["fp32"][0]
    return [f"| {n} | {v:.4f} | {(v / ref - 1) * 100:+.2f}% | {sh} |"
            for n, (v, sh) in results.items()]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", default="", help="comma-separated row-name substrings")
    args = parser.parse_args()
    wanted = [w.strip().lower() for w in args.rows.split(",") if w.strip()]
    print(
        f"# FP8 emulation benchmark: torch {torch.__version__}, {torch.get_num_threads()} threads\n"
    )
    e = EmulationRecipe
    runs = {
        "fp32": lambda: train_tiny(None),
        "bf16 autocast": lambda: train_tiny(None, precision=torch.bfloat16),
        "e4m3 tensorwise (HYBRID, TE current scaling)": lambda: train_tiny(e.hybrid_tensorwise()),
        "TE delayed scaling (HYBRID, history 1024, per layer and tensor)": lambda: train_tiny(
            e.te_delayed()
        ),
        "TE delayed scaling, history 16, margin 1": lambda: train_tiny(
            e.te_delayed(margin=1, amax_history_len=16)
        ),
        "rowwise, torchao axes, HYBRID formats": lambda: train_tiny(e.hybrid_rowwise()),
        "torchao rowwise (e4m3, power-of-two scales)": lambda: train_tiny(e.torchao_rowwise()),
        "e4m3 1x128 / 128x128 blocks (HYBRID, TE block scaling)": lambda: train_tiny(
            e.hybrid_block()
        ),
        "the same + SDPA matmuls (HYBRID, attention=True)": lambda: train_tiny(
            e.hybrid_block(), attention=True
        ),
        "DeepSeek-V3 (e4m3, 128x1 wgrad tiles, 14-bit accumulator)": lambda: train_tiny(
            e.deepseek_v3()
        ),
        "DeepGEMM casts (decode scales, 1e-4 floor)": lambda: train_tiny(e.deepgemm()),
        "DeepGEMM casts (UE8M0 scales)": lambda: train_tiny(e.deepgemm(ue8m0=True)),
        "MXFP8 (e4m3, 32-blocks, E8M0 rceil)": lambda: train_tiny(e.mxfp8()),
        "MXFP8 (OCP floor scales)": lambda: train_tiny(e.mxfp8("floor")),
        "NVFP4 forward, straight-through backward": lambda: train_tiny(e.nvfp4()),
        "NVFP4 training (RHT wgrad, 16x16 weights, SR grads)": lambda: train_tiny(
            e.nvfp4_training()
        ),
        "NVFP4 training without RHT": lambda: train_tiny(e.nvfp4_training(rht=False)),
        "NVFP4 training without SR": lambda: train_tiny(e.nvfp4_training(stochastic=False)),
        "NVFP4 training without 16x16 weights": lambda: train_tiny(e.nvfp4_training(two_d=False)),
        "NVFP4 training + last layer in BF16 (1 of 8, the paper's ~15%)": lambda: train_tiny(
            e.nvfp4_training(skip=("head", "blocks.1.mlp.proj"))
        ),
    }
    if wanted:
        runs = {n: f for n, f in runs.items() if n == "fp32" or any(w in n.lower() for w in wanted)}
    losses = {name: fn() for name, fn in runs.items()}
    ref = losses["fp32"]
    print("| tiny GPT, 300 steps, same seed | held-out loss | vs fp32 | layers emulated "
          "| GEMM FLOPs emulated |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    audits: dict[tuple[EmulationRecipe, bool], tuple[str, str]] = {}
    for name, loss in losses.items():
        recipe, attention = run_recipe(runs[name])
        if recipe is not None and (recipe, attention) not in audits:
            audits[recipe, attention] = coverage(recipe, attention)
        layers, share = ("-", "-") if recipe is None else audits[recipe, attention]
        print(f"| {name} | {loss:.4f} | {(loss / ref - 1) * 100:+.2f}% | {layers} | {share} |")
    if not wanted or "moe" in wanted:
        moe = moe_rows()
        print("\n| Mixtral MoE (4 experts, top-2, grouped_mm), 150 steps | held-out loss "
              "| vs fp32 | GEMM FLOPs emulated |")  # fmt: skip
        print("|---|---:|---:|---:|")
        print("\n".join(moe) if moe else "transformers not installed")
    if wanted:
        return
    gpt2 = gpt2_coverage()
    print(f"\nGPT-2 from a config (Conv1D), HYBRID block, LM head skipped, attention=True:"
          f"\n{gpt2 or 'transformers not installed'}")  # fmt: skip
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
