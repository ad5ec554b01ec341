"""Render the report page and its plots from an event stream."""

from __future__ import annotations

import dataclasses
import math
import os
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from floatguard._event_schema import finite as _finite
from floatguard._safe_io import replacing
from floatguard.diagnose import Finding, RunInfo, clipped_steps, diagnose, run_info
from floatguard.events import Event, conform_events
from floatguard.report._html import escape as _e
from floatguard.report._html import img_tag as _img
from floatguard.report._html import save_figure as _save
from floatguard.report.advice import advice_section
from floatguard.report.verdict import Verdict, verdict_of
from floatguard.runlog import RunLog, global_view, reduce_stats, tensor_fields

__all__ = ["Verdict", "global_view", "reduce_stats", "render_report", "verdict_of"]


def _rank_table(log: RunLog) -> str:
    ranks = log.ranks
    if len(ranks) <= 1:
        return ""
    faults = log.of_kind("fault")
    born = {(e.step, e.rank if e["fault_rank"] is None else e["fault_rank"]) for e in faults}
    last_step: dict[int, int] = {}  # rank -> index of its last step
    for j, r in enumerate(log.steps.rank):
        last_step[r] = j
    steps_of = Counter(log.steps.rank)
    rows = []
    for r in ranks:
        stop = next((e for e in reversed(log.of_kind("stop")) if e.rank == r), None)
        last = log.steps[last_step[r]]["loss"] if r in last_step else None
        rows.append(
            f"<tr><td>rank {r}</td><td>{log.rank_counts[r]}</td><td>{steps_of[r]}</td>"
            f"<td>{sum(1 for e in faults if e.rank == r)}</td>"
            f"<td>{sum(1 for _, fr in born if fr == r)}</td>"
            f"<td>{_e(last) if r in last_step else '-'}</td>"
            f"<td>{_e(stop['reason']) if stop else '-'}</td></tr>"
        )
    per_rank = _rank_stats_table(log, ranks)
    return (
        f"<h2>Ranks ({len(ranks)})</h2><p class='muted'>Decisions are taken together: the "
        f"timeline and faults are rank {ranks[0]}'s view, statistics are reduced over all "
        "ranks.</p><table><tr><th>rank</th><th>events</th><th>steps</th><th>faults logged"
        "</th><th>faults born here</th><th>last loss</th><th>stop</th></tr>"
        + "".join(rows)
        + "</table>"
        + per_rank
    )


def _rank_stats_table(log: RunLog, ranks: list[int]) -> str:
    """Per-rank view of the sampled statistics: the largest amax of each module's output
    on each rank over the run, and the non-finite values each rank saw."""
    amax: dict[str, dict[int, float]] = {}
    bad: dict[int, int] = dict.fromkeys(ranks, 0)
    for e in log.of_kind("stats"):
        for t in e["tensors"] or []:
            n = t.get("nonfinite")
            bad[e.rank] = bad.get(e.rank, 0) + (n if type(n) is int else 0)
            if t.get("role") == "output[0]" and _finite(t.get("amax")):
                row = amax.setdefault(t["module"] or "<root>", {})
                row[e.rank] = max(row.get(e.rank, 0.0), float(t["amax"]))
    if not amax:
        return ""
    head = "".join(f"<th>rank {r}</th>" for r in ranks)
    body = "".join(
        f"<tr><td><code>{_e(m)}</code></td>"
        + "".join(f"<td>{row[r]:.4g}</td>" if r in row else "<td>-</td>" for r in ranks)
        + "</tr>"
        for m, row in sorted(amax.items())
    )
    bad_row = "".join(f"<td>{bad.get(r, 0)}</td>" for r in ranks)
    return (
        "<h3>Statistics per rank</h3><p class='muted'>largest amax of each module's output "
        "over the sampled steps (the Layers plots reduce over ranks)</p>"
        f"<table><tr><th>module</th>{head}</tr>{body}"
        f"<tr><td>non-finite values seen</td>{bad_row}</tr></table>"
    )


Plots = tuple[dict[str, Path], dict[str, str]]  # the images, and a sentence for each left out


