"""Diagnosis: rules over the event stream, each a finding with evidence, cause and fix.

Each rule reads the events (``run``, ``step``, ``fault``, ``overflow``, ``spike``,
``rollback``, ``warning`` ...) and returns zero or more :class:`Finding`;
:func:`diagnose` runs them all and ranks the findings (what stops a run first, then
what costs it most). The rules are the common numerical bugs of deep-learning training
(the lessons' table, `docs/lessons.md`): each tells its causes apart by the evidence
where it can, and states the evidence it needs (the run's precision comes from its
``run`` event; a log without one is judged by what its steps show, and says so).

Any log the reader accepts can be diagnosed: fields a schema 1 file lacks are unknown
(None) and every rule reads them as such; events with a mistyped field are left out
and reported as a finding of their own (``unreadable_events``).

Words used here: an *applied* step is one whose update was kept; a *level* is the
median loss of up to LEVEL_STEPS applied steps (:class:`Level`: back within
LEVEL_BAND of the level before an incident, or not); the *schedule's LR* is a step's
``lr`` with the guard's ``lr_factor`` taken out (:func:`schedule_lrs`); an *episode*
is spikes fewer than 20 steps apart (:func:`spike_episodes`: isolated, a burst, or
sustained); a batch's *identity* is its position and content fingerprint
(:func:`batch_words`).

Reading order: :class:`Finding`, :func:`run_info`, the levels and LR changes, then the
rules in registry order (each ``@_rule`` names the finding ids it may return:
:data:`RULE_IDS`, the table of ``docs/report.md``), then :func:`diagnose`.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from floatguard._event_schema import finite as _finite
from floatguard.causes import describe
from floatguard.events import Event
from floatguard.runlog import RunLog, Steps, global_view
from floatguard.stability import episodes
from floatguard.stability.episodes import GAP as EPISODE_GAP
from floatguard.stability.episodes import SETTLE, classify_spikes

__all__ = ["RULE_IDS", "Finding", "RunInfo", "diagnose", "run_info"]


@dataclass(frozen=True)
class Finding:
    """One diagnosis: what was seen (``evidence``), why it likely happened, what to do."""

    rule: str
    title: str
    evidence: str
    cause: str
    fix: str
    severity: int  # 3: stops or corrupts a run; 2: costs steps; 1: worth a look
    steps: tuple[int, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["steps"] = list(self.steps)
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


@_rule("bad_input", "repeated_bad_input")
def bad_input(events: RunLog) -> list[Finding]:
    hits = [e for e in events.of_kind("fault") if e["phase"] == "input"]
    if not hits:
        return []
    steps = tuple(e.step for e in hits)
    stopped = any(e.fields.get("reason") == "bad_data" for e in events.of_kind("stop"))
    done = (
        "the guard stopped the run: so many batches were non-finite that training on "
        "would learn from too little data"
        if stopped
        else "the guard skipped each such batch without changing the LR or the loss scale"
    )
    first = hits[0]["source"] or hits[0]["tensor"] or "the batch"
    rank = hits[0]["fault_rank"]
    if rank is not None:
        first += f", on rank {rank}"
    found = [Finding(
        "bad_input", "Non-finite values in the data",
        f"{len(hits)} batch(es) carried NaN/inf into the step (steps {_list(steps)}); "
        f"first at {first}",
        "the data pipeline produced them (a corrupted sample, a bad loss mask, a division "
        "by zero in preprocessing); the model did nothing wrong",
        "validate batches where they are made (torch.isfinite on inputs and loss weights); "
        + done,
        3 if stopped else 2, steps,
    )]  # fmt: skip
    if len(hits) >= 3:
        found.append(_repeated_input(events, hits, stopped))
    return found


def _repeated_input(events: RunLog, hits: list[Event], stopped: bool) -> Finding:
    """Bad batches that keep coming: a period (the same sample every epoch) or a share
    of all steps (a pipeline that is broken, not unlucky)."""
    steps = [e.step for e in hits]
    gaps = {b - a for a, b in itertools.pairwise(steps)}
    total = len(set(events.steps.step)) or len(steps)
    tensors = sorted({str(e["tensor"]) for e in hits if e["tensor"]})
    if len(gaps) == 1 and next(iter(gaps)) > 1:
        pattern = (
            f"every {next(iter(gaps))} steps: the same bad sample comes back each epoch (a "
            f"dataset of {next(iter(gaps))} batches per epoch, or a fixed shard)"
        )
    elif gaps == {1}:
        pattern = "on consecutive steps: the pipeline broke at a point and stayed broken"
    else:
        pattern = f"at irregular steps, {len(hits)} of {total} steps"
    return Finding(
        "repeated_bad_input", "Non-finite batches keep coming",
        f"{len(hits)} non-finite batch(es) {pattern}; in {', '.join(tensors[:3]) or 'the input'}",
        "not bad luck: a sample or a preprocessing step that always yields NaN/inf (a "
        "log of 0, a division by a zero count, an uninitialized buffer in the loader); "
        "skipping it hides the bug and loses those batches every epoch",
        "find the sample (the fault's step and batch index) and fix or filter it at the "
        "source; ResponsePolicy(bad_data_stop_after=...) bounds how many the guard skips"
        + ("; the guard stopped the run for it" if stopped else ""),
        3, tuple(steps),
    )  # fmt: skip


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


def _on_ranks(hits: Sequence[Event]) -> str:
    """Where the faults were found (", on rank 1", ", on ranks 1, 3"; "" if not named)."""
    ranks = sorted({e["fault_rank"] for e in hits if e["fault_rank"] is not None})
    if not ranks:
        return ""
    return f", on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _param_faults(events: RunLog, *kinds: str) -> list[Event]:
    """The parameter-phase faults of the given :func:`_param_kind` kinds."""
    return [e for e in events.of_kind("fault") if e["phase"] == "param" and _param_kind(e) in kinds]


@_rule("optimizer_update")
def optimizer_update(events: RunLog) -> list[Finding]:
    """A weight the guard verified good before the update and bad right after it."""
    hits = _param_faults(events, "update")
    if not hits:
        return []
    steps = tuple(e.step for e in hits)
    names = sorted({_name(e) for e in hits})
    cause, fix = _update_advice(run_info(events))
    return [Finding(
        rule="optimizer_update", title="The optimizer update made a weight non-finite",
        evidence=(f"{', '.join(names)} finite with finite gradients before the update of "
                  f"step {hits[0].step - 1}, non-finite after it (step(s) {_list(steps)})"
                  f"{_on_ranks(hits)}"),
        cause=cause, fix=fix, severity=3, steps=steps,
    )]  # fmt: skip


def _update_advice(info: RunInfo) -> tuple[str, str]:
    """Why an optimizer update can make a weight non-finite, and what to do, for this
    run's weights (16-bit without a master copy, or fp32)."""
    low = info.weights_16bit
    if low is not None:
        return (
            f"the weights are {low} with no fp32 master copy ({info.says()}), so the update "
            f"is computed and rounded in {low}: AdamW's eps (1e-8) is 0 in fp16, so a second "
            "moment that underflowed to 0 gives 0/0, and an update past the format's range "
            "is inf",
            "keep fp32 master weights (floatguard.MasterWeights, or keep the model in fp32 and "
            "train under autocast instead of model.half()); use an eps the dtype can hold "
            "(>= 1e-4 in fp16); lower the LR",
        )
    return (
        "the update overflowed or divided by zero with fp32 weights (" + info.says() + "): a "
        "learning rate far too high for this phase, an optimizer hyper-parameter out of range "
        "(eps=0, a beta of 1), or a custom optimizer's bug",
        "lower the LR (or lengthen warmup) and check the optimizer's arguments; keep gradient "
        "clipping on",
    )


_OUTSIDE_CAUSE = (
    "a write to the weights between steps, outside the optimizer: an embedding resized with "
    "uninitialized rows (resize_token_embeddings), a callback or hook that edits weights, a "
    "checkpoint or state_dict load, an in-place init or weight tying done mid-run"
)
_OUTSIDE_FIX = (
    "find that write (what runs between optimizer.step() and the next forward: callbacks, "
    "hooks, load_state_dict, resizing) and make it write finite values"
)


@_rule("update_or_outside")
def update_or_outside(events: RunLog) -> list[Finding]:
    """A weight found non-finite at a check, good at the check before: the update made it
    or something wrote it between steps; the guard did not see which, so both."""
    hits = _param_faults(events, "update_or_outside")
    if not hits:
        return []
    steps = tuple(e.step for e in hits)
    names = sorted({_name(e) for e in hits})
    source = hits[0]["source"]
    since = source if isinstance(source, str) and source else "non-finite since the last check"
    update_cause, update_fix = _update_advice(run_info(events))
    return [Finding(
        "update_or_outside",
        "A weight went non-finite between two checks: the update, or a write outside it",
        f"{', '.join(names)}: {since} (found at step(s) {_list(steps)}){_on_ranks(hits)}; "
        "the guard did not see whether the optimizer update or a write outside it made it",
        f"either the update: {update_cause}; or {_OUTSIDE_CAUSE}",
        f"if the update: {update_fix}; if a write outside it: {_OUTSIDE_FIX}; the guard "
        "rolled back to the last snapshot vetted finite",
        3, steps,
    )]  # fmt: skip


