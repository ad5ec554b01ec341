"""Diagnosis: rules over the event stream, each a finding with evidence, cause and fix.

Each rule reads the events (``step``, ``fault``, ``overflow``, ``spike``, ``rollback``,
``warning`` ...) and returns zero or more :class:`Finding`; :func:`diagnose` runs them
all and ranks the findings (what stops a run first, then what costs it most). The
rules are the common numerical bugs of deep-learning training (the lessons' table,
`docs/lessons.md`): each tells its causes apart by the evidence where it can.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from floatguard.events import Event

__all__ = ["Finding", "diagnose"]


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


Rule = Callable[[list[Event]], list[Finding]]
_RULES: list[Rule] = []


def _rule(fn: Rule) -> Rule:
    _RULES.append(fn)
    return fn


def _steps(events: list[Event]) -> list[Event]:
    return [e for e in events if e.kind == "step"]


def _faults(events: list[Event]) -> list[Event]:
    return [e for e in events if e.kind == "fault"]


def _where(e: Event) -> str:
    return e["module"] or "<root>"


@_rule
def bad_input(events: list[Event]) -> list[Finding]:
    hits = [e for e in _faults(events) if e["phase"] == "input"]
    if not hits:
        return []
    steps = tuple(e.step for e in hits)
    stopped = any(e.kind == "stop" and e.fields.get("reason") == "bad_data" for e in events)
    done = (
        "the guard stopped the run: so many batches were non-finite that training on "
        "would learn from too little data"
        if stopped
        else "the guard skipped each such batch without changing the LR or the loss scale"
    )
    return [Finding(
        "bad_input", "Non-finite values in the data",
        f"{len(hits)} batch(es) carried NaN/inf into the step (steps {_list(steps)}); "
        f"first at {hits[0]['source'] or hits[0]['tensor']}",
        "the data pipeline produced them (a corrupted sample, a bad loss mask, a division "
        "by zero in preprocessing); the model did nothing wrong",
        "validate batches where they are made (torch.isfinite on inputs and loss weights); "
        + done,
        3 if stopped else 2, steps,
    )]  # fmt: skip


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


@_rule
def optimizer_update(events: list[Event]) -> list[Finding]:
    hits = [e for e in _faults(events) if e["phase"] == "param" and _param_kind(e) == "update"]
    if not hits:
        return []
    steps = tuple(e.step for e in hits)
    names = sorted({f"{_where(e)}.{e['tensor']}" for e in hits})
    return [Finding(
        rule="optimizer_update", title="The optimizer update made a weight non-finite",
        evidence=(f"{', '.join(names)} finite with finite gradients before the update of "
                  f"step {hits[0].step - 1}, non-finite after it (step(s) {_list(steps)})"),
        cause=("the update itself overflowed or divided by zero: with 16-bit weights the "
               "update is computed and rounded in 16 bits, and AdamW's eps (1e-8) is 0 in "
               "fp16, so a moment that underflowed to 0 gives 0/0; or the LR is too high"),
        fix=("keep fp32 master weights (floatguard.MasterWeights, or train in fp32 under "
             "autocast instead of model.half()); use an eps the dtype can hold (>= 1e-4 "
             "in fp16); lower the LR"),
        severity=3, steps=steps,
    )]  # fmt: skip


@_rule
def bad_optimizer_state(events: list[Event]) -> list[Finding]:
    hits = [e for e in _faults(events) if e["phase"] == "param" and _param_kind(e) == "state"]
    if not hits:
        return []
    steps = tuple(e.step for e in hits)
    names = sorted({f"{_where(e)}.{e['tensor']}" for e in hits})
    return [Finding(
        rule="bad_optimizer_state", title="An optimizer state tensor went non-finite",
        evidence=f"{', '.join(names)} at step(s) {_list(steps)}",
        cause=("a moment (exp_avg, exp_avg_sq) held a NaN or inf before the weight it updates "
               "went bad: a low-precision optimizer state that overflowed (g**2 past fp16's "
               "range), a write from outside the optimizer, or memory corruption"),
        fix=("keep optimizer states in fp32; the guard rolled back to the last snapshot, "
             "whose states were vetted finite; if it recurs on one machine, check its memory"),
        severity=3, steps=steps,
    )]  # fmt: skip


@_rule
def bad_parameter(events: list[Event]) -> list[Finding]:
    hits = [
        e for e in _faults(events)
        if e["phase"] == "param" and _param_kind(e) in ("weight", "magnitude")
    ]  # fmt: skip
    if not hits:
        return []
    steps = tuple(e.step for e in hits)
    spikes_before = [
        e for e in events if e.kind in ("spike", "lr_backoff") and hits[0].step - 20 <= e.step
        < hits[0].step
    ]  # fmt: skip
    if all(_param_kind(e) == "magnitude" for e in hits):
        cause = (
            "a weight stayed finite but jumped to an absurd magnitude between steps (orders "
            "of magnitude past its value at the last snapshot): a flipped exponent bit "
            "(memory corruption) or a write from outside the optimizer"
        )
        fix = ("the guard rolled back to the last verified snapshot; if it recurs on one "
               "machine, check its memory (ECC errors) and run the job elsewhere")  # fmt: skip
    elif spikes_before:
        cause = ("an optimizer step with too large an update (loss or gradient spikes came "
                 "just before it): the learning rate is too high for this phase")  # fmt: skip
        fix = "lower the peak LR or lengthen warmup; keep gradient clipping on"
    else:
        cause = (
            "a weight changed between steps with no warning in the training signal: "
            "memory corruption (a flipped bit) or a write from outside the optimizer"
        )
        fix = ("the guard rolled back to the last verified snapshot; if it recurs on one "
               "machine, check its memory (ECC errors) and run the job elsewhere")  # fmt: skip
    names = sorted({f"{_where(e)}.{e['tensor']}" for e in hits})
    return [Finding(
        "bad_parameter", "A weight went non-finite (or past the format's range)",
        f"{', '.join(names)} at step(s) {_list(steps)}", cause, fix, 3, steps,
    )]  # fmt: skip


@_rule
def masked_softmax(events: list[Event]) -> list[Finding]:
    hits = [
        e for e in _faults(events)
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
def exp_overflow(events: list[Event]) -> list[Finding]:
    hits = [e for e in _faults(events) if (e["op"] or "").startswith("aten.exp")]
    if not hits:
        return []
    steps = tuple(e.step for e in hits)
    return [Finding(
        "exp_overflow", "exp() overflowed",
        f"inf born in {_where(hits[0])} by {hits[0]['op']} at {hits[0]['source']}",
        "exp of raw logits: anything above ~88.7 (float32) or ~11.1 (fp16) is inf",
        "subtract the maximum first (log-sum-exp trick): floatguard.ops.logsumexp / "
        "softmax / cross_entropy, or torch's own fused ops",
        2, steps,
    )]  # fmt: skip


@_rule
def norm_eps(events: list[Event]) -> list[Finding]:
    hits = [
        e for e in _faults(events)
        if any(k in (e["op"] or "") for k in ("rsqrt", "native_layer_norm", "div"))
        and any(k in e["module"].lower() for k in ("norm", "ln", "bn"))
    ]  # fmt: skip
    if not hits:
        return []
    steps = tuple(e.step for e in hits)
    return [Finding(
        "norm_eps", "A normalization divided by a vanishing variance",
        f"{hits[0]['kind_of_value']} born in {_where(hits[0])} by {hits[0]['op']}",
        "a (near-)constant input makes the variance 0; with a tiny eps (or one below the "
        "format's smallest normal, as 1e-6 is in fp16) 1/sqrt(var + eps) overflows",
        "use eps >= 1e-5 (1e-4 or more under fp16), or compute the statistics in float32 "
        "(floatguard.ops.layer_norm / rms_norm)",
        2, steps,
    )]  # fmt: skip


@_rule
def repeated_module(events: list[Event]) -> list[Finding]:
    by = Counter((e["module"], e["phase"], e["op"]) for e in _faults(events)
                 if e["phase"] not in ("input", "param"))  # fmt: skip
    out = []
    for (module, phase, op), n in by.items():
        if n < 2:
            continue
        steps = tuple(e.step for e in _faults(events)
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
def scale_collapse(events: list[Event]) -> list[Finding]:
    over = [e for e in events if e.kind == "overflow"]
    if not over:
        return []
    last = over[-1]["scale_after"]
    steps = tuple(e.step for e in over)
    if last <= 1.0 or len(over) >= 20:
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
def loss_spikes(events: list[Event]) -> list[Finding]:
    spikes = [e for e in events if e.kind == "spike"]
    if not spikes:
        return []
    steps = tuple(e.step for e in spikes)
    rolled = [e for e in events if e.kind == "rollback" and e["cause"] is None]
    return [Finding(
        "loss_spikes", "Loss spikes",
        f"{len(spikes)} spike(s) at steps {_list(steps)}"
        + (f"; {len(rolled)} rollback(s) after them" if rolled else ""),
        "an update too large for the curvature (LR too high, or a learning-rate schedule "
        "jump), or an outlier batch",
        "lower the peak LR or lengthen warmup; clip gradients (ZClip adapts the threshold); "
        "look at the batches at those steps",
        2, steps,
    )]  # fmt: skip


@_rule
def transients(events: list[Event]) -> list[Finding]:
    hits = [e for e in _faults(events) if e["deterministic"] is False]
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
def loss_nan_unguarded(events: list[Event]) -> list[Finding]:
    steps = _steps(events)
    bad = [e for e in steps if not _finite(e["loss"])]
    if not bad or _faults(events):
        return []
    first = bad[0].step
    before = [
        e["grad_norm"] for e in steps if first - 20 <= e.step < first and _finite(e["grad_norm"])
    ]
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
    return [Finding(
        "loss_nan", "The loss became NaN/inf", f"first at step {first} ({len(bad)} steps in all)",
        cause, fix, 3, (first,),
    )]  # fmt: skip


@_rule
def loss_stuck(events: list[Event]) -> list[Finding]:
    losses = [e["loss"] for e in _steps(events)[-50:] if _finite(e["loss"])]
    if len(losses) < 30:
        return []
    mean = statistics.fmean(losses)
    spread = statistics.pstdev(losses)
    n = round(math.exp(min(mean, 700.0)))  # (a loss past ~709 overflows exp: cap it)
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
def zero_grad_norm(events: list[Event]) -> list[Finding]:
    zeros = [e for e in _steps(events) if e["grad_norm"] == 0.0]
    if len(zeros) < 3:
        return []
    fp16 = any(e["scale"] not in (None, 1.0) for e in _steps(events))
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
def gradient_underflow(events: list[Event]) -> list[Finding]:
    """Gradients that fp16 flushes to zero, measured on the sampled steps' statistics."""
    samples = [e for e in events if e.kind == "stats"]
    worst: dict[str, float] = {}
    for e in samples:
        for t in e["tensors"]:
            if "grad" not in t["role"]:
                continue
            u = t["formats"].get("fp16", {}).get("underflow")
            if _finite(u) and u > worst.get(f"{t['module']}.{t['role']}", 0.0):
                worst[f"{t['module']}.{t['role']}"] = u
    bad = {k: v for k, v in worst.items() if v >= 0.01}
    if not bad:
        return []
    scaled = any(_finite(e["scale"]) and e["scale"] > 1.0 for e in _steps(events))
    top = sorted(bad.items(), key=lambda kv: -kv[1])[:3]
    evidence = ", ".join(f"{k}: {v:.1%}" for k, v in top)
    if scaled:
        return [Finding(
            "gradient_underflow", "Some gradients are below fp16's range even unscaled",
            f"fraction that would flush to zero in fp16, unscaled: {evidence} (the run uses "
            "a loss scale, which lifts them)",
            "small gradients, as usual: the loss scale is what keeps them", "nothing to do "
            "while the loss scale stays high; if it collapses, use bf16",
            1, (),
        )]  # fmt: skip
    return [Finding(
        "gradient_underflow", "Gradients flush to zero in fp16 (no loss scaling)",
        f"fraction that flushes to zero in fp16: {evidence}",
        "fp16's smallest subnormal is 2^-24 (6e-8): smaller gradients become 0 and those "
        "weights stop learning; accuracy is lost silently",
        "use dynamic loss scaling (Guard(precision='fp16') does), or bf16",
        2, (),
    )]  # fmt: skip