def _scale_of(values: list[float]) -> str | None:
    """The y scale values can be drawn on: "log" when every finite one is > 0 and they
    span a decade or more, "linear" otherwise (a loss may be negative or zero; a narrow
    range on a log axis gets only minor ticks, whose labels overlap), None when none is
    finite."""
    finite = [v for v in values if _finite(v)]
    if not finite:
        return None
    low, high = min(finite), max(finite)
    return "log" if low > 0 and high >= 10 * low else "linear"


def _plottable(v: object) -> float:
    # matplotlib draws floats; a huge int (a log's) or a non-finite value is a gap
    return float(v) if _finite(v) and abs(float(v)) < 1e300 else math.nan  # type: ignore[arg-type]


_MAX_POINTS = 20_000  # per curve: a longer run is drawn every k-th step (counts stay exact)


def _step_tick(v: float, _pos: object = None) -> str:
    """A step number on an axis: 950, 12,500, 120k, 1.2M (never an offset or 1e6)."""
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.3g}M"
    if a >= 1e5:
        return f"{v / 1e3:.3g}k"
    return f"{v:,.0f}"


def _value_tick(v: float, _pos: object = None) -> str:
    """A value on a log axis: 0.001, 2, 5e+04 (shortest exact form, no mathtext)."""
    return f"{v:.3g}"


def _readable(ax: Any, scale: str, values: Sequence[float] = ()) -> None:
    """Tick labels a reader can read at any step count and magnitude: at most ~8 integer
    step ticks with thousands separators; on a log y axis one label per decade (every
    other decade past 8), minor ticks at 2 and 5 labelled only when ``values`` span
    under two decades (else unlabelled); on a linear one plain numbers, no
    offset ("+1" over the axis) and a power-of-ten multiplier only past 1e5 or below 1e-4."""
    from matplotlib import ticker

    ax.xaxis.set_major_locator(ticker.MaxNLocator(nbins=8, integer=True))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(_step_tick))
    if scale == "log":
        ax.yaxis.set_major_locator(ticker.LogLocator(base=10, numticks=7))
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(_value_tick))
        ax.yaxis.set_minor_locator(ticker.LogLocator(base=10, subs=(2.0, 5.0), numticks=12))
        finite = [v for v in values if _finite(v) and v > 0]
        narrow = bool(finite) and max(finite) < 100 * min(finite)
        ax.yaxis.set_minor_formatter(
            ticker.FuncFormatter(_value_tick) if narrow else ticker.NullFormatter()
        )
    else:
        ax.yaxis.set_major_locator(ticker.MaxNLocator(nbins=6))
        fmt = ticker.ScalarFormatter(useOffset=False)
        fmt.set_powerlimits((-4, 5))
        ax.yaxis.set_major_formatter(fmt)
    ax.tick_params(which="both", labelsize=8)


def _norm_label(info: RunInfo) -> str:
    """What the steps' gradient norm is (the run event's clip.norm_measured)."""
    return {
        "before_clip": "gradient norm (before clipping)",
        "after_clip": "gradient norm (after the Trainer's clipping)",
    }.get(info.norm_measured or "", "gradient norm")


def _lr_panel(ax: Any, xs: list[float], lr: list[float], factor: list[float]) -> None:
    """The LR each update used (``step.lr``: the schedule's times the guard's factor) and,
    on a second axis, the guard's LR factor when it ever left 1."""
    scale = _scale_of(lr)
    if scale is not None:
        ax.plot(xs, lr, lw=1, color="#9467bd", label="learning rate (as applied)")
        ax.set_yscale(scale)
        ax.set_ylabel(f"learning rate ({scale} scale)")
        _readable(ax, scale, lr)
    if any(_finite(f) and f != 1.0 for f in factor):
        other = ax.twinx() if scale is not None else ax
        other.step(xs, factor, where="post", lw=1, ls="--", color="#e377c2",
                   label="the guard's LR factor")  # fmt: skip
        other.set_ylim(0.0, 1.05)
        other.set_ylabel("LR factor")
        if other is not ax:
            other.legend(loc="lower right", fontsize=8)
        else:
            _readable(ax, "linear")


