"""Each diagnosis rule on a crafted event stream: the finding, its evidence, and the
cases it must tell apart."""

from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path

import pytest

from floatguard.diagnose import OWN_IDS, RULE_IDS, Finding, diagnose
from floatguard.diagnose.specs import SPECS
from floatguard.events import EVENT_FIELDS, Event, EventLog

from .report import _runs as runs


def ev(kind: str, step: int, **fields: object) -> Event:
    base: dict[str, object] = dict.fromkeys(EVENT_FIELDS[kind], None)
    base.update(fields)
    return Event(kind, step, base)


def steps(losses: list[float], norms: list[float] | None = None, scale: float = 1.0) -> list[Event]:
    norms = norms or [1.0] * len(losses)
    return [
        ev("step", i, action="applied", loss=v, grad_norm=g, clip_coef=1.0, scale=scale,
           lr_factor=1.0)
        for i, (v, g) in enumerate(zip(losses, norms, strict=True))
    ]  # fmt: skip


def fault(step: int, **kw: object) -> Event:
    d: dict[str, object] = {"phase": "forward", "module": "m", "tensor": "output",
                            "kind_of_value": "nan", "shape": [1], "op": "aten.add.Tensor",
                            "source": "x.py:1", "deterministic": True}  # fmt: skip
    d.update(kw)
    return ev("fault", step, **d)


def rules(events: list[Event]) -> list[str]:
    return [f.rule for f in diagnose(events)]


def test_a_healthy_run_has_no_finding() -> None:
    assert diagnose(steps([2.0 - i * 0.01 for i in range(100)])) == []


def test_bad_input_and_bad_parameter_causes_told_apart() -> None:
    base = steps([1.0] * 40)
    evs = [*base, fault(10, phase="input", module="", tensor="input[0]")]
    assert rules(evs) == ["bad_input"]
    lone = [*base, fault(30, phase="param", module="fc", tensor="param:weight", op="parameter")]
    f = diagnose(lone)[0]
    assert f.rule == "bad_parameter" and "memory corruption" in f.cause
    assert f.evidence == "fc.param:weight at step(s) 30"
    on_rank = [*base, fault(30, phase="param", module="fc", tensor="param:weight",
                            op="parameter", fault_rank=1)]  # fmt: skip
    assert diagnose(on_rank)[0].evidence == "fc.param:weight at step(s) 30, on rank 1"
    after_spikes = [*lone, ev("spike", 25, signal="loss", value=9.0)]
    f = next(f for f in diagnose(after_spikes) if f.rule == "bad_parameter")
    assert "learning rate is too high" in f.cause


@pytest.mark.parametrize(
    ("op", "module", "rule"),
    [
        ("aten._softmax.default", "attn", "masked_softmax"),
        ("aten.exp.default", "head", "exp_overflow"),
        ("aten.rsqrt.default", "blocks.0.ln1", "norm_eps"),
    ],
)
def test_op_specific_rules(op: str, module: str, rule: str) -> None:
    kind = "inf" if rule == "exp_overflow" else "nan"
    found = rules([*steps([1.0] * 5), fault(3, op=op, module=module, kind_of_value=kind)])
    assert rule in found


def test_repeated_faults_in_one_module() -> None:
    evs = [*steps([1.0] * 30), fault(5, module="mlp"), fault(9, module="mlp"), fault(12)]
    f = diagnose(evs)[0]
    assert f.rule == "repeated_module" and f.steps == (5, 9) and f.severity == 3


def test_loss_scale_rare_overflows_versus_collapse() -> None:
    rare = [*steps([1.0] * 20, scale=65536.0),
            ev("overflow", 4, scale_before=65536.0, scale_after=32768.0)]  # fmt: skip
    assert rules(rare) == ["fp16_overflow"]
    collapse = [*steps([1.0] * 30, scale=65536.0)] + [
        ev("overflow", i, scale_before=2.0 ** (16 - i), scale_after=2.0 ** (15 - i))
        for i in range(16)
    ]
    f = diagnose(collapse)[0]
    assert f.rule == "scale_collapse" and "bf16" in f.fix


