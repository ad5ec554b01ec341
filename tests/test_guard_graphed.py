"""Guard.graphed (issue 43, item 5): the deferred step as one CUDA graph replay. On the
CPU the "check" backend runs each step eagerly and compares its operators with the
captured step's: these tests show the capture path decides exactly what the eager
deferred (and exact) guard decides, with no host read on a replayed step, and that
what a graph would replay wrongly is named (GraphUnsafe) and leaves no trace."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from floatguard import ClipPolicy, Guard, ResponsePolicy, SpikePolicy
from floatguard.guard import GraphUnsafe
from floatguard.stability.clip import ZClip
from tests.test_guard_deferred import batches, host_reads

MODELS = {
    "plain": lambda: nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)),
    "batchnorm": lambda: nn.Sequential(
        nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)
    ),
    "dropout": lambda: nn.Sequential(
        nn.Linear(8, 32), nn.Dropout(0.3), nn.Tanh(), nn.Linear(32, 4)
    ),
}


def _optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)


def _run(mode: str, kind: str = "plain", opt: str = "sgd", precision: str = "fp32",
         clip: ClipPolicy | None = None, n: int = 40) -> dict[str, Any]:  # fmt: skip
    """A run with NaN batches (a bad-data skip), a NaN weight (a rollback) and a loss
    spike: ``mode`` exact, deferred (eager) or graphed."""
    torch.manual_seed(0)
    model = MODELS[kind]()
    guard = Guard(
        model, _optimizer(model, opt), sync="exact" if mode == "exact" else "deferred",
        precision=precision, clip=clip, spikes=SpikePolicy(window=10, z=6.0),
        response=ResponsePolicy(rollback_after=3),
    )  # fmt: skip
    data = batches(n)

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)

    graphed = guard.graphed(loss_fn, *data[0]) if mode == "graphed" else None
    rows = []
    for i, (x, y) in enumerate(data):
        if i in (12, 13):
            x = x * float("inf")
        if i == 25:
            with torch.no_grad():
                model[0].weight[0, 0] = float("nan")
        if i == 30:
            y = y * 300
        r = graphed(x, y) if graphed else guard.step(lambda x=x, y=y: loss_fn(x, y))
        rows.append(r)
    guard.close()
    return {
        "rows": [(r.step, r.action, r.reason) for r in rows],
        "losses": [r.loss for r in rows],
        "state": [p.detach().clone() for p in model.parameters()] + list(model.buffers()),
        "rng": torch.rand(3),
        "graphed": graphed,
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["rows"] == b["rows"]
    assert all(x == y or (x != x and y != y) for x, y in zip(a["losses"], b["losses"], strict=True))
    assert all(torch.equal(x, y) for x, y in zip(a["state"], b["state"], strict=True))
    assert torch.equal(a["rng"], b["rng"])  # the same draws (dropout) in the same order


@pytest.mark.parametrize(
    ("kind", "opt", "precision", "clip"),
    [
        ("plain", "sgd", "fp32", None),
        ("plain", "adamw_fused", "fp32", ClipPolicy(kind="norm", max_norm=0.5)),
        ("batchnorm", "sgd", "fp32", ClipPolicy(kind="value", max_value=0.05)),
        ("dropout", "adamw_fused", "bf16", None),
    ],
)
def test_a_graphed_run_decides_what_the_exact_mode_decides(
    kind: str, opt: str, precision: str, clip: ClipPolicy | None
) -> None:
    """Bit for bit against the exact and the eager deferred guard: the actions and
    causes, the losses, the weights and buffers, the RNG after the run (ZClip, the
    default, clips from its state written to the device before each replay)."""
    exact = _run("exact", kind, opt, precision, clip)
    graphed = _run("graphed", kind, opt, precision, clip)
    _same(graphed, exact)
    _same(graphed, _run("deferred", kind, opt, precision, clip))
    actions = {a for _, a, _ in exact["rows"]}
    assert {"skipped", "rolled_back"} <= actions, exact["rows"]
    g = graphed["graphed"]
    # the eager steps: 3 of warm-up, the snapshot steps, the batches around the rollback
    assert g.replays >= 25 and g.replays + g.eager_steps == 40
    assert g.captures == 2  # the rollback loaded the optimizer's state anew: captured again


def test_a_replayed_step_reads_nothing_to_the_host() -> None:
    model = MODELS["plain"]()
    guard = Guard(model, _optimizer(model, "adamw_fused"), sync="deferred",
                  response=ResponsePolicy(snapshot_every=10**6))  # fmt: skip
    data = batches(12)
    step = guard.graphed(lambda x, y: nn.functional.mse_loss(model(x), y), *data[0])
    reads = []
    for x, y in data:
        guard.settle()  # (outside the count: the host's settling of the step before)
        with host_reads() as log:
            step(x, y)
        reads.append(sum(who.startswith("floatguard") for _, who in log))
    guard.close()
    assert step.replays == 9 and step.eager_steps == 3
    assert reads[3:] == [0] * 9, reads  # (the first warm-up step runs exactly: one read)


def test_a_number_baked_into_the_step_is_named_and_leaves_no_trace() -> None:
    """A float LR a scheduler moves is a number a CUDA graph would bake in: named (the
    operator, the argument, both values), and the step undone whole; a tensor LR
    replays."""
    model = MODELS["plain"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.9**k)
    guard = Guard(model, opt, scheduler=sched, sync="deferred")
    data = batches(10)
    step = guard.graphed(lambda x, y: nn.functional.mse_loss(model(x), y), *data[0])
    for x, y in data[:4]:  # three warm-up steps, the capture
        step(x, y)
    guard.settle()
    before = [p.detach().clone() for p in model.parameters()]
    moments = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    count = guard.step_count
    with pytest.raises(GraphUnsafe, match=r"aten\.add_.*'alpha' was -0\.0729.* is -0\.06561"):
        step(*data[4])
    assert guard.step_count == count
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert all(
        torch.equal(a, opt.state[p]["momentum_buffer"])
        for a, p in zip(moments, model.parameters(), strict=True)
    )
    guard.close()
    model = MODELS["plain"]()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.9**k)
    guard = Guard(model, opt, scheduler=sched, sync="deferred")
    step = guard.graphed(lambda x, y: nn.functional.mse_loss(model(x), y), *data[0])
    for x, y in data:
        step(x, y)
    guard.close()
    assert step.replays >= 5


def test_a_host_read_in_the_step_is_named() -> None:
    """AdamW without fused=True (or capturable=True) reads its step counter."""
    model = MODELS["plain"]()
    guard = Guard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), sync="deferred")
    data = batches(6)
    step = guard.graphed(lambda x, y: nn.functional.mse_loss(model(x), y), *data[0])
    with pytest.raises(GraphUnsafe, match="reads a tensor to the host"):
        for x, y in data:
            step(x, y)
    guard.close()


def test_bad_graphed_settings_are_named() -> None:
    model = MODELS["plain"]()
    opt = _optimizer(model, "sgd")
    x, y = batches(1)[0]

    def loss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(model(a), b)

    with pytest.raises(ValueError, match="sync='deferred'"):
        Guard(model, opt).graphed(loss, x, y)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        Guard(model, opt, sync="deferred", precision="fp16").graphed(loss, x, y)
    with pytest.raises(ValueError, match="hook the forward"):
        Guard(model, opt, sync="deferred", watch="hooks").graphed(loss, x, y)
    guard = Guard(model, opt, sync="deferred")
    with pytest.raises(TypeError, match="example batch"):
        guard.graphed(loss, x, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="warmup=1"):
        guard.graphed(loss, x, y, warmup=1)
    with pytest.raises(ValueError, match="backend='cuda'"):
        guard.graphed(loss, x, y, backend="cuda")
    step = guard.graphed(loss, x, y)
    with pytest.raises(ValueError, match=r"input 0 must be shaped like the example \(\(16, 8\)"):
        step(x[:8], y[:8])
    guard.close()


def test_zclip_from_its_state_on_the_device_is_the_hosts_coefficient() -> None:
    """The coefficient a captured step computes from ZClip's state written to the device
    (both branches computed, then selected) is the host's, bit for bit, through warm-up,
    clipped and unclipped steps."""
    host = ZClip(on_host=True, warmup_steps=5, max_grad_norm=2.0)
    g = torch.Generator().manual_seed(0)
    norms = (torch.rand(40, generator=g, dtype=torch.float64) * 3).tolist()
    norms[20] = 40.0  # a spike: clipped
    for n in norms:
        state = torch.tensor(host.host_state(), dtype=torch.float64)
        device = host.compute_from(torch.tensor(n, dtype=torch.float64), state)
        value, clipped, coef = host.compute(n)
        assert device.dtype == torch.float64 and device.item() == coef
        host.update(n, value, clipped)
    with pytest.raises(ValueError, match="host ZClip"):
        ZClip().host_state()


def _lr_run(mode: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-4), fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 10))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 16, generator=g), torch.randn(32, 16, generator=g)) for _ in range(12)]

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)

    if mode == "loop":  # the hand-written loop: the LR of step k is the schedule's k-th
        for x, y in data:
            opt.zero_grad()
            loss_fn(x, y).backward()
            opt.step()
            sched.step()
        return [p.detach().clone() for p in model.parameters()]
    guard = Guard(model, opt, scheduler=sched, sync="exact" if mode == "exact" else "deferred",
                  clip=ClipPolicy(kind="none"))  # fmt: skip
    step = guard.graphed(loss_fn, *data[0]) if mode == "graphed" else None
    for x, y in data:
        _ = step(x, y) if step else guard.step(lambda x=x, y=y: loss_fn(x, y))
    guard.close()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["exact", "deferred", "graphed"])
def test_a_tensor_lr_a_scheduler_fills_is_the_schedules_lr(mode: str) -> None:
    """lr=torch.tensor(...) (what a captured step needs): the scheduler fills it in place;
    the guard steps the scheduler before the update and puts its value back for the
    update (a copy of the value, not the object), so every update uses the schedule's
    LR: bit for bit the hand-written loop."""
    ref = _lr_run("loop")
    assert all(torch.equal(a, b) for a, b in zip(ref, _lr_run(mode), strict=True))


def test_a_refused_fused_step_leaves_its_step_counters() -> None:
    """Fused AdamW counts the step before its kernel; a refusal stops the kernel and
    puts the counters back: the step leaves no trace."""
    model = MODELS["plain"]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.9**k)  # a float LR: baked
    guard = Guard(model, opt, scheduler=sched, sync="deferred")
    data = batches(8)
    step = guard.graphed(lambda x, y: nn.functional.mse_loss(model(x), y), *data[0])
    for x, y in data[:4]:
        step(x, y)
    guard.settle()
    counters = [opt.state[p]["step"].clone() for p in model.parameters()]
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(GraphUnsafe, match=r"_fused_adamw_.*'lr'.*cycle_momentum"):
        step(*data[4])
    assert [opt.state[p]["step"] for p in model.parameters()] == counters
    assert all(torch.equal(a, p) for a, p in zip(weights, model.parameters(), strict=True))
    guard.close()


def test_what_a_graph_cannot_take_is_named() -> None:
    """A batch that requires grad (the static inputs do not), a host read in loss_fn
    (.tolist() reads a CPU tensor without an operator: caught too, with its line), a
    parameter that never gets a gradient (never captured: named, and warned), a
    graphed step of a closed guard."""
    model = MODELS["plain"]()
    guard = Guard(model, _optimizer(model, "sgd"), sync="deferred")
    data = batches(6)

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)

    step = guard.graphed(loss_fn, *data[0])
    with pytest.raises(ValueError, match=r"input 0 requires grad.*x\.detach\(\)"):
        step(data[0][0].requires_grad_(), data[0][1])
    data[0][0].requires_grad_(False)

    def reading(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(model(x), y)
        _ = loss.detach().tolist()  # a host read
        return loss

    step = guard.graphed(reading, *data[0])
    with pytest.raises(GraphUnsafe, match=r"\.tolist\(\)\) at tests/test_guard_graphed\.py"):
        for x, y in data:
            step(x, y)
    guard.close()
    with pytest.raises(RuntimeError, match=r"graphed\(\) after guard\.close\(\)"):
        guard.graphed(loss_fn, *data[0])

    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(8, 4), "unused": nn.Linear(8, 4)})
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), sync="deferred")
    step = guard.graphed(lambda x, y: nn.functional.mse_loss(model["used"](x), y), *data[0])
    with pytest.warns(RuntimeWarning, match=r"not replayed once: 2 trainable .*'unused\.weight'"):
        for _ in range(14):
            step(*data[1])
    assert step.replays == 0 and "requires_grad=False" in (step.why_eager or "")
    guard.close()
