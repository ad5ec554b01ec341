"""The guard's façade: wires the collaborators and runs a step as run -> read -> decide -> act.

Words used here (the collaborators, one concern each; see ``docs/design.md``):

- *runner* (:mod:`.run`): the closures under autocast, the (scaled) backward, the losses;
- *reader* (:mod:`.read`): unscale, norm, loss and monitor records packed; the one read;
- *channel* (:mod:`.channel`): local, all-reduced or carried on DDP; fault agreement;
- *locator* (:mod:`.locate`): on a bad step, parameters and optimizer state, then replay;
- *judge* (:mod:`.judge`): the step's evidence, then the *policy* (:mod:`.policy`):
  (evidence, state) -> decision, pure Python; the *actor* (:mod:`.act`) carries it out;
- *keeper* (:mod:`.keeper`): snapshots in memory and on disk, resume;
- *emitters* (:mod:`.emit`): the step's events; *clipper* and *spike watch* in ``stability/``;
- *the step's end* (:mod:`.conclude`): the verdict carried out, the result emitted.

Reading order: :meth:`Guard.step`, then ``_step`` (one screen), then the methods it names.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from floatguard.causes import Cause
from floatguard.distributed import GuardDesync, PeerFailed
from floatguard.guard._setup import (
    check_args,
    check_deferred,
    check_graphable,
    check_log_path,
)
from floatguard.guard.conclude import StepEnd
from floatguard.guard.crew import build_crew
from floatguard.guard.graphs import GraphedStep
from floatguard.guard.judge import StepVerdict
from floatguard.guard.persist_api import GuardPersistence
from floatguard.guard.run import as_closures
from floatguard.guard.types import Closure, Precision, StepResult, Watch
from floatguard.scaling.loss_scale import DynamicLossScaler
from floatguard.stability.respond import ClipPolicy, GuardStopped, ResponsePolicy, SpikePolicy
from floatguard.stability.trend import TrendPolicy

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
        sync: ``"exact"`` (default): one host read per step, decided before the update.
            ``"deferred"``: no host read on a healthy step: the verdict is made on the
            device, the update gated there (a bad step never moves a weight), the host
            settles the step a call later (the next ``step(closure)`` after its forward
            and backward, another call, the next forward with grad enabled, or reading
            the returned :class:`PendingResult`). See
            ``docs/guard.md``, "No host read on a healthy step".

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
        sync: Literal["exact", "deferred"] = "exact",
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
        self._c = build_crew(
            model, optimizer, scheduler, precision=precision, watch=watch,
            distributed=self._distributed, process_group=process_group, device=self._device,
            clip=self._clip, spikes=self._spikes, response=self._response, scaler=self._scaler,
            log=log, stats_every=stats_every, peer_timeout_s=peer_timeout_s,
            step_scheduler=step_scheduler, trend=trend,
        )  # fmt: skip
        self._end = StepEnd(self._c, self._scaler, optimizer)
        self._deferred = check_deferred(sync, self._c, self._end, optimizer, model)
        self._ended = False
        self._c.emit.run(
            precision,
            self._scaler.enabled,
            model,
            optimizer,
            process_group,
            self._clip,
            "after_clip" if clipped_before else "before_clip",
        )

    # ------------------------------------------------------------ loop API
    def autocast(self) -> Any:
        """``torch.autocast`` to the guard's precision (nothing for fp32)."""
        return self._c.runner.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the (scaled, for fp16) loss; the loss is kept for the step's
        decision. May be called several times before :meth:`step` (gradient
        accumulation): the step is decided on the mean loss."""
        self._c.runner.backward(loss)

    def record_loss(self, loss: torch.Tensor) -> None:
        """Record a micro-batch's loss for this step's decision without running its
        backward (for loops that run the backward themselves: the integrations)."""
        self._c.runner.record(loss)

    def has_recorded_losses(self) -> bool:
        """Whether a loss was recorded (:meth:`backward`, :meth:`record_loss`) for this step."""
        return bool(self._c.runner.losses)

    def recorded_losses_finite(self) -> torch.Tensor:
        """Whether the losses recorded for this step are all finite: a device bool, no sync."""
        return self._c.runner.losses_finite()

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

        def run() -> StepResult:
            closures, ahead = as_closures(closure), False
            if self._deferred is not None:  # the previous step's decision, first (after
                # this step's forward and backward where they may run ahead; a failure
                # is announced below, once)
                begun = self._deferred.begin(closures, replay, self._c.runner.run)
                if isinstance(begun, StepResult):
                    return begun
                closures, replay_, ahead = begun
                return self._step(closures, replay_, ahead, metric=metric)
            return self._step(closures, replay, metric=metric)

        return self._announced(run)

    def _announced(self, run: Callable[[], StepResult]) -> StepResult:
        """``run()`` (a step), its failure announced to the peers once."""
        try:
            return run()
        except (PeerFailed, GuardDesync) as e:
            self._c.channel.stopped(self.step_count, e)  # the stop event, once
            raise
        except GuardStopped:
            raise  # decided together: every rank raises it
        except BaseException as e:
            self._c.channel.announce_failure(self.step_count, e)
            raise

    def settle(self) -> StepResult | None:
        """(``sync="deferred"``) Decide the step the device has run but the host has not
        read yet, now: its result (None when nothing is pending). The guard does this
        itself when the next step begins; calling it is an explicit sync."""
        if self._deferred is None:
            return None
        try:
            settled: StepResult | None = self._deferred.settle()
            return settled
        except (PeerFailed, GuardDesync, GuardStopped):
            raise
        except BaseException as e:
            self._c.channel.announce_failure(self.step_count, e)
            raise

    @property
    def ended(self) -> bool:
        """Whether :meth:`finish` or :meth:`close` was called (a step is then refused)."""
        return self._c.channel.finished or self._c.channel.closed

    def finish(self) -> None:
        """End the run after the last step: under torch.distributed a join, every rank
        after as many guard steps (else GuardDesync on every rank; a rank gone: PeerFailed)."""
        try:
            self.settle()
            self._c.channel.finish(self.step_count)
        except (PeerFailed, GuardDesync) as e:
            self._c.channel.stopped(self.step_count, e)
            raise

    def graphed(
        self,
        loss_fn: Callable[..., torch.Tensor],
        *example: torch.Tensor,
        warmup: int = 3,
        backend: Literal["auto", "cuda", "check"] = "auto",
    ) -> GraphedStep:
        """(``sync="deferred"``) A training step run as one CUDA graph replay: ``step =
        guard.graphed(lambda x, y: loss(model(x), y), x0, y0)``, then ``step(x, y)`` each
        step (a batch shaped like the example). The forward, backward, verdict, clipping,
        gated update and the read's copy to the host are captured after ``warmup`` eager
        steps and replayed; the host settles each step as the deferred mode does, and
        runs a step eagerly where it must decide it (snapshot steps, a batch skipped
        after a rollback, an LR backed off). ``backend``: ``"cuda"``
        (``torch.cuda.CUDAGraph``; the default for a CUDA batch), ``"check"`` (every step
        eager, its operators compared with the captured step's: :class:`GraphUnsafe`
        names what a graph would replay wrongly; the default on the CPU). See
        :mod:`floatguard.guard.graphs` and ``docs/guard.md``, "CUDA graphs"."""
        if self.ended:
            raise RuntimeError("guard.graphed() after guard.close() or finish(): build a new Guard")
        half = check_graphable(self._deferred, self._c, self.precision, self.device)
        return GraphedStep(
            loss_fn, example, guard=self, stepper=half, warmup=warmup, backend=backend,
            run_graphed=lambda graph, closures: self._announced(
                lambda: self._step(closures, None, graph=graph)
            ),
        )  # fmt: skip

    def _step(
        self,
        closures: list[Closure],
        replay: Sequence[Closure] | None,
        ahead: bool = False,
        *,
        metric: float | torch.Tensor | None = None,
        graph: GraphedStep | None = None,
    ) -> StepResult:
        self._c.actor.metric = (
            None if metric is None else float(metric)  # a tensor is read: the caller's
        )
        run, keeper = self._c.run, self._c.keeper
        # (else the caller ran it: the three-call loop; ``ahead``: the guard ran this
        # step's closures before settling the previous step, ``replay`` holds them)
        guard_runs_forward = bool(closures) or ahead
        self._c.channel.begin(run.step_count)  # a peer failed, finished or exited: stop now
        if not closures and not self._c.runner.losses:
            raise RuntimeError("call guard.backward(loss) before guard.step(), or pass a closure")
        step = run.step_count
        if keeper.first_due:  # the first snapshot's RNG: where this step begins
            self._c.state.rng = self._c.state.rng_now()
        keeper.begin_step(step, run.ladder.good_steps, self._c.checkpoint.capture)
        run.stage = "running"
        try:
            last_update = self._c.updates.last()  # (a graphed step's, before its replay)
            if graph is not None:  # the captured forward, backward and gated update
                self._c.state.rng = self._c.state.rng_now()
                graph.enqueue()
            elif closures:
                self._c.state.rng = self._c.state.rng_now()  # the draws this step's forward makes
                self._c.runner.run(closures, before_last_backward=self._c.channel.arm_for(step))
            else:
                closures = as_closures(replay) if replay else []
            self._c.scratch.keep_batch()  # this step's batch, before any replay
            run.step_count, run.stage = step + 1, "deciding"
            if graph is not None:  # (graph_ready: no snapshot read, decided on the device)
                pended = graph.pend(step, closures, last_update)
                run.stage = "applied"
                return pended
            # A snapshot step reads the state's magnitudes with the step, to vet them.
            reads = keeper.reads_state(run.ladder.good_steps)
            state_tensors, magnitudes = self._c.check.magnitudes() if reads else ([], None)
            deferred = self._deferred
            if (
                deferred is not None
                and not reads
                and not keeper.vetting_first
                and deferred.can_defer(guard_runs_forward)
            ):  # no read: decided on the device, settled at the next call (or forward)
                result: StepResult = deferred.start(step, closures)
                run.stage = "applied"  # (gated on the device; undone if the host says so)
                return result
            read = self._c.reader.read(step, self._c.runner.mean_loss(), magnitudes)  # one read
            vetted = (state_tensors, list(read.extra))
            if keeper.vetting_first:
                self._c.checkpoint.first_vetted(step, vetted)
            verdict: StepVerdict = self._c.judge.judge(
                step, read, closures, vetted, run.ladder, run.previous_applied
            )
            updated = self._deferred.params() if self._deferred is not None else []
            decided = self._end.act(step, read, verdict, closures)
            if self._deferred is not None and decided.action == "applied":
                self._deferred.after_exact(updated)
            return decided
        except BaseException:
            if not run.applied():  # the step did not happen: as if it had not begun
                run.step_count = step
                self._c.scratch.undo()
                keeper.abort_step()
            raise
        finally:
            run.stage = "idle"

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
        self.settle()
        return self._end.skipped_outside(reason, scale_before, scale_after)

    def close(self) -> None:
        """Detach the monitors, let go of the snapshot folder's lock, close the event log
        (once; a step after it is refused). Distributed, it waits for nothing: it leaves
        a note for the peers (finished after its steps; a ``with`` left by an exception
        from outside :meth:`step`, not GuardStopped: exited with it) and destroys the
        guard's groups. Closed without :meth:`finish` after guard steps, it warns: that
        every rank took as many guard steps is then unchecked (docs/guard.md)."""
        self._close(None)

    def _close(self, error: BaseException | None) -> None:
        if self._deferred is not None:
            if self._deferred.pending is not None and error is None:
                self.settle()  # the last step's decision before the run ends
            self._deferred.remove()
        if not self._ended:
            self._ended = True
            self._c.watches.run_ended(
                self.step_count, self._c.check, self._c.keeper.amax,
                self._c.run.ladder.lr_factor, self._end.lr(self._c.run.ladder.lr_factor),
            )  # fmt: skip
        self._c.scratch.close()
        self._c.keeper.close()
        self._c.channel.close(error)
        self._c.events.close()

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        self._close(None if isinstance(error, GuardStopped) else error)
