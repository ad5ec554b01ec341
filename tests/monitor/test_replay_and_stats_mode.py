"""Op-level replay, stats mode and the lessons' per-module alerts."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from floatguard import Monitor, replay

from .test_faults import Lambda, NaNBackward


def test_replay_finds_the_forward_op_and_line() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Lambda(lambda x: torch.log(x - 100)), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    r = replay(lambda: model(x).sum().backward(), repeat=2)
    assert r is not None
    assert r.op == "aten.log.default" and r.phase == "forward" and r.kind == "nan"
    assert r.source is not None and "torch.log(x - 100)" in r.source and "test_replay" in r.source
    assert r.deterministic is True
    assert int(r.inputs[0].nan) == 0 and int(r.outputs[0].nan) > 0


def test_replay_finds_a_backward_only_fault() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Lambda(NaNBackward.apply), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    r = replay(lambda: model(x).sum().backward())
    assert r is not None and r.phase == "backward" and r.op.startswith("aten.mul")
    # the custom Function's own backward line, in the module whose call made its node
    assert r.source is not None and 'return g * float("nan")' in r.source
    assert (r.module, r.tensor) == ("1", "grad")


def test_replay_on_a_clean_step_and_masks() -> None:
    model = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[:, -1] = True  # -inf fills are intended, not faults
    assert replay(lambda: model(x, x, x, key_padding_mask=mask)[0].sum().backward()) is None


def test_replay_says_when_a_fault_is_not_deterministic() -> None:
    calls = {"n": 0}

    def flaky() -> None:
        calls["n"] += 1
        x = torch.ones(3, requires_grad=True)
        y = torch.log(x - 2) if calls["n"] % 2 else torch.sqrt(x - 2)
        y.sum().backward()

    r = replay(flaky, repeat=2)
    assert r is not None and r.deterministic is False
    assert r.op == "aten.log.default"


def test_stats_mode_every_k_and_alerts() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    mon = Monitor(model, mode="stats", every=2).attach()
    x = torch.randn(3, 4)
    model(x).sum().backward()
    st = mon.stats
    assert (
        ("0", "output[0]") in st
        and ("2", "param:weight") in st
        and ("0", "grad_input[0]") not in st
    )
    assert ("1", "grad_output[0]") in st and int(st[("0", "output[0]")].numel) == 12
    # a parameter and its gradient are kept apart
    w = model[2].weight
    assert w.grad is not None
    assert float(st[("2", "param:weight")].amax) == float(w.detach().abs().max())
    assert float(st[("2", "param:weight.grad")].amax) == float(w.grad.abs().max())
    assert int(st[("2", "param:weight")].numel) == int(st[("2", "param:weight.grad")].numel) == 8
    model(x).sum().backward()  # step 1: no stats
    assert mon.step == 1 and mon.stats == {}
    x_bad = x.clone()
    x_bad[0, 0] = float("nan")
    model(x_bad).sum().backward()  # step 2: stats again
    assert mon.step == 2 and mon.stats
    alerts = mon.alerts
    first = alerts[0]
    assert (first.module, first.tensor, first.shape, first.has_nan, first.has_inf) == (
        "",
        "input[0]",
        (3, 4),
        True,
        False,
    )
    assert first.min is not None and first.max is not None and first.min <= first.max
    f = mon.first_nonfinite
    assert f is not None and f.stats is not None and int(f.stats.nan) == 1
    mon.detach()


def test_sentinel_alerts_have_flags_without_extremes() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Lambda(lambda x: x * float("inf")))
    with Monitor(model) as mon:
        model(torch.randn(2, 4))
    a = mon.alerts[0]
    assert a.module == "1" and a.tensor == "output[0]" and a.shape == (2, 4)
    assert a.min is None and (a.has_nan or a.has_inf)


def test_replay_judges_an_in_place_op_by_its_inputs_before_it_ran() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)

    def step() -> None:
        h = lin(torch.randn(2, 4)) * 1
        h.div_(h * 0)  # finite / 0 -> inf, written over its own input
        h.sum().backward()

    r = replay(step)
    assert r is not None
    # after the model (the Linear) returned: the loss code
    assert (r.op, r.phase, r.kind) == ("aten.div_.Tensor", "loss", "inf")
    assert r.source is not None and "h.div_(h * 0)" in r.source
    assert int(r.inputs[0].posinf) == 0 and int(r.outputs[0].posinf) > 0


def test_replay_finds_the_nan_of_a_fully_masked_attention_row() -> None:
    """The -inf fill is intended; the softmax that turns a row of -inf into NaN is not."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1] = True
    r = replay(lambda: mha(x, x, x, key_padding_mask=mask)[0].sum().backward())
    assert r is not None and r.phase == "forward" and r.kind == "nan"
    assert "softmax" in r.op
    assert int(r.inputs[0].neginf) > 0 and int(r.inputs[0].nan) == 0


def test_replay_does_not_read_out_buffers_as_inputs() -> None:
    def step() -> None:
        a = torch.tensor([1.0, 100.0, -3.0])
        o = torch.full((3,), float("inf"))  # stale buffer content is not an input
        torch.exp(a * 10, out=o)

    r = replay(step)
    assert r is not None and (r.op, r.kind) == ("aten.exp.out", "inf")


