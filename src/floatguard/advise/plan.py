"""The plan under a budget, the rank agreement, the recipe's name, notes and words."""

from __future__ import annotations

import math

import numpy as np

from floatguard.advise.result import db_text
from floatguard.emulation import EmulationRecipe

__all__ = ["PRESETS", "plan", "recipe_name", "recipe_notes", "recommend", "spearman"]


def plan(
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


def spearman(a: list[float], b: list[float]) -> float | None:
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


def recommend(
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
    what = f"gradient SQNR {db_text(error)} with only it emulated{worst}"
    if name in keep:
        return f"keep in high precision (the plan): {what}"
    return f"{recipe} safe at this budget: {what}"


PRESETS = ("nvfp4_training", "nvfp4", "mxfp8", "hybrid_block", "te_block_scaling",
            "hybrid_tensorwise", "hybrid_rowwise", "torchao_rowwise",
            "torchao_rowwise_with_gw_hp", "deepseek_v3", "deepgemm")  # fmt: skip


def recipe_name(recipe: EmulationRecipe) -> str:
    """The preset ``recipe`` equals (``"nvfp4_training"``), else its operand recipe's
    class with "custom" (``"custom MX"``)."""
    for preset in PRESETS:
        try:
            if getattr(EmulationRecipe, preset)() == recipe:
                return preset
        except (TypeError, ValueError):  # a recipe whose fields do not compare
            break
    ops = recipe.operands()
    first = next((v for v in ops.values() if v is not None), None)
    return f"custom {type(first).__name__}" if first is not None else "custom"


def recipe_notes(recipe: EmulationRecipe) -> tuple[str, ...]:
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
