"""Localization on inputs the fault suite does not cover: activation checkpointing,
RNNs, sparse and complex gradients, inference tensors, modules that return their
input, parameters used by their owner's code. Each case runs with proofs and with
reads only, and asserts the whole list of faults (a consequence listed as a birth
is a defect too)."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as checkpoint
from torch import nn

from floatguard import Fault, Monitor

from .test_faults import Lambda, NaNBackward

PROOFS = pytest.mark.parametrize("proofs", ["all", "off"])


class ScaleBackward(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``s`` (finite) in backward."""

    @staticmethod
    def forward(ctx, x, s):  # type: ignore[no-untyped-def,override]
        ctx.s = s
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def,override]
        return g * ctx.s, None


def where(faults: list[Fault]) -> list[tuple[str, str, str, str]]:
    return [(f.module, f.phase, f.kind, f.tensor) for f in faults]


@PROOFS
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        (lambda x: x * 2, []),
        (lambda x: torch.log(x - 100), [("blk.bad", "forward", "nan", "output[0]")]),
        (NaNBackward.apply, [("blk.bad", "backward", "nan", "grad_input[0]")]),
    ],
    ids=["clean", "forward", "backward"],
)
def test_activation_checkpointing(proofs: str, reentrant: bool, fault, expected) -> None:  # type: ignore[no-untyped-def]
    """The checkpointed block's forward runs again inside backward: its hooks fire a
    second time, and the verdicts stay those of the first run."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.bad = Lambda(fault)
            self.b = nn.Linear(8, 8)

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.b(self.bad(self.a(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(8, 8)
            self.blk = Block()
            self.out = nn.Linear(8, 2)

        def forward(self, x):  # type: ignore[no-untyped-def]
            h = checkpoint.checkpoint(self.blk, self.inp(x), use_reentrant=reentrant)
            return self.out(h)

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(4, 8, requires_grad=reentrant)
    with Monitor(net, proofs=proofs) as mon:  # type: ignore[arg-type]
        for step in range(2):
            net(x).sum().backward()
            assert mon.step == step
            assert where(mon.faults) == expected


@PROOFS
def test_lstm_with_an_inf_recurrent_weight(proofs: str) -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.LSTM(8, 16, batch_first=True)
            self.head = nn.Linear(16, 2)

        def forward(self, x):  # type: ignore[no-untyped-def]
            out, _state = self.rnn(x)
            return self.head(out[:, -1])

    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        net.rnn.weight_hh_l0[3, 2] = float("inf")
    with Monitor(net, proofs=proofs) as mon:  # type: ignore[arg-type]
        net(torch.randn(2, 5, 8)).sum().backward()
    assert where(mon.faults) == [("rnn", "forward", "inf", "param:weight_hh_l0")]


def _big_gradient_embedding(sparse: bool) -> nn.Sequential:
    """Embedding -> (gradient x 3e38 in backward) -> Linear with unit weights: each
    gradient row of a looked-up token is 3e38, finite; two of them sum to inf."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Embedding(10, 4, sparse=sparse),
        Lambda(lambda h: ScaleBackward.apply(h, 3e38)),
        nn.Linear(4, 1),
    )
    with torch.no_grad():
        net[2].weight.fill_(1.0)
    return net


@PROOFS
@pytest.mark.parametrize("sparse", [True, False])
def test_embedding_gradient_that_overflows_when_rows_are_summed(proofs: str, sparse: bool) -> None:
    """Token 1 appears twice; each row of its gradient is 3e38, their sum is inf.
    A sparse gradient holds the two rows uncoalesced: it must be read as the tensor
    it stands for (coalesced), not as its stored rows."""
    net = _big_gradient_embedding(sparse)
    with Monitor(net, proofs=proofs) as mon:  # type: ignore[arg-type]
        net(torch.tensor([[1, 2, 1]])).sum().backward()
    assert net[0].weight.grad is not None and net[0].weight.grad.is_sparse == sparse
    assert where(mon.faults) == [("0", "param_grad", "inf", "param:weight")]
    # and a clean sparse step reports nothing
    with Monitor(net, proofs=proofs) as mon:  # type: ignore[arg-type]
        net(torch.tensor([[1, 2, 3]])).sum().backward()
    assert mon.faults == []


