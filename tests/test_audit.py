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


def test_fp16_loss_scale_recommendation() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1))
    report = audit(model, [torch.randn(32, 16)], loss_fn=lambda m, b: m(b).mean() * 1e-7,
                   formats=("fp16", "bf16"), recipes={})  # fmt: skip
    rec = " ".join(report["1"].recommendation)
    assert "fp16 needs a loss scale >= 2^5 " in rec
    # Gradients so small that the scale they need is not an fp16 value itself
    tiny = audit(model, [torch.randn(32, 16)], loss_fn=lambda m, b: m(b).mean() * 1e-12,
                 formats=("fp16", "bf16"), recipes={})  # fmt: skip
    rec = " ".join(tiny["1"].recommendation)
    assert "loss scale of 2^21, beyond fp16's own range (2^15 is the largest" in rec
    assert "needs a loss scale >=" not in rec


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
