"""The guard's façade: wires the collaborators and runs a step as run -> read -> decide -> act.

Words used here (the collaborators, one concern each; see ``docs/design.md``):

- *runner* (:mod:`.run`): the closures under autocast, the (scaled) backward, the losses;
- *reader* (:mod:`.read`): unscale, norm, loss and monitor records packed; the one read;
- *channel* (:mod:`.channel`): local, all-reduced or carried on DDP; fault agreement;
- *locator* (:mod:`.locate`): on a bad step, parameters and optimizer state, then replay;
- *judge* (:mod:`.judge`): the step's evidence, then the *policy* (:mod:`.policy`):
  (evidence, state) -> decision, pure Python; the *actor* (:mod:`.act`) carries it out;
- *keeper* (:mod:`.keeper`): snapshots in memory and on disk, resume;
- *emitters* (:mod:`.emit`): the step's events; *clipper* and *spike watch* in ``stability/``.

Reading order: :meth:`Guard.step`, then ``_step`` (one screen), then the methods it names.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from floatguard.causes import CAUSES, Cause
from floatguard.distributed import GuardDesync, PeerFailed
from floatguard.events import EventLog
from floatguard.guard import policy
from floatguard.guard._setup import (
    check_args,
    check_log_path,
    configuration,
    rank_of,
    world_size_of,
)
from floatguard.guard.act import Actor
from floatguard.guard.batch_id import BatchInputs
from floatguard.guard.channel import ReadChannel
from floatguard.guard.emit import GuardEvents
from floatguard.guard.judge import Judge, StepVerdict
from floatguard.guard.locate import Locator, named_root
from floatguard.guard.peers import Peers
from floatguard.guard.persist import GuardCheckpoint, RunState
from floatguard.guard.read import StepRead, StepReader
from floatguard.guard.repro_writer import ReproWriter
from floatguard.guard.run import StepRunner, as_closures
from floatguard.guard.types import Closure, Precision, StepResult, Watch
from floatguard.guard.update_check import UpdateCheck
from floatguard.guard.watches import SilentWatches
from floatguard.monitor.hooks import Monitor
from floatguard.scaling.loss_scale import DynamicLossScaler
from floatguard.stability.clipper import Clipper
from floatguard.stability.respond import ClipPolicy, GuardStopped, ResponsePolicy, SpikePolicy
from floatguard.stability.snapshot import Snapshot
from floatguard.stability.snapshot_keeper import SnapshotKeeper
from floatguard.stability.spike_watch import SpikeDetector, SpikeWatch
from floatguard.stability.stall import StallWatch
from floatguard.stability.step_state import StepState
from floatguard.stability.trend import TrendPolicy, TrendWatch

__all__ = ["Guard"]


class Guard:
    """Keep a training loop numerically healthy (``docs/guard.md`` has the whole story).

    Args:
        model: the module being trained (its parameters must be the optimizer's).
        optimizer: any ``torch.optim.Optimizer``.
        precision: "fp32", "bf16" (autocast to bfloat16) or "fp16" (autocast to
            float16 with dynamic loss scaling).
        scheduler: an LR scheduler to step with applied steps only (and to keep in
            snapshots). A metric-driven one (``ReduceLROnPlateau``) is stepped with the
            ``metric`` given to :meth:`step`, else with the step's loss.
        step_scheduler: False when the caller steps the scheduler itself (a framework
            stepping ReduceLROnPlateau on its evaluation metric): the guard then only
            keeps it in its snapshots and restores it on a rollback.
        trend: the slow-divergence watch's settings (default :class:`TrendPolicy`): a
            sustained rise of the loss (or the gradient norm) against the run's best
            window is a ``warning`` (``loss_trend`` / ``grad_norm_trend``) with its
            evidence, never a response; ``TrendPolicy(watch_loss=False,
            watch_grad_norm=False)`` turns it off.
        clipped_before: the gradients reach the guard already clipped by the caller (a
            framework's own clipping, as the Trainer's ``max_grad_norm``): the gradient
            norm it reads and reports is the clipped one, and its ``run`` event says so
            (``clip["norm_measured"] == "after_clip"``).
        clip, spikes, response: frozen policies (defaults: ZClip with its published
            settings; robust loss-spike detection; responses by cause, see
            ``docs/guard.md``, "The judgement").
        scaler: a :class:`DynamicLossScaler` for fp16 (default: a new one). It is used
            as given, never changed by the guard's construction; an enabled scaler with
            another precision is refused.
        watch: how a bad step is localized: ``"replay"`` (default; a bad step given as
            a closure is replayed and the birth named), ``"hooks"`` (also keep the hook
            :class:`Monitor` attached, for the three-call loop without a closure) or
            ``"off"`` (check the parameters and optimizer state only).
        stats_every: every that many steps, per-layer statistics as a ``stats`` event
            (a sampling :class:`Monitor`, hooks on those steps only). Default: off.
        log: a JSONL path for the event stream (events are kept in memory too).
        distributed: decide every step together over ``process_group`` (default: when
            torch.distributed is initialized); see :mod:`floatguard.distributed`.
        peer_timeout_s: under torch.distributed, the one bound on every wait the
            guard owns: its collectives run on a group created with this timeout, so a
            silent peer (stopped, killed, stuck in its data loader) ends every rank with
            :class:`PeerFailed` naming it within ``peer_timeout_s`` + 5 s (None: the
            process group's default). Waits the guard does not own (DDP's buffer
            broadcast, FSDP's all-gathers) end at ``init_process_group(timeout=...)``.
        peer_grace_s: deprecated, no effect (a rank blocked outside the guard's
            collectives ends at the process group's own timeout).

    Two ways to drive it. ``step(closure)``: the closure runs the forward and returns
    the loss (it must capture its batch, so a replay sees the same data); a sequence
    of closures accumulates gradients. Or the three-call loop (``with
    guard.autocast(): loss = ...``, ``guard.backward(loss)``, ``guard.step()``). The
    guard zeroes the gradients at the end of every step; a step is applied whole or
    not at all (a skipped step changes no weight, optimizer state, scheduler, scaler
    growth or buffer).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        precision: Precision = "fp32",
        scheduler: Any = None,
        clip: ClipPolicy | None = None,
        spikes: SpikePolicy | None = None,
        response: ResponsePolicy | None = None,
        scaler: DynamicLossScaler | None = None,
        watch: Watch = "replay",
        stats_every: int | None = None,
        log: str | os.PathLike[str] | None = None,
        distributed: bool | None = None,
        process_group: Any = None,
        peer_timeout_s: float | None = 600.0,
        peer_grace_s: float | None = None,
        step_scheduler: bool = True,
        clipped_before: bool = False,
        trend: TrendPolicy | None = None,
    ) -> None:
        check_args(model, optimizer, precision, watch, scaler, stats_every, peer_timeout_s)
        if peer_grace_s is not None:
            warnings.warn(
                "floatguard: Guard(peer_grace_s=...) has no effect any more: a rank blocked "
                "in a collective the guard does not own ends at the process group's own "
                "timeout (init_process_group(timeout=...)); peer_timeout_s bounds the guard's",
                DeprecationWarning,
                stacklevel=2,
            )
        if distributed is None:
            import torch.distributed as dist

            distributed = dist.is_available() and dist.is_initialized()
        # configuration
        self._model, self._optimizer, self._scheduler = model, optimizer, scheduler
        self._precision: Precision = precision
        self._watch: Watch = watch
        self._distributed, self._process_group = bool(distributed), process_group
        self._device: torch.device = next(iter({p.device for p in model.parameters()}))
        self._clip, self._spikes = clip or ClipPolicy(), spikes or SpikePolicy()
        self._response = response or ResponsePolicy()
        if self._distributed and self._clip.norm_type != 2:
            raise ValueError(
                f"ClipPolicy.norm_type={self._clip.norm_type!r}: under torch.distributed "
                "the guard adds the ranks' squared norms; use norm_type=2"
            )
        self._scaler = (
            scaler if scaler is not None else DynamicLossScaler(enabled=precision == "fp16")
        )
        check_log_path(log, self._response)  # never one of the guard's own files
        # collaborators
        self._events = EventLog(log, rank=rank_of(self._distributed, process_group))
        self._emit = GuardEvents(self._events)
        self._clipper = Clipper(self._clip)
        self._spike_watch = SpikeWatch(self._spikes)
        # The guard starts the monitors' steps itself, so records of every micro-batch
        # of an accumulated step are there when the step is decided.
        self._monitor = Monitor(model, auto_step=False).attach() if watch == "hooks" else None
        self._stats_monitor = (
            Monitor(model, mode="stats", every=stats_every, auto_step=False).attach()
            if stats_every is not None
            else None
        )
        peers = (
            Peers(
                process_group,
                timeout_s=peer_timeout_s,
                device=self._device,
                on_stop=self._emit.stop,
            )
            if self._distributed
            else None
        )
        self._channel = ReadChannel(
            model,
            peers,
            process_group,
            configuration(precision, watch, self._clip, self._spikes, self._response, model),
            norm_type=self._clip.norm_type,
        )
        on_loss = self._monitor.check_loss if self._monitor is not None else None
        self._runner = StepRunner(
            precision,
            self._device,
            self._scaler,
            self._channel.region,
            on_loss,
            [p for g in optimizer.param_groups for p in g["params"]],
        )
        self._reader = StepReader(
            optimizer, self._scaler, self._channel, self._monitor, self._device
        )
        self._state = StepState(model)
        self._state.save()
        self._updates = UpdateCheck(optimizer)
        names = {id(p): n for n, p in named_root(model).named_parameters()}
        self._stall = StallWatch(optimizer, names)
        self._trend = TrendWatch(trend)
        self._watches = SilentWatches(self._trend, self._stall, self._emit, self._scaler)
        self._inputs = BatchInputs(model)
        self._step_inputs: list[tuple[Any, ...]] = []
        self._ended = False
        self._locator = Locator(
            model,
            optimizer,
            precision,
            self._state,
            self._runner,
            self._reader,
            self._channel,
            self._device,
            self._updates,
        )
        self._repro = (
            ReproWriter(
                self._response.repro_dir,
                self._response.repro_level,
                self._response.repro_keep,
                model,
                optimizer,
                self._locator,
                precision=precision,
                device=self._device,
                rank=self._channel.rank if self._distributed else None,
                world_size=world_size_of(self._distributed, process_group),
                scaler=self._scaler,
                step_state=self._state,
                spike_watch=self._spike_watch,
                events=self._emit,
            )
            if self._response.repro_dir is not None
            else None
        )
        self._run = RunState()  # the step counter, the policy's counters, the stage
        self._keeper = SnapshotKeeper(self._response, self._emit)
        self._actor = Actor(
            self._run,
            optimizer,
            scheduler,
            self._scaler,
            self._state,
            self._reader,
            self._clipper,
            self._spike_watch,
            self._keeper,
            self._emit,
            self._response,
            self._stateful,
            self._updates,
            step_scheduler,
            self._stall if self._stall.active else None,
        )
        self._judge = Judge(
            self._response,
            watch,
            self._scaler,
            self._clipper,
            self._spike_watch,
            self._locator,
            self._channel,
            self._keeper,
        )
        self._checkpoint = GuardCheckpoint(
            self._run, model, optimizer, scheduler, self._own_parts, self._keeper, self._judge,
            self._channel, self._state, self._trend, self._emit, self._device,
        )  # fmt: skip
        self._emit.run(
            precision,
            self._scaler.enabled,
            model,
            optimizer,
            process_group,
            self._clip,
            "after_clip" if clipped_before else "before_clip",
        )

    # ------------------------------------------------------ read-only views
    model = property(lambda self: self._model)
    optimizer = property(lambda self: self._optimizer)
    scheduler = property(lambda self: self._scheduler)
    precision = property(lambda self: self._precision)
    watch = property(lambda self: self._watch)
    distributed = property(lambda self: self._distributed)
    process_group = property(lambda self: self._process_group)
    device = property(lambda self: self._device)
    clip = property(lambda self: self._clip)
    spikes = property(lambda self: self._spikes)
    response = property(lambda self: self._response)
    scaler = property(lambda self: self._scaler)
    events = property(lambda self: self._events)
    monitor = property(lambda self: self._monitor)
    stats_monitor = property(lambda self: self._stats_monitor)

    @property
    def zclip(self) -> Any:
        return self._clipper.zclip

    @property
    def loss_detector(self) -> SpikeDetector | None:
        return self._spike_watch.loss

    @property
    def norm_detector(self) -> SpikeDetector | None:
        return self._spike_watch.grad_norm

    @property
    def ladder(self) -> policy.LadderState:
        """The response policy's counters (read-only; see :mod:`floatguard.guard.policy`)."""
        return self._run.ladder

    good_steps = property(lambda self: self._run.ladder.good_steps)
    consecutive_bad = property(lambda self: self._run.ladder.consecutive_bad)
    rollbacks = property(lambda self: self._run.ladder.rollbacks)
    transients = property(lambda self: self._run.ladder.transients)
    skip_remaining = property(lambda self: self._run.ladder.skip_remaining)
    lr_factor = property(lambda self: self._run.ladder.lr_factor)

    @property
    def step_count(self) -> int:
        """The number of guard steps taken (the index of the next step)."""
        return self._run.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self._run.step_count = value

    @property
    def last_snapshot(self) -> Snapshot | None:
        """The snapshot a rollback would restore (in memory)."""
        return self._keeper.snapshot

    # ------------------------------------------------------------ loop API
    def autocast(self) -> Any:
        """``torch.autocast`` to the guard's precision (nothing for fp32)."""
        return self._runner.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the (scaled, for fp16) loss; the loss is kept for the step's
        decision. May be called several times before :meth:`step` (gradient
        accumulation): the step is decided on the mean loss."""
        self._runner.backward(loss)

    def record_loss(self, loss: torch.Tensor) -> None:
        """Record a micro-batch's loss for this step's decision without running its
        backward (for loops that run the backward themselves: the integrations)."""
        self._runner.record(loss)

    def has_recorded_losses(self) -> bool:
        """Whether a loss was recorded (:meth:`backward`, :meth:`record_loss`) for this step."""
        return bool(self._runner.losses)

    def recorded_losses_finite(self) -> torch.Tensor:
        """Whether the losses recorded for this step are all finite: a device bool, no sync."""
        return self._runner.losses_finite()

    def step(
        self,
        closure: Closure | Sequence[Closure] | None = None,
        *,
        replay: Sequence[Closure] | None = None,
        metric: float | torch.Tensor | None = None,
    ) -> StepResult:
        """Decide on this step (one host read), apply it or not, and zero the gradients.

        ``closure``: a function running the forward and returning the loss (or a
        sequence of them for gradient accumulation); without it, the losses given to
        :meth:`backward` (or :meth:`record_loss`) since the last step are decided on.
        ``replay``: for that second form, closures that re-run the step's forward (its
        micro-batches) if the step turns out bad, so it can be localized all the same.
        ``metric``: what a metric-driven scheduler (``ReduceLROnPlateau``) is stepped
        with when the step is applied (default: the step's loss).
        """
        self._actor.metric = (
            None if metric is None else float(metric)  # a tensor is read: the caller's
        )
        try:
            return self._step(closure, replay)
        except (PeerFailed, GuardDesync) as e:
            self._channel.stopped(self.step_count, e)  # the stop event, once
            raise
        except GuardStopped:
            raise  # decided together: every rank raises it
        except BaseException as e:
            self._channel.announce_failure(self.step_count, e)
            raise

    @property
    def ended(self) -> bool:
        """Whether :meth:`finish` or :meth:`close` was called (a step is then refused)."""
        return self._channel.finished or self._channel.closed

    def finish(self) -> None:
        """End the run after the last step: under torch.distributed a join, every rank
        after as many guard steps (else GuardDesync on every rank; a rank gone: PeerFailed)."""
        try:
            self._channel.finish(self.step_count)
        except (PeerFailed, GuardDesync) as e:
            self._channel.stopped(self.step_count, e)
            raise

    def _step(
        self, closure: Closure | Sequence[Closure] | None, replay: Sequence[Closure] | None
    ) -> StepResult:
        closures, run, keeper = as_closures(closure), self._run, self._keeper
        if not closures and not self._runner.losses:
            raise RuntimeError("call guard.backward(loss) before guard.step(), or pass a closure")
        self._channel.begin(run.step_count)  # a peer failed, finished or exited: stop now
        step = run.step_count
        if keeper.first_due:  # the first snapshot's RNG: where this step begins
            self._state.rng = self._state.rng_now()
        keeper.begin_step(step, run.ladder.good_steps, self._checkpoint.capture)
        run.stage = "running"
        try:
            if closures:
                self._state.rng = self._state.rng_now()  # the draws this step's forward makes
                self._runner.run(closures, before_last_backward=self._channel.arm_for(step))
            else:
                closures = as_closures(replay) if replay else []
            self._step_inputs = self._inputs.take()  # this step's batch, before any replay
            run.step_count, run.stage = step + 1, "deciding"
            # A snapshot step reads the state's magnitudes with the step, to vet them.
            reads = keeper.reads_state(run.ladder.good_steps)
            state_tensors, magnitudes = self._locator.magnitudes() if reads else ([], None)
            read = self._reader.read(step, self._runner.mean_loss(), magnitudes)  # one read
            vetted = (state_tensors, list(read.extra))
            if keeper.vetting_first:
                self._checkpoint.first_vetted(step, vetted)
            verdict = self._judge.judge(
                step, read, closures, vetted, run.ladder, run.previous_applied
            )
            return self._act(step, read, verdict, closures)
        except BaseException:
            if not run.applied():  # the step did not happen: as if it had not begun
                run.step_count = step
                self._undo()
                keeper.abort_step()
            raise
        finally:
            run.stage = "idle"

    # --------------------------------------------------------- persistence
    def resume(self, path: str | os.PathLike[str] | None = None, *, foreign: bool = False) -> int:
        """Continue a run from its newest good snapshot on disk; returns the step to run next.

        ``path``: a snapshot file, or a folder of them (default: the policy's
        ``snapshot_dir``). This guard continues the run the snapshot folder belongs to
        (its ``floatguard-run.json``): a snapshot written by another run is *foreign*.
        In a folder, a newer snapshot that fails to verify, is misnamed (its name says
        another step: renamed or swapped) or is foreign is passed over for the one
        before it (a ``snapshot_fallback`` event each, saying why). A file named by
        ``path`` is refused for those instead (SnapshotError; ForeignSnapshotError for
        another run's); ``foreign=True`` takes another run's snapshot on purpose (a
        branch of a run, a file copied from elsewhere). The snapshot is checked against
        the model and optimizer (every tensor's name, shape and dtype) before anything
        is loaded: a misfit is a SnapshotError naming the first tensor that differs,
        with model and optimizer untouched. The snapshot folder's lock is taken first:
        SnapshotFolderBusy while another guard writes there.

        Under torch.distributed (every rank calls it) the ranks resume from the same
        step: the newest one every rank has a good snapshot of, each from its own file
        (:mod:`floatguard.guard.resume_agree`); when there is none, or a rank cannot
        load its file, every rank raises SnapshotError naming each rank's steps or the
        rank that failed, with nothing loaded anywhere.

        Model, optimizer, scaler, scheduler, clipper, detectors, the guard's counters
        and the torch RNG (as at the start of that step) are restored; a ``resume``
        event marks where the event stream picks up (with this rank's newest step and
        the ranks behind, when the step agreed is older). Feed the data from the
        returned step on.
        """
        return self._checkpoint.resume(path, foreign)

    def state_dict(self) -> dict[str, Any]:
        """The guard's own state, for a framework's checkpoint (Lightning keeps a
        callback's): step counter, counters, loss scaler, clipper and spike detectors.
        Not the model, optimizer or scheduler (the framework saves those)."""
        return self._checkpoint.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (a guard configured the same way).
        The guard then continues the run its ``snapshot_dir`` belongs to (as after
        :meth:`resume`), so a framework's resume keeps the folder's snapshots its own."""
        self._checkpoint.load_state_dict(sd)

    def skip_external(
        self,
        reason: Cause = "overflow",
        *,
        scale_before: float | None = None,
        scale_after: float | None = None,
    ) -> StepResult:
        """Record a step the training framework skipped on its own (an fp16 GradScaler
        that found an inf and did not call the optimizer): the losses recorded for it
        are dropped, the buffers restored, the step counted, and an ``overflow`` event
        (when the scales are given) and a ``step`` event written. One host read."""
        if reason not in CAUSES:
            raise ValueError(f"skip_external(reason={reason!r}); use one of {CAUSES}")
        step = self._run.step_count
        self._run.step_count += 1
        loss = float(self._runner.mean_loss()) if self._runner.losses else math.nan
        self._discard()
        self._state.save()
        self._run.previous_applied = False
        if scale_before is not None and scale_after is not None:
            self._emit.overflow(step, scale_before, scale_after)
        scale = scale_after if scale_after is not None else self._scaler.get_scale()
        result = StepResult(
            step, "skipped", reason, loss, math.nan, scale, 1.0, self._run.ladder.lr_factor,
            snapshot_age=self._keeper.age(self._run.step_count),
        )  # fmt: skip
        self._emit.step(result)
        return result

    def _stateful(self) -> dict[str, Any]:
        """Everything a snapshot captures and a rollback restores."""
        return self._checkpoint.objects()

    def _own_parts(self) -> dict[str, Any]:
        """The parts of the guard's own state a framework's checkpoint keeps."""
        return {
            "scaler": self._scaler,
            "zclip": self.zclip,
            "loss_detector": self.loss_detector,
            "norm_detector": self.norm_detector,
        }

    # ----------------------------------------------------------------- act
    def _act(
        self, step: int, read: StepRead, verdict: StepVerdict, closures: Sequence[Closure] = ()
    ) -> StepResult:
        scale = self._scaler.get_scale()
        lr = self._lr(verdict.decision.state.lr_factor)  # what the update uses
        schedule_lr = self._lr(1.0)  # the schedule's, the guard's back-off left out
        batch = (
            self._inputs.identity(step, self._step_inputs)
            if verdict.fault is not None or verdict.spike is not None
            else None
        )
        if self._repro is not None and verdict.decision.response != "apply":
            self._repro.bad_step(  # before a rollback
                step, verdict, self._judge.local, read.bad_ranks, closures, self._step_inputs
            )
        try:
            action, self._run.ladder = self._actor.act(
                step, read, verdict, self._checkpoint.before_update, batch
            )
        except GuardStopped:
            self._run.ladder = verdict.decision.state
            raise
        self._run.previous_applied = action == "applied"
        if self._run.previous_applied:
            self._watches.applied(step, read, schedule_lr, scale)
        self._keeper.end_step()
        self._end_step()
        result = StepResult(
            step,
            action,
            verdict.decision.cause,
            read.loss,
            read.grad_norm,
            scale,
            verdict.clip[0],
            self._run.ladder.lr_factor,
            verdict.fault,
            self._keeper.age(self.step_count),
            lr,
        )
        self._emit.step(result)
        return result

    def _lr(self, factor: float) -> float | None:
        """The LR a step's update uses: the first group's, times the LR factor."""
        lr = self._optimizer.param_groups[0].get("lr") if self._optimizer.param_groups else None
        if lr is None or isinstance(lr, torch.Tensor):
            return None  # (a tensor LR is not read: that would be a sync)
        return float(lr) * factor

    def _undo(self) -> None:
        """A step that raised (its closure, a SnapshotError, ...): discarded, and the RNG
        back where the step began, so a retry draws what an uninterrupted run draws."""
        self._discard()
        self._state.restore_rng()

    def _discard(self) -> None:
        self._optimizer.zero_grad(set_to_none=True)
        self._runner.clear()
        self._step_inputs = []
        self._inputs.take()
        self._state.restore_buffers()
        if self._scaler.enabled:
            self._scaler.skip_step()
        for mon in (self._monitor, self._stats_monitor):
            if mon is not None:
                mon.reset()

    def _end_step(self) -> None:
        if self._stats_monitor is not None:
            summary = self._stats_monitor.stats_summary()  # empty on unsampled steps
            if summary:
                self._emit.stats(self.step_count - 1, summary)
            self._stats_monitor.next_step()
        self._optimizer.zero_grad(set_to_none=True)
        self._runner.clear()
        self._step_inputs = []
        self._inputs.take()  # replays' calls
        if self._monitor is not None:
            self._monitor.next_step()
        self._state.save()

    def close(self) -> None:
        """Detach the monitors, let go of the snapshot folder's lock, close the event log
        (once; a step after it is refused). Distributed, it waits for nothing: it leaves
        a note for the peers (finished after its steps; a ``with`` left by an exception
        from outside :meth:`step`, not GuardStopped: exited with it) and destroys the
        guard's groups. Closed without :meth:`finish` after guard steps, it warns: that
        every rank took as many guard steps is then unchecked (docs/guard.md)."""
        self._close(None)

    def _close(self, error: BaseException | None) -> None:
        if not self._ended:
            self._ended = True
            self._end()
        self._inputs.close()
        for mon in (self._monitor, self._stats_monitor):
            if mon is not None:
                mon.detach()
        self._keeper.close()
        self._channel.close(error)
        self._events.close()

    def _end(self) -> None:
        """The ``end`` event: whether the run ends with finite weights, optimizer state
        and floating buffers (one read, at close), which are not, the LR factor."""
        try:
            bad = self._locator.nonfinite_now(self._keeper.amax)
        except Exception:  # closing must not fail on the check
            bad = None
        lr = self._lr(self._run.ladder.lr_factor)
        scale = self._scaler.get_scale() if self._scaler.enabled else None
        self._emit.end(
            self.step_count,
            None if bad is None else not bad,
            bad or [],
            self._run.ladder.lr_factor,
            lr,
            scale,
        )

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        self._close(None if isinstance(error, GuardStopped) else error)
