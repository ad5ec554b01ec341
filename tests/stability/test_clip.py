"""Clipping against torch, ZClip against the published zclip package."""

from __future__ import annotations

import math

import pytest
import torch
import zclip as zclip_pkg
from torch import nn

from floatguard import WindowedZClip, ZClip, ZClipConfig, clip_grad_norm_, clip_grad_value_


def _params(seed: int = 0, scale: float = 1.0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    ps = [nn.Parameter(torch.randn(n, generator=g)) for n in (5, 7, 3)]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * scale
    return ps


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.1, 100.0])
def test_clip_grad_norm_matches_torch(norm_type: float, max_norm: float) -> None:
    a, b = _params(), _params()
    n1 = clip_grad_norm_(a, max_norm, norm_type)
    n2 = torch.nn.utils.clip_grad_norm_(b, max_norm, norm_type)
    torch.testing.assert_close(n1, n2)
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_nonfinite_norm_is_not_hidden() -> None:
    ref = _params()
    assert ref[1].grad is not None
    ref[1].grad[2] = math.inf
    torch.nn.utils.clip_grad_norm_(ref, 1.0)
    assert ref[0].grad is not None and not bool(ref[0].grad.any())  # torch zeroed the healthy grads
    for mode in ("skip", "zero"):
        ps = _params()
        assert ps[1].grad is not None
        ps[1].grad[2] = math.inf
        before = [p.grad.clone() for p in ps if p.grad is not None]
        norm = clip_grad_norm_(ps, 1.0, nonfinite=mode)  # type: ignore[arg-type]
        assert math.isinf(float(norm))
        after = [p.grad for p in ps]
        if mode == "skip":
            assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
        else:
            assert all(y is not None and not bool(y.any()) for y in after)
    ps = _params()
    assert ps[0].grad is not None
    ps[0].grad[0] = math.nan
    with pytest.raises(RuntimeError, match="gradient is NaN or inf"):
        clip_grad_norm_(ps, 1.0, nonfinite="error")


def test_clip_grad_value_matches_torch() -> None:
    a, b = _params(scale=3.0), _params(scale=3.0)
    clip_grad_value_(a, 1.5)
    torch.nn.utils.clip_grad_value_(b, 1.5)
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]


def _norm_series(n: int) -> list[float]:
    g = torch.Generator().manual_seed(11)
    base = (torch.rand(n, generator=g) * 0.4 + 0.8).tolist()
    for i in (30, 45, 46, 70, 90):
        base[i] *= 12.0  # spikes after warmup
    return base


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"max_grad_norm": None},
        {"clip_option": "mean", "max_grad_norm": None},
        {"mode": "percentile", "max_grad_norm": 5.0},
        {"skip_update_on_spike": True, "max_grad_norm": None, "warmup_steps": 10},
    ],
)
@pytest.mark.parametrize("on_host", [False, True], ids=["device", "host"])
def test_zclip_matches_the_published_package(kw: dict[str, object], on_host: bool) -> None:
    """Decisions and EMA equal zclip's (1.0.0, the only release; pinned in constraints.txt)."""
    ours = ZClip(ZClipConfig(**kw), on_host=on_host)  # type: ignore[arg-type]
    ref = zclip_pkg.ZClip(**kw)
    w_ours, w_ref = nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)
    for norm in _norm_series(100):
        for m in (w_ours, w_ref):
            m.weight.grad = torch.full((1, 1), norm)
        n_ours = ours.step(w_ours.parameters())
        n_ref = ref.step(w_ref)
        assert float(n_ours) == pytest.approx(n_ref, rel=1e-6)
        assert w_ours.weight.grad is not None and w_ref.weight.grad is not None
        assert float(w_ours.weight.grad) == pytest.approx(float(w_ref.weight.grad), rel=1e-5)
    assert ours.mean is not None and ours.var is not None
    assert float(ours.mean) == pytest.approx(ref.mean, rel=1e-6)
    assert float(ours.var) == pytest.approx(ref.var, rel=1e-5)


def test_zclip_is_nan_safe_and_checkpointable() -> None:
    z = ZClip(max_grad_norm=None, warmup_steps=5)
    w = nn.Linear(1, 1, bias=False)
    series = [1.0, 1.1, 0.9, 1.0, 1.05, 1.0, math.nan, math.inf, 1.0, 0.95]
    for v in series:
        w.weight.grad = torch.full((1, 1), v)
        z.step(w.parameters())
        if not math.isfinite(v):
            assert w.weight.grad is not None and not math.isfinite(
                float(w.weight.grad)
            )  # left visible
    assert z.mean is not None and math.isfinite(float(z.mean)) and math.isfinite(float(z.var))  # type: ignore[arg-type]
    clean = ZClip(max_grad_norm=None, warmup_steps=5)
    for v in [x for x in series if math.isfinite(x)]:
        w.weight.grad = torch.full((1, 1), v)
        clean.step(w.parameters())
    assert float(z.mean) == pytest.approx(float(clean.mean))  # type: ignore[arg-type]
    restored = ZClip()
    restored.load_state_dict(z.state_dict())
    assert float(restored.mean) == float(z.mean) and restored.config == z.config  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"alpha=1.5"):
        ZClipConfig(alpha=1.5)


def test_windowed_zclip_clips_to_threshold_not_mean() -> None:
    wz = WindowedZClip(window=5, z_thresh=2.0)
    w = nn.Linear(1, 1, bias=False)
    for v in [1.0, 1.2, 0.8, 1.1, 0.9]:
        w.weight.grad = torch.full((1, 1), v)
        wz.step(w.parameters())
    thr = wz.threshold()
    assert thr is not None and thr > 1.0
    w.weight.grad = torch.full((1, 1), 50.0)
    assert wz.step(w.parameters()) == 50.0
    assert float(w.weight.grad) == pytest.approx(
        thr, rel=1e-6
    )  # the lesson would give the mean, 1.0


@pytest.mark.parametrize(
    "kw",
    [{}, {"clip_option": "mean", "max_grad_norm": None}, {"mode": "percentile"},
     {"skip_update_on_spike": True, "warmup_steps": 5}],
)  # fmt: skip
def test_zclip_on_host_is_bit_identical_to_zclip_on_device(kw: dict[str, object]) -> None:
    """The guard runs ZClip on host floats after its one read: the same float64
    arithmetic, so the same decisions, coefficients and state to the last bit,
    non-finite norms included."""
    series = _norm_series(100)
    for i in (3, 40, 41, 77):
        series[i] = [math.nan, math.inf, 0.0, 1e300][(i // 3) % 4]
    dev, host = ZClip(ZClipConfig(**kw)), ZClip(ZClipConfig(**kw), on_host=True)  # type: ignore[arg-type]
    for v in series:
        d = dev.compute(torch.tensor(v, dtype=torch.float64))
        h = host.compute(v)
        for a, b in zip(d, h, strict=True):
            assert float(a) == b or (math.isnan(float(a)) and math.isnan(float(b))), (v, d, h)
        dev.update(torch.tensor(v, dtype=torch.float64), d[0], d[1])
        host.update(v, h[0], h[1])
    for k, v in dev.state_dict()["state"].items():
        assert float(v) == float(host.state_dict()["state"][k]), k
    # a state saved on one kind loads into the other
    back = ZClip(on_host=False)
    back.load_state_dict(host.state_dict())
    assert float(back.mean) == host.mean  # type: ignore[arg-type]
