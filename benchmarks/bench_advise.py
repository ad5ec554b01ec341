"""Is floatguard.advise's plan right? Held-out loss after training, against high precision.

For each recipe and seed: the model is built, ``advise`` runs on 4 training batches with
``warmup_steps=--warmup`` (a copy trained that many steps in high precision on them is
measured: the initial model's sensitivities do not predict training's, see --oracle),
then the model is trained from the same initialization for ``--steps`` steps (AdamW,
the demo's synthetic task) in:

- high precision (fp32 on this CPU: the stand-in for BF16, the reference);
- every GEMM layer emulated;
- the advisor's plan at 10% and 20% of GEMM FLOPs kept in high precision;
- the same budget spent on the last layers (NVIDIA's heuristic: from the LM head back,
  each layer kept while it fits);
- the same budget spent at random (each layer in a random order, kept while it fits;
  the mean of ``--draws`` draws).

The held-out loss (8 fixed batches, evaluated in high precision) is printed as the gap
to the high-precision run; "closed" is the share of the all-emulated gap a plan removes.
Means and spreads (min..max) over the seeds.

    python benchmarks/bench_advise.py [--recipes mxfp8,hybrid_block] [--seeds 3]
        [--steps 200] [--draws 3] [--model tiny|proxy] [--lr 1e-3] [--threads 2]
        [--plant blocks.0.attn.proj] [--oracle] [--warmup 30]

``--oracle``: per candidate layer, the trained gap it closes when kept alone (every
other layer emulated), over the seeds, how well that gap agrees with itself from seed
to seed, and each estimator's rank agreement with it (the error alone that ranks, the
leave-one-out gain, the one-step loss change).

"noise" is the gap between two high-precision runs whose batches are drawn in another
order: a plan's gap within it is not told apart from none.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

from floatguard import EmulationRecipe, advise, emulate, restore
from floatguard.demo import GPT, TINY, GPTConfig, synthetic_batch

PROXY = GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=4, n_embd=192)


def _loss(cfg: GPTConfig):  # type: ignore[no-untyped-def]
    def lm(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]).reshape(-1, cfg.vocab_size), batch[1].reshape(-1))

    return lm


def _fit(order: list[str], share: dict[str, float], budget: float) -> list[str]:
    keep, used = [], 0.0
    for n in order:
        if used + share[n] <= budget + 1e-12:
            keep.append(n)
            used += share[n]
    return keep


def _plant(model: torch.nn.Module, name: str | None) -> torch.nn.Module:
    """A layer made hard for a block-scaled recipe, the same in every configuration: the
    first channel of every 16 of its input is a constant 60, so in a 1x16 block (NVFP4)
    it sets the scale and the signal beside it flushes to zero."""
    if name:

        def hook(m: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
            x = args[0].clone()
            x[..., ::16] = 60.0
            return (x,)

        dict(model.named_modules())[name].register_forward_pre_hook(hook)
    return model


def _seeded(cfg: GPTConfig, seed: int, plant: str | None):  # type: ignore[no-untyped-def]
    """The seed's model (planted), its initial state and the 4 batches advise measures."""
    torch.manual_seed(seed)
    model = _plant(GPT(cfg), plant)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    return model, init, [synthetic_batch(cfg, 16, generator=gen) for _ in range(4)]


def _train(
    cfg, init, recipe, keep, names, steps, seed, held, lr, data_seed=None, plant=None
) -> float:  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    model = _plant(GPT(cfg), plant)
    model.load_state_dict(init)
    emulated = recipe is not None and len(keep) < len(names)
    if emulated:
        wanted = set(names) - set(keep)
        emulate(model, recipe, skip=lambda n, m: n not in wanted)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(1000 + seed if data_seed is None else data_seed)
    lm = _loss(cfg)
    for _ in range(steps):
        loss = lm(model, synthetic_batch(cfg, 16, generator=gen))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if emulated:
        restore(model)
    model.eval()
    with torch.no_grad():
        return statistics.fmean(float(lm(model, b)) for b in held)


