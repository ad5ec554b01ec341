"""``replay()`` on a clean step returns None: a non-finite value that harms nothing
is not a fault.

A clean step has a finite loss and finite gradients. The guard only replays bad
steps; the public ``replay()`` may be called on any step, and must not report the
intended infinities of a healthy model (T5's ``log(0)`` in its relative-position
bucketing, on every step) as its fault. Each test first shows, with the guard's own
``run_localized`` (which does not judge the step), that the harmless value is there.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from floatguard import replay
from floatguard.monitor.replay import run_localized

X = torch.randn(4, 8)
Y = torch.randn(4, 3)


@pytest.fixture
def t5(monkeypatch: pytest.MonkeyPatch) -> nn.Module:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1,
        num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model: nn.Module = transformers.T5Model(config)
    return model


IDS = torch.randint(1, 32, (2, 7), generator=torch.Generator().manual_seed(0))


def _t5_step(model: nn.Module, *, returns_loss: bool = True) -> torch.Tensor | None:
    model.zero_grad(set_to_none=True)
    h = model(input_ids=IDS, decoder_input_ids=IDS).last_hidden_state
    loss = h.pow(2).mean()
    loss.backward()
    return loss if returns_loss else None


def test_t5_intended_log_zero_is_there_but_a_clean_step_is_no_fault(t5: nn.Module) -> None:
    seen = run_localized(lambda: _t5_step(t5), model=t5)
    assert seen is not None  # the bucketing's log(0): -inf, masked away by a where
    assert (seen.op, seen.kind, seen.phase) == ("aten.log.default", "inf", "forward")
    assert seen.module == "encoder.block.0.layer.0.SelfAttention"
    assert seen.source is not None and "modeling_t5.py" in seen.source
    assert replay(lambda: _t5_step(t5)) is None
    assert replay(lambda: _t5_step(t5, returns_loss=False)) is None  # the loss found by itself
    assert replay(lambda: _t5_step(t5), repeat=2) is None


def test_t5_real_fault_is_still_found(t5: nn.Module) -> None:
    ff = t5.get_submodule("encoder.block.0.layer.1.DenseReluDense.wo")
    assert isinstance(ff, nn.Linear)
    with torch.no_grad():
        ff.weight.fill_(3e38)  # finite, but its products sum past float32's range
    r = replay(lambda: _t5_step(t5))
    assert r is not None  # the -inf of the bucketing came first, and is passed over
    assert (r.op, r.kind, r.phase) == ("aten.mm.default", "inf", "forward")
    assert r.module == "encoder.block.0.layer.1.DenseReluDense.wo"


class LogOfZeroMasked(nn.Module):
    """A log-space term whose ``log(0)`` is masked away (or, when broken, is not)."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logz = torch.log(torch.zeros(h.shape))  # -inf everywhere: intended
        if self.broken:
            return h + logz  # LOG REACHES THE LOSS
        return h + torch.where(torch.isinf(logz), torch.zeros(h.shape), logz)


def _net() -> tuple[nn.Sequential, LogOfZeroMasked]:
    torch.manual_seed(0)
    inner = LogOfZeroMasked()  # last: when broken, its -inf is the output itself
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3), inner), inner


def _step(model: nn.Module, x: torch.Tensor = X) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), Y)
    loss.backward()
    return loss


def test_a_masked_log_of_zero_on_a_clean_step_is_no_fault() -> None:
    model, _ = _net()
    seen = run_localized(lambda: _step(model), model=model)
    assert seen is not None and (seen.op, seen.kind, seen.module) == (
        "aten.log.default",
        "inf",
        "3",
    )
    assert replay(lambda: _step(model)) is None
    assert replay(lambda: _step(model), model=model) is None


def test_a_log_of_zero_that_reaches_the_loss_is_the_fault() -> None:
    model, inner = _net()
    inner.broken = True
    r = replay(lambda: _step(model))
    assert r is not None and (r.op, r.kind, r.phase, r.module) == (
        "aten.log.default",
        "inf",
        "forward",
        "3",
    )


def test_a_real_nan_on_the_same_model_is_still_the_fault() -> None:
    model, _ = _net()
    bad = X.clone()
    bad[0, 0] = math.nan
    r = replay(lambda: _step(model, bad))
    assert r is not None and (r.phase, r.op, r.tensor, r.kind) == (
        "input",
        "input",
        "input[0]",
        "nan",
    )


class SqrtWhere(nn.Module):
    """The ``where`` gradient trap: the masked sqrt's NaN stays out of the loss but
    its backward makes the gradients NaN: a finite loss is not a clean step."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.where(h > 0, torch.sqrt(h), torch.zeros_like(h))


def test_a_finite_loss_with_nan_gradients_is_not_clean() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), SqrtWhere(), nn.Linear(8, 3))
    loss = _step(model)
    assert math.isfinite(loss.item())
    first = model[0].weight.grad
    assert first is not None and bool(first.isnan().any())
    r = replay(lambda: _step(model))
    # the forward's NaN, consumed by sqrt's backward, is what harmed the gradients
    assert r is not None
    assert (r.op, r.phase, r.module, r.kind) == ("aten.sqrt.default", "forward", "1", "nan")