def test_replay_reads_sparse_gradients_as_the_tensor_they_stand_for() -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)

    def step(idx: torch.Tensor) -> None:
        (emb(idx) * 1).sum().backward(torch.tensor(3e38))

    assert replay(lambda: step(torch.tensor([1, 2, 3]))) is None
    r = replay(lambda: step(torch.tensor([1, 2, 1])))  # the two rows of token 1 sum to inf
    assert r is not None and r.phase == "backward" and r.kind == "inf"
    assert "sparse" in r.op  # the op that assembles the rows into one sparse tensor


def test_replay_keeps_what_it_found_when_the_step_raises() -> None:
    def step() -> None:
        loss = torch.log(torch.zeros(3) - 1).sum()
        if not torch.isfinite(loss):
            raise FloatingPointError("loss is nan")

    with pytest.warns(RuntimeWarning, match="FloatingPointError"):
        r = replay(step)
    assert r is not None and r.op == "aten.log.default"

    def broken() -> None:
        raise KeyError("unrelated")

    with pytest.raises(KeyError):
        replay(broken)


def test_format_fit_matches_casting_with_ml_dtypes() -> None:
    """The fractions come from the stats alone; the reference casts every value with
    ml_dtypes. Values are 1.25 * 2**k over the whole float32 range, skipping the two
    binades the histogram cannot split (each format's top binade, and the one just
    below its smallest subnormal)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import numpy as np

    from floatguard.formats import get as get_format

    names = ("fp16", "bf16", "e4m3fn", "e5m2")
    fmts = [get_format(n) for n in names]
    skip = {f.emax for f in fmts} | {f.emin - f.mantissa_bits - 2 for f in fmts}
    ks = [k for k in range(-147, 128) if k not in skip]
    vals = torch.tensor([s * 1.25 * 2.0**k for k in ks for s in (1, -1)], dtype=torch.float32)
    model = nn.Sequential(nn.Identity(), Lambda(lambda x: x * 1.0))
    with Monitor(model, mode="stats", formats=names) as mon:
        model(vals)
    fit = mon.format_fit()[("1", "output[0]")]
    ref_types = {
        "fp16": np.float16,
        "bf16": ml_dtypes.bfloat16,
        "e4m3fn": ml_dtypes.float8_e4m3fn,
        "e5m2": ml_dtypes.float8_e5m2,
    }
    x = vals.numpy()
    for f in fmts:
        with np.errstate(over="ignore"):  # overflowing is what is being counted
            cast = x.astype(ref_types[f.name]).astype(np.float64)
        smallest_normal = 2.0**f.emin
        want = {
            "overflow": float(np.mean(~np.isfinite(cast))),
            "underflow": float(np.mean((cast == 0) & (x != 0))),
            "subnormal": float(np.mean((cast != 0) & (np.abs(cast) < smallest_normal))),
        }
        got = {k: fit[f.name][k] for k in want}
        assert got == pytest.approx(want), f.name
        assert fit[f.name]["scale"] == pytest.approx(f.max / float(vals.abs().max()))
        assert fit[f.name]["scale_pow2"] <= fit[f.name]["scale"] < 2 * fit[f.name]["scale_pow2"]
    # sentinel mode keeps no stats
    with Monitor(model) as mon:
        model(vals)
    assert mon.format_fit() == {}


def test_formats_may_be_one_name() -> None:
    assert Monitor(nn.Linear(2, 2), formats="e4m3fn").formats == ("e4m3fn",)
    with pytest.raises(ValueError, match="bogus"):
        Monitor(nn.Linear(2, 2), formats=("fp16", "bogus"))


def test_sampled_statistics_hook_only_the_sampled_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stats every k steps: on the other steps only the model's own two hooks run; the
    modules' hooks are registered on sampled steps and removed after them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    registered: list[int] = []
    original = nn.Module.register_forward_pre_hook

    def counting(self: nn.Module, *a: object, **k: object) -> object:
        registered.append(mon_step())
        return original(self, *a, **k)  # type: ignore[arg-type]

    mon = Monitor(model, mode="stats", every=3)
    mon_step = lambda: mon.step  # noqa: E731
    monkeypatch.setattr(nn.Module, "register_forward_pre_hook", counting)
    mon.attach()
    x = torch.randn(3, 4)
    seen = []
    for _ in range(7):
        model(x).sum().backward()
        seen.append((mon.step, bool(mon.stats)))
    assert seen == [(i, i % 3 == 0) for i in range(7)]
    # the root's pre-hook once at attach; the three children's on steps 0, 3 and 6
    assert registered == [0] + [0] * 3 + [3] * 3 + [6] * 3
    bad = x.clone()
    bad[0, 0] = float("nan")
    model(bad).sum().backward()  # step 7: not sampled, nothing recorded
    assert mon.step == 7 and mon.first_nonfinite is None
    model(bad).sum().backward()  # step 8: not sampled
    model(bad).sum().backward()  # step 9: sampled, the NaN input is found
    f = mon.first_nonfinite
    assert mon.step == 9 and f is not None and (f.phase, f.tensor) == ("input", "input[0]")
    mon.detach()


def test_a_nan_fill_is_a_fault_an_inf_fill_is_a_mask() -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def step(fill: float) -> torch.Tensor:
        h = lin(x)
        masked = h.masked_fill(torch.tensor([True, False, False, False]), fill)
        loss = torch.logsumexp(masked, -1).sum() if fill < 0 else masked.sum()
        loss.backward()
        return loss

    assert replay(lambda: step(-math.inf)) is None  # a -inf mask: data
    r = replay(lambda: step(math.nan))
    assert r is not None and (r.op, r.kind, r.phase) == ("aten.masked_fill.Scalar", "nan", "loss")
