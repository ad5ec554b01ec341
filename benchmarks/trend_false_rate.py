"""False-alarm rate of ``TrendWatch`` (its defaults) on clean runs, and when it finds
the planted slow divergences of issue 36.

Small models are trained on synthetic data; every applied step's loss, gradient norm,
LR (and loss scale, for the demo) goes to a fresh ``TrendWatch``, as the guard feeds
it. Nothing is injected in the clean runs, so every alarm there is a false one:

- warm-up + cosine: MLP regression and a 10-class MLP classifier (AdamW, 5% warm-up,
  cosine to 0), three seeds each
- constant LR, noisy loss: the classifier at a constant LR with small batches (16),
  three seeds
- the demo: ``floatguard.demo.run_demo`` without faults (the guard's own events, fp16
  with a loss scale), and with its default fault schedule (one-step faults: no trend)
- tiny Hugging Face GPT-2, Llama and T5 built from configs (no download) on synthetic
  sequences, warm-up + cosine, if transformers is installed

Planted (the column is the step the alarm fired, and its signal):

- LR creeping from 1e-3 to 0.3 (geometric) over 300 steps: the demo GPT, HF GPT-2
- label noise growing linearly to 60% over 300 steps: the classifier
- the LR x40 from step 60 on: the classifier, the demo GPT

    python benchmarks/trend_false_rate.py [--scale 1.0] [--seeds 3]

``--scale`` multiplies the clean runs' step counts (0.3 for a quick look); ``--only``
picks runs by name (a regular expression); ``--dump`` writes the observations out. With
one torch thread the whole script takes about five minutes on the 2-core development
CPU (shared).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from floatguard.demo import GPT, GPTConfig, synthetic_batch
from floatguard.stability.trend import TrendAlarm, TrendWatch

Obs = tuple[int, float, float, float | None, float | None]  # step, loss, grad norm, lr, scale
LrAt = Callable[[int], float]  # step -> LR


def _grad_norm(model: nn.Module) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    )


def warmup_cosine(lr: float, steps: int) -> LrAt:
    warm = max(1, steps // 20)
    return lambda s: (
        lr * min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )


def constant(lr: float) -> LrAt:
    return lambda s: lr


def creep(lo: float, hi: float, steps: int) -> LrAt:
    return lambda s: lo * (hi / lo) ** (min(s, steps) / steps)


def jump(lr: float, factor: float, at: int) -> LrAt:
    return lambda s: lr * (factor if s >= at else 1.0)


def train(
    model: nn.Module, loss_fn: Callable[[int], torch.Tensor], lr_at: LrAt, steps: int
) -> Iterator[Obs]:
    """AdamW (weight decay 0.01) with the LR set each step; yields the observations."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr_at(0), weight_decay=0.01)
    for s in range(steps):
        lr = lr_at(s)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(s)
        loss.backward()  # type: ignore[no-untyped-call]
        norm = _grad_norm(model)
        opt.step()
        yield s, float(loss.detach()), norm, lr, None


def mlp_regression(seed: int, steps: int, lr_at: LrAt) -> Iterator[Obs]:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    w_true = torch.randn(16, 1, generator=g)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1)
    )

    def loss(s: int) -> torch.Tensor:
        x = torch.randn(32, 16, generator=g)
        y = torch.sin(x @ w_true) + 0.1 * torch.randn(32, 1, generator=g)
        return F.mse_loss(model(x), y)

    return train(model, loss, lr_at, steps)


