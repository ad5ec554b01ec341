"""Which layers to keep in high precision under an emulated recipe, measured on a CPU.

``advise(model, batches, recipe)`` answers "which GEMM layers should stay in BF16, and
what will the gap be?" before any GPU time, with the bit-exact fake-quant of
:func:`floatguard.emulate`.

The estimator (``docs/fp8.md``, "Which layers to keep"): *measured ablation*, not a
first-order guess. On each batch the model's loss and full gradient are computed in
high precision (the reference), with every candidate layer emulated, and with one layer
at a time emulated (the others in high precision); with ``per_gemm=True`` also with
only that layer's forward (fprop), input-gradient (dgrad) or weight-gradient (wgrad)
GEMM emulated; with ``leave_one_out=True`` also with every layer emulated but that one.
A configuration's error is the relative squared error of the whole gradient,
``||g - g_ref||^2 / ||g_ref||^2`` (its SQNR in dB is ``-10 log10``), and its loss change
``L - L_ref``, each the mean over the batches. The error of one layer alone ranks the
layers (it is what the layer adds, free of the others' noise); the leave-one-out gain
(the all-emulated error minus the error with that layer kept) is the second estimator,
and their rank agreement (Spearman) is reported: when it is low, errors interact and the
plan is measured, not only predicted. Cost, in forward+backward passes:
``len(batches) * (3 + L * (1 + G + leave_one_out))`` for ``L`` candidate layers and ``G``
GEMMs the recipe quantizes (0 with ``per_gemm=False`` or when it quantizes only one),
plus one pass for the operand statistics and one counting the FLOPs.

The plan: the layers whose errors alone sum highest while their GEMM FLOPs (forward
and backward, counted by :func:`floatguard.emulation.coverage`) fit ``budget``, a
fraction of all GEMM FLOPs (a 0/1 knapsack over the shares rounded up to budget/20000:
the errors of layers emulated together add up, e.g. on the demo's tiny GPT under MXFP8
the nine layers' errors alone sum to the all-emulated error within 1%, so a cheap
sensitive layer can be worth more than a costly one a little more sensitive), or an
int, a number of layers (the top of the ranking). A layer the recipe or ``skip``
already keeps in high precision is never proposed. The plan is then run: ``gap_plan``
is measured, and ``predicted_plan`` is the additive prediction from the leave-one-out
gains. With ``train_steps``, the expected loss gap (:func:`floatguard.expected_gap`)
costs ``3 * seeds * train_steps`` more passes and optimizer steps.

Nothing of the model changes: the work runs on a deep copy (one model's memory), with
torch's RNG forked and reseeded identically for every pass of a batch (dropout draws the
same masks in every configuration). Operand statistics (per layer, from the reference
pass; ``nn.Linear`` and GPT-2's ``Conv1D``): each operand quantized by the recipe in its
GEMM's layout, its SQNR in dB, the fraction of its nonzero values flushed to zero
(underflow), and the fraction clamped (saturation: in the tensor's top octave, more than
half an element ulp below the value; only formats and scale rules that saturate, as MX's
``floor``, show any).
"""

from __future__ import annotations

import copy
import math
import numbers
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from floatguard.batch_loss import batch_loss, check_loss_fn, output_loss
from floatguard.emulation import EmulationRecipe, check_skip, emulate, is_emulated, restore
from floatguard.emulation.coverage import coverage
from floatguard.events import EventLog
from floatguard.formats import get as get_format
from floatguard.gap import ExpectedGap, OptimizerFactory, listed, seed_list_of, trained_gaps

__all__ = ["Advice", "LayerAdvice", "advise"]

Skip = tuple[str, ...] | Callable[[str, nn.Module], bool] | None
_GEMMS = ("fprop", "dgrad", "wgrad")
_OPERANDS: dict[str, tuple[Any, ...]] = {
    "fprop": ("fprop_input", "fprop_weight"),
    "dgrad": ("dgrad_grad", "dgrad_weight"),
    "wgrad": ("wgrad_grad", "wgrad_input"),
}
_OFF = {
    "fprop": {"activation": None, "weight": None},
    "dgrad": {"dgrad_grad": None, "dgrad_weight": None},
    "wgrad": {"wgrad_grad": None, "wgrad_input": None, "wgrad_rht": None},
}


