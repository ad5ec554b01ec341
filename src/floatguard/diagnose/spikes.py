"""Rules over spikes: episodes told apart (an isolated bad batch, a burst, a sustained
change; :mod:`floatguard.stability.episodes`), transients."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from floatguard.diagnose._base import (
    LEVEL_BAND,
    Finding,
    Level,
    LrChange,
    _fingerprint,
    _list,
    _num,
    _rule,
    _times,
    applied_losses,
    batch_words,
    end_lr_factor,
    loss_level,
    lr_change,
    schedule_lrs,
    warnings_of,
)
from floatguard.events import Event
from floatguard.runlog import RunLog
from floatguard.stability.episodes import GAP as EPISODE_GAP
from floatguard.stability.episodes import SETTLE, classify_spikes

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
        "one, a spike that did not recur"
        if len(episodes) == 1
        else f"{len(episodes)}, spikes that did not recur",
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
        "sustained_instability", f"from step {first}", evidence, cause,
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
        f"in the {' and '.join(signals)}",
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
            "transient_spikes", "",
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
        "transients", "",
        f"{len(hits)} non-finite steps were clean when replayed (steps {_list(steps)})",
        "nondeterminism outside the model's math: failing hardware (GPU memory, a bad "
        "link), a race (asynchronous copies, a stream misuse) or a nondeterministic kernel",
        "run the same steps on another device; enable CUDA_LAUNCH_BLOCKING=1 and "
        "torch.use_deterministic_algorithms(True) to rule out races",
        2, steps,
    )]  # fmt: skip
