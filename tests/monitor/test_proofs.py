"""Finiteness proofs: every bound holds against the real kernels, and proving never
changes a verdict (the monitor with proofs reports exactly what it reports reading
everything)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from floatguard import Monitor
from floatguard.demo import GPT, GPTConfig, synthetic_batch
from floatguard.monitor.bounds import (
    HOST,
    accumulation_roundoff,
    backward_rule,
    forward_rule,
    rule_params,
)

from .test_faults import Lambda


def _bound_of(t: torch.Tensor) -> tuple[float, float]:
    """The tightest valid dependency bound: (amax, max 2-norm of last-dim rows)."""
    t64 = t.detach().double()
    amax = t64.abs().max().item()
    rows = t64.reshape(-1, t.shape[-1]) if t.dim() else t64.reshape(1, 1)
    return amax, rows.norm(dim=1).max().item()


def _modules(d: int) -> list[nn.Module]:
    mods: list[nn.Module] = [
        nn.Linear(d, 3 * d),
        nn.Linear(d, 5, bias=False),
        nn.LayerNorm(d),
        nn.LayerNorm(d, eps=1e-12, elementwise_affine=False),
        nn.GELU(),
        nn.GELU(approximate="tanh"),
        nn.SiLU(),
        nn.ReLU(),
        nn.LeakyReLU(0.2),
        nn.ELU(alpha=1.5),
        nn.Tanh(),
        nn.Sigmoid(),
        nn.Softsign(),
        nn.Hardtanh(-2.0, 3.0),
        nn.ReLU6(),
        nn.Hardswish(),
        nn.Softplus(beta=2.0),
        nn.Dropout(0.3),
    ]
    if hasattr(nn, "RMSNorm"):
        mods.append(nn.RMSNorm(d))
    return mods


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("scale", [1e-30, 1.0, 37.0, 1e6, 1e15, 1e30])
def test_every_bound_holds_against_the_kernel(dtype: torch.dtype, scale: float) -> None:
    gen = torch.Generator().manual_seed(int(math.log10(scale) + 40))
    d = 24
    limit = torch.finfo(dtype).max
    checked = 0
    for m in _modules(d):
        torch.manual_seed(1)
        m = m.to(dtype)
        with torch.no_grad():
            for p in m.parameters():  # non-trivial affine parameters
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 3)
        for pattern in ("randn", "aligned", "outlier"):
            if pattern == "randn":
                x = torch.randn(6, 4, d, generator=gen, dtype=torch.float64) * scale
            elif pattern == "aligned":  # |y| of a Linear reaches K * amax(x) * amax(W)
                x = torch.full((6, 4, d), scale, dtype=torch.float64)
            else:  # one large value per row: the normalisations' worst case
                x = torch.randn(6, 4, d, generator=gen, dtype=torch.float64) * scale * 1e-3
                x[..., 3] = scale
            x = x.to(dtype).requires_grad_()
            y = m(x)
            g = torch.randn(y.shape, generator=gen, dtype=torch.float64) * scale
            g = g.to(dtype)
            (gx,) = torch.autograd.grad(y, x, g)
            params = [_bound_of(getattr(m, n)) for n in rule_params(m)]
            acc = accumulation_roundoff(dtype)  # the tightest the monitor assumes
            fr = forward_rule(m, dtype, y, acc)
            br = backward_rule(m, d, dtype, acc)
            assert fr is not None and br is not None, m
            for rule, deps, result in (
                (fr, [_bound_of(x), *params], y),
                (br, [_bound_of(g), _bound_of(x), *params], gx),
            ):
                a, r = rule(HOST, deps)
                if not (a < limit):
                    continue  # not proved: the monitor reads the tensor instead
                checked += 1
                assert torch.isfinite(result).all(), (m, pattern, rule.name)
                amax, rnorm = _bound_of(result)
                assert amax <= a, (m, pattern, rule.name, amax, a)
                assert rnorm <= r * (1 + 1e-12), (m, pattern, rule.name, rnorm, r)
    # Most cases are proved (the test checks bounds, not skips); beyond 1e18 only
    # the dot products (Linear) still are.
    assert checked > (20 if scale < 1e18 else 1)


def test_conv_and_embedding_bounds_hold() -> None:
    gen = torch.Generator().manual_seed(3)
    for m, x in (
        (nn.Conv1d(4, 6, 3, padding=1), torch.randn(2, 4, 9, generator=gen)),
        (nn.Conv2d(4, 8, 3, stride=2, groups=2), torch.randn(2, 4, 9, 9, generator=gen)),
        (nn.Conv2d(3, 5, 2, dilation=2, padding_mode="reflect", padding=1), torch.ones(1, 3, 6, 6)),
        (nn.Conv3d(2, 2, 2), torch.randn(1, 2, 4, 4, 4, generator=gen)),
    ):
        with torch.no_grad():
            m.weight.abs_()  # same signs everywhere: the sums reach the bound's shape
        x = (x.abs() * 1e3).requires_grad_()
        y = m(x)
        g = torch.ones_like(y) * 7.0
        (gx,) = torch.autograd.grad(y, x, g)
        params = [_bound_of(getattr(m, n)) for n in rule_params(m)]
        acc = accumulation_roundoff(x.dtype)
        fr, br = forward_rule(m, x.dtype, y, acc), backward_rule(m, x.shape[-1], x.dtype, acc)
        assert fr is not None and br is not None
        assert _bound_of(y)[0] <= fr(HOST, [_bound_of(x), *params])[0]
        assert _bound_of(gx)[0] <= br(HOST, [_bound_of(g), _bound_of(x), *params])[0]
    emb = nn.Embedding(10, 6)
    out = emb(torch.tensor([[1, 2, 9]]))
    rule = forward_rule(emb, None, out)
    assert rule is not None
    a, r = rule(HOST, [_bound_of(emb.weight)])
    assert _bound_of(out)[0] <= a and _bound_of(out)[1] <= r


def test_unprovable_configurations_have_no_rule() -> None:
    x = torch.randn(2, 8)
    assert forward_rule(nn.LayerNorm(8, eps=0.0), x.dtype, x) is None  # constant row: 0/0
    assert forward_rule(nn.ReLU(inplace=True), x.dtype, x) is None
    assert forward_rule(nn.Dropout(1.0), x.dtype, x) is None
    assert forward_rule(nn.Softmax(dim=-1), x.dtype, x) is None  # not in the rule book
    assert forward_rule(nn.Softplus(beta=-1.0), x.dtype, x) is None


# ------------------------------------------------------------------ integration


class Net(nn.Module):
    def __init__(self, dtype: torch.dtype, middle: nn.Module | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 16)
        self.ln = nn.LayerNorm(16)
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.middle = middle if middle is not None else nn.Identity()
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(32, 16)
        self.head = nn.Linear(16, 3)
        self.to(dtype)

    def forward(self, idx, extra):  # type: ignore[no-untyped-def]
        h = self.emb(idx) + extra
        h = h + self.fc2(self.drop(self.middle(self.act(self.fc1(self.ln(h))))))
        return self.head(h)


def _faults(mon: Monitor) -> list[tuple[str, str, str, str]]:
    return [(f.phase, f.module, f.tensor, f.kind) for f in mon.faults]


def _alerts(mon: Monitor) -> list[tuple[str, str, str, bool, bool]]:
    return [(a.phase, a.module, a.tensor, a.has_nan, a.has_inf) for a in mon.alerts]


def _verdicts(
    net: nn.Module, idx: torch.Tensor, extra: torch.Tensor, proofs: bool
) -> tuple[object, bool, int, int]:
    torch.manual_seed(5)  # same dropout masks in both runs
    with Monitor(net, proofs=proofs) as mon:
        out = net(idx, extra)
        out.float().sum().backward()
        sen = mon._rec.book.sentinel
        return (_faults(mon), _alerts(mon)), bool(mon.found_nonfinite), sen.reads, len(sen)


def _inject(net: Net, case: str) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = net.fc1.weight.dtype
    idx = torch.randint(0, 11, (4, 7), generator=torch.Generator().manual_seed(1))
    extra = torch.randn(4, 7, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        if case == "nan_input":
            extra[1, 2, 3] = float("nan")
        elif case == "nan_weight":
            net.fc2.weight[0, 0] = float("nan")
        elif case == "inf_embedding":
            net.emb.weight[idx[0, 0], 0] = float("inf")
        elif case == "overflow_fc1":  # finite everything, a Linear overflows
            net.fc1.weight.mul_(torch.finfo(dtype).max / 4)
        elif case == "overflow_head":
            net.head.weight.fill_(torch.finfo(dtype).max / 8)
        elif case == "huge_but_finite":  # bounds cannot settle; reads say finite
            net.fc1.weight.mul_(torch.finfo(dtype).max / 1e6)
            net.fc2.weight.mul_(1e-30)
    return idx, extra


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "case",
    ["clean", "nan_input", "nan_weight", "inf_embedding", "overflow_fc1", "overflow_head",
     "huge_but_finite", "middle_log", "middle_inplace_relu"],
)  # fmt: skip
def test_proofs_never_change_a_verdict(dtype: torch.dtype, case: str) -> None:
    middle: nn.Module | None = None
    if case == "middle_log":
        middle = Lambda(lambda h: torch.log(h))  # NaN where GELU went negative
    elif case == "middle_inplace_relu":
        middle = nn.ReLU(inplace=True)
    results = []
    for proofs in (False, True):
        net = Net(dtype, middle)
        idx, extra = _inject(net, case)
        results.append(_verdicts(net, idx, extra, proofs))
    (f_read, flag_read, _, n0), (f_proof, flag_proof, reads, n1) = results
    assert f_proof == f_read and flag_proof == flag_read and n0 == n1
    assert (f_read[0] != []) == (case not in ("clean", "huge_but_finite", "middle_inplace_relu"))
    assert reads < n1  # something was proved


def test_float32_overflow_in_a_linear_is_found_with_proofs() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    with torch.no_grad():
        m[0].weight.fill_(0.1)
        m[0].bias.zero_()
        m[1].weight.fill_(1e37)  # every layer-1 output is 8 * 80 * 1e37: inf
    with Monitor(m) as mon:
        m(torch.full((3, 8), 100.0)).sum().backward()
    f = mon.first_nonfinite
    assert f is not None and (f.module, f.phase, f.kind, f.tensor) == (
        "1",
        "forward",
        "inf",
        "output[0]",
    )


class Clamped(nn.Module):
    """Parent code that clamps a child's output in place, after the child ran."""

    def __init__(self, w: float) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        with torch.no_grad():
            self.fc.weight.fill_(w)

    def forward(self, x):  # type: ignore[no-untyped-def]
        h = self.fc(x)
        with torch.no_grad():
            h.clamp_(-1.0, 1.0)
        return h * 2