@dataclass(frozen=True)
class LayerAdvice:
    """One candidate layer: its GEMM FLOPs per step (forward and backward) and share of
    all GEMM FLOPs; ``error`` and ``loss_delta`` with only it emulated; ``gemms``: the
    error with only its fprop / dgrad / wgrad emulated (empty without ``per_gemm``);
    ``gain``: how much of the all-emulated error keeping it in high precision removes
    (None without ``leave_one_out``); ``operands``: per operand, ``sqnr_db``,
    ``underflow`` and ``saturation`` (empty for layers other than linear ones);
    ``recommendation``: the verdict in :func:`floatguard.audit`'s words ("keep in bf16"
    for a layer of the plan, else the recipe is fine for it at this budget)."""

    name: str
    flops: int
    share: float
    error: float
    loss_delta: float
    gemms: dict[str, float] = field(default_factory=dict)
    gain: float | None = None
    operands: dict[str, dict[str, float]] = field(default_factory=dict)
    recommendation: str = ""

    @property
    def sqnr_db(self) -> float:
        """The gradient's SQNR with only this layer emulated."""
        return _db(self.error)


@dataclass(frozen=True)
class Advice:
    """What :func:`advise` found. ``ranking``: the candidate layers' names, most
    sensitive first; ``keep``: the plan (names for ``emulate(..., skip=advice.keep)``,
    in ranking order); ``gap_all`` / ``gap_plan``: ``{"loss_delta", "error",
    "sqnr_db"}`` with every candidate emulated / with the plan, measured;
    ``predicted_plan``: the plan's error predicted from the leave-one-out gains;
    ``agreement``: Spearman's rank correlation of the two estimators (None when not
    measured); ``notes``: what the recipe's own rules mean for the plan;
    ``expected`` / ``expected_plan``: the loss gap the recipe costs this model with every
    candidate emulated / with the plan (:class:`~floatguard.ExpectedGap`: after
    ``train_steps`` steps over the seeds, or, without ``train_steps``, the one-step loss
    change per batch); ``expected.judge(gap)`` says whether a gap you see on a GPU is one
    the recipe's numerics explain."""

    recipe: str
    budget: float | int
    layers: tuple[LayerAdvice, ...]
    ranking: tuple[str, ...]
    keep: tuple[str, ...]
    kept_share: float
    gap_all: dict[str, float]
    gap_plan: dict[str, float]
    predicted_plan: float | None
    agreement: float | None
    passes: int
    notes: tuple[str, ...] = ()
    expected: ExpectedGap | None = None
    expected_plan: ExpectedGap | None = None
    base_skip: Skip = field(default=None, compare=False, repr=False)
    """The skip the layers were chosen under (yours or the recipe's), kept by skip()."""

    def skip(self) -> tuple[str, ...] | Callable[[str, nn.Module], bool]:
        """The plan as ``emulate()``'s ``skip``, with the skip the advice was made under
        (yours, or the recipe's own) kept: a tuple of name substrings when the plan's
        names, as substrings, match no other candidate layer and that skip was a tuple;
        else a predicate of exact names (and that skip)."""
        base = self.base_skip
        if self._exact and (base is None or isinstance(base, (tuple, list))):
            return (*(base or ()), *self.keep)
        return _Exactly(frozenset(self.keep), base=base)

    @property
    def _exact(self) -> bool:
        others = [n for n in self.ranking if n not in self.keep]
        return not any(k in n for k in self.keep for n in others)

    def summary(self, top: int = 10) -> str:
        """The ranking and the plan, in words."""
        lines = [
            f"advise {self.recipe}: {len(self.ranking)} layer(s), {self.passes} passes; "
            f"everything emulated: gradient SQNR {_dbs(self.gap_all['error'])}, loss "
            f"{self.gap_all['loss_delta']:+.4g}; the plan ({len(self.keep)} layer(s), "
            f"{self.kept_share:.1%} of GEMM FLOPs kept): {_dbs(self.gap_plan['error'])}, "
            f"loss {self.gap_plan['loss_delta']:+.4g}"
        ]
        for la in self.layers[:top]:
            gemm = ", ".join(f"{g} {_dbs(e)}" for g, e in la.gemms.items())
            lines.append(
                f"  {la.name}: {_dbs(la.error)} alone ({la.share:.1%} of FLOPs)"
                + (f"; by GEMM: {gemm}" if gemm else "")
                + (" [keep]" if la.name in self.keep else "")
            )
        skip = self.skip()
        lines.append(
            f"emulate(model, recipe, skip={skip!r})"
            if isinstance(skip, tuple)
            else f"emulate(model, recipe, skip=advice.skip())  # {skip!r}"
        )
        if self.expected is not None and self.expected_plan is not None:
            lines.append(
                f"expected loss gap, everything emulated: {self.expected}; with the plan: "
                f"{self.expected_plan} (to judge a gap you measured: "
                "advice.expected.judge(gap), or --observed GAP)"
            )
        lines.extend(self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready but for non-finite floats)."""
        return {
            "recipe": self.recipe, "budget": self.budget, "ranking": list(self.ranking),
            "keep": list(self.keep), "kept_share": self.kept_share, "gap_all": self.gap_all,
            "gap_plan": self.gap_plan, "predicted_plan": self.predicted_plan,
            "agreement": self.agreement, "passes": self.passes, "notes": list(self.notes),
            "layers": [{**la.__dict__, "sqnr_db": la.sqnr_db} for la in self.layers],
            "expected": None if self.expected is None else self.expected.to_dict(),
            "expected_plan": None if self.expected_plan is None else self.expected_plan.to_dict(),
        }  # fmt: skip

    def log(self, target: EventLog | str | os.PathLike[str], step: int = 0) -> None:
        """Append this advice to a run's event log (an :class:`~floatguard.EventLog`,
        e.g. a guard's, or a JSONL path) as an ``advice`` event: ``floatguard report``
        shows it (the sensitivity per layer, the plan, the expected gap). OSError when
        a path cannot be written."""
        fields = {
            "recipe": self.recipe, "budget": float(self.budget), "keep": list(self.keep),
            "kept_share": self.kept_share, "gap_all": self.gap_all, "gap_plan": self.gap_plan,
            "expected": None if self.expected is None else self.expected.to_dict(),
            "expected_plan": None if self.expected_plan is None else self.expected_plan.to_dict(),
            "notes": list(self.notes),
            "layers": [
                {"name": la.name, "share": la.share, "sqnr_db": la.sqnr_db,
                 "loss_delta": la.loss_delta, "recommendation": la.recommendation}
                for la in self.layers
            ],
        }  # fmt: skip
        if isinstance(target, EventLog):
            target.emit("advice", step, **fields)
            return
        if not isinstance(target, (str, os.PathLike)):
            raise TypeError(f"Advice.log: give an EventLog or a path, got {type(target).__name__}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a write that fails is raised below
            out = EventLog(target)
            try:
                out.emit("advice", step, **fields)
            finally:
                out.close()
        if out.write_error is not None:
            raise OSError(f"Advice.log: {target}: {out.write_error}")


@dataclass(frozen=True)
class _Exactly:
    """An emulate() skip by exact names: those skipped (and what ``base``, another skip,
    skips), or (``emulated``) all but those."""

    names: frozenset[str]
    emulated: bool = False
    base: Skip = None

    def __call__(self, name: str, module: nn.Module) -> bool:
        if self.emulated:
            return name not in self.names
        if name in self.names:
            return True
        base = self.base
        if base is None:
            return False
        return bool(base(name, module)) if callable(base) else any(s in name for s in base)

    def __repr__(self) -> str:
        also = "" if self.base is None else f" and what {self.base!r} skips"
        return f"<the layers {sorted(self.names)}{also}>"


def _db(error: float) -> float:
    return math.inf if error <= 0 else -10.0 * math.log10(error)


def _dbs(error: float) -> str:
    """An error in dB as the summary prints it: "exact" for none at all."""
    db = _db(error)
    return "exact" if db == math.inf else f"{db:.1f} dB"


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

    ValueError when the high-precision loss or gradient is already non-finite on a
    batch (nothing can be ranked against it), naming the batch."""
    data, budget = _check_args(model, batches, recipe, loss_fn, budget, skip, seed, per_gemm,
                       leave_one_out, train_steps, seeds)  # fmt: skip
    label = name if name is not None else _recipe_name(recipe)
    work = copy.deepcopy(model)
    for p in work.parameters():
        p.grad = None
    given_skip, skip = skip, (recipe.skip or ()) if skip is None else skip
    names = list(emulate(work, recipe, skip=skip))
    restore(work)
    run = _Runner(work, data, loss_fn, seed)
    ref = run.reference()  # first: a batch the model cannot run is named here
    with torch.random.fork_rng(devices=_cuda_devices(work)):  # its stochastic rounding
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
        quantized = [g for g in _GEMMS if any(ops[o] is not None for o in _OPERANDS[g])]
        for g in quantized if len(quantized) > 1 else ():  # one GEMM: the layer's own error
            only = _only(recipe, g)
            for n in names:
                gemms[n][g] = measured(only, [n])[0]
    gains: dict[str, float] = {}
    if leave_one_out:
        for n in names:
            gains[n] = _gain(everything[0], measured(recipe, [m for m in names if m != n])[0])
    ranking = sorted(names, key=lambda n: (-alone[n][0], names.index(n)))
    share = {n: flops.get(n, _zero()).total / total for n in names}
    keep = _plan(ranking, share, budget, {n: alone[n][0] for n in names})
    keep = [n for n in ranking if n in keep]
    plan_set = [n for n in names if n not in keep]
    plan = measured(recipe, plan_set)
    operands = run.operands(recipe, names)
    configs = ["every candidate layer emulated", f"the plan ({len(keep)} layer(s) kept)"]
    if train_steps:
        expected, expected_plan = trained_gaps(
            model, data, recipe, [skip, _Exactly(frozenset(plan_set), emulated=True)],
            loss_fn=loss_fn, steps=train_steps, seeds=seeds, optimizer=optimizer,
            eval_batches=eval_batches, configs=configs, who="advise",
        )  # fmt: skip
        passes += 3 * len(expected.seeds) * train_steps
    else:
        expected, expected_plan = (
            ExpectedGap("step", 0, (seed,),
                        tuple(deltas.get(frozenset(s), [0.0] * len(data))), config=c)
            for s, c in zip((names, plan_set), configs, strict=True)
        )  # fmt: skip
    layers = tuple(
        LayerAdvice(n, flops.get(n, _zero()).total, share[n], alone[n][0], alone[n][1],
                    gemms[n], gains.get(n), operands.get(n, {}),
                    _recommend(n, keep, alone[n][0], operands.get(n, {}), label))
        for n in ranking
    )  # fmt: skip
    finite_all = math.isfinite(everything[0])
    return Advice(
        recipe=label, budget=budget, layers=layers, ranking=tuple(ranking),
        keep=tuple(keep), kept_share=sum(share[n] for n in keep),
        gap_all=_gap(everything), gap_plan=_gap(plan),
        predicted_plan=max(everything[0] - sum(gains[n] for n in keep), 0.0)
        if gains and finite_all else None,
        agreement=_spearman([alone[n][0] for n in names], [gains[n] for n in names])
        if gains and len(names) > 2 else None,
        passes=passes + 2, notes=_notes(recipe), expected=expected, expected_plan=expected_plan,
        base_skip=skip if given_skip is not None or recipe.skip else None,
    )  # fmt: skip


