"""Guard.step(closure): detection in one read, localization by replay, responses by cause.

Every fault is planted in a known module, pass and op; the tests assert the exact
fault named and the exact sequence of actions the guard took.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from floatguard import Fault, Guard, GuardStopped, Monitor, ResponsePolicy, SpikePolicy, replay

from .monitor.test_sync_free import CountSyncs

pytestmark = pytest.mark.usefixtures("guard_sync")  # every test in both sync modes

T, D, V = 6, 16, 11


class CausalLM(nn.Module):
    """A causal LM on PyTorch's own encoder, with PyTorch's own causal mask."""

    def __init__(self, padding: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        layer = nn.TransformerEncoderLayer(D, 2, 32, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, V)
        self.padding = padding

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        pad = None
        if self.padding:
            pad = torch.zeros(ids.shape, dtype=torch.bool)
            pad[:, -2:] = True  # the encoder turns this into a -inf float mask
        # is_causal=True: the encoder would otherwise compare the mask with a causal one
        # on the host (a sync of PyTorch's own, not the guard's)
        h = self.enc(self.emb(ids), mask=mask, src_key_padding_mask=pad, is_causal=True)
        return self.head(h)


class MinMaskAttention(nn.Module):
    """An HF-style additive mask of finfo.min, built in the parent."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.out = nn.Linear(D, V)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        n = h.shape[1]
        mask = torch.triu(torch.full((n, n), torch.finfo(h.dtype).min), diagonal=1)
        return self.out(self.attn(h, h, h, attn_mask=mask)[0])


def lm_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (4, T), generator=g)
    return ids, torch.roll(ids, 1, dims=1)


def lm_loss(model: nn.Module, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids).reshape(-1, V).float(), y.reshape(-1))


# ------------------------------------------------------------ no false faults
@pytest.mark.filterwarnings("ignore:Support for mismatched src_key_padding_mask")
@pytest.mark.parametrize("padding", [False, True], ids=["causal", "causal+padding"])
def test_clean_transformer_with_pytorch_masks_has_no_fault(padding: bool) -> None:
    torch.manual_seed(0)
    model = CausalLM(padding)
    guard = Guard(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for i in range(4):
        ids, y = lm_batch(i)
        r = guard.step(lambda ids=ids, y=y: lm_loss(model, ids, y))
        assert (r.action, r.fault) == ("applied", None)
    assert not guard.events.of_kind("fault")
    ids, y = lm_batch(9)
    assert replay(lambda: lm_loss(model, ids, y).backward(), model=model) is None
    with Monitor(model) as mon:
        loss = lm_loss(model, ids, y)
        mon.check_loss(loss)
        loss.backward()
    assert mon.first_nonfinite is None and mon.faults == []
    guard.close()


def test_finfo_min_masks_and_hooks_guard_have_no_fault() -> None:
    torch.manual_seed(0)
    model = MinMaskAttention()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), watch="hooks")
    h = torch.randn(2, 5, D)
    for _ in range(3):
        guard.backward(model(h).pow(2).mean())
        assert guard.step().action == "applied"
    assert not guard.events.of_kind("fault")
    guard.close()


def test_a_nan_weight_is_named_not_the_mask() -> None:
    torch.manual_seed(0)
    model = CausalLM()
    with torch.no_grad():
        model.enc.layers[1].linear1.weight[3, 3] = math.nan
    ids, y = lm_batch(0)
    with Monitor(model) as mon:
        loss = lm_loss(model, ids, y)
        mon.check_loss(loss)
        loss.backward()
    first = mon.first_nonfinite
    assert first is not None
    assert (first.module, first.tensor) == ("enc.layers.1.linear1", "param:weight")
    r = replay(lambda: lm_loss(model, ids, y).backward(), model=model)
    assert r is not None and (r.phase, r.module, r.tensor) == (
        "param",
        "enc.layers.1.linear1",
        "param:weight",
    )


# ------------------------------------------------------------ localization by replay
class Where(nn.Module):
    """The where-trap: log of relu(h) where it is positive; log(0) = -inf is masked in
    forward, and its gradient 0 * inf = NaN is not masked in backward."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        r = h * (h > 0)
        return torch.where(r > 0, torch.log(r), torch.zeros_like(r))


class SqrtAtZero(nn.Module):
    """sqrt(0) = 0 in forward; its gradient 1 / (2 sqrt(0)) = inf in backward."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(h * 0)


