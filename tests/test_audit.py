"""Precision-readiness audit: structure, numbers against direct quantization, recommendations."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from floatguard import audit
from floatguard.formats import quantize


class OutlierNet(nn.Module):
    """fc2 receives activations with outlier channels spread over decades (as the lesson's
    question 1); fc1 sees ordinary data."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(256, 256)
        self.fc2 = nn.Linear(256, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        g = torch.Generator().manual_seed(1)
        spread = 10 ** (torch.rand(h.shape, generator=g) * 5 - 5)
        h = h.sign() * spread
        h = h * torch.where(torch.arange(256) < 1, 100.0, 1.0)
        return self.fc2(h)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(64, 256, generator=g) for _ in range(2)]


def test_audit_numbers_and_recommendations() -> None:
    torch.manual_seed(0)
    model = OutlierNet()
    report = audit(model, batches())
    assert [la.layer for la in report.layers] == ["fc1", "fc2"]
    fc2 = report["fc2"]
    act = fc2.results["activation"]
    # amax against the activations themselves
    with torch.no_grad():
        hs = []
        model.fc2.register_forward_hook(lambda m, a, o: hs.append(a[0]))
        for b in batches():
            model(b)
    h = torch.cat(hs)
    assert act["amax"] == pytest.approx(float(h.abs().max()), rel=1e-6)
    under = float(((quantize(h, "fp16") == 0) & (h != 0)).float().mean())
    assert act["format:fp16"]["underflow"] == pytest.approx(under, abs=1e-6)
    assert act["recipe:e4m3 tensorwise"]["underflow"] > 0.2
    assert act["recipe:e4m3 block 1x128"]["underflow"] < 0.02
    text = " ".join(fc2.recommendation)
    assert "use block scaling" in text and "bf16" in text
    assert "tensor-wise is enough" in " ".join(report["fc1"].recommendation)
    assert all(k in fc2.results for k in ("activation", "weight", "gradient"))
    assert all(p.grad is None for p in model.parameters())  # gradients left as they were
    json.dumps(report.to_dict(), default=lambda v: None if not math.isfinite(v) else v)


