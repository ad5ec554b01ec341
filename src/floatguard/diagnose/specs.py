"""Every finding id as data: its title, how severe, the lesson it comes from, the fix.

One id names the rule's finding, its row in ``docs/report.md``, its entry here and the
CLI's filter (``floatguard diagnose LOG --rule ID``); ``floatguard diagnose
--list-rules`` prints this table. A finding's title is its spec's, with the finding's
``detail`` after a colon where it has one (the module, the step, the signal); its
evidence, cause and fix say more than the spec, which is what holds for every finding
of that id. ``tests/test_diagnose.py`` checks that every id a rule declares has
a spec here and a docs row, and that every finding's severity is its spec's.

The lessons are the claims of ``docs/lessons.md`` (the numerics each rule stands on).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SPECS", "RuleSpec"]


@dataclass(frozen=True)
class RuleSpec:
    """``severity``: 3 stops or corrupts a run, 2 costs steps, 1 worth a look."""

    id: str
    title: str
    severity: int
    lesson: str
    fix: str


_TABLE: tuple[RuleSpec, ...] = (
    RuleSpec("stopped", "The guard stopped the run", 3,
             "training on after a fault it cannot skip applies bad steps again",
             "fix the cause the other findings name, then guard.resume()"),
    RuleSpec("bad_input", "Non-finite values in the data", 3,
             "a NaN in the inputs is born before the model: no op of the model is at fault",
             "check the data pipeline (a division by a zero std, a corrupt sample)"),
    RuleSpec("repeated_bad_input", "Non-finite batches keep coming", 3,
             "the same bad sample each epoch is a data bug, not numerics",
             "find the sample by its position or fingerprint and fix or drop it"),
    RuleSpec("optimizer_update", "The optimizer's update made a weight non-finite", 3,
             "Adam's update divides by sqrt(v) + eps: a tiny eps in 16-bit state overflows",
             "keep optimizer state in fp32 (MasterWeights), raise eps, lower the LR"),
    RuleSpec("update_or_outside", "A weight became non-finite between checks", 3,
             "a weight is written by the update or by code outside it; the log tells which "
             "only when the update was verified",
             "rerun with the guard's parameter check each step to tell them apart"),
    RuleSpec("bad_optimizer_state", "The optimizer's state holds a NaN or inf", 3,
             "moments in a 16-bit dtype overflow (v = g^2 past 65504 in fp16)",
             "keep optimizer state in fp32; find what wrote the state if it was fp32"),
    RuleSpec("bad_parameter", "A weight went bad between steps", 3,
             "a weight that changed without an update was written by other code",
             "find the write (an in-place op on a parameter, a bad checkpoint load)"),
    RuleSpec("nonfinite_buffer", "A buffer holds a NaN or inf", 3,
             "running statistics average every batch: one NaN batch poisons them for good",
             "skip the bad batch before the forward; reset the buffer from a snapshot"),
    RuleSpec("masked_softmax", "Softmax over a row with every entry masked", 2,
             "softmax of a row that is all -inf is 0/0",
             "use a finite mask value (finfo.min) or floatguard.ops.softmax"),
    RuleSpec("exp_overflow", "exp() overflowed", 2,
             "exp(x) overflows fp32 above 88.7 and fp16 above 11.1: subtract the max first",
             "compute exp of x - max(x) (log-sum-exp), or in fp32"),
    RuleSpec("norm_eps", "A normalization divided by a vanishing variance", 2,
             "normalization needs an eps above the format's smallest normal",
             "raise eps (1e-5 in fp32, 1e-4 or more in fp16), or normalize in fp32"),
    RuleSpec("norm_input_out_of_range", "A normalization was given values out of range", 3,
             "a variance is a mean of squares: inputs above sqrt(max) overflow it",
             "find what grew the activations; normalize in fp32"),
    RuleSpec("repeated_module", "Repeated faults in one module", 3,
             "a fault that comes back in the same op is deterministic: skipping cannot fix it",
             "stabilize that op (clamp its input, compute it in fp32)"),
    RuleSpec("scale_collapse", "The fp16 loss scale collapsed", 3,
             "a gradient that overflows fp16 at any scale is not an underflow problem",
             "train in bf16, or find the layer whose gradient overflows"),
    RuleSpec("fp16_overflow", "fp16 gradient overflows", 1,
             "dynamic loss scaling probes upward and backs off: rare overflows are its design",
             "nothing if rare; frequent ones: lower the LR or use bf16"),
    RuleSpec("bad_batch", "Bad batches", 2,
             "an isolated spike that the loss recovers from is the batch, not the training",
             "look at the batch by its fingerprint; skipping it was right"),
    RuleSpec("sustained_instability", "Sustained instability", 3,
             "spikes that keep coming after a change are the training becoming unstable",
             "lower the LR (or undo the change that preceded it); clip gradients"),
    RuleSpec("loss_spikes", "Spikes", 2,
             "an update too large for the curvature spikes the loss",
             "lower the peak LR or lengthen warmup; clip gradients (ZClip)"),
    RuleSpec("transient_spikes", "Spikes that do not reproduce", 2,
             "a spike a replay of the same batch does not show was not the batch",
             "nothing if rare; many: look for nondeterminism or a flaky device"),
    RuleSpec("transients", "Faults that do not reproduce", 2,
             "a fault a replay does not reproduce is nondeterministic or hardware",
             "nothing if rare; many on one device: test that device"),
    RuleSpec("loss_nan", "The loss became NaN/inf", 3,
             "NaN sources: log(x<=0), sqrt(x<0), 0/0, inf-inf, inf*0, overflow",
             "run with Guard.step(closure): the replay names the op and the line"),
    RuleSpec("loss_stuck", "The loss is stuck at chance", 2,
             "a loss of ln(n) is a uniform guess over n classes: nothing is learned",
             "check the labels, the LR and that the gradients reach the weights"),
    RuleSpec("zero_grad", "The gradient norm is zero", 2,
             "a zero gradient on every step means the loss does not depend on the weights",
             "check the graph (a detach, a frozen model, an argmax in the loss)"),
    RuleSpec("converged", "The loss reached 0", 1,
             "a zero loss with a zero gradient is a fitted training set, not a bug",
             "evaluate on held-out data; stop or regularize"),
    RuleSpec("gradient_underflow", "Gradients below fp16's range", 2,
             "fp16's smallest subnormal is 6e-8: smaller gradients flush to zero",
             "use loss scaling (or bf16)"),
    RuleSpec("dead_layers", "Layers with an all-zero gradient", 2,
             "a layer whose activations are all zero gets no gradient (dead ReLUs)",
             "lower the LR, change the init, or use a leaky activation"),
    RuleSpec("attention_logits", "Attention logits grow", 2,
             "attention logits grow with q and k norms until softmax saturates and overflows",
             "QK-norm, a lower LR, or logit soft-capping"),
    RuleSpec("fp16_divergence", "The fp16 run diverged after overflows", 3,
             "fp16's range (65504) is what a run outgrows first",
             "train in bf16, or lower the LR"),
    RuleSpec("localized_faults", "A non-finite value born in the model", 2,
             "an op whose inputs were finite gave NaN/inf: that op is where to look",
             "guard that op's input (clamp, eps) or compute it in fp32"),
    RuleSpec("large_loss", "The loss is very large", 2,
             "a loss of 10^4 and more is unnormalized targets or a sum reduction",
             "normalize the targets; use reduction='mean'"),
    RuleSpec("clipped_most_steps", "The gradient-norm cap clips most steps", 1,
             "a cap below the usual norm scales every update down, as a lower LR would",
             "raise the cap, or let ZClip adapt the threshold"),
    RuleSpec("stalled_updates", "Weight updates lost to rounding", 2,
             "an update below half a 16-bit weight's spacing rounds away",
             "keep fp32 master weights (MasterWeights) or use stochastic rounding"),
    RuleSpec("slow_divergence", "A steady rise (no NaN)", 2,
             "most lost runs never NaN: the loss drifts up after a change",
             "undo the change at its start (an LR rise, new data); lower the LR"),
    RuleSpec("unreadable_events", "Lines or events could not be read", 1,
             "a line cut short by a crash is skipped: the diagnosis rests on the rest",
             "fix or remove those lines"),
    RuleSpec("rule_failed", "A rule could not read this run", 1,
             "one rule's bug must not hide the others' findings",
             "report it with the log; the other findings stand"),
)  # fmt: skip

SPECS: dict[str, RuleSpec] = {s.id: s for s in _TABLE}
