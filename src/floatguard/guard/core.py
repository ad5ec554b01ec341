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

import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

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
from floatguard.guard.keeper import SnapshotKeeper
from floatguard.guard.locate import Locator, named_root
from floatguard.guard.peers import Peers
from floatguard.guard.persist import GuardPersistence
from floatguard.guard.read import StepRead, StepReader
from floatguard.guard.repro_writer import ReproWriter
from floatguard.guard.run import StepRunner, as_closures
from floatguard.guard.stall import StallWatch
from floatguard.guard.types import Closure, Precision, StepResult, Watch
from floatguard.guard.update_check import UpdateCheck
from floatguard.monitor.hooks import Monitor
from floatguard.scaling.loss_scale import DynamicLossScaler
from floatguard.stability.clipper import Clipper
from floatguard.stability.respond import ClipPolicy, GuardStopped, ResponsePolicy, SpikePolicy
from floatguard.stability.snapshot import Snapshot
from floatguard.stability.spike_watch import SpikeDetector, SpikeWatch
from floatguard.stability.step_state import StepState
from floatguard.stability.trend import TrendPolicy, TrendWatch

__all__ = ["Guard"]


class Guard(GuardPersistence):
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
            )
            if self._response.repro_dir is not None
            else None
        )
        self._keeper = SnapshotKeeper(self._response, self._emit)
        self._actor = Actor(
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
        # the guard's own state
        self._ladder = policy.LadderState()
        self.step_count = 0
        self._previous_applied = False  # the last step's update was applied
        # The first snapshot is of the state the first step starts from (taken then,
        # vetted): weights a user loads after building the guard (a fine-tune's
        # pretrained weights, a resume through load_state_dict) are the ones kept.
        self._snapshot_pending = True
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
        return self._ladder

    good_steps = property(lambda self: self._ladder.good_steps)
    consecutive_bad = property(lambda self: self._ladder.consecutive_bad)
    rollbacks = property(lambda self: self._ladder.rollbacks)
    transients = property(lambda self: self._ladder.transients)
    skip_remaining = property(lambda self: self._ladder.skip_remaining)
    lr_factor = property(lambda self: self._ladder.lr_factor)

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
        closures = as_closures(closure)
        self._channel.begin(self.step_count)  # a peer failed, finished or exited: stop now
        self._keeper.tick()
        step = self.step_count
        initial = self._snapshot_pending
        if initial:  # the state this step starts from, vetted by the step's own read
            self._snapshot_pending = False
            self._state.rng = self._state.rng_now()
            self._keeper.take(step, self._stateful(), self._snapshot_meta(), {}, vetted=False)
        elif self._keeper.opens(self._ladder.good_steps):  # snapshot_overlap: copy now
            self._keeper.take(step, self._stateful(), self._snapshot_meta(), {}, pending=True)
        if closures:
            self._state.rng = self._state.rng_now()  # the draws this step's forward makes
            try:
                self._runner.run(closures, before_last_backward=self._channel.arm_for(step))
            except BaseException:
                self._undo()  # the closure failed: the step did not happen
                self._unvouched(initial)
                raise
        elif not self._runner.losses:
            raise RuntimeError("call guard.backward(loss) before guard.step(), or pass a closure")
        else:
            closures = as_closures(replay) if replay else []
        self._step_inputs = self._inputs.take()  # this step's batch, before any replay
        self.step_count, self._actor.applying = step + 1, False
        try:
            # A snapshot step reads the state's magnitudes with the step, to vet them.
            due = initial or self._keeper.due(self._ladder.good_steps)
            state_tensors, magnitudes = self._locator.magnitudes() if due else ([], None)
            read = self._reader.read(step, self._runner.mean_loss(), magnitudes)  # one read
            if initial:
                self._vouch_initial(step, (state_tensors, list(read.extra)))
                initial = False
            verdict = self._judge.judge(
                step,
                read,
                closures,
                (state_tensors, list(read.extra)),
                self._ladder,
                self._previous_applied,
            )
            return self._act(step, read, verdict, closures)
        except BaseException:
            if not self._actor.applying:  # the step did not happen: as if it had not begun
                self.step_count = step
                self._undo()
                self._unvouched(initial)
            raise

    def _unvouched(self, initial: bool) -> None:
        """A first step that failed before its read vetted the first snapshot: forget
        that snapshot; the next step takes it again (and so for an overlapped copy)."""
        self._keeper.settle()
        if initial:
            self._keeper.drop()
            self._snapshot_pending = True

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
            self._write_repro(step, read, verdict, closures)  # before a rollback
        try:
            action, self._ladder = self._actor.act(step, read, verdict, self._snapshot_now, batch)
        except GuardStopped:
            self._ladder = verdict.decision.state
            raise
        self._previous_applied = action == "applied"
        if self._previous_applied:
            self._observe_trend(step, read, schedule_lr, scale)
        if self._previous_applied and self._stall.active:
            stalled = self._stall.after(step)  # on its sampled steps only
            if stalled is not None:
                self._emit.warning(
                    step, StallWatch.message(stalled), code="stalled_updates", evidence=stalled
                )
        self._keeper.settle()  # an overlapped copy the step did not vouch for
        self._end_step()
        result = StepResult(
            step,
            action,
            verdict.decision.cause,
            read.loss,
            read.grad_norm,
            scale,
            verdict.clip[0],
            self._ladder.lr_factor,
            verdict.fault,
            self._keeper.age(self.step_count),
            lr,
        )
        self._emit.step(result)
        return result

    def _write_repro(
        self, step: int, read: StepRead, verdict: StepVerdict, closures: Sequence[Closure]
    ) -> None:
        """Write the repro bundle of a bad step (its fault born on this rank, or at the
        "step" level its spike): a ``repro`` event, or a ``warning`` (``repro_error``)
        when it cannot be written; training goes on either way."""
        assert self._repro is not None
        fault = self._judge.local if verdict.fault is not None else None
        if verdict.fault is not None and fault is None:
            return
        if (
            self._distributed
            and self._channel.rank not in read.bad_ranks
            and (fault is None or fault.phase != "param")
        ):
            return  # the fault was born on another rank: its bundle is written there
        spike = verdict.spike if fault is None else None
        if not self._repro.wants(fault, spike):
            return
        self._repro.mark(fault, spike)
        spike_info = None
        if spike is not None:
            detector = (
                self._spike_watch.loss if spike == "loss_spike" else self._spike_watch.grad_norm
            )
            spike_info = {
                "signal": spike.removesuffix("_spike"),
                "value": verdict.spike_value,
                "threshold": detector.bar() if detector is not None else None,
                "reproduced": verdict.spike_reproduced,
            }
        state = None
        if self._response.repro_level == "step":
            state = {
                "model": named_root(self._model).state_dict(),
                "optimizer": self._optimizer.state_dict(),
                "scaler": self._scaler.state_dict(),
                "rng": self._state.rng,
            }
        try:
            path, size, seconds, summary = self._repro.capture(
                step,
                fault,
                spike_info,
                closures,
                self._step_inputs,
                self._repro_context(),
                state,
            )
        except Exception as e:  # never let a bundle break training
            self._emit.warning(
                step,
                f"repro bundle not written: {type(e).__name__}: {e}",
                code="repro_error",
            )
            return
        self._emit.repro(step, str(path), self._response.repro_level, size, seconds, summary)

    def _repro_context(self) -> dict[str, Any]:
        """What the step computed in: precision, loss scale, autocast, the parameters'
        dtypes, the emulation recipes of the model's emulated layers."""
        from floatguard.emulation.emulation_recipe import EmulationRecipe

        recipes = {
            name: repr(m.recipe)
            for name, m in named_root(self._model).named_modules()
            if isinstance(getattr(m, "recipe", None), EmulationRecipe)
        }
        return {
            "precision": self._precision,
            "loss_scale": self._scaler.get_scale() if self._scaler.enabled else None,
            "autocast": {"fp16": "float16", "bf16": "bfloat16"}.get(self._precision),
            "param_dtypes": sorted(
                {str(p.dtype).removeprefix("torch.") for p in self._model.parameters()}
            ),
            "emulation": recipes,
        }

    def _observe_trend(self, step: int, read: StepRead, lr: float | None, scale: float) -> None:
        """An applied step's loss and norm into the trend watch; its alarms as warnings."""
        alarms = self._trend.observe(
            step, read.loss, read.grad_norm, lr, scale if self._scaler.enabled else None
        )
        for alarm in alarms:
            self._emit.warning(
                step,
                alarm.message,
                code=f"{alarm.signal}_trend",
                evidence=alarm.evidence(),
            )

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
        and floating buffers (one read, at close), which are not, the LR factor; a
        non-finite buffer is also a warning (the run never ends with one unsaid)."""
        try:
            bad = self._locator.nonfinite_now(self._keeper.amax)
        except Exception:  # closing must not fail on the check
            bad = None
        lr = self._lr(self._ladder.lr_factor)
        scale = self._scaler.get_scale() if self._scaler.enabled else None
        buffers = [n.removeprefix("buffer:") for n in bad or [] if n.startswith("buffer:")]
        if buffers:
            self._emit.warning(
                self.step_count,
                f"the run ends with non-finite buffer(s) {', '.join(buffers[:5])}: "
                "evaluation with them gives NaN; restore a snapshot or recompute them",
                code="nonfinite_buffer",
                evidence={"buffers": buffers},
            )
        self._emit.end(
            self.step_count,
            None if bad is None else not bad,
            bad or [],
            self._ladder.lr_factor,
            lr,
            scale,
        )

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        self._close(None if isinstance(error, GuardStopped) else error)