def test_a_tensor_modified_in_place_after_its_proof() -> None:
    # The bound held when it was made: the in-place change does not matter.
    m = Clamped(0.5)
    with Monitor(m) as mon:
        m(torch.ones(2, 4))
    assert mon.first_nonfinite is None and not bool(mon.found_nonfinite)
    # The bound did not hold and the values are gone: reported as a possible overflow.
    m = Clamped(1e38)
    with Monitor(m) as mon:
        m(torch.full((2, 4), 10.0))
    # The clamp makes the output finite: the step is clean, so no fault, but the alert
    # says what the record saw.
    assert mon.first_nonfinite is None
    assert [(a.module, a.has_inf) for a in mon.alerts] == [("fc", True)]
    assert bool(mon.found_nonfinite)


def test_an_inplace_activation_reads_its_input_first() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
    with torch.no_grad():
        m[0].weight.fill_(-1e38)  # -inf out of the Linear, which the ReLU turns into 0
    with Monitor(m) as mon:
        m(torch.full((2, 4), 10.0))
    # The ReLU turns the -inf into 0: a clean step (no fault), with the -inf alerted.
    assert mon.first_nonfinite is None
    got = [(a.module, a.tensor, a.has_inf) for a in mon.alerts]
    assert got == [("0", "output[0]", True), ("1", "input[0]", True)]  # read before the ReLU


