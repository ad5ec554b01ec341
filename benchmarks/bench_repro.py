"""What a repro bundle costs: the bad step's time with and without one, its size
against the module and the model it comes from, and the time to re-run it.

A NaN is born in the MLP of the model's last block (log(-1) in a forward hook of the
user's). Per model: the guard's bad step without a bundle (the peer: the same guard,
``repro_dir`` off), with a ``minimal`` bundle and with a ``step`` bundle; each round a
new guard and folder (a bundle is written once per distinct fault). Median of the
rounds; ratio = with / without (> 1 is slower). Sizes in bytes as written; the module's
and the model's ``state_dict`` bytes for comparison.

    python benchmarks/bench_repro.py [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from floatguard import Guard, ResponsePolicy, SpikePolicy
from floatguard.demo import GPT, GPTConfig, synthetic_batch
from floatguard.repro import load_bundle, reproduce

MODELS = {
    "bench GPT (4 x d=128)": (GPTConfig(), 16),
    "GPT-2-small layer (2 x d=768, T=128)": (
        GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=12, n_embd=768),
        4,
    ),
}


def _bytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def bad_step(cfg: GPTConfig, batch: int, level: str | None) -> tuple[float, int, Path | None]:
    """Seconds of the bad step, the bundle's bytes and its path (none: 0, None)."""
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = synthetic_batch(cfg, batch, generator=torch.Generator().manual_seed(0))
    folder = Path(tempfile.mkdtemp(prefix="bench-repro-"))
    response = ResponsePolicy(repro_dir=folder, repro_level=level) if level else None  # type: ignore[arg-type]
    guard = Guard(model, opt, spikes=SpikePolicy(watch_loss=False), response=response)

    def loss() -> torch.Tensor:
        logits = model(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    guard.step(loss)
    mlp: nn.Module = model.blocks[-1].mlp  # type: ignore[index]
    h = mlp.register_forward_hook(lambda m, i, o: o + torch.log(-torch.ones_like(o[..., :1])))
    start = time.perf_counter()
    r = guard.step(loss)
    seconds = time.perf_counter() - start
    h.remove()
    guard.close()
    assert r.fault is not None and r.fault.module.endswith("mlp"), r.fault
    files = sorted(folder.glob("*.fgr"))
    if level is None:
        return seconds, 0, None
    assert len(files) == 1, files
    return seconds, files[0].stat().st_size, files[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one round")
    args = ap.parse_args()
    rounds = 1 if args.quick else args.rounds
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {rounds} round(s)")
    print(
        "| model | module state | model state | bad step ms, no bundle | minimal: ms, ratio, "
        "bytes | step: ms, ratio, bytes | re-run ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (cfg, batch) in MODELS.items():
        torch.manual_seed(0)
        model = GPT(cfg)
        module_bytes = _bytes(model.blocks[-1].mlp.state_dict())  # type: ignore[index]
        model_bytes = _bytes(model.state_dict())
        base = statistics.median(bad_step(cfg, batch, None)[0] for _ in range(rounds))
        cells = []
        path = None
        for level in ("minimal", "step"):
            runs = [bad_step(cfg, batch, level) for _ in range(rounds)]
            t = statistics.median(r[0] for r in runs)
            cells.append(f"{t * 1e3:.1f}, {t / base:.2f}x, {runs[0][1]:,}")
            if level == "minimal":
                path = runs[0][2]
        assert path is not None
        bundle = load_bundle(path)
        start = time.perf_counter()
        outcome = reproduce(bundle)
        rerun = time.perf_counter() - start
        assert outcome.reproduced, outcome
        print(
            f"| {name} | {module_bytes:,} | {model_bytes:,} | {base * 1e3:.1f} | "
            f"{cells[0]} | {cells[1]} | {rerun * 1e3:.1f} |"
        )


if __name__ == "__main__":
    main()
