"""Guard: monitor + loss scaler + clipping + spike response + rollback around a training step.

```python
guard = floatguard.Guard(model, optimizer, precision="fp16", scheduler=sched, log="run.jsonl")
for batch in loader:
    with guard.autocast():
        loss = loss_fn(model(batch))
    guard.backward(loss)
    result = guard.step()   # "applied" | "skipped" | "rolled_back"
```

One step reads the device exactly once: a small packed tensor (overflow flag,
gradient norm, loss, clip coefficient, and the monitor's per-tensor records) is
copied to the host, and every decision is made from it. Only on a step that
overflows in fp16 does the loss scaler read more, to report which parameter.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from floatguard.events import EventLog
from floatguard.monitor.hooks import Monitor
from floatguard.monitor.localize import Fault
from floatguard.scaling.loss_scale import DynamicLossScaler
from floatguard.stability.clip import ZClip, clip_grad_value_, total_norm
from floatguard.stability.respond import ClipPolicy, GuardStopped, ResponsePolicy, SpikePolicy
from floatguard.stability.snapshot import Snapshot
from floatguard.stability.spikes import LossSpikeHandler, RobustSpikeDetector

__all__ = ["Guard", "StepResult"]

Precision = Literal["fp32", "bf16", "fp16"]
Action = Literal["applied", "skipped", "rolled_back"]


@dataclass(frozen=True)
class StepResult:
    """What the guard did with one step, and the numbers it decided on."""

    step: int
    action: Action
    reason: str | None
    loss: float
    grad_norm: float
    scale: float
    clip_coef: float = 1.0
    lr_factor: float = 1.0
    fault: Fault | None = field(default=None, repr=False)


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


class Guard:
    """Keep a training loop numerically healthy with two extra lines.

    Args:
        model: the module being trained (its parameters must be the optimizer's).
        optimizer: any ``torch.optim.Optimizer``.
        precision: "fp32", "bf16" (autocast to bfloat16) or "fp16" (autocast to
            float16 with dynamic loss scaling).
        scheduler: an LR scheduler to step with applied steps only.
        clip, spikes, response: frozen policies (defaults: ZClip with its published
            settings; robust loss-spike detection; the ladder skip → LR back-off →
            rollback → stop).
        scaler: a :class:`DynamicLossScaler` to use for fp16 (default: a new one).
        monitor: watch the model with a sentinel :class:`Monitor` (default True); on
            a fault the step's event names where it was born.
        log: a JSONL path for the event stream (events are kept in memory too).
        distributed: all-reduce the step's decision numbers (overflow flag, loss,
            gradient norm) over ``process_group`` so every rank skips, applies or rolls
            back together (default: when torch.distributed is initialized). Losses are
            averaged over ranks for spike detection; a NaN on any rank is seen by all.

    The guard zeroes the gradients at the end of every step.
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
        monitor: bool = True,
        log: str | os.PathLike[str] | None = None,
        distributed: bool | None = None,
        process_group: Any = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Guard needs an nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"Guard needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision={precision!r}; use 'fp32', 'bf16' or 'fp16'")
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
        if distributed is None:
            import torch.distributed as dist

            distributed = dist.is_available() and dist.is_initialized()
        self.distributed = bool(distributed)
        self.process_group = process_group
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.precision: Precision = precision
        self.device = next(iter(devices))
        self.clip = clip or ClipPolicy()
        self.spikes = spikes or SpikePolicy()
        self.response = response or ResponsePolicy()
        self.scaler = (
            scaler if scaler is not None else DynamicLossScaler(enabled=precision == "fp16")
        )
        if precision != "fp16":
            self.scaler.enabled = False
        self.zclip = ZClip(self.clip.zclip) if self.clip.kind == "zclip" else None
        self.loss_detector = _Detector(self.spikes) if self.spikes.watch_loss else None
        self.norm_detector = _Detector(self.spikes) if self.spikes.watch_grad_norm else None
        # The guard starts the monitor's steps itself, so records of every micro-batch
        # of an accumulated step are there when the step is decided.
        self.monitor = Monitor(model, auto_step=False).attach() if monitor else None
        self.events = EventLog(log)
        self.step_count = 0
        self.good_steps = 0
        self.consecutive_bad = 0
        self.rollbacks = 0
        self.skip_remaining = 0
        self.lr_factor = 1.0
        self._lr_recover_from: float | None = None
        self._lr_recover_step = 0
        self._loss: torch.Tensor | None = None
        self._losses: list[torch.Tensor] = []
        self._snapshot: Snapshot | None = None
        self._take_snapshot()

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
            raise ValueError("Guard.backward needs a scalar loss tensor")
        if self.monitor is not None:
            self.monitor.check_loss(loss)
        # Several backward() calls before one step() (gradient accumulation): the step
        # is decided on the mean of their losses (device ops, no sync).
        self._losses.append(loss.detach().float().reshape(()))
        self._loss = torch.stack(self._losses).mean()
        target = self.scaler.scale(loss) if self.scaler.enabled else loss
        target.backward()  # type: ignore[no-untyped-call]

    def step(self) -> StepResult:
        """Decide on this step (one host read), apply or skip it, and zero the gradients."""
        if self._loss is None:
            raise RuntimeError("call guard.backward(loss) before guard.step()")
        step = self.step_count
        self.step_count += 1
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        dev = params[0].device if params else self.device
        if self.scaler.enabled:
            found = self.scaler.unscale_(self.optimizer).to(dev)
        else:
            found = torch.zeros((), device=dev)
        # After unscale_, which may replace a sparse gradient by its coalesced form.
        grads = [p.grad for p in params if p.grad is not None]
        norm = total_norm(grads).to(dev).float() if grads else torch.zeros((), device=dev)
        coef = torch.ones((), device=dev)
        clip_value = clipped = None
        if grads and self.zclip is not None:
            clip_value, clipped, coef64 = self.zclip.compute(norm)
            coef = coef64.float()
        elif grads and self.clip.kind == "norm":
            coef = torch.clamp(self.clip.max_norm / (norm + 1e-6), max=1.0)
            coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
        if grads and self.clip.kind != "value":
            torch._foreach_mul_(grads, coef)
        elif grads:
            clip_grad_value_(params, self.clip.max_value)
        small = torch.stack([found.float(), norm, self._loss.float().reshape(()).to(dev), coef])
        if self.distributed:
            # Every rank must take the same decision: one all-reduce of the 4 numbers
            # (asynchronous on NCCL, so still no extra host sync). Flags > 0 on any rank
            # stay > 0; NaN on any rank stays NaN; loss and norm become their means.
            import torch.distributed as dist

            dist.all_reduce(small, op=dist.ReduceOp.SUM, group=self.process_group)
            small = small / dist.get_world_size(self.process_group)
        packed_mon = self.monitor._sentinel.packed() if self.monitor is not None else None
        if packed_mon is not None:
            lo, hi = packed_mon
            small = torch.cat([small, lo.to(dev), hi.to(dev)])
        # The one host read of the step: flags, norm, loss, coefficient, monitor records.
        values = small.tolist()
        overflow, gnorm, loss_v, coef_v = values[0] > 0, values[1], values[2], values[3]
        fault: Fault | None = None
        if packed_mon is not None and self.monitor is not None:
            n = len(packed_mon[0])
            faults = self.monitor.faults_from(values[4 : 4 + n], values[4 + n :])
            fault = faults[0] if faults else None
        scale = self.scaler.get_scale()
        reason: str | None = None
        if overflow or not math.isfinite(gnorm):
            reason = "overflow" if self.scaler.enabled else "nonfinite_grad"
        elif not math.isfinite(loss_v):
            reason = "nonfinite_loss"
        elif self.loss_detector is not None and self.loss_detector.would_spike(loss_v):
            reason = "loss_spike"
        elif self.norm_detector is not None and self.norm_detector.would_spike(gnorm):
            reason = "grad_norm_spike"
        if fault is not None:
            self.events.emit(
                "fault", step, phase=fault.phase, module=fault.module, tensor=fault.tensor,
                kind_of_value=fault.kind, shape=list(fault.shape),
            )  # fmt: skip
        if self.skip_remaining > 0 and reason is None:
            self.skip_remaining -= 1
            reason = "after_rollback"
        action: Action
        if reason is None:
            action = "applied"
            self._apply()
            if self.zclip is not None and clip_value is not None and clipped is not None:
                self.zclip.update(norm, clip_value, clipped)
            self.scaler.update(found_inf=False)
            for det, v in ((self.loss_detector, loss_v), (self.norm_detector, gnorm)):
                if det is not None:
                    det.record(v)
            self.consecutive_bad = 0
            self.good_steps += 1
            self._recover_lr()
            if self.good_steps % self.response.snapshot_every == 0:
                self._take_snapshot()
        else:
            action = "skipped"
            if reason == "overflow":
                before = self.scaler.get_scale()
                self.scaler.update(found_inf=True)
                self.events.emit(
                    "overflow", step, scale_before=before, scale_after=self.scaler.get_scale()
                )
            else:
                self.scaler._unscaled = False  # hold the scaler's growth: the step did not happen
            if reason in ("loss_spike", "grad_norm_spike"):
                value = loss_v if reason == "loss_spike" else gnorm
                self.events.emit("spike", step, signal=reason.removesuffix("_spike"), value=value)
            if reason != "after_rollback":
                self.consecutive_bad += 1
                action = self._escalate(step)
        self.optimizer.zero_grad(set_to_none=True)
        self._loss = None
        self._losses = []
        if self.monitor is not None:
            self.monitor.next_step()
        result = StepResult(
            step, action, reason, loss_v, gnorm, scale, coef_v, self.lr_factor, fault
        )
        self.events.emit(
            "step", step, action=action, reason=reason, loss=loss_v, grad_norm=gnorm,
            clip_coef=coef_v, scale=scale, lr_factor=self.lr_factor,
        )  # fmt: skip
        return result

    # ------------------------------------------------------------- internals
    def _apply(self) -> None:
        if self.lr_factor != 1.0:
            saved = [g["lr"] for g in self.optimizer.param_groups]
            for g in self.optimizer.param_groups:
                g["lr"] = g["lr"] * self.lr_factor
            self.optimizer.step()
            for g, lr in zip(self.optimizer.param_groups, saved, strict=True):
                g["lr"] = lr
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def _recover_lr(self) -> None:
        if self._lr_recover_from is None:
            return
        self._lr_recover_step += 1
        frac = min(1.0, self._lr_recover_step / self.response.lr_recovery_steps)
        self.lr_factor = self._lr_recover_from + (1.0 - self._lr_recover_from) * frac
        if frac >= 1.0:
            self._lr_recover_from = None
            self.lr_factor = 1.0

    def _escalate(self, step: int) -> Action:
        r = self.response
        if self.consecutive_bad >= r.rollback_after:
            return self._rollback(step)
        if self.consecutive_bad >= r.lr_backoff_after:
            self.lr_factor *= r.lr_backoff_factor
            self._lr_recover_from = self.lr_factor
            self._lr_recover_step = 0
            self.events.emit("lr_backoff", step, factor=self.lr_factor)
        return "skipped"

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

    def _take_snapshot(self) -> None:
        self._snapshot = Snapshot.capture(
            self.step_count, self._stateful(), meta={"good": self.good_steps}
        )
        where = "memory"
        if self.response.snapshot_dir is not None:
            path = Path(self.response.snapshot_dir) / "floatguard-snapshot.pt"
            self._snapshot.save(path)
            where = str(path)
        self.events.emit("snapshot", self.step_count, where=where)

    def _rollback(self, step: int) -> Action:
        self.rollbacks += 1
        if self.rollbacks > self.response.max_rollbacks:
            report = {
                "step": step,
                "rollbacks": self.rollbacks - 1,
                "events": len(self.events.events),
            }
            self.events.emit("stop", step, reason="max_rollbacks")
            raise GuardStopped(
                f"training stopped at step {step}: {self.response.max_rollbacks} rollbacks did not "
                "restore healthy steps; see the event log",
                report,
            )
        assert self._snapshot is not None
        self._snapshot.restore(self._stateful())
        self.consecutive_bad = 0
        self.skip_remaining = self.response.skip_batches
        self.lr_factor = self.response.lr_backoff_factor
        self._lr_recover_from = self.lr_factor
        self._lr_recover_step = 0
        self.events.emit(
            "rollback", step, to_step=self._snapshot.step, rollbacks=self.rollbacks,
            skip_batches=self.response.skip_batches,
        )  # fmt: skip
        return "rolled_back"

    def close(self) -> None:
        """Detach the monitor and close the event log."""
        if self.monitor is not None:
            self.monitor.detach()
        self.events.close()

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