def test_bf16_autocast_is_proved_and_exact() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 1))
    with Monitor(m) as mon, torch.autocast("cpu", dtype=torch.bfloat16):
        m(torch.randn(4, 8)).float().sum().backward()
    assert mon._rec.book.sentinel.reads < len(mon._rec.book.sentinel)
    assert mon.first_nonfinite is None and not bool(mon.found_nonfinite)
    with torch.no_grad():
        m[2].weight.fill_(3e38)  # bf16 output of the last Linear overflows
    with Monitor(m) as mon, torch.autocast("cpu", dtype=torch.bfloat16):
        m(torch.full((4, 8), 5.0)).float().sum()
    f = mon.first_nonfinite
    assert f is not None and (f.module, f.phase) == ("2", "forward")


def test_fp16_autocast_is_never_proved() -> None:
    m = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 1))
    with Monitor(m) as mon, torch.autocast("cpu", dtype=torch.float16):
        m(torch.randn(4, 8)).float().sum().backward()
    assert mon._rec.book.sentinel.reads == len(mon._rec.book.sentinel)


def _gpt_coverage(proofs: bool | str) -> tuple[float, set[str]]:
    """Share of the step's values proved, and the record kinds that were proved."""
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=20)
    torch.manual_seed(0)
    model = GPT(cfg)
    x, y = synthetic_batch(cfg, 4, generator=torch.Generator().manual_seed(0))
    with Monitor(model, proofs=proofs) as mon:  # type: ignore[arg-type]
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1)).backward()
        sen = mon._rec.book.sentinel
        assert mon.first_nonfinite is None and not bool(mon.found_nonfinite)
    first = {r.slot: r for r in reversed(mon._rec.book.records)}  # the record that made each slot
    proved = sum(math.prod(r.shape) for s, r in first.items() if sen.is_proof(s))
    total = sum(math.prod(r.shape) for r in first.values())
    kinds = {r.kind for s, r in first.items() if sen.is_proof(s)}
    return proved / total, kinds


