"""The report of a multi-rank run: one merged log or one per rank; the agreed view
(each fault once, named with its rank), statistics reduced over ranks, a table per rank."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from floatguard.events import EventLog, read_events
from floatguard.report import render_report
from floatguard.report.page import global_view, reduce_stats


def _tensor(
    amax: float, hist_from: int, hist: list[int], under: float, numel: int
) -> dict[str, Any]:
    fit = {"underflow": under, "overflow": 0.0, "subnormal": 0.0}
    return {"module": "fc1", "role": "output[0]", "numel": numel, "amax": amax,
            "nonfinite": 0, "zeros": 0, "hist_from": hist_from, "hist": hist,
            "formats": {"fp16": fit}}  # fmt: skip


def _write(log: EventLog, rank: int) -> None:
    for step in range(6):
        bad = step == 3
        log.emit("step", step, action="skipped" if bad else "applied",
                 reason="nonfinite_input" if bad else None, loss=math.nan if bad else 1.0,
                 grad_norm=1.0, clip_coef=1.0, scale=1.0, lr_factor=1.0, lr=None)  # fmt: skip
        if bad:  # every rank logs the agreed fault, born on rank 1
            log.emit("fault", step, phase="input", module="", tensor="input[0]",
                     kind_of_value="nan", shape=[4], op="input", source=None,
                     deterministic=True, stats=None, fault_rank=1,
                     cause="nonfinite_input", input_amax=None, batch=None)  # fmt: skip
        if step == 4:
            t = _tensor(2.0 + rank, -3 + rank, [1, 2], 0.1 * (rank + 1), 10 * (rank + 1))
            log.emit("stats", step, tensors=[t])


def test_reduce_stats_sums_counts_and_weights_fractions() -> None:
    a, b = _tensor(2.0, -3, [1, 2], 0.1, 10), _tensor(3.0, -2, [4, 8], 0.4, 30)
    (m,) = reduce_stats([[a], [b]])
    assert m["amax"] == 3.0 and m["numel"] == 40
    assert m["hist_from"] == -3 and m["hist"] == [1, 6, 8]  # binade -2 gets 2 + 4
    assert math.isclose(m["formats"]["fp16"]["underflow"], (0.1 * 10 + 0.4 * 30) / 40)


def test_one_log_per_rank_or_one_merged_log(tmp_path: Path) -> None:
    for r in (0, 1):
        per = EventLog(tmp_path / f"run-rank{r}.jsonl", rank=r)
        _write(per, r)
        per.close()
    # one merged file: the two ranks' lines interleaved in one stream
    texts = [(tmp_path / f"run-rank{r}.jsonl").read_text().splitlines() for r in (0, 1)]
    mixed = [ln for pair in zip(*texts, strict=True) for ln in pair]
    (tmp_path / "merged.jsonl").write_text("\n".join(mixed) + "\n")
    events = [e for r in (0, 1) for e in read_events(tmp_path / f"run-rank{r}.jsonl")]
    view = global_view(events)
    assert sum(1 for e in view if e.kind == "fault") == 1
    assert sum(1 for e in view if e.kind == "step") == 6
    (stats,) = [e for e in view if e.kind == "stats"]
    assert stats["tensors"][0]["amax"] == 3.0 and stats["tensors"][0]["numel"] == 30
    for source, out in (
        ([tmp_path / "run-rank0.jsonl", tmp_path / "run-rank1.jsonl"], "per-rank"),
        (tmp_path / "merged.jsonl", "merged"),
    ):
        page = render_report(source, tmp_path / out).read_text()  # type: ignore[arg-type]
        assert "Ranks (2)" in page and "on <b>rank 1</b>" in page
        assert page.count('<div class="card"><b>step') == 1
        assert "Statistics per rank" in page and "<td>2</td><td>3</td>" in page
        assert "Recovered from 1 fault(s)" in page
