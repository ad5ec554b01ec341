"""Snapshots restore bit-identical state; on-disk writes are atomic."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from floatguard import DynamicLossScaler, Snapshot, ZClip, load_snapshot


def _setup() -> tuple[nn.Module, torch.optim.Optimizer, DynamicLossScaler, ZClip]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt, DynamicLossScaler(init_scale=256.0), ZClip(warmup_steps=2)


def _train(model: nn.Module, opt: torch.optim.Optimizer, z: ZClip, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        z.step(model.parameters())
        opt.step()


def _flat(model: nn.Module) -> list[torch.Tensor]:
    return [t.clone() for t in model.state_dict().values()]


def test_restore_is_bit_identical_including_rng(tmp_path: Path) -> None:
    model, opt, scaler, z = _setup()
    _train(model, opt, z, 3)
    objs = {"model": model, "optimizer": opt, "scaler": scaler, "zclip": z}
    snap = Snapshot.capture(3, objs)  # type: ignore[arg-type]
    _train(model, opt, z, 1)
    after_one = _flat(model)
    scaler.update(found_inf=True)
    _train(model, opt, z, 4)  # drift away
    snap.restore(objs)  # type: ignore[arg-type]
    _train(model, opt, z, 1)  # same data (RNG restored), same state: same result
    assert all(torch.equal(a, b) for a, b in zip(_flat(model), after_one, strict=True))
    snap.restore(objs)  # type: ignore[arg-type]
    drawn = (torch.rand(3).tolist(), np.random.rand(), random.random())
    snap.restore(objs)  # type: ignore[arg-type]
    assert (torch.rand(3).tolist(), np.random.rand(), random.random()) == drawn
    assert scaler.get_scale() == 256.0
    path = snap.save(tmp_path / "snap.pt")
    loaded = load_snapshot(path)
    model2, opt2, scaler2, z2 = _setup()
    loaded.restore({"model": model2, "optimizer": opt2, "scaler": scaler2, "zclip": z2})
    snap.restore(objs)  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(_flat(model2), _flat(model), strict=True))
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


def test_crash_during_write_keeps_the_previous_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt, _, _ = _setup()
    objs = {"model": model, "optimizer": opt}
    target = tmp_path / "snap.pt"
    Snapshot.capture(1, objs).save(target)  # type: ignore[arg-type]
    good = target.read_bytes()

    def boom(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        Snapshot.capture(2, objs).save(target)  # type: ignore[arg-type]
    monkeypatch.undo()
    assert target.read_bytes() == good
    assert load_snapshot(target).step == 1
    assert [p.name for p in tmp_path.iterdir()] == ["snap.pt"]  # no temp file left behind

    def crash_on_rename(src: object, dst: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("os.replace", crash_on_rename)
    with pytest.raises(KeyboardInterrupt):
        Snapshot.capture(3, objs).save(target)  # type: ignore[arg-type]
    monkeypatch.undo()
    assert load_snapshot(target).step == 1


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no snapshot"):
        load_snapshot(tmp_path / "missing.pt")
    snap = Snapshot(0, {"model": {}})
    with pytest.raises(KeyError, match="no state for"):
        snap.restore({"optimizer": torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0)})


def _same_state(a: object, b: object) -> bool:
    """Equal nested states: tensors bit-equal (NaN equal), plain values equal."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )  # fmt: skip
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
        )
    if isinstance(a, list | tuple):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(  # type: ignore[arg-type]
                _same_state(x, y)
                for x, y in zip(a, b, strict=True)  # type: ignore[call-overload]
            )
        )
    return a == b


def test_a_reused_snapshot_is_a_fresh_one() -> None:
    """Capturing into an earlier snapshot's memory gives what a fresh capture gives, with
    the tensors copied in place; a changed learning rate, a new state entry, a reshaped
    buffer or a changed tuple make it right too (a fresh copy where the memory cannot
    serve)."""
    model, opt, scaler, z = _setup()
    objs = {"model": model, "optimizer": opt, "scaler": scaler, "zclip": z}
    _train(model, opt, z, 2)
    first = Snapshot.capture(1, objs)  # type: ignore[arg-type]
    memory = [t.data_ptr() for t in first.states["model"].values()]

    def check(step: int, in_place: bool) -> None:
        nonlocal first
        reused = Snapshot.capture(step, objs, reuse=first)  # type: ignore[arg-type]
        fresh = Snapshot.capture(step, objs)  # type: ignore[arg-type]
        assert _same_state(reused.states, fresh.states)
        assert (reused is first) == in_place
        if in_place:
            assert [t.data_ptr() for t in reused.states["model"].values()] == memory
        # the copy is a copy: training on leaves it as it was
        saved = Snapshot.capture(step, objs)  # type: ignore[arg-type]
        _train(model, opt, z, 1)
        assert _same_state(reused.states, saved.states)
        first = reused

    check(2, in_place=True)
    opt.param_groups[0]["lr"] = 3e-3  # a plain value changes: copied into the snapshot
    check(3, in_place=True)
    assert first.states["optimizer"]["param_groups"][0]["lr"] == 3e-3
    scaler.update(torch.tensor(True))  # the scaler's state (plain) changes
    check(4, in_place=True)
    opt.param_groups[0]["betas"] = (0.8, 0.99)  # a tuple changes: a fresh snapshot
    check(5, in_place=False)
    memory = [t.data_ptr() for t in first.states["model"].values()]
    model.register_buffer("seen", torch.zeros(3))  # a new entry: a fresh snapshot
    check(6, in_place=False)
    memory = [t.data_ptr() for t in first.states["model"].values()]
    model.seen = torch.zeros(1)  # a reshaped buffer (it would broadcast): a fresh snapshot
    check(7, in_place=False)
    memory = [t.data_ptr() for t in first.states["model"].values()]
    model.seen = torch.zeros(1, dtype=torch.float64)  # another dtype: a fresh snapshot
    check(8, in_place=False)
    memory = [t.data_ptr() for t in first.states["model"].values()]
    check(9, in_place=True)