def _plots(log: RunLog, out: Path) -> Plots:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = log.steps
    paths: dict[str, Path] = {}
    notes: dict[str, str] = {}
    if not len(steps):
        notes["timeline"] = "No step events: nothing to plot."
        return paths, notes
    stride = max(1, -(-len(steps) // _MAX_POINTS))
    xs = [float(s) for s in steps.step[::stride]]
    loss = [_plottable(v) for v in steps.column("loss")[::stride]]
    norm_all = steps.column("grad_norm")
    norm = [_plottable(v) for v in norm_all[::stride]]
    lr = [_plottable(v) for v in steps.column("lr")[::stride]]
    factor = [_plottable(v) for v in steps.column("lr_factor")[::stride]]
    actions = steps.column("action")
    info = run_info(log)
    if stride > 1:
        notes["drawn"] = f"{len(steps)} steps, drawn every {stride}th (the counts are exact)."
    panels = [(name, values, scale) for name, values in (("loss", loss), ("gradient norm", norm))
              if (scale := _scale_of(values)) is not None]  # fmt: skip
    missing = [name for name in ("loss", "gradient norm") if name not in {p[0] for p in panels}]
    if missing:
        notes["timeline"] = (
            f"No finite {' or '.join(missing)} in {len(xs)} step(s)"
            + (" drawn" if stride > 1 else "") + ": "
            + ("every value was non-finite or missing, so there is no curve to draw."
               if len(missing) == 2 else "that curve is left out.")
        )  # fmt: skip
    # the LR panel: from step.lr (absent in older logs) or a factor that left 1
    with_lr = panels and (_scale_of(lr) is not None or any(_finite(f) and f != 1.0 for f in factor))
    if panels:
        rows = len(panels) + (1 if with_lr else 0)
        fig, axes = plt.subplots(rows, 1, figsize=(10, 2.8 * rows), sharex=True, squeeze=False)
        axs = {name: ax for (name, _, _), ax in zip(panels, axes[:, 0], strict=False)}
        for (name, values, scale), ax in zip(panels, axes[:, 0], strict=False):
            label = "loss" if name == "loss" else _norm_label(info)
            ax.plot(xs, values, lw=1, color="#1f77b4" if name == "loss" else "#2ca02c",
                    label=label)  # fmt: skip
            ax.set_yscale(scale)
            ax.set_ylabel(f"{name} ({scale} scale)")
            _readable(ax, scale, values)
        if with_lr:
            _lr_panel(axes[-1, 0], xs, lr, factor)
        top_ax = axes[0, 0]
        first_values = panels[0][1]
        finite_top = [v for v in first_values if not math.isnan(v)]
        top = max(finite_top) if finite_top else 1.0
        for action, (marker, color) in {"skipped": ("x", "#ff7f0e"),
                                        "rolled_back": ("v", "#d62728")}.items():  # fmt: skip
            pts = [float(st) for st, a in zip(steps.step, actions, strict=True) if a == action]
            if pts:
                label = f"{action.replace('_', ' ')} ({len(pts)})"
                top_ax.scatter(pts, [top] * len(pts), marker=marker, color=color, label=label,
                               zorder=3)  # fmt: skip
        fault_xs = sorted({float(f.step) for f in log.of_kind("fault")})
        if fault_xs:
            top_ax.vlines(fault_xs, 0, 1, transform=top_ax.get_xaxis_transform(),
                          color="#d62728", alpha=0.25, lw=1)  # fmt: skip
        if "gradient norm" in axs:
            by_cap, by_z = clipped_steps(steps, info)
            cap = info.clip_cap
            for group, label, color in (
                (by_z, "clipped by ZClip's z-score" if cap is not None else "clipped", "#9467bd"),
                (by_cap, f"clipped to the cap {cap:g}" if cap is not None else "", "#bcbd22"),
            ):
                marks = [(float(steps.step[j]), _plottable(norm_all[j])) for j in group[::stride]]
                if marks:
                    axs["gradient norm"].scatter(
                        [x for x, _ in marks], [v for _, v in marks], s=6, color=color,
                        label=f"{label} ({len(group)})", zorder=3,
                    )  # fmt: skip
            if info.clip_cap is not None and by_cap:
                axs["gradient norm"].axhline(info.clip_cap, color="#bcbd22", lw=0.8, ls="--")
                notes["timeline"] = (notes.get("timeline", "") + " " + _cap_sentence(
                    info, len(by_cap), len(by_z), actions.count("applied")
                )).strip()  # fmt: skip
        axes[-1, 0].set_xlabel("step")
        top_ax.set_title(
            "Loss, gradient norm"
            + (" and learning rate" if with_lr else "")
            + "; red lines: faults"
        )
        for ax in axes[:, 0]:
            if ax.get_legend_handles_labels()[0]:
                ax.legend(loc="upper right", fontsize=8)
        _save(fig, plt, out / "timeline.png")
        paths["timeline"] = out / "timeline.png"
    scales = steps.column("scale")[::stride]
    if any(_finite(v) and v != 1.0 for v in scales):
        logs = [math.log2(v) if _finite(v) and v > 0 else math.nan for v in scales]
        if all(math.isnan(v) for v in logs):
            notes["scale"] = "The loss scale was never a positive finite number: no plot."
        else:
            fig, ax = plt.subplots(figsize=(10, 2.8))
            ax.step(xs, logs, where="post", color="#8c564b")
            _readable(ax, "linear")
            ax.set_xlabel("step")
            ax.set_ylabel("log2(loss scale)")
            ax.set_title("fp16 loss scale")
            _save(fig, plt, out / "scale.png")
            paths["scale"] = out / "scale.png"
    if "drawn" in notes:
        notes["timeline"] = (notes.pop("drawn") + " " + notes.get("timeline", "")).strip()
    return paths, notes


def _cap_sentence(info: RunInfo, at_cap: int, by_z: int, applied: int) -> str:
    """What the clipping marks mean: the cap, and why it is there."""
    who = "ZClip's absolute cap (max_grad_norm)" if info.clip_kind == "zclip" else "The cap"
    return (
        f"Clipping: {who} is {info.clip_cap:g}, the common LLM default (GPT-3, Llama, "
        f"ZClip's own); it clipped {at_cap} of {applied} applied steps"
        + (f", ZClip's z-score {by_z} more" if by_z else "")
        + ". A cap below the usual norm scales every update down (as a lower LR would): "
        "raise it, or set it to None to let ZClip adapt alone."
    )


# the formats whose windows the exponent histograms are drawn against
_WINDOWS = ("fp16", "bf16", "e4m3fn", "e5m2")


_MAX_SAMPLES = 400  # heatmap columns: a longer run's samples are drawn every k-th


def _stats_plots(log: RunLog, out: Path) -> Plots:
    """Per-layer heatmaps (amax, fp16 underflow) over the sampled steps, and exponent
    histograms of two chosen tensors against each format's representable window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from floatguard.formats import get

    every = [e for e in log.of_kind("stats") if e["tensors"]]
    step_by = max(1, -(-len(every) // _MAX_SAMPLES))
    chosen_samples = every[::step_by] + (
        [every[-1]] if every and (len(every) - 1) % step_by else []
    )
    samples = [
        dataclasses.replace(
            e, fields={**e.fields, "tensors": [tensor_fields(t) for t in e["tensors"]]}
        )
        for e in chosen_samples
    ]
    paths: dict[str, Path] = {}
    notes: dict[str, str] = {}
    if not samples:
        return paths, notes
    # Activations (module outputs) of the modules seen on every sampled step.
    rows = sorted({(t["module"], t["role"]) for e in samples for t in e["tensors"]
                   if t["role"] == "output[0]" and t["module"]})  # fmt: skip
    if not rows:
        notes["heatmap"] = "No module output among the sampled statistics: no per-layer plot."
    else:
        row_of = {key: i for i, key in enumerate(rows)}
        amax = np.full((len(rows), len(samples)), np.nan)
        under = np.full((len(rows), len(samples)), np.nan)
        for j, e in enumerate(samples):
            for t in e["tensors"]:
                key = (t["module"], t["role"])
                i = row_of.get(key)
                if i is not None and _finite(t["amax"]) and t["amax"] > 0:
                    amax[i, j] = math.log10(t["amax"])
                    u = t["formats"].get("fp16", {}).get("underflow")
                    under[i, j] = u if _finite(u) else math.nan
    if rows and np.isnan(amax).all():
        notes["heatmap"] = "No sampled module output had a positive finite amax: no per-layer plot."
    elif rows:
        fig, axes = plt.subplots(1, 2, figsize=(11, min(0.32 * len(rows), 60) + 1.8),
                                 sharey=True)  # fmt: skip
        for ax, data, title, cmap in (
            (axes[0], amax, "log10 amax of each module's output", "viridis"),
            (axes[1], under, "fraction of the output that underflows in fp16", "magma"),
        ):
            finite = data[~np.isnan(data)]
            kw = {"vmin": 0.0, "vmax": max(float(finite.max()) if finite.size else 0.0, 1e-3)}
            im = ax.imshow(
                data, aspect="auto", cmap=cmap, interpolation="nearest",
                **(kw if cmap == "magma" else {}),
            )  # fmt: skip
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("sampled step")
            gap = max(1, -(-len(samples) // 24))  # at most ~24 labels, readable
            ax.set_xticks(range(0, len(samples), gap))
            ax.set_xticklabels([_step_tick(e.step) for e in samples[::gap]], rotation=90,
                               fontsize=7)  # fmt: skip
            fig.colorbar(im, ax=ax, fraction=0.04)
        axes[0].set_yticks(range(len(rows)))
        axes[0].set_yticklabels([m for m, _ in rows], fontsize=7)
        _save(fig, plt, out / "heatmap.png")
        paths["heatmap"] = out / "heatmap.png"
    last = samples[-1]["tensors"]
    acts = [t for t in last if t["role"] == "output[0]" and t["hist"]]
    grads = [t for t in last if t["role"].endswith(".grad") and t["hist"]]

    def size(t: dict[str, Any]) -> float:
        return float(t["amax"]) if _finite(t["amax"]) else -math.inf

    chosen = [c for c in (max(acts, key=size, default=None),
                          min(grads, key=lambda t: t["hist_from"], default=None)) if c]  # fmt: skip
    if not chosen:
        notes["histograms"] = "The last sample holds no exponent histogram: no plot."
    else:
        fig, axes = plt.subplots(len(chosen), 1, figsize=(10, 2.6 * len(chosen)), squeeze=False)
        colors = ("#1f77b4", "#2ca02c", "#d62728", "#9467bd")
        for ax, t in zip(axes[:, 0], chosen, strict=True):
            xs = [t["hist_from"] + i for i in range(len(t["hist"]))]
            ax.bar(xs, t["hist"], width=1.0, color="#555", label="values per binade")
            for k, (name, color) in enumerate(zip(_WINDOWS, colors, strict=True)):
                f = get(name)
                lo = math.floor(math.log2(f.smallest_subnormal or f.tiny))
                hi = math.floor(math.log2(f.max))
                ax.axvspan(lo, hi + 1, ymin=k * 0.06, ymax=k * 0.06 + 0.05, color=color,
                           alpha=0.8, label=f"{name} window [2^{lo}, 2^{hi + 1})")  # fmt: skip
            ax.set_yscale("log")
            ax.set_xlabel("binary exponent floor(log2|x|)")
            ax.set_ylabel("count (log scale)")
            ax.set_title(f"{t['module'] or '<root>'} {t['role']} at step {samples[-1].step}",
                         fontsize=9)  # fmt: skip
            ax.set_xlim(min(xs[0], -40) - 1, max(xs[-1], 20) + 2)
            ax.legend(fontsize=7, loc="upper left")
        _save(fig, plt, out / "histograms.png")
        paths["histograms"] = out / "histograms.png"
    return paths, notes


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;max-width:1000px;margin:2em auto;
color:#222;padding:0 1em} h1{font-size:1.6em} h2{margin-top:1.6em;border-bottom:1px solid #ddd}
.verdict{padding:.8em 1em;border-radius:6px;font-size:1.15em}
.healthy{background:#e6f4ea}.recovered{background:#fff4e0}.died{background:#fde8e8}
.unchecked{background:#eef1f5}.unresolved{background:#fde9d9}
.card{border:1px solid #ddd;border-radius:6px;padding:.6em 1em;margin:.6em 0}
.card code,td code{background:#f4f4f4;padding:0 .2em} table{border-collapse:collapse}
td,th{border:1px solid #ddd;padding:.25em .5em;text-align:left;font-size:.92em}
img{max-width:100%} .sev3{border-left:5px solid #d62728}.sev2{border-left:5px solid #ff7f0e}
.sev1{border-left:5px solid #999} .muted{color:#666;font-size:.9em}
"""


def _figure(plots: dict[str, Path], notes: dict[str, str], name: str, alt: str) -> str:
    """The plot ``name``, and the sentence said instead of (or beside) what it could not
    draw; nothing when the run has nothing of the kind."""
    parts = []
    if name in plots:
        parts.append(_img(plots[name], alt))
    if name in notes:
        parts.append(f"<p class='muted'>{_e(notes[name])}</p>")
    return "".join(parts)


_MAX_CARDS = 200  # fault cards on the page (the count and the diagnosis cover them all)


def _kind_words(kind: object) -> str:
    return "an absurd finite value" if kind == "huge" else str(kind)


def _fault_cards(log: RunLog) -> str:
    every = log.of_kind("fault")
    if not every:
        return "<p>No fault.</p>"
    faults = list(every[:_MAX_CARDS])
    wanted = {f.step for f in faults}
    steps = log.steps
    actions = {
        s: (a, r) for s, a, r in zip(steps.step, steps.column("action"), steps.reason, strict=True)
        if s in wanted
    }  # fmt: skip
    out = []
    stops = {e.step: e for e in log.of_kind("stop")}
    for f in faults:
        action, reason = actions.get(f.step, ("?", None))
        if f.step not in actions and f.step in stops:  # the fault the guard stopped for
            action, reason = "stopped the run", stops[f.step]["reason"]
        det = {True: "deterministic (the replay reproduced it)",
               False: "transient (the replay was clean)", None: "not replayed"}.get(
            f["deterministic"], "?")  # fmt: skip
        rank = f.fields.get("fault_rank")
        on = f" on <b>rank {_e(rank)}</b>" if rank is not None else ""
        out.append(
            f'<div class="card"><b>step {f.step}</b>: {_e(_kind_words(f["kind_of_value"]))} '
            "born in "
            f"<code>{_e(f['module'] or '<root>')}</code>{on} ({_e(f['phase'])}, "
            f"<code>{_e(f['tensor'])}</code>)<br>op: <code>{_e(f['op'] or '-')}</code>; "
            f"line: <code>{_e(f['source'] or '-')}</code><br>shape {_e(f['shape'])}; {det}"
            + _stats_line(f.fields.get("stats"))
            + f"<br>the guard: <b>{_e(action)}</b> ({_e(reason)})</div>"
        )
    if len(every) > len(faults):
        out.append(f"<p class='muted'>... and {len(every) - len(faults)} more faults (the "
                   "diagnosis counts them all)</p>")  # fmt: skip
    return "\n".join(out)


def _repro_href(path: str, out: Path) -> str:
    """A link to a bundle from the page: relative when both are on one tree."""
    p = Path(path)
    if not p.is_absolute():
        return p.as_posix()
    try:
        return Path(os.path.relpath(p, out.resolve())).as_posix()
    except ValueError:  # another drive
        return p.as_uri()


def _repro_section(log: RunLog, out: Path) -> str:
    """The repro bundles the guard wrote: a link each and the command that re-runs it."""
    written = log.of_kind("repro")
    if not written:
        return ""
    rows = []
    for e in written[:_MAX_CARDS]:
        path = str(e.fields.get("path") or "")
        on = f" (rank {_e(e.rank)})" if e.rank else ""
        seen = e.fields.get("reproduced")
        again = (
            "the guard's replay reproduced it"
            if seen is True
            else "transient in the guard"
            if seen is False
            else "not replayed"
        )
        if path and Path(path).is_file():
            name = f"<a href='{_e(_repro_href(path, out))}'>{_e(Path(path).name)}</a>"
            rerun = f"<code>floatguard repro {_e(path)}</code>"
        else:  # pruned (repro_keep), moved, or on another machine
            name = f"{_e(Path(path).name)} <span class='muted'>(not on disk here)</span>"
            rerun = "<span class='muted'>pruned by repro_keep, or moved</span>"
        rows.append(
            f"<tr><td>{e.step}{on}</td><td>{name}</td><td>{_e(e.fields.get('level'))}</td>"
            f"<td>{_e(e.fields.get('bytes'))}</td><td>{_e(again)}</td><td>{rerun}</td></tr>"
        )
    return (
        f"<h2>Repro bundles ({len(written)})</h2><p class='muted'>Each re-raises its fault "
        "anywhere: <code>floatguard repro BUNDLE</code> re-runs it, <code>--script "
        "repro.py</code> writes it as a PyTorch script that needs nothing of floatguard."
        "</p><table><tr><th>step</th><th>bundle</th><th>level</th><th>bytes</th>"
        "<th>in the guard</th><th>re-run</th></tr>" + "".join(rows) + "</table>"
    )


def _stats_line(st: object) -> str:
    if not isinstance(st, dict):
        return ""
    parts = [
        f"{k} {st[k]:g}" if isinstance(st[k], float) else f"{k} {st[k]}"
        for k in ("numel", "nan", "posinf", "neginf", "zeros", "amax", "min", "max")
        if k in st
    ]
    return f"<br>value statistics: {_e(', '.join(parts))}"


def _findings(found: list[Finding]) -> str:
    if not found:
        return "<p>Nothing to report.</p>"
    return "\n".join(
        f'<div class="card sev{f.severity}"><b>{_e(f.title)}</b><br>'
        f"<b>evidence</b>: {_e(f.evidence)}<br><b>likely cause</b>: {_e(f.cause)}<br>"
        f"<b>fix</b>: {_e(f.fix)}</div>"
        for f in found
    )


def _write_logs(events: list[Event], out: Path) -> None:
    """Events given in code are written beside the page (one log per rank, whole lines:
    a kind this floatguard does not know is kept as it is)."""
    lines: dict[int, list[str]] = {}
    for e in events:
        lines.setdefault(e.rank, []).append(e.to_json() + "\n")
    for rank, text in lines.items():
        name = "events.jsonl" if rank == 0 else f"events-rank{rank}.jsonl"
        with replacing(out / name) as tmp:
            tmp.write_text("".join(text), encoding="utf-8")


# every file a report writes into its folder (the event logs only for events given)
OUTPUTS = ("index.html", "timeline.png", "scale.png", "heatmap.png", "histograms.png")


def _refuse_overwriting(source: object, inputs: Sequence[object], out: Path) -> None:
    """ValueError when a log read (``source``'s paths, ``inputs``) is one of the files
    the report writes (the same file: by name, through a link, or a hard link)."""
    items = [source] if isinstance(source, (str, os.PathLike)) else source
    if isinstance(items, RunLog) or not isinstance(items, (list, tuple)):
        items = []
    for item in [*items, *inputs]:
        if not isinstance(item, (str, os.PathLike)):
            continue
        for name in OUTPUTS:
            try:
                same = os.path.samefile(item, out / name)
            except OSError:
                continue
            if same:
                raise ValueError(
                    f"the report would overwrite its input: {item} is {out / name}; "
                    "choose another output folder (--out)"
                )


def render_report(
    source: str | os.PathLike[str] | Iterable[Event] | Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    title: str = "floatguard run report",
    progress: Callable[[int, int], None] | None = None,
    origin: str | None = None,
    problems: Sequence[str] = (),
    inputs: Sequence[str | os.PathLike[str]] = (),
) -> Path:
    """Write the report of ``source`` (a JSONL path, several paths (one log per rank),
    or events) into ``out_dir``; the path of ``index.html``. A multi-rank run (one
    merged log or one per rank) is shown as the ranks' agreed view (:func:`global_view`)
    with a table per rank and each fault's rank. Logs are streamed into a compact
    :class:`~floatguard.runlog.RunLog` (memory grows with the steps, not the bytes);
    ``progress(bytes_read, total)`` is called as they are read. A :class:`RunLog` read
    already may be given with the ``problems`` its reading met and its ``origin`` (the
    page's "from" line), and ``inputs``, the files it was read from.

    Each file is written to a temp file in ``out_dir`` and renamed over its name (a
    link there is replaced, never written through; a report killed midway leaves the
    previous page whole). ValueError, with nothing written, when a log read is one of
    the files the report writes (``index.html``, the plots); OSError (with the folder
    named) when it cannot write."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _refuse_overwriting(source, inputs, out)
    given_origin = origin
    problems = list(problems)
    if isinstance(source, (str, os.PathLike)):
        source = [source]
    if isinstance(source, RunLog):
        every_rank, origin = source, "events"
    else:
        items = list(source)
        if items and all(isinstance(p, (str, os.PathLike)) for p in items):
            paths = [Path(p) for p in items]  # type: ignore[arg-type]
            every_rank = RunLog.read(paths, problems, progress)
            origin = ", ".join(str(p) for p in paths)
        else:
            events = conform_events(items, problems)  # type: ignore[arg-type]
            origin = "events"
            _write_logs(events, out)
            every_rank = RunLog.from_events(events)
    origin = given_origin if given_origin is not None else origin
    log = global_view(every_rank)
    verdict = verdict_of(log)
    found = diagnose(log)
    plots, notes = _plots(log, out)
    more, more_notes = _stats_plots(log, out)
    plots.update(more)
    notes.update(more_notes)
    rows = "".join(
        f"<tr><td>{_e(k)}</td><td>{v}</td></tr>" for k, v in sorted(every_rank.counts.items())
    )
    problem_html = (
        "<h2>Unreadable lines</h2><ul>" + "".join(f"<li>{_e(p)}</li>" for p in problems) + "</ul>"
        if problems else ""
    )  # fmt: skip
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1><p class='muted'>from {_e(origin)}</p>",
        f"<div class='verdict {verdict.state}'>{_e(verdict.text)}</div>",
        _rank_table(every_rank),
        "<h2>Timeline</h2>",
        _figure(plots, notes, "timeline", "loss and gradient norm over steps"),
        _figure(plots, notes, "scale", "loss scale over steps"),
        "<h2>Layers</h2>" if any(k in plots or k in notes for k in ("heatmap", "histograms"))
        else "",
        _figure(plots, notes, "heatmap", "per-layer amax and fp16 underflow over sampled steps"),
        _figure(plots, notes, "histograms", "exponent histograms against format windows"),
        advice_section(log, out),
        f"<h2>Faults ({verdict.faults})</h2>",
        _fault_cards(log),
        _repro_section(log, out),
        f"<h2>Diagnosis ({len(found)})</h2>",
        _findings(found),
        "<h2>Events</h2><table><tr><th>kind</th><th>count</th></tr>" + rows + "</table>",
        problem_html,
        # For a browser check: how many images decoded, once the page has loaded.
        "<script>window.addEventListener('load',function(){var i=[].slice.call("
        "document.images);document.body.setAttribute('data-images',i.filter(function(x)"
        "{return x.complete&&x.naturalWidth>0}).length+'/'+i.length)})</script>",
        "</body></html>",
    ]  # fmt: skip
    index = out / "index.html"
    with replacing(index) as tmp:
        tmp.write_text("\n".join(parts), encoding="utf-8")
    return index
