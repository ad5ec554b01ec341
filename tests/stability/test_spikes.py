"""Spike detectors: the lesson's trace, NaN safety, and the robust variant."""

from __future__ import annotations

import math

import numpy as np
import pytest

from floatguard import LossSpikeHandler, RobustSpikeDetector


class LessonLossSpikeHandler:
    """The lesson's class (reference for the trace)."""

    def __init__(self, threshold=5.0, patience=3):  # type: ignore[no-untyped-def]
        self.threshold = threshold
        self.patience = patience
        self.loss_history = []  # type: ignore[var-annotated]
        self.spike_count = 0

    def check_spike(self, loss):  # type: ignore[no-untyped-def]
        self.loss_history.append(loss)
        if len(self.loss_history) < 10:
            return False
        recent = self.loss_history[-10:]
        mean = np.mean(recent)
        std = np.std(recent)
        is_spike = loss > mean + self.threshold * std
        if is_spike:
            self.spike_count += 1
            if self.spike_count >= self.patience:
                return True
        else:
            self.spike_count = 0
        return False


def _losses() -> list[float]:
    rng = np.random.default_rng(0)
    xs = list(3.0 - 0.01 * np.arange(200) + rng.normal(0, 0.02, 200))
    for i in (40, 41, 42, 43, 100, 150, 151, 152):
        xs[i] += 0.3
    return [float(x) for x in xs]


@pytest.mark.parametrize(("threshold", "patience"), [(5.0, 3), (2.0, 1), (2.5, 2)])
def test_lesson_trace_reproduced(threshold: float, patience: int) -> None:
    lesson = LessonLossSpikeHandler(threshold, patience)
    ours = LossSpikeHandler(threshold, patience)
    trace_l = [lesson.check_spike(v) for v in _losses()]
    trace_o = [ours.check(v) for v in _losses()]
    assert trace_o == trace_l
    if (threshold, patience) == (2.0, 1):
        # The injected +0.3 jumps are found (so the comparison is not all-False).
        assert sum(trace_o) >= 4


def test_lesson_default_can_never_fire() -> None:
    """With the value inside its own 10-value window, its z-score is at most sqrt(9) = 3:
    the lesson's default threshold of 5 never detects anything. Ours documents this."""
    d = LossSpikeHandler(threshold=5.0, patience=1)
    assert not any(d.check(v) for v in [1.0] * 9 + [1e9])
    d2 = LossSpikeHandler(threshold=2.9, patience=1)
    assert [d2.check(v) for v in [1.0] * 9 + [1e9]][-1] is True


def test_nan_never_poisons_the_history() -> None:
    lesson = LessonLossSpikeHandler(2.0, 1)
    ours = LossSpikeHandler(2.0, 1)
    seq = [*_losses()[:30], math.nan, 2.7, 2.7, 9.0, *_losses()[30:60]]
    lt = [lesson.check_spike(v) for v in seq]
    ot = [ours.check(v) for v in seq]
    assert ot[30] is True  # NaN is a spike
    assert ot[33] is True and lt[33] is False  # while the NaN is in its window the lesson is blind
    assert all(math.isfinite(v) for v in ours.history)


def test_robust_detector() -> None:
    d = RobustSpikeDetector(window=20, z=6.0, warmup=5)
    flags = [d.check(v) for v in [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02]]
    assert not any(flags)
    assert d.check(5.0) is True
    assert 5.0 not in d.history  # a spike does not raise the bar
    assert d.check(1.01) is False
    assert d.check(math.nan) is True
    with pytest.raises(ValueError, match="warmup=2"):
        RobustSpikeDetector(warmup=2)


# --------------------------------------------------------------------------------------
# RobustSpikeDetector: a spike needs a z-score above z AND a material jump.


def _z_only(history: list[float], value: float, z: float = 6.0) -> bool:
    """The rule before (reference): the MAD z-score over the whole window, zeros
    included; a zero MAD makes any value above the median a spike."""
    med = float(np.median(history))
    scale = 1.4826 * float(np.median(np.abs(np.asarray(history) - med)))
    return value > med if scale == 0 else (value - med) / scale > z