def test_loss_nan_divergence_versus_sudden_overflow() -> None:
    growing = steps([1.0] * 30 + [math.nan] * 5, [1.0] * 20 + [3.0 ** (i / 2) for i in range(10)]
                    + [math.nan] * 5)  # fmt: skip
    f = diagnose(growing)[0]
    assert f.rule == "loss_nan" and "divergence" in f.cause and f.steps == (30,)
    sudden = steps([1.0] * 30 + [math.nan] * 5, [1.0] * 30 + [math.nan] * 5)
    f = diagnose(sudden)[0]
    assert f.rule == "loss_nan" and "sudden overflow" in f.cause


def test_loss_stuck_at_ln_num_classes() -> None:
    f = diagnose(steps([math.log(10) + 1e-4 * (i % 3) for i in range(60)]))
    assert [x.rule for x in f] == ["loss_stuck"] and "ln(10)" in f[0].title
    assert diagnose(steps([2.0 + 0.3 * math.sin(i) for i in range(60)])) == []


def test_zero_gradients_underflow_versus_dead_units() -> None:
    fp16 = steps([1.0] * 10, [0.0] * 5 + [1.0] * 5, scale=65536.0)
    assert "underflowed" in diagnose(fp16)[0].cause
    fp32 = steps([1.0] * 10, [0.0] * 5 + [1.0] * 5)
    assert "dead ReLUs" in diagnose(fp32)[0].cause


def test_transient_faults_cluster_and_loss_spikes() -> None:
    evs = [*steps([1.0] * 20), fault(3, deterministic=False), fault(8, deterministic=False)]
    assert "transients" in rules(evs)
    spikes = [*steps([1.0] * 20), ev("spike", 7, signal="loss", value=50.0)]
    assert rules(spikes) == ["bad_batch"]  # one spike, the loss back, none after it
    burst = [*steps([1.0] * 20), *(ev("spike", s, signal="loss", value=50.0) for s in (7, 8, 9))]
    assert rules(burst) == ["loss_spikes"]


def test_findings_are_ranked_most_severe_first() -> None:
    evs = [*steps([1.0] * 40, scale=65536.0),
           ev("overflow", 2, scale_before=65536.0, scale_after=32768.0),
           fault(30, phase="param", module="fc", tensor="param:weight", op="parameter"),
           fault(10, phase="input", module="", tensor="input[0]")]  # fmt: skip
    assert rules(evs) == ["bad_parameter", "bad_input", "fp16_overflow"]
    d = diagnose(evs)[0].to_dict()
    assert d["steps"] == [30] and set(d) >= {"rule", "title", "evidence", "cause", "fix"}


def test_gradient_underflow_from_the_sampled_statistics() -> None:
    tensors = [
        {"module": "fc", "role": "param:weight.grad", "formats": {"fp16": {"underflow": 0.25}}},
        {"module": "fc", "role": "output[0]", "formats": {"fp16": {"underflow": 0.9}}},
    ]
    plain = [*steps([1.0] * 10), ev("stats", 5, tensors=tensors)]
    f = diagnose(plain)[0]
    assert f.rule == "gradient_underflow" and "25.0%" in f.evidence and f.severity == 2
    scaled = [*steps([1.0] * 10, scale=65536.0), ev("stats", 5, tensors=tensors)]
    assert diagnose(scaled)[0].severity == 1
    tensors[0]["formats"]["fp16"]["underflow"] = 0.001  # type: ignore[index]
    assert diagnose([*steps([1.0] * 10), ev("stats", 5, tensors=tensors)]) == []


def _t(module: str, role: str, numel: int = 100, zeros: int = 0, amax: float = 1.0) -> dict:  # type: ignore[type-arg]
    return {"module": module, "role": role, "numel": numel, "zeros": zeros, "amax": amax,
            "formats": {"fp16": {"underflow": 0.0}}}  # fmt: skip


def test_dead_layers_told_apart_by_the_statistics() -> None:
    dead_relu = [*steps([1.0] * 10), ev("stats", 4, tensors=[
        _t("act", "output[0]", zeros=97), _t("fc2", "param:weight.grad", zeros=100)])]  # fmt: skip
    f = next(x for x in diagnose(dead_relu) if x.rule == "dead_layers")
    assert "dead units" in f.cause and "fc2.param:weight.grad" in f.evidence
    underflow = [*steps([1.0] * 10, scale=65536.0), ev("stats", 4, tensors=[
        _t("act", "output[0]", zeros=3), _t("fc2", "param:weight.grad", zeros=100)])]  # fmt: skip
    f = next(x for x in diagnose(underflow) if x.rule == "dead_layers")
    assert "fp16 underflow" in f.cause


