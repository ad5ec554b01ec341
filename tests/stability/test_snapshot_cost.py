"""What a snapshot step costs and keeps (issue 26.2): the RNG states a snapshot holds by
where it goes, the capture's measured cost feeding a budget on CPU too, and the vetting's
one-pass common case agreeing with the full rule."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from floatguard import Guard, ResponsePolicy
from floatguard.guard.vetting import FLOOR, IMPLAUSIBLE, JUMP, all_clean
from floatguard.stability.snapshot import Snapshot, load_snapshot
from floatguard.stability.snapshot_cadence import MAX_INTERVAL


def _setup() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return model, opt, torch.randn(16, 4), torch.randn(16, 1)


def _py_np() -> tuple[object, list[int]]:
    return random.getstate(), np.random.get_state()[1].tolist()


# --- the RNG states a snapshot holds ----------------------------------------------------
def test_capture_keeps_the_rng_states_asked_for_and_restore_puts_back_the_kind_asked() -> None:
    model = nn.Linear(2, 2)
    full = Snapshot.capture(0, {"model": model})
    assert full.rng is not None and {"torch", "python", "numpy"} <= set(full.rng)
    torch_only = Snapshot.capture(0, {"model": model}, rng="torch")
    assert torch_only.rng is not None and set(torch_only.rng) - {"cuda"} == {"torch"}
    assert Snapshot.capture(0, {"model": model}, rng=False).rng is None
    with pytest.raises(ValueError, match="rng='python'"):
        Snapshot.capture(0, {"model": model}, rng="python")  # type: ignore[arg-type]

    # restore(rng="torch") puts torch's back and leaves Python's and NumPy's alone
    torch_draw = torch.rand(3)
    random.random()
    np.random.rand()
    py_np = _py_np()
    full.restore({"model": model}, rng="torch")
    assert torch.equal(torch.rand(3), torch_draw)
    assert _py_np() == py_np
    full.restore({"model": model})  # all of them
    assert torch.equal(torch.rand(3), torch_draw)
    assert full.rng is not None and random.getstate()[1] == tuple(full.rng["python"][1])


def test_a_rollback_rewinds_torch_rng_but_not_the_data_pipelines() -> None:
    model, opt, x, y = _setup()
    guard = Guard(model, opt, response=ResponsePolicy(snapshot_every=2), clip=None)

    def closure() -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)

    for _ in range(3):
        assert guard.step(closure).action == "applied"
        random.random()  # the data pipeline draws between steps
        np.random.rand()
    snap = guard.last_snapshot
    assert snap is not None and snap.rng is not None
    assert set(snap.rng) - {"cuda"} == {"torch"}  # in memory: torch's only (~1 us, not ~60)
    py_np = _py_np()
    with torch.no_grad():
        model[0].weight[0, 0] = math.nan
    assert guard.step(closure).action == "rolled_back"
    assert _py_np() == py_np  # not rewound: the data stream goes on
    assert torch.equal(torch.get_rng_state(), snap.rng["torch"])
    guard.close()


def test_a_snapshot_bound_for_disk_keeps_every_rng_and_a_resume_puts_them_back(
    tmp_path: Path,
) -> None:
    model, opt, x, y = _setup()
    policy = ResponsePolicy(snapshot_every=2, snapshot_dir=str(tmp_path), disk_every=2)
    guard = Guard(model, opt, response=policy, clip=None)

    def closure() -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)

    kinds: list[set[str]] = []
    for _ in range(6):
        guard.step(closure)
        snap = guard.last_snapshot
        assert snap is not None and snap.rng is not None
        kinds.append(set(snap.rng) - {"cuda"})
    # snapshots 0 (before step 0), 2 and 4 (steps 2, 4): the 1st and 3rd go to disk
    on_disk = sorted(tmp_path.glob("snapshot-*.fgs"))
    assert [int(p.stem.split("-")[1]) for p in on_disk] == [0, 4]
    assert kinds[-1] == {"torch", "python", "numpy"}  # snapshot of step 4: written
    assert kinds[2] == {"torch"}  # snapshot of step 2: memory only
    written = load_snapshot(on_disk[-1])
    assert written.rng is not None and {"python", "numpy"} <= set(written.rng)
    guard.close()

    random.random()
    np.random.rand()
    model2, opt2, _, _ = _setup()
    resumed = Guard(model2, opt2, response=policy, clip=None)
    assert resumed.resume() == 4
    assert random.getstate()[1] == tuple(written.rng["python"][1])
    assert np.random.get_state()[1].tolist() == written.rng["numpy"][1].tolist()
    resumed.close()


# --- the measured cost, and a budget on CPU ----------------------------------------------
def test_a_device_snapshot_measures_its_capture() -> None:
    model, opt, _, _ = _setup()
    snap = Snapshot.capture(0, {"model": model, "optimizer": opt}, on="device")
    first = snap.copy_seconds()
    assert first is not None and first > 0
    again = Snapshot.capture(1, {"model": model, "optimizer": opt}, on="device", reuse=snap)
    assert again is snap  # reused in place, and timed again
    assert snap.copy_seconds() is not None and snap.copy_seconds() != first


@pytest.mark.parametrize(
    ("budget", "snapshot_steps"),
    [
        (None, [0, 5, 10, 15, 20, 25]),  # the fixed cadence: every 5 good steps
        # a budget no snapshot meets: every 5 until the first cost is known, then
        # the cap (a CPU capture is timed on the host)
        (1e-12, [0, 5]),
    ],
    ids=["fixed", "budget"],
)
def test_an_explicit_budget_sets_the_cadence_of_cpu_snapshots(
    budget: float | None, snapshot_steps: list[int]
) -> None:
    model, opt, x, y = _setup()
    guard = Guard(
        model, opt, response=ResponsePolicy(snapshot_budget=budget), clip=None, spikes=None
    )
    steps = []
    for _ in range(30):
        guard.step(lambda: nn.functional.mse_loss(model(x), y))
        snap = guard.last_snapshot
        assert snap is not None
        if not steps or steps[-1] != snap.step:
            steps.append(snap.step)
    assert steps == snapshot_steps
    assert MAX_INTERVAL > 30
    guard.close()


# --- the vetting's common case ------------------------------------------------------------
def _full_rule(
    values: list[float], params: list[int], keys: list[str], before: dict[str, float], limit: float
) -> bool:
    """The rule as StateCheck.vet's full pass states it: nothing bad."""
    for i, v in enumerate(values):
        is_param = i in params
        if not math.isfinite(v) or (is_param and v > limit):
            return False
        if is_param:
            b = before.get(keys[i])
            if v > IMPLAUSIBLE or (b is not None and v > FLOOR and v > JUMP * b):
                return False
    return True


