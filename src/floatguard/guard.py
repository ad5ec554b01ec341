"""Guard: loss scaling, clipping, detection, localization by replay and responses by cause.

```python
guard = floatguard.Guard(model, optimizer, precision="fp16", scheduler=sched, log="run.jsonl")
for x, y in loader:
    result = guard.step(lambda: loss_fn(model(x), y))  # "applied" | "skipped" | "rolled_back"
```

Words used here:

- *detection*: the step's one host read, of a small packed tensor (overflow flag,
  gradient norm, loss, clip coefficient). A clean step registers no hook and reads
  nothing else.
- *signal*: what the read says: clean, an fp16 gradient overflow (finite loss), a
  non-finite loss or gradient, a loss or gradient-norm spike.
- *localization*: on a non-finite step only, before anything changes: the
  parameters (and optimizer state) are checked, then the closure is replayed with
  the step's RNG states and buffers restored, under the op-level replay
  (:mod:`floatguard.monitor.replay`). The result is a :class:`Fault` with module,
  phase, op, source line and ``deterministic`` (whether the replay reproduced it).
- *cause* and *response*: a non-finite input batch is skipped (LR and scale
  unchanged); an fp16 gradient overflow backs the scale off; a non-finite parameter
  or optimizer state rolls back at once; a spike is skipped, then the LR backs off;
  other deterministic faults climb the ladder (skip, LR back-off, rollback); the
  same deterministic fault again after a rollback stops the run; a transient fault
  (the replay is clean) is skipped and counted.

Reading order: :meth:`Guard.step` (one screen: run -> gather -> read -> decide ->
act), then the steps it names, each a method of a few lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch import nn

from floatguard._values import local_part, values_of
from floatguard.distributed import (
    SLOTS,
    DDPReadHook,
    GuardDesync,
    PeerFailed,
    Peers,
    config_fingerprint,
    pack,
    unpack,
)
from floatguard.events import EventLog
from floatguard.monitor.hooks import Monitor
from floatguard.monitor.localize import Fault
from floatguard.monitor.replay import ReplayResult, run_localized
from floatguard.scaling.loss_scale import DynamicLossScaler
from floatguard.stability.clip import ZClip, clip_grad_value_, total_norm
from floatguard.stability.respond import ClipPolicy, GuardStopped, ResponsePolicy, SpikePolicy
from floatguard.stability.snapshot import Snapshot, SnapshotError, SnapshotStore, load_snapshot
from floatguard.stability.spikes import LossSpikeHandler, RobustSpikeDetector
from floatguard.stability.step_state import StepState, set_rng_state
from floatguard.stats import TensorStats

__all__ = ["Guard", "StepResult"]

Precision = Literal["fp32", "bf16", "fp16"]
Action = Literal["applied", "skipped", "rolled_back"]
Watch = Literal["replay", "hooks", "off"]
Closure = Callable[[], torch.Tensor]
_Response = Literal["apply", "skip", "backoff", "ladder", "rollback", "stop"]


@dataclass(frozen=True)
class StepResult:
    """What the guard did with one step, and the numbers it decided on.

    ``reason`` (None when applied): "nonfinite_input", "nonfinite_param",
    "overflow" (fp16 gradient overflow), "nonfinite_loss", "nonfinite_grad",
    "transient" (a replay of the step was clean), "loss_spike", "grad_norm_spike",
    "after_rollback" (a batch the policy skips after a rollback). ``fault``: where the
    non-finite value was born, when it was localized.
    """

    step: int
    action: Action
    reason: str | None
    loss: float
    grad_norm: float
    scale: float
    clip_coef: float = 1.0
    lr_factor: float = 1.0
    fault: Fault | None = field(default=None, repr=False)


@dataclass(frozen=True)
class _Read:
    """The host copy of the step's packed numbers."""

    overflow: bool
    grad_norm: float
    loss: float
    clip_coef: float
    zclip: tuple[float, bool] | None  # ZClip's (clip value, clipped), for its update
    monitor_fault: Fault | None
    bad_ranks: tuple[int, ...] = ()  # under torch.distributed: ranks with a bad local loss/norm


@dataclass(frozen=True)
class _Gathered:
    packed: torch.Tensor
    monitor_slots: int


class _Detector:
    def __init__(self, policy: SpikePolicy) -> None:
        self.policy = policy
        self.impl: LossSpikeHandler | RobustSpikeDetector
        if policy.detector == "lesson":
            self.impl = LossSpikeHandler(policy.threshold, policy.patience, policy.window)
        else:
            self.impl = RobustSpikeDetector(
                policy.window, policy.z, min(policy.warmup, policy.window)
            )

    def would_spike(self, value: float) -> bool:
        if isinstance(self.impl, LossSpikeHandler):
            return self.impl.is_spike(value) and self.impl.spike_count + 1 >= self.impl.patience
        return self.impl.score(value) > self.impl.z

    def record(self, value: float) -> None:
        self.impl.check(value)

    def state_dict(self) -> dict[str, Any]:
        return self.impl.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.impl.load_state_dict(sd)


def _fault_key(fault: Fault) -> tuple[str, str, str, str | None]:
    """What makes two faults "the same fault" for the stop rule."""
    return (fault.phase, fault.module, fault.tensor, fault.op)


def _fault_from_replay(step: int, r: ReplayResult, deterministic: bool) -> Fault:
    return Fault(
        step, r.phase, r.module if r.module is not None else "", r.tensor, r.kind, r.shape,
        r.outputs[0] if r.outputs else None, r.op, r.source, deterministic,
    )  # fmt: skip


def _stats_fields(st: TensorStats | None) -> dict[str, Any] | None:
    """A birth's statistics for the event stream: counts and finite extremes (one read)."""
    if st is None:
        return None
    v = torch.stack(
        [st.numel.double(), st.nan.double(), st.posinf.double(), st.neginf.double(),
         st.zeros.double(), st.amax.double(), st.min.double(), st.max.double()]
    ).cpu().tolist()  # fmt: skip
    names = ("numel", "nan", "posinf", "neginf", "zeros", "amax", "min", "max")
    return {n: (int(x) if i < 5 else x) for i, (n, x) in enumerate(zip(names, v, strict=True))}