def test_attention_logit_growth() -> None:
    samples = [ev("stats", s, tensors=[_t("blocks.0.attn.qkv", "output[0]", amax=a)])
               for s, a in ((0, 1.0), (50, 4.0), (100, 30.0))]  # fmt: skip
    f = diagnose([*steps([1.0] * 10), *samples])
    assert [x.rule for x in f] == ["attention_logits"] and "30x" in f[0].evidence
    flat = [ev("stats", s, tensors=[_t("blocks.0.attn.qkv", "output[0]", amax=2.0)])
            for s in (0, 50, 100)]  # fmt: skip
    assert diagnose([*steps([1.0] * 10), *flat]) == []


def test_fp16_divergence_after_overflows() -> None:
    evs = [*steps([1.0] * 40 + [math.nan] * 3, scale=1024.0)] + [
        ev("overflow", s, scale_before=2048.0, scale_after=1024.0) for s in (32, 35, 38)
    ]
    assert "fp16_divergence" in [f.rule for f in diagnose(evs)]
    fp32 = steps([1.0] * 40 + [math.nan] * 3)
    assert "fp16_divergence" not in [f.rule for f in diagnose(fp32)]


def test_a_run_whose_loss_is_large_is_diagnosed() -> None:
    events = [
        Event("step", i, {"action": "applied", "reason": None, "loss": 1300.0 + (i % 3),
                          "grad_norm": 1.0, "clip_coef": 1.0, "scale": 1.0, "lr_factor": 1.0})
        for i in range(60)
    ]  # fmt: skip
    assert all(f.rule != "loss_stuck" for f in diagnose(events))


# ------------------------------------------------ logs off the beaten path (issue 22)
def run_ev(precision: str, dtypes: list[str], scaling: bool = False) -> Event:
    return ev("run", 0, precision=precision, loss_scaling=scaling, param_dtypes=dtypes,
              optimizer="AdamW", world_size=1)  # fmt: skip


def test_a_schema_1_fault_without_op_or_cause_is_diagnosed() -> None:
    old = Event("fault", 3, {"phase": "forward", "module": "ln_f", "kind_of_value": "nan"})
    found = diagnose([*steps([1.0] * 5), old])
    assert all(f.rule != "rule_failed" for f in found)
    bare = Event("fault", 4, {"phase": "param"})  # module, tensor, op: all unknown
    assert all(f.rule != "rule_failed" for f in diagnose([bare, Event("overflow", 5, {})]))


def test_mistyped_events_are_left_out_and_named() -> None:
    bad = Event("step", 7, {"action": "applied", "loss": "high", "grad_norm": 1.0})
    found = diagnose([*steps([1.0] * 40), bad])
    assert [f.rule for f in found] == ["unreadable_events"]
    assert "'loss' must be num, got 'high'" in found[0].evidence


def _underflow_stats() -> list[Event]:
    tensors = [{"module": "fc", "role": "param:weight.grad", "numel": 10,
                "formats": {"fp16": {"underflow": 0.25}}}]  # fmt: skip
    return [*steps([1.0] * 10), ev("stats", 5, tensors=tensors)]


@pytest.mark.parametrize(
    ("precision", "dtypes", "scaling", "severity", "words"),
    [
        ("bf16", ["float32"], False, 1, "if this run moved to fp16"),
        ("fp32", ["float32"], False, 1, "if this run moved to fp16"),
        ("fp16", ["float32"], True, 1, "even unscaled"),
        ("fp16", ["float32"], False, 2, "no loss scaling"),
        ("fp32", ["float16"], False, 2, "no loss scaling"),  # model.half(), no scaler
    ],
)
def test_gradient_underflow_knows_the_runs_precision(
    precision: str, dtypes: list[str], scaling: bool, severity: int, words: str
) -> None:
    f = next(x for x in diagnose([run_ev(precision, dtypes, scaling), *_underflow_stats()])
             if x.rule == "gradient_underflow")  # fmt: skip
    assert f.severity == severity and words in f.title
    if precision == "bf16":
        assert "use bf16" not in f.fix


def test_a_log_without_precision_says_it_cannot_tell() -> None:
    f = next(x for x in diagnose(_underflow_stats()) if x.rule == "gradient_underflow")
    assert "does not say the run's precision" in f.evidence


