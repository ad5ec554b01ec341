"""What :func:`floatguard.advise` returns: :class:`Advice` and :class:`LayerAdvice`."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from floatguard.events import EventLog
from floatguard.gap import ExpectedGap

__all__ = ["Advice", "Exactly", "LayerAdvice", "Skip", "db", "db_text"]

Skip = tuple[str, ...] | Callable[[str, nn.Module], bool] | None


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
        return db(self.error)


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
    ``train_steps`` steps over the seeds, from the model as given even with a warm-up, or,
    without ``train_steps``, the one-step loss change per batch of the model measured);
    ``expected.judge(gap)`` says whether a gap you see on a GPU is one the recipe's
    numerics explain."""

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
        return Exactly(frozenset(self.keep), base=base)

    @property
    def _exact(self) -> bool:
        others = [n for n in self.ranking if n not in self.keep]
        return not any(k in n for k in self.keep for n in others)

    def summary(self, top: int = 10) -> str:
        """The ranking and the plan, in words."""
        lines = [
            f"advise {self.recipe}: {len(self.ranking)} layer(s), {self.passes} passes; "
            f"everything emulated: gradient SQNR {db_text(self.gap_all['error'])}, loss "
            f"{self.gap_all['loss_delta']:+.4g}; the plan ({len(self.keep)} layer(s), "
            f"{self.kept_share:.1%} of GEMM FLOPs kept): {db_text(self.gap_plan['error'])}, "
            f"loss {self.gap_plan['loss_delta']:+.4g}"
        ]
        for la in self.layers[:top]:
            gemm = ", ".join(f"{g} {db_text(e)}" for g, e in la.gemms.items())
            lines.append(
                f"  {la.name}: {db_text(la.error)} alone ({la.share:.1%} of FLOPs)"
                + (f"; by GEMM: {gemm}" if gemm else "")
                + (" [keep]" if la.name in self.keep else "")
            )
        skip = self.skip()
        if self.ranking and set(self.keep) >= set(self.ranking):
            lines.append(
                "the plan keeps every candidate layer: nothing is left to emulate (train "
                "without emulate(), or give a smaller budget)"
            )
        else:
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
class Exactly:
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


def db(error: float) -> float:
    return math.inf if error <= 0 else -10.0 * math.log10(error)


def db_text(error: float) -> str:
    """An error in dB as the summary prints it: "exact" for none at all."""
    value = db(error)
    return "exact" if value == math.inf else f"{value:.1f} dB"