@pytest.mark.parametrize(
    ("values", "before", "limit"),
    [
        ([1.0, 2.0, 3.0], {}, math.inf),
        ([math.nan, 2.0, 3.0], {}, math.inf),  # an optimizer state NaN
        ([1.0, math.inf, 3.0], {}, math.inf),  # a parameter inf
        ([1.0, 7e4, 3.0], {}, 65504.0),  # past fp16 under fp16
        ([1.0, 7e4, 3.0], {}, math.inf),
        ([1e30, 2.0, 3.0], {}, math.inf),  # a huge optimizer state is no parameter
        ([1.0, 2.0**65, 3.0], {}, math.inf),  # beyond any trained weight
        ([1.0, 2.0**64, 3.0], {}, math.inf),  # exactly the bound: fine
        ([1.0, FLOOR, 3.0], {"m.param:w": 1e-3}, math.inf),  # at the floor: fine
        ([1.0, FLOOR * 2, 3.0], {"m.param:w": 1e-3}, math.inf),  # a jump past the floor
        ([1.0, JUMP * 1.0, 3.0], {"m.param:w": 1.0}, math.inf),  # exactly JUMP x: fine
        ([1.0, JUMP * 1.0 + 1, 3.0], {"m.param:w": 1.0}, math.inf),
        ([1e308, 1e308, 1.0], {}, math.inf),  # the sum overflows: the full pass decides
        ([1.0, 2.0, -0.0], {}, math.inf),
    ],
)
def test_the_one_pass_check_agrees_with_the_full_rule(
    values: list[float], before: dict[str, float], limit: float
) -> None:
    params, keys = [1, 2], ["m.optimizer:w.exp_avg", "m.param:w", "m.param:b"]
    quick = all_clean(values, params, keys, before, limit)
    full = _full_rule(values, params, keys, before, limit)
    assert quick <= full  # never says clean when the full rule finds something
    if math.isfinite(sum(values)):
        assert quick == full  # and agrees whenever the sum is finite
