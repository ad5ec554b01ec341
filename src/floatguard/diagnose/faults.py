"""Rules over faults: bad data, bad weights and optimizer state, ops (softmax, exp,
normalizations), repeated modules, fp16 overflows."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence

from floatguard._event_schema import finite as _finite
from floatguard.diagnose._base import (
    Finding,
    RunInfo,
    _is_norm,
    _list,
    _name,
    _param_faults,
    _param_kind,
    _rule,
    _where,
    run_info,
)
from floatguard.events import Event
from floatguard.runlog import RunLog


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
        "bad_input", "",
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
        "repeated_bad_input", "",
        f"{len(hits)} non-finite batch(es) {pattern}; in {', '.join(tensors[:3]) or 'the input'}",
        "not bad luck: a sample or a preprocessing step that always yields NaN/inf (a "
        "log of 0, a division by a zero count, an uninitialized buffer in the loader); "
        "skipping it hides the bug and loses those batches every epoch",
        "find the sample (the fault's step and batch index) and fix or filter it at the "
        "source; ResponsePolicy(bad_data_stop_after=...) bounds how many the guard skips"
        + ("; the guard stopped the run for it" if stopped else ""),
        3, tuple(steps),
    )  # fmt: skip


def _on_ranks(hits: Sequence[Event]) -> str:
    """Where the faults were found (", on rank 1", ", on ranks 1, 3"; "" if not named)."""
    ranks = sorted({e["fault_rank"] for e in hits if e["fault_rank"] is not None})
    if not ranks:
        return ""
    return f", on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


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
        rule="optimizer_update", detail="",
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
        "by the update, or by a write outside it",
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
        rule="bad_optimizer_state", detail="",
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
            "bad_parameter", "written outside the optimizer update",
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
        detail = "an absurd (finite) magnitude"
        cause = (
            "a weight stayed finite but jumped to an absurd magnitude between steps (orders "
            "of magnitude past its value at the last snapshot): a flipped exponent bit "
            "(memory corruption) or a write from outside the optimizer"
        )
        fix = ("the guard rolled back to the last verified snapshot; if it recurs on one "
               "machine, check its memory (ECC errors) and run the job elsewhere")  # fmt: skip
    elif spikes_before:
        detail = "non-finite, or past the format's range"
        cause = ("an optimizer step with too large an update (loss or gradient spikes came "
                 "just before it): the learning rate is too high for this phase")  # fmt: skip
        fix = "lower the peak LR or lengthen warmup; keep gradient clipping on"
    else:
        detail = "non-finite, or past the format's range"
        cause = (
            "a weight changed between steps with no warning in the training signal: "
            "memory corruption (a flipped bit) or a write from outside the optimizer"
        )
        fix = ("the guard rolled back to the last verified snapshot; if it recurs on one "
               "machine, check its memory (ECC errors) and run the job elsewhere")  # fmt: skip
    return [Finding(
        "bad_parameter", detail, f"{', '.join(names)} at step(s) {_list(steps)}{_on_ranks(hits)}",
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
        "masked_softmax", "",
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
        "exp_overflow", "",
        f"inf born in {_where(hits[0])} by {hits[0]['op']}"
        + (f" at {hits[0]['source']}" if hits[0]["source"] else ""),
        "exp of raw logits: anything above ~88.7 (float32) or ~11.1 (fp16) is inf",
        "subtract the maximum first (log-sum-exp trick): floatguard.ops.logsumexp / "
        "softmax / cross_entropy, or torch's own fused ops",
        2, steps,
    )]  # fmt: skip


# |x| past this squares past float32's range: a normalization's variance is inf, not 0
_SQUARE_OVERFLOWS = math.sqrt(3.4028234663852886e38)


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
            "norm_input_out_of_range", "",
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
            "norm_eps", "", evidence,
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
            "repeated_module", f"in {module or '<root>'}",
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
            "scale_collapse", "",
            f"{len(over)} overflow back-offs; the scale fell to {last:g}",
            "the gradients overflow fp16 at any scale: a value in the backward pass grows past "
            "65504 by itself (large activations, an unnormalized residual stream)",
            "train in bf16 (same range as float32), or find the layer whose gradient overflows "
            "(the guard localizes it once the scale cannot back off further)",
            3, steps,
        )]  # fmt: skip
    return [Finding(
        "fp16_overflow", "",
        f"{len(over)} step(s) skipped for a gradient overflow (steps {_list(steps)})"
        + (f"; the loss scale backed off, now {last:g}" if afters else ""),
        "scaled gradients above 65504: normal at the start of fp16 training, rare after",
        "nothing to do if rare (the scale recovers); frequent ones: lower the LR or use bf16",
        1, steps,
    )]  # fmt: skip