class Guard:
    """Keep a training loop numerically healthy.

    Args:
        model: the module being trained (its parameters must be the optimizer's).
        optimizer: any ``torch.optim.Optimizer``.
        precision: "fp32", "bf16" (autocast to bfloat16) or "fp16" (autocast to
            float16 with dynamic loss scaling).
        scheduler: an LR scheduler to step with applied steps only.
        clip, spikes, response: frozen policies (defaults: ZClip with its published
            settings; robust loss-spike detection; responses by cause, see the module).
        scaler: a :class:`DynamicLossScaler` to use for fp16 (default: a new one).
        watch: how a bad step is localized. ``"replay"`` (default): nothing runs on a
            clean step; a bad step given as a closure (``step(closure)``) is replayed
            and the birth named. ``"hooks"``: also keep the hook-based
            :class:`Monitor` attached (for the three-call loop without a closure; it
            costs hooks on every step, and it ignores no-grad forwards). ``"off"``:
            check the parameters on a bad step, nothing else.
        stats_every: every that many steps, record per-layer statistics (amax, the
            fractions fp16/bf16/e4m3/e5m2 would lose, exponent histograms) with a
            sampling :class:`Monitor` (hooks on those steps only) and write them as a
            ``stats`` event (for the report's heatmaps and histograms). Default: off.
        log: a JSONL path for the event stream (events are kept in memory too).
        distributed: decide every step together over ``process_group`` (default: when
            torch.distributed is initialized): one all-reduce per step of one small
            packed tensor (overflow flag, gradient norm with FSDP2 shards summed and
            DDP replicas averaged, loss, which ranks saw a non-finite value, and the
            step counter and a configuration fingerprint, checked: a rank on another
            step or configured differently raises :class:`GuardDesync` on every rank).
            On a bad step every rank localizes (replay under ``no_sync()``) and the
            ranks all-gather their findings: every rank names the faulting rank and
            takes the same response. See :mod:`floatguard.distributed`.
        peer_timeout_s: under torch.distributed, how long the guard's own collectives
            wait for the other ranks before :class:`PeerFailed` (None: forever).
        peer_grace_s: under torch.distributed, after another rank raised out of its
            guard, how long this rank may stay blocked in a collective the guard does
            not own (DDP's all-reduce in backward) before the watchdog ends the process
            with the reason on stderr (None: wait for the backend's own timeout).

    Two ways to drive it. ``step(closure)``: the closure runs the forward and returns
    the loss (inside the guard's autocast; it must capture its batch, so a replay
    sees the same data and the data iterator is not advanced); the guard runs the
    backward and decides. A sequence of closures accumulates gradients (each loss
    is backpropagated as returned; the step is decided on their mean). Or the
    three-call loop (``with guard.autocast(): loss = ...``, ``guard.backward(loss)``,
    ``guard.step()``): the same detection and responses, without replay.

    The guard zeroes the gradients at the end of every step. A step is applied whole
    or not at all: a skipped step changes no weight, optimizer state, scheduler or
    scaler growth, and restores the buffers (BatchNorm statistics) it changed.
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
        peer_grace_s: float | None = 10.0,
    ) -> None:
        self._check_args(model, optimizer, precision, watch)
        devices = {p.device for p in model.parameters()}
        if distributed is None:
            import torch.distributed as dist

            distributed = dist.is_available() and dist.is_initialized()
        self.distributed = bool(distributed)
        self.process_group = process_group
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.precision: Precision = precision
        self.watch: Watch = watch
        self.device = next(iter(devices))
        self.clip = clip or ClipPolicy()
        self.spikes = spikes or SpikePolicy()
        self.response = response or ResponsePolicy()
        self.scaler = (
            scaler if scaler is not None else DynamicLossScaler(enabled=precision == "fp16")
        )
        if precision != "fp16":
            self.scaler.enabled = False
        # ZClip on the host: the norm is in the step's one read, so its statistics and
        # coefficient cost no device op (the same float64 arithmetic as on device).
        self.zclip = ZClip(self.clip.zclip, on_host=True) if self.clip.kind == "zclip" else None
        self.loss_detector = _Detector(self.spikes) if self.spikes.watch_loss else None
        self.norm_detector = _Detector(self.spikes) if self.spikes.watch_grad_norm else None
        # The guard starts the monitor's steps itself, so records of every micro-batch
        # of an accumulated step are there when the step is decided.
        self.monitor = Monitor(model, auto_step=False).attach() if watch == "hooks" else None
        if stats_every is not None and (
            isinstance(stats_every, bool) or not isinstance(stats_every, int) or stats_every < 2
        ):
            raise ValueError(f"stats_every={stats_every!r} must be an int >= 2 or None")
        self.stats_monitor = (
            Monitor(model, mode="stats", every=stats_every, auto_step=False).attach()
            if stats_every is not None
            else None
        )
        self.events = EventLog(log, rank=self._rank())
        self.step_count = 0
        self.good_steps = 0
        self.consecutive_bad = 0
        self.rollbacks = 0
        self._rollback_streak = 0  # rollbacks in a row, for the stop rule
        self._good_since_rollback = 0
        self.transients = 0
        self.skip_remaining = 0
        self.lr_factor = 1.0
        self._lr_recover_from: float | None = None
        self._lr_recover_step = 0
        self._losses: list[torch.Tensor] = []
        # The fault the last rollback answered; cleared by the next snapshot (training
        # went on past it), so only a fault that returns before then stops the run.
        self._rolled_back_for: tuple[str, str, str, str | None] | None = None
        self._state = StepState(model)
        self._state.save()
        self._snapshot: Snapshot | None = None
        self._snapshots_taken = 0
        self._store = (
            SnapshotStore(self.response.snapshot_dir, self.response.snapshot_keep)
            if self.response.snapshot_dir is not None
            else None
        )
        self._applied = False  # set just before optimizer.step(): no undo past it
        self._peers = (
            Peers(process_group, timeout_s=peer_timeout_s, grace_s=peer_grace_s, device=self.device)
            if self.distributed
            else None
        )
        self._fingerprint = config_fingerprint(self._configuration())
        self._ddp_hook = self._register_ddp_hook()
        self._carried = False  # this step's read came on DDP's all-reduce
        self._take_snapshot(0)

    def _register_ddp_hook(self) -> DDPReadHook | None:
        """Under DDP, carry the step's read on DDP's own gradient all-reduce (no extra
        collective per step); a model with a comm hook of its own keeps it, and the
        guard all-reduces its read separately."""
        if self._peers is None or not isinstance(self.model, nn.parallel.DistributedDataParallel):
            return None
        hook = DDPReadHook(self.process_group, self._peers.world)
        try:
            self.model.register_comm_hook(None, hook.as_comm_hook())
        except RuntimeError:  # "can only be called once": the user's hook stays
            return None
        return hook

    def _configuration(self) -> tuple[Any, ...]:
        """What every rank's guard must share (for the fingerprint): precision, policies
        (paths left out: they may differ per rank), the model's global parameter shapes."""
        resp = {k: v for k, v in vars(self.response).items() if "dir" not in k}
        shapes = [tuple(p.shape) for p in self.model.parameters()]  # DTensor: global shape
        return (self.precision, self.watch, self.clip, self.spikes, sorted(resp.items()), shapes)

    def _rank(self) -> int:
        if not self.distributed:
            return 0
        import torch.distributed as dist

        return int(dist.get_rank(self.process_group))

    @staticmethod
    def _check_args(
        model: nn.Module, optimizer: torch.optim.Optimizer, precision: str, watch: str
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Guard needs an nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"Guard needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if precision not in get_args(Precision):
            raise ValueError(f"precision={precision!r}; use 'fp32', 'bf16' or 'fp16'")
        if watch not in get_args(Watch):
            raise ValueError(f"watch={watch!r}; use 'replay' (default), 'hooks' or 'off'")
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

    # ----------------------------------------------------------------- loop API
    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """``torch.autocast`` to the guard's precision (nothing for fp32)."""
        if self.precision == "fp32":
            yield
            return
        dtype = torch.float16 if self.precision == "fp16" else torch.bfloat16
        with torch.autocast(device_type=self.device.type, dtype=dtype):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the (scaled, for fp16) loss; the loss is kept for the step's decision.

        May be called several times before :meth:`step` (gradient accumulation): the
        gradients add up as usual and the step is decided on the mean loss.
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"Guard.backward needs a scalar loss tensor, got {got}")
        if self.monitor is not None:
            self.monitor.check_loss(loss)
        # The step is decided on the mean of the micro-batches' losses (device ops).
        self._losses.append(loss.detach().float().reshape(()))
        target = self.scaler.scale(loss) if self.scaler.enabled else loss
        with self._region():
            target.backward()  # type: ignore[no-untyped-call]

    def record_loss(self, loss: torch.Tensor) -> None:
        """Record a micro-batch's loss for this step's decision without running its
        backward (for loops that run the backward themselves: the integrations)."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"Guard.record_loss needs a scalar loss tensor, got {got}")
        self._losses.append(loss.detach().float().reshape(()).to(self.device))

    def has_recorded_losses(self) -> bool:
        """Whether a loss was recorded (:meth:`backward`, :meth:`record_loss`) for this step."""
        return bool(self._losses)

    def recorded_losses_finite(self) -> torch.Tensor:
        """Whether the losses recorded for this step are all finite: a device bool, no
        sync (read it together with what else the caller needs)."""
        if not self._losses:
            return torch.ones((), dtype=torch.bool, device=self.device)
        return torch.stack(self._losses).isfinite().all()

    def _region(self) -> contextlib.AbstractContextManager[None]:
        """Where this rank may block in collectives the guard does not own."""
        return self._peers.region() if self._peers is not None else contextlib.nullcontext()

    def step(
        self,
        closure: Closure | Sequence[Closure] | None = None,
        *,
        replay: Sequence[Closure] | None = None,
    ) -> StepResult:
        """Decide on this step (one host read), apply it or not, and zero the gradients.

        ``closure``: a function running the forward and returning the loss (or a
        sequence of them for gradient accumulation); without it, the losses given to
        :meth:`backward` (or :meth:`record_loss`) since the last step are decided on.
        ``replay``: for that second form, closures that re-run the step's forward (its
        micro-batches) if the step turns out bad, so it can be localized all the same
        (the integrations pass the batches the trainer ran).
        """
        try:
            return self._step(closure, replay)
        except (PeerFailed, GuardDesync) as e:
            reason = "peer_failed" if isinstance(e, PeerFailed) else "desync"
            self.events.emit("stop", self.step_count, reason=reason, fault=str(e))
            raise
        except GuardStopped:
            raise  # decided together: every rank raises it
        except BaseException as e:
            if self._peers is not None:  # this rank alone: tell the others, who wait on it
                self._peers.announce_failure(self.step_count, e)
            raise

    def _step(self, closure: Closure | Sequence[Closure] | None,
              replay: Sequence[Closure] | None) -> StepResult:  # fmt: skip
        closures = self._closures(closure)
        if self._peers is not None:
            self._peers.raise_if_failed()
        if closures:
            self._state.rng = self._state.rng_now()  # the draws this step's forward makes
            try:
                self._forward_backward(closures, early=self._ddp_hook is not None)
            except BaseException:
                # The closure failed (a user error, an interrupt): the step did not
                # happen; nothing of it stays for the next one.
                self._discard()
                raise
        elif not self._losses:
            raise RuntimeError("call guard.backward(loss) before guard.step(), or pass a closure")
        else:
            closures = self._closures(replay) if replay else []
        step = self.step_count
        self.step_count += 1
        self._applied = False
        try:
            read = self._read(self._gather(step))
            response, reason, fault = self._decide(step, read, closures)
            return self._act(step, read, response, reason, fault)
        except BaseException:
            if not self._applied:  # the step did not happen: as if it had not begun
                self.step_count = step
                self._discard()
            raise

    # ------------------------------------------------------------------ run
    @staticmethod
    def _closures(closure: Closure | Sequence[Closure] | None) -> list[Closure]:
        if closure is None:
            return []
        items = [closure] if callable(closure) else list(closure)
        bad = [type(c).__name__ for c in items if not callable(c)]
        if bad or not items:
            raise TypeError(
                f"Guard.step(closure) needs a callable returning the loss, or a non-empty "
                f"sequence of them; got {bad[0] if bad else 'an empty sequence'}"
            )
        return items

    def _forward_backward(
        self, closures: Sequence[Closure], *, early: bool = False
    ) -> torch.Tensor:
        """Run every closure's forward (under autocast) and backward; the mean loss.
        ``early``: under DDP, arm the guard's comm hook after the last forward, so the
        step's read rides on DDP's gradient all-reduce (see :meth:`_launch_early`)."""
        for i, c in enumerate(closures):
            with self.autocast(), self._region():
                loss = c()
            if not isinstance(loss, torch.Tensor):
                raise TypeError(
                    f"the closure must return the loss tensor, got {type(loss).__name__}"
                )
            if early and i == len(closures) - 1:
                self._launch_early(loss)
            self.backward(loss)
        return torch.stack(self._losses).mean()

    def _launch_early(self, last_loss: torch.Tensor) -> None:
        assert self._peers is not None and self._ddp_hook is not None
        losses = [*self._losses, last_loss.detach().float().reshape(())]
        loss = torch.stack(losses).mean().to(self.device)
        self._ddp_hook.arm(loss, ~torch.isfinite(loss), self._peers.rank, self.step_count,
                           self._fingerprint)  # fmt: skip

    # --------------------------------------------------------------- gather
    def _grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.device]:
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        dev = params[0].device if params else self.device
        return params, [p.grad for p in params if p.grad is not None], dev

    def _gather(self, step: int) -> _Gathered:
        """Unscale and take the norm on device; pack what the read needs. No sync."""
        _, _, dev = self._grads()
        found = (
            self.scaler.unscale_(self.optimizer).to(dev)
            if self.scaler.enabled
            else torch.zeros((), device=dev)
        )
        _, grads, _ = self._grads()  # after unscale_ (a sparse gradient is coalesced)
        loss = torch.stack(self._losses).mean().to(dev)
        if self._peers is not None:
            small = self._pack_distributed(step, found, grads, loss, dev)
        else:
            norm = total_norm(grads).to(dev).float() if grads else torch.zeros((), device=dev)
            small = torch.stack([found.float(), norm, loss])
        packed_mon = self.monitor.packed_records() if self.monitor is not None else None
        n = 0
        if packed_mon is not None:
            lo, hi = packed_mon
            n = len(lo)
            # float64 records stay float64 (cat promotes): a finite 1e300 is not an inf
            small = torch.cat([small, lo.to(dev), hi.to(dev)])
        return _Gathered(small, n)

    def _clip_coef(self, grad_norm: float) -> tuple[float, tuple[float, bool] | None]:
        """The clip coefficient for this norm, on the host (the norm was just read):
        ZClip's or clip_grad_norm_'s formula (1 for a non-finite norm)."""
        if self.zclip is not None:
            clip_value, clipped, coef = self.zclip.compute(grad_norm)
            return float(coef), (clip_value, clipped)
        if self.clip.kind == "norm" and math.isfinite(grad_norm):
            return min(1.0, self.clip.max_norm / (grad_norm + 1e-6)), None
        return 1.0, None

    def _clip(self, coef: float) -> None:
        params, grads, _ = self._grads()
        if self.clip.kind == "value":
            clip_grad_value_(params, self.clip.max_value)
        elif grads and coef != 1.0:
            torch._foreach_mul_(grads, coef)

    def _pack_distributed(
        self, step: int, found: torch.Tensor, grads: list[torch.Tensor], loss: torch.Tensor,
        dev: torch.device,
    ) -> torch.Tensor:  # fmt: skip
        """This rank's packed read, all-reduced (SUM) once: flags > 0 on any rank stay
        > 0, NaN anywhere stays NaN; see :mod:`floatguard.distributed` for the slots."""
        assert self._peers is not None
        if self._ddp_hook is not None:
            # DDP: every rank's gradients are the same average, so norm and overflow need
            # no reduction; the losses and the step check came with the gradients.
            n = total_norm(grads).to(dev).double() if grads else torch.zeros((), device=dev)
            carried = self._ddp_hook.take(found, n)
            if carried is not None:
                self._carried = True
                return carried
        sharded = [g.to_local() for g in grads if hasattr(g, "to_local")]  # FSDP2 shards
        replicated = [g for g in grads if not hasattr(g, "to_local")]
        zero = torch.zeros((), device=dev, dtype=torch.float64)
        sq_sh = total_norm(sharded).to(dev).double() ** 2 if sharded else zero
        n_rep = total_norm(replicated).to(dev).double() if replicated else zero
        local_bad = ~torch.isfinite(loss) | ~torch.isfinite(n_rep) | ~torch.isfinite(sq_sh)
        packed = pack(found, sq_sh, n_rep**2, loss, local_bad, self._peers.rank, step,
                      self._fingerprint)  # fmt: skip
        return self._peers.all_reduce_sum(packed, "step read")

    # ----------------------------------------------------------------- read
    def _read(self, g: _Gathered) -> _Read:
        # The one host read of the step: flags, norm, loss, coefficient, monitor records.
        values = g.packed.tolist()
        head = 3
        overflow, norm, loss = values[0] > 0, values[1], values[2]
        bad_ranks: tuple[int, ...] = ()
        if self._peers is not None:
            head = SLOTS.size
            step = self.step_count - 1
            if self._carried:  # on DDP's gradient all-reduce (DDPReadHook)
                assert self._ddp_hook is not None
                self._carried = False
                head = self._ddp_hook.size
                summed = self._ddp_hook.values(values[:head], self._peers.rank, step,
                                               self._fingerprint)  # fmt: skip
            else:
                summed = values[:head]
            agreed = unpack(summed, self._peers.world, self._peers.rank, step,
                            self._fingerprint)  # fmt: skip
            overflow, norm, loss = agreed.found, agreed.grad_norm, agreed.loss
            bad_ranks = agreed.bad_ranks
        fault = None
        if self.monitor is not None and g.monitor_slots:
            n = g.monitor_slots
            faults = self.monitor.faults_from(values[head : head + n], values[head + n :])
            fault = faults[0] if faults else None
        coef, zstate = self._clip_coef(norm)
        return _Read(overflow, norm, loss, coef, zstate, fault, bad_ranks)

    # --------------------------------------------------------------- decide
    def _decide(
        self, step: int, read: _Read, closures: Sequence[Closure]
    ) -> tuple[_Response, str | None, Fault | None]:
        """The signal, then (on a non-finite step) the cause, then the response."""
        finite_loss = math.isfinite(read.loss)
        overflow = read.overflow or not math.isfinite(read.grad_norm)
        # Under torch.distributed the read is the same on every rank, and so is every
        # decision taken from it; only localization is per rank, and it is agreed on.
        if self.scaler.enabled and finite_loss and overflow and not self._scale_at_floor():
            return "backoff", "overflow", None
        if not finite_loss or overflow:
            fault = self._localize(step, read, closures)
            response, reason = self._respond_to_fault(fault, finite_loss)
            return response, reason, fault
        spike = self._spike(read)
        if spike is not None:
            return "ladder", spike, None
        if self.skip_remaining > 0:
            self.skip_remaining -= 1
            return "skip", "after_rollback", None
        return "apply", None, None

    def _scale_at_floor(self) -> bool:
        """The loss scale cannot back off further: a gradient that still overflows is
        not an overflow the scale can cure, so it is localized like any other fault."""
        return self.scaler.get_scale() <= self.scaler.min_scale

    def _spike(self, read: _Read) -> str | None:
        if self.loss_detector is not None and self.loss_detector.would_spike(read.loss):
            return "loss_spike"
        if self.norm_detector is not None and self.norm_detector.would_spike(read.grad_norm):
            return "grad_norm_spike"
        return None

    def _localize(self, step: int, read: _Read, closures: Sequence[Closure]) -> Fault | None:
        """Where the non-finite value was born: a bad parameter, else a replay of the
        step (with a closure), else the hook monitor's records (watch="hooks")."""
        bad_param = self._agreed_fault(self._bad_parameter(step), read, "parameter check")
        if bad_param is not None:
            return bad_param  # (on every rank: no rank replays while another does not)
        if closures and self.watch != "off":
            return self._agreed_fault(self._replay(step, closures, read), read, "replay")
        return self._agreed_fault(read.monitor_fault, read, "hook records")

    def _agreed_fault(self, local: Fault | None, read: _Read, what: str) -> Fault | None:
        """Under torch.distributed, the fault every rank takes: the ranks all-gather their
        own finding (bad steps only) and take the first reproduced one (lowest rank),
        else the first finding, named with its rank; without distributed, ``local``."""
        if self._peers is None:
            return local
        mine = None if local is None else dataclasses.replace(local, rank=self._peers.rank)
        records = self._peers.all_gather_json(
            {"fault": None if mine is None else mine.to_record()}, f"agreement on the {what}"
        )
        found = [Fault.from_record(r["fault"]) for r in records if r.get("fault")]
        # reproduced first, then localized (an op named) first, then the lowest rank
        found.sort(key=lambda f: (f.deterministic is not True, f.op is None, f.rank or 0))
        if not found:
            return None
        best = found[0]
        if mine is not None and best == mine:
            best = mine  # this rank's own finding, with its value statistics (not sent)
        if best.deterministic is not True and read.bad_ranks:
            best = dataclasses.replace(best, rank=read.bad_ranks[0])  # where the read saw it
        return best

    def _bad_parameter(self, step: int) -> Fault | None:
        """The first non-finite parameter or optimizer-state tensor (bad steps only)."""
        tensors: list[tuple[str, str, torch.Tensor]] = []  # (owner module, role, tensor)
        named = self._named_root()
        for name, p in named.named_parameters():
            owner, _, pname = name.rpartition(".")
            tensors.append((owner, f"param:{pname}", local_part(p)))
            for key, v in self.optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() > 1:
                    tensors.append((owner, f"optimizer:{pname}.{key}", local_part(v)))
        # Under fp16 autocast a weight past fp16's range turns into inf when cast: a
        # flipped exponent bit that leaves it finite in float32 is as bad as a NaN.
        limit = 65504.0 if self.precision == "fp16" else math.inf
        checks = [
            (values_of(t).abs() <= limit).all().to(self.device)
            if role.startswith("param:") and limit < math.inf
            else values_of(t).isfinite().all().to(self.device)
            for _, role, t in tensors
        ]
        flags = torch.stack(checks).tolist() if checks else []  # a bad step's second read
        for (owner, role, t), ok in zip(tensors, flags, strict=True):
            if not ok:
                # (a weight past fp16's range counts as the inf it becomes when cast)
                kind: Literal["nan", "inf"] = "nan" if bool(values_of(t).isnan().any()) else "inf"
                shape = tuple(t.shape)
                return Fault(step, "param", owner, role, kind, shape, None, "parameter", None, True)
        return None

    def _replay(self, step: int, closures: Sequence[Closure], read: _Read) -> Fault:
        """Re-run the step from its starting state under the op-level replay."""
        after = self._state.rng_now()
        self.optimizer.zero_grad(set_to_none=True)
        self._state.restore_buffers()
        self._state.restore_rng()
        self._losses = []
        with self._no_gradient_sync():
            run = lambda: self._forward_backward(closures)  # noqa: E731
            found = run_localized(run, model=self._named_root())
        reproduced = self._step_is_bad()
        self.optimizer.zero_grad(set_to_none=True)
        self._losses = []
        set_rng_state(after)
        if found is not None and reproduced:
            return _fault_from_replay(step, found, True)
        # Not localized (or not reproduced): what the read saw, where it saw it.
        loss_ok = math.isfinite(read.loss)
        phase: Literal["loss", "backward"] = "backward" if loss_ok else "loss"
        seen = read.grad_norm if loss_ok else read.loss
        kind: Literal["nan", "inf"] = "nan" if math.isnan(seen) else "inf"
        return Fault(step, phase, "", "grad" if loss_ok else "loss", kind, (), None, None, None,
                     reproduced)  # fmt: skip

    def _named_root(self) -> nn.Module:
        """The module whose names faults use: a compiled model (torch.compile's wrapper)
        and a DistributedDataParallel model are named by the module they wrap."""
        root = self.model
        if isinstance(root, nn.parallel.DistributedDataParallel):
            root = root.module
        inner = getattr(root, "_orig_mod", root)
        return inner if isinstance(inner, nn.Module) else root

    @contextlib.contextmanager
    def _no_gradient_sync(self) -> Iterator[None]:
        """DDP's ``no_sync()`` around the replay: each rank's gradients stay its own, so
        only the faulting rank reproduces the fault. FSDP2 replays with its collectives
        (every rank replays a bad step, so they match): without gradient sync it keeps
        the replay's unsharded gradients and adds them to the next step's. The replay
        does not take a value a collective delivers for a birth, so there too only the
        faulting rank names one."""
        sync = getattr(self.model, "no_sync", None)
        if callable(sync):
            with sync():
                yield
        else:
            yield

    def _step_is_bad(self) -> bool:
        """Whether the replayed step was bad again (loss or a gradient non-finite)."""
        _, grads, dev = self._grads()
        flags = [torch.stack(self._losses).isfinite().all().to(dev)] if self._losses else []
        flags += [local_part(g.detach()).isfinite().all().to(dev) for g in grads
                  if g.layout == torch.strided]  # fmt: skip
        return not all(torch.stack(flags).tolist()) if flags else False

    def _respond_to_fault(self, fault: Fault | None, finite_loss: bool) -> tuple[_Response, str]:
        generic = "nonfinite_grad" if finite_loss else "nonfinite_loss"
        if fault is None:
            return "ladder", generic
        again = bool(fault.deterministic) and self._rolled_back_for == _fault_key(fault)
        if fault.phase == "param":
            return ("stop" if again else "rollback"), "nonfinite_param"
        if fault.deterministic is False:
            return "skip", "transient"
        if fault.phase == "input":
            return "skip", "nonfinite_input"
        return ("stop" if again else "ladder"), generic

    # ------------------------------------------------------------------ act
    def _act(
        self,
        step: int,
        read: _Read,
        response: _Response,
        reason: str | None,
        fault: Fault | None,
    ) -> StepResult:
        scale = self.scaler.get_scale()
        if fault is not None:
            self._emit_fault(step, fault)
        action: Action = "skipped"
        if response == "apply":
            self._apply(step, read)
            action = "applied"
        else:
            self._undo()
            if response == "backoff":
                self._back_off_scale(step)
            else:
                self.scaler.skip_step()
            if reason in ("loss_spike", "grad_norm_spike"):
                value = read.loss if reason == "loss_spike" else read.grad_norm
                self.events.emit("spike", step, signal=reason.removesuffix("_spike"), value=value)
            if reason == "transient":
                self._count_transient(step, fault)
            if response == "stop":
                self._stop(step, fault)
            elif response == "rollback":
                action = self._rollback(step, fault, lr_backoff=False)
            elif response == "ladder":
                self.consecutive_bad += 1
                action = self._escalate(step, fault)
        self._end_step(step)
        result = StepResult(
            step, action, reason, read.loss, read.grad_norm, scale, read.clip_coef,
            self.lr_factor, fault,
        )  # fmt: skip
        self.events.emit(
            "step", step, action=action, reason=reason, loss=read.loss,
            grad_norm=read.grad_norm, clip_coef=read.clip_coef, scale=scale,
            lr_factor=self.lr_factor,
        )  # fmt: skip
        return result

    def _apply(self, step: int, read: _Read) -> None:
        # The weights just gave a finite loss and gradients: a snapshot of them is good.
        if self.good_steps % self.response.snapshot_every == 0 and self.good_steps:
            self._take_snapshot(step)
        self._clip(read.clip_coef)
        self._applied = True
        self._optimizer_step()
        if self.zclip is not None and read.zclip is not None:
            self.zclip.update(read.grad_norm, *read.zclip)
        self.scaler.update(found_inf=False)
        for det, v in ((self.loss_detector, read.loss), (self.norm_detector, read.grad_norm)):
            if det is not None:
                det.record(v)
        self.consecutive_bad = 0
        self.good_steps += 1
        self._good_since_rollback += 1
        self._recover_lr()

    def _optimizer_step(self) -> None:
        if self.lr_factor != 1.0:
            saved = [pg["lr"] for pg in self.optimizer.param_groups]
            for pg in self.optimizer.param_groups:
                pg["lr"] = pg["lr"] * self.lr_factor
            self.optimizer.step()
            for pg, lr in zip(self.optimizer.param_groups, saved, strict=True):
                pg["lr"] = lr
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def _discard(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._losses = []
        self._state.restore_buffers()
        if self.scaler.enabled:
            self.scaler.skip_step()
        if self.monitor is not None:
            self.monitor.reset()
        if self.stats_monitor is not None:
            self.stats_monitor.reset()

    def _undo(self) -> None:
        """A step not applied leaves no trace in the buffers it changed."""
        self._state.restore_buffers()

    def _back_off_scale(self, step: int) -> None:
        before = self.scaler.get_scale()
        self.scaler.update(found_inf=True)
        self.events.emit("overflow", step, scale_before=before, scale_after=self.scaler.get_scale())

    def _count_transient(self, step: int, fault: Fault | None) -> None:
        self.transients += 1
        if self.transients in (
            self.response.transient_warn_after,
            10 * self.response.transient_warn_after,
        ):
            self.events.emit(
                "warning", step, transients=self.transients,
                message=(
                    f"{self.transients} non-finite steps did not reproduce when replayed: "
                    "suspect a nondeterministic kernel, a race (asynchronous copies, "
                    "streams) or failing hardware"
                ),
            )  # fmt: skip

    def _end_step(self, step: int) -> None:
        if self.stats_monitor is not None:
            summary = self.stats_monitor.stats_summary()  # empty on unsampled steps
            if summary:
                self.events.emit("stats", step, tensors=summary)
            self.stats_monitor.next_step()
        self.optimizer.zero_grad(set_to_none=True)
        self._losses = []
        if self.monitor is not None:
            self.monitor.next_step()
        self._state.save()

    def _emit_fault(self, step: int, fault: Fault) -> None:
        self.events.emit(
            "fault", step, phase=fault.phase, module=fault.module, tensor=fault.tensor,
            kind_of_value=fault.kind, shape=list(fault.shape), op=fault.op,
            source=fault.source, deterministic=fault.deterministic,
            stats=_stats_fields(fault.stats), fault_rank=fault.rank,
        )  # fmt: skip

    def _recover_lr(self) -> None:
        if self._lr_recover_from is None:
            return
        self._lr_recover_step += 1
        frac = min(1.0, self._lr_recover_step / self.response.lr_recovery_steps)
        self.lr_factor = self._lr_recover_from + (1.0 - self._lr_recover_from) * frac
        if frac >= 1.0:
            self._lr_recover_from = None
            self.lr_factor = 1.0

    def _escalate(self, step: int, fault: Fault | None) -> Action:
        r = self.response
        if self.consecutive_bad >= r.rollback_after:
            return self._rollback(step, fault, lr_backoff=True)
        if self.consecutive_bad >= r.lr_backoff_after:
            self._back_off_lr(step)
        return "skipped"

    def _back_off_lr(self, step: int) -> None:
        self.lr_factor *= self.response.lr_backoff_factor
        self._lr_recover_from = self.lr_factor
        self._lr_recover_step = 0
        self.events.emit("lr_backoff", step, factor=self.lr_factor)

    def _stateful(self) -> dict[str, Any]:
        objs: dict[str, Any] = {
            "model": self.model,
            "optimizer": self.optimizer,
            "scaler": self.scaler,
        }
        if self.scheduler is not None:
            objs["scheduler"] = self.scheduler
        if self.zclip is not None:
            objs["zclip"] = self.zclip
        if self.loss_detector is not None:
            objs["loss_detector"] = self.loss_detector
        if self.norm_detector is not None:
            objs["norm_detector"] = self.norm_detector
        return objs

    def _counters(self) -> dict[str, Any]:
        """The guard's own state, saved with each snapshot (for :meth:`resume`)."""
        return {
            "good": self.good_steps, "consecutive_bad": self.consecutive_bad,
            "rollbacks": self.rollbacks, "transients": self.transients,
            "rollback_streak": self._rollback_streak,
            "good_since_rollback": self._good_since_rollback,
            "skip_remaining": self.skip_remaining, "lr_factor": self.lr_factor,
            "lr_recover_from": self._lr_recover_from, "lr_recover_step": self._lr_recover_step,
            "snapshots": self._snapshots_taken,
            # the torch RNG at the start of the step (a resumed run redoes this step)
            "step_rng": dict(self._state.rng),
        }  # fmt: skip

    def _take_snapshot(self, step: int) -> None:
        """Snapshot the state before step ``step`` is applied (its weights just gave a
        finite loss and gradients), in memory (copied into the previous snapshot's
        memory) and, every ``disk_every``-th time, on disk."""
        self._rolled_back_for = None
        self._snapshot = Snapshot.capture(
            step, self._stateful(), meta=self._counters(), reuse=self._snapshot
        )
        self._snapshots_taken += 1
        where = "memory"
        if self._store is not None and (self._snapshots_taken - 1) % self.response.disk_every == 0:
            where = self._write_snapshot(step, self._snapshot)
        self.events.emit("snapshot", step, where=where)

    def _write_snapshot(self, step: int, snap: Snapshot) -> str:
        """Write ``snap`` to the store; a failure is an event, then the policy acts."""
        assert self._store is not None
        try:
            return str(self._store.save(snap))
        except (OSError, RuntimeError, SnapshotError) as e:
            policy = self.response.on_snapshot_error
            error = f"{type(e).__name__}: {e}"
            self.events.emit(
                "snapshot_error", step, where=str(self._store.folder), error=error, policy=policy
            )
            if policy == "disable":
                self._store = None
            elif policy == "raise":
                raise SnapshotError(
                    f"cannot write the snapshot of step {step} to {self._store.folder} "
                    f"({error}); the step was not applied"
                ) from e
            return "memory"

    def resume(self, path: str | os.PathLike[str] | None = None) -> int:
        """Continue a run from its newest good snapshot on disk; returns the step to run next.

        ``path``: a snapshot file, or a folder of them (default: the policy's
        ``snapshot_dir``). In a folder, a newest snapshot that fails to verify is
        skipped for the one before it (a ``snapshot_fallback`` event each). Model,
        optimizer, scaler, scheduler, clipper, detectors, the guard's counters and the
        torch RNG (as at the start of that step) are restored; a ``resume`` event marks
        where the event stream picks up (events of the steps the crash cut short stay
        in the file before it). Feed the data from the returned step on.
        """
        target = Path(path) if path is not None else None
        if target is None and self.response.snapshot_dir is not None:
            target = Path(self.response.snapshot_dir)
        if target is None:
            raise ValueError(
                "Guard.resume() needs a path, or ResponsePolicy(snapshot_dir=...) to look in"
            )
        if target.is_dir():
            store = SnapshotStore(target, self.response.snapshot_keep)
            snap, used, bad = store.load_latest(map_location=self.device)
        else:
            snap, used, bad = load_snapshot(target, map_location=self.device), target, []
        for p, why in bad:
            self.events.emit("snapshot_fallback", snap.step, bad=str(p), error=why, used=str(used))
        missing = sorted(set(self._stateful()) - set(snap.states))
        if missing:
            raise SnapshotError(
                f"{used} holds no state for {missing} (it has {sorted(snap.states)}): it was "
                "written by a guard set up differently"
            )
        snap.restore(self._stateful())
        self._load_counters(snap.meta)
        self.step_count = snap.step
        self._snapshot = snap
        self._state.save()
        self.events.emit("resume", snap.step, from_step=snap.step, path=str(used))
        return snap.step

    def _load_counters(self, meta: dict[str, Any]) -> None:
        self.good_steps = int(meta.get("good", 0))
        self.consecutive_bad = int(meta.get("consecutive_bad", 0))
        self.rollbacks = int(meta.get("rollbacks", 0))
        self._rollback_streak = int(meta.get("rollback_streak", 0))
        self._good_since_rollback = int(meta.get("good_since_rollback", 0))
        self.transients = int(meta.get("transients", 0))
        self.skip_remaining = int(meta.get("skip_remaining", 0))
        self.lr_factor = float(meta.get("lr_factor", 1.0))
        self._lr_recover_from = meta.get("lr_recover_from")
        self._lr_recover_step = int(meta.get("lr_recover_step", 0))
        self._snapshots_taken = int(meta.get("snapshots", 0))
        if meta.get("step_rng"):
            set_rng_state(meta["step_rng"])

    def skip_external(
        self, reason: str = "overflow", *, scale_before: float | None = None,
        scale_after: float | None = None,
    ) -> StepResult:  # fmt: skip
        """Record a step the training framework skipped on its own (an fp16 GradScaler
        that found an inf and did not call the optimizer): the losses recorded for it
        are dropped, the buffers restored, the step counted, and an ``overflow`` event
        (when the scales are given) and a ``step`` event written. One host read."""
        step = self.step_count
        self.step_count += 1
        loss = float(torch.stack(self._losses).mean()) if self._losses else math.nan
        self._discard()
        self._state.save()
        if scale_before is not None and scale_after is not None:
            self.events.emit("overflow", step, scale_before=scale_before, scale_after=scale_after)
        scale = scale_after if scale_after is not None else self.scaler.get_scale()
        self.events.emit(
            "step", step, action="skipped", reason=reason, loss=loss, grad_norm=math.nan,
            clip_coef=1.0, scale=scale, lr_factor=self.lr_factor,
        )  # fmt: skip
        return StepResult(step, "skipped", reason, loss, math.nan, scale, 1.0, self.lr_factor)

    def state_dict(self) -> dict[str, Any]:
        """The guard's own state, for a framework's checkpoint (Lightning keeps a
        callback's): step counter, counters, loss scaler, clipper and spike detectors.
        Not the model, optimizer or scheduler (the framework saves those)."""
        counters = {k: v for k, v in self._counters().items() if k != "step_rng"}
        sd: dict[str, Any] = {"step_count": self.step_count, "counters": counters,
                              "scaler": self.scaler.state_dict()}  # fmt: skip
        for name in ("zclip", "loss_detector", "norm_detector"):
            obj = getattr(self, name)
            if obj is not None:
                sd[name] = obj.state_dict()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (a guard configured the same way)."""
        missing = [n for n in ("zclip", "loss_detector", "norm_detector")
                   if getattr(self, n) is not None and n not in sd]  # fmt: skip
        if missing or "counters" not in sd:
            raise ValueError(
                f"Guard.load_state_dict: the state has no {missing or ['counters']}: it was "
                "saved by a guard set up differently"
            )
        self.step_count = int(sd["step_count"])
        self._load_counters(sd["counters"])
        self.scaler.load_state_dict(sd["scaler"])
        for name in ("zclip", "loss_detector", "norm_detector"):
            obj = getattr(self, name)
            if obj is not None:
                obj.load_state_dict(sd[name])

    @property
    def last_snapshot(self) -> Snapshot | None:
        """The snapshot a rollback would restore (in memory)."""
        return self._snapshot

    def _stop(self, step: int, fault: Fault | None) -> None:
        report = {
            "step": step,
            "rollbacks": self.rollbacks,
            "events": len(self.events.events),
            "fault": str(fault) if fault is not None else None,
        }
        why = "the same deterministic fault came back after a rollback"
        self.events.emit("stop", step, reason="repeated_fault", fault=report["fault"])
        raise GuardStopped(
            f"training stopped at step {step}: {why}: {fault}. Rolling back again would "
            "loop; fix the cause (see the fault's module, op and line)",
            report,
        )

    def _rollback(self, step: int, fault: Fault | None, *, lr_backoff: bool) -> Action:
        # Rollbacks in a row: fewer than rollback_window good steps between them.
        if self._good_since_rollback >= self.response.rollback_window:
            self._rollback_streak = 0
        self._rollback_streak += 1
        self._good_since_rollback = 0
        if self._rollback_streak > self.response.max_rollbacks:
            report = {
                "step": step,
                "rollbacks": self._rollback_streak - 1,
                "events": sum(self.events.counts.values()),
            }
            self.events.emit("stop", step, reason="max_rollbacks", fault=None)
            raise GuardStopped(
                f"training stopped at step {step}: {self.response.max_rollbacks} rollbacks did not "
                "restore healthy steps; see the event log",
                report,
            )
        self.rollbacks += 1
        assert self._snapshot is not None
        self._snapshot.restore(self._stateful())
        self.consecutive_bad = 0
        self.skip_remaining = self.response.skip_batches
        if fault is not None and fault.deterministic:
            self._rolled_back_for = _fault_key(fault)
        if lr_backoff:
            self.lr_factor = self.response.lr_backoff_factor
            self._lr_recover_from = self.lr_factor
            self._lr_recover_step = 0
        self.events.emit(
            "rollback", step, to_step=self._snapshot.step, rollbacks=self.rollbacks,
            skip_batches=self.response.skip_batches,
            cause=None if fault is None else f"{fault.phase}:{fault.module}:{fault.tensor}",
        )  # fmt: skip
        return "rolled_back"

    def close(self) -> None:
        """Detach the monitors (watch="hooks", stats_every) and close the event log."""
        if self.monitor is not None:
            self.monitor.detach()
        if self.stats_monitor is not None:
            self.stats_monitor.detach()
        if self._peers is not None:
            self._peers.close()
        self.events.close()

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
