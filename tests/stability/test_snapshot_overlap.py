"""Snapshot copies that overlap the step's compute (issue 26.1): ``snapshot_overlap=True``
copies the state as the step begins, vets it with that step's read, and keeps the
previous snapshot the rollback target until then (two copies, alternating). The CUDA
ordering is checked against the stand-in runtime of test_host_snapshot."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from floatguard import Guard, ResponsePolicy
from floatguard.stability import _host_copy

from .test_host_snapshot import _Runtime


def _setup(bn: bool = False) -> tuple[nn.Module, torch.optim.Optimizer, list[Any]]:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(4, 8)]
    if bn:
        layers.append(nn.BatchNorm1d(8))
    model = nn.Sequential(*layers, nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)) for _ in range(12)
    ]
    return model, opt, batches


def _run(overlap: bool, faults: dict[int, str] | None = None) -> dict[str, Any]:
    model, opt, batches = _setup()
    policy = ResponsePolicy(snapshot_every=2, snapshot_on="host", snapshot_overlap=overlap)
    guard = Guard(model, opt, response=policy, clip=None, spikes=None)
    out: dict[str, Any] = {"actions": [], "snaps": [], "ptrs": [], "states": []}
    for i, (x, y) in enumerate(batches):
        kind = (faults or {}).get(i)
        if kind == "nan_weight":
            with torch.no_grad():
                model[0].weight[0, 0] = math.nan
        if kind == "nan_batch":
            x = x * math.nan
        r = guard.step(lambda x=x, y=y: nn.functional.mse_loss(model(x), y))
        snap = guard.last_snapshot
        assert snap is not None and snap.on == "host"
        out["actions"].append((r.action, r.reason))
        out["snaps"].append(snap.step)
        out["ptrs"].append(snap.states["model"]["0.weight"].data_ptr())
        out["states"].append({k: v.clone() for k, v in snap.states["model"].items()})
        if r.action == "rolled_back":
            out["restored"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    guard.close()
    return out


def test_overlapped_snapshots_keep_the_same_states_at_the_same_steps() -> None:
    plain, over = _run(False), _run(True)
    assert over["actions"] == plain["actions"] == [("applied", None)] * 12
    assert over["snaps"] == plain["snaps"] == [0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10]
    for a, b in zip(over["states"], plain["states"], strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # two copies, alternating: the new one in the memory the one before the last held
    # (from step 2 on: the first snapshot, before AdamW has moments, is of another shape)
    assert len(set(over["ptrs"][2:])) == 2 and len(set(plain["ptrs"][2:])) == 1
    assert over["ptrs"][2] != over["ptrs"][4] and over["ptrs"][2] == over["ptrs"][6]


def test_a_bad_state_copied_as_its_step_began_is_never_the_rollback_target() -> None:
    """A weight goes NaN right before a snapshot step: the overlapped copy holds it, the
    step's read finds it, and the rollback restores the snapshot before (vetted)."""
    res = _run(True, {6: "nan_weight"})
    assert res["actions"][6] == ("rolled_back", "nonfinite_param")
    assert res["snaps"][5] == res["snaps"][6] == 4  # the step-6 copy was never kept
    assert all(torch.isfinite(v).all() for v in res["restored"].values())
    assert all(torch.equal(res["restored"][k], res["states"][5][k]) for k in res["restored"])
    assert res["actions"][7:] == [("applied", None)] * 5


def test_a_skipped_snapshot_step_drops_its_copy_and_the_next_step_copies_again() -> None:
    plain, over = _run(False, {4: "nan_batch"}), _run(True, {4: "nan_batch"})
    assert over["actions"][4] == ("skipped", "nonfinite_input")
    assert over["actions"] == plain["actions"]
    assert over["snaps"] == plain["snaps"]  # the snapshot is taken at step 5 instead
    assert over["snaps"][4] == 2 and over["snaps"][5] == 5


@pytest.mark.parametrize("overlap", [True, False])
def test_the_copy_is_enqueued_before_the_forward_and_fenced_before_the_update(
    monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    """On the (stand-in) device: an overlapped snapshot's copy is enqueued as the step
    begins, so the forward and backward run while it copies; the module's buffers
    (which the forward updates in place) are copied first, on the current stream; the
    update waits for the copy on the device. Without overlap the copy comes after the
    backward."""
    rt = _Runtime()
    monkeypatch.setattr(_host_copy, "CudaCopies", lambda: rt)
    real = torch._foreach_copy_

    def spy(dst: Any, src: Any, **kw: Any) -> Any:
        rt.log.append(f"copy {len(dst)}")
        return real(dst, src, **kw)

    monkeypatch.setattr(torch, "_foreach_copy_", spy)
    model, opt, batches = _setup(bn=True)
    model.register_forward_pre_hook(lambda *a: rt.log.append("forward"))
    opt.register_step_pre_hook(lambda *a: rt.log.append("update"))
    policy = ResponsePolicy(snapshot_every=2, snapshot_on="host", snapshot_overlap=overlap)
    guard = Guard(model, opt, response=policy, clip=None, spikes=None)
    steps: list[list[str]] = []
    for x, y in batches[:4]:
        mark = len(rt.log)
        guard.step(lambda x=x, y=y: nn.functional.mse_loss(model(x), y))
        steps.append(rt.log[mark:])
    monkeypatch.undo()
    third = steps[2]  # the snapshot of good steps 2, taken with step 2
    early = third.index("copy 3")  # BatchNorm's mean, var and count, on the main stream
    waits = third.index("side waits for main")
    side = third.index("copies on side")
    forward = third.index("forward")
    assert early < waits < side < third.index("main waits for done") < third.index("update")
    if overlap:
        assert side < forward  # the forward and backward run while it copies
    else:
        assert forward < early  # after the backward
    guard.close()