@_rule("bad_optimizer_state")
def bad_optimizer_state(events: RunLog) -> list[Finding]:
    hits = _param_faults(events, "state")
    if not hits:
        return []
    steps = tuple(e.step for e in hits)
    names = sorted({_name(e) for e in hits})
    info = run_info(events)
    low = info.weights_16bit
    if low is not None:
        cause = (
            f"the moments are {low}: the weights are {low} ({info.says()}) and AdamW keeps "
            "its moments in the weights' dtype, where exp_avg_sq = g**2 overflows (past "
            "65504 in fp16: |g| > 256) or a moment goes non-finite with the update"
        )
        fix = (
            "keep fp32 master weights and optimizer states (floatguard.MasterWeights); the "
            "guard rolled back to the last snapshot, whose states were vetted finite"
        )
    else:
        cause = (
            "a moment (exp_avg, exp_avg_sq) held a NaN or inf before the weight it updates "
            "went bad, with finite gradients and fp32 states as far as the log says ("
            + info.says()
            + "): a write from outside the optimizer (a hook, a state loaded "
            "from a bad checkpoint), a low-precision optimizer (8-bit states), or memory "
            "corruption"
        )
        fix = ("check what writes the optimizer's state (hooks, checkpoint loading); the "
               "guard rolled back to the last snapshot, whose states were vetted finite; if "
               "it recurs on one machine only, check its memory (ECC errors)")  # fmt: skip
    return [Finding(
        rule="bad_optimizer_state", title="An optimizer state tensor went non-finite",
        evidence=f"{', '.join(names)} at step(s) {_list(steps)}{_on_ranks(hits)}",
        cause=cause, fix=fix, severity=3, steps=steps,
    )]  # fmt: skip


@_rule("bad_parameter")
def bad_parameter(events: RunLog) -> list[Finding]:
    """A weight bad before the step: verified written outside the update (op "outside"),
    an absurd finite magnitude, or non-finite with or without spikes just before."""
    hits = _param_faults(events, "weight", "magnitude", "outside")
    if not hits:
        return []
    steps = tuple(e.step for e in hits)
    names = sorted({_name(e) for e in hits})
    if all(_param_kind(e) == "outside" for e in hits):
        return [Finding(
            "bad_parameter", "A weight was written outside the optimizer update",
            f"{', '.join(names)} went bad between two steps, and the last update could not "
            "have made it (its step there, recomputed from the optimizer's state, is finite "
            f"and small) (step(s) {_list(steps)}){_on_ranks(hits)}",
            f"not the update and not the learning rate: {_OUTSIDE_CAUSE}; or memory "
            "corruption (a flipped bit)",
            f"{_OUTSIDE_FIX}; do not lower the LR for it; the guard rolled back to the last "
            "snapshot vetted finite; if it recurs on one machine with no such write, check "
            "its memory (ECC errors)",
            3, steps,
        )]  # fmt: skip
    spikes_before = [
        e for e in [*events.of_kind("spike"), *events.of_kind("lr_backoff")]
        if hits[0].step - 20 <= e.step
        < hits[0].step
    ]  # fmt: skip
    if all(_param_kind(e) == "magnitude" for e in hits):
        title = "A weight jumped to an absurd (finite) magnitude"
        cause = (
            "a weight stayed finite but jumped to an absurd magnitude between steps (orders "
            "of magnitude past its value at the last snapshot): a flipped exponent bit "
            "(memory corruption) or a write from outside the optimizer"
        )
        fix = ("the guard rolled back to the last verified snapshot; if it recurs on one "
               "machine, check its memory (ECC errors) and run the job elsewhere")  # fmt: skip
    elif spikes_before:
        title = "A weight went non-finite (or past the format's range)"
        cause = ("an optimizer step with too large an update (loss or gradient spikes came "
                 "just before it): the learning rate is too high for this phase")  # fmt: skip
        fix = "lower the peak LR or lengthen warmup; keep gradient clipping on"
    else:
        title = "A weight went non-finite (or past the format's range)"
        cause = (
            "a weight changed between steps with no warning in the training signal: "
            "memory corruption (a flipped bit) or a write from outside the optimizer"
        )
        fix = ("the guard rolled back to the last verified snapshot; if it recurs on one "
               "machine, check its memory (ECC errors) and run the job elsewhere")  # fmt: skip
    return [Finding(
        "bad_parameter", title, f"{', '.join(names)} at step(s) {_list(steps)}{_on_ranks(hits)}",
        cause, fix, 3, steps,
    )]  # fmt: skip


@_rule("masked_softmax")
def masked_softmax(events: RunLog) -> list[Finding]:
    hits = [
        e for e in events.of_kind("fault")
        if e["kind_of_value"] == "nan" and "softmax" in (e["op"] or "")
    ]  # fmt: skip
    if not hits:
        return []
    steps = tuple(e.step for e in hits)
    return [Finding(
        "masked_softmax", "Softmax over a row with every entry masked",
        f"NaN born in {_where(hits[0])} by {hits[0]['op']} at step(s) {_list(steps)}",
        "an attention mask (causal combined with padding, say) left a query with no key to "
        "look at: softmax of a row of -inf is 0/0",
        "make sure every query sees at least one key (do not pad the first position), or "
        "use a softmax that returns 0 for empty rows (floatguard.ops.softmax / "
        "ops.attention, or F.scaled_dot_product_attention)",
        2, steps,
    )]  # fmt: skip


@_rule("exp_overflow")
def exp_overflow(events: RunLog) -> list[Finding]:
    hits = [e for e in events.of_kind("fault") if (e["op"] or "").startswith("aten.exp")]
    if not hits:
        return []
    steps = tuple(e.step for e in hits)
    return [Finding(
        "exp_overflow", "exp() overflowed",
        f"inf born in {_where(hits[0])} by {hits[0]['op']}"
        + (f" at {hits[0]['source']}" if hits[0]["source"] else ""),
        "exp of raw logits: anything above ~88.7 (float32) or ~11.1 (fp16) is inf",
        "subtract the maximum first (log-sum-exp trick): floatguard.ops.logsumexp / "
        "softmax / cross_entropy, or torch's own fused ops",
        2, steps,
    )]  # fmt: skip


_NORM_OPS = ("rsqrt", "layer_norm", "rms_norm", "group_norm", "batch_norm", "var", "div")
_NORM_NAMES = ("norm", "ln", "bn", "rms")
# |x| past this squares past float32's range: a normalization's variance is inf, not 0
_SQUARE_OVERFLOWS = math.sqrt(3.4028234663852886e38)


def _is_norm(e: Event) -> bool:
    op = str(e["op"] or "")
    named = any(k in str(e["module"] or "").lower() for k in _NORM_NAMES)
    return ("layer_norm" in op or "rms_norm" in op) or (named and any(k in op for k in _NORM_OPS))


@_rule("norm_eps", "norm_input_out_of_range")
def norm_eps(events: RunLog) -> list[Finding]:
    """A normalization's fault: a vanishing variance (tiny eps) or an input that was
    already out of range (its square overflows); the fault's ``input_amax`` tells
    them apart, and without it the finding says the evidence is missing."""
    hits = [
        e for e in events.of_kind("fault") if e["phase"] not in ("input", "param") and _is_norm(e)
    ]
    if not hits:
        return []
    huge = [e for e in hits if _finite(e["input_amax"]) and e["input_amax"] > _SQUARE_OVERFLOWS]
    small = [e for e in hits if e not in huge]
    out = []
    if huge:
        h = huge[0]
        out.append(Finding(
            "norm_input_out_of_range", "A normalization was given values out of range",
            f"{h['kind_of_value']} born in {_where(h)} by {h['op']}, whose input had "
            f"|x| up to {h['input_amax']:.3g} (its square overflows float32)",
            "the normalization is where the bad value showed, not where it came from: its "
            "input was already absurd (a weight with a flipped exponent bit upstream, an "
            "exploding residual stream, an unnormalized input); eps plays no part",
            "look upstream of that module: the guard's snapshot check names a corrupted "
            "weight; watch the residual stream's amax (Monitor(mode='stats')); lower the LR",
            3, tuple(e.step for e in huge),
        ))  # fmt: skip
    if small:
        f = small[0]
        known = _finite(f["input_amax"])
        evidence = f"{f['kind_of_value']} born in {_where(f)} by {f['op']}" + (
            f"; its input's |x| was at most {f['input_amax']:.3g}, so the variance, not "
            "the input, is what failed"
            if known
            else "; the fault carries no input statistics, so an input out of range "
            "cannot be ruled out (a replay records them: Guard.step(closure))"
        )
        out.append(Finding(
            "norm_eps", "A normalization divided by a vanishing variance", evidence,
            "a (near-)constant input makes the variance 0; with a tiny eps (or one below the "
            "format's smallest normal, as 1e-6 is in fp16) 1/sqrt(var + eps) overflows",
            "use eps >= 1e-5 (1e-4 or more under fp16), or compute the statistics in float32 "
            "(floatguard.ops.layer_norm / rms_norm)",
            2, tuple(e.step for e in small),
        ))  # fmt: skip
    return out


