"""Guarded runs that meet a fault the way users do, with repro bundles on.

Each scenario trains a small two-block model under :class:`floatguard.Guard` with
``ResponsePolicy(repro_dir=...)`` and plants one fault at a given step; it returns the
guard's fault for that step and the bundles written.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from floatguard import Guard, ResponsePolicy, SpikePolicy
from tests.repro._user_model import TwoBlocks

Plant = Callable[[TwoBlocks, torch.optim.Optimizer, torch.Tensor, torch.Tensor], Any]


@dataclass
class Outcome:
    folder: Path
    faults: list[Any]
    actions: list[str]
    bundles: list[Path] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)


def run(
    folder: Path,
    plant: Plant,
    *,
    at: int = 10,
    steps: int = 12,
    precision: str = "fp32",
    level: str = "minimal",
    keep: int = 5,
    setup: Callable[[TwoBlocks], None] | None = None,
    spikes: SpikePolicy | None = None,
    every: bool = False,
) -> Outcome:
    """Train ``steps`` steps, planting at step ``at`` (and every later step when
    ``every``); the guard's faults and actions from step ``at`` on."""
    torch.manual_seed(0)
    model = TwoBlocks()
    if setup is not None:
        setup(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "events.jsonl"
    guard = Guard(
        model,
        opt,
        precision=precision,  # type: ignore[arg-type]
        spikes=spikes,
        response=ResponsePolicy(repro_dir=folder, repro_level=level, repro_keep=keep),  # type: ignore[arg-type]
        log=log,
    )
    gen = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(steps)
    ]
    out = Outcome(folder, [], [])
    for i in range(steps):
        x, y = data[i]
        if i == at or (every and i > at):
            planted = plant(model, opt, x, y)
            if planted is not None:
                x, y = planted
        r = guard.step(lambda x=x, y=y: F.mse_loss(model(x), y))
        if i >= at:
            out.faults.append(r.fault)
            out.actions.append(r.action)
    guard.close()
    out.bundles = sorted(folder.glob("*.fgr"))
    out.events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return out


# ---------------------------------------------------------------------- the faults
def forward_log(m: TwoBlocks, o: Any, x: Any, y: Any) -> None:
    m.b.mode = "log"


def backward_sqrt(m: TwoBlocks, o: Any, x: Any, y: Any) -> None:
    m.b.mode = "sqrt"


def grad_hook(m: TwoBlocks, o: Any, x: Any, y: Any) -> None:
    m.b.fc.weight.register_hook(lambda g: g * float("nan"))


def nan_weight(m: TwoBlocks, o: Any, x: Any, y: Any) -> None:
    with torch.no_grad():
        m.b.fc.weight[0, 0] = float("nan")


def nan_exp_avg(m: TwoBlocks, o: torch.optim.Optimizer, x: Any, y: Any) -> None:
    o.state[m.b.fc.weight]["exp_avg"][0, 0] = float("nan")


def nan_input(m: TwoBlocks, o: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
    x = x.clone()
    x[1, 2] = float("nan")
    return x, y


def overflow(m: TwoBlocks, o: Any, x: Any, y: Any) -> None:
    m.a.mode = "big"


def gemm_overflow(m: TwoBlocks, o: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
    """Inputs near fp32's top and weights 8x larger (finite, plausible): the emulated
    GEMM of block a's layer overflows, and its sum of +inf and -inf is NaN."""
    with torch.no_grad():
        m.a.fc.weight.mul_(8)
    return x / x.abs().amax() * 3e38, y


def spike(m: TwoBlocks, o: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
    return x * 1e3, y * 1e3


def first_call_only(m: TwoBlocks, o: Any, x: Any, y: Any) -> None:
    """NaN from block b on its first call only: the guard's replay finds nothing."""
    calls = [0]
    forward = m.b.forward

    def once(h: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        out = forward(h)
        return out * float("nan") if calls[0] == 1 else out

    m.b.forward = once  # type: ignore[method-assign]
