"""DynamicLossScaler against torch.amp.GradScaler and the lesson's DynamicGradScaler."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from floatguard import DynamicLossScaler


class LessonDynamicGradScaler:
    """The lesson's class, verbatim in behaviour (the reference for its trace)."""

    def __init__(
        self, init_scale=2**15, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000
    ):  # type: ignore[no-untyped-def]
        self.scale = init_scale
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self._growth_tracker = 0

    def update(self, found_inf):  # type: ignore[no-untyped-def]
        if found_inf:
            self.scale *= self.backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker >= self.growth_interval:
                self.scale *= self.growth_factor
                self._growth_tracker = 0


def _pattern(n: int) -> list[bool]:
    g = torch.Generator().manual_seed(3)
    return (torch.rand(n, generator=g) < 0.15).tolist()


def _run(scaler, pattern: list[bool]) -> list[float]:  # type: ignore[no-untyped-def]
    """Drive a scaler through real overflows: a parameter whose grad is inf on 'True' steps."""
    w = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.0)
    scales = []
    for bad in pattern:
        loss = (w * (float("inf") if bad else 1.0)).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(float(scaler.get_scale()))
    return scales


def test_scale_sequence_equals_gradscaler() -> None:
    pattern = _pattern(300)
    ours = _run(
        DynamicLossScaler(growth_interval=7, min_scale=2.0**-30, max_scale=2.0**40), pattern
    )
    ref = _run(torch.amp.GradScaler("cpu", growth_interval=7), pattern)
    assert ours == ref
    assert len(set(ours)) > 5  # the pattern exercises both growth and back-off


def test_lesson_trace_reproduced() -> None:
    pattern = _pattern(200)
    lesson = LessonDynamicGradScaler(growth_interval=5)
    ours = DynamicLossScaler(
        init_scale=2**15, growth_interval=5, min_scale=2.0**-30, max_scale=2.0**40
    )
    for bad in pattern:
        lesson.update(bad)
        ours.update(found_inf=bad)
        assert ours.get_scale() == lesson.scale


def test_bounds_hysteresis_static() -> None:
    s = DynamicLossScaler(init_scale=4.0, min_scale=1.0, growth_interval=1, max_scale=16.0)
    for _ in range(5):
        s.update(found_inf=True)
    assert s.get_scale() == 1.0  # GradScaler would be at 4 * 0.5**5
    for _ in range(10):
        s.update(found_inf=False)
    assert s.get_scale() == 16.0  # capped
    h = DynamicLossScaler(init_scale=64.0, hysteresis=3)
    h.update(found_inf=True)
    h.update(found_inf=True)
    assert h.get_scale() == 64.0
    h.update(found_inf=True)
    assert h.get_scale() == 32.0
    st = DynamicLossScaler(init_scale=128.0, dynamic=False, growth_interval=1)
    for bad in (True, False, False, True):
        st.update(found_inf=bad)
    assert st.get_scale() == 128.0


def test_overflow_report_and_state() -> None:
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([a, b], lr=0.1)
    s = DynamicLossScaler(init_scale=8.0)
    loss = a.sum() + (b * float("nan")).sum()
    s.scale(loss).backward()
    assert s.step(opt) is None  # skipped
    s.update()
    assert (
        s.last_overflow is not None
        and s.last_overflow["kind"] == "nan"
        and s.last_overflow["param"] == 1
    )
    assert torch.equal(a.detach(), torch.ones(2))  # weights untouched
    sd = s.state_dict()
    t = DynamicLossScaler()
    t.load_state_dict(sd)
    assert t.get_scale() == 4.0 and t.state_dict() == sd
    with pytest.raises(RuntimeError, match="already called"):
        s.unscale_(opt)
        s.unscale_(opt)


def test_bad_values() -> None:
    with pytest.raises(ValueError, match=r"backoff_factor=1.5"):
        DynamicLossScaler(backoff_factor=1.5)
    with pytest.raises(ValueError, match="growth_interval=0"):
        DynamicLossScaler(growth_interval=0)
    with pytest.raises(ValueError, match="hysteresis=0"):
        DynamicLossScaler(hysteresis=0)
    assert DynamicLossScaler(enabled=False).get_scale() == 1.0
