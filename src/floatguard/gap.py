"""The loss gap a recipe costs on a model, with its seed spread: "is this gap expected?"

A user comparing an FP8 (or FP4) run on a GPU against a BF16 run sees a validation loss
a little higher and cannot tell an expected gap from a bug (Megatron-LM#1152: "FP8 vs
BF16 loss differ by about 2e-2: is this expected?"). :func:`expected_gap` trains copies
of the model for ``steps`` optimizer steps, once in high precision and once under the
emulated recipe, from the same weights, the same batches in the same order and the same
RNG, for each seed; the gap is the held-out loss (evaluated in high precision, in eval
mode, without gradients) of the emulated run minus the high-precision run's. The seeds
change the batch order (a fresh shuffle of ``batches`` every pass) and torch's RNG
(dropout masks, stochastic rounding), not the initial weights, which are the model's.

Limits: the gap is this model's, on these batches, after these steps; a larger model
or a longer run can cost more or less (a gap usually grows with training tokens in the
reports above). It answers "is my GPU run's gap within what the recipe's numerics cost
here?", and a gap far above it points at something the recipe does not explain: a layer
quantized that the recipe keeps, scales not reduced across ranks, a kernel bug.

Cost: ``len(seeds) * steps * (1 + configurations)`` forward+backward passes and as many
optimizer steps, plus the evaluations; the model, its gradients and torch's RNG are
left as they were (the work is done on deep copies, under a forked RNG).
"""

from __future__ import annotations

import copy
import math
import random
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from floatguard.batch_loss import batch_loss, check_loss_fn, output_loss
from floatguard.emulation import EmulationRecipe, check_skip, emulate, is_emulated, restore

__all__ = ["ExpectedGap", "expected_gap"]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
Skip = tuple[str, ...] | Callable[[str, nn.Module], bool] | None


