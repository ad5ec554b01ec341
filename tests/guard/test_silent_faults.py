"""What does not NaN: stalled 16-bit weights, a NaN buffer, causes stated only when seen,
the batch's identity, the end state (issue 36, items 1, 3, 4 and 5)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from floatguard import Guard, ResponsePolicy
from floatguard.guard.batch_id import fingerprint

pytestmark = pytest.mark.usefixtures("guard_sync")  # every test in both sync modes


def _mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).to(dtype)


def _train(guard: Guard, model: nn.Module, steps: int, dtype: torch.dtype, sched=None) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen).to(dtype)
        y = torch.randint(0, 10, (16,), generator=gen)
        guard.step(lambda x=x, y=y: F.cross_entropy(model(x).float(), y))


# 1. Weights that stop learning ---------------------------------------------------------
@pytest.mark.parametrize(("dtype", "lr"), [(torch.bfloat16, 1e-4), (torch.float16, 1e-5)])
def test_16_bit_weights_whose_updates_round_away_are_warned_about_once(
    dtype: torch.dtype, lr: float
) -> None:
    # fp16 keeps 3 more bits than bf16: at lr 1e-4 its linear weights lose ~65% of their
    # updates a step but most elements still move within 50 steps (no warning: they
    # learn, slowly); at 1e-5 most never move
    model = _mlp(dtype)
    frozen = model[2]
    frozen.requires_grad_(False)  # a frozen layer is never named
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=lr,
        eps=1e-4 if dtype == torch.float16 else 1e-8,  # (fp16: eps=1e-8 is 0, a NaN)
    )
    guard = Guard(model, opt)
    _train(guard, model, 60, dtype)
    warnings = guard.events.of_kind("warning")
    assert [(w.step, w["code"]) for w in warnings] == [(49, "stalled_updates")]
    ev = warnings[0]["evidence"]
    assert {x["name"] for x in ev["layers"]} == {"0.weight", "0.bias"}
    assert all(x["fraction"] >= 0.5 and x["dtype"] == str(dtype)[6:] for x in ev["layers"])
    assert ev["window"] == [9, 49] and ev["samples"] == 5
    assert all(ev["unmoved"][x["name"]] >= 0.5 for x in ev["layers"]) and ev["lr"] == pytest.approx(
        lr
    )
    assert "MasterWeights" in warnings[0]["message"]
    guard.close()


def test_the_lost_fraction_is_what_rounding_loses() -> None:
    # The reference: the same AdamW update in float64 from the same bf16 weights; an
    # element whose bf16 weight did not move although its float64 update is nonzero
    # lost it. The guard's sampled fraction for a layer of 2048 elements (all sampled)
    # is that count exactly.
    torch.manual_seed(0)
    model = nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    from floatguard.stability.stall import StallWatch

    watch = StallWatch(opt, {id(model.weight): "w"}, every=1, window=1, threshold=0.0)
    x = torch.randn(8, 64).to(torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    g = model.weight.grad
    assert g is not None
    w0 = model.weight.detach().double().clone()
    intended = w0 - 1e-3 * g.double()
    watch.before(1.0)
    opt.step()
    ev = watch.after(0)
    assert ev is not None
    nonzero = g != 0
    rounded_back = intended.to(torch.bfloat16).double() == w0
    expected = int((nonzero & rounded_back).sum()) / int(nonzero.sum())
    assert ev["layers"][0]["fraction"] == pytest.approx(expected, abs=1e-4)
    assert 0.0 < expected < 1.0


def test_no_stall_warning_with_fp32_weights_under_autocast_or_a_schedules_tail() -> None:
    model = _mlp()
    guard = Guard(model, torch.optim.AdamW(model.parameters(), lr=1e-4), precision="bf16")
    _train(guard, model, 60, torch.float32)
    assert not guard.events.of_kind("warning")
    guard.close()
    # bf16 weights at a sane LR decaying to 0 by cosine: the tail's tiny updates are
    # intended (the LR is below half its peak there), nothing is said
    model = _mlp(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=120)
    guard = Guard(model, opt, scheduler=sched)
    _train(guard, model, 120, torch.bfloat16)
    assert not [w for w in guard.events.of_kind("warning") if w["code"] == "stalled_updates"]
    guard.close()


# 3. A NaN in a buffer ------------------------------------------------------------------
def test_a_nan_buffer_is_a_fault_rolled_back_and_never_vouched_for() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(model, opt, response=ResponsePolicy(snapshot_every=5))
    gen = torch.Generator().manual_seed(0)
    got = []
    for step in range(14):
        if step == 7:
            with torch.no_grad():
                model[1].running_var[3] = math.nan  # training loss stays finite
        x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 1, generator=gen)
        r = guard.step(lambda x=x, y=y: F.mse_loss(model(x), y))
        got.append((r.action, r.reason))
    assert got[:10] == [("applied", None)] * 10
    assert got[10] == ("rolled_back", "nonfinite_buffer")  # the snapshot step's vetting
    assert got[11:] == [("applied", None)] * 3
    (fault,) = guard.events.of_kind("fault")
    assert (fault["module"], fault["tensor"], fault["op"]) == ("1", "buffer:running_var", "buffer")
    assert guard.events.of_kind("rollback")[0]["to_step"] == 5
    assert bool(model[1].running_var.isfinite().all())
    model.eval()
    assert bool(model(torch.randn(4, 8)).isfinite().all())
    guard.close()
    (end,) = guard.events.of_kind("end")
    assert end["state_finite"] is True and end["nonfinite"] == []


def test_a_run_that_ends_with_a_nan_buffer_says_so() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.05))
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for _ in range(3):
        guard.step(lambda: F.mse_loss(model(x), y))
    with torch.no_grad():
        model[1].running_mean[0] = math.nan
    guard.close()
    (end,) = guard.events.of_kind("end")
    assert end["state_finite"] is False and end["nonfinite"] == ["buffer:1.running_mean"]
    (w,) = guard.events.of_kind("warning")
    assert w["code"] == "nonfinite_buffer" and w["evidence"] == {"buffers": ["1.running_mean"]}


def test_an_inf_mask_buffer_is_data_not_a_fault() -> None:
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("mask", torch.triu(torch.full((4, 4), -math.inf), 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(self.fc(x)[:, None, :] + self.mask, -1).sum(1)

    torch.manual_seed(0)
    model = Masked()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(8, 4)
    for _ in range(12):
        assert guard.step(lambda: model(x).pow(2).mean()).action == "applied"
    guard.close()
    assert guard.events.of_kind("end")[0]["state_finite"] is True


# 4. Causes stated, never guessed -------------------------------------------------------
def _embedding_run(opt_name: str, write: str) -> tuple[Guard, list[tuple[str, str | None]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Flatten(), nn.Linear(16 * 4, 1))
    params = model.parameters()
    opt: torch.optim.Optimizer = (
        torch.optim.AdamW(params, lr=1e-3) if opt_name == "adamw" else torch.optim.SGD(params, 0.1)
    )
    guard = Guard(model, opt)
    gen = torch.Generator().manual_seed(0)
    got = []
    for step in range(8):
        if step == 5:
            with torch.no_grad():
                if write == "row":
                    model[0].weight[7] = math.nan  # a bad resize / callback / load
                else:
                    model[2].weight[0, 3] = 1e30  # an absurd magnitude from outside
        ids = torch.randint(0, 50, (8, 4), generator=gen)
        ids[0, 0] = 7
        y = torch.randn(8, 1, generator=gen)
        r = guard.step(lambda ids=ids, y=y: F.mse_loss(model(ids), y))
        got.append((r.action, r.reason))
    return guard, got


def test_a_nan_row_written_between_steps_is_not_blamed_on_the_optimizer() -> None:
    guard, got = _embedding_run("adamw", "row")
    assert got[5] == ("rolled_back", "nonfinite_param")
    (fault,) = guard.events.of_kind("fault")
    assert (fault["module"], fault["tensor"], fault["op"]) == ("0", "param:weight", "outside")
    assert fault["source"].startswith("non-finite since the last check at step ")
    assert "the last update could not have made it" in fault["source"]
    guard.close()
    # plain SGD keeps no state to verify with: both possibilities are named
    guard, got = _embedding_run("sgd", "row")
    assert got[5] == ("rolled_back", "nonfinite_param")
    (fault,) = guard.events.of_kind("fault")
    assert fault["op"] == "update_or_outside"
    assert fault["source"].endswith("written by the update or outside it")
    guard.close()


def test_an_absurd_weight_written_from_outside_is_not_the_update() -> None:
    guard, got = _embedding_run("adamw", "huge")
    assert got[5] == ("rolled_back", "nonfinite_param")
    (fault,) = guard.events.of_kind("fault")
    assert fault["op"] == "magnitude" and fault["kind_of_value"] == "huge"
    assert "the last update could not have made it" in fault["source"]
    guard.close()


def test_a_one_element_write_into_a_bf16_weight_is_not_the_update() -> None:
    model = _mlp(torch.bfloat16)
    guard = Guard(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        if step == 4:
            with torch.no_grad():
                model[0].weight[1, 2] = math.nan
        x = torch.randn(16, 32, generator=gen).to(torch.bfloat16)
        y = torch.randint(0, 10, (16,), generator=gen)
        guard.step(lambda x=x, y=y: F.cross_entropy(model(x).float(), y))
    (fault,) = guard.events.of_kind("fault")
    assert (fault["op"], fault["cause"]) == ("outside", "nonfinite_param")
    guard.close()


# 5. The batch's identity ---------------------------------------------------------------
def _reference_fingerprint(x: torch.Tensor) -> str:
    """SHA-256 over (dtype, shape, bytes) of the one positional input, as documented."""
    h = hashlib.sha256()
    h.update(f"{x.dtype}{tuple(x.shape)}".encode())
    h.update(x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def test_a_bad_batch_is_named_by_position_and_content() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.05))
    gen = torch.Generator().manual_seed(0)
    bad_x = None
    for step in range(10):
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
        if step == 6:
            x[2, 1] = math.nan
            bad_x = x
        guard.step(lambda x=x, y=y: F.mse_loss(model(x), y))
    (fault,) = guard.events.of_kind("fault")
    assert bad_x is not None
    assert fault["batch"] == {
        "position": 6,
        "micro_batches": 1,
        "fingerprint": _reference_fingerprint(bad_x),
        "shapes": [[8, 4]],
    }
    assert fingerprint([((bad_x.clone(),), {})])[0] == fault["batch"]["fingerprint"]
    guard.close()


# 2 and 5. Slow divergence, and a bad batch, through the guard ------------------------
def _blobs(
    seed: int, steps: int, lr_at: Callable[[int], float], noise: Callable[[int], float]
) -> Guard:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(10, 20, generator=g)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=lr_at(0), weight_decay=0.01)
    guard = Guard(model, opt)
    for s in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(s)
        y = torch.randint(0, 10, (64,), generator=g)
        x = centers[y] + 0.7 * torch.randn(64, 20, generator=g)
        flip = torch.rand(64, generator=g) < noise(s)
        y = torch.where(flip, torch.randint(0, 10, (64,), generator=g), y)
        guard.step(lambda x=x, y=y: F.cross_entropy(model(x), y))
    guard.close()
    return guard


def _trend_warnings(guard: Guard) -> list[tuple[int, str]]:
    return [
        (w.step, w["code"])
        for w in guard.events.of_kind("warning")
        if w["code"] in ("loss_trend", "grad_norm_trend")
    ]


def test_label_noise_growing_is_a_loss_trend_warning_and_a_clean_run_has_none() -> None:
    clean = _blobs(0, 300, lambda s: 1e-3, lambda s: 0.0)
    assert _trend_warnings(clean) == []
    noisy = _blobs(0, 300, lambda s: 1e-3, lambda s: 0.6 * s / 300)
    got = _trend_warnings(noisy)
    assert got and got[0][1] == "loss_trend"
    ev = next(w for w in noisy.events.of_kind("warning") if w["code"] == "loss_trend")
    assert ev["evidence"]["ratio"] >= 1.5
    # a warning only: every step was applied
    assert {e["action"] for e in noisy.events.of_kind("step")} == {"applied"}


def test_an_lr_x40_from_step_60_is_a_trend_warning_that_names_the_change() -> None:
    guard = _blobs(0, 300, lambda s: 1e-3 if s < 60 else 4e-2, lambda s: 0.0)
    got = _trend_warnings(guard)
    assert got, [w["message"] for w in guard.events.of_kind("warning")]
    w = next(w for w in guard.events.of_kind("warning") if w["code"] == "loss_trend")
    assert "lr" in w["message"].lower()


def test_the_trend_watch_goes_through_the_guards_state_dict() -> None:
    noisy = _blobs(0, 120, lambda s: 1e-3, lambda s: 0.0)
    sd = noisy.state_dict()
    assert sd["trend"] == noisy._c.trend.state_dict()  # (the test reads the guard's part)
    model = nn.Linear(20, 10)
    other = Guard(model, torch.optim.AdamW(model.parameters()))
    other.load_state_dict(sd)
    assert other.state_dict()["trend"] == sd["trend"]
    other.close()


def test_a_group_frozen_by_lr_0_is_not_a_stall() -> None:
    model = _mlp(torch.bfloat16)
    opt = torch.optim.AdamW(
        [
            {"params": model[0].parameters(), "lr": 0.0},  # frozen by its LR
            {"params": model[2].parameters(), "lr": 2e-2},
        ]
    )
    guard = Guard(model, opt)
    _train(guard, model, 60, torch.bfloat16)
    assert not [w for w in guard.events.of_kind("warning") if w["code"] == "stalled_updates"]
    guard.close()
