"""Rules over what does not NaN the loss: a bad buffer, updates lost to rounding, slow
divergence (issue 36)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from floatguard._event_schema import finite as _finite
from floatguard.diagnose._base import (
    _LR_JUMP,
    Finding,
    _evidence,
    _list,
    _num,
    _pair,
    _param_faults,
    _rule,
    _times,
    end_nonfinite,
    run_info,
    warnings_of,
    window_lr,
)
from floatguard.runlog import RunLog

# ------------------------------------------------ what does not NaN the loss (issue 36)


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
        "nonfinite_buffer", "the loss stays finite",
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
        "stalled_updates", "16-bit weights",
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
    detail = f"the {signal}" if not also else "the loss and the gradient norm"
    return [Finding("slow_divergence", detail, evidence, cause, fix, 2,
                    tuple(e.step for e in hits))]  # fmt: skip