def test_a_normalization_fed_an_absurd_input_is_not_blamed_on_eps() -> None:
    norm = {"op": "aten.native_layer_norm.default", "module": "ln_f"}
    flipped = fault(9, **norm, input_amax=3.4e30)  # a flipped exponent bit upstream
    found = {f.rule: f for f in diagnose([run_ev("bf16", ["float32"]), *steps([1.0] * 12),
                                          flipped])}  # fmt: skip
    assert "norm_eps" not in found and "norm_input_out_of_range" in found
    assert "3.4e+30" in found["norm_input_out_of_range"].evidence
    flat = fault(9, **norm, input_amax=0.5)
    f = next(x for x in diagnose([*steps([1.0] * 12), flat]) if x.rule == "norm_eps")
    assert "the variance, not the input" in f.evidence
    unknown = fault(9, **norm)
    f = next(x for x in diagnose([*steps([1.0] * 12), unknown]) if x.rule == "norm_eps")
    assert "cannot be ruled out" in f.evidence


def test_optimizer_faults_with_16_bit_weights_are_not_called_memory_corruption() -> None:
    update = fault(12, phase="param", module="fc", tensor="param:weight", op="optimizer.step",
                   cause="optimizer_update")  # fmt: skip
    moment = fault(12, phase="param", module="fc", tensor="optimizer:weight.exp_avg_sq",
                   op="parameter", cause="nonfinite_optimizer_state")  # fmt: skip
    for f_ev, rule in ((update, "optimizer_update"), (moment, "bad_optimizer_state")):
        half = next(x for x in diagnose([run_ev("fp32", ["float16"]), *steps([1.0] * 15), f_ev])
                    if x.rule == rule)  # fmt: skip
        assert "ECC" not in half.cause + half.fix and "float16" in half.cause
        full = next(x for x in diagnose([run_ev("fp32", ["float32"]), *steps([1.0] * 15), f_ev])
                    if x.rule == rule)  # fmt: skip
        assert "float16" not in full.cause


def test_repeated_bad_input_is_told_from_bad_luck() -> None:
    def bad(s: int) -> Event:
        return fault(s, phase="input", module="", tensor="input[0]", op="input")

    periodic = [*steps([1.0] * 40), *(bad(s) for s in (5, 15, 25, 35))]
    f = next(x for x in diagnose(periodic) if x.rule == "repeated_bad_input")
    assert "every 10 steps" in f.evidence and f.severity == 3
    assert "repeated_bad_input" not in [x.rule for x in diagnose([*steps([1.0] * 40), bad(5)])]


def test_spikes_told_apart_by_their_replay() -> None:
    def spike(s: int, again: bool | None) -> Event:
        return ev("spike", s, signal="loss", value=9.0, reproduced=again)

    gone = diagnose([*steps([1.0] * 30), spike(10, False), spike(20, False)])
    assert [f.rule for f in gone] == ["transient_spikes"]
    again = diagnose([*steps([1.0] * 30), spike(10, True)])
    assert [f.rule for f in again] == ["bad_batch"]
    assert "the replay with the same batch and weights spiked again" in again[0].cause
    twice = diagnose([*steps([1.0] * 30), spike(10, True), spike(11, True)])
    assert [f.rule for f in twice] == ["loss_spikes"]
    assert "spikes on 2 batches in a row" in twice[0].cause


def test_a_huge_loss_window_is_diagnosed_without_overflow() -> None:
    huge = steps([1e308] * 25 + [1.7e308] * 25)
    assert all(f.rule != "rule_failed" for f in diagnose(huge))


def test_a_cap_that_clips_most_steps_is_named_with_its_value() -> None:
    run = ev("run", 0, precision="fp32", loss_scaling=False, param_dtypes=["float32"],
             optimizer="AdamW", world_size=1,
             clip={"kind": "zclip", "max_norm": 1.0, "z_thresh": 2.5})  # fmt: skip
    norms = [3.0] * 36 + [30.0] * 4  # healthy norms above the cap; 4 z-score outliers
    coefs = [1.0 / (3.0 + 1e-6)] * 36 + [0.2] * 4  # capped to 1.0; outliers to 6.0
    evs = [run, *(ev("step", i, action="applied", loss=1.0, grad_norm=n, clip_coef=c,
                     scale=1.0, lr_factor=1.0)
                  for i, (n, c) in enumerate(zip(norms, coefs, strict=True)))]  # fmt: skip
    f = next(x for x in diagnose(evs) if x.rule == "clipped_most_steps")
    assert "36 of 40 applied steps clipped to the cap 1" in f.evidence
    assert "4 more by ZClip's z-score" in f.evidence and "max_grad_norm=None" in f.fix
    few = [run, *evs[1:21], *(ev("step", i, action="applied", loss=1.0, grad_norm=0.5,
                                  clip_coef=1.0, scale=1.0, lr_factor=1.0)
                               for i in range(21, 60))]  # fmt: skip
    assert "clipped_most_steps" not in [x.rule for x in diagnose(few)]