def test_proofs_spare_most_reads_of_a_gpt_step() -> None:
    share, kinds = _gpt_coverage("all")
    assert share > 0.5 and kinds == {"fwd_output", "bwd_grad_input"}
    share_fwd, kinds_fwd = _gpt_coverage("forward")
    assert 0.15 < share_fwd < share and kinds_fwd == {"fwd_output"}
    assert _gpt_coverage("off") == (0.0, set())
    assert _gpt_coverage(True) == (share, kinds) and _gpt_coverage(False) == (0.0, set())


def test_bad_proofs_argument() -> None:
    with pytest.raises(ValueError, match="proofs='maybe'"):
        Monitor(nn.Linear(2, 2), proofs="maybe")  # type: ignore[arg-type]


class Poisoner(nn.Module):
    """Modifies its input in place (after the monitor recorded it), then calls a child."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            x[0, 0] = float("nan")
        return self.fc(x)


def test_an_input_modified_in_place_is_read_again() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), Poisoner())
    with Monitor(m) as mon:
        m(torch.randn(2, 4)).sum().backward()
    f = mon.first_nonfinite
    assert f is not None and (f.module, f.phase, f.kind, f.tensor) == (
        "1",
        "forward",
        "nan",
        "fc.input[0]",
    )


class Cnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect")
        self.act = nn.SiLU()
        self.flat = nn.Flatten()
        self.fc = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):  # type: ignore[no-untyped-def]
        h = self.pool(self.relu(self.bn(self.conv1(x))))
        return self.fc(self.flat(self.act(self.conv2(h))))


class Tied(nn.Module):
    """An embedding and a head sharing one weight, and a block called twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(13, 16)
        self.block = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 13, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):  # type: ignore[no-untyped-def]
        h = self.emb(idx)
        h = h + self.block(h)
        h = h + self.block(h)
        return self.head(h)