def _hinge_stream() -> list[float]:
    """Batch hinge losses of a fitted linear classifier on overlapping blobs: most
    batches are cleared by the margin (exactly 0), the others range over decades."""
    rng = np.random.default_rng(3)
    mu = np.full(20, 3.0 / math.sqrt(20))  # class means +-mu, unit noise
    w = mu / (mu @ mu) * 4.5  # y * f(x) = 4.5 + 1.5 * N(0, 1): about 1% of samples violate
    out = []
    for _ in range(1500):
        y = rng.choice([-1.0, 1.0], 32)
        x = y[:, None] * mu + rng.normal(size=(32, 20))
        out.append(float(np.maximum(0.0, 1.0 - y * (x @ w)).mean()))
    return out


def test_hinge_loss_stream_has_no_spikes() -> None:
    losses = _hinge_stream()
    zeros = sum(v == 0 for v in losses)
    assert 0.6 * len(losses) < zeros < 0.95 * len(losses)  # mostly zeros, some learning
    positive = [v for v in losses if v > 0]
    assert max(positive) / min(positive) > 30  # the informative batches span decades
    d = RobustSpikeDetector()
    assert [i for i, v in enumerate(losses) if d.check(v)] == []
    # The z-score alone (the rule before) skipped most informative batches.
    old = sum(_z_only(losses[i - 50 : i], v) for i, v in enumerate(losses) if i >= 50 and v > 0)
    assert old > 0.5 * sum(v > 0 for v in losses[50:])
    # And a real spike on that stream is still one: 10x its largest batch.
    assert d.is_spike(10 * max(positive))


def _smooth_curve(n: int = 300) -> list[float]:
    """A smooth, slowly decreasing loss (gradient accumulation over many tokens, late in
    training): 0.05% noise, 0.1% drift per window of 50."""
    rng = np.random.default_rng(4)
    t = np.arange(n)
    return [float(v) for v in (1.8 + 0.4 * np.exp(-t / 4000)) * (1 + 5e-4 * rng.normal(size=n))]


def test_small_bump_on_a_smooth_curve_is_not_a_spike() -> None:
    xs = _smooth_curve()
    d = RobustSpikeDetector()
    assert not any(d.check(v) for v in xs)
    neighbours = xs[-3:]
    bump = 1.017 * sum(neighbours) / 3  # a batch 1.7% above its neighbours
    assert d.score(bump) > d.z  # the z-score alone would skip it
    assert d.is_spike(bump) is False
    assert d.check(bump) is False and d.history[-1] == bump
    assert d.is_spike(10 * xs[-1]) is True  # a real 10x spike still is
    assert d.is_spike(1.6 * xs[-1]) is True  # and so is a jump past min_rel
    assert d.is_spike(1.4 * xs[-1]) is False


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_is_a_spike_even_in_warmup(bad: float) -> None:
    d = RobustSpikeDetector()
    assert d.is_spike(bad) is True  # empty window
    for v in _smooth_curve()[:60]:
        d.check(v)
    n = len(d.history)
    assert d.check(bad) is True
    assert len(d.history) == n  # never recorded


def test_warmup_unchanged() -> None:
    """Before ``warmup`` values are recorded no finite value is a spike, whatever it is;
    the next one can be."""
    for warmup in (3, 5, 10):
        d = RobustSpikeDetector(window=20, warmup=warmup)
        for i in range(warmup):
            assert d.is_spike(1000.0) is False
            assert d.check(1.0 + 0.01 * (i % 3)) is False
        assert d.is_spike(1000.0) is True
        assert d.check(1.0) is False


def test_is_spike_is_pure_and_check_records_its_decision() -> None:
    stream = [*_smooth_curve(120), 40.0, *_hinge_stream()[:200], math.nan, 0.0, 3.0]
    d = RobustSpikeDetector()
    for v in stream:
        before = (list(d.history), d.threshold())
        asked = [d.is_spike(v) for _ in range(3)]
        assert (list(d.history), d.threshold()) == before  # no state change
        assert d.check(v) is asked[0] is asked[1] is asked[2]
        assert d.would_trigger(v) is d.is_spike(v)


def test_zero_window_needs_a_scale() -> None:
    """A window of exact zeros has no scale: the first informative batches are learned
    from; with min_spread (an absolute scale) a value past z * min_spread is a spike."""
    d = RobustSpikeDetector()
    for _ in range(50):
        d.check(0.0)
    assert d.threshold() == math.inf
    assert d.is_spike(0.3) is False and d.is_spike(1e6) is False
    assert d.is_spike(math.nan) is True
    e = RobustSpikeDetector(min_spread=0.1)
    for _ in range(50):
        e.check(0.0)
    assert e.threshold() == pytest.approx(0.6)  # z * min_spread
    assert e.is_spike(0.5) is False and e.is_spike(0.7) is True
    # A few informative values among the zeros: still too few to set a scale.
    for v in [0.2, 0.0, 0.05, 0.0, 0.4]:
        assert d.check(v) is False