# --------------------------------------------- from the new-user trial of issue 22
def test_a_long_healthy_fp16_run_with_spread_out_overflows_has_not_collapsed() -> None:
    evs = [*steps([1.0] * 20_000, scale=65536.0)] + [
        ev("overflow", s, scale_before=65536.0, scale_after=32768.0) for s in range(0, 20_000, 500)
    ]  # fmt: skip
    assert "scale_collapse" not in rules(evs) and "fp16_overflow" in rules(evs)


def test_the_stop_a_localized_fault_and_a_huge_loss_each_have_a_finding() -> None:
    stop = ev("stop", 9, reason="repeated_fault", fault="nan born in fc")
    f = diagnose([*steps([1.0] * 10), stop])[0]
    assert f.rule == "stopped" and "repeated_fault" in f.evidence and f.severity == 3
    log0 = fault(5, phase="loss", module="", op="aten.log.default", source="train.py:9")
    f = next(x for x in diagnose([*steps([1.0] * 10), log0]) if x.rule == "localized_faults")
    assert "aten.log.default" in f.evidence and "train.py:9" in f.evidence
    f = next(x for x in diagnose(steps([8e10] * 10)) if x.rule == "large_loss")
    assert "8e+10" in f.evidence and "normalize the targets" in f.fix


def test_a_run_that_survived_a_nan_then_died_is_dated_from_its_death() -> None:
    losses = [1.0] * 10 + [math.nan] + [1.0] * 7 + [math.nan] * 30
    f = next(x for x in diagnose(steps(losses)) if x.rule == "loss_nan")
    assert f.steps == (18,) and "isolated non-finite steps 10" in f.evidence


def test_a_merged_multi_rank_log_is_diagnosed_once_per_step() -> None:
    def rank_events(r: int) -> list[Event]:
        out = [Event("step", i, {"action": "applied", "loss": 1.0, "grad_norm": 1.0}, rank=r)
               for i in range(30)]  # fmt: skip
        bad = {"phase": "forward", "module": "blocks.0.attn", "tensor": "output",
               "kind_of_value": "nan", "op": "aten.add.Tensor", "fault_rank": 1}  # fmt: skip
        return [*out, Event("fault", 27, bad, rank=r)]

    merged = [e for r in range(4) for e in rank_events(r)]
    found = rules(merged)
    assert "repeated_module" not in found and found.count("localized_faults") == 1


# ------------------------------------------------------- what does not NaN (issue 36)
def found(events: list[Event]) -> dict[str, Finding]:
    return {f.rule: f for f in diagnose(events)}


def test_a_loss_of_exactly_zero_with_a_zero_gradient_is_convergence() -> None:
    f = found(runs.memorized())
    assert list(f) == ["converged"] and f["converged"].severity == 1
    assert f["converged"].evidence == (
        "20 applied step(s) with a loss of 0 and a gradient norm of exactly 0 (first at step 40)"
    )
    assert "dead" not in f["converged"].title and "convergence, not a dead model" in f[
        "converged"].cause  # fmt: skip
    # a sampled step at a zero loss has an all-zero gradient everywhere: not dead layers
    zero_grads = ev("stats", 45, tensors=[_t("fc", "param:weight.grad", zeros=100)])
    assert "dead_layers" not in rules([*runs.memorized(), zero_grads])
    # a zero gradient with a loss that is not 0 is still no gradient flowing
    stuck = [e for e in runs.memorized() if e.kind != "step"] + steps([0.7] * 10, [0.0] * 10)
    f = found(stuck)
    assert list(f) == ["zero_grad"] and "dead ReLUs" in f["zero_grad"].cause


