"""TrendWatch: a sustained rise of the loss or gradient norm against the run's best
window (issue 36, item 2), on planted synthetic sequences with known alarm steps."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable

import numpy as np
import pytest

from floatguard.stability.trend import TrendAlarm, TrendPolicy, TrendWatch

Obs = tuple[int, float, float, float | None, float | None]


def _noise(n: int, rel: float, seed: int) -> np.ndarray:
    return np.exp(rel * np.random.default_rng(seed).normal(size=n))


def _feed(obs: Iterable[Obs], watch: TrendWatch | None = None) -> list[TrendAlarm]:
    w = watch or TrendWatch()
    out: list[TrendAlarm] = []
    for o in obs:
        out += w.observe(*o)
    return out


def _stream(
    loss: Callable[[int], float],
    n: int,
    *,
    norm: Callable[[int], float] = lambda s: 1.0,
    lr: Callable[[int], float | None] = lambda s: 1e-3,
    scale: Callable[[int], float | None] = lambda s: None,
    noise: float = 0.1,
    seed: int = 0,
) -> list[Obs]:
    eps_l, eps_n = _noise(n, noise, seed), _noise(n, noise, seed + 1)
    return [(s, loss(s) * eps_l[s], norm(s) * eps_n[s], lr(s), scale(s)) for s in range(n)]


# The issue's LR creep: mean loss per 50 steps 4.63, 0.72, 0.99, 1.36, 1.71, 2.41 while
# the LR climbs from 1e-3 to 0.3 (geometric).
CREEP = [4.63, 0.72, 0.99, 1.36, 1.71, 2.41]


def _lr_creep(s: int) -> float:
    return 1e-3 * 300 ** (s / 300)


def _levels(levels: list[float], per: int = 20, **kw: object) -> list[Obs]:
    """A loss constant over each ``per`` steps (2% noise unless told), the LR creeping."""
    kw.setdefault("noise", 0.02)
    kw.setdefault("lr", _lr_creep)
    return _stream(lambda s: levels[s // per], per * len(levels), **kw)  # type: ignore[arg-type]


def test_the_issues_windows_alarm_once_with_their_evidence() -> None:
    """The issue's six windows of 50, judged in windows of 50: the best is 0.72 (steps
    50-99); 0.99 is within 1.5x of it; 1.36 and 1.71 are above: the alarm fires at the
    end of the second of them."""
    alarms = _feed(
        _levels(CREEP, 50, noise=0.05), TrendWatch(TrendPolicy(window=50, warmup_windows=3))
    )
    assert [(a.signal, a.step) for a in alarms] == [("loss", 249)]
    a = alarms[0]
    assert (a.best_start, a.best_end) == (50, 99)
    assert a.best_value == pytest.approx(0.72, rel=0.03)
    assert a.window_starts == (150, 200) and a.window_ends == (199, 249)
    assert a.window_values == pytest.approx((1.36, 1.71), rel=0.04)
    assert a.rise_start == 150 and a.rise_windows == 2
    assert a.ratio == pytest.approx(1.71 / 0.72, rel=0.05)
    assert a.slope_per_window == pytest.approx(0.35, rel=0.15)
    assert a.slope_per_step == pytest.approx(a.slope_per_window / 50)
    # What changed: the LR, by 300 ** (100 / 300) = 6.7x between the two windows' middles.
    assert a.lr_ratio == pytest.approx(300 ** (100 / 300), rel=0.05)
    assert a.lr_jump is None  # a creep, no jump
    assert a.scale_best is None and a.scale_ratio is None
    msg = a.message
    assert msg.startswith(f"loss {a.ratio:.2f}x its best window (steps 50-99: 0.7")
    for part in ("above its margin for 2 windows since step 150", "(150-199)", "(200-249)",
                 "since the best window the LR went x6."):  # fmt: skip
        assert part in msg, (part, msg)
    ev = a.evidence()
    assert json.loads(json.dumps(ev)) == ev
    assert ev["message"] == msg and ev["window_starts"] == [150, 200]
    assert ev["lr_ratio"] == a.lr_ratio


# The same creep in the default windows of 20 steps: 4.63 falling to 0.72, then up.
CREEP_20 = [4.63, 4.63, 2.0, 0.72, 0.72, 0.85, 0.99, 1.2, 1.36, 1.5, 1.71, 2.0, 2.41, 2.5, 2.6]


def test_the_issues_creep_in_default_windows() -> None:
    """Best 0.72 (steps 60-99); the margin 1.5 x 0.72 x (its bound) is about 1.1: 0.99
    is below it, 1.2 (steps 140-159) and 1.36 above: the alarm fires at step 179."""
    (a,) = _feed(_levels(CREEP_20))
    assert (a.signal, a.step, a.rise_start, a.rise_windows) == ("loss", 179, 140, 2)
    assert a.best_start in (60, 80) and a.best_value == pytest.approx(0.72, rel=0.03)
    assert a.window_starts == (140, 160) and a.window_values == pytest.approx((1.2, 1.36), rel=0.03)


def test_lr_x40_from_step_60_names_the_jump() -> None:
    """The loss falls, then at step 60 the LR goes x40: the loss jumps and stays up
    (slowly settling): sustained after a change. The best window is steps 40-59; the
    first judgement (five windows) is at step 99."""

    def loss(s: int) -> float:
        return 2.0 * math.exp(-s / 20) + 0.4 if s < 60 else 2.0 + 0.4 * math.exp(-(s - 60) / 200)

    alarms = _feed(_stream(loss, 300, lr=lambda s: 1e-3 * (40 if s >= 60 else 1)))
    assert [(a.signal, a.step) for a in alarms] == [("loss", 99)]
    a = alarms[0]
    assert (a.best_start, a.rise_start) == (40, 60)
    assert (a.lr_jump, a.lr_jump_step) == (pytest.approx(40.0), 60)
    assert a.lr_ratio == pytest.approx(40.0)
    assert "it jumped x40 at step 60" in a.message


def test_label_noise_growing_says_the_optimizer_did_not_change() -> None:
    """A classifier learns (its loss falls from 2.3 over the first windows) while the
    fraction p of random labels grows to 60% over 300 steps: CE gains about p * ln(10).
    The best window is about 0.34 (steps 20-59); 80-99 (about 0.51) is within the
    margin (about 0.54), 100-119 (0.60) and 120-139 above: the alarm at step 139. By
    step 299 the loss has doubled again: told once more, as the same trend."""

    def loss(s: int) -> float:
        return 2.2 * math.exp(-s / 10) + 0.1 + 0.6 * s / 300 * math.log(10)

    alarms = _feed(_stream(loss, 300, scale=lambda s: 65536.0, noise=0.05))
    assert [(a.signal, a.step, a.again_after) for a in alarms] == [
        ("loss", 139, None),
        ("loss", 299, 139),
    ]
    a = alarms[0]
    assert a.best_start in (20, 40) and a.rise_start == 100
    assert a.lr_ratio == 1.0 and a.scale_ratio == 1.0
    assert "the LR and the loss scale did not change since the best window" in a.message


# --------------------------------------------------------------------------------------
# Clean sequences: no alarm.


CLEAN: dict[str, list[Obs]] = {
    "falling fast, then flat": _stream(lambda s: 4.0 * math.exp(-s / 30) + 0.3, 2000),
    "constant LR, 40% noise": _stream(lambda s: 1.0, 3000, noise=0.4),
    "heavy-tailed noise": [(s, 1.0 + 20.0 * (s % 37 == 0), 1.0, 1e-3, None) for s in range(2000)],
    "warm-up then cosine": _stream(
        lambda s: 3.0 / (1 + s / 100) + 0.5,
        2000,
        lr=lambda s: 1e-3 * min(1, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * s / 2000)),
    ),
    "norm grows 5x while the loss falls": _stream(
        lambda s: 3.0 / (1 + s / 50), 1500, norm=lambda s: 0.5 + 2.5 * min(1, s / 500)
    ),
    "norm grows 4x on a plateau at the best": _stream(
        lambda s: 1.0, 1500, norm=lambda s: 0.5 * (1 + 3 * s / 1500)
    ),
    "a bump that recovers": _stream(
        lambda s: 1.0 + (2.0 * math.exp(-(s - 500) / 25) if s >= 500 else 0.0), 1500
    ),
}


@pytest.mark.parametrize("obs", list(CLEAN.values()), ids=list(CLEAN))
def test_clean_sequences_do_not_alarm(obs: list[Obs]) -> None:
    assert _feed(obs) == []


def test_nothing_before_warmup_windows() -> None:
    """The loss is 5x higher from step 50 on. The window 40-59 straddles the jump (half
    its values each side: its median is uncertain by far more than the margin), so by
    the standard errors alone (climb=0) the rise starts at 60; the steady climb (20-39,
    40-59, 60-79, 80-99 each above the one before) counts the straddling window, past
    the ratio by value, as the rise's start: 40 (the jump, at 50, lies in it). Nothing
    is judged before five windows (step 99); with eight, step 159."""
    obs = _stream(lambda s: 0.5 if s < 50 else 2.5, 400)
    assert [(a.step, a.rise_start) for a in _feed(obs)] == [(99, 40)]
    plain = _feed(obs, TrendWatch(TrendPolicy(climb=0)))
    assert [(a.step, a.rise_start) for a in plain] == [(99, 60)]
    late = _feed(obs, TrendWatch(TrendPolicy(warmup_windows=8, climb=0)))
    assert [(a.step, a.rise_start) for a in late] == [(159, 60)]


# --------------------------------------------------------------------------------------
# The gradient norm: only when the loss has stopped improving.


def test_grad_norm_alarm_needs_the_loss_to_stop_improving() -> None:
    def norm(s: int) -> float:
        return 1.0 if s < 200 else 4.0

    improving = _stream(lambda s: 2.0 / (1 + s / 100), 500, norm=norm)
    assert _feed(improving) == []
    stalled = _stream(lambda s: 1.0 if s < 200 else 1.3, 500, norm=norm)  # 1.3 < 1.5: no loss alarm
    alarms = _feed(stalled)
    assert [(a.signal, a.step) for a in alarms] == [("grad_norm", 239)]
    a = alarms[0]
    assert a.ratio == pytest.approx(4.0, rel=0.08) and a.rise_start == 200
    assert a.loss_ratio == pytest.approx(1.3, rel=0.08)
    assert a.message.startswith("gradient norm 4.")
    assert "since step 200" in a.message
    assert f"while the loss stopped improving ({a.loss_ratio:.2f}x its best)" in a.message
    # With the requirement off, the norm alarms on the improving run too.
    off = TrendWatch(TrendPolicy(grad_norm_loss_ratio=0))
    assert [(a.signal, a.step) for a in _feed(improving, off)] == [("grad_norm", 239)]
    only_loss = TrendWatch(TrendPolicy(watch_grad_norm=False))
    assert _feed(stalled, only_loss) == []


# --------------------------------------------------------------------------------------
# Once per trend: re-armed near the best, again after growing again_factor.

FLAT = [1.0] * 5


def test_one_alarm_per_trend_then_again_after_doubling() -> None:
    level = [*FLAT, 2.0, 2.2, 2.4, 2.6, 3.0, 3.6, 4.8, 5.0, 6.0]
    alarms = _feed(_levels(level))
    # First at the end of the second window above 1.5 (2.2: step 139); then once a
    # window passes 2 * 2.2 (4.8: step 239), told as the same trend grown again.
    assert [a.step for a in alarms] == [139, 239]
    assert alarms[0].again_after is None and alarms[1].again_after == 139
    assert alarms[1].rise_start == 100 and alarms[1].rise_windows == 7
    assert "grown again since the alarm at step 139" in alarms[1].message


def test_rearmed_once_back_near_the_best() -> None:
    # Up (alarm at 139), back to 1.05 (within sqrt(1.5) = 1.22 of the best: re-armed),
    # up again: a second, new alarm (not "again").
    alarms = _feed(_levels([*FLAT, 2.0, 2.0, 1.05, 1.0, 2.0, 2.0, 2.0]))
    assert [(a.step, a.rise_start, a.again_after) for a in alarms] == [
        (139, 100, None),
        (219, 180, None),
    ]
    # Back only to 1.4 (above 1.22): the same trend, no second alarm.
    assert [a.step for a in _feed(_levels([*FLAT, 2.0, 2.0, 1.4, 1.4, 2.0, 2.0, 2.0]))] == [139]


def test_a_rise_that_is_coming_back_is_not_sustained() -> None:
    """Both windows above the margin, but the latest has come back more than half the
    way to the best (hold=0.5): recovering, no alarm; with hold=0.2 it alarms."""
    obs = _levels([*FLAT, 3.0, 1.8, 1.0, 1.0, 1.0])
    assert _feed(obs) == []
    assert [a.step for a in _feed(obs, TrendWatch(TrendPolicy(hold=0.2)))] == [139]


def test_a_spike_or_a_few_do_not_move_a_window() -> None:
    """Windows are medians: 5 steps of 20x in each window of 20 leave it where it was."""
    obs = [(s, 20.0 if s % 20 < 5 and s >= 100 else 1.0, 1.0, 1e-3, None) for s in range(600)]
    assert _feed(obs) == []


def test_non_finite_values_are_left_out() -> None:
    obs = [
        (s, math.nan if s % 7 == 0 else v, math.inf, lr, sc)
        for s, v, _, lr, sc in _levels(CREEP_20)
    ]
    assert [(a.signal, a.step) for a in _feed(obs)] == [("loss", 179)]


def test_lr_and_scale_may_be_missing() -> None:
    obs = [(s, v, n, None, None) for s, v, n, _, _ in _levels(CREEP_20)]
    (a,) = _feed(obs)
    assert a.lr_best is None and a.lr_ratio is None and a.lr_jump is None
    assert "no LR or loss scale was given" in a.message


def test_skipped_steps_count_only_applied_ones() -> None:
    """Windows are counted in observations (applied steps); their steps are reported."""
    obs = [o for o in _levels(CREEP_20) if o[0] % 10 != 3]  # every tenth step was skipped
    (a,) = _feed(obs)
    firsts = [o[0] for o in obs[::20]]
    lasts = [o[0] for o in obs[19::20]]
    assert a.best_start in firsts and a.best_end == lasts[firsts.index(a.best_start)]
    assert a.step in lasts and a.rise_start in firsts


# --------------------------------------------------------------------------------------
# State, memory, settings.


def test_state_dict_round_trip_resumes_the_same_alarms() -> None:
    obs = _levels([*FLAT, 2.0, 2.2, 2.4, 2.6, 3.0, 3.6, 4.8, 5.0, 6.0])
    whole = _feed(obs)
    assert len(whole) == 2
    for cut in (0, 37, 120, 139, 140, 251):
        first = TrendWatch()
        got = _feed(obs[:cut], first)
        sd = json.loads(json.dumps(first.state_dict()))  # plain values
        second = TrendWatch()
        second.load_state_dict(sd)
        got += _feed(obs[cut:], second)
        assert got == whole, cut
        assert second.state_dict() == _watched(obs).state_dict()


def _watched(obs: list[Obs]) -> TrendWatch:
    w = TrendWatch()
    _feed(obs, w)
    return w


def test_state_version_is_checked() -> None:
    sd = TrendWatch().state_dict()
    sd["version"] = 99
    with pytest.raises(ValueError, match="version 99"):
        TrendWatch().load_state_dict(sd)


def test_memory_is_bounded() -> None:
    w = TrendWatch()
    for s in range(100_000):
        w.observe(s, 1.0 + 0.001 * (s % 13), 1.0, 1e-3, 1.0)
    sd = w.state_dict()
    assert len(sd["windows"]) == 4
    assert all(len(v) < 20 for v in sd["fill"].values())
    assert len(json.dumps(sd)) < 5000


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"window": 2}, r"TrendPolicy.window=2 must be an int >= 3"),
        ({"window": 50.0}, r"window=50.0"),
        ({"recent": 0}, r"TrendPolicy.recent=0 must be an int >= 1"),
        ({"warmup_windows": 2}, r"warmup_windows=2 must be an int > recent=2"),
        ({"loss_ratio": 1.0}, r"loss_ratio=1.0 must be a finite number > 1"),
        ({"grad_norm_ratio": math.inf}, r"grad_norm_ratio=inf"),
        ({"again_factor": 0.5}, r"again_factor=0.5"),
        ({"grad_norm_loss_ratio": -1.0}, r"grad_norm_loss_ratio=-1.0 must be a finite number >= 0"),
        ({"hold": 0}, r"hold=0 must be a number in \(0, 1\]"),
        ({"hold": 1.5}, r"hold=1.5"),
        ({"watch_loss": 1}, r"watch_loss=1 must be True or False"),
    ],
)
def test_policy_is_validated(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TrendPolicy(**kw)  # type: ignore[arg-type]


def test_step_must_be_an_int() -> None:
    with pytest.raises(TypeError, match=r"step=1\.5 must be an int"):
        TrendWatch().observe(1.5, 1.0, 1.0, None, None)  # type: ignore[arg-type]
