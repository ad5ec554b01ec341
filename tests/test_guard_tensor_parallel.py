"""The guard under DTensor placements, on 2 and 4 gloo ranks (CPU): tensor parallelism
(1-D, with SequenceParallel's Partial gradients), 2-D dp x tp (torchtitan's layout),
HSDP, and a model mixing DTensor and plain parameters.

Every clean step's ``StepResult.grad_norm`` is compared with an independent reference:
the same step's gradients computed outside the guard, ``full_tensor()`` of every DTensor
gradient and every plain gradient once, in float64. The mixed model is clipped under
every clip policy (and in fp16) and its clipped gradients compared with the reference
gradients clipped by hand; a NaN batch and a NaN weight on one rank are one decision
everywhere, and a rollback leaves every rank's parameters the same, the state restored.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from floatguard import ClipPolicy, Guard, ResponsePolicy, ZClip, ZClipConfig
from floatguard.scaling.loss_scale import DynamicLossScaler
from floatguard.stability.clip import clip_grad_norm_

from ._ranks import run_ranks

pytestmark = pytest.mark.ranks

REL = 1e-6  # the guard's norms are float32 per tensor, summed in float64


class MLP(nn.Module):
    """LayerNorm, a column- then row-parallel pair, a head (plain under 1-D TP), and two
    buffers each forward counts in (a DTensor and a plain one under 1-D TP)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.head = nn.Linear(8, 1)
        self.register_buffer("calls", torch.zeros(2))
        self.register_buffer("calls_placed", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.calls += 1
            self.calls_placed += 1
        return self.head(self.down(torch.relu(self.up(self.ln(x)))))


def _replicate(module: nn.Module, mesh: Any) -> None:
    """``module``'s parameters as Replicate DTensors (inputs in, outputs out as plain)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def inputs(mod: nn.Module, args: Any, mesh: Any) -> Any:
        return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False) for a in args)

    def outputs(mod: nn.Module, out: Any, mesh: Any) -> Any:
        return out.to_local()

    distribute_module(module, mesh, input_fn=inputs, output_fn=outputs)


def _build(layout: str, rank: int) -> tuple[nn.Module, int]:
    """The model laid out as ``layout``; the seed of this rank's data (ranks that share
    a tensor-parallel group see the same batches)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = MLP()
    if layout == "tp":  # a Replicate LayerNorm and bias, sharded weights, a plain head
        mesh = init_device_mesh("cpu", (2,))
        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        _replicate(model.ln, mesh)
        model.calls_placed = distribute_tensor(model.calls_placed, mesh, [Replicate()])
        return model, 0
    if layout == "sp":  # SequenceParallel: the LayerNorm's gradients are Partial
        mesh = init_device_mesh("cpu", (2,))
        plan = {
            "ln": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Replicate()),
        }
        parallelize_module(model, mesh, plan)  # type: ignore[arg-type]
        return model, 0
    if layout == "2d":  # tp inside, fully_shard over dp: (Shard, Replicate) placements
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        return model, rank // 2
    assert layout == "hsdp"  # replicate x shard: (Replicate, Shard) placements
    fully_shard(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard")))
    return model, rank


def _batch(layout: str, g: torch.Generator, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    if layout == "sp":  # SequenceParallel: each rank's input is its part of the sequence
        x, y = torch.randn(4, 12, 8, generator=g), torch.randn(4, 12, 1, generator=g)
        return x[:, 6 * rank : 6 * rank + 6], y
    return torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full tensor (a collective), a plain tensor as it is; detached."""
    full = getattr(t, "full_tensor", None)
    return (full() if callable(full) else t).detach().clone()


def _reference(
    model: nn.Module, loss: Callable[[], torch.Tensor], fp16_scale: float | None = None
) -> tuple[list[torch.Tensor], float]:
    """This step's gradients computed outside the guard, as full tensors, and their
    global norm in float64 (each plain gradient once); the gradients are zeroed after.
    ``fp16_scale``: under fp16 autocast, the backward of the loss times that scale, the
    gradients divided by it (a power of two: exact), as the guard's scaler does."""
    if fp16_scale is None:
        loss().backward()
    else:
        with torch.autocast("cpu", dtype=torch.float16):
            value = loss()
        (value * torch.full((), fp16_scale, dtype=torch.float32)).backward()
    grads = [_full(p.grad) for p in model.parameters() if p.grad is not None]
    if fp16_scale is not None:
        grads = [g * (1.0 / fp16_scale) for g in grads]
    model.zero_grad(set_to_none=True)
    return grads, math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))