def _samples(events: list[Event]) -> list[Event]:
    return [e for e in events if e.kind == "stats" and e["tensors"]]


@_rule
def dead_layers(events: list[Event]) -> list[Finding]:
    """Layers whose gradient is all zero on a sampled step: dead units or underflow."""
    dead: dict[str, int] = {}
    zero_acts: dict[str, float] = {}
    for e in _samples(events):
        for t in e["tensors"]:
            n = t.get("numel", 0)
            if not n:
                continue
            if t["role"].endswith(".grad") and t.get("zeros", 0) == n:
                dead.setdefault(f"{t['module']}.{t['role']}", e.step)
            if t["role"] == "output[0]":
                frac = t.get("zeros", 0) / n
                zero_acts[t["module"]] = max(zero_acts.get(t["module"], 0.0), frac)
    if not dead:
        return []
    mostly_zero = sorted(m for m, f in zero_acts.items() if f >= 0.9)
    fp16 = any(_finite(e["scale"]) and e["scale"] > 1.0 for e in _steps(events))
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
def attention_logits(events: list[Event]) -> list[Finding]:
    """Attention inputs (q/k projections) whose amax grows over the run: logits grow as
    their product, and the softmax saturates (the lesson on 1/sqrt(d_k))."""
    series: dict[str, list[tuple[int, float]]] = {}
    for e in _samples(events):
        for t in e["tensors"]:
            m = t["module"].lower()
            if t["role"] == "output[0]" and any(k in m for k in ("qkv", "q_proj", "k_proj",
                                                                 "query", "key")):  # fmt: skip
                if _finite(t["amax"]) and t["amax"] > 0:
                    series.setdefault(t["module"], []).append((e.step, t["amax"]))
    out = []
    for module, pts in series.items():
        if len(pts) < 3:
            continue
        first, last = pts[0][1], pts[-1][1]
        if last >= 10 * first and last >= 8.0:
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
def fp16_divergence(events: list[Event]) -> list[Finding]:
    """An fp16 run whose loss goes non-finite after a burst of overflows."""
    steps = _steps(events)
    if not any(_finite(e["scale"]) and e["scale"] > 1.0 for e in steps):
        return []
    bad = [e.step for e in steps if not _finite(e["loss"])]
    if not bad:
        return []
    over = [e.step for e in events if e.kind == "overflow" and bad[0] - 50 <= e.step <= bad[0]]
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


def diagnose(events: Iterable[Event]) -> list[Finding]:
    """Run every rule over ``events``; the findings, most severe first (then earliest)."""
    evs = list(events)
    found: list[Finding] = []
    for rule in _RULES:
        found.extend(rule(evs))
    return sorted(found, key=lambda f: (-f.severity, f.steps[0] if f.steps else math.inf))


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _list(steps: Iterable[int], most: int = 8) -> str:
    s = list(steps)
    head = ", ".join(map(str, s[:most]))
    return head + (f" and {len(s) - most} more" if len(s) > most else "")