@_rule("repeated_module")
def repeated_module(events: RunLog) -> list[Finding]:
    by = Counter((e["module"], e["phase"], e["op"]) for e in events.of_kind("fault")
                 if e["phase"] not in ("input", "param"))  # fmt: skip
    out = []
    for (module, phase, op), n in by.items():
        if n < 2:
            continue
        steps = tuple(e.step for e in events.of_kind("fault")
                      if (e["module"], e["phase"], e["op"]) == (module, phase, op))  # fmt: skip
        out.append(Finding(
            "repeated_module", f"Repeated faults in {module or '<root>'}",
            f"{n} faults born in {module or '<root>'} ({phase}, {op}) at steps {_list(steps)}",
            "the same computation fails again and again: a bug or an unstable formulation in "
            "that module, not bad luck",
            "fix that module's numerics (read the op and line in the fault cards); skipping "
            "or rolling back only postpones it",
            3, steps,
        ))  # fmt: skip
    return out


@_rule("scale_collapse", "fp16_overflow")
def scale_collapse(events: RunLog) -> list[Finding]:
    over = list(events.of_kind("overflow"))
    if not over:
        return []
    over.sort(key=lambda e: e.step)
    afters = [e["scale_after"] for e in over if _finite(e["scale_after"])]
    last = afters[-1] if afters else math.nan
    steps = tuple(e.step for e in over)
    # Collapsed: the scale ended at 1 or below, or low after several back-offs, or it
    # backs off on a large share of the steps (GradScaler's defaults overflow about once
    # per growth interval of 2000 steps: a long healthy run has many, spread out).
    n_steps = len(events.steps) or len(over)
    often = len(over) >= 20 and len(over) > 0.05 * n_steps
    if (afters and (last <= 1.0 or (last <= 128.0 and len(over) >= 5))) or often:
        return [Finding(
            "scale_collapse", "The fp16 loss scale collapsed",
            f"{len(over)} overflow back-offs; the scale fell to {last:g}",
            "the gradients overflow fp16 at any scale: a value in the backward pass grows past "
            "65504 by itself (large activations, an unnormalized residual stream)",
            "train in bf16 (same range as float32), or find the layer whose gradient overflows "
            "(the guard localizes it once the scale cannot back off further)",
            3, steps,
        )]  # fmt: skip
    return [Finding(
        "fp16_overflow", "fp16 gradient overflows",
        f"{len(over)} step(s) skipped for a gradient overflow (steps {_list(steps)})"
        + (f"; the loss scale backed off, now {last:g}" if afters else ""),
        "scaled gradients above 65504: normal at the start of fp16 training, rare after",
        "nothing to do if rare (the scale recovers); frequent ones: lower the LR or use bf16",
        1, steps,
    )]  # fmt: skip


# ------------------------------------------------------ spikes: a batch or the training
# Spikes (not the transients a replay cleared) are grouped into episodes and told apart
# by floatguard.stability.episodes.classify_spikes (its docstring states the rule):
# *isolated* (one spike, the loss back, nothing after it: a bad batch, bad_batch),
# *sustained* (from a change on: a trend warning, a level that stayed up, or repeated
# spikes after a lasting LR rise: sustained_instability), *burst* or *unresolved* (the
# rest: loss_spikes).


@dataclass(frozen=True)
class Episode:
    """Spikes close together: ``kind`` "isolated", "burst", "sustained" or "unresolved"
    (classify_spikes); ``level``: the loss before the first spike and after the last
    (the next SETTLE applied steps; for a sustained episode, the run's last
    LEVEL_STEPS); ``change``: the LR's last rise before it; ``reason``: why, in words."""

    kind: str
    spikes: tuple[Event, ...]
    level: Level
    change: LrChange | None
    reason: str = ""


def spike_episodes(log: RunLog) -> list[Episode]:
    """The spikes a replay did not clear, as :class:`Episode` (in step order)."""
    spikes = sorted((e for e in log.of_kind("spike") if e["reproduced"] is not False),
                    key=lambda e: e.step)  # fmt: skip
    if not spikes:
        return []
    points = applied_losses(log.steps)
    lrs = [(s, v) for s, v in zip(log.steps.step, schedule_lrs(log.steps), strict=True)
           if v is not None]  # fmt: skip
    trends = [w.step for w in warnings_of(log, "loss_trend", "grad_norm_trend")]
    found = classify_spikes([e.step for e in spikes], points, trends, lrs=lrs)
    start = next((ep.steps[0] for ep in found if ep.kind == "sustained"), None)
    out = []
    for ep in found:
        members = tuple(e for e in spikes if e.step in ep.steps)
        if ep.kind == "sustained" and start is not None:
            level = loss_level(points, start)
        else:
            level = loss_level(points, ep.steps[0], upto=ep.steps[-1], n_after=SETTLE)
        out.append(Episode(ep.kind, members, level, lr_change(log.steps, ep.steps[0]),
                           ep.reason))  # fmt: skip
    return out


def _spike_words(e: Event, level: Level) -> str:
    """One spike: its step, value against the level before it, and its batch."""
    value = _num(e["value"])
    text = f"step {e.step}: {e['signal'] or 'loss'}"
    if value is not None:
        text += f" {value:.3g}"
        if level.before is not None and level.before > 0 and value > 0:
            text += f" ({_times(value / level.before)} its level)"
    b = batch_words(e["batch"])
    return text + (f", batch {b}" if b else ", batch identity not logged")


def _action_at(log: RunLog, step: int) -> str | None:
    for s, a in zip(log.steps.step, log.steps.column("action"), strict=True):
        if s == step:
            return str(a) if a is not None else None
    return None


def _not_applied_words(log: RunLog, since: int) -> str:
    """How many steps from ``since`` on were not applied, by reason."""
    by = Counter(
        str(r or "unknown") for s, a, r in zip(log.steps.step, log.steps.column("action"),
                                               log.steps.reason, strict=True)
        if s >= since and a in ("skipped", "rolled_back")
    )  # fmt: skip
    if not by:
        return "every step applied"
    return f"{sum(by.values())} steps not applied ({reason_counts(by)})"


def reason_counts(by: Counter[str]) -> str:
    """Steps not applied by reason, in words, in the order the reasons first came:
    "loss spikes: 5, after rollback: 8"."""
    return ", ".join(f"{REASON_WORDS.get(r, r)}: {n}" for r, n in by.items())


# A step's reason in a few words, for counts ("loss spikes: 5").
REASON_WORDS: dict[str, str] = {
    "loss_spike": "loss spikes", "grad_norm_spike": "gradient-norm spikes",
    "after_rollback": "after rollback", "overflow": "fp16 overflows",
    "nonfinite_input": "non-finite batches", "nonfinite_loss": "non-finite loss",
    "nonfinite_grad": "non-finite gradients", "transient": "transients",
    "nonfinite_param": "bad weights", "optimizer_update": "bad updates",
    "nonfinite_optimizer_state": "bad optimizer state", "nonfinite_buffer": "bad buffers",
    "unknown": "reason not logged",
}  # fmt: skip


