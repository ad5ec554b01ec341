"""Rules over the loss and the gradients: a NaN loss, a stuck or large loss, zero and
underflowing gradients, dead layers, attention logits, fp16 divergence, the stop, the
faults no other rule names, clipping."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from typing import Any

from floatguard._event_schema import finite as _finite
from floatguard.causes import describe
from floatguard.diagnose._base import (
    Finding,
    _is_norm,
    _list,
    _rule,
    _where,
    clipped_steps,
    run_info,
    warnings_of,
)
from floatguard.events import Event
from floatguard.runlog import RunLog, Steps


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
        "loss_nan", "", evidence, cause, fix, 3, (first,),
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
        "loss_stuck", f"ln({n})",
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
            "converged", "the model fits its training batches exactly",
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
        "zero_grad", "",
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
            "gradient_underflow", "if this run moved to fp16",
            f"fraction that would flush to zero in fp16, unscaled: {evidence} (this run: "
            f"{info.says()}, so nothing is lost now)",
            "small gradients, as usual; bf16 and fp32 have float32's range and keep them",
            "nothing to do in bf16/fp32; a move to fp16 needs dynamic loss scaling "
            "(Guard(precision='fp16') does it)",
            1, (),
        )]  # fmt: skip
    if info.loss_scaling:
        return [Finding(
            "gradient_underflow", "some, even unscaled",
            f"fraction that would flush to zero in fp16, unscaled: {evidence} (the run uses "
            "a loss scale, which lifts them)",
            "small gradients, as usual: the loss scale is what keeps them", "nothing to do "
            "while the loss scale stays high; if it collapses, use bf16",
            1, (),
        )]  # fmt: skip
    if info.fp16 is None:
        return [Finding(
            "gradient_underflow", "",
            f"fraction that flushes to zero in fp16, unscaled: {evidence} (the log does not "
            "say the run's precision and shows no loss scaling)",
            "in an fp16 run without loss scaling these gradients become 0 and those weights "
            "stop learning; in bf16 or fp32 nothing is lost",
            "if the run is fp16: use dynamic loss scaling (Guard(precision='fp16') does), or "
            "bf16",
            2, (),
        )]  # fmt: skip
    return [Finding(
        "gradient_underflow", "no loss scaling: fp16 flushes them to zero",
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
        "dead_layers", "",
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
                "attention_logits", f"in {module}",
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
        "fp16_divergence", "",
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
            "stopped", "once; it was resumed",
            f"at step {s.step}: {reason} ({describe(reason)}); resumed from step "
            f"{resumed[-1].step}" + (f"; the fault: {s['fault']}" if s["fault"] else ""),
            "the steps from the resumed snapshot on were run again (their earlier events "
            "are superseded by the resume)",
            "if the cause was not fixed before resuming, expect the same stop again",
            1, (s.step, resumed[-1].step),
        )]  # fmt: skip
    return [Finding(
        "stopped", "",
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
        "localized_faults", "",
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
        "large_loss", "",
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
        "clipped_most_steps", "",
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