def classifier(
    seed: int, steps: int, lr_at: LrAt, batch: int = 64, noise: Callable[[int], float] | None = None
) -> Iterator[Obs]:
    """10 Gaussian blobs in 20 dimensions; ``noise(step)``: the fraction of labels
    replaced by random ones."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(10, 20, generator=g)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 10))

    def loss(s: int) -> torch.Tensor:
        y = torch.randint(0, 10, (batch,), generator=g)
        x = centers[y] + 0.7 * torch.randn(batch, 20, generator=g)
        if noise is not None:
            flip = torch.rand(batch, generator=g) < noise(s)
            y = torch.where(flip, torch.randint(0, 10, (batch,), generator=g), y)
        return F.cross_entropy(model(x), y)

    return train(model, loss, lr_at, steps)


def demo_gpt(seed: int, steps: int, lr_at: LrAt) -> Iterator[Obs]:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=32, block_size=24, n_layer=2, n_head=2, n_embd=64)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(seed)

    def loss(s: int) -> torch.Tensor:
        x, y = synthetic_batch(cfg, 16, generator=g)
        return F.cross_entropy(model(x).reshape(-1, cfg.vocab_size), y.reshape(-1))

    return train(model, loss, lr_at, steps)


def hf_model(kind: str, seed: int, steps: int, lr_at: LrAt) -> Iterator[Obs] | None:
    try:
        import transformers
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    small = dict(vocab_size=256)
    model: nn.Module
    if kind == "gpt2":
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_positions=32, n_embd=64, n_layer=2, n_head=2, **small)
        )
    elif kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=32, **small,
        ))  # fmt: skip
    else:
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            d_model=64, d_ff=128, d_kv=32, num_layers=2, num_decoder_layers=2, num_heads=2,
            decoder_start_token_id=0, pad_token_id=0, **small,
        ))  # fmt: skip
    cfg = GPTConfig(vocab_size=256, block_size=32)
    g = torch.Generator().manual_seed(seed)

    def loss(s: int) -> torch.Tensor:
        x, _ = synthetic_batch(cfg, 8, generator=g)
        if kind == "t5":  # the decoder continues the progression the encoder saw
            out = model(input_ids=x[:, :16].contiguous(), labels=x[:, 16:].contiguous())
        else:
            out = model(input_ids=x, labels=x)
        loss: torch.Tensor = out.loss
        return loss

    return train(model, loss, lr_at, steps)


def demo_run(seed: int, steps: int, faults: list[str]) -> Iterator[Obs]:
    """The demo itself (``run_demo``, guarded, fp16): its applied steps' events."""
    from floatguard.demo.run import run_demo

    out: list[Obs] = []

    def on_event(e: object) -> None:
        if getattr(e, "kind", None) == "step" and e["action"] == "applied":  # type: ignore[index]
            f = e.fields  # type: ignore[attr-defined]
            out.append((e.step, f["loss"], f["grad_norm"], f["lr"], f["scale"]))  # type: ignore[attr-defined]

    run_demo(steps=steps, faults=faults, seed=seed, on_event=on_event)
    return iter(out)


@dataclass
class Row:
    run: str
    steps: int
    planted: bool
    alarms: list[TrendAlarm]
    seconds: float


def watch(name: str, obs: Iterator[Obs] | None, planted: bool) -> Row | None:
    if obs is None:
        return None
    w = TrendWatch()
    alarms: list[TrendAlarm] = []
    n, spent = 0, 0.0  # the watch's own time (the observations are trained lazily)
    for step, loss, norm, lr, scale in obs:
        t0 = time.perf_counter()
        alarms += w.observe(step, loss, norm, lr, scale)
        spent += time.perf_counter() - t0
        n += 1
    return Row(name, n, planted, alarms, spent)


