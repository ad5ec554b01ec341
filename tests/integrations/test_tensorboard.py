"""The event stream in TensorBoard: scalars, the exponent histograms of sampled tensors
and fault text, read back with TensorBoard's own event reader."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import (
    EventAccumulator,
)

from floatguard import Guard
from floatguard.integrations.tensorboard import TensorBoardSink, export


def _run(log: Path, sink_dir: Path | None) -> TensorBoardSink | None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(model, opt, stats_every=4, log=log)
    sink = TensorBoardSink(sink_dir).attach(guard) if sink_dir is not None else None
    for step in range(12):
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        if step == 7:
            x[0, 0] = math.nan
        guard.step(lambda x=x, y=y: ((model(x) - y) ** 2).mean())
    guard.close()
    if sink is not None:
        sink.close()
    return sink


def _read(d: Path) -> EventAccumulator:
    acc = EventAccumulator(str(d), size_guidance={"histograms": 0, "scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_live_sink_and_export_write_the_same(tmp_path: Path) -> None:
    _run(tmp_path / "run.jsonl", tmp_path / "live")
    n = export(tmp_path / "run.jsonl", tmp_path / "exported")
    assert n > 12
    for d in ("live", "exported"):
        acc = _read(tmp_path / d)
        tags = acc.Tags()
        action = [e.value for e in acc.Scalars("floatguard/action")]
        assert action == [0.0] * 7 + [1.0] + [0.0] * 4  # step 7 skipped
        assert [e.value for e in acc.Scalars("floatguard/skipped")][-1] == 1.0
        loss = [e.value for e in acc.Scalars("floatguard/loss")]
        assert math.isnan(loss[7]) and all(math.isfinite(v) for i, v in enumerate(loss) if i != 7)
        hist = [t for t in tags["histograms"] if t.startswith("floatguard/exponents/")]
        assert "floatguard/exponents/0/output[0]" in hist
        h = acc.Histograms("floatguard/exponents/0/output[0]")[0]
        assert h.step == 0 and h.histogram_value.num == 16 * 8  # every element, one binade each
        amax = [t for t in tags["scalars"] if t.startswith("floatguard/amax/")]
        assert amax
        assert "floatguard/fault/text_summary" in tags["tensors"]  # add_text: a text tensor