def _bad_batches(log: RunLog, episodes: list[Episode]) -> Finding:
    spikes = [ep.spikes[0] for ep in episodes]
    steps = tuple(e.step for e in spikes)
    lines = "; ".join(_spike_words(ep.spikes[0], ep.level) for ep in episodes[:5])
    more = f"; {len(episodes) - 5} more" if len(episodes) > 5 else ""
    fps = Counter(fp for e in spikes if (fp := _fingerprint(e)) is not None)
    again = [fp for fp, n in fps.items() if n > 1]
    repeat = (
        f"; the same batch (fingerprint {again[0][:16]}) spiked at steps "
        f"{_list(e.step for e in spikes if _fingerprint(e) == again[0])}: it comes back, "
        "each epoch say"
        if again else ""
    )  # fmt: skip
    replayed = any(e["reproduced"] is True for e in spikes)
    actions = Counter(_action_at(log, s) for s in steps)
    done = {"skipped": "skipped", "rolled_back": "rolled back", "applied": "applied"}
    did = ", ".join(f"{done.get(str(a), 'did not log')} {n}" for a, n in actions.items())
    return Finding(
        "bad_batch",
        "A bad batch (a spike that did not recur)" if len(episodes) == 1
        else f"{len(episodes)} bad batches (spikes that did not recur)",
        f"{lines}{more}; after {'it' if len(episodes) == 1 else 'each'}, no spike in the next "
        f"{EPISODE_GAP} steps and the loss "
        f"back within {LEVEL_BAND:.0%} of its level before it{repeat}",
        "one batch, not the training: a corrupted or mislabelled batch (shuffled labels, "
        "inputs off by a factor, a bad shard or file) or a genuine outlier; the training "
        "itself is stable (the loss came back, no spike followed)"
        + ("; the replay with the same batch and weights spiked again" if replayed else ""),
        "find the batch in your data pipeline by its position (the guard step it was given "
        "to) and fingerprint (sha256 of the inputs' contents: hash the same tensors to match "
        "it), then fix or filter it; the LR and the model need no change; the guard's "
        f"steps there: {did}",
        2 if len(episodes) > 1 or again else 1, steps,
    )  # fmt: skip


def _sustained(log: RunLog, episodes: list[Episode]) -> Finding:
    spikes = [e for ep in episodes for e in ep.spikes]
    first = spikes[0].step
    level = episodes[0].level
    change = lr_change(log.steps, first)
    rose = change is not None and change.lasted and change.after > change.before
    fps = {fp for e in spikes if (fp := _fingerprint(e)) is not None}
    named = [b for e in spikes[:3] if (b := batch_words(e["batch"]))]
    backoffs = [f for e in log.of_kind("lr_backoff") if e.step >= first
                and (f := _num(e["factor"])) is not None]  # fmt: skip
    factor = end_lr_factor(log)
    rollbacks = [e for e in log.of_kind("rollback") if e.step >= first]
    trends = warnings_of(log, "loss_trend", "grad_norm_trend")
    evidence = (
        f"{len(spikes)} spikes from step {first} on (steps {_list(e.step for e in spikes)})"
        + (f", on {len(fps)} different batches" if len(fps) > 1 else "")
        + f"; {_not_applied_words(log, first)}"
        + (f"; {len(rollbacks)} rollback(s)" if rollbacks else "")
        + (f"; LR back-offs down to a factor {min(backoffs):.2g}" if backoffs else "")
        + (f", {factor:.2g} at the end" if backoffs and factor is not None else "")
        + (f"; {change.says()}" if change is not None else "; no LR change in the log"
           if log.steps.column("lr").count(None) < len(log.steps) else "")
        + (f"; the loss ended {level.times()} its level before step {first}"
           if level.back is False else "")
        + ("; a rising trend was warned about too" if trends else "")
        + (f"; batches: {'; '.join(named)}" if named else "")
    )  # fmt: skip
    if rose:
        assert change is not None
        cause = (
            f"a change, not a batch: {change.says()}; from then on the updates are too large "
            "for the curvature, so the loss spikes on whichever batch comes"
        )
        fix = (
            f"undo or shrink the LR change at step {change.step} (check the schedule: a warmup "
            "that overshoots, a restart, a multiplier, a manual change)"
        )
    else:
        cause = (
            "not one batch: the spikes keep coming on different batches, so the training "
            "itself became unstable: an LR too high for this phase (the curvature sharpens "
            "as training goes on), too short a warmup, or a stretch of bad data (when the "
            "batches named come from one source)"
        )
        fix = "lower the peak LR (or lengthen warmup) and keep gradient clipping on"
    fix += "; the guard's rollbacks and LR back-offs only postpone it" + (
        f" (its LR factor is {factor:.2g})" if factor is not None and factor < 1 else ""
    )
    return Finding(
        "sustained_instability", f"Sustained instability from step {first}", evidence, cause,
        fix, 3 if level.back is False else 2, tuple(e.step for e in spikes[:20]),
    )  # fmt: skip


def _bursts(log: RunLog, episodes: list[Episode]) -> Finding:
    hits = [e for ep in episodes for e in ep.spikes]
    early = [ep for ep in episodes if ep.kind == "unresolved"]
    again = [e for e in hits if e["reproduced"] is True]
    unknown = [e for e in hits if e["reproduced"] is None]
    rolled = [e for e in log.of_kind("rollback") if e["cause"] is None]
    steps = tuple(e.step for e in hits)
    signals = sorted({str(e["signal"] or "loss") for e in hits})
    told = (
        f"; {len(again)} reproduced when the step was replayed" if again else
        "; not replayed (no closure, or under torch.distributed)"
    )  # fmt: skip
    changes = [ep.change for ep in episodes if ep.change is not None]
    rows = max(len(ep.spikes) for ep in episodes)
    if rows >= 2:
        cause = (
            f"spikes on {rows} batches in a row, then none: the weights, not one batch: an "
            "update too large for the curvature (an LR too high, a schedule jump) left them "
            "where every batch spikes" + ("; the rollback restored them" if rolled else "")
        )
    elif again and not unknown:
        cause = (
            "the replayed step spiked again, so the spike is in the batch or in the weights: "
            "an outlier or mislabelled batch, or an update too large for the curvature (LR "
            "too high, a schedule jump)"
        )
    else:
        cause = (
            "an update too large for the curvature (LR too high, or a learning-rate "
            "schedule jump), or an outlier batch"
        )
    if changes:
        cause += f" ({changes[0].says()})"
    return Finding(
        "loss_spikes",
        "Loss spikes" if signals == ["loss"] else "Spikes in the training signal",
        f"{len(hits)} spike(s) of {', '.join(signals)} at steps {_list(steps)}{told}"
        + (f"; {len(rolled)} rollback(s) after them" if rolled else "")
        + (
            f"; the run ended {min(ep.level.n_after for ep in early)} applied step(s) after "
            "the last: too soon to tell a bad batch from the start of an instability"
            if early else "; then none, and the loss came back"
        ),
        cause,
        "lower the peak LR or lengthen warmup; clip gradients (ZClip adapts the threshold); "
        "look at the batches at those steps",
        2, steps,
    )  # fmt: skip


@_rule("bad_batch", "sustained_instability", "loss_spikes", "transient_spikes")
def loss_spikes(events: RunLog) -> list[Finding]:
    """Spikes, told apart: by their replay (one that is gone when the step is replayed
    is a transient of the computation), then by their course (:func:`spike_episodes`):
    one spike that did not recur is a bad batch; spikes that keep coming after a change
    are an instability; a burst that stopped is an update too large."""
    spikes = list(events.of_kind("spike"))
    if not spikes:
        return []
    out = []
    episodes = spike_episodes(events)
    for kinds, make in ((("sustained",), _sustained), (("isolated",), _bad_batches),
                        (("burst", "unresolved"), _bursts)):  # fmt: skip
        chosen = [ep for ep in episodes if ep.kind in kinds]
        if chosen:
            out.append(make(events, chosen))
    gone = [e for e in spikes if e["reproduced"] is False]
    if gone:
        steps = tuple(e.step for e in gone)
        out.append(Finding(
            "transient_spikes", "Spikes that do not reproduce",
            f"{len(gone)} spike(s) at steps {_list(steps)} were gone when the same step was "
            "replayed with the same batch and weights",
            "the computation, not the data or the weights: nondeterminism (atomics, a race "
            "between streams), failing hardware, or randomness the replay does not repeat "
            "(dropout seeded outside torch's generators)",
            "if they are frequent, run the steps on another device and with "
            "torch.use_deterministic_algorithms(True); the guard skipped each one",
            2 if len(gone) >= 2 else 1, steps,
        ))  # fmt: skip
    return out


@_rule("transients")
def transients(events: RunLog) -> list[Finding]:
    hits = [e for e in events.of_kind("fault") if e["deterministic"] is False]
    if len(hits) < 2:
        return []
    steps = tuple(e.step for e in hits)
    return [Finding(
        "transients", "Faults that do not reproduce",
        f"{len(hits)} non-finite steps were clean when replayed (steps {_list(steps)})",
        "nondeterminism outside the model's math: failing hardware (GPU memory, a bad "
        "link), a race (asynchronous copies, a stream misuse) or a nondeterministic kernel",
        "run the same steps on another device; enable CUDA_LAUNCH_BLOCKING=1 and "
        "torch.use_deterministic_algorithms(True) to rule out races",
        2, steps,
    )]  # fmt: skip