def _oracle(args: argparse.Namespace, cfg: GPTConfig, held: list) -> None:  # type: ignore[type-arg]
    """Is the estimator right layer by layer? For each candidate, the trained gap it
    closes kept alone (every other layer emulated), against what advise measured."""
    from itertools import combinations

    from floatguard.advise.plan import spearman as _spearman

    for rname in args.recipes.split(","):
        recipe = getattr(EmulationRecipe, rname)()
        truth: dict[int, dict[str, float]] = {}
        est: dict[str, dict[int, dict[str, float]]] = {"alone": {}, "gain": {}, "loss": {}}
        for seed in range(args.seeds):
            model, init, probe = _seeded(cfg, seed, args.plant)
            a = advise(model, probe, recipe, loss_fn=_loss(cfg), budget=1, seed=seed,
                       warmup_steps=args.warmup)  # fmt: skip
            names = list(a.ranking)
            run = (args.steps, seed, held, args.lr, None, args.plant)
            ref = _train(cfg, init, None, [], [], *run)
            every = _train(cfg, init, recipe, [], names, *run) - ref
            truth[seed] = {n: every - (_train(cfg, init, recipe, [n], names, *run) - ref)
                           for n in names}  # fmt: skip
            est["alone"][seed] = {la.name: la.error for la in a.layers}
            est["gain"][seed] = {la.name: la.gain or 0.0 for la in a.layers}
            est["loss"][seed] = {la.name: abs(la.loss_delta) for la in a.layers}
            print(f"#   {rname} seed {seed}: everything emulated {every:+.4f}", flush=True)
        seeds = sorted(truth)
        names = list(truth[seeds[0]])
        mean = {n: statistics.fmean(truth[s][n] for s in seeds) for n in names}
        print(f"\n{rname}: the trained gap each layer closes kept alone (mean, min..max over "
              "seeds), and its FLOP share")  # fmt: skip
        for n in sorted(names, key=lambda n: -mean[n]):
            vals = [truth[s][n] for s in seeds]
            print(f"  {n}: {mean[n]:+.4f} ({min(vals):+.4f}..{max(vals):+.4f})")
        pairs = [_spearman([truth[x][n] for n in names], [truth[y][n] for n in names])
                 for x, y in combinations(seeds, 2)]  # fmt: skip
        finite = [p for p in pairs if p is not None]
        print(f"  seed-to-seed rank agreement of that gap (Spearman, mean of pairs): "
              f"{statistics.fmean(finite):+.2f} "
              f"({min(finite):+.2f}..{max(finite):+.2f})")  # fmt: skip
        for key, by_seed in est.items():
            m = {n: statistics.fmean(by_seed[s][n] for s in seeds) for n in names}
            rho = _spearman([m[n] for n in names], [mean[n] for n in names])
            said = "undefined" if rho is None else f"{rho:+.2f}"
            print(f"  estimator {key!r} (mean over seeds) vs the trained gap: Spearman {said}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", default="mxfp8,hybrid_block")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--draws", type=int, default=3)
    ap.add_argument("--model", choices=("tiny", "proxy"), default="tiny")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--plant", default=None, help="a layer made hard for 1x16 blocks")
    ap.add_argument("--warmup", type=int, default=30, help="advise's warmup_steps")
    ap.add_argument("--oracle", action="store_true",
                    help="per layer: the trained gap it closes alone, vs estimators")  # fmt: skip
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    cfg = TINY if args.model == "tiny" else PROXY
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(99)
    held = [synthetic_batch(cfg, 16, generator=g) for _ in range(8)]
    print(f"# bench_advise: {args.model} GPT {cfg}, {args.steps} steps, AdamW lr {args.lr}, "
          f"planted: {args.plant}, advise's warm-up: {args.warmup} steps, "
          f"seeds 0..{args.seeds - 1}, {args.draws} random draws, "
          f"torch {torch.__version__}")  # fmt: skip
    if args.oracle:
        _oracle(args, cfg, held)
        return
    rows: dict[tuple[str, str], list[float]] = {}
    t0 = time.time()
    for rname in args.recipes.split(","):
        recipe = getattr(EmulationRecipe, rname)()
        for seed in range(args.seeds):
            model, init, probe = _seeded(cfg, seed, args.plant)
            ref = _train(cfg, init, None, [], [], args.steps, seed, held, args.lr, None, args.plant)
            # the noise floor: high precision again, the batches drawn in another order
            other = _train(
                cfg, init, None, [], [], args.steps, seed, held, args.lr, 5000 + seed, args.plant
            )
            rows.setdefault((rname, "noise: fp32, other batches"), []).append(other - ref)
            plans = {}
            for budget in (0.1, 0.2):
                a = advise(model, probe, recipe, loss_fn=_loss(cfg), budget=budget, seed=seed,
                           warmup_steps=args.warmup)  # fmt: skip
                names = list(a.ranking)
                share = {la.name: la.share for la in a.layers}
                order = [n for n, _ in model.named_modules() if n in share]
                plans[f"advisor {budget:.0%}"] = [list(a.keep)]
                plans[f"last layers {budget:.0%}"] = [_fit(order[::-1], share, budget)]
                rng = random.Random(seed)
                plans[f"random {budget:.0%}"] = [
                    _fit(rng.sample(order, len(order)), share, budget) for _ in range(args.draws)
                ]
            gaps_of: dict[frozenset[str], float] = {}  # a plan met twice is trained once
            for keep in [[], *(k for ks in plans.values() for k in ks)]:
                if frozenset(keep) not in gaps_of:
                    low = _train(
                        cfg,
                        init,
                        recipe,
                        keep,
                        names,
                        args.steps,
                        seed,
                        held,
                        args.lr,
                        None,
                        args.plant,
                    )
                    gaps_of[frozenset(keep)] = low - ref
            every = gaps_of[frozenset()]
            rows.setdefault((rname, "everything emulated"), []).append(every)
            for label, keeps in plans.items():
                gaps = [gaps_of[frozenset(k)] for k in keeps]
                rows.setdefault((rname, label), []).append(statistics.fmean(gaps))
                rows.setdefault((rname, label + " closed"), []).append(
                    1 - statistics.fmean(gaps) / every if every else float("nan")
                )
            chosen = {k: v[0] for k, v in plans.items() if "advisor" in k}
            print(f"#   {rname} seed {seed} done ({time.time() - t0:.0f} s); plans: {chosen}",
                  flush=True)  # fmt: skip
    print("\n| recipe | configuration | held-out loss gap to high precision (mean, min..max) "
          "| share of the all-emulated gap closed (mean, min..max) |")  # fmt: skip
    print("|---|---|---:|---:|")
    for (rname, label), vals in rows.items():
        if label.endswith(" closed"):
            continue
        closed = rows.get((rname, label + " closed"))
        c = (f"{statistics.fmean(closed):+.0%} ({min(closed):+.0%}..{max(closed):+.0%})"
             if closed else "")  # fmt: skip
        print(f"| {rname} | {label} | {statistics.fmean(vals):+.4f} "
              f"({min(vals):+.4f}..{max(vals):+.4f}) | {c} |")  # fmt: skip


if __name__ == "__main__":
    main()