def _arch_run(arch: str, case: str, proofs: bool) -> tuple[list[tuple[str, str, str, str]], bool]:
    net: nn.Module = Cnn() if arch == "cnn" else Tied()
    if arch == "cnn":
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
        if case == "nan_input":
            x[0, 0, 0, 0] = float("nan")
    else:
        x = torch.randint(0, 13, (3, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        if case == "overflow":
            first = net.conv1 if arch == "cnn" else net.block[1]
            first.weight.mul_(torch.finfo(torch.float32).max / 2)  # type: ignore[operator]
        elif case == "inf_param":
            (net.fc if arch == "cnn" else net.emb).weight[0, 0] = float("inf")  # type: ignore[index]
        elif case == "big_loss":
            pass
    with Monitor(net, proofs=proofs) as mon:
        out = net(x)
        loss = out.float().sum() * (3e36 if case == "big_loss" else 1.0)
        loss.backward()
        return (_faults(mon), _alerts(mon)), bool(mon.found_nonfinite)


@pytest.mark.parametrize("arch", ["cnn", "tied"])
@pytest.mark.parametrize("case", ["clean", "nan_input", "overflow", "inf_param", "big_loss"])
def test_proofs_agree_with_reads_on_other_architectures(arch: str, case: str) -> None:
    with_reads = _arch_run(arch, case, proofs=False)
    assert _arch_run(arch, case, proofs=True) == with_reads
    # Where a fault was injected, it is seen (big_loss only checks agreement: near the
    # top of float32, gradients may or may not overflow).
    if case == "overflow" and arch == "tied":
        # The tanh saturates the inf and the step stays clean: alerts, no fault.
        assert with_reads[1] and with_reads[0][1] and not with_reads[0][0]
    elif case in ("overflow", "inf_param") or (case, arch) == ("nan_input", "cnn"):
        assert with_reads[1] and with_reads[0][0]
    elif case == "clean":
        assert with_reads == (([], []), False)


class GradBomb(nn.Module):
    """Parent code that hooks a child's output and multiplies its gradient by inf."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x):  # type: ignore[no-untyped-def]
        h = self.fc1(x)
        h.register_hook(lambda g: g * float("inf"))
        return self.fc2(h)


def _tampered(case: str) -> nn.Module:
    torch.manual_seed(0)
    if case == "grad_hook":
        return GradBomb()
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    if case == "forward_hook":  # fault injection the usual way
        m[1].register_forward_hook(lambda mod, args, out: out * float("nan"))
    elif case == "pre_hook":
        m[1].register_forward_pre_hook(lambda mod, args: (args[0] * 1e38,))
    elif case == "instance_forward":
        m[1].forward = lambda x: torch.log(-x.abs() - 1)  # type: ignore[method-assign]
    elif case == "weight_norm":
        torch.nn.utils.weight_norm(m[1])  # weight made by a pre-hook, not a parameter
        with torch.no_grad():
            m[1].weight_g.fill_(float("inf"))
    elif case == "backward_hook":
        m[1].register_full_backward_hook(lambda mod, gi, go: (gi[0] * float("nan"),))
    return m


@pytest.mark.parametrize(
    "case",
    ["forward_hook", "pre_hook", "instance_forward", "weight_norm", "backward_hook", "grad_hook"],
)
def test_tampered_modules_are_read_not_proved(case: str) -> None:
    import warnings

    results = []
    for proofs in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # weight_norm's deprecation
            m = _tampered(case)
            with Monitor(m, proofs=proofs) as mon:
                m(torch.full((3, 4), 3.0, requires_grad=True)).sum().backward()
                results.append((_faults(mon), _alerts(mon)))
    assert results[0] == results[1]  # every non-finite tensor, not only the births
    assert results[1][0], "the injected fault must be found"