def test_constant_nonzero_window_uses_the_level() -> None:
    """A loss sitting on one bf16 value (MAD 0): one ulp up is not a spike, 2x is."""
    d = RobustSpikeDetector()
    for _ in range(30):
        d.check(2.0)
    assert d.is_spike(2.0 + 2**-6) is False
    assert d.threshold() == pytest.approx(3.0)
    assert d.is_spike(4.0) is True


def test_heavy_tail_within_the_shown_range_is_not_a_spike() -> None:
    """Values the window rose to and came back from are ordinary for the stream (bar 3)
    even at z > 6; a value far past them is still a spike."""
    base = [0.2, 0.25, 0.22, 0.21, 0.24, 0.23, 0.2, 0.26, 0.22, 0.8, 0.21, 0.24] * 4
    d = RobustSpikeDetector()
    assert not any(d.check(v) for v in base)
    assert d.score(0.85) > d.z and d.is_spike(0.85) is False
    med, hi = float(np.median(base)), 0.8
    assert d.threshold() == pytest.approx(hi + 1.5 * (hi - med))
    assert d.is_spike(2.5) is True


def test_divergence_is_still_caught() -> None:
    """A climb that never comes back down does not raise its own bar (bar 3 counts only
    rises the stream returned from): flagged once past 1.5x the median, and after."""
    rng = np.random.default_rng(5)
    flat = [float(v) for v in 1 + 0.01 * rng.normal(size=60)]
    climb = [1.1**k for k in range(1, 30)]
    d = RobustSpikeDetector()
    assert not any(d.check(v) for v in flat)
    flags = [d.check(v) for v in climb]
    first = flags.index(True)
    assert climb[first] == pytest.approx(1.1**5)  # 1.61: the first value past 1.5x
    assert all(flags[first:])