@PROOFS
def test_complex_tensors_are_watched(proofs: str) -> None:
    class Spectral(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(5, dtype=torch.cfloat))

        def forward(self, x):  # type: ignore[no-untyped-def]
            return torch.fft.rfft(x) * self.w

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(8, 8)
            self.spec = Spectral()
            self.mag = Lambda(lambda z: z.abs())
            self.out = nn.Linear(5, 1)

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.out(self.mag(self.spec(self.inp(x))))

    torch.manual_seed(0)
    net = Net()
    with Monitor(net, proofs=proofs) as mon:  # type: ignore[arg-type]
        net(torch.randn(3, 8)).sum().backward()
    assert mon.faults == []
    with torch.no_grad():
        net.spec.w[2] = complex(float("nan"), 0.0)
    with Monitor(net, proofs=proofs) as mon:  # type: ignore[arg-type]
        net(torch.randn(3, 8)).sum().backward()
    assert where(mon.faults) == [("spec", "forward", "nan", "param:w")]
    with torch.no_grad():
        net.spec.w.fill_(complex(3e38, 3e38))
    with Monitor(net, proofs=proofs) as mon:  # type: ignore[arg-type]
        net(torch.ones(3, 8) * 100).sum().backward()
    assert where(mon.faults)[0] == ("spec", "forward", "inf", "output[0]")


@PROOFS
def test_inference_mode(proofs: str) -> None:
    """Inference tensors have no version counter: they are read, never aliased or proved."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with Monitor(net, proofs=proofs) as mon:  # type: ignore[arg-type]
        with torch.inference_mode():
            net(torch.randn(2, 4))
        assert mon.faults == []
        with torch.no_grad():
            net[2].weight.fill_(3e38)
        with torch.inference_mode():
            net(torch.ones(2, 4) * 10)
        assert where(mon.faults) == [("2", "forward", "inf", "output[0]")]


@PROOFS
def test_modules_returning_their_input_are_not_blamed(proofs: str) -> None:
    """An identity's output is its input: the same gradient is its grad_output and its
    grad_input, and must be seen in that order."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(4, 4),
        nn.Identity(),
        nn.Dropout(0.0),
        Lambda(NaNBackward.apply),
        nn.Identity(),
        nn.Linear(4, 1),
    )
    with Monitor(net, proofs=proofs) as mon:  # type: ignore[arg-type]
        net(torch.randn(2, 4)).sum().backward()
    assert where(mon.faults) == [("3", "backward", "nan", "grad_input[0]")]


@PROOFS
def test_a_parameter_used_by_its_owner_is_judged_with_the_owner(proofs: str) -> None:
    """nn.MultiheadAttention uses out_proj's weight itself (out_proj never runs): after a
    NaN born in the attention's forward, out_proj's NaN gradient is a consequence."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 3, 8)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    mask[1] = True
    with Monitor(mha, proofs=proofs) as mon:  # type: ignore[arg-type]
        out, _ = mha(x, x, x, key_padding_mask=mask)
        out.sum().backward()
    assert mha.out_proj.weight.grad is not None and mha.out_proj.weight.grad.isnan().any()
    assert where(mon.faults) == [("", "forward", "nan", "output[0]")]


@PROOFS
def test_transformer_encoder_reports_only_the_birth(proofs: str) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    net = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    with torch.no_grad():
        net.layers[1].linear1.weight[0, 0] = float("nan")
    with Monitor(net, proofs=proofs) as mon:  # type: ignore[arg-type]
        net(torch.randn(2, 5, 16)).sum().backward()
    assert where(mon.faults) == [("layers.1.linear1", "forward", "nan", "param:weight")]


def test_stats_mode_counts_the_zeros_a_sparse_gradient_does_not_store() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    with Monitor(net, mode="stats") as mon:
        net(torch.tensor([[1, 2, 1]])).sum().backward()
    grad = net[0].weight.grad
    assert grad is not None and grad.is_sparse
    got = mon.stats[("0", "param:weight.grad")]
    dense = grad.to_dense()
    assert int(got.numel) == dense.numel() == 40
    assert int(got.zeros) == int((dense == 0).sum())  # 7 rows never looked up
    assert float(got.max) == float(dense.max()) and float(got.min) == float(dense.min())


@pytest.mark.parametrize("order", ["compile_then_attach", "attach_then_compile"])
def test_a_compiled_model_is_watched_module_by_module(order: str) -> None:
    """torch.compile does not trace the hooks (each is a graph break): the records and
    verdicts are those of the eager model."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 1))
    x = torch.randn(2, 4)
    if order == "compile_then_attach":
        compiled = torch.compile(net, backend="eager")
        mon = Monitor(compiled).attach()
        prefix = "_orig_mod."
    else:
        mon = Monitor(net).attach()
        compiled = torch.compile(net, backend="eager")
        prefix = ""
    try:
        compiled(x).sum().backward()
        assert mon.faults == []
        with torch.no_grad():
            net[2].weight.fill_(float("nan"))
        compiled(x).sum().backward()
        assert where(mon.faults) == [(prefix + "2", "forward", "nan", "param:weight")]
        with torch.no_grad():
            net[2].weight.fill_(1.0)
        x_bad = x.clone()
        x_bad[0, 0] = float("inf")
        compiled(x_bad).sum().backward()
        assert where(mon.faults)[0] == ("", "input", "inf", "input[0]")
    finally:
        mon.detach()
        torch._dynamo.reset()