@dataclass(frozen=True)
class ExpectedGap:
    """The loss gap a recipe costs (emulated minus high precision), measured.

    ``basis``: ``"trained"`` (``gaps`` are the held-out loss gaps after ``steps``
    optimizer steps, one per seed) or ``"step"`` (no training: ``gaps`` are the loss
    changes of one forward pass per batch, the cheap stand-in :func:`floatguard.advise`
    gives without ``train_steps``; ``seeds`` then holds the seed the passes ran under).
    ``mean``, ``spread`` (sample standard deviation; 0 for one value), ``low`` and
    ``high`` summarize ``gaps``; ``reference``: the high-precision held-out losses;
    ``config``: what was emulated ("every candidate emulated", "the plan", ...)."""

    basis: str
    steps: int
    seeds: tuple[int, ...]
    gaps: tuple[float, ...]
    reference: tuple[float, ...] = ()
    config: str = ""

    @property
    def mean(self) -> float:
        return statistics.fmean(self.gaps) if self.gaps else math.nan

    @property
    def spread(self) -> float:
        finite = [g for g in self.gaps if math.isfinite(g)]
        return statistics.stdev(finite) if len(finite) > 1 else 0.0

    @property
    def low(self) -> float:
        return min(self.gaps) if self.gaps else math.nan

    @property
    def high(self) -> float:
        return max(self.gaps) if self.gaps else math.nan

    @property
    def upper(self) -> float:
        """The largest gap still called expected: the largest of the highest gap seen,
        the mean plus three spreads (few seeds estimate the spread roughly) and three
        spreads above no gap at all (a gap at or below zero is no sign of a bug even
        where the measured gaps are all negative, i.e. seed noise)."""
        return max(self.high, self.mean + 3 * self.spread, 3 * self.spread)

    @property
    def diverged(self) -> int:
        """How many of the emulated runs diverged (an infinite gap)."""
        return sum(1 for g in self.gaps if g == math.inf)

    def is_expected(self, observed: float) -> bool:
        """Whether an observed gap (your low-precision run's loss minus your
        high-precision run's, same data) is one the recipe's numerics explain: no larger
        than :attr:`upper`, or any gap at all (a diverged run too) when the emulated run
        itself diverged. Never for NaN or -inf (the high-precision run diverged)."""
        x = _observed(observed)
        if math.isnan(x) or x == -math.inf or not self.gaps:
            return False
        return bool(self.diverged) or x <= self.upper

    def judge(self, observed: float) -> str:
        """One sentence: is ``observed`` a gap the recipe's numerics explain here?"""
        x = _observed(observed)
        where = f" ({self.config})" if self.config else ""
        if not self.gaps or (math.isnan(self.mean) and not self.diverged):
            return "nothing was measured: no gap can be judged"
        if math.isnan(x):
            return "a gap of nan is no gap: one of the runs computed NaN"
        if x == -math.inf:
            return f"a gap of {x} is no gap: the high-precision run diverged"
        if self.diverged:
            return (
                f"a gap of {x:+.4g} is expected: the emulated run itself diverged in "
                f"{self.diverged} of {len(self.gaps)} seed(s){where}, so the recipe does not "
                "train this model as configured and a gap of any size is no evidence of a bug"
            )
        if x == math.inf:
            return (
                f"a gap of {x} is no gap: the low-precision run diverged, which the emulated "
                f"runs did not ({self}{where}): look for what the recipe does not explain"
            )
        caveat = (
            f" (measured on one step{', untrained' if not self.steps else ''}: "
            "advise(train_steps=...) or --train-steps measures the gap after training, "
            "what a run's gap is compared with)"
            if self.basis == "step" else ""
        )  # fmt: skip
        if x < min(self.low, 0.0) - 3 * self.spread - 1e-12:
            return (
                f"a gap of {x:+.4g} is smaller than the recipe costs here ({self}{where}): "
                "the low-precision run did better than its numerics predict; no sign of a "
                "numerics problem, but check the two runs are compared like for like" + caveat
            )
        if x <= self.upper:
            return (
                f"a gap of {x:+.4g} is expected: the recipe costs {self} here{where}, up to "
                f"{self.upper:+.4g}" + caveat
            )
        return (
            f"a gap of {x:+.4g} is larger than the recipe's numerics cost here ({self}{where}, "
            f"up to {self.upper:+.4g}): look for what the recipe does not explain (a layer "
            "quantized that the recipe keeps in high precision, scales not reduced across "
            "ranks, a different data order or learning rate, a kernel bug)" + caveat
        )

    def __format__(self, spec: str) -> str:
        if spec not in ("", "s"):
            raise ValueError(f"ExpectedGap format {spec!r}: use '' or 's'")
        if self.basis == "trained":
            where = f"over {len(self.gaps)} seed(s) after {self.steps} step(s)"
        elif self.steps:
            where = f"over {len(self.gaps)} batch(es) of one step after a {self.steps}-step warm-up"
        else:
            where = f"over {len(self.gaps)} batch(es) of one step, untrained"
        finite = [g for g in self.gaps if math.isfinite(g)]
        if self.diverged:
            head = f"diverged in {self.diverged} of {len(self.gaps)}"
            if not finite:
                return f"{head} {where}"
            return (
                f"{head}; the others {statistics.fmean(finite):+.4g} ± {self.spread:.2g} "
                f"({min(finite):+.4g}..{max(finite):+.4g}) {where}"
            )
        return f"{self.mean:+.4g} ± {self.spread:.2g} ({self.low:+.4g}..{self.high:+.4g}) {where}"

    def __str__(self) -> str:
        return format(self, "s")

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready but for non-finite floats)."""
        return {
            "basis": self.basis, "steps": self.steps, "seeds": list(self.seeds),
            "gaps": list(self.gaps), "reference": list(self.reference), "mean": self.mean,
            "spread": self.spread, "low": self.low, "high": self.high, "upper": self.upper,
            "config": self.config,
        }  # fmt: skip


def _observed(observed: object) -> float:
    """A gap given to judge / is_expected as a float (a 0-d tensor or numpy number too)."""
    try:
        return float(observed)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TypeError(
            f"ExpectedGap: the observed gap must be a number (your low-precision run's loss "
            f"minus your high-precision run's), got {observed!r}"
        ) from None


def expected_gap(
    model: nn.Module,
    batches: Iterable[Any],
    recipe: EmulationRecipe,
    *,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    steps: int = 100,
    seeds: int | Sequence[int] = 3,
    optimizer: OptimizerFactory | None = None,
    eval_batches: Iterable[Any] | None = None,
    skip: Skip = None,
) -> ExpectedGap:
    """The held-out loss gap ``recipe`` costs ``model`` after ``steps`` optimizer steps
    on ``batches`` (cycled, reshuffled every pass), over ``seeds`` (an int ``n``: seeds
    0..n-1, or the seeds themselves); see the module for what varies with the seed, the
    cost and the limits. ``optimizer(params)`` builds the optimizer (default AdamW,
    lr 1e-3: pass your own schedule's optimizer to measure your run's gap);
    ``eval_batches``: the held-out batches (default: ``batches`` themselves, which
    measures the training loss); ``skip``: as :func:`floatguard.emulate`'s (default: the
    recipe's own). ``loss_fn(model, batch)`` as :func:`floatguard.audit`'s."""
    check_skip(skip, "expected_gap")
    return trained_gaps(
        model, batches, recipe, [skip], loss_fn=loss_fn, steps=steps, seeds=seeds,
        optimizer=optimizer, eval_batches=eval_batches,
        configs=["the recipe's layers emulated" if skip is None else "as skip= leaves them"],
    )[0]  # fmt: skip


def trained_gaps(
    model: nn.Module,
    batches: Iterable[Any],
    recipe: EmulationRecipe,
    skips: list[Skip],
    *,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None,
    steps: int,
    seeds: int | Sequence[int],
    optimizer: OptimizerFactory | None,
    eval_batches: Iterable[Any] | None,
    configs: list[str],
    who: str = "expected_gap",
) -> list[ExpectedGap]:
    """One :class:`ExpectedGap` per entry of ``skips`` (each an emulate() skip, its
    ``configs`` entry saying what it emulates), the high-precision run trained once per
    seed for all of them."""
    check_model(model, recipe, loss_fn, who)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{who}: steps={steps!r}; give an int >= 1 (optimizer steps)")
    seed_list = seed_list_of(seeds, who)
    if optimizer is not None and not callable(optimizer):
        raise TypeError(
            f"{who}: optimizer={optimizer!r} must build one from the parameters, e.g. "
            "optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4)"
        )
    data = listed(batches, "batches", who)
    held = data if eval_batches is None else listed(eval_batches, "eval_batches", who)
    make = optimizer if optimizer is not None else _adamw
    refs: list[float] = []
    gaps: list[list[float]] = [[] for _ in skips]
    for seed in seed_list:
        ref = _train(model, data, held, None, None, loss_fn, steps, seed, make, who)
        if not math.isfinite(ref):
            raise ValueError(
                f"{who}: the high-precision run diverged (a non-finite loss) with seed "
                f"{seed}: no gap can be measured against it; lower the learning rate "
                "(optimizer=...) or fix the model or data first"
            )
        refs.append(ref)
        for i, skip in enumerate(skips):
            got = _train(model, data, held, recipe, skip, loss_fn, steps, seed, make, who)
            gaps[i].append(got - ref if math.isfinite(got) else math.inf)
    return [
        ExpectedGap("trained", steps, tuple(seed_list), tuple(g), tuple(refs), c)
        for g, c in zip(gaps, configs, strict=True)
    ]


def check_model(model: object, recipe: object, loss_fn: object, who: str) -> None:
    """A high-precision nn.Module, an EmulationRecipe and a loss_fn(model, batch), or a
    clear error naming the bad one and its fix."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who}: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(recipe, EmulationRecipe):
        raise TypeError(
            f"{who}: recipe must be an EmulationRecipe (e.g. EmulationRecipe.nvfp4(), "
            "EmulationRecipe.mxfp8()), "
            f"got {type(recipe).__name__}"
        )
    check_loss_fn(loss_fn, who)
    if is_emulated(model):
        raise ValueError(
            f"{who}: the model is already emulate()d; pass the high-precision model "
            "(restore(model) first)"
        )