def test_state_dict_is_the_window_alone() -> None:
    d = RobustSpikeDetector(min_rel=0.3, range_rel=1.0, min_spread=0.01)
    for v in _smooth_curve(80):
        d.check(v)
    sd = d.state_dict()
    assert list(sd) == ["history"]
    old_format = {"history": [float(v) for v in sd["history"]]}  # as saved before the knobs
    e = RobustSpikeDetector(min_rel=0.3, range_rel=1.0, min_spread=0.01)
    e.load_state_dict(old_format)
    probe = [1.0, 2.0, 2.3, 2.5, 9.0, math.nan]
    assert [e.is_spike(v) for v in probe] == [d.is_spike(v) for v in probe]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"min_rel": -0.1}, r"min_rel=-0\.1 must be a finite number >= 0"),
        ({"min_rel": math.nan}, r"min_rel=nan"),
        ({"min_rel": math.inf}, r"min_rel=inf"),
        ({"min_rel": True}, r"min_rel=True"),
        ({"range_rel": -1}, r"range_rel=-1 must be a finite number >= 0"),
        ({"min_spread": -1e-3}, r"min_spread=-0\.001 must be a finite number >= 0.*units"),
        ({"min_spread": "0.1"}, r"min_spread='0\.1'"),
        ({"neighbours": -1}, r"neighbours=-1 must be an int >= 0"),
        ({"neighbours": 2.0}, r"neighbours=2\.0 must be an int"),
        ({"neighbours": True}, r"neighbours=True"),
    ],
)
def test_knobs_are_validated(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RobustSpikeDetector(**kw)  # type: ignore[arg-type]


def test_lesson_handler_min_rel() -> None:
    """Off by default (the lesson's trace, tested above); on, a bump of a few percent over
    the prior mean is no spike however small the std; would_trigger is check's answer."""
    xs = [2.0 + 1e-4 * (i % 3) for i in range(20)]
    plain = LossSpikeHandler(threshold=2.0, patience=1)
    rel = LossSpikeHandler(threshold=2.0, patience=1, min_rel=0.5)
    for v in xs:
        plain.check(v)
        rel.check(v)
    assert plain.is_spike(2.04) is True
    assert rel.is_spike(2.04) is False
    assert rel.is_spike(4.0) is True
    with pytest.raises(ValueError, match="min_rel=-1"):
        LossSpikeHandler(min_rel=-1)
    d = LossSpikeHandler(threshold=2.0, patience=2)
    for v in [*xs, 9.0, 9.5, 2.0, 9.0]:
        expected = d.would_trigger(v)
        assert d.check(v) is expected


# --------------------------------------------------------------------------------------
# Trends: a bad batch on a falling loss (issue 36, item 5).


def _falling(n: int = 200, seed: int = 6) -> list[float]:
    """Early training: a loss falling 40-fold over 80 steps, 10% lognormal batch noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    return [float(v) for v in (2.2 * np.exp(-t / 20) + 0.05) * np.exp(0.1 * rng.normal(size=n))]


def _before_threshold(history: list[float], z: float = 6.0, min_rel: float = 0.5) -> float:
    """The rule before ``neighbours`` (reference): median, MAD and the highest value
    come back from, over the last 50 nonzero values."""
    basis = [v for v in history if v != 0][-50:]
    med = float(np.median(basis))
    mad = float(np.median(np.abs(np.asarray(basis) - med)))
    back = max(i for i, v in enumerate(basis) if v <= med)
    hi = max([med, *basis[:back]])
    bar = max(med + z * 1.4826 * mad, med + min_rel * abs(med), hi + 1.5 * (hi - med))
    return bar if bar > med else math.inf


@pytest.mark.parametrize("step", [30, 80], ids=["step30", "step80"])
def test_a_batch_5x_its_neighbours_on_a_falling_loss_is_a_spike(step: int) -> None:
    xs = _falling()
    for k in (0, 8):
        assert not any(RobustSpikeDetector(neighbours=k).check(v) for v in xs)  # clean: none
    d, before = RobustSpikeDetector(), RobustSpikeDetector(neighbours=0)
    for v in xs[:step]:
        d.check(v)
        before.check(v)
    neighbours = float(np.median(xs[step - 5 : step]))
    assert d.is_spike(5 * neighbours) is True
    assert d.is_spike(2 * neighbours) is False  # within the stream's own noise and fall
    # Against the whole window the median was 2-3x the loss of the moment, the MAD the
    # fall's, and the window's first values a "rise come back from": 5x was applied.
    assert before.is_spike(5 * neighbours) is False
    assert before.threshold() > 8 * neighbours
    assert before.threshold() == pytest.approx(_before_threshold(before.history))


def test_neighbours_zero_is_the_rule_before() -> None:
    for stream in (_hinge_stream()[:400], _smooth_curve(), _falling()):
        d = RobustSpikeDetector(neighbours=0)
        for v in stream:
            if len([h for h in d.history if h != 0]) >= d.warmup:
                assert d.threshold() == pytest.approx(_before_threshold(d.history), rel=1e-12)
            d.check(v)


def test_a_rising_stream_keeps_the_window_median_as_its_level() -> None:
    """Only a falling stream lowers the level: a gradient norm that doubles over the
    window (early training) is judged from the window's median, as before, and a
    value past 1 + min_rel of it is a spike, however recent values have risen."""
    rise = [1.0 + k / 50 for k in range(50)]
    d = RobustSpikeDetector()
    assert not any(d.check(v) for v in rise)
    assert d.threshold() == pytest.approx(1.5 * float(np.median(rise)))
    # The last value was 1.98, the median 1.49: the bar is 2.235 (not 1.5 x 1.98).
    assert d.is_spike(2.2) is False and d.is_spike(2.3) is True


def test_the_deviation_cache_is_exact() -> None:
    """Deviations kept between steps give the thresholds of a detector loaded with the
    same window (which computes all of them afresh), at every step: with zeros, spikes,
    NaN, a falling trend, min_spread's basis and windows shorter than the neighbourhood."""
    rng = np.random.default_rng(7)
    for trial in range(12):
        kw = {
            "window": [10, 20, 50][trial % 3],
            "neighbours": [2, 3, 8, 8][trial % 4],
            "min_spread": [0.0, 0.1][trial % 2],
        }
        d = RobustSpikeDetector(**kw)  # type: ignore[arg-type]
        for i in range(300):
            r = rng.random()
            v = math.nan if r > 0.99 else 0.0 if r < 0.15 * (trial % 3) else rng.lognormal()
            e = RobustSpikeDetector(**kw)  # type: ignore[arg-type]
            e.load_state_dict(d.state_dict())
            assert d.threshold() == e.threshold(), (trial, i)
            d.check(float(v) * (1 + 0.02 * (300 - i)) if math.isfinite(v) else v)