@PROOFS
@pytest.mark.parametrize("stats", [False, True])
def test_float8_tensors_are_read(proofs: str, stats: bool) -> None:
    """8-bit floats have no aminmax kernel: they are read through float32 (exact)."""

    class Cast(nn.Module):
        def __init__(self, dtype: torch.dtype) -> None:
            super().__init__()
            self.dtype = dtype

        def forward(self, x):  # type: ignore[no-untyped-def]
            return x.to(self.dtype)

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(4, 4), Cast(torch.float8_e5m2), Cast(torch.float32), nn.Linear(4, 1)
    )
    mode = "stats" if stats else "sentinel"
    with Monitor(net, mode=mode, proofs=proofs) as mon:  # type: ignore[arg-type]
        net(torch.randn(2, 4)).sum().backward()
        assert mon.faults == []
        with torch.no_grad():
            net[0].weight.fill_(1e4)  # outputs ~4e4..1e5: beyond E5M2's 57344 -> inf
        net(torch.ones(2, 4) * 3).sum().backward()
        assert where(mon.faults)[0] == ("1", "forward", "inf", "output[0]")
        if stats:
            assert int(mon.stats[("1", "output[0]")].posinf) == 8


@PROOFS
def test_a_module_returning_its_own_parameter(proofs: str) -> None:
    """A leaf output has no node to hook and its parameter hooks fire first: the module
    returns a view of it, so its gradient is seen as grad_output before the parameter's
    gradient, and no hook outlives the step."""

    class Query(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Parameter(torch.randn(4))

        def forward(self):  # type: ignore[no-untyped-def]
            return self.q

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query = Query()
            self.bad = Lambda(NaNBackward.apply)
            self.out = nn.Linear(4, 1)

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.out(self.bad(x * self.query()))

    torch.manual_seed(0)
    net = Net()
    with Monitor(net, proofs=proofs) as mon:  # type: ignore[arg-type]
        counts = []
        for _ in range(3):
            net(torch.randn(2, 4)).sum().backward()
            counts.append(len(mon._rec.book.records))
            assert where(mon.faults) == [("bad", "backward", "nan", "grad_input[0]")]
        assert counts[0] == counts[1] == counts[2]
        net.zero_grad()
        net(torch.randn(2, 4)).sum().backward()
    assert not net.query.q._backward_hooks  # nothing left behind
    # the parameter's value is unchanged and still trains
    assert isinstance(net.query.q.grad, torch.Tensor)


@pytest.mark.parametrize("rows", [[1, 2, 3], [1, 2, 1]])
def test_a_sparse_gradient_is_not_coalesced_during_the_step(
    rows: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Coalescing sizes its output on the host (a sync on CUDA): during forward and
    backward the stored values are read and the sums proved; the exact read waits
    for the monitor to be read."""
    calls = []
    coalesce = torch.Tensor.coalesce

    def counting(self: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return coalesce(self)

    net = _big_gradient_embedding(True)
    with Monitor(net) as mon:
        monkeypatch.setattr(torch.Tensor, "coalesce", counting)
        net(torch.tensor([rows])).sum().backward()
        assert calls == []
        flag = bool(mon.found_nonfinite)  # no coalescing there either
        assert calls == []
        faults = where(mon.faults)
    duplicate = rows.count(1) == 2
    assert flag == duplicate
    assert faults == ([("0", "param_grad", "inf", "param:weight")] if duplicate else [])