@pytest.mark.parametrize(
    ("op", "rule", "says", "never"),
    [
        ("optimizer.step", "optimizer_update", ["lower the LR"], ["resize", "callback"]),
        ("update_or_outside", "update_or_outside",
         ["lower the LR", "resize_token_embeddings", "callback", "checkpoint"], []),
        ("outside", "bad_parameter", ["resize_token_embeddings", "do not lower the LR",
                                      "a flipped bit"], ["(or lengthen warmup)"]),
    ],
    ids=["verified-update", "update-or-outside", "verified-outside"],
)  # fmt: skip
def test_a_bad_weights_cause_is_stated_never_guessed(
    op: str, rule: str, says: list[str], never: list[str]
) -> None:
    f = found(runs.weight_fault(op))
    assert list(f) == [rule]
    text = f[rule].cause + " " + f[rule].fix
    assert all(w in text for w in says), text
    assert not any(w in text for w in never), text
    if op == "update_or_outside":
        assert f[rule].evidence == (
            "emb.param:weight: non-finite since the last check at step 40 (found at step(s) "
            "45); the guard did not see whether the optimizer update or a write outside it "
            "made it"
        )


def test_an_older_logs_unverified_optimizer_update_gets_both_advices() -> None:
    old = fault(12, phase="param", module="fc", tensor="param:weight", op=None,
                cause="optimizer_update")  # fmt: skip
    assert rules([*steps([1.0] * 15), old]) == ["update_or_outside"]


def test_a_nan_buffer_is_named_and_what_became_of_it_said() -> None:
    rolled = found(runs.nan_buffer(rolled_back=True))
    assert list(rolled) == ["nonfinite_buffer"]  # not a bad weight, nor memory corruption
    assert rolled["nonfinite_buffer"].evidence == (
        "bn.running_var at step(s) 7; the guard rolled back to a snapshot whose buffers were "
        "vetted finite"
    )
    kept = found(runs.nan_buffer(rolled_back=False))["nonfinite_buffer"]
    assert kept.evidence == (
        "bn.running_var at step(s) 20; the run ended with them non-finite: every eval() "
        "forward through them is NaN"
    )
    assert "model.eval()" in kept.fix and "reset_running_stats()" in kept.fix
    assert kept.severity == 3


def test_stalled_16_bit_weights_name_the_layers_and_the_fix() -> None:
    f = found(runs.stalled())
    assert list(f) == ["stalled_updates"]
    assert f["stalled_updates"].evidence == (
        "78% of the measured weight elements did not move over steps 10-150 (5 samples, lr "
        "0.0001) although their update was not 0; by layer, worst first: fc1.weight "
        "(bfloat16, 81% of 4096), fc2.weight (bfloat16, 74% of 1024)"
    )
    fix = f["stalled_updates"].fix
    assert "floatguard.MasterWeights" in fix and "stochastic rounding" in fix
    assert "Kahan" in fix and "only if that step size is what you intend" in fix


@pytest.mark.parametrize(
    ("events", "what", "cause", "fix"),
    [
        (runs.lr_creep(), "the LR rose 2.6x from the best window to the rise's start "
         "(0.00418 to 0.0109)", "the learning rate grew", "fix the schedule"),
        (runs.lr_creep(changed=False), "the LR rose 11x from the best window to the rise's "
         "median (0.00414 to 0.045)", "the learning rate grew", "fix the schedule"),
        (runs.label_noise(), "the LR did not rise (0.001 to 0.001)",
         "the loss rose with the LR unchanged: the data changed", "evaluate on a clean held-out"),
    ],
    ids=["lr-creep", "lr-creep-from-the-steps", "label-noise"],
)  # fmt: skip
def test_slow_divergence_says_what_changed_at_its_start(
    events: list[Event], what: str, cause: str, fix: str
) -> None:
    f = found(events)
    assert list(f) == ["slow_divergence"]  # the flat windows are not "stuck at ln(n)"
    d = f["slow_divergence"]
    assert d.evidence == (
        "the loss rose from 0.72 (steps 50-99, its best window); 3.4x its best level; "
        "+0.0069 a step from step 100; median per window: 0.99, 1.36, 1.71, 2.41; warned at "
        f"step 299; what changed: {what}"
    )
    assert cause in d.cause and fix in d.fix
    assert d.fix.endswith("the guard only warns about a trend: it changed nothing for it")