@_rule("loss_nan")
def loss_nan_unguarded(events: RunLog) -> list[Finding]:
    steps = events.steps
    losses = steps.column("loss")
    known = [j for j, v in enumerate(losses) if v is not None]  # a step without a loss: unknown
    bad = [j for j in known if not _finite(losses[j])]
    if not bad or events.of_kind("fault"):
        return []
    # The run died where its last stretch of non-finite losses began; earlier isolated
    # ones (a bad batch a GradScaler loop survived) are told apart.
    bad_set, start = set(bad), bad[-1]
    while start - 1 in bad_set:
        start -= 1
    died = bad[-1] == known[-1]  # the run ended non-finite (its last known loss)
    first = steps.step[start] if died else steps.step[bad[0]]
    earlier = [steps.step[j] for j in bad if j < start] if died else []
    before = [
        g for s, g in zip(steps.step, steps.column("grad_norm"), strict=True)
        if first - 20 <= s < first and _finite(g)
    ]  # fmt: skip
    growing = len(before) >= 4 and before[-1] > 10 * statistics.median(before[: len(before) // 2])
    cause = (
        "divergence: the gradient norm grew >10x over the steps before, so the updates "
        "were too large (learning rate too high)"
        if growing
        else "a sudden overflow: the gradient norm was steady until then, so one value "
        "(logits into exp, a residual sum, an fp16 activation) jumped past the range"
    )
    fix = (
        "lower the LR, add warmup and clipping"
        if growing
        else "find the op with Guard.step(closure) (it replays the step) and stabilize it"
    )
    evidence = (
        f"non-finite from step {first} to the end ({len(bad) - bad.index(start)} steps)"
        + (f"; before that, isolated non-finite steps {_list(earlier)} the run survived"
           if earlier else "")
        if died
        else f"first at step {first} ({len(bad)} steps in all)"
    )  # fmt: skip
    return [Finding(
        "loss_nan", "The loss became NaN/inf", evidence, cause, fix, 3, (first,),
    )]  # fmt: skip


@_rule("loss_stuck")
def loss_stuck(events: RunLog) -> list[Finding]:
    losses = [e["loss"] for e in events.steps[-50:] if _finite(e["loss"])]
    if len(losses) < 30 or warnings_of(events, "loss_trend"):  # rising is not stuck
        return []
    if max(abs(v) for v in losses) > 700.0:  # no ln(n) of a class count is this large
        return []
    mean = statistics.fmean(losses)
    spread = statistics.pstdev(losses)
    n = round(math.exp(mean))
    if n < 2 or spread > 0.01 * max(mean, 1e-9) or abs(mean - math.log(n)) > 0.005 * math.log(n):
        return []
    return [Finding(
        "loss_stuck", f"The loss is stuck at ln({n})",
        f"the last {len(losses)} losses average {mean:.4f} = ln({n}) (spread {spread:.2g})",
        f"the model predicts the uniform distribution over {n} classes: the gradients do not "
        "reach it (dead activations, zero gradients from underflow, a detached graph) or the "
        "learning rate is 0",
        "check the gradient norm per layer (Monitor(mode='stats')), the LR schedule, and that "
        "the loss is computed from the model's output",
        2, (),
    )]  # fmt: skip


# A loss this small against the run's largest is 0: the model fits its batches exactly.
_ZERO_LOSS = 1e-9


def _zero_losses(steps: Steps) -> set[int]:
    """The steps whose loss is (relatively) exactly 0."""
    losses = steps.column("loss")
    finite = [abs(v) for v in losses if _finite(v)]
    ref = max(finite, default=0.0) or 1.0
    return {s for s, v in zip(steps.step, losses, strict=True)
            if _finite(v) and abs(v) <= _ZERO_LOSS * ref}  # fmt: skip


@_rule("zero_grad", "converged")
def zero_grad_norm(events: RunLog) -> list[Finding]:
    """Gradient norms of exactly 0 on applied steps: with a loss of 0 too, the model fits
    its batches (convergence); with a loss that is not 0, no gradient reaches the weights."""
    steps = events.steps
    solved = _zero_losses(steps)
    zeros = [
        s for s, g, a in zip(steps.step, steps.column("grad_norm"), steps.column("action"),
                             strict=True)
        if g == 0.0 and a == "applied"
    ]  # fmt: skip
    dead = [s for s in zeros if s not in solved]
    out = []
    converged = [s for s in zeros if s in solved]
    if len(converged) >= 3:
        out.append(Finding(
            "converged", "The loss reached 0: the model fits its training batches exactly",
            f"{len(converged)} applied step(s) with a loss of 0 and a gradient norm of exactly "
            f"0 (first at step {converged[0]})",
            "convergence, not a dead model: the model fits every example of those batches "
            "exactly (a memorized cross-entropy, whose log-softmax rounds to exactly 0 in "
            "float32; an exactly solvable regression), so there is no gradient left",
            "nothing to fix in the numerics; if it is unexpected (a large dataset, an early "
            "step), check for a target leaking into the inputs or a dataset too small, and "
            "evaluate on held-out data; stopping here saves compute",
            1, tuple(converged[:20]),
        ))  # fmt: skip
    if len(dead) < 3:
        return out
    fp16 = run_info(events).fp16
    cause = (
        "fp16 gradients underflowed to zero (the loss scale is too small for them)"
        if fp16
        else "no gradient reaches the parameters although the loss is not 0: dead ReLUs, a "
        "detached graph, or a frozen model"
    )
    return [Finding(
        "zero_grad", "The gradient norm is zero",
        f"{len(dead)} step(s) with a gradient norm of exactly 0 and a loss that is not 0 "
        f"(first at {dead[0]})",
        cause, "raise the loss scale (or use bf16)" if fp16 else
        "check requires_grad, the graph, and the activations' dead fraction",
        2, tuple(dead[:20]),
    ), *out]  # fmt: skip


@_rule("gradient_underflow")
def gradient_underflow(events: RunLog) -> list[Finding]:
    """Gradients that fp16 flushes to zero, measured on the sampled steps' statistics;
    what it means depends on the run's precision (``run`` event): a loss in an fp16 run
    without scaling, a lifted loss with scaling, and only a forecast in bf16/fp32."""
    worst: dict[str, float] = {}
    for e in _samples(events):
        for t in e["tensors"]:
            if "grad" not in t["role"]:
                continue
            u = (t.get("formats") or {}).get("fp16", {}).get("underflow")
            if _finite(u) and u > worst.get(f"{t['module']}.{t['role']}", 0.0):
                worst[f"{t['module']}.{t['role']}"] = u
    bad = {k: v for k, v in worst.items() if v >= 0.01}
    if not bad:
        return []
    info = run_info(events)
    top = sorted(bad.items(), key=lambda kv: -kv[1])[:3]
    evidence = ", ".join(f"{k}: {v:.1%}" for k, v in top)
    if info.fp16 is False:
        return [Finding(
            "gradient_underflow", "Gradients below fp16's range (if this run moved to fp16)",
            f"fraction that would flush to zero in fp16, unscaled: {evidence} (this run: "
            f"{info.says()}, so nothing is lost now)",
            "small gradients, as usual; bf16 and fp32 have float32's range and keep them",
            "nothing to do in bf16/fp32; a move to fp16 needs dynamic loss scaling "
            "(Guard(precision='fp16') does it)",
            1, (),
        )]  # fmt: skip
    if info.loss_scaling:
        return [Finding(
            "gradient_underflow", "Some gradients are below fp16's range even unscaled",
            f"fraction that would flush to zero in fp16, unscaled: {evidence} (the run uses "
            "a loss scale, which lifts them)",
            "small gradients, as usual: the loss scale is what keeps them", "nothing to do "
            "while the loss scale stays high; if it collapses, use bf16",
            1, (),
        )]  # fmt: skip
    if info.fp16 is None:
        return [Finding(
            "gradient_underflow", "Gradients below fp16's range",
            f"fraction that flushes to zero in fp16, unscaled: {evidence} (the log does not "
            "say the run's precision and shows no loss scaling)",
            "in an fp16 run without loss scaling these gradients become 0 and those weights "
            "stop learning; in bf16 or fp32 nothing is lost",
            "if the run is fp16: use dynamic loss scaling (Guard(precision='fp16') does), or "
            "bf16",
            2, (),
        )]  # fmt: skip
    return [Finding(
        "gradient_underflow", "Gradients flush to zero in fp16 (no loss scaling)",
        f"fraction that flushes to zero in fp16: {evidence} ({info.says()})",
        "fp16's smallest subnormal is 2^-24 (6e-8): smaller gradients become 0 and those "
        "weights stop learning; accuracy is lost silently",
        "use dynamic loss scaling (Guard(precision='fp16') does), or bf16",
        2, (),
    )]  # fmt: skip


def _samples(events: RunLog) -> list[Event]:
    return [e for e in events.of_kind("stats") if e["tensors"]]


def _count(t: dict[str, Any], key: str) -> int:
    v = t.get(key)
    return v if type(v) is int else 0


@_rule("dead_layers")
def dead_layers(events: RunLog) -> list[Finding]:
    """Layers whose gradient is all zero on a sampled step: dead units or underflow."""
    dead: dict[str, int] = {}
    zero_acts: dict[str, float] = {}
    solved = _zero_losses(events.steps)  # a loss of 0 has a zero gradient everywhere
    for e in _samples(events):
        if e.step in solved:
            continue
        for t in e["tensors"]:
            n = _count(t, "numel")
            if n <= 0:
                continue
            if t["role"].endswith(".grad") and _count(t, "zeros") == n:
                dead.setdefault(f"{t['module']}.{t['role']}", e.step)
            if t["role"] == "output[0]":
                frac = _count(t, "zeros") / n
                zero_acts[t["module"]] = max(zero_acts.get(t["module"], 0.0), frac)
    if not dead:
        return []
    mostly_zero = sorted(m for m, f in zero_acts.items() if f >= 0.9)
    fp16 = run_info(events).fp16
    if mostly_zero:
        cause = (
            f"dead units: the outputs of {', '.join(mostly_zero[:3])} are >= 90% zeros, "
            "so no gradient flows back through them (ReLU units pushed below 0 for good)"
        )
        fix = "a smaller LR, LeakyReLU/GELU, or a better initialization"
    elif fp16:
        cause = "fp16 underflow: the gradients are smaller than fp16's 6e-8 and became 0"
        fix = "raise the loss scale (min_scale) or train in bf16"
    else:
        cause = "no gradient reaches these parameters (unused in the loss, or detached)"
        fix = "check that the layer's output feeds the loss, and requires_grad"
    names = sorted(dead)
    return [Finding(
        "dead_layers", "Layers with an all-zero gradient",
        f"{len(names)} parameter gradient(s) exactly zero on a sampled step: "
        f"{', '.join(names[:4])}" + (" ..." if len(names) > 4 else ""),
        cause, fix, 2, tuple(sorted(set(dead.values()))),
    )]  # fmt: skip


@_rule("attention_logits")
def attention_logits(events: RunLog) -> list[Finding]:
    """Attention inputs (q/k projections) whose amax grows over the run: logits grow as
    their product, and the softmax saturates (the lesson on 1/sqrt(d_k))."""
    series: dict[str, list[tuple[int, float]]] = {}
    for e in _samples(events):
        for t in e["tensors"]:
            m = t["module"].lower()
            if t["role"] == "output[0]" and any(k in m for k in ("qkv", "q_proj", "k_proj",
                                                                 "query", "key")):  # fmt: skip
                if _finite(t.get("amax")) and t["amax"] > 0:
                    series.setdefault(t["module"], []).append((e.step, t["amax"]))
    out = []
    for module, pts in series.items():
        if len(pts) < 3:
            continue
        first, last = pts[0][1], pts[-1][1]
        if last >= 10 * first and last >= 8.0 and math.isfinite(last / first):
            out.append(Finding(
                "attention_logits", f"Attention logits grow in {module}",
                f"the amax of {module}'s output grew {last / first:.0f}x (from {first:.3g} at "
                f"step {pts[0][0]} to {last:.3g} at step {pts[-1][0]}); q k^T grows as its "
                "square",
                "unbounded q/k growth saturates the softmax: one key takes all the weight and "
                "the gradient through the softmax vanishes; in low precision the logits "
                "themselves overflow",
                "scale the scores by 1/sqrt(d_k), normalize q and k (QK-norm), or soft-cap "
                "the logits; lower the LR",
                2, (pts[-1][0],),
            ))  # fmt: skip
    return out


@_rule("fp16_divergence")
def fp16_divergence(events: RunLog) -> list[Finding]:
    """An fp16 run whose loss goes non-finite after a burst of overflows."""
    steps = events.steps
    if not run_info(events).fp16:
        return []
    bad = [s for s, v in zip(steps.step, steps.column("loss"), strict=True)
           if v is not None and not _finite(v)]  # fmt: skip
    if not bad:
        return []
    over = [e.step for e in events.of_kind("overflow") if bad[0] - 50 <= e.step <= bad[0]]
    if len(over) < 3:
        return []
    return [Finding(
        "fp16_divergence", "Divergence in fp16",
        f"{len(over)} gradient overflows in the 50 steps before the loss went non-finite at "
        f"step {bad[0]}",
        "the run's values outgrew fp16's range (65504): what trains in fp32 diverges after "
        "a switch to fp16 when activations or gradients grow (an LR tuned for fp32, a "
        "missing fp32 master copy of the weights, no loss scaling)",
        "keep fp32 master weights (MasterWeights), lower the LR, or train in bf16",
        3, (bad[0],),
    )]  # fmt: skip


@_rule("stopped")
def stopped(events: RunLog) -> list[Finding]:
    """The guard stopped the run: say so first, with its reason in words."""
    stops = events.of_kind("stop")
    if not stops:
        return []
    s = stops[-1]
    reason = str(s["reason"] or "unknown")
    resumed = [r for r in events.of_kind("resume") if r.rank == s.rank and r.time >= s.time]
    if resumed:  # the run went on: the stop is history, not how it ended
        return [Finding(
            "stopped", "The guard stopped the run once; it was resumed",
            f"at step {s.step}: {reason} ({describe(reason)}); resumed from step "
            f"{resumed[-1].step}" + (f"; the fault: {s['fault']}" if s["fault"] else ""),
            "the steps from the resumed snapshot on were run again (their earlier events "
            "are superseded by the resume)",
            "if the cause was not fixed before resuming, expect the same stop again",
            1, (s.step, resumed[-1].step),
        )]  # fmt: skip
    return [Finding(
        "stopped", "The guard stopped the run",
        f"at step {s.step}: {reason} ({describe(reason)})"
        + (f"; the fault: {s['fault']}" if s["fault"] else ""),
        "training on would have applied bad steps again: see the other findings for what "
        "kept failing",
        "fix that cause, then resume from the last snapshot (guard.resume()); the model "
        "was left as it was before the fault",
        3, (s.step,),
    )]  # fmt: skip


_NAMED_OPS = ("softmax", "aten.exp")


@_rule("localized_faults")
def localized_faults(events: RunLog) -> list[Finding]:
    """Faults born in the model that no specific rule names: where, by what, and the line
    (the replay's localization), so none goes unmentioned."""
    hits = [
        e for e in events.of_kind("fault")
        if e["phase"] not in ("input", "param")
        and not any(k in str(e["op"] or "") for k in _NAMED_OPS) and not _is_norm(e)
    ]  # fmt: skip
    by = Counter((e["module"], e["phase"], e["op"]) for e in hits)
    at = Counter((e["module"], e["phase"]) for e in hits)  # for a fault without its op

    def repeated(e: Event) -> bool:  # repeated: its own rule
        if e["op"] is None:
            return at[(e["module"], e["phase"])] > 1
        return by[(e["module"], e["phase"], e["op"])] > 1

    once = [e for e in hits if not repeated(e)]
    if not once:
        return []
    first = once[0]
    where = f"'{_where(first)}'" if first["module"] else "the model's root"
    line = f" at {first['source']}" if first["source"] else ""
    return [Finding(
        "localized_faults", "A non-finite value born in the model",
        f"{first['kind_of_value'] or 'a non-finite value'} born in {where} "
        f"({first['phase']}) by {first['op'] or 'an unknown op'}{line}, step {first.step}"
        + (f"; {len(once) - 1} more such fault(s)" if len(once) > 1 else ""),
        "an op whose inputs were finite gave NaN/inf: log of 0 or a negative, a division by "
        "zero, sqrt of a negative, an overflow in a low-precision op",
        "read the op and the line; guard the input of that op (clamp, add an eps) or compute "
        "it in float32",
        2, tuple(e.step for e in once),
    )]  # fmt: skip


@_rule("large_loss")
def large_loss(events: RunLog) -> list[Finding]:
    """A loss far larger than a normalized objective gives: targets or a reduction that
    scale every gradient (and overflow fp16) with it."""
    losses = [abs(v) for v in events.steps.column("loss") if _finite(v)]
    if len(losses) < 5:
        return []
    typical = statistics.median(losses)
    if typical < 1e4:
        return []
    fp16 = run_info(events).fp16
    return [Finding(
        "large_loss", "The loss is very large",
        f"median loss {typical:.3g} over {len(losses)} steps",
        "unnormalized targets (a regression on raw values), a sum over elements instead of "
        "a mean, or a loss weight: the gradients scale with it"
        + (", and in fp16 they overflow (65504) whatever the loss scale" if fp16 else ""),
        "normalize the targets (zero mean, unit variance), use reduction='mean', or scale the "
        "loss down; then clipping caps and loss scales mean what they usually do",
        2, (),
    )]  # fmt: skip


@_rule("clipped_most_steps")
def clipped_most_steps(events: RunLog) -> list[Finding]:
    """The absolute cap clips most healthy steps: the cap, not the adaptive rule, then
    sets every update's size (like a lower learning rate)."""
    info = run_info(events)
    if info.clip_cap is None:
        return []
    applied = events.steps.column("action").count("applied")
    by_cap, by_z = clipped_steps(events.steps, info)
    if applied < 20 or len(by_cap) < 0.5 * applied:
        return []
    all_norms = events.steps.column("grad_norm")
    norms = sorted(all_norms[j] for j in by_cap)
    what = "ZClip's absolute cap (max_grad_norm)" if info.clip_kind == "zclip" else "the cap"
    return [Finding(
        "clipped_most_steps", "The gradient-norm cap clips most steps",
        f"{len(by_cap)} of {applied} applied steps clipped to the cap "
        f"{info.clip_cap:g} (median norm before clipping {norms[len(norms) // 2]:.3g})"
        + (f"; {len(by_z)} more by ZClip's z-score" if by_z else ""),
        f"{what} is below this model's usual gradient norm, so every update is scaled "
        "down to it: the cap, not the z-score, sets the step size (as a lower learning rate "
        "would). A cap of 1.0 is the common LLM default (GPT-3, Llama, ZClip's own); on a "
        "small model or a summed loss the norm is often larger",
        "if that is not intended, raise the cap above the healthy norm or drop it "
        "(ClipPolicy(zclip=ZClipConfig(max_grad_norm=None)) lets ZClip adapt alone)",
        1, (),
    )]  # fmt: skip


# ------------------------------------------------ what does not NaN the loss (issue 36)
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


@_rule("nonfinite_buffer")
def nonfinite_buffer(events: RunLog) -> list[Finding]:
    """A floating buffer (BatchNorm's running statistics) holding a NaN or inf: a fault
    the guard answered with a rollback, a warning, or what the run ended with."""
    faults = _param_faults(events, "buffer")
    warned = warnings_of(events, "nonfinite_buffer")
    ended = [n for n in end_nonfinite(events) if n.startswith("buffer:")]
    if not (faults or warned or ended):
        return []
    names: dict[str, None] = {}
    for e in faults:
        names[str(e["tensor"] or "buffer:?").removeprefix("buffer:")] = None
    for e in warned:
        given = _evidence(e).get("buffers")
        for n in given if isinstance(given, list) else []:
            names[str(n).removeprefix("buffer:")] = None
    for n in ended:
        names[n.removeprefix("buffer:")] = None
    seen = sorted({e.step for e in [*faults, *warned]})
    first = seen[0] if seen else None
    rolled = first is not None and any(r.step >= first for r in events.of_kind("rollback"))
    if ended:
        outcome = "the run ended with them non-finite: every eval() forward through them is NaN"
    elif rolled:
        outcome = "the guard rolled back to a snapshot whose buffers were vetted finite"
    else:
        outcome = "no rollback followed and the log has no end check"
    return [Finding(
        "nonfinite_buffer", "A buffer holds a NaN or inf (the loss stays finite)",
        f"{', '.join(list(names)[:6])}" + (f" at step(s) {_list(seen)}" if seen else "")
        + f"; {outcome}",
        "running statistics took a non-finite value while the training loss stayed finite "
        "(train mode normalizes with the batch's own statistics; the running ones are used "
        "only in eval()): a batch holding NaN/inf went through a forward in train mode (a "
        "skipped step still updates BatchNorm's running statistics, and so does an eval or "
        "data-check pass run without model.eval()), a variance that overflows in a "
        "half-precision BatchNorm, or a write from outside (a checkpoint load)",
        "validate batches before the forward; run evaluation and data checks under "
        "model.eval(); keep BatchNorm in float32 (autocast does) with a larger eps in fp16; "
        "with very small batches use GroupNorm/LayerNorm; a model that ended with them: "
        "module.reset_running_stats() and recompute the statistics on clean data",
        3, tuple(seen),
    )]  # fmt: skip


def _layer_words(layers: list[Any]) -> str:
    out = []
    for layer in layers[:5]:
        if not isinstance(layer, dict):
            continue
        words = str(layer.get("name") or "?")
        extra = [str(layer["dtype"])] if isinstance(layer.get("dtype"), str) else []
        frac, numel = _num(layer.get("fraction")), layer.get("numel")
        if frac is not None:
            extra.append(f"{frac:.0%}" + (f" of {numel}" if type(numel) is int else ""))
        out.append(words + (f" ({', '.join(extra)})" if extra else ""))
    more = len(layers) - 5
    return ", ".join(out) + (f" and {more} more" if more > 0 else "")


@_rule("stalled_updates")
def stalled_updates(events: RunLog) -> list[Finding]:
    """16-bit weights whose updates are lost to rounding (the guard's ``stalled_updates``
    warning: elements whose fp32 update was nonzero and whose stored weight did not move)."""
    hits = warnings_of(events, "stalled_updates")
    if not hits:
        return []
    ev = _evidence(hits[-1])
    layers: list[Any] = ev["layers"] if isinstance(ev.get("layers"), list) else []
    frac, lr = _num(ev.get("fraction")), _num(ev.get("lr"))
    window = ev.get("window")
    span = (
        f" over steps {window[0]}-{window[1]}"
        if isinstance(window, list) and len(window) == 2 and all(type(w) is int for w in window)
        else ""
    )
    samples = ev.get("samples")
    detail = ", ".join(
        x for x in (f"{samples} samples" if type(samples) is int else "",
                    f"lr {lr:g}" if lr is not None else "") if x
    )  # fmt: skip
    info = run_info(events)
    dtypes = {str(x["dtype"]) for x in layers if isinstance(x, dict) and isinstance(
        x.get("dtype"), str)}  # fmt: skip
    low = (sorted(dtypes)[0] if dtypes else None) or info.weights_16bit or "16-bit"
    evidence = (
        (f"{frac:.0%} of the measured weight elements" if frac is not None
         else "most weight elements of the layers measured")
        + f" did not move{span}" + (f" ({detail})" if detail else "")
        + " although their update was not 0"
        + (f"; by layer, worst first: {_layer_words(layers)}" if layers else "")
    )  # fmt: skip
    if not ev:
        evidence = str(hits[-1]["message"] or "the guard warned of stalled updates")
    return [Finding(
        "stalled_updates", "Weight updates lost to rounding (16-bit weights)",
        evidence,
        f"the weights are {low} with no fp32 master copy: an update smaller than half the "
        f"spacing of {low} values around the weight rounds back to the same value (the "
        "spacing is 2^-7 of |w| in bf16, 2^-10 in fp16), so those weights stop learning "
        "while the loss drifts or rises, with no NaN",
        "keep fp32 master weights (floatguard.MasterWeights: the update is applied in fp32 "
        "and rounded once), or keep the model in fp32 and train under autocast; if the "
        "weights must stay 16-bit, use stochastic rounding or Kahan-compensated updates; a "
        "larger LR makes the updates survive only if that step size is what you intend",
        2, tuple(e.step for e in hits),
    )]  # fmt: skip


_TREND_SIGNALS = {"loss_trend": "loss", "grad_norm_trend": "gradient norm"}


def _ints(v: object) -> list[int]:
    return [x for x in v if type(x) is int] if isinstance(v, list) else []


@dataclass(frozen=True)
class Trend:
    """A trend warning's evidence, read from either shape a log may hold (TrendAlarm's
    ``best_start``/``window_values``/``lr_best`` ..., or ``best_window``/``windows``/
    ``changed``); a missing part is None (or empty)."""

    best: tuple[int, int] | None
    best_value: float | None
    windows: tuple[tuple[int, float], ...]
    ratio: float | None
    slope: float | None
    rise: int | None
    lr: tuple[float, float] | None  # the LR over the best window and the rise's start
    jump: tuple[float, int] | None  # the largest step-to-step LR factor, and its step
    scale: tuple[float, float] | None

    @classmethod
    def read(cls, ev: dict[str, Any]) -> Trend:
        changed: dict[str, Any] = ev["changed"] if isinstance(ev.get("changed"), dict) else {}
        best = _ints(ev.get("best_window")) or _ints([ev.get("best_start"), ev.get("best_end")])
        starts = _ints(ev.get("window_starts"))
        values: list[Any] = ev["window_values"] if isinstance(ev.get("window_values"), list) else []
        given: list[Any] = ev["windows"] if isinstance(ev.get("windows"), list) else []
        pairs = [(w[0], float(w[1])) for w in given if isinstance(w, list) and len(w) == 2
                 and type(w[0]) is int and _finite(w[1])]  # fmt: skip
        if not pairs and len(starts) == len(values):
            pairs = [(st, float(v)) for st, v in zip(starts, values, strict=True) if _finite(v)]
        rise = ev.get("rise_step", ev.get("rise_start"))
        jump, jump_step = _num(ev.get("lr_jump")), ev.get("lr_jump_step")
        return cls(
            (best[0], best[1]) if len(best) == 2 else None,
            _num(ev.get("best_mean", ev.get("best_value"))),
            tuple(pairs),
            _num(ev.get("ratio")),
            _num(ev.get("slope_per_step")),
            rise if type(rise) is int else None,
            _pair(changed.get("lr")) or _pair([ev.get("lr_best"), ev.get("lr_rise")]),
            (jump, jump_step) if jump is not None and type(jump_step) is int else None,
            _pair(changed.get("scale")) or _pair([ev.get("scale_best"), ev.get("scale_rise")]),
        )  # fmt: skip

    def words(self, signal: str) -> str:
        """The evidence in words: the best window, the rise, the windows."""
        parts = []
        if self.best_value is not None:
            where = (f" (steps {self.best[0]}-{self.best[1]}, its best window)"
                     if self.best else " (its best window)")  # fmt: skip
            parts.append(f"the {signal} rose from {self.best_value:.3g}{where}")
        else:
            parts.append(f"the {signal} rose steadily")
        if self.ratio is not None:
            parts.append(f"{_times(self.ratio)} its best level")
        if self.slope is not None and self.slope > 0:  # (a flat last window can make it < 0)
            parts.append(
                f"{self.slope:+.3g} a step"
                + (f" from step {self.rise}" if self.rise is not None else "")
            )
        elif self.rise is not None:
            parts.append(f"from step {self.rise}")
        if self.windows:
            w = self.windows
            shown = w if len(w) <= 8 else (*w[:3], None, *w[-4:])
            means = ", ".join("..." if x is None else f"{x[1]:.3g}" for x in shown)
            parts.append(f"median per window: {means}")
        return "; ".join(parts)


def _trend_change(events: RunLog, trend: Trend, start: int) -> tuple[str, str | None]:
    """What changed at a trend's start, in words, and "lr" / "scale" / "none" / None
    (unknown): the warning's LR and scale (best window against the rise's start), an LR
    jump it names, else the steps' own LR from the best window to the end."""
    lr = trend.lr
    end = max(events.steps.step, default=start)
    steps_lr = None
    if trend.best is not None:
        before = window_lr(events.steps, *trend.best)
        after = window_lr(events.steps, start, end)
        steps_lr = (before, after) if before is not None and after is not None else None
    words: list[str] = []
    what: str | None = None
    if trend.jump is not None and trend.jump[0] >= _LR_JUMP:
        words.append(f"the LR jumped {_times(trend.jump[0])} at step {trend.jump[1]}")
        what = "lr"
    for pair, span in ((lr, "from the best window to the rise's start"),
                       (steps_lr, "from the best window to the rise's median")):  # fmt: skip
        if what == "lr" or pair is None or pair[0] <= 0 or pair[1] <= 0:
            continue
        r = pair[1] / pair[0]
        if r >= _LR_JUMP:
            words.append(f"the LR rose {_times(r)} {span} ({pair[0]:.3g} to {pair[1]:.3g})")
            what = "lr"
        elif what is None:
            what = "none"
    if what == "none":
        assert (lr or steps_lr) is not None
        known = lr or steps_lr
        assert known is not None
        words.append(f"the LR did not rise ({known[0]:.3g} to {known[1]:.3g})")
    elif what is None:
        words.append("the LR is not in the log")
    if trend.scale is not None and trend.scale[0] != trend.scale[1]:
        words.append(f"the loss scale went from {trend.scale[0]:g} to {trend.scale[1]:g}")
        what = what if what == "lr" else "scale"
    return "; ".join(words), what


@_rule("slow_divergence")
def slow_divergence(events: RunLog) -> list[Finding]:
    """A sustained rise of the loss (or the gradient norm) with no NaN (the guard's
    ``loss_trend`` / ``grad_norm_trend`` warnings), and what changed at its start."""
    hits = warnings_of(events, *_TREND_SIGNALS)
    if not hits:
        return []
    loss = [e for e in hits if e["code"] == "loss_trend"]
    lead = (loss or hits)[-1]  # the latest: the trend as far as it went
    ev = _evidence(lead)
    trend = Trend.read(ev)
    signal = _TREND_SIGNALS[str(lead["code"])]
    start = trend.rise if trend.rise is not None else lead.step
    change, what = _trend_change(events, trend, start)
    also = sorted({_TREND_SIGNALS[str(e["code"])] for e in hits} - {signal})
    evidence = (
        (trend.words(signal) if ev else str(lead["message"] or f"the {signal} rose"))
        + f"; warned at step {lead.step}" + (f"; the {also[0]} rose too" if also else "")
        + f"; what changed: {change}"
    )  # fmt: skip
    if what == "lr":
        cause = (
            "the learning rate grew until the updates were too large for the curvature: an "
            "LR schedule that increases (a warmup that never ends, a cyclic or one-cycle "
            "peak, a restart, scheduler.step() called per micro-batch) or an LR set too high; "
            "it diverges slowly, with no NaN"
        )
        fix = ("lower the peak LR or fix the schedule (warmup length in steps, one "
               "scheduler.step() per optimizer step)")  # fmt: skip
    elif what in ("none", "scale"):
        cause = (
            "the loss rose with the LR unchanged: the data changed (labels growing noisy or "
            "shuffled, a corrupted or mislabelled shard, a distribution shift, a curriculum "
            "step), or an LR that was right earlier is too high for this phase"
            + ("; the fp16 loss scale also changed (if the gradients reach the optimizer "
               "still scaled, a custom step that skips unscaling, the update changes with it)"
               if what == "scale" else "")
        )  # fmt: skip
        fix = (
            f"look at the data from step {start} on (the labels, the source of those batches); "
            "evaluate on a clean held-out set (a held-out loss that keeps falling while the "
            "training loss rises means noisy training labels); if the data is clean, lower "
            "the LR"
        )
    else:
        cause = (
            "an LR schedule that increases or an LR too high for this phase, or the data "
            "going bad (noisy labels, a corrupted shard); the log does not say the LR"
        )
        fix = "check the LR schedule and the data from that step on; lower the LR"
    fix += "; the guard only warns about a trend: it changed nothing for it"
    title = (
        f"The {signal} rises steadily (no NaN)"
        if not also
        else "The loss and the gradient norm rise steadily (no NaN)"
    )
    return [Finding("slow_divergence", title, evidence, cause, fix, 2,
                    tuple(e.step for e in hits))]  # fmt: skip


def diagnose(events: Iterable[Event], unread: Sequence[str] = ()) -> list[Finding]:
    """Run every rule over ``events`` (a :class:`~floatguard.runlog.RunLog`, or any
    events: checked and completed as the reader does); the findings, most severe first
    (then earliest). ``unread``: the lines the reader could not read (its
    ``problems``); they, and any event given here that cannot be read, are counted
    and named in an ``unreadable_events`` finding, and no other finding rests on them.
    A field absent from an event that was read is unknown: no rule reads it as a
    value (a step without a loss is not a NaN loss)."""
    problems: list[str] = list(unread)
    log = global_view(RunLog.from_events(events, problems))  # several ranks: the agreed view
    found: list[Finding] = []
    for rule in _RULES:
        try:
            found.extend(rule(log))
        except Exception as e:  # a rule's bug must not hide the others' findings
            found.append(Finding(
                "rule_failed", f"The {rule.__name__} rule could not read this run",
                f"{type(e).__name__}: {e}",
                "a floatguard bug: the rule met a log it did not expect",
                "report it with the log (floatguard's issue tracker); the other findings stand",
                1, (),
            ))  # fmt: skip
    if problems:
        found.append(Finding(
            "unreadable_events", f"{len(problems)} line(s) or event(s) could not be read",
            "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5
                                       else ""),
            "a line cut short (a run killed mid-write), an event without a field it needs "
            "or with a field of the wrong type (a log written by another tool, or edited "
            "by hand)",
            "the diagnosis left them out and rests on the rest; fix or remove those lines",
            1, (),
        ))  # fmt: skip
    return sorted(found, key=lambda f: (-f.severity, f.steps[0] if f.steps else math.inf))


def _list(steps: Iterable[int], most: int = 8) -> str:
    s = list(steps)
    head = ", ".join(map(str, s[:most]))
    return head + (f" and {len(s) - most} more" if len(s) > most else "")