def _check_args(
    model: object, batches: object, recipe: object, loss_fn: object, budget: object,
    skip: object, seed: object, per_gemm: object, leave_one_out: object, train_steps: object,
    seeds: object,
) -> tuple[list[Any], float | int]:  # fmt: skip
    """The arguments checked, each bad one named with its fix; the batches as a list and
    the budget as an int (layers) or a float (a FLOP fraction)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"advise: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(recipe, EmulationRecipe):
        raise TypeError(
            f"advise: recipe must be an EmulationRecipe (e.g. EmulationRecipe.nvfp4()), "
            f"got {type(recipe).__name__}"
        )
    check_loss_fn(loss_fn, "advise")
    if is_emulated(model):
        raise ValueError(
            "advise: the model is already emulate()d; pass the high-precision model "
            "(restore(model) first)"
        )
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
    for what, value in (("seed", seed), ("train_steps", train_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TypeError(f"advise: {what}={value!r} must be an int >= 0")
    seed_list_of(seeds, "advise")
    return data, int(budget) if isinstance(budget, numbers.Integral) else float(budget)


def _gain(everything: float, without: float) -> float:
    """How much keeping a layer removes from the all-emulated error: infinite when only
    it made the error infinite, none when the error stays infinite without it."""
    if math.isinf(everything):
        return 0.0 if math.isinf(without) else math.inf
    return everything - without


def _cuda_devices(model: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


def _zero() -> Any:
    from floatguard.emulation.coverage import Flops

    return Flops(0, 0)


def _gap(m: tuple[float, float]) -> dict[str, float]:
    return {"error": m[0], "sqnr_db": _db(m[0]), "loss_delta": m[1]}


def _only(recipe: EmulationRecipe, gemm: str) -> EmulationRecipe:
    """``recipe`` with only ``gemm``'s operands quantized (the others' resolved to None)."""
    ops = recipe.operands()
    explicit = {
        "dgrad_grad": ops["dgrad_grad"], "dgrad_weight": ops["dgrad_weight"],
        "wgrad_grad": ops["wgrad_grad"], "wgrad_input": ops["wgrad_input"],
    }  # fmt: skip
    off: dict[str, Any] = {}
    for g in _GEMMS:
        if g != gemm:
            off.update(_OFF[g])
    return replace(recipe, **{**explicit, **off})


def _plan(
    ranking: list[str], share: dict[str, float], budget: float | int, error: dict[str, float]
) -> list[str]:
    """The layers whose errors sum highest with their FLOP shares within ``budget`` (a
    0/1 knapsack over shares in units of budget/20000, rounded up so the plan fits; ties
    to the ranking's order), or the top ``budget`` of the ranking for a layer count."""
    if isinstance(budget, int):
        return ranking[:budget]
    units = 20_000
    cost = [math.ceil(share[n] / budget * units - 1e-6) for n in ranking]
    best = np.zeros(units + 1)
    took = np.zeros((len(ranking), units + 1), dtype=bool)
    for i, n in enumerate(ranking):
        c, v = cost[i], error[n] if math.isfinite(error[n]) else 1e300
        if c > units:
            continue
        with_it = best[: units + 1 - c] + v  # best[cap - c] + v for cap in c..units
        better = with_it > best[c:]
        took[i, c:] = better
        best[c:] = np.where(better, with_it, best[c:])
    keep, cap = [], units
    for i in range(len(ranking) - 1, -1, -1):
        if took[i, cap]:
            keep.append(ranking[i])
            cap -= cost[i]
    return keep[::-1]


def _spearman(a: list[float], b: list[float]) -> float | None:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    pairs = [(x, y) for x, y in zip(a, b, strict=True) if not (math.isnan(x) or math.isnan(y))]
    if len(pairs) < 3:
        return None
    ra, rb = ranks([x for x, _ in pairs]), ranks([y for _, y in pairs])
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return None if va == 0 or vb == 0 else cov / math.sqrt(va * vb)


def _recommend(
    name: str,
    keep: list[str],
    error: float,
    operands: dict[str, dict[str, float]],
    recipe: str,
) -> str:
    """The layer's verdict in audit's words (``keep in high precision``, ``... safe``),
    with the measurement behind it: the gradient SQNR alone and the worst operand's
    losses."""
    worst = ""
    if operands:
        op, st = max(operands.items(), key=lambda kv: kv[1]["underflow"] + kv[1]["saturation"])
        lost = st["underflow"] + st["saturation"]
        if lost > 0:
            kind = "underflow" if st["underflow"] >= st["saturation"] else "saturation"
            worst = f"; {op} loses {lost:.2%} of values ({kind})"
    what = f"gradient SQNR {_dbs(error)} with only it emulated{worst}"
    if name in keep:
        return f"keep in high precision (the plan): {what}"
    return f"{recipe} safe at this budget: {what}"


_PRESETS = ("nvfp4_training", "nvfp4", "mxfp8", "hybrid_block", "hybrid_tensorwise",
            "hybrid_rowwise", "torchao_rowwise", "deepseek_v3", "deepgemm")  # fmt: skip


def _recipe_name(recipe: EmulationRecipe) -> str:
    """The preset ``recipe`` equals (``"nvfp4_training"``), else its operand recipe's
    class with "custom" (``"custom MX"``)."""
    for preset in _PRESETS:
        try:
            if getattr(EmulationRecipe, preset)() == recipe:
                return preset
        except (TypeError, ValueError):  # a recipe whose fields do not compare
            break
    ops = recipe.operands()
    first = next((v for v in ops.values() if v is not None), None)
    return f"custom {type(first).__name__}" if first is not None else "custom"


def _notes(recipe: EmulationRecipe) -> tuple[str, ...]:
    ops = {type(v).__name__ for v in recipe.operands().values() if v is not None}
    notes = []
    if "NVFP4" in ops:
        notes.append(
            "NVFP4: the weight's 16x16 2-D scaling and the wgrad RHT are part of the recipe "
            "measured here; NVIDIA's recipe also keeps some layers (the last blocks) in BF16: "
            "compare that choice with this plan before training"
        )
    if "MX" in ops:
        notes.append(
            "MX: scales are shared by blocks of 32 along each GEMM's reduction dim: a layer "
            "whose reduction dim is not a multiple of 32 is padded, and one outlier per block "
            "sets the scale of 31 neighbours"
        )
    return tuple(notes)


class _Runner:
    """Forward and backward passes of the work copy, reseeded per batch."""

    def __init__(self, model: nn.Module, batches: list[Any], loss_fn: Any, seed: int) -> None:
        self.model, self.batches, self.loss_fn, self.seed = model, batches, loss_fn, seed
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.devices = _cuda_devices(model)
        self.warned = False

    def loss(self, batch: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            return batch_loss(self.loss_fn, self.model, batch, "advise")
        out = self.model(**batch) if isinstance(batch, dict) else self.model(batch)
        loss, own = output_loss(out, "advise")
        if not own and not self.warned:
            self.warned = True
            warnings.warn(
                "advise: the model returned no loss (a Hugging Face model given no labels?): "
                "ranking on the mean of its output, which says little of training; put "
                "labels in the batches or pass loss_fn=...",
                stacklevel=4,
            )
        return loss

    def one(self, i: int, batch: Any) -> tuple[float, torch.Tensor]:
        with torch.random.fork_rng(devices=self.devices):
            torch.manual_seed(self.seed + i)
            for p in self.params:
                p.grad = None
            loss = self.loss(batch)
            if loss.numel() != 1:
                raise ValueError(
                    f"advise: the loss of batch {i} has shape {tuple(loss.shape)}; loss_fn "
                    "must return one number (reduce it: .mean())"
                )
            if not loss.requires_grad:
                raise ValueError(
                    f"advise: the loss of batch {i} does not require grad (detached, under "
                    "no_grad, or no parameter requires grad): nothing can be measured"
                )
            loss.backward()  # type: ignore[no-untyped-call]
        grads = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().flatten()
            for p in self.params
        ]
        for p in self.params:
            p.grad = None
        return float(loss.detach()), torch.cat(grads) if grads else torch.zeros(0)

    def reference(self) -> list[tuple[float, torch.Tensor]]:
        """The high-precision loss and gradient per batch; an error naming the batch
        when the model cannot run it or its loss or gradient is already non-finite."""
        out = []
        for i, b in enumerate(self.batches):
            try:
                got = self.one(i, b)
            except (RuntimeError, TypeError, IndexError, KeyError, AttributeError) as e:
                if hasattr(e, "add_note"):
                    e.add_note(
                        f"advise: raised by the high-precision pass on batch {i}: each batch "
                        "is given to loss_fn(model, batch), or, without loss_fn, to the "
                        "model (a dict as keywords); pass loss_fn=... for any other call"
                    )
                raise
            if not math.isfinite(got[0]) or not bool(torch.isfinite(got[1]).all()):
                what = "loss" if not math.isfinite(got[0]) else "gradient"
                raise ValueError(
                    f"advise: the high-precision {what} of batch {i} is already non-finite "
                    "(before any emulation): nothing can be ranked against it; fix the model "
                    "or the data first (floatguard.Guard or replay() locate where)"
                )
            out.append(got)
        return out

    def against(self, ref: list[tuple[float, torch.Tensor]]) -> tuple[float, float, list[float]]:
        """(mean relative squared gradient error, mean loss change, the loss changes per
        batch) against ``ref``."""
        errors, deltas = [], []
        for i, b in enumerate(self.batches):
            loss, g = self.one(i, b)
            r_loss, r = ref[i]
            denom = float(r.pow(2).sum())
            diff = float((g - r).pow(2).sum())
            err = diff / denom if denom > 0 else (0.0 if diff == 0 else math.inf)
            errors.append(err if math.isfinite(err) else math.inf)
            deltas.append(loss - r_loss)
        return sum(errors) / len(errors), sum(deltas) / len(deltas), deltas

    def operands(self, recipe: EmulationRecipe, names: list[str]) -> dict[str, dict[str, Any]]:
        """Per linear layer, its operands on the first batch quantized in their GEMMs'
        layouts: SQNR dB, underflow and saturation fractions."""
        seen: dict[str, dict[str, torch.Tensor]] = {}
        handles = []
        for name, m in self.model.named_modules():
            w = getattr(m, "weight", None)
            conv1d = type(m).__name__ == "Conv1D"
            if name not in names or not (isinstance(m, nn.Linear) or conv1d):
                continue
            if not isinstance(w, torch.Tensor) or w.dim() != 2:
                continue

            def fwd(
                mod: nn.Module, args: Any, out: Any, name: str = name, t: bool = conv1d
            ) -> None:
                x = args[0].detach().reshape(-1, args[0].shape[-1])
                wt = getattr(mod, "weight").detach()  # noqa: B009
                seen[name] = {"x": x, "w": wt.t() if t else wt}
                if isinstance(out, torch.Tensor) and out.requires_grad:  # dY, as backward sees it

                    def grad(g: torch.Tensor, name: str = name) -> None:
                        seen[name]["dy"] = g.detach().reshape(-1, g.shape[-1])

                    out.register_hook(grad)  # type: ignore[no-untyped-call]

            handles.append(m.register_forward_hook(fwd))
        try:
            self.one(0, self.batches[0])
        finally:
            for h in handles:
                h.remove()
        ops = recipe.operands()
        out: dict[str, dict[str, Any]] = {}
        for name, t in seen.items():
            layouts = {  # [rows, reduction] as each GEMM reads it (docs/fp8.md)
                "fprop_input": t["x"], "fprop_weight": t["w"],
                "dgrad_weight": t["w"].t(), "wgrad_input": t["x"].t(),
            }  # fmt: skip
            if "dy" in t:
                layouts.update(dgrad_grad=t["dy"], wgrad_grad=t["dy"].t())
            with torch.random.fork_rng(devices=self.devices):  # stochastic rounding draws
                torch.manual_seed(self.seed)
                out[name] = {
                    op: _stats(ops[op], v.contiguous().float())  # type: ignore[index]
                    for op, v in layouts.items() if ops[op] is not None  # type: ignore[index]
                }  # fmt: skip
        return out


def _stats(r: Any, x: torch.Tensor) -> dict[str, float]:
    q = r.quantize(x)
    nonzero = x != 0
    n = int(nonzero.sum())
    noise = float((q - x).double().pow(2).sum())
    signal = float(x.double().pow(2).sum())
    fmt = getattr(r, "fmt", None) or getattr(r, "element", None) or "e2m1fn"
    half_ulp = 2.0 ** -(get_format(fmt).mantissa_bits + 1)
    top = q.abs() >= 0.5 * float(q.abs().max()) if q.numel() else q.bool()
    clamped = top & (q.abs() < x.abs() * (1 - half_ulp * 1.001)) & nonzero
    return {
        "sqnr_db": _db(noise / signal) if signal > 0 else math.inf,
        "underflow": float(((q == 0) & nonzero).sum()) / n if n else 0.0,
        "saturation": float(clamped.sum()) / n if n else 0.0,
    }
