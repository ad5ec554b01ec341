"""The guard's construction checks: arguments, the configuration every rank must share, the rank."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, get_args

import torch
from torch import nn

from floatguard.guard.types import Precision, Watch
from floatguard.scaling.loss_scale import DynamicLossScaler

__all__ = ["check_args", "configuration", "rank_of"]


def check_args(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    precision: str,
    watch: str,
    scaler: DynamicLossScaler | None,
    stats_every: int | None,
    peer_timeout_s: float | None = None,
) -> None:
    """A clear TypeError / ValueError naming the bad argument and the fix."""
    if peer_timeout_s is not None and (
        isinstance(peer_timeout_s, bool)
        or not isinstance(peer_timeout_s, (int, float))
        or not math.isfinite(peer_timeout_s)
        or peer_timeout_s <= 0
    ):
        raise ValueError(
            f"peer_timeout_s={peer_timeout_s!r}: give a number of seconds > 0 (the bound on "
            "every wait the guard owns under torch.distributed), or None for the process "
            "group's own timeout"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"Guard needs an nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"Guard needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if precision not in get_args(Precision):
        raise ValueError(f"precision={precision!r}; use 'fp32', 'bf16' or 'fp16'")
    if watch not in get_args(Watch):
        raise ValueError(f"watch={watch!r}; use 'replay' (default), 'hooks' or 'off'")
    if scaler is not None and not isinstance(scaler, DynamicLossScaler):
        raise TypeError(
            f"scaler= needs a floatguard DynamicLossScaler, got {type(scaler).__name__}"
        )
    if scaler is not None and scaler.enabled and precision != "fp16":
        raise ValueError(
            f"scaler= is an enabled loss scaler, but precision={precision!r} needs none "
            "(loss scaling is for fp16); pass precision='fp16', or no scaler "
            "(or DynamicLossScaler(enabled=False))"
        )
    if stats_every is not None and (
        isinstance(stats_every, bool) or not isinstance(stats_every, int) or stats_every < 2
    ):
        raise ValueError(f"stats_every={stats_every!r} must be an int >= 2 or None")
    named = list(model.named_parameters())
    meta = named[0][0] if named and all(p.is_meta for _, p in named) else None
    if meta is not None:  # the whole model (part of it: the several-devices check)
        raise ValueError(
            f"the model's parameter {meta!r} is on the meta device (no data to guard); "
            "materialize the model first (model.to_empty(device=...) and initialize it, "
            "or load its weights)"
        )
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    if not opt_params:
        raise ValueError("the optimizer has no parameters; build it from model.parameters()")
    model_params = {id(p) for p in model.parameters()}
    foreign = [i for i, p in enumerate(opt_params) if id(p) not in model_params]
    if foreign:
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameter(s) that are not the model's "
            f"(first at index {foreign[0]}); build it from this model's parameters"
        )
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise ValueError(
            f"the model's parameters are on several devices ({sorted(map(str, devices))}); "
            "the guard expects one device"
        )


def configuration(
    precision: str, watch: str, clip: Any, spikes: Any, response: Any, model: nn.Module
) -> tuple[Any, ...]:
    """What every rank's guard must share (for the fingerprint): precision, policies
    (paths left out: they may differ per rank), the model's global parameter shapes."""
    per_rank = set(response.per_rank_fields())
    resp = {k: v for k, v in vars(response).items() if k not in per_rank}
    shapes = [tuple(p.shape) for p in model.parameters()]  # DTensor: global shape
    return (precision, watch, clip, spikes, sorted(resp.items()), shapes)


def rank_of(distributed: bool, group: Any) -> int:
    if not distributed:
        return 0
    import torch.distributed as dist

    return int(dist.get_rank(group))


def world_size_of(distributed: bool, group: Any) -> int:
    if not distributed:
        return 1
    import torch.distributed as dist

    return int(dist.get_world_size(group))


_RESERVED = re.compile(r"^(floatguard\.lock|floatguard-run\.json|snapshot-\d+\.fgs|\.snapshot-.*)$")


def check_log_path(log: str | os.PathLike[str] | None, response: Any) -> None:
    """ValueError when the event log would be one of the guard's own files: the
    snapshot folder itself, or a name the snapshot store owns there (the lock, the
    identity file, a snapshot, a temp file), or a repro bundle's name (each would be
    replaced or removed, and the events with it)."""
    if log is None:
        return
    where = Path(os.path.abspath(log)).resolve()
    for option, folder in (
        ("snapshot_dir", response.snapshot_dir),
        ("repro_dir", response.repro_dir),
    ):
        if folder is None:
            continue
        home = Path(os.path.abspath(folder)).resolve()
        owned = where.parent == home and (
            _RESERVED.match(where.name) is not None
            or (option == "repro_dir" and where.suffix == ".fgr")
        )
        if where == home or owned:
            raise ValueError(
                f"log={str(log)!r} is {'the' if where == home else 'a file of the'} "
                f"{option} ({folder}): the guard writes and removes its own files there; "
                "give the event log another name, e.g. beside the folder"
            )


def check_deferred(
    sync: object, crew: Any, end: Any, optimizer: torch.optim.Optimizer, model: nn.Module
) -> Any:
    """The deferred stepper for ``sync="deferred"`` (None for ``"exact"``); another value
    is a ValueError naming it."""
    if sync == "exact":
        return None
    if sync != "deferred":
        raise ValueError(f"Guard(sync={sync!r}); use 'exact' (the default) or 'deferred'")
    from floatguard.guard.deferred import DeferredStepper

    return DeferredStepper(crew, end, optimizer, model)


def check_graphable(stepper: Any, crew: Any, precision: str, device: torch.device) -> Any:
    """The guard's half of a graphed step (:meth:`Guard.graphed`), or a ValueError naming
    what a captured step cannot do: the exact mode (a read every step), fp16 (the loss
    scale is the host's), a hook monitor (it records the forward on the host), more
    than one rank (the read's agreement and its collectives are the host's)."""
    why = None
    if stepper is None:
        why = "needs Guard(sync='deferred') (the exact mode reads the device every step)"
    elif precision == "fp16":
        why = "runs fp32 or bf16 (fp16's loss scale is decided on the host every step)"
    elif crew.monitor is not None or crew.stats_monitor is not None:
        why = "cannot hook the forward (watch='hooks' or stats_every record it on the host)"
    elif crew.channel.peers is not None:
        why = "runs on one process (not under torch.distributed yet)"
    if why is not None:
        raise ValueError(f"Guard.graphed {why}")
    from floatguard.guard.graph_half import GraphHalf

    return GraphHalf(crew, stepper, device)
