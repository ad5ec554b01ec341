"""What the duplication had broken: the user's scaler, ``norm_type``, one LR back-off,
one stop report."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from floatguard import ClipPolicy, DynamicLossScaler, Guard, GuardStopped, ResponsePolicy

pytestmark = pytest.mark.usefixtures("guard_sync")  # every test in both sync modes


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def test_the_users_scaler_is_never_changed_and_a_mismatch_is_refused() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=4.0)
    with pytest.raises(ValueError, match=r"precision=.bf16. needs none"):
        Guard(model, opt, precision="bf16", scaler=scaler)
    assert scaler.enabled and scaler.get_scale() == 4.0  # untouched by the refusal
    off = DynamicLossScaler(enabled=False)
    guard = Guard(model, opt, precision="bf16", scaler=off)
    assert guard.scaler is off and not off.enabled
    guard.close()


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_norm_type_is_the_norm_measured_and_clipped_on(norm_type: float) -> None:
    model = _model()
    ref = _model()
    x, y = torch.randn(16, 4), torch.randn(16, 2) * 10
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, opt, clip=ClipPolicy(kind="norm", max_norm=0.5, norm_type=norm_type),
                  spikes=None)  # fmt: skip
    r = guard.step(lambda: F.mse_loss(model(x), y))
    F.mse_loss(ref(x), y).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, norm_type=norm_type)
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    assert r.action == "applied"
    assert r.grad_norm == pytest.approx(float(want), rel=1e-6)
    assert r.clip_coef == pytest.approx(min(1.0, 0.5 / (float(want) + 1e-6)), rel=1e-6)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    guard.close()


def test_norm_type_is_validated() -> None:
    with pytest.raises(ValueError, match=r"norm_type=0\.5"):
        ClipPolicy(norm_type=0.5)


def test_one_lr_back_off_path_multiplies_and_logs_on_the_ladder_and_the_rollback() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, opt, response=ResponsePolicy(lr_backoff_after=2, rollback_after=3))
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    guard.step(lambda: F.mse_loss(model(x), y))
    bad = lambda: F.mse_loss(model(x), y) * torch.log(torch.tensor(-1.0))  # noqa: E731
    actions = [guard.step(bad).action for _ in range(3)]
    assert actions == ["skipped", "skipped", "rolled_back"]
    factors = [e["factor"] for e in guard.events.of_kind("lr_backoff")]
    assert factors == [0.5, 0.25]  # the rollback's back-off is the same multiply, logged
    assert guard.lr_factor == 0.25
    guard.close()


def test_one_stop_report_counts_every_event_written(tmp_path: object) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, opt, response=ResponsePolicy(rollback_after=1, max_rollbacks=1))
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    guard.step(lambda: F.mse_loss(model(x), y))
    bad = lambda: F.mse_loss(model(x), y) * torch.log(torch.tensor(-1.0))  # noqa: E731
    with pytest.raises(GuardStopped) as stopped:
        for _ in range(3):
            guard.step(bad)
    report = stopped.value.report
    assert report["reason"] == "repeated_fault"
    assert report["events"] == sum(guard.events.counts.values())
    assert guard.events.of_kind("stop")[-1]["reason"] == "repeated_fault"
    guard.close()


def test_a_step_that_raised_leaves_the_rng_where_the_step_began() -> None:
    """A retried step with dropout draws what an uninterrupted run draws (issue 23)."""

    def run(fail_at: int | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        guard = Guard(model, opt)
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        failed = False
        for i in range(4):

            def closure(i: int = i) -> torch.Tensor:
                nonlocal failed
                loss = torch.nn.functional.mse_loss(model(x), y)  # draws the dropout mask
                if i == fail_at and not failed:
                    failed = True
                    raise RuntimeError("a data-loader hiccup after the forward")
                return loss

            try:
                guard.step(closure)
            except RuntimeError:
                guard.step(closure)  # the retry
        guard.close()
        return [p.detach().clone() for p in model.parameters()]

    clean, retried = run(None), run(2)
    assert all(torch.equal(a, b) for a, b in zip(clean, retried, strict=True))


def test_a_loss_without_a_graph_is_one_clear_error_and_the_step_did_not_happen() -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, opt)
    with pytest.raises(ValueError, match="the loss has no gradient graph"):
        guard.step(lambda: torch.tensor(float("nan")))
    assert guard.step_count == 0
    guard.close()