def test_a_trend_in_the_issues_evidence_shape_is_read_too() -> None:
    evidence = {"signal": "loss", "best_window": [50, 99], "best_mean": 0.72,
                "windows": [[100, 0.99], [150, 1.36]], "ratio": 1.9, "rise_step": 100,
                "changed": {"lr": [1e-3, 4e-2], "scale": [65536.0, 65536.0]}}  # fmt: skip
    warning = ev("warning", 200, message="loss rising", code="loss_trend", evidence=evidence)
    d = found([*steps([1.0] * 200), warning])["slow_divergence"]
    assert d.evidence == (
        "the loss rose from 0.72 (steps 50-99, its best window); 1.9x its best level; from "
        "step 100; median per window: 0.99, 1.36; warned at step 200; what changed: the LR "
        "rose 40x from the best window to the rise's start (0.001 to 0.04)"
    )


def test_a_bad_batch_is_not_an_instability() -> None:
    batch = found(runs.corrupt_batch())
    lr = found(runs.lr_x40())
    assert list(batch) == ["bad_batch"] and list(lr) == ["sustained_instability"]
    b, s = batch["bad_batch"], lr["sustained_instability"]
    assert b.evidence == (
        "step 50: loss 11 (5.5x its level), batch position 50, fingerprint 0123456789abcdef; "
        "after it, no spike in the next 20 steps and the loss back within 25% of its level "
        "before it"
    )
    assert b.cause.startswith("one batch, not the training")
    assert "fingerprint" in b.fix and "the LR and the model need no change" in b.fix
    assert s.title == "Sustained instability: from step 61"
    assert s.evidence == (
        "5 spikes from step 61 on (steps 61, 62, 78, 79, 90), on 5 different batches; 13 steps "
        "not applied (loss spikes: 5, after rollback: 8); 1 rollback(s); LR back-offs down to "
        "a factor 0.25, 0.34 at the end; the LR rose 40x at step 60 (0.001 to 0.04) and "
        "stayed there; the loss ended 4.1x its level before step 61; batches: position 61, "
        "fingerprint 000000000000003d; position 62, fingerprint 000000000000003e; position "
        "78, fingerprint 000000000000004e"
    )
    assert s.cause.startswith("a change, not a batch: the LR rose 40x at step 60")
    assert s.fix.startswith("undo or shrink the LR change at step 60")
    assert "only postpone it (its LR factor is 0.34)" in s.fix and s.severity == 3
    assert b.cause != s.cause and b.fix != s.fix


def test_a_burst_after_one_large_update_is_neither() -> None:
    f = found(runs.burst())
    assert list(f) == ["loss_spikes"]
    assert f["loss_spikes"].cause.startswith("spikes on 4 batches in a row, then none: the "
                                             "weights, not one batch")  # fmt: skip
    assert "(the LR rose 300x at step 120 (0.001 to 0.3) for that step only)" in f[
        "loss_spikes"].cause  # fmt: skip


def test_the_same_bad_batch_every_epoch_is_said() -> None:
    evs = [*steps([1.0] * 200)] + [
        ev("spike", s, signal="loss", value=9.0, reproduced=True,
           batch={"position": s, "micro_batches": 1, "fingerprint": "aa" * 8, "shapes": []})
        for s in (40, 140)
    ]  # fmt: skip
    f = found(evs)["bad_batch"]
    assert f.title == "Bad batches: 2, spikes that did not recur" and f.severity == 2
    assert "the same batch (fingerprint aaaaaaaaaaaaaaaa) spiked at steps 40, 140" in f.evidence


def test_the_rule_table_in_the_docs_is_the_registry() -> None:
    """docs/report.md's rule table names exactly the finding ids the rules declare (issue
    40), and every finding a situation above yields is a declared id."""
    text = (Path(__file__).parents[1] / "docs" / "report.md").read_text(encoding="utf-8")
    table = text.split("## The rules and the evidence each needs", 1)[1].split("\n## ", 1)[0]
    documented = {
        name for line in table.splitlines() if line.startswith("| `")
        for name in re.findall(r"`([a-z0-9_]+)`", line.split("|")[1])
    }  # fmt: skip
    declared = {i for ids in RULE_IDS.values() for i in ids} | set(OWN_IDS)
    assert documented == declared, (sorted(declared - documented), sorted(documented - declared))
    situations = [runs.clean(), runs.corrupt_batch(), runs.lr_x40(), runs.burst(),
                  runs.lr_creep(), runs.label_noise(), runs.stalled(), runs.memorized(),
                  runs.nan_buffer(True), runs.nan_buffer(False),
                  *(runs.weight_fault(op) for op in ("optimizer.step", "update_or_outside",
                                                     "outside"))]  # fmt: skip
    assert {r for s in situations for r in rules(s)} <= declared