class Masked(nn.Module):
    """Attention whose third query row may see no key at all."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(h.shape[1], h.shape[1])
        mask[2, :] = -math.inf
        return self.attn(h, h, h, attn_mask=mask)[0]


def net(middle: nn.Module, d: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, d), middle, nn.Linear(d, 3))


def one_step(
    model: nn.Module,
    closure: Callable[[], torch.Tensor],
    precision: str = "fp32",
) -> tuple[Guard, Fault]:
    guard = Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        precision=precision,  # type: ignore[arg-type]
    )
    before = [p.detach().clone() for p in model.parameters()]
    try:
        r = guard.step(closure)
    except GuardStopped as e:
        # A model bad before its first step has no clean snapshot to roll back to.
        assert e.report["reason"] == "no_clean_snapshot", e.report
        assert isinstance(e.fault, Fault) and e.fault.phase == "param", e.fault
        assert all(p.grad is None for p in model.parameters())
        return guard, e.fault
    assert r.action != "applied" and r.fault is not None, r
    if r.action == "skipped":
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())
    guard.close()
    return guard, r.fault


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))


def test_a_nan_batch_is_the_input() -> None:
    model = net(nn.Tanh())
    bad = X.clone()
    bad[1, 2] = math.nan
    _, f = one_step(model, lambda: model(bad).pow(2).mean())
    assert (f.phase, f.module, f.tensor, f.kind, f.deterministic) == (
        "input",
        "",
        "input[0]",
        "nan",
        True,
    )


def test_a_nan_weight_is_that_modules_parameter() -> None:
    model = net(nn.Tanh())
    with torch.no_grad():
        model[2].weight[0, 1] = math.nan
    _, f = one_step(model, lambda: model(X).pow(2).mean())
    assert (f.phase, f.module, f.tensor, f.deterministic) == ("param", "2", "param:weight", True)


def test_an_fp16_linear_overflow_is_that_linear() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[1].weight.fill_(3000.0)  # 3000 * 8 * 24 = 576000: past 65504 in fp16
    x = torch.full((4, 8), 3.0)
    _, f = one_step(model, lambda: model(x).float().pow(2).mean(), precision="fp16")
    assert (f.phase, f.module, f.kind) == ("forward", "1", "inf")
    assert f.op is not None and "addmm" in f.op


def test_a_fully_masked_attention_row_is_the_softmax_not_the_mask() -> None:
    model = net(Masked())
    _, f = one_step(model, lambda: model(X.reshape(1, 4, 8)).pow(2).mean())
    assert (f.phase, f.module, f.kind) == ("forward", "1.attn", "nan")
    assert f.op is not None and "softmax" in f.op


@pytest.mark.parametrize("trap", [SqrtAtZero, Where], ids=["sqrt_at_0", "where_trap"])
def test_backward_traps_are_the_backward_of_that_module(trap: type[nn.Module]) -> None:
    model = net(trap())
    _, f = one_step(model, lambda: model(X).pow(2).mean())
    assert (f.phase, f.module) == ("backward", "1"), f
    assert f.source is not None and "test_guard_causes.py" in f.source


def test_log_of_zero_in_the_loss_is_the_loss() -> None:
    model = net(nn.Tanh())
    _, f = one_step(model, lambda: -torch.log(torch.sigmoid(model(X)) * 0).mean())
    assert (f.phase, f.kind, f.op) == ("loss", "inf", "aten.log.default")
    assert f.source is not None and "torch.log" in f.source


def test_a_compiled_model_is_localized_as_its_eager_version() -> None:
    eager = net(nn.Tanh())
    compiled = torch.compile(net(nn.Tanh()), backend="aot_eager")
    found = []
    for model in (eager, compiled):
        with torch.no_grad():
            next(iter(model.parameters())).copy_(next(iter(eager.parameters())))
        bad = X.clone()
        bad[0, 0] = math.inf
        _, f = one_step(model, lambda m=model, b=bad: m(b).pow(2).mean())
        found.append((f.phase, f.module, f.tensor))
        name = "2" if model is eager else "_orig_mod.2"  # torch.compile's wrapper
        with torch.no_grad():
            dict(model.named_modules())[name].weight[0, 0] = math.nan
        _, f = one_step(model, lambda m=model: m(X).pow(2).mean())
        found.append((f.phase, f.module, f.tensor))
    assert found[:2] == found[2:] == [("input", "", "input[0]"), ("param", "2", "param:weight")]


def test_a_checkpointed_model_is_localized() -> None:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 8), SqrtAtZero(), nn.Linear(8, 8))

    class Ckpt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = inner
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = checkpoint(self.block, x, use_reentrant=False)
            return self.head(h)

    model = Ckpt()
    _, f = one_step(model, lambda: model(X).pow(2).mean())
    assert (f.phase, f.module) == ("backward", "block.1")


def test_transient_and_deterministic_faults() -> None:
    calls = {"n": 0}
    model = net(nn.Tanh())

    def first_call_only() -> torch.Tensor:
        calls["n"] += 1
        x = X * math.nan if calls["n"] == 1 else X
        return model(x).pow(2).mean()

    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    r = guard.step(first_call_only)
    assert (r.action, r.reason) == ("skipped", "transient")
    assert r.fault is not None and r.fault.deterministic is False
    assert guard.rollbacks == 0 and guard.consecutive_bad == 0
    bad = X * math.nan
    r = guard.step(lambda: model(bad).pow(2).mean())
    assert r.fault is not None and r.fault.deterministic is True
    assert (r.action, r.reason) == ("skipped", "nonfinite_input")
    guard.close()


# ------------------------------------------------------------ responses by cause
def _run(
    precision: str, plant: dict[int, str], n: int = 8, **policy: int
) -> tuple[Guard, list[tuple[str, str | None]], list[float], nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(
        model,
        opt,
        precision=precision,  # type: ignore[arg-type]
        spikes=SpikePolicy(watch_loss=False),
        response=ResponsePolicy(**policy),
    )
    g = torch.Generator().manual_seed(1)
    actions, scales = [], []
    for i in range(n):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g)
        what = plant.get(i)
        if what == "nan_batch":
            x = x * math.nan
        if what == "nan_weight":
            with torch.no_grad():
                model[0].weight[2, 2] = math.nan
        factor = 1e30 if what == "overflow" else 1.0

        def closure(x: torch.Tensor = x, y: torch.Tensor = y, f: float = factor) -> torch.Tensor:
            return F.mse_loss(model(x).float(), y) * f

        r = guard.step(closure)
        actions.append((r.action, r.reason))
        scales.append(r.scale)
        assert opt.param_groups[0]["lr"] == 0.05
    return guard, actions, scales, model


A = ("applied", None)


def test_a_nan_batch_is_skipped_once_lr_and_scale_unchanged() -> None:
    guard, actions, scales, _ = _run("fp16", {3: "nan_batch"})
    assert actions == [A, A, A, ("skipped", "nonfinite_input"), A, A, A, A]
    assert scales == [65536.0] * 8 and guard.lr_factor == 1.0
    assert not guard.events.of_kind("lr_backoff") and guard.rollbacks == 0


def test_a_nan_weight_rolls_back_on_that_step_and_names_it() -> None:
    guard, actions, scales, model = _run("fp16", {7: "nan_weight"}, n=10)
    assert actions == [A] * 7 + [("rolled_back", "nonfinite_param"), A, A]
    assert scales == [65536.0] * 10
    fault = guard.events.of_kind("fault")
    assert [(f.step, f["phase"], f["module"], f["tensor"]) for f in fault] == [
        (7, "param", "0", "param:weight")
    ]
    rollback = guard.events.of_kind("rollback")[0]
    assert rollback.step == 7 and rollback["to_step"] == 5  # lost: steps 5 and 6
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_fp16_overflows_halve_the_scale_and_never_count_toward_rollback() -> None:
    plant = dict.fromkeys(range(2, 7), "overflow")
    guard, actions, scales, _ = _run("fp16", plant, n=9, rollback_after=2)
    assert actions == [A, A] + [("skipped", "overflow")] * 5 + [A, A]
    assert scales == [65536.0] * 3 + [32768.0, 16384.0, 8192.0, 4096.0, 2048.0, 2048.0]
    assert guard.rollbacks == 0 and guard.consecutive_bad == 0


def test_the_same_fault_after_a_rollback_stops_the_run() -> None:
    torch.manual_seed(0)
    model = net(nn.Tanh())
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    guard.step(lambda: model(X).pow(2).mean())

    def corrupt() -> torch.Tensor:
        with torch.no_grad():
            model[0].bias[0] = math.nan  # something writes NaN into the weights every step
        return model(X).pow(2).mean()

    assert guard.step(corrupt).action == "rolled_back"
    with pytest.raises(Exception, match=r"same deterministic fault") as ei:
        guard.step(corrupt).action  # noqa: B018 (deferred: reading the result settles it)
    assert "param:bias" in str(ei.value)
    assert guard.events.of_kind("stop")[0]["reason"] == "repeated_fault"


def test_a_skipped_step_restores_batchnorm_statistics() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    guard.step(lambda: model(X).pow(2).mean())
    stats = {k: v.clone() for k, v in model[1].state_dict().items()}
    spike = X * 100.0
    r = guard.step(lambda: model(spike).pow(2).mean() * math.inf)
    assert r.action == "skipped"
    for k, v in model[1].state_dict().items():
        assert torch.equal(v, stats[k]), k


def test_replay_uses_the_steps_own_dropout_masks() -> None:
    """A fault that depends on the dropout mask reproduces: the RNG state is restored."""

    class DropGate(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            keep = F.dropout(torch.ones(()), 0.5, self.training)  # 0 or 2
            return h * torch.log(keep - 1.0)  # log(-1) = NaN when dropped, 0 when kept

    # A seed whose first draw drops and whose next draw keeps: a replay that drew
    # again, instead of restoring the step's RNG state, would not reproduce the fault.
    def draws(seed: int) -> list[float]:
        torch.manual_seed(seed)
        return [float(F.dropout(torch.ones(()), 0.5)) for _ in range(2)]

    seed = next(s for s in range(100) if draws(s) == [0.0, 2.0])
    model = net(DropGate())
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    torch.manual_seed(seed)
    r = guard.step(lambda: model(X).pow(2).mean())
    assert r.fault is not None and r.fault.deterministic is True, r
    assert (r.reason, r.fault.module, r.fault.op) == ("nonfinite_loss", "1", "aten.log.default")
    guard.close()


# ------------------------------------------------------------ cost: nothing on clean steps
class CountHooks:
    """Count hook registrations of every kind while active."""

    NAMES = (
        (nn.Module, "register_forward_pre_hook"),
        (nn.Module, "register_forward_hook"),
        (nn.Module, "register_full_backward_hook"),
        (nn.Module, "register_full_backward_pre_hook"),
        (torch.Tensor, "register_hook"),
    )

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        self.mp = monkeypatch

    def __enter__(self) -> CountHooks:
        from torch.nn.modules import module as mod

        for owner, name in self.NAMES:
            orig = getattr(owner, name)

            def counted(*a, __n=name, __o=orig, **k):  # type: ignore[no-untyped-def]
                self.calls.append(__n)
                return __o(*a, **k)

            self.mp.setattr(owner, name, counted)
        for name in ("register_module_forward_pre_hook", "register_module_forward_hook"):
            orig = getattr(mod, name)

            def counted_g(*a, __n=name, __o=orig, **k):  # type: ignore[no-untyped-def]
                self.calls.append(__n)
                return __o(*a, **k)

            self.mp.setattr(mod, name, counted_g)
        return self

    def __exit__(self, *exc: object) -> None:
        self.mp.undo()


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_clean_step_reads_once_and_registers_no_hook(
    precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = CausalLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # SGD itself never syncs
    guard = Guard(model, opt, precision=precision)  # type: ignore[arg-type]
    ids, y = lm_batch(0)
    guard.step(lambda: lm_loss(model, ids, y))  # warm-up (first snapshot, buffers)
    for _ in range(6):  # a snapshot step among them
        with CountHooks(monkeypatch) as hooks, CountSyncs() as syncs:
            r = guard.step(lambda: lm_loss(model, ids, y))
        # exact: the one read; deferred: none, but on the steps it runs exactly (a
        # snapshot step), which return a decided result at once
        deferred = guard.sync == "deferred" and not r.settled
        assert r.action == "applied"
        assert syncs.calls == ([] if deferred else ["tolist"]), syncs.calls
        assert hooks.calls == [], hooks.calls
    guard.close()


def test_a_guarded_model_outside_guard_step_holds_nothing() -> None:
    torch.manual_seed(0)
    model = net(nn.Tanh())
    for watch in ("replay", "hooks"):
        guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), watch=watch)  # type: ignore[arg-type]
        guard.step(lambda: model(X).pow(2).mean())
        with torch.no_grad():
            for _ in range(200):
                model(X)
        with torch.inference_mode():
            model(X)
        if guard.monitor is not None:
            assert guard.monitor.packed_records() is None  # no record piled up
        assert guard.step(lambda: model(X).pow(2).mean()).action == "applied"
        guard.close()


def test_a_replay_does_not_advance_a_monitor() -> None:
    model = net(nn.Tanh())
    with Monitor(model) as mon:
        model(X).sum().backward()
        step = mon.step
        bad = X * math.nan
        assert replay(lambda: model(bad).sum().backward()) is not None
        assert mon.step == step


def test_an_fp16_backward_bug_is_localized_once_the_scale_cannot_back_off() -> None:
    from floatguard import DynamicLossScaler

    model = net(SqrtAtZero())
    scaler = DynamicLossScaler(init_scale=4.0, min_scale=1.0)
    guard = Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", scaler=scaler
    )
    results = [guard.step(lambda: model(X).float().pow(2).mean()) for _ in range(4)]
    assert [(r.reason, r.scale) for r in results] == [
        ("overflow", 4.0),
        ("overflow", 2.0),
        ("nonfinite_grad", 1.0),
        ("nonfinite_grad", 1.0),
    ]
    f = results[2].fault
    assert f is not None and (f.phase, f.module) == ("backward", "1")
    guard.close()


def test_an_inf_reaching_a_norm_layer_is_the_input_not_the_norm() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 3))
    bad = X.clone()
    bad[0, 0] = math.inf  # LayerNorm computes inf * 0 = NaN from it
    r = replay(lambda: model(bad).sum().backward(), model=model)
    assert r is not None and (r.phase, r.tensor, r.kind) == ("input", "input[0]", "inf")


def test_a_tied_weight_gives_no_birth_in_a_module_that_never_ran() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.unused = nn.Linear(8, 8)  # first owner of the weight; never called
            self.used = nn.Linear(8, 8)
            self.used.weight = self.unused.weight
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.used(x)))

    torch.manual_seed(0)
    model = Tied()
    with torch.no_grad():
        model.used.weight[0, 0] = math.nan
    with Monitor(model) as mon:
        loss = model(X).sum()
        mon.check_loss(loss)
        loss.backward()
    assert [(f.module, f.phase, f.tensor) for f in mon.faults] == [
        ("used", "forward", "param:weight")
    ]
    guard, fault = one_step(model, lambda: model(X).sum())
    assert fault.phase == "param"
    assert (fault.module, fault.tensor) == ("unused", "param:weight")  # its first name
    guard.close()


def test_a_closure_that_raises_leaves_nothing_behind() -> None:
    model = net(nn.Tanh())
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16")
    before = [p.detach().clone() for p in model.parameters()]

    def broken() -> torch.Tensor:
        loss = model(X).float().pow(2).mean()
        loss.backward()  # a gradient already accumulated before the error
        raise KeyError("label")

    with pytest.raises(KeyError):
        guard.step(broken)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    r = guard.step(lambda: model(X).float().pow(2).mean())  # the next step is whole
    assert r.action == "applied" and r.step == 0
    guard.close()


def test_nan_in_data_the_closure_captured_is_the_input() -> None:
    """A corrupted loss weight (data given to the step, not made by it) is phase input,
    at the line that used it."""
    model = net(nn.Tanh())
    weights = torch.ones(4, 3)
    weights[1, 1] = math.nan
    _, f = one_step(model, lambda: (model(X).pow(2) * weights).mean())
    assert (f.phase, f.kind, f.op, f.deterministic) == ("input", "nan", "input", True)
    assert f.source is not None and "* weights" in f.source


def test_under_fp16_a_weight_past_its_range_is_a_bad_parameter() -> None:
    """A flipped exponent bit leaves 0.02 as ~2e37: finite in float32, inf once cast to
    fp16 by autocast: rolled back at once like a NaN weight."""
    model = net(nn.Tanh())
    with torch.no_grad():
        model[2].weight[0, 0] = 2e37
    _, f = one_step(model, lambda: model(X).float().pow(2).mean(), precision="fp16")
    assert (f.phase, f.module, f.tensor, f.kind) == ("param", "2", "param:weight", "inf")
