"""The guard's crew: every collaborator of :class:`~floatguard.guard.Guard`, built once
from its resolved configuration and held as one composed object (the façade keeps the
configuration and calls the crew by verb)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from floatguard.events import EventLog
from floatguard.guard._setup import configuration, rank_of, world_size_of
from floatguard.guard.act import Actor
from floatguard.guard.batch_id import BatchInputs
from floatguard.guard.channel import ReadChannel
from floatguard.guard.emit import GuardEvents
from floatguard.guard.judge import Judge
from floatguard.guard.locate import Locator
from floatguard.guard.peers import Peers
from floatguard.guard.persist import GuardCheckpoint, RunState
from floatguard.guard.read import StepReader
from floatguard.guard.repro_writer import ReproWriter
from floatguard.guard.run import StepRunner
from floatguard.guard.scratch import StepScratch
from floatguard.guard.types import Precision, Watch
from floatguard.guard.update_check import UpdateCheck
from floatguard.guard.vetting import StateCheck, named_root
from floatguard.guard.watches import SilentWatches
from floatguard.monitor.hooks import Monitor
from floatguard.scaling.loss_scale import DynamicLossScaler
from floatguard.stability.clipper import Clipper
from floatguard.stability.respond import ClipPolicy, ResponsePolicy, SpikePolicy
from floatguard.stability.snapshot_keeper import SnapshotKeeper
from floatguard.stability.spike_watch import SpikeWatch
from floatguard.stability.stall import StallWatch
from floatguard.stability.step_state import StepState
from floatguard.stability.trend import TrendPolicy, TrendWatch

__all__ = ["Crew", "build_crew"]


@dataclass
class Crew:
    """The guard's collaborators (see ``docs/design.md``, the path of one step)."""

    events: EventLog
    emit: GuardEvents
    clipper: Clipper
    spike_watch: SpikeWatch
    monitor: Monitor | None
    stats_monitor: Monitor | None
    channel: ReadChannel
    runner: StepRunner
    reader: StepReader
    state: StepState
    updates: UpdateCheck
    stall: StallWatch
    trend: TrendWatch
    watches: SilentWatches
    inputs: BatchInputs
    check: StateCheck
    locator: Locator
    repro: ReproWriter | None
    run: RunState
    keeper: SnapshotKeeper
    actor: Actor
    judge: Judge
    checkpoint: GuardCheckpoint
    scratch: StepScratch


def build_crew(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, *,
    precision: Precision, watch: Watch, distributed: bool, process_group: Any,
    device: torch.device, clip: ClipPolicy, spikes: SpikePolicy, response: ResponsePolicy,
    scaler: DynamicLossScaler, log: str | os.PathLike[str] | None, stats_every: int | None,
    peer_timeout_s: float | None, step_scheduler: bool, trend: TrendPolicy | None,
) -> Crew:  # fmt: skip
    """Every collaborator, wired (the guard's configuration already checked)."""

    def own_parts() -> dict[str, Any]:
        return {
            "scaler": scaler,
            "zclip": clipper.zclip,
            "loss_detector": spike_watch.loss,
            "norm_detector": spike_watch.grad_norm,
        }

    def stateful() -> dict[str, Any]:
        return checkpoint.objects()

    events = EventLog(log, rank=rank_of(distributed, process_group))
    emit = GuardEvents(events)
    clipper = Clipper(clip)
    spike_watch = SpikeWatch(spikes)
    # The guard starts the monitors' steps itself, so records of every micro-batch
    # of an accumulated step are there when the step is decided.
    monitor = Monitor(model, auto_step=False).attach() if watch == "hooks" else None
    stats_monitor = (
        Monitor(model, mode="stats", every=stats_every, auto_step=False).attach()
        if stats_every is not None
        else None
    )
    peers = (
        Peers(
            process_group,
            timeout_s=peer_timeout_s,
            device=device,
            on_stop=emit.stop,
        )
        if distributed
        else None
    )
    channel = ReadChannel(
        model,
        peers,
        process_group,
        configuration(precision, watch, clip, spikes, response, model),
        norm_type=clip.norm_type,
    )
    on_loss = monitor.check_loss if monitor is not None else None
    runner = StepRunner(
        precision,
        device,
        scaler,
        channel.region,
        on_loss,
        [p for g in optimizer.param_groups for p in g["params"]],
    )
    reader = StepReader(optimizer, scaler, channel, monitor, device)
    state = StepState(model)
    state.save()
    updates = UpdateCheck(optimizer)
    names = {id(p): n for n, p in named_root(model).named_parameters()}
    stall = StallWatch(optimizer, names)
    trend_watch = TrendWatch(trend)
    watches = SilentWatches(trend_watch, stall, emit, scaler)
    inputs = BatchInputs(model)
    check = StateCheck(model, optimizer, precision, device, updates)
    locator = Locator(
        model,
        optimizer,
        state,
        runner,
        reader,
        channel,
        check,
    )
    repro = (
        ReproWriter(
            response.repro_dir,
            response.repro_level,
            response.repro_keep,
            model,
            optimizer,
            locator,
            precision=precision,
            device=device,
            rank=channel.rank if distributed else None,
            world_size=world_size_of(distributed, process_group),
            scaler=scaler,
            step_state=state,
            spike_watch=spike_watch,
            events=emit,
        )
        if response.repro_dir is not None
        else None
    )
    run = RunState()  # the step counter, the policy's counters, the stage
    keeper = SnapshotKeeper(response, emit)
    actor = Actor(
        run,
        optimizer,
        scheduler,
        scaler,
        state,
        reader,
        clipper,
        spike_watch,
        keeper,
        emit,
        response,
        stateful,
        updates,
        step_scheduler,
        stall if stall.active else None,
    )
    judge = Judge(
        response,
        watch,
        scaler,
        clipper,
        spike_watch,
        locator,
        channel,
        keeper,
    )
    checkpoint = GuardCheckpoint(
        run, model, optimizer, scheduler, own_parts, keeper, judge,
        channel, state, trend_watch, emit, device,
    )  # fmt: skip

    return Crew(
        events, emit, clipper, spike_watch, monitor, stats_monitor, channel, runner, reader,
        state, updates, stall, trend_watch, watches, inputs, check, locator, repro, run,
        keeper, actor, judge, checkpoint,
        StepScratch(optimizer, runner, inputs, state, scaler, monitor, stats_monitor, emit),
    )  # fmt: skip