# Loss-scale advice, from gradients set exactly: a bias-free Linear(1, n) fed x, with the
# loss sum(out * c), gets c as its output gradient and x * c as its weight gradient.
# (c, x, fp16 loss, the advice). 1.5 * 2^-e keeps clear of fp16's ties at 2^-25.
_EPS = 1.5 * 2.0**-30  # 1.4e-09: k = 5 (2^4 x it is below 2^-25, rounds to zero)
_EPS42 = 1.5 * 2.0**-42  # 3.41e-13: k = 17
_EPS50 = 1.5 * 2.0**-50  # 1.33e-15: k = 25
LOSS_SCALE_CASES = [
    pytest.param(
        [_EPS] * 4 + [2.0**-4] * 4, 1.0, False,
        "fp16 needs a loss scale from 2^5 to 2^19 (50% of gradients underflow unscaled): "
        "use 2^19, the largest that keeps the largest gradient (0.0625) below fp16's max "
        "65504, 2^5 is the least that keeps the smallest (1.4e-09) from rounding to zero, "
        "with the loss in float32 as autocast's loss ops give it (an fp16 loss's own "
        "gradient is the scale: 2^15 at most)",
        id="autocast-beyond-2^15",
    ),
    pytest.param(
        [_EPS] * 4 + [2.0**-4] * 4, 4.0, False,
        "fp16 needs a loss scale from 2^5 to 2^17 (50% of gradients underflow unscaled): "
        "use 2^17, the largest that keeps the largest gradient (0.25, a parameter's) below "
        "fp16's max 65504, 2^5 is the least that keeps the smallest (1.4e-09) from rounding "
        "to zero, with the loss in float32 as autocast's loss ops give it (an fp16 loss's "
        "own gradient is the scale: 2^15 at most)",
        id="weight-gradient-bounds",
    ),
    pytest.param(
        [_EPS] * 4 + [1.0] * 4, 1.0, False,
        "fp16 needs a loss scale from 2^5 to 2^15 (50% of gradients underflow unscaled): "
        "use 2^15, the largest that keeps the largest gradient (1) below fp16's max 65504, "
        "2^5 is the least that keeps the smallest (1.4e-09) from rounding to zero",
        id="gradient-bounds-at-2^15",
    ),
    pytest.param(
        [_EPS] * 4 + [2.0**-4] * 4, 1.0, True,
        "fp16 needs a loss scale from 2^5 to 2^15 (50% of gradients underflow unscaled): "
        "use 2^15, the most an fp16 loss takes (its own gradient is the scale, fp16's max "
        "65504), 2^5 is the least that keeps the smallest (1.4e-09) from rounding to zero",
        id="fp16-loss",
    ),
    pytest.param(
        [_EPS42] * 4 + [2.0**-4] * 4, 1.0, False,
        "fp16 needs a loss scale from 2^17 to 2^19 (50% of gradients underflow unscaled): "
        "use 2^19, the largest that keeps the largest gradient (0.0625) below fp16's max "
        "65504, 2^17 is the least that keeps the smallest (3.41e-13) from rounding to zero, "
        "with the loss in float32 as autocast's loss ops give it (an fp16 loss's own "
        "gradient is the scale: 2^15 at most)",
        id="autocast-needs-2^17",
    ),
    pytest.param(
        [_EPS42] * 4 + [2.0**-4] * 4, 1.0, True,
        "fp16 gradients need a loss scale of 2^17 or more (50% of gradients underflow "
        "unscaled), beyond the 2^15 an fp16 loss takes (its own gradient is the scale, and "
        "fp16's max is 65504): compute the loss in float32 (loss.float() before its final "
        "sum or mean) and use 2^19, the largest that keeps the largest gradient (0.0625) "
        "below fp16's max 65504, 2^17 is the least that keeps the smallest (3.41e-13) from "
        "rounding to zero",
        id="fp16-loss-needs-2^17",
    ),
    pytest.param(
        [_EPS50] * 2 + [_EPS] * 2 + [1.0] * 4, 1.0, False,
        "fp16 gradients span more than its range (50% of gradients underflow unscaled): "
        "2^25 is the least that keeps the smallest (1.33e-15) from rounding to zero, but "
        "above 2^15 the largest gradient (1) passes fp16's max 65504; at 2^15, 25% still "
        "underflow: keep bf16",
        id="span",
    ),
    pytest.param(
        [_EPS50] + [_EPS] * 10 + [1.0] * 1989, 1.0, False,
        "fp16 needs a loss scale of 2^15 (0.55% of gradients underflow unscaled): use 2^15, "
        "the largest that keeps the largest gradient (1) below fp16's max 65504, where 0.05% "
        "still underflow (the smallest, 1.33e-15, needs 2^25)",
        id="a-few-flush-at-the-best-scale",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("c", "x", "fp16_loss", "advice"), LOSS_SCALE_CASES)
def test_fp16_loss_scale_advice(c: list[float], x: float, fp16_loss: bool, advice: str) -> None:
    model = nn.Linear(1, len(c), bias=False)
    grad = torch.tensor(c)

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        loss = (m(b) * grad).sum()
        return loss.half() if fp16_loss else loss

    report = audit(model, [torch.full((1, 1), x)], loss_fn=loss_fn,
                   formats=("fp16", "bf16"), recipes={})  # fmt: skip
    (layer,) = report.layers  # the model itself, named ""
    assert layer.recommendation == ["bf16 safe", advice]
    assert layer.results["gradient"]["param_grad_amax"] == x * max(c)


def test_fp16_loss_scale_window_against_casts() -> None:
    """The window of the first case, by casting the scaled gradients to fp16 (the
    reference): 2^5 keeps every one, 2^4 flushes the smallest, 2^19 keeps the largest
    finite, 2^20 overflows it."""
    c = torch.tensor([_EPS] * 4 + [2.0**-4] * 4)
    half = [(c * 2.0**s).half() for s in (4, 5, 19, 20)]
    assert [int((h == 0).sum()) for h in half] == [4, 0, 0, 0]
    assert [int(h.isinf().sum()) for h in half] == [0, 0, 0, 4]


def test_an_fp16_loss_takes_2_to_the_15_at_most() -> None:
    """What the advice says of an fp16 loss (``model.half()``, or ``out.mean()`` of an
    fp16 output under autocast): its own gradient is the scale, an fp16 value. GradScaler's
    float32 scale on it, 2^16, makes the gradients inf; on a float32 loss it does not."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 2).half()
    x = torch.randn(3, 4).half()
    for log2_scale, inf in ((16, True), (15, False)):
        lin.zero_grad()
        loss = lin(x).mean()
        assert loss.dtype == torch.float16
        (loss * torch.tensor(2.0**log2_scale)).backward()
        assert lin.weight.grad is not None
        assert bool(lin.weight.grad.isinf().any()) is inf, log2_scale
    lin.zero_grad()
    (lin(x).float().mean() * torch.tensor(2.0**16)).backward()  # the loss in float32
    assert lin.weight.grad is not None and bool(lin.weight.grad.isfinite().all())


def test_audit_errors() -> None:
    with pytest.raises(ValueError, match="no module of types"):
        audit(nn.ReLU(), [torch.ones(2)])
    with pytest.raises(ValueError, match="unknown format"):
        audit(nn.Linear(2, 2), [torch.ones(2)], formats=("fp9",))


class _Conv1D(nn.Module):
    """transformers' Conv1D as GPT-2 uses it: weight (in, out), y = x @ W + b."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


_Conv1D.__name__ = "Conv1D"


class _Out:
    """A Hugging Face-style output: .logits (and .loss when labels are given)."""

    def __init__(self, logits: torch.Tensor, loss: torch.Tensor | None) -> None:
        self.logits, self.loss = logits, loss


class _HFish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = _Conv1D(32, 16)
        self.up_proj = nn.Linear(32, 8)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> _Out:
        h = self.up_proj(torch.tanh(self.c_fc(input_ids)))
        loss = ((h - labels) ** 2).mean() if labels is not None else None
        return _Out(h, loss)


def test_audit_sees_forward_overflow_conv1d_and_hf_outputs() -> None:
    torch.manual_seed(0)
    model = _HFish()
    with torch.no_grad():
        model.up_proj.weight.mul_(3e5)  # its fp32 output peaks past fp16's 65504
    batches = [{"input_ids": torch.randn(4, 16) * 50, "labels": torch.randn(4, 8)}]
    report = audit(model, batches)  # the default loss takes the output's .loss
    layers = {la.layer: la for la in report.layers}
    assert set(layers) == {"c_fc", "up_proj"}  # Conv1D covered
    up = layers["up_proj"]
    assert up.results["output"]["format:fp16"]["overflow"] > 0
    assert any(r.startswith("fp16 overflows") and "in the output" in r for r in up.recommendation)
    assert all("e+" not in r for la in report.layers for r in la.recommendation)  # no 1e+02%
    logits_only = [{"input_ids": torch.randn(4, 16)}]  # no labels: the mean of .logits
    assert audit(model, logits_only).layers


def test_loss_fn_is_called_with_the_model_and_one_batch() -> None:
    """audit's convention: loss_fn(model, batch) -> loss, with each element of batches as
    given; a criterion(output, target) is refused with the wrapper to use."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    batches = [(torch.randn(6, 4), torch.randn(6, 1)) for _ in range(2)]
    seen: list[tuple[nn.Module, object]] = []

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        seen.append((m, batch))
        x, y = batch
        return nn.functional.mse_loss(m(x), y)

    assert audit(model, batches, loss_fn=loss_fn).layers
    assert [m for m, _ in seen] == [model, model]
    assert all(b is given for (_, b), given in zip(seen, batches, strict=True))
    criterion = nn.MSELoss()
    wrapped = audit(model, batches, loss_fn=lambda m, b: criterion(m(b[0]), b[1]))
    assert [la.layer for la in wrapped.layers] == ["0", "1"]
    fix = r"loss_fn=lambda model, batch: criterion\(model\(batch\[0\]\), batch\[1\]\)"
    with pytest.raises(TypeError, match=r"MSELoss\(\) is a criterion\(output, target\).*" + fix):
        audit(model, batches, loss_fn=criterion)
    with pytest.raises(TypeError, match=r"loss_fn\(model, batch\) raised TypeError: .*criterion"):
        audit(model, batches, loss_fn=nn.functional.cross_entropy)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"returned float; it must return the loss"):
        audit(model, batches, loss_fn=lambda m, b: 1.0)  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="must be callable"):
        audit(model, batches, loss_fn="mse")  # type: ignore[arg-type]
    assert all(p.grad is None for p in model.parameters())  # a failed audit leaves no grads


def test_a_model_that_computes_nan_is_not_called_safe() -> None:
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(float("nan"))
    report = audit(model, [torch.randn(8, 4)])
    (layer,) = report.layers
    assert len(layer.recommendation) == 1
    rec = layer.recommendation[0]
    assert rec.startswith("non-finite values in ") and "no format can be judged" in rec
    assert "safe" not in rec