def seed_list_of(seeds: object, who: str) -> list[int]:
    """``seeds`` (an int n: 0..n-1; or a list of ints) as a list; a clear error else."""
    if isinstance(seeds, int) and not isinstance(seeds, bool):
        if seeds < 1:
            raise ValueError(f"{who}: seeds={seeds!r}; give an int >= 1 or a list of seeds")
        return list(range(seeds))
    if (
        isinstance(seeds, (list, tuple))
        and seeds
        and all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
    ):
        return [int(s) for s in seeds]
    raise TypeError(
        f"{who}: seeds={seeds!r}; give an int >= 1 (seeds 0..n-1) or a non-empty list of ints"
    )


def listed(batches: object, what: str, who: str) -> list[Any]:
    """``batches`` as a non-empty list, or a clear error (a tensor alone is refused: it
    would be iterated row by row)."""
    if isinstance(batches, (torch.Tensor, str, bytes)) or not isinstance(batches, Iterable):
        raise TypeError(
            f"{who}: {what} must be a list of batches, got {type(batches).__name__} "
            "(a tensor alone: [x])"
        )
    data = list(batches)
    if not data:
        raise ValueError(f"{who}: give a non-empty list of {what} (a tensor alone: [x])")
    return data


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def trained_copy(
    model: nn.Module,
    data: list[Any],
    recipe: EmulationRecipe | None,
    skip: Skip,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None,
    steps: int,
    seed: int,
    make: OptimizerFactory | None,
    who: str,
) -> nn.Module | None:
    """A copy of ``model`` trained ``steps`` optimizer steps on ``data`` (cycled,
    reshuffled every pass by ``random.Random(seed)``, torch's RNG forked and seeded with
    ``seed``), emulated under ``recipe`` unless None (and restored after); None when a
    loss went non-finite. ``model`` and the RNG are left as they were."""
    work = copy.deepcopy(model)  # every submodule keeps its own train/eval mode
    params = [p for p in work.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{who}: no parameter of the model requires grad: nothing to train")
    for p in params:
        p.grad = None
    if recipe is not None:
        emulate(work, recipe, skip=(recipe.skip or ()) if skip is None else skip)
    devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    order = random.Random(seed)
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            opt = (make or _adamw)(params)
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(
                    f"{who}: optimizer(params) returned {type(opt).__name__}, not a "
                    "torch.optim.Optimizer (e.g. lambda params: torch.optim.AdamW(params))"
                )
            queue: list[Any] = []
            for _ in range(steps):
                if not queue:
                    queue = list(data)
                    order.shuffle(queue)
                loss = _training_loss(loss_fn, work, queue.pop(), who)
                if not torch.isfinite(loss.detach()):  # a diverged run
                    return None
                loss.backward()  # type: ignore[no-untyped-call]
                opt.step()
                opt.zero_grad(set_to_none=True)
            for p in params:
                p.grad = None
    finally:
        if recipe is not None:
            restore(work)
    return work


def _training_loss(
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None,
    model: nn.Module,
    batch: Any,
    who: str,
) -> torch.Tensor:
    """The loss to train on: ``loss_fn``'s, or the model's own; never the mean of an
    output (training would minimize the logits)."""
    if loss_fn is not None:
        return batch_loss(loss_fn, model, batch, who)
    out = model(**batch) if isinstance(batch, dict) else model(batch)
    loss, own = output_loss(out, who)
    if not own:
        raise ValueError(
            f"{who}: the model returned no loss of its own (a Hugging Face model given no "
            "labels?): training on the mean of its output is meaningless; put labels in "
            "the batches or pass loss_fn=..."
        )
    return loss


def _train(
    model: nn.Module,
    data: list[Any],
    held: list[Any],
    recipe: EmulationRecipe | None,
    skip: Skip,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None,
    steps: int,
    seed: int,
    make: OptimizerFactory,
    who: str,
) -> float:
    """:func:`trained_copy`'s mean held-out loss, in high precision, in eval mode, without
    gradients; inf when a loss went non-finite."""
    work = trained_copy(model, data, recipe, skip, loss_fn, steps, seed, make, who)
    if work is None:
        return math.inf
    work.eval()
    with torch.no_grad():
        losses = [float(batch_loss(loss_fn, work, b, who)) for b in held]
    mean = statistics.fmean(losses)
    return mean if math.isfinite(mean) else math.inf