def runs(
    scale: float, seeds: int
) -> Iterator[tuple[str, Callable[[], Iterator[Obs] | None], bool]]:
    def n(steps: int) -> int:
        return max(200, round(steps * scale))

    for seed in range(seeds):
        yield (
            f"MLP regression, warm-up + cosine, seed {seed}",
            lambda s=seed: mlp_regression(s, n(1500), warmup_cosine(3e-3, n(1500))),
            False,
        )
        yield (
            f"classifier, warm-up + cosine, seed {seed}",
            lambda s=seed: classifier(s, n(1500), warmup_cosine(3e-3, n(1500))),
            False,
        )
        yield (
            f"classifier, constant LR, batch 16, seed {seed}",
            lambda s=seed: classifier(s, n(1500), constant(1e-3), batch=16),
            False,
        )
        yield (
            f"demo GPT, warm-up + cosine, seed {seed}",
            lambda s=seed: demo_gpt(s, n(800), warmup_cosine(3e-3, n(800))),
            False,
        )
    for seed in range(min(seeds, 2)):
        yield (
            f"demo (run_demo, fp16, no faults), seed {seed}",
            lambda s=seed: demo_run(s, n(400), []),
            False,
        )
    yield (
        "demo (run_demo, fp16, default faults)",
        lambda: demo_run(
            0, n(400), ["corrupt_batch", "bit_flip", "masked_row", "lr_spike", "fp16_overflow"]
        ),
        False,
    )
    for kind in ("gpt2", "llama", "t5"):
        for seed in range(min(seeds, 2)):
            yield (
                f"HF {kind} (tiny, from config), seed {seed}",
                lambda k=kind, s=seed: hf_model(k, s, n(400), warmup_cosine(3e-3, n(400))),
                False,
            )
    # Planted divergences (300 steps, as issue 36 ran them).
    for seed in range(seeds):
        yield (
            f"LR creep 1e-3 -> 0.3: demo GPT, seed {seed}",
            lambda s=seed: demo_gpt(s, 300, creep(1e-3, 0.3, 300)),
            True,
        )
        yield (
            f"LR creep 1e-3 -> 0.3: HF GPT-2, seed {seed}",
            lambda s=seed: hf_model("gpt2", s, 300, creep(1e-3, 0.3, 300)),
            True,
        )
        yield (
            f"label noise -> 60% over 300 steps: classifier, seed {seed}",
            lambda s=seed: classifier(s, 300, constant(3e-3), noise=lambda t: 0.6 * t / 300),
            True,
        )
        yield (
            f"LR x40 from step 60: classifier, seed {seed}",
            lambda s=seed: classifier(s, 300, jump(1e-2, 40, 60)),
            True,
        )
        yield (
            f"LR x40 from step 60: demo GPT, seed {seed}",
            lambda s=seed: demo_gpt(s, 300, jump(1e-3, 40, 60)),
            True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the clean runs' steps")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per clean run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (tiny models: 1)")
    parser.add_argument(
        "--only", default="", help="run only the runs whose name matches this regular expression"
    )
    parser.add_argument("--dump", help="also write every run's observations to this JSON file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rows, dumped = [], {}
    for name, make, planted in runs(args.scale, args.seeds):
        if not re.search(args.only, name):
            continue
        obs = make()
        if obs is None:
            print(f"({name}: transformers is not installed, skipped)")
            continue
        if args.dump:
            seq = list(obs)
            dumped[name] = {"planted": planted, "obs": seq}
            obs = iter(seq)
        row = watch(name, obs, planted)
        assert row is not None
        rows.append(row)
        print(f"{name}: {len(row.alarms)} alarm(s)", flush=True)
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump(dumped, f)
    print()
    print("| run | steps | alarms (clean: false; planted: step, signal) |")
    print("|---|---:|---|")
    for r in rows:
        said = ", ".join(f"{a.step} ({a.signal})" for a in r.alarms) or "none"
        if not r.planted:
            said = f"{len(r.alarms)}" + (f": {said}" if r.alarms else "")
        print(f"| {r.run} | {r.steps} | {said} |")
    clean = [r for r in rows if not r.planted]
    print(f"\nclean runs: {sum(len(r.alarms) for r in clean)} false alarm(s) in "
          f"{sum(r.steps for r in clean)} steps of {len(clean)} runs; planted: "
          f"{sum(bool(r.alarms) for r in rows if r.planted)} of "
          f"{sum(r.planted for r in rows)} found; {time.perf_counter() - t0:.0f} s with "
          f"training (torch {torch.__version__}, threads: {torch.get_num_threads()}), "
          f"{sum(r.seconds for r in rows):.1f} s of it in the watch")  # fmt: skip


if __name__ == "__main__":
    main()