def _standalone(model: nn.Module, loss: Callable[[], torch.Tensor]) -> dict[str, Any]:
    """floatguard's clip_grad_norm_ (outside a guard) and torch's, on one backward."""
    loss().backward()
    grads = sorted({str(getattr(p.grad, "placements", "plain")) for p in model.parameters()})
    out: dict[str, Any] = {"grads": grads}
    out["floatguard"] = float(clip_grad_norm_(model.parameters(), 1e9))
    try:
        out["torch"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    except RuntimeError as e:
        out["torch"] = str(e).splitlines()[0]
    model.zero_grad(set_to_none=True)
    return out


def _norm_worker(rank: int, world: int, out: str, layout: str) -> dict[str, Any]:
    model, seed = _build(layout, rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = Guard(model, opt, clip=ClipPolicy(kind="none"))
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(4):
        x, y = _batch(layout, g, rank)

        def loss(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            return ((model(x) - y) ** 2).mean()

        _, ref = _reference(model, loss)
        r = guard.step(loss)
        pairs.append((r.action, r.grad_norm, ref))
    guard.finish()
    guard.close()
    x, y = _batch(layout, g, rank)
    _, ref = _reference(model, lambda: ((model(x) - y) ** 2).mean())
    alone = _standalone(model, lambda: ((model(x) - y) ** 2).mean())
    placements = sorted({str(getattr(p, "placements", "plain")) for p in model.parameters()})
    return {"pairs": pairs, "placements": placements, "standalone": (alone, ref)}


_MIXED = "got mixed torch.Tensor and DTensor"
_MESHES = "must have the same mesh"


@pytest.mark.parametrize(
    ("layout", "world", "kinds", "torch_says"),
    [
        ("tp", 2, {"(Shard(dim=0),)", "(Shard(dim=1),)", "(Replicate(),)", "plain"}, _MIXED),
        ("sp", 2, {"(Shard(dim=0),)", "(Replicate(),)", "plain"}, _MIXED),
        ("2d", 4, {"(Shard(dim=0), Replicate())", "(Shard(dim=0),)"}, _MESHES),
        ("hsdp", 4, {"(Replicate(), Shard(dim=0))"}, None),
    ],
    ids=["tp-1d", "tp-sequence-parallel", "dp-x-tp", "hsdp"],
)
def test_the_norm_is_the_global_norm(
    tmp_path: Path,
    layout: str,
    world: int,
    kinds: set,  # type: ignore[type-arg]
    torch_says: str | None,
) -> None:
    """Shard pieces added, Replicate ones counted once, Partial ones reduced first, a
    parameter on the dp mesh only (2-D: its tp copies) once, plain ones once."""
    res = run_ranks(_norm_worker, world, tmp_path, layout, timeout=120)
    assert all("pairs" in res[r] for r in range(world)), res
    assert kinds <= set(res[0]["placements"]), res[0]["placements"]  # the layout's placements
    alone, alone_ref = res[0]["standalone"]
    assert ("(Partial(sum),)" in alone["grads"]) == (layout == "sp"), alone  # LayerNorm's
    for r in range(world):
        assert res[r]["pairs"] == res[0]["pairs"]  # one decision, one norm, every rank
    for action, norm, ref in res[0]["pairs"]:
        assert action == "applied"
        assert abs(norm - ref) <= REL * ref, f"guard {norm!r}, full tensors {ref!r}"
    # floatguard's clip_grad_norm_ outside a guard: the global norm too (DTensors per
    # mesh, plain tensors as they are); torch's refuses a model that mixes them, or
    # DTensors on two meshes.
    assert abs(alone["floatguard"] - alone_ref) <= REL * alone_ref, (alone, alone_ref)
    if torch_says is not None:
        assert torch_says in alone["torch"], alone
    else:
        assert isinstance(alone["torch"], float), alone
        assert abs(alone["torch"] - alone_ref) <= REL * alone_ref, (alone, alone_ref)


def _replicated_worker(rank: int, world: int, out: str) -> list[tuple[float, float]]:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    _replicate(model, init_device_mesh("cpu", (world,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, opt, clip=ClipPolicy(kind="none"))
    g = torch.Generator().manual_seed(0)
    pairs = []
    for _ in range(24):
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)

        def loss(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            return ((model(x) - y) ** 2).mean()

        w, b = (float(torch.linalg.vector_norm(t)) for t in _reference(model, loss)[0])
        exact = math.sqrt(w**2 + b**2)  # float32 norms, squared and added in float64
        pairs.append((guard.step(loss).grad_norm, exact))
    guard.finish()
    guard.close()
    return pairs


def test_a_gradient_replicated_on_3_ranks_is_counted_once_exactly(tmp_path: Path) -> None:
    """Replicate gradients on 3 ranks count on rank 0 only (weights 0 and 1): the agreed
    norm is theirs, bit for bit. (Weights of 1/3, which float64 cannot hold, leave the
    norm an ulp off in 2 of these 24 steps.)"""
    res = run_ranks(_replicated_worker, 3, tmp_path, timeout=90)
    assert isinstance(res[0], list) and res[0] == res[1] == res[2], res
    for norm, exact in res[0]:
        assert norm == exact, (norm, exact)


# ------------------------------------------------------------------ clipping
CLIPS = {
    "none": ClipPolicy(kind="none"),
    "norm": ClipPolicy(kind="norm", max_norm=0.3),
    "value": ClipPolicy(kind="value", max_value=0.02),
    # with its absolute cap (warmup: clip_grad_norm_ to it), then the z-test alone
    "zclip": ClipPolicy(zclip=ZClipConfig(warmup_steps=2, z_thresh=0.5, max_grad_norm=0.6)),
    "zclip-mean": ClipPolicy(
        zclip=ZClipConfig(warmup_steps=2, z_thresh=0.5, clip_option="mean", max_grad_norm=None)
    ),
}
CASES = [(name, "fp32") for name in CLIPS] + [("zclip", "fp16"), ("norm", "fp16")]


def _expected(policy: ClipPolicy, zclip: ZClip | None, ref_norm: float) -> float:
    """The clip coefficient for the reference norm, computed apart from the guard."""
    if zclip is not None:
        clip_value, clipped, coef = zclip.compute(ref_norm)
        zclip.update(ref_norm, clip_value, clipped)
        return float(coef)
    if policy.kind == "norm":
        return min(1.0, policy.max_norm / (ref_norm + 1e-6))
    return 1.0


def _clip_case(rank: int, name: str, precision: str) -> list[tuple[Any, ...]]:
    """Five steps of the mixed 1-D TP model under ``CLIPS[name]``: per step the action,
    the guard's norm, the reference norm, the guard's and the expected coefficient,
    whether optimizer.step() got the reference gradients clipped by hand (bit for bit),
    and whether clipping changed them."""
    model, _ = _build("tp", rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[list[torch.Tensor]] = []  # the gradients optimizer.step() gets
    opt.register_step_pre_hook(
        lambda *_: seen.append([_full(p.grad) for p in model.parameters()])  # type: ignore[arg-type]
    )
    policy = CLIPS[name]
    scaler = DynamicLossScaler(init_scale=2.0**4, enabled=precision == "fp16")
    guard = Guard(model, opt, precision=precision, clip=policy, scaler=scaler)  # type: ignore[arg-type]
    zclip = ZClip(policy.zclip, on_host=True) if policy.kind == "zclip" else None
    g = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(5):
        x, y = _batch("tp", g, rank)

        def loss(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            return ((model(x) - y) ** 2).mean()

        scale = scaler.get_scale() if precision == "fp16" else None
        grads, ref = _reference(model, loss, scale)
        r = guard.step(loss)
        want = _expected(policy, zclip, ref)
        got = seen[-1]
        if policy.kind == "value":
            clipped = [gr.clamp(-policy.max_value, policy.max_value) for gr in grads]
        else:
            clipped = [gr * r.clip_coef for gr in grads]
        same = all(torch.equal(a, b) for a, b in zip(got, clipped, strict=True))
        changed = not all(torch.equal(a, b) for a, b in zip(got, grads, strict=True))
        steps.append((r.action, r.grad_norm, ref, r.clip_coef, want, same, changed))
    guard.finish()
    guard.close()
    return steps


def _clip_worker(rank: int, world: int, out: str) -> dict[str, Any]:
    return {f"{name}-{precision}": _clip_case(rank, name, precision) for name, precision in CASES}


def test_a_mixed_model_is_clipped_as_the_reference_under_every_policy(tmp_path: Path) -> None:
    """1-D TP with a Replicate LayerNorm and a plain head: DTensor and plain gradients in
    one list for every foreach op (norm, unscale, scale, clamp): the clipped gradients
    optimizer.step() gets are the reference gradients clipped by hand, bit for bit."""
    res = run_ranks(_clip_worker, 2, tmp_path, timeout=120)
    assert "norm-fp32" in res[0] and res[0] == res[1], res
    for case, steps in res[0].items():
        for i, (action, norm, ref, coef, want, same, _) in enumerate(steps):
            where = f"{case} step {i}"
            assert action == "applied", where
            assert abs(norm - ref) <= REL * ref, (where, norm, ref)
            assert abs(coef - want) <= REL * want, (where, coef, want)
            assert same, where
    clipped = {case: sum(s[6] for s in steps) for case, steps in res[0].items()}
    assert clipped["none-fp32"] == 0 and clipped["value-fp32"] == 5, clipped
    assert all(clipped[c] >= 3 for c in ("norm-fp32", "zclip-fp32", "norm-fp16", "zclip-fp16"))
    assert clipped["zclip-mean-fp32"] >= 1, clipped  # the z-test fired


# ------------------------------------------------------------------- faults
NAN_BATCH, NAN_WEIGHT, STEPS = 3, 6, 9


def _fault_worker(rank: int, world: int, out: str, layout: str) -> dict[str, Any]:
    model, seed = _build(layout, rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = Guard(model, opt, response=ResponsePolicy(snapshot_every=2))
    g = torch.Generator().manual_seed(seed)
    results, before, rolled_back = [], [], None
    for step in range(STEPS):
        x, y = _batch(layout, g, rank)
        if rank == 1 and step == NAN_BATCH:
            x[0, 0] = math.nan  # a NaN batch on rank 1 only
        if rank == 1 and step == NAN_WEIGHT:
            with torch.no_grad():  # rank 1's piece of a weight goes bad
                model.up.weight.to_local()[0, 0] = math.nan  # type: ignore[operator]
        before.append(_state(model))
        r = guard.step(lambda x=x, y=y: ((model(x) - y) ** 2).mean())
        after = _state(model)
        unchanged = all(torch.equal(a, b) for a, b in zip(before[-1], after, strict=True))
        results.append((r.action, r.reason, None if r.fault is None else r.fault.rank, unchanged))
        if r.action == "rolled_back":
            rolled_back = after
    (rollback,) = guard.events.of_kind("rollback")
    guard.finish()
    guard.close()
    n = len(list(model.parameters()))  # (a snapshot's buffers are after its forward)
    assert rolled_back is not None
    return {
        "results": results,
        "restored": before[rollback.fields["to_step"]][:n],  # the weights it went back to
        "rolled_back": rolled_back[:n],
        "final": _state(model),
    }


def _state(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer as a full tensor."""
    return [_full(t) for t in [*model.parameters(), *model.buffers()]]


@pytest.mark.parametrize(("layout", "world"), [("tp", 2), ("2d", 4)], ids=["tp-1d", "dp-x-tp"])
def test_a_fault_on_one_rank_is_skipped_or_rolled_back_on_every_rank(
    tmp_path: Path, layout: str, world: int
) -> None:
    """A NaN batch on rank 1 (TP spreads it to every rank's loss): skipped everywhere,
    nothing changed (the buffers the forward counts in, a DTensor and a plain one, put
    back). A NaN in rank 1's piece of a weight: named on rank 1, rolled back
    on every rank to the same snapshot, the full parameters equal to that step's; every
    rank's parameters and buffers the same at the end."""
    res = run_ranks(_fault_worker, world, tmp_path, layout, timeout=120)
    assert all("results" in res[r] for r in range(world)), res
    a = res[0]["results"]
    assert all(res[r]["results"] == a for r in range(world))  # one decision everywhere
    assert a[NAN_BATCH] == ("skipped", "nonfinite_input", 1, True)
    assert a[NAN_WEIGHT][:3] == ("rolled_back", "nonfinite_param", 1)
    assert all(r[0] == "applied" and not r[3] for i, r in enumerate(a)
               if i not in (NAN_BATCH, NAN_WEIGHT))  # fmt: skip
    for r in range(world):
        for got, want, ref in zip(
            res[r]["rolled_back"], res[r]["restored"], res[0]["rolled_back"], strict=True
        ):
            assert torch.equal(got, want) and torch.equal(got, ref)
        for got, ref in zip(res[r]["final"], res[0]["final"], strict=True):
            assert torch.equal(got, ref) and bool(got.isfinite().all())
