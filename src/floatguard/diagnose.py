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

__all__ = ["Finding", "RunInfo", "diagnose", "run_info"]


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
        return RunInfo(precision, scaling, dtypes, kind, cap if cap and cap > 0 else None)
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


Rule = Callable[[RunLog], list[Finding]]
_RULES: list[Rule] = []


def _rule(fn: Rule) -> Rule:
    _RULES.append(fn)
    return fn


def _where(e: Event) -> str:
    return str(e["module"] or "<root>")


def _name(e: Event) -> str:
    return f"{_where(e)}.{e['tensor'] or '?'}"


@_rule
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
    "update" (the optimizer update made it), "magnitude" (a finite weight jumped
    absurdly) or "weight" (a weight already bad)."""
    cause = e.fields.get("cause")
    if cause == "nonfinite_optimizer_state" or str(e["tensor"]).startswith("optimizer:"):
        return "state"
    if cause == "optimizer_update" or e.fields.get("op") == "optimizer.step":
        return "update"
    if e.fields.get("op") == "magnitude":
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


@_rule
def optimizer_update(events: RunLog) -> list[Finding]:
    hits = _param_faults(events, "update")
    if not hits:
        return []
    steps = tuple(e.step for e in hits)
    names = sorted({_name(e) for e in hits})
    info = run_info(events)
    low = info.weights_16bit
    if low is not None:
        cause = (
            f"the weights are {low} with no fp32 master copy ({info.says()}), so the "
            f"update is computed and rounded in {low}: AdamW's eps (1e-8) is 0 in fp16, "
            "so a second moment that underflowed to 0 gives 0/0, and an update past the "
            "format's range is inf"
        )
        fix = ("keep fp32 master weights (floatguard.MasterWeights, or keep the model in "
               "fp32 and train under autocast instead of model.half()); use an eps the "
               "dtype can hold (>= 1e-4 in fp16); lower the LR")  # fmt: skip
    else:
        cause = (
            "the update itself overflowed or divided by zero with fp32 weights ("
            + info.says()
            + "): a learning rate far too high for this phase, an optimizer "
            "hyper-parameter out of range (eps=0, a beta of 1), or a custom optimizer's bug"
        )
        fix = ("lower the LR (or lengthen warmup) and check the optimizer's arguments; keep "
               "gradient clipping on")  # fmt: skip
    return [Finding(
        rule="optimizer_update", title="The optimizer update made a weight non-finite",
        evidence=(f"{', '.join(names)} finite with finite gradients before the update of "
                  f"step {hits[0].step - 1}, non-finite after it (step(s) {_list(steps)})"
                  f"{_on_ranks(hits)}"),
        cause=cause, fix=fix, severity=3, steps=steps,
    )]  # fmt: skip


@_rule
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


@_rule
def bad_parameter(events: RunLog) -> list[Finding]:
    hits = _param_faults(events, "weight", "magnitude")
    if not hits:
        return []
    steps = tuple(e.step for e in hits)
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
    names = sorted({_name(e) for e in hits})
    return [Finding(
        "bad_parameter", title, f"{', '.join(names)} at step(s) {_list(steps)}{_on_ranks(hits)}",
        cause, fix, 3, steps,
    )]  # fmt: skip


@_rule
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


@_rule
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


@_rule
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


@_rule
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


@_rule
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
        f"{len(over)} step(s) skipped with the loss scale backed off (steps {_list(steps)}); "
        f"scale now {last:g}",
        "scaled gradients above 65504: normal at the start of fp16 training, rare after",
        "nothing to do if rare (the scale recovers); frequent ones: lower the LR or use bf16",
        1, steps,
    )]  # fmt: skip


@_rule
def loss_spikes(events: RunLog) -> list[Finding]:
    """Spikes, told apart by their replay (the guard replays a spike's step when it
    can): one that spikes again is in the batch or the weights; one that does not is a
    transient of the computation; without a replay, the common causes."""
    spikes = list(events.of_kind("spike"))
    if not spikes:
        return []
    again = [e for e in spikes if e["reproduced"] is True]
    gone = [e for e in spikes if e["reproduced"] is False]
    unknown = [e for e in spikes if e["reproduced"] is None]
    rolled = [e for e in events.of_kind("rollback") if e["cause"] is None]
    out = []
    if again or unknown:
        hits = again + unknown
        steps = tuple(sorted(e.step for e in hits))
        signals = sorted({str(e["signal"] or "loss") for e in hits})
        told = (
            f"; {len(again)} reproduced when the step was replayed" if again else
            "; not replayed (no closure, or under torch.distributed)"
        )  # fmt: skip
        cause = (
            "the replayed step spiked again, so the spike is in the batch or in the weights: "
            "an outlier or mislabelled batch, or an update too large for the curvature (LR "
            "too high, a schedule jump)"
            if again and not unknown
            else "an update too large for the curvature (LR too high, or a learning-rate "
            "schedule jump), or an outlier batch"
        )
        out.append(Finding(
            "loss_spikes",
            "Loss spikes" if signals == ["loss"] else "Spikes in the training signal",
            f"{len(hits)} spike(s) of {', '.join(signals)} at steps {_list(steps)}{told}"
            + (f"; {len(rolled)} rollback(s) after them" if rolled else ""),
            cause,
            "lower the peak LR or lengthen warmup; clip gradients (ZClip adapts the threshold); "
            "look at the batches at those steps",
            2, steps,
        ))  # fmt: skip
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


@_rule
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


@_rule
def loss_nan_unguarded(events: RunLog) -> list[Finding]:
    steps = events.steps
    losses = steps.column("loss")
    bad = [j for j, v in enumerate(losses) if not _finite(v)]
    if not bad or events.of_kind("fault"):
        return []
    # The run died where its last stretch of non-finite losses began; earlier isolated
    # ones (a bad batch a GradScaler loop survived) are told apart.
    bad_set, start = set(bad), bad[-1]
    while start - 1 in bad_set:
        start -= 1
    died = bad[-1] == len(losses) - 1  # the run ended non-finite
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
        f"non-finite from step {first} to the end ({len(losses) - start} steps)"
        + (f"; before that, isolated non-finite steps {_list(earlier)} the run survived"
           if earlier else "")
        if died
        else f"first at step {first} ({len(bad)} steps in all)"
    )  # fmt: skip
    return [Finding(
        "loss_nan", "The loss became NaN/inf", evidence, cause, fix, 3, (first,),
    )]  # fmt: skip


@_rule
def loss_stuck(events: RunLog) -> list[Finding]:
    losses = [e["loss"] for e in events.steps[-50:] if _finite(e["loss"])]
    if len(losses) < 30:
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


@_rule
def zero_grad_norm(events: RunLog) -> list[Finding]:
    steps = events.steps
    zeros = [
        steps[j] for j, (g, a) in enumerate(zip(steps.column("grad_norm"),
                                                steps.column("action"), strict=True))
        if g == 0.0 and a == "applied"
    ]  # fmt: skip
    if len(zeros) < 3:
        return []
    fp16 = run_info(events).fp16
    cause = (
        "fp16 gradients underflowed to zero (the loss scale is too small for them)"
        if fp16
        else "no gradient reaches the parameters: dead ReLUs, a detached graph, or a frozen model"
    )
    return [Finding(
        "zero_grad", "The gradient norm is zero",
        f"{len(zeros)} step(s) with a gradient norm of exactly 0 (first at {zeros[0].step})",
        cause, "raise the loss scale (or use bf16)" if fp16 else
        "check requires_grad, the graph, and the activations' dead fraction",
        2, tuple(e.step for e in zeros[:20]),
    )]  # fmt: skip


@_rule
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


@_rule
def dead_layers(events: RunLog) -> list[Finding]:
    """Layers whose gradient is all zero on a sampled step: dead units or underflow."""
    dead: dict[str, int] = {}
    zero_acts: dict[str, float] = {}
    for e in _samples(events):
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


@_rule
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


@_rule
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


@_rule
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


@_rule
def localized_faults(events: RunLog) -> list[Finding]:
    """Faults born in the model that no specific rule names: where, by what, and the line
    (the replay's localization), so none goes unmentioned."""
    hits = [
        e for e in events.of_kind("fault")
        if e["phase"] not in ("input", "param")
        and not any(k in str(e["op"] or "") for k in _NAMED_OPS) and not _is_norm(e)
    ]  # fmt: skip
    by = Counter((e["module"], e["phase"], e["op"]) for e in hits)
    once = [e for e in hits if by[(e["module"], e["phase"], e["op"])] < 2]  # repeated: its rule
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


@_rule
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


@_rule
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


def diagnose(events: Iterable[Event]) -> list[Finding]:
    """Run every rule over ``events`` (a :class:`~floatguard.runlog.RunLog`, or any
    events: checked and completed as the reader does); the findings, most severe first
    (then earliest)."""
    problems: list[str] = []
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
            "unreadable_events", f"{len(problems)} event(s) could not be read",
            "; ".join(problems[:3]) + (" ..." if len(problems) > 3 else ""),
            "a field of the wrong type (a log written by another tool, or edited by hand)",
            "the diagnosis left them out; fix or remove those events",
            1, (),
        ))  # fmt: skip
    return sorted(found, key=lambda f: (-f.severity, f.steps[0] if f.steps else math.inf))


def _list(steps: Iterable[int], most: int = 8) -> str:
    s = list(steps)
    head = ", ".join(map(str, s[:most]))
    return head + (f" and {len(s) - most} more" if len(s) > most else "")
