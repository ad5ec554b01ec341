"""Stats mode on clean models with causal ``-inf`` masks: no false fault (issue 36, item 10).

The one-pass stats kernel reads ``numel()`` values from a tensor's flat memory. The
gradient a ``.sum()`` / ``.mean()`` loss sends into the model is a scalar expanded to
the output's shape (stride 0), and a strided slice flattens to a stride-k view: both
were read past their values (made-up NaN / +inf), and stats mode's verdict, taken from
the same read, named ``<root> (loss, grad_output[0])`` on clean steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import pytest
import torch
from torch import nn

from floatguard import Monitor, replay

Mode = Literal["sentinel", "stats"]
Loss = Literal["sum", "mean", "ce"]
MODES: list[Mode] = ["sentinel", "stats"]
LOSSES: list[Loss] = ["sum", "mean", "ce"]


class CausalAttention(nn.Module):
    """A parent that builds its own ``-inf`` causal mask for ``nn.MultiheadAttention``."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.att = nn.MultiheadAttention(d, 2, batch_first=True)
        self.proj = nn.Linear(d, d)
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.full((t, t), -math.inf).triu(1)
        return self.out(self.proj(self.att(x, x, x, attn_mask=mask)[0]))


class TransformerWithHead(nn.Module):
    """``nn.Transformer`` with its causal mask from ``generate_square_subsequent_mask``."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.tr = nn.Transformer(
            d_model=d, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
            dim_feedforward=32, dropout=0.0, batch_first=True,
        )  # fmt: skip
        self.out = nn.Linear(d, 3)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.out(self.tr(src, tgt, tgt_mask=mask))


def _build(kind: str) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    if kind == "transformer":
        tr = TransformerWithHead()
        src, tgt = torch.randn(2, 5, 16), torch.randn(2, 4, 16)
        return tr, lambda: tr(src, tgt)
    mha = CausalAttention()
    x = torch.randn(2, 5, 16)
    return mha, lambda: mha(x)


def _loss(out: torch.Tensor, kind: Loss) -> torch.Tensor:
    if kind == "sum":
        return out.sum()
    if kind == "mean":
        return out.mean()
    target = torch.arange(out.shape[:-1].numel()) % out.shape[-1]
    return nn.functional.cross_entropy(out.flatten(0, -2), target)


def _monitor(model: nn.Module, mode: Mode) -> Monitor:
    return (Monitor(model) if mode == "sentinel" else Monitor(model, mode="stats")).attach()


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["transformer", "mha"])
def test_clean_causal_models_report_no_fault(kind: str, mode: Mode, loss: Loss) -> None:
    model, forward = _build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = _monitor(model, mode)
    for step in range(4):
        opt.zero_grad()
        _loss(forward(), loss).backward()
        assert mon.faults == [], f"step {step}: {mon.faults}"
        if mode == "stats":
            assert mon.stats  # the statistics were kept: the stats path ran
        opt.step()
    mon.detach()


@pytest.mark.parametrize("loss", ["sum", "mean"])
def test_stats_mode_reads_the_expanded_loss_gradient_by_its_values(loss: Loss) -> None:
    model, forward = _build("transformer")
    mon = _monitor(model, "stats")
    out = forward()
    _loss(out, loss).backward()
    st = mon.stats[("out", "grad_output[0]")]  # d loss / d output: one value, expanded
    want = 1.0 if loss == "sum" else float(torch.tensor(1.0) / out.numel())
    assert (int(st.numel), int(st.nan), int(st.posinf), int(st.neginf)) == (out.numel(), 0, 0, 0)
    assert (float(st.amax), float(st.min), float(st.max)) == (want, want, want)
    assert mon.faults == []


class Strided(nn.Module):
    """Returns a stride-2 view whose skipped memory holds +inf: the output is finite."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pair = torch.stack([x, torch.full_like(x, math.inf)], dim=-1)
        return pair[..., 0]


def test_stats_mode_reads_a_strided_view_by_its_values() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Strided(), nn.Linear(4, 2))
    mon = _monitor(model, "stats")
    x = torch.randn(3, 4)
    out = model(x)
    out.pow(2).mean().backward()
    st = mon.stats[("1", "output[0]")]
    view = model[0](x).detach()
    assert (int(st.posinf), int(st.nan)) == (0, 0)
    assert float(st.amax) == float(view.abs().max())
    assert mon.faults == []


def test_replay_states_an_expanded_operand_by_its_values() -> None:
    w = torch.tensor(-2.0, requires_grad=True)
    r = replay(lambda: torch.log(w.expand(64)).sum().backward())
    assert r is not None and r.op == "aten.log.default" and r.kind == "nan"
    a = r.inputs[0]
    assert (int(a.numel), int(a.nan), int(a.posinf), float(a.min), float(a.max)) == (
        64, 0, 0, -2.0, -2.0,
    )  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("kind", "module"), [("transformer", "tr.decoder.layers.0.linear1"), ("mha", "proj")]
)
def test_a_real_inf_in_a_causal_model_is_named(kind: str, module: str, mode: Mode) -> None:
    model, forward = _build(kind)
    lin = model.get_submodule(module)
    assert isinstance(lin, nn.Linear)
    with torch.no_grad():  # finite weights whose products pass float32's range
        if kind == "mha":
            lin.weight.copy_(torch.eye(16) * 3e38)
            lin.bias.zero_()
        else:
            lin.weight.fill_(3e38)
    mon = _monitor(model, mode)
    if kind == "mha":
        x = torch.randn(2, 5, 16) * 10
        out = model(x)
    else:
        out = forward()
    out.mean().backward()
    first = mon.first_nonfinite
    assert first is not None
    assert (first.phase, first.module, first.tensor, first.kind) == (
        "forward", module, "output[0]", "inf",
    )  # fmt: skip


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_causal_lm_in_stats_mode_reports_no_fault(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32,
                                      n_positions=8, bos_token_id=0, eos_token_id=0)  # fmt: skip
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=2,
                                       num_key_value_heads=1, intermediate_size=32, vocab_size=32,
                                       bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 32, (2, 8))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = _monitor(model, "stats")
    for step in range(3):
        opt.zero_grad()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        assert mon.faults == [], f"step {step}: {mon.faults}"
        opt.step()
    mon.detach()