def test_a_spike_too_near_the_end_is_not_called_a_bad_batch() -> None:
    late = [*steps([1.0] * 30), ev("spike", 28, signal="loss", value=9.0, reproduced=True)]
    f = found(late)
    assert list(f) == ["loss_spikes"]
    assert f["loss_spikes"].evidence.endswith(
        "; the run ended 1 applied step(s) after the last: too soon to tell a bad batch from "
        "the start of an instability"
    )


def _severities(node: ast.expr) -> list[object]:
    """The values a severity expression can take (a constant, or a conditional of them)."""
    if isinstance(node, ast.IfExp):
        return _severities(node.body) + _severities(node.orelse)
    return [node.value] if isinstance(node, ast.Constant) else [None]


def test_every_finding_id_has_a_spec_and_no_finding_outranks_it() -> None:
    """One id names the rule's finding, its docs row (above) and its spec: every
    declared id has a spec with a lesson and a fix, and every Finding a rule builds
    with that id has at most the spec's severity."""
    declared = {i for ids in RULE_IDS.values() for i in ids} | set(OWN_IDS)
    assert set(SPECS) == declared
    assert all(s.lesson and s.fix and s.title and s.severity in (1, 2, 3) for s in SPECS.values())
    seen = set()
    for path in (Path(__file__).parents[1] / "src" / "floatguard" / "diagnose").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Finding"):
                continue
            kw = {k.arg: k.value for k in node.keywords}
            rid = node.args[0] if node.args else kw["rule"]
            sev = node.args[5] if len(node.args) > 5 else kw["severity"]
            if isinstance(rid, ast.Constant):
                seen.add(rid.value)
                for value in _severities(sev):
                    assert value is None or value <= SPECS[rid.value].severity, rid.value
    assert seen <= declared and len(seen) >= 25  # the scan found the findings


def test_a_findings_title_is_its_specs() -> None:
    """The title comes from the spec (one place), with the finding's detail after it."""
    plain = Finding("scale_collapse", "", "e", "c", "f", 3)
    assert plain.title == SPECS["scale_collapse"].title == plain.to_dict()["title"]
    told = Finding("repeated_module", "in fc2", "e", "c", "f", 3, (4, 5))
    assert told.title == f"{SPECS['repeated_module'].title}: in fc2"
    assert told.to_dict() == {
        "rule": "repeated_module", "detail": "in fc2", "title": told.title, "evidence": "e",
        "cause": "c", "fix": "f", "severity": 3, "steps": [4, 5],
    }  # fmt: skip
    with pytest.raises(KeyError):
        _ = Finding("no_such_rule", "", "e", "c", "f", 1).title


def test_list_rules_prints_every_rule_with_its_lesson_and_fix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import floatguard.cli as cli

    with pytest.raises(SystemExit):
        cli.main(["diagnose", "--list-rules", "--json"])
    listed = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in listed] == list(SPECS)
    assert all(r["lesson"] and r["fix"] for r in listed)
    with pytest.raises(SystemExit):
        cli.main(["diagnose", "--list-rules"])
    text = capsys.readouterr().out
    for spec in SPECS.values():
        assert f"{spec.id} (severity {spec.severity})" in text and spec.lesson in text


def test_rule_filters_the_findings_and_an_unknown_id_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import floatguard.cli as cli

    log = EventLog(tmp_path / "run.jsonl")
    for i in range(30):
        log.emit("step", i, action="applied", reason=None, loss=1e5, grad_norm=0.0,
                 clip_coef=1.0, scale=None, lr_factor=1.0, lr=None)  # fmt: skip
    log.close()
    with pytest.raises(SystemExit):
        cli.main(["diagnose", str(tmp_path / "run.jsonl"), "--json"])
    every = {f["rule"] for f in json.loads(capsys.readouterr().out)}
    assert {"large_loss", "zero_grad"} <= every
    with pytest.raises(SystemExit):
        cli.main(["diagnose", str(tmp_path / "run.jsonl"), "--json", "--rule", "large_loss"])
    assert {f["rule"] for f in json.loads(capsys.readouterr().out)} == {"large_loss"}
    with pytest.raises(SystemExit) as info:
        cli.main(["diagnose", str(tmp_path / "run.jsonl"), "--rule", "nope"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert (
        info.value.code == 2 and len(err) == 1 and "'nope'" in err[0] and "--list-rules" in err[0]
    )
