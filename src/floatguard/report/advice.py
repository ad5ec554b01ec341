"""The report's "Precision plan" section: ``advice`` events (:meth:`floatguard.Advice.log`).

Per recipe advised (the latest advice of each), the gradient SQNR each candidate layer's
emulation leaves alone (a bar per layer, the plan's layers marked), the plan with its
FLOP share, the gap with everything emulated and with the plan, the expected loss gap
and the recipe's notes. Fields are read as a file from elsewhere may hold them: a layer
entry that is not what :meth:`~floatguard.Advice.log` writes is left out, and said so.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from floatguard.report._html import escape, img_tag, save_figure
from floatguard.runlog import RunLog

__all__ = ["advice_section"]

_MAX_BARS = 40  # layers drawn (the table lists them all)


def _num(v: object, infinite: bool = False) -> float | None:
    """A finite number (or, with ``infinite``, +-inf too) as a float; else None."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None
    x = float(v)
    return x if math.isfinite(x) or (infinite and not math.isnan(x)) else None


def _layers(raw: object) -> tuple[list[dict[str, Any]], int]:
    """The well-formed layer entries, and how many were not."""
    good: list[dict[str, Any]] = []
    bad = 0
    for la in raw if isinstance(raw, list) else []:
        if (
            isinstance(la, dict) and isinstance(la.get("name"), str)
            and _num(la.get("sqnr_db"), infinite=True) is not None
            and _num(la.get("share")) is not None
        ):  # fmt: skip
            good.append(la)
        else:
            bad += 1
    return good, bad


def _gap_words(g: object) -> str:
    if not isinstance(g, dict):
        return "not recorded"
    db, loss = _num(g.get("sqnr_db"), infinite=True), _num(g.get("loss_delta"), infinite=True)
    parts = []
    if db is not None:
        parts.append(f"gradient SQNR {db:.1f} dB")
    if loss is not None:
        parts.append(f"loss {loss:+.4g}")
    return ", ".join(parts) or "not recorded"


def _expected_words(e: object) -> str:
    if not isinstance(e, dict):
        return "not measured"
    mean, spread = _num(e.get("mean"), infinite=True), _num(e.get("spread"))
    low, high = _num(e.get("low"), infinite=True), _num(e.get("high"), infinite=True)
    steps = _num(e.get("steps"))
    if mean is None:
        return "not measured"
    text = f"{mean:+.4g}"
    if spread is not None:
        text += f" ± {spread:.2g}"
    if low is not None and high is not None:
        text += f" ({low:+.4g}..{high:+.4g})"
    n = len(e["gaps"]) if isinstance(e.get("gaps"), list) else None
    if e.get("basis") == "trained" and steps is not None:
        text += f" over {n} seed(s) after {int(steps)} step(s)"
    else:
        text += f" over {n} batch(es) of one step, untrained"
    return text


def _plot(layers: list[dict[str, Any]], keep: set[str], everything: float | None,
          path: Path) -> None:  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = layers[:_MAX_BARS]
    names = [str(la["name"]) for la in shown][::-1]
    raw = [float(la["sqnr_db"]) for la in shown][::-1]
    finite = [d for d in raw if math.isfinite(d)]
    cap = (max(finite) + 10.0) if finite else 100.0
    # +inf: the layer adds no error (the longest bar); -inf: its emulation made the
    # gradient non-finite, the most sensitive of all (no bar, red, named so)
    floor = 0.03 * cap  # a visible red stub for a non-finite layer
    db = [cap if d == math.inf else floor if d == -math.inf else d for d in raw]
    names = [n + " (non-finite)" if d == -math.inf else n for n, d in zip(names, raw, strict=True)]
    colors = [
        "#d62728" if d == -math.inf else "#ff7f0e" if n in keep else "#1f77b4"
        for n, d in zip((str(la["name"]) for la in shown[::-1]), raw, strict=True)
    ]
    fig, ax = plt.subplots(figsize=(7.5, 1.2 + 0.28 * len(shown)))
    ax.barh(range(len(shown)), db, color=colors)
    ax.set_yticks(range(len(shown)), names, fontsize=7)
    if everything is not None and math.isfinite(everything):
        ax.axvline(everything, color="#d62728", linestyle="--", linewidth=1,
                   label=f"every layer emulated: {everything:.1f} dB")  # fmt: skip
        ax.legend(fontsize=7, loc="lower right")
    elif everything == -math.inf:
        ax.set_title("every layer emulated: the gradient is non-finite", fontsize=8)
    ax.set_xlabel("gradient SQNR with only this layer emulated (dB; shorter bar: more "
                  "sensitive; orange: kept by the plan)", fontsize=8)  # fmt: skip
    ax.set_xlim(left=min(0.0, *db) if db else 0.0)
    save_figure(fig, plt, path)


