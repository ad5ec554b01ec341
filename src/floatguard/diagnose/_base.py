"""The diagnosis's parts every rule uses: :class:`Finding`, :class:`RunInfo`, the levels
and LR changes, the rule registry (:func:`_rule`, :data:`RULE_IDS`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from floatguard._event_schema import finite as _finite
from floatguard.diagnose.specs import SPECS
from floatguard.events import Event
from floatguard.runlog import RunLog, Steps
from floatguard.stability import episodes


@dataclass(frozen=True)
class Finding:
    """One diagnosis: what was seen (``evidence``), why it likely happened, what to do.

    ``rule``: the finding's id, which names its spec (:data:`~floatguard.diagnose.specs.
    SPECS`); the title is the spec's, with ``detail`` (this finding's module, step or
    signal; "" for none) after a colon."""

    rule: str
    detail: str
    evidence: str
    cause: str
    fix: str
    severity: int  # 3: stops or corrupts a run; 2: costs steps; 1: worth a look
    steps: tuple[int, ...] = field(default=())

    @property
    def title(self) -> str:
        """The spec's title, and this finding's detail."""
        base = SPECS[self.rule].title
        return f"{base}: {self.detail}" if self.detail else base

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["title"], d["steps"] = self.title, list(self.steps)
        return d


@dataclass(frozen=True)
class RunInfo:
    """What a run computes in, as far as its log tells: ``precision`` ("fp32", "bf16",
    "fp16": the autocast precision; None when the log has no ``run`` event),
    ``loss_scaling`` (None: unknown; from the steps' scale when there is no ``run``
    event), ``param_dtypes`` (the weights' dtypes; empty: unknown)."""

    precision: str | None
    loss_scaling: bool | None
    param_dtypes: tuple[str, ...]
    clip_kind: str | None = None  # "zclip", "norm", "value", "none"; None: not in the log
    clip_cap: float | None = None  # the absolute cap on the gradient norm (None: none, or unknown)
    # what the steps' grad_norm is: "before_clip" (the guard's own, before it clips),
    # "after_clip" (HF's Trainer clipped first); None: not in the log
    norm_measured: str | None = None

    @property
    def weights_16bit(self) -> str | None:
        """ "float16" / "bfloat16" when the weights themselves are 16-bit (no fp32 master
        copy; AdamW then keeps its moments in that dtype too), else None."""
        for d in ("float16", "bfloat16"):
            if d in self.param_dtypes:
                return d
        return None

    @property
    def fp16(self) -> bool | None:
        """Whether the run computes in fp16 (autocast or fp16 weights); None: unknown."""
        if self.precision is None and not self.param_dtypes:
            return True if self.loss_scaling else None
        return self.precision == "fp16" or "float16" in self.param_dtypes

    def says(self) -> str:
        """The run's precision in words, for evidence."""
        if self.precision is None:
            return "precision not in the log" + (
                " (loss-scaled steps: fp16)" if self.loss_scaling else ""
            )
        weights = f", {'/'.join(self.param_dtypes)} weights" if self.param_dtypes else ""
        scaled = ", loss scaling" if self.loss_scaling else ""
        return f"{self.precision} autocast{weights}{scaled}"


def run_info(events: Iterable[Event]) -> RunInfo:
    """The run's :class:`RunInfo`: from its last ``run`` event, else from the steps'
    loss scale (a scale other than 1 means fp16 with loss scaling)."""
    log = RunLog.from_events(events)
    runs = log.of_kind("run")
    if runs:
        r = runs[-1].fields
        precision = r.get("precision") if r.get("precision") in ("fp32", "bf16", "fp16") else None
        scaling = r.get("loss_scaling") if isinstance(r.get("loss_scaling"), bool) else None
        dtypes = tuple(str(d) for d in r.get("param_dtypes") or [] if isinstance(d, str))
        clip: dict[str, Any] = r["clip"] if isinstance(r.get("clip"), dict) else {}
        kind = clip.get("kind") if isinstance(clip.get("kind"), str) else None
        cap = float(clip["max_norm"]) if _finite(clip.get("max_norm")) else None
        measured = clip.get("norm_measured")
        return RunInfo(
            precision, scaling, dtypes, kind, cap if cap and cap > 0 else None,
            measured if measured in ("before_clip", "after_clip") else None,
        )  # fmt: skip
    scaled = any(_finite(v) and v > 1.0 for v in log.steps.column("scale"))
    return RunInfo(None, True if scaled else None, ())


def clipped_steps(steps: Steps, info: RunInfo) -> tuple[list[int], list[int]]:
    """The indices of the applied steps whose gradient was clipped: by the absolute cap
    (the clipped norm, grad_norm * clip_coef, equals ``info.clip_cap``) and by ZClip's
    z-score (the rest). Without a known cap, every clipped step is in the second list."""
    by_cap: list[int] = []
    by_z: list[int] = []
    cap = info.clip_cap
    columns = zip(steps.column("action"), steps.column("clip_coef"), steps.column("grad_norm"),
                  strict=True)  # fmt: skip
    for j, (action, coef, norm) in enumerate(columns):
        if action != "applied" or not (_finite(coef) and coef < 1.0 and _finite(norm)):
            continue
        at_cap = cap is not None and abs(norm * coef - cap) <= 1e-3 * cap
        (by_cap if at_cap else by_z).append(j)
    return by_cap, by_z


# ---------------------------------------------------------------- levels and changes
# "Back to its level": the median loss of up to LEVEL_STEPS applied steps after an
# incident is at most LEVEL_BAND (25%) above the median of up to LEVEL_STEPS applied
# steps before it (for a loss near 0, within 1e-6); fewer than LEVEL_MIN applied steps on
# a side: unknown. The report's verdict and the spike rules use it (docs/report.md).
LEVEL_STEPS = episodes.LEVEL_STEPS  # 20 (one source: the spike episodes use the same)
LEVEL_MIN = episodes.LEVEL_MIN  # 3
LEVEL_BAND = episodes.BAND  # 0.25
_LEVEL_FLOOR = 1e-6


@dataclass(frozen=True)
class Level:
    """The loss around an incident at step ``at``: ``before`` (the median of the applied
    steps before it) and ``after`` (the median of the applied steps after it: the last
    ones of the run, or the next ones); None where fewer than LEVEL_MIN steps exist."""

    at: int
    before: float | None
    after: float | None
    n_before: int
    n_after: int

    @property
    def back(self) -> bool | None:
        """Whether ``after`` is within the band of ``before`` (None: unknown)."""
        if self.before is None or self.after is None:
            return None
        return self.after - self.before <= LEVEL_BAND * max(abs(self.before), _LEVEL_FLOOR)

    def times(self) -> str:
        """``after`` against ``before`` in words: "4.1x", or "3.2 vs 1.1" when a ratio
        means nothing (a loss at or below 0)."""
        assert self.before is not None and self.after is not None
        if self.before > 0 and self.after > 0:
            return _times(self.after / self.before)
        return f"{self.after:.3g} vs {self.before:.3g}"


def _times(r: float) -> str:
    """A ratio in words: 0.93x, 1.0x, 4.1x, 40x."""
    if r >= 10:
        return f"{r:.0f}x"
    text = f"{r:.2g}"
    return (text if "." in text or "e" in text else text + ".0") + "x"


def applied_losses(steps: Steps) -> list[tuple[int, float]]:
    """(step, loss) of the applied steps whose loss is finite, in log order."""
    return [
        (s, float(v)) for s, a, v in zip(steps.step, steps.column("action"),
                                          steps.column("loss"), strict=True)
        if a == "applied" and _finite(v)
    ]  # fmt: skip


def loss_level(
    points: Sequence[tuple[int, float]],
    at: int,
    *,
    upto: int | None = None,
    n_after: int = LEVEL_STEPS,
) -> Level:
    """The :class:`Level` around step ``at`` from ``points`` (:func:`applied_losses`):
    ``before`` from the LEVEL_STEPS applied steps before ``at``; ``after`` from the last
    ``n_after`` applied steps after it, or with ``upto`` the first ``n_after`` after
    ``upto``."""
    before = [v for s, v in points if s < at][-LEVEL_STEPS:]
    if upto is None:
        after = [v for s, v in points if s > at][-n_after:]
    else:
        after = [v for s, v in points if s > upto][:n_after]

    def median(vs: list[float]) -> float | None:
        return statistics.median(vs) if len(vs) >= LEVEL_MIN else None

    return Level(at, median(before), median(after), len(before), len(after))


def schedule_lrs(steps: Steps) -> list[float | None]:
    """Each step's LR as the schedule set it: ``lr`` with the guard's ``lr_factor`` taken
    out (a back-off is the guard's answer, not a change the run made); None: not logged."""
    out: list[float | None] = []
    for lr, factor in zip(steps.column("lr"), steps.column("lr_factor"), strict=True):
        if not _finite(lr):
            out.append(None)
        elif _finite(factor) and factor > 0:
            out.append(lr / factor)
        else:
            out.append(lr)
    return out


_LR_JUMP = 1.5  # an LR that moved by this factor or more changed


@dataclass(frozen=True)
class LrChange:
    """A rise of the schedule's LR at ``step`` (from ``before`` to ``after``), and until
    which step it lasted (``until``: the first step back within _LR_JUMP of ``before``;
    None: it stayed up to the end)."""

    step: int
    before: float
    after: float
    until: int | None

    @property
    def lasted(self) -> bool:
        return self.until is None

    def says(self) -> str:
        if self.until is None:
            kept = "and stayed there"
        elif self.until == self.step + 1:
            kept = "for that step only"
        else:
            kept = f"until step {self.until}"
        return (
            f"the LR rose {_times(self.after / self.before)} at step {self.step} "
            f"({self.before:.3g} to {self.after:.3g}) {kept}"
        )


def lr_change(steps: Steps, near: int, look_back: int = 50) -> LrChange | None:
    """The last rise of the schedule's LR (:func:`schedule_lrs`) by _LR_JUMP or more, at
    or up to ``look_back`` steps before step ``near``; None when the LR is not in the log
    or did not rise."""
    lrs = schedule_lrs(steps)
    idx = [j for j, s in enumerate(steps.step) if near - look_back <= s <= near]
    for j in reversed(idx):
        k = j - 1
        while k >= 0 and lrs[k] is None:
            k -= 1
        a, b = (lrs[k] if k >= 0 else None), lrs[j]
        if a is None or b is None or a <= 0 or b / a < _LR_JUMP:
            continue
        until = next((steps.step[m] for m in range(j + 1, len(lrs))
                      if (v := lrs[m]) is not None and v < _LR_JUMP * a), None)  # fmt: skip
        return LrChange(steps.step[j], a, b, until)
    return None


def window_lr(steps: Steps, start: int, end: int) -> float | None:
    """The schedule's median LR over steps ``start..end`` (None: not logged)."""
    lrs = [v for s, v in zip(steps.step, schedule_lrs(steps), strict=True)
           if start <= s <= end and v is not None]  # fmt: skip
    return statistics.median(lrs) if lrs else None


def batch_words(batch: object) -> str | None:
    """A batch's identity from a ``fault``/``spike`` event's ``batch`` field, in words
    ("position 50, fingerprint 3f9a0c..."); None when the event has none."""
    if not isinstance(batch, dict):
        return None
    parts = []
    pos, fp, micro = batch.get("position"), batch.get("fingerprint"), batch.get("micro_batches")
    if type(pos) is int:
        parts.append(f"position {pos}")
    if isinstance(fp, str) and fp:
        parts.append(f"fingerprint {fp[:16]}")
    if type(micro) is int and micro > 1:
        parts.append(f"{micro} micro-batches")
    return ", ".join(parts) or None


def _fingerprint(e: Event) -> str | None:
    b = e.fields.get("batch")
    fp = b.get("fingerprint") if isinstance(b, dict) else None
    return fp if isinstance(fp, str) and fp else None


def warnings_of(events: RunLog, *codes: str) -> list[Event]:
    """The ``warning`` events with one of ``codes``."""
    return [e for e in events.of_kind("warning") if e.fields.get("code") in codes]


def _evidence(e: Event) -> dict[str, Any]:
    ev = e.fields.get("evidence")
    return ev if isinstance(ev, dict) else {}


def _num(v: object) -> float | None:
    return float(v) if _finite(v) else None  # type: ignore[arg-type]


def _pair(v: object) -> tuple[float, float] | None:
    """A ``[before, after]`` pair of finite numbers, or None."""
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(_finite(x) for x in v):
        return float(v[0]), float(v[1])
    return None


RuleCheck = Callable[[RunLog], list[Finding]]
_RULES: list[RuleCheck] = []
# Each rule's finding ids (a rule may tell several situations apart, each its own id);
# docs/report.md's table lists exactly these (tests/test_diagnose.py checks it).
RULE_IDS: dict[str, tuple[str, ...]] = {}
# Findings diagnose() itself adds: a rule that raised, events it could not read.
OWN_IDS = ("rule_failed", "unreadable_events")


def _rule(*ids: str) -> Callable[[RuleCheck], RuleCheck]:
    """Register a rule with the finding ids it may return."""

    def register(fn: RuleCheck) -> RuleCheck:
        _RULES.append(fn)
        RULE_IDS[fn.__name__] = ids
        return fn

    return register


def _where(e: Event) -> str:
    return str(e["module"] or "<root>")


def _name(e: Event) -> str:
    return f"{_where(e)}.{e['tensor'] or '?'}"


def _list(steps: Iterable[int], most: int = 8) -> str:
    s = list(steps)
    head = ", ".join(map(str, s[:most]))
    return head + (f" and {len(s) - most} more" if len(s) > most else "")


def ended(events: RunLog) -> list[Event]:
    """Each rank's last ``end`` event (written when its guard closed)."""
    last: dict[int, Event] = {}
    for e in events.of_kind("end"):
        last[e.rank] = e
    return [last[r] for r in sorted(last)]


def end_nonfinite(events: RunLog) -> list[str]:
    """What the run ended with non-finite, by the ``end`` events ("buffer:bn.running_var",
    "param:fc.weight", ...), in order and without repeats."""
    names: dict[str, None] = {}
    for e in ended(events):
        for n in e.fields.get("nonfinite") or []:
            names[str(n)] = None
    return list(names)


def end_lr_factor(events: RunLog) -> float | None:
    """The guard's LR factor at the end: the ``end`` event's, else the last step's."""
    ends = ended(events)
    factor = _num(ends[-1].fields.get("lr_factor")) if ends else None
    if factor is None:
        factors = [v for v in events.steps.column("lr_factor") if _finite(v)]
        factor = factors[-1] if factors else None
    return factor


def _param_kind(e: Event) -> str:
    """What a parameter-phase fault says happened: "state" (an optimizer state tensor),
    "buffer" (a floating buffer, BatchNorm's running statistics, say), "update" (the
    optimizer update made it: verified, op "optimizer.step"), "update_or_outside" (bad
    since the last check: the update or a write outside it; also an older log's
    unverified ``optimizer_update``), "outside" (verified: written outside the update),
    "magnitude" (a finite weight jumped absurdly) or "weight" (a weight already bad)."""
    cause, op = e.fields.get("cause"), e.fields.get("op")
    tensor = str(e.fields.get("tensor") or "")
    if cause == "nonfinite_optimizer_state" or tensor.startswith("optimizer:"):
        return "state"
    if cause == "nonfinite_buffer" or tensor.startswith("buffer:"):
        return "buffer"
    if op == "optimizer.step":
        return "update"
    if op == "update_or_outside" or (op is None and cause == "optimizer_update"):
        return "update_or_outside"
    if op == "outside":
        return "outside"
    if op == "magnitude":
        return "magnitude"
    return "weight"


def _param_faults(events: RunLog, *kinds: str) -> list[Event]:
    """The parameter-phase faults of the given :func:`_param_kind` kinds."""
    return [e for e in events.of_kind("fault") if e["phase"] == "param" and _param_kind(e) in kinds]


_NORM_OPS = ("rsqrt", "layer_norm", "rms_norm", "group_norm", "batch_norm", "var", "div")
_NORM_NAMES = ("norm", "ln", "bn", "rms")


def _is_norm(e: Event) -> bool:
    op = str(e["op"] or "")
    named = any(k in str(e["module"] or "").lower() for k in _NORM_NAMES)
    return ("layer_norm" in op or "rms_norm" in op) or (named and any(k in op for k in _NORM_OPS))
