"""The report page: the verdict's state, the LR panel, the gradient norm labelled by
what was measured, tick labels readable at any length and magnitude."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from floatguard.diagnose import run_info
from floatguard.events import Event
from floatguard.report import render_report
from floatguard.report.page import _norm_label, _scale_of, _step_tick

from . import _runs as runs


def _png_height(path: Path) -> int:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int(struct.unpack(">I", data[20:24])[0])  # IHDR: width, height


def _old(events: list[Event]) -> list[Event]:
    """As an older floatguard wrote it: no step.lr."""
    return [Event(e.kind, e.step, {**e.fields, "lr": None}) if e.kind == "step" else e
            for e in events]  # fmt: skip


def test_the_timeline_has_an_lr_panel_when_the_log_has_the_lr(tmp_path: Path) -> None:
    render_report(runs.lr_x40(), tmp_path / "new")
    render_report(_old(runs.clean()), tmp_path / "old")
    render_report(_old(runs.lr_x40()), tmp_path / "factor")  # no lr, a factor that left 1
    three, two = (_png_height(tmp_path / d / "timeline.png") for d in ("new", "old"))
    assert three > 1.4 * two  # three panels against two
    assert _png_height(tmp_path / "factor" / "timeline.png") == three


def test_the_verdicts_state_colours_the_page(tmp_path: Path) -> None:
    page = render_report(runs.lr_x40(), tmp_path).read_text(encoding="utf-8")
    assert "<div class='verdict unresolved'>13 of 100 steps not applied" in page
    assert ".unresolved{" in page and "Sustained instability: from step 61" in page


@pytest.mark.parametrize(
    ("measured", "label"),
    [("before_clip", "gradient norm (before clipping)"),
     ("after_clip", "gradient norm (after the Trainer's clipping)"), (None, "gradient norm")],
)  # fmt: skip
def test_the_gradient_norm_is_labelled_by_what_was_measured(
    measured: str | None, label: str
) -> None:
    run = runs.Run(norm_measured=measured)
    assert _norm_label(run_info(run.events)) == label


def test_ticks_are_readable() -> None:
    assert [_step_tick(v) for v in (0, 950, 12_500, 120_000, 1_200_000, 2e7)] == [
        "0", "950", "12,500", "120k", "1.2M", "20M"
    ]  # fmt: skip
    # a narrow range (a clipped norm near 1) is drawn linear: a log axis would label
    # only its overlapping minor ticks; a decade or more is drawn on a log axis
    assert _scale_of([0.999999, 1.0, 0.9999995]) == "linear"
    assert _scale_of([1e-8, 5e-5]) == "log"
    assert _scale_of([-1.0, 3.0]) == "linear" and _scale_of([float("nan")]) is None
