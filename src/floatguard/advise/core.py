"""advise(): the measurements in order, the plan, the expected gap."""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from floatguard.advise.measure import (
    GEMMS,
    OPERANDS,
    Runner,
    cuda_devices,
    gap_of,
    no_flops,
    only_gemm,
)
from floatguard.advise.plan import plan, recipe_name, recipe_notes, recommend, spearman
from floatguard.advise.result import Advice, Exactly, LayerAdvice, Skip
from floatguard.emulation import EmulationRecipe, check_skip, emulate, restore
from floatguard.emulation.coverage import coverage
from floatguard.gap import (
    ExpectedGap,
    OptimizerFactory,
    check_model,
    listed,
    seed_list_of,
    trained_copy,
    trained_gaps,
)

__all__ = ["advise"]


def advise(
    model: nn.Module,
    batches: Iterable[Any],
    recipe: EmulationRecipe,
    *,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    budget: float | int = 0.1,
    skip: Skip = None,
    per_gemm: bool = True,
    leave_one_out: bool = True,
    seed: int = 0,
    train_steps: int = 0,
    seeds: int | Sequence[int] = 3,
    optimizer: OptimizerFactory | None = None,
    eval_batches: Iterable[Any] | None = None,
    name: str | None = None,
    warmup_steps: int = 0,
) -> Advice:
    """Rank the GEMM layers ``emulate(model, recipe, skip=skip)`` would swap by how much
    each one's emulation moves the gradient (and the loss), and plan which to keep in
    high precision under ``budget`` (see the module for the estimator, the cost and the
    limits). ``loss_fn(model, batch)`` as :func:`floatguard.audit` (default: the model's
    own loss). The model runs in the mode it is in. With ``train_steps``, the expected
    gap (everything emulated, and the plan) is measured after that many optimizer steps
    over ``seeds`` by :func:`floatguard.expected_gap` (``optimizer``, ``eval_batches``
    as there); without, it is the one-step loss change per batch. ``name``: the
    recipe's name in the advice and the report (default: the preset it equals, e.g.
    ``"nvfp4_training"``, else the operand recipe's class). Returns an :class:`Advice`.

    ``warmup_steps``: first train a copy that many steps in high precision (``optimizer``,
    the batches cycled, as :func:`floatguard.expected_gap` trains) and measure that copy:
    a randomly initialized model's sensitivities do not predict training's (on the tiny
    GPT under NVFP4 the rank agreement with the trained gap each layer closes is 0.00 at
    initialization, 0.88 after a 30-step warm-up; docs/fp8.md). Advise a trained
    checkpoint as it is, or a fresh model with ``warmup_steps``.

    ValueError when the high-precision loss or gradient is already non-finite on a
    batch (nothing can be ranked against it), naming the batch."""
    data, budget = _check_args(model, batches, recipe, loss_fn, budget, skip, seed, per_gemm,
                       leave_one_out, train_steps, seeds, warmup_steps)  # fmt: skip
    if name is not None and not isinstance(name, str):
        raise TypeError(f"advise: name={name!r} must be a string (the recipe's name) or None")
    label = name if name is not None else recipe_name(recipe)
    seed, train_steps, warmup_steps = int(seed), int(train_steps), int(warmup_steps)
    if warmup_steps:
        warmed = trained_copy(model, data, None, None, loss_fn, warmup_steps, seed, optimizer,
                              "advise")  # fmt: skip
        if warmed is None:
            raise ValueError(
                f"advise: the high-precision warm-up diverged within {warmup_steps} steps (a "
                "non-finite loss): lower the learning rate (optimizer=...) or advise a "
                "checkpoint instead"
            )
        work = warmed
    else:
        work = copy.deepcopy(model)
    for p in work.parameters():
        p.grad = None
    given_skip, skip = skip, (recipe.skip or ()) if skip is None else skip
    names = list(emulate(work, recipe, skip=skip))
    restore(work)
    run = Runner(work, data, loss_fn, seed)
    ref = run.reference()  # first: a batch the model cannot run is named here
    with torch.random.fork_rng(devices=cuda_devices(work)):  # its stochastic rounding
        torch.manual_seed(seed)
        flops = coverage(work, data[0], recipe, loss_fn=loss_fn, skip=skip).by_module()
    total = max(sum(f.total for f in flops.values()), 1)
    passes = len(data)

    deltas: dict[frozenset[str], list[float]] = {}

    def measured(r: EmulationRecipe, emulated: Iterable[str]) -> tuple[float, float]:
        nonlocal passes
        wanted = frozenset(emulated)
        passes += len(data)
        if not wanted:  # nothing emulated: the reference itself
            return run.against(ref)[:2]
        emulate(work, r, skip=lambda n, m: n not in wanted)
        try:
            err, delta, per_batch = run.against(ref)
        finally:
            restore(work)
        if r is recipe:
            deltas[wanted] = per_batch
        return err, delta

    everything = measured(recipe, names)
    alone: dict[str, tuple[float, float]] = {n: measured(recipe, [n]) for n in names}
    gemms: dict[str, dict[str, float]] = {n: {} for n in names}
    if per_gemm:
        ops = recipe.operands()
        quantized = [g for g in GEMMS if any(ops[o] is not None for o in OPERANDS[g])]
        for g in quantized if len(quantized) > 1 else ():  # one GEMM: the layer's own error
            only = only_gemm(recipe, g)
            for n in names:
                gemms[n][g] = measured(only, [n])[0]
    gains: dict[str, float] = {}
    if leave_one_out:
        for n in names:
            gains[n] = _gain(everything[0], measured(recipe, [m for m in names if m != n])[0])
    # the error of the layer alone ranks: after a warm-up it agreed best with the trained
    # gap a layer closes (docs/fp8.md; bench_advise --oracle)
    score = {n: alone[n][0] for n in names}
    ranking = sorted(names, key=lambda n: (-score[n], names.index(n)))
    share = {n: flops.get(n, no_flops()).total / total for n in names}
    keep = plan(ranking, share, budget, score)
    keep = [n for n in ranking if n in keep]
    plan_set = [n for n in names if n not in keep]
    planned = measured(recipe, plan_set)
    operands = run.operands(recipe, names)
    configs = ["every candidate layer emulated", f"the plan ({len(keep)} layer(s) kept)"]
    if train_steps:
        expected, expected_plan = trained_gaps(
            model, data, recipe, [skip, Exactly(frozenset(plan_set), emulated=True)],
            loss_fn=loss_fn, steps=train_steps, seeds=seeds, optimizer=optimizer,
            eval_batches=eval_batches, configs=configs, who="advise",
        )  # fmt: skip
        passes += 3 * len(expected.seeds) * train_steps
    else:
        expected, expected_plan = (
            ExpectedGap("step", warmup_steps, (seed,),
                        tuple(deltas.get(frozenset(s), [0.0] * len(data))), config=c)
            for s, c in zip((names, plan_set), configs, strict=True)
        )  # fmt: skip
    layers = tuple(
        LayerAdvice(n, flops.get(n, no_flops()).total, share[n], alone[n][0], alone[n][1],
                    gemms[n], gains.get(n), operands.get(n, {}),
                    recommend(n, keep, alone[n][0], operands.get(n, {}), label))
        for n in ranking
    )  # fmt: skip
    finite_all = math.isfinite(everything[0])
    return Advice(
        recipe=label, budget=budget, layers=layers, ranking=tuple(ranking),
        keep=tuple(keep), kept_share=sum(share[n] for n in keep),
        gap_all=gap_of(everything), gap_plan=gap_of(planned),
        predicted_plan=max(everything[0] - sum(gains[n] for n in keep), 0.0)
        if gains and finite_all else None,
        agreement=spearman([alone[n][0] for n in names], [gains[n] for n in names])
        if gains and len(names) > 2 else None,
        passes=passes + 2 + warmup_steps, notes=recipe_notes(recipe), expected=expected,
        expected_plan=expected_plan,
        base_skip=skip if given_skip is not None or recipe.skip else None,
    )  # fmt: skip