def advice_section(log: RunLog, out: Path) -> str:
    """The section's HTML (empty when the log holds no ``advice`` event); its plots are
    written into ``out`` as ``advice-K.png`` and embedded."""
    latest: dict[str, Any] = {}
    for e in log.of_kind("advice"):
        latest[str(e.fields.get("recipe"))] = e
    if not latest:
        return ""
    parts = ["<h2>Precision plan</h2>"]
    for k, (recipe, e) in enumerate(latest.items()):
        f = e.fields
        layers, bad = _layers(f.get("layers"))
        keep_raw = f.get("keep")
        keep = {str(n) for n in keep_raw} if isinstance(keep_raw, list) else set()
        share = _num(f.get("kept_share"))
        budget = _num(f.get("budget"))
        budget_words = (
            "" if budget is None
            else f" under a budget of {budget:.0%} of GEMM FLOPs" if 0 < budget < 1
            else f" under a budget of {int(budget)} layer(s)"
        )  # fmt: skip
        everything = f.get("gap_all")
        parts.append(
            f"<h3>{escape(recipe)}</h3><p>The plan{escape(budget_words)}: keep "
            f"{len(keep)} layer(s) in high precision"
            + (f" ({share:.1%} of GEMM FLOPs)" if share is not None else "")
            + (f": <code>{escape(', '.join(map(str, keep_raw or [])))}</code>" if keep else "")
            + f". Everything emulated: {escape(_gap_words(everything))}; with the plan: "
            f"{escape(_gap_words(f.get('gap_plan')))}.</p>"
            f"<p>Expected loss gap (emulated minus high precision), everything emulated: "
            f"{escape(_expected_words(f.get('expected')))}; with the plan: "
            f"{escape(_expected_words(f.get('expected_plan')))}.</p>"
        )
        if layers:
            path = out / f"advice-{k}.png"
            db = _num(everything.get("sqnr_db")) if isinstance(everything, dict) else None
            try:
                _plot(layers, keep, db, path)
                parts.append(img_tag(path, f"gradient SQNR per layer under {recipe}"))
            except (ValueError, OverflowError) as err:  # a value matplotlib cannot draw
                parts.append(f"<p class='muted'>The plot could not be drawn: {escape(err)}</p>")
            rows = "".join(
                f"<tr><td>{escape(la['name'])}</td><td>{float(la['share']):.1%}</td>"
                f"<td>{float(la['sqnr_db']):.1f}</td>"
                f"<td>{escape(la.get('recommendation') or '')}</td></tr>"
                for la in layers
            )
            parts.append(
                "<table><tr><th>layer (most sensitive first)</th><th>GEMM FLOPs</th>"
                f"<th>SQNR alone (dB)</th><th>advice</th></tr>{rows}</table>"
            )
        if bad:
            parts.append(
                f"<p class='muted'>{bad} layer entr{'y' if bad == 1 else 'ies'} "
                "unreadable, left out.</p>"
            )
        notes = f.get("notes")
        for note in notes if isinstance(notes, list) else []:
            parts.append(f"<p class='muted'>{escape(note)}</p>")
    return "".join(parts)
