"""The fault suite: each scenario names the module, phase, kind and tensor of its birth."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from floatguard import Fault, Monitor


class Lambda(nn.Module):
    def __init__(self, fn):  # type: ignore[no-untyped-def]
        super().__init__()
        self.fn = fn

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.fn(x)


def run(model: nn.Module, x: torch.Tensor, loss_fn=None, check_loss: bool = False) -> Monitor:  # type: ignore[no-untyped-def]
    with Monitor(model) as mon:
        out = model(x)
        loss = loss_fn(out) if loss_fn is not None else out.float().sum()
        if check_loss:
            mon.check_loss(loss)
        loss.backward()
    return mon


def expect(mon: Monitor, module: str, phase: str, kind: str, tensor: str) -> Fault:
    f = mon.first_nonfinite
    assert f is not None, "no fault found"
    assert (f.module, f.phase, f.kind, f.tensor) == (module, phase, kind, tensor), f
    assert bool(mon.found_nonfinite)
    return f


def mlp(middle: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), middle, nn.Linear(8, 4))


X = torch.randn(5, 8)


def test_log_of_negative() -> None:
    expect(run(mlp(Lambda(lambda x: torch.log(x - 100))), X), "1", "forward", "nan", "output[0]")


def test_sqrt_of_negative() -> None:
    expect(
        run(mlp(Lambda(lambda x: torch.sqrt(-x.abs() - 1))), X), "1", "forward", "nan", "output[0]"
    )


def test_zero_over_zero() -> None:
    expect(run(mlp(Lambda(lambda x: (x * 0) / (x * 0))), X), "1", "forward", "nan", "output[0]")


def test_inf_minus_inf() -> None:
    big = Lambda(lambda x: torch.exp(x.abs() + 100) - torch.exp(x.abs() + 100))
    expect(run(mlp(big), X), "1", "forward", "nan", "output[0]")


def test_fp16_overflow_in_linear() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)).half()
    with torch.no_grad():
        model[1].weight.fill_(3000.0)
    x = (torch.rand(4, 16) * 10 + 5).half()
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(16))
        model[0].bias.zero_()
    expect(run(model, x), "1", "forward", "inf", "output[0]")


def test_fully_masked_attention_row() -> None:
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x, mask):  # type: ignore[no-untyped-def]
            h = self.proj(x)
            return self.attn(h, h, h, key_padding_mask=mask)[0]

    net = Net()
    x = torch.randn(2, 5, 8)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1] = True  # every key of batch row 1 masked
    with Monitor(net) as mon:
        net(x, mask).sum().backward()
    expect(mon, "attn", "forward", "nan", "output[0]")


def test_layernorm_of_constant_with_zero_eps() -> None:
    torch.manual_seed(0)

    class Norm(nn.Module):
        def forward(self, x):  # type: ignore[no-untyped-def]
            mean = x.mean(-1, keepdim=True)
            var = x.var(-1, keepdim=True, unbiased=False)
            return (x - mean) / torch.sqrt(var + 0.0)

    model = nn.Sequential(nn.Linear(8, 8), Norm(), nn.Linear(8, 4))
    with torch.no_grad():
        model[0].weight.zero_()  # every row constant: var = 0
        model[0].bias.fill_(3.0)
    expect(run(model, X), "1", "forward", "nan", "output[0]")
    ln = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8, eps=0.0))
    with torch.no_grad():
        ln[0].weight.zero_()
        ln[0].bias.fill_(3.0)
    expect(run(ln, X), "1", "forward", "nan", "output[0]")


class NaNBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def,override]
        return x * 2

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def,override]
        return g * float("nan")


def test_backward_only_nan() -> None:
    model = mlp(Lambda(NaNBackward.apply))
    mon = run(model, X)
    f = expect(mon, "1", "backward", "nan", "grad_input[0]")
    assert f.shape == (5, 8)


def test_param_grad_only_nan() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(8))

        def forward(self, x):  # type: ignore[no-untyped-def]
            return ParamNaN.apply(x, self.w)

    class ParamNaN(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):  # type: ignore[no-untyped-def,override]
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def,override]
            x, w = ctx.saved_tensors
            return g * w, (g * x).sum(0) * float("nan")

    expect(run(mlp(Scale()), X), "1", "param_grad", "nan", "param:w")


def test_nan_weight() -> None:
    model = mlp(nn.Tanh())
    with torch.no_grad():
        model[2].weight[1, 3] = float("nan")
    expect(run(model, X), "2", "forward", "nan", "param:weight")


def test_nan_input_batch() -> None:
    x = X.clone()
    x[2, 1] = float("nan")
    expect(run(mlp(nn.Tanh()), x), "", "input", "nan", "input[0]")


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x):  # type: ignore[no-untyped-def]
        h = x + self.a(x) * 1e38  # the parent's residual add overflows; a and b are finite
        return self.c(h + self.b(x) * 1e38)


def test_inf_born_in_parents_residual_add() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Residual())
    with torch.no_grad():
        for lin in (model[1].a, model[1].b):
            lin.weight.fill_(1.0)
            lin.bias.fill_(10.0)
    x = torch.rand(5, 8) + 1
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(8))
        model[0].bias.zero_()
    f = expect(run(model, x), "1", "forward", "inf", "c.input[0]")
    assert "1" in str(f)


def test_inf_in_parent_output_between_children() -> None:
    class Sum(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.a(x) * 3e38 + self.b(x) * 3e38

    torch.manual_seed(0)
    block = Sum()
    with torch.no_grad():
        for lin in (block.a, block.b):
            lin.weight.zero_()
            lin.bias.fill_(1.0)
    model = nn.Sequential(nn.Linear(8, 8), block)
    expect(run(model, X), "1", "forward", "inf", "output[0]")


def test_nan_loss_from_log0_outside_the_model() -> None:
    model = mlp(nn.Sigmoid())
    mon = run(model, X, loss_fn=lambda out: torch.log(out * 0).sum(), check_loss=True)
    expect(mon, "", "loss", "inf", "loss")
    mon = run(model, X, loss_fn=lambda out: (out * 0 * torch.log(out * 0)).sum(), check_loss=True)
    expect(mon, "", "loss", "nan", "loss")


def test_loss_backward_inf_enters_the_model() -> None:
    model = mlp(nn.Tanh())
    mon = run(model, X, loss_fn=lambda out: torch.sqrt(out.sum() * 0))
    expect(mon, "", "loss", "nan", "grad_output[0]")  # sqrt'(0) * 0 = inf * 0


def test_backward_fault_in_parent_code_between_children() -> None:
    class P(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x):  # type: ignore[no-untyped-def]
            h = self.a(x)
            g = torch.sqrt(torch.relu(h) * 0)  # finite forward, inf * 0 = NaN backward
            return self.b(g)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), P())
    expect(run(model, X), "1", "backward", "nan", "a.grad_output[0]")


def test_nested_modules_resolve_to_the_deepest() -> None:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 8), Lambda(lambda x: torch.log(-x.abs() - 1)), nn.ReLU())
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Tanh(), inner))
    mon = run(model, X)
    expect(mon, "1.1.1", "forward", "nan", "output[0]")
    assert [f.module for f in mon.faults] == ["1.1.1"]  # everything after is propagation


def test_dict_and_dataclass_outputs() -> None:
    @dataclasses.dataclass
    class Out:
        hidden: torch.Tensor
        extra: dict[str, torch.Tensor]

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):  # type: ignore[no-untyped-def]
            h = self.lin(x)
            return Out(
                hidden=h, extra={"bad": torch.log(h - 100), "ids": torch.ones(2, dtype=torch.long)}
            )

    m = M()
    with Monitor(m) as mon:
        out = m(X)
        out.hidden.sum().backward()
    expect(mon, "", "forward", "nan", "output.extra.bad")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_clean_low_precision_runs_report_nothing(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 16)).to(
        dtype
    )
    info = torch.finfo(dtype)
    x = torch.randn(8, 16).to(dtype)
    x[0, :4] = info.tiny * 0.25  # subnormals
    big = 2000.0 if dtype == torch.float16 else 1e15  # large, yet every layer stays in range
    x[1, :4] = big
    x[2, :4] = -big
    with Monitor(model) as mon:
        for _ in range(3):
            out = model(x)
            mon.check_loss(out.float().mean())
            out.float().mean().backward()
            assert mon.first_nonfinite is None and not bool(mon.found_nonfinite)
            assert mon.faults == [] and mon.alerts == []
    assert mon.step == 2


def test_step_counter_and_detach_removes_hooks() -> None:
    model = mlp(nn.Tanh())
    mon = Monitor(model).attach()
    for _ in range(3):
        model(X).sum().backward()
    assert mon.step == 2
    x = X.clone()
    x[0, 0] = math.inf
    model(x).sum().backward()
    f = mon.first_nonfinite
    assert f is not None and f.step == 3 and f.phase == "input" and f.kind == "inf"
    mon.detach()
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert all(not p._backward_hooks for p in model.parameters())  # type: ignore[attr-defined]
    assert mon.first_nonfinite == f  # the last step's records stay readable


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match=r"needs an nn.Module"):
        Monitor(lambda x: x)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode='full'"):
        Monitor(nn.Linear(2, 2), mode="full")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="every=0"):
        Monitor(nn.Linear(2, 2), every=0)
    with pytest.raises(ValueError, match="unknown format"):
        Monitor(nn.Linear(2, 2), formats=("fp9",))