def _check_args(
    model: object, batches: object, recipe: object, loss_fn: object, budget: object,
    skip: object, seed: object, per_gemm: object, leave_one_out: object, train_steps: object,
    seeds: object, warmup_steps: object,
) -> tuple[list[Any], float | int]:  # fmt: skip
    """The arguments checked, each bad one named with its fix; the batches as a list and
    the budget as an int (layers) or a float (a FLOP fraction)."""
    check_model(model, recipe, loss_fn, "advise")
    data = listed(batches, "batches", "advise")
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise TypeError(
            f"advise: budget={budget!r}; give a fraction of GEMM FLOPs in (0, 1) (0.1: 10%) "
            "or a number of layers (an int >= 0)"
        )
    layers = isinstance(budget, numbers.Integral) and int(budget) >= 0
    if not (layers or 0 < float(budget) < 1):
        raise ValueError(
            f"advise: budget={budget!r}; give a fraction of GEMM FLOPs in (0, 1) (0.1: "
            "10%) or a number of layers (an int >= 0)"
        )
    check_skip(skip, "advise")
    for flag, value in (("per_gemm", per_gemm), ("leave_one_out", leave_one_out)):
        if not isinstance(value, bool):
            raise TypeError(f"advise: {flag}={value!r} must be True or False")
    for what, value in (("seed", seed), ("train_steps", train_steps),
                        ("warmup_steps", warmup_steps)):  # fmt: skip
        _count(what, value)
    seed_list_of(seeds, "advise")
    return data, int(budget) if isinstance(budget, numbers.Integral) else float(budget)


def _count(what: str, value: object) -> None:
    """An int >= 0 (a numpy integer too): TypeError for another type, ValueError below 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"advise: {what}={value!r} must be an int >= 0")
    if int(value) < 0:
        raise ValueError(f"advise: {what}={value!r} must be an int >= 0")


def _gain(everything: float, without: float) -> float:
    """How much keeping a layer removes from the all-emulated error: infinite when only
    it made the error infinite, none when the error stays infinite without it."""
    if math.isinf(everything):
        return 0.0 if math.isinf(without) else math.inf
    return everything - without
