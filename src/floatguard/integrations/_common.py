"""What the Trainer and Lightning callbacks share: their settings, the guard they make,
the wrapping of a framework's ``step`` methods, the default log path and the metrics."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from floatguard.guard import Guard, Precision, StepResult
from floatguard.guard.act import is_metric_scheduler
from floatguard.scaling.loss_scale import DynamicLossScaler
from floatguard.stability.respond import ClipPolicy, ResponsePolicy, SpikePolicy

__all__ = ["GuardedLoop"]


class GuardedLoop:
    """The guard in front of a framework's optimizer step (the callbacks' common part)."""

    def __init__(
        self,
        *,
        log: str | os.PathLike[str] | None = None,
        clip: ClipPolicy | None = None,
        spikes: SpikePolicy | None = None,
        response: ResponsePolicy | None = None,
        watch: str = "replay",
        sync: Literal["exact", "deferred"] = "exact",
    ) -> None:
        if sync not in ("exact", "deferred"):
            raise ValueError(f"sync={sync!r}; use 'exact' or 'deferred'")
        self.sync = sync
        self.log_path = log
        self.clip = clip
        self.spikes = spikes
        self.response = response
        self.watch = watch
        self.guard: Guard | None = None
        self.last: StepResult | None = None  # the last step decided
        self._unsettled: list[StepResult] = []  # (deferred) steps the host has not decided
        self.totals = {"applied": 0, "skipped": 0, "rolled_back": 0}
        self._applying = False  # the guard's own apply is running: really step
        self._replaying = False
        self._wrapped: list[tuple[Any, str, Any]] = []

    def make_guard(
        self, model: nn.Module, optimizer: Any, *, precision: Precision, scheduler: Any,
        framework_clips: bool, folder: str, rank: int, framework_scales: bool = False,
    ) -> Guard:  # fmt: skip
        """The guard for this run (the framework's own loss scaler scales fp16 losses, so
        the guard's stays off); its events go to ``<folder>/floatguard-events.jsonl``
        (``-rank<r>`` on rank r > 0) unless a log was given. ``framework_scales``: the
        framework's fp16 GradScaler steps the optimizer (it reads the device every step
        for its own found-inf: the deferred mode would save nothing, so the exact one
        is built, with a warning)."""
        log = self.log_path
        if log is None:
            name = "floatguard-events.jsonl" if rank == 0 else f"floatguard-events-rank{rank}.jsonl"
            os.makedirs(folder, exist_ok=True)
            log = os.path.join(folder, name)
        clip = self.clip or ClipPolicy(kind="none" if framework_clips else "zclip")
        sync = self.sync
        if sync == "deferred" and framework_scales:
            warnings.warn(
                "floatguard: sync='deferred' with the framework's fp16 GradScaler: the "
                "scaler reads the device every step for its own found-inf, so the guard "
                "runs the exact mode (bf16 or fp32 runs defer)",
                stacklevel=3,
            )
            sync = "exact"
        # A metric-driven scheduler (ReduceLROnPlateau) is stepped by the framework with
        # its evaluation metric; the guard keeps it in its snapshots only.
        self.guard = Guard(
            model, optimizer, precision=precision, scheduler=scheduler, clip=clip,
            spikes=self.spikes, response=self.response, watch=self.watch,  # type: ignore[arg-type]
            scaler=DynamicLossScaler(enabled=False), log=log,
            step_scheduler=scheduler is None or not is_metric_scheduler(scheduler),
            clipped_before=framework_clips, sync=sync,
        )  # fmt: skip
        return self.guard

    def wrap_scheduler(self, scheduler: Any) -> None:
        """Gate a per-step scheduler's ``step`` (the guard steps it after applied steps);
        a metric-driven one is left to the framework, which steps it with its metric."""
        if not is_metric_scheduler(scheduler):
            self.wrap(scheduler, "step", self.scheduler_step)

    def wrap(self, obj: Any, name: str, gate: Callable[..., Any]) -> None:
        """Replace ``obj.name`` by ``gate(original, *args, **kwargs)`` until :meth:`unwrap`."""
        original = getattr(obj, name)
        had_own = name in vars(obj)  # an instance attribute (not the class's method)

        @functools.wraps(original)  # keeps the LR scheduler's mark on optimizer.step
        def wrapped(*a: Any, **k: Any) -> Any:
            return gate(original, *a, **k)

        setattr(obj, name, wrapped)
        self._wrapped.append((obj, name, original if had_own else None))
        if _saves_its_dict(obj):
            self._keep_out_of_state_dict(obj)

    def _keep_out_of_state_dict(self, obj: Any) -> None:
        """An LR scheduler's ``state_dict()`` is its ``__dict__``, where the wrapper now
        sits: a checkpoint would pickle it (and fail, a closure cannot be pickled), so
        the scheduler's state leaves out what the loop put there."""
        if "state_dict" in vars(obj):
            return
        original = obj.state_dict

        def state_dict() -> Any:
            ours = {n for o, n, _ in self._wrapped if o is obj} | {"state_dict"}
            return {k: v for k, v in original().items() if k not in ours}

        obj.state_dict = state_dict
        self._wrapped.append((obj, "state_dict", None))

    def unwrap(self, finished: bool = False) -> None:
        """Put every wrapped method back (at the end of training: a second ``train()``
        wraps afresh, never twice) and close the guard's event log; ``finished``: the
        training ended normally, so the guard's run ends with :meth:`Guard.finish`
        first (under torch.distributed: every rank took as many guard steps, or a
        GuardDesync names the one that did not)."""
        for obj, name, original in reversed(self._wrapped):
            if original is None:
                delattr(obj, name)  # the class's method shows through again
            else:
                setattr(obj, name, original)
        self._wrapped = []
        if self.guard is not None:
            try:
                if finished and self.guard.step_count and not self.guard.ended:
                    self.guard.finish()
            finally:
                self.guard.close()
                self.tally()  # (the last step, decided at finish or close)

    def decide(self, replay: list[Callable[[], torch.Tensor]] | None) -> StepResult:
        """The guard's step on what was recorded (it applies the optimizer step itself)."""
        assert self.guard is not None
        if not self.guard.has_recorded_losses():
            self.guard.record_loss(torch.zeros((), device=self.guard.device))
        self._applying = True
        try:
            result = self.guard.step(replay=replay)
        finally:
            self._applying = False
        self._unsettled.append(result)
        self.tally()
        return result

    def tally(self) -> None:
        """Count the steps the guard has decided (in the deferred mode a step is decided
        a step later: counted then, without waiting for it) and keep the last one."""
        waiting = []
        for r in self._unsettled:
            if r.settled:
                self.totals[r.action] += 1
                self.last = r
            elif self.guard is not None and self.guard.pending_step == r.step:
                waiting.append(r)  # (else its settling raised: it is never decided)
        self._unsettled = waiting

    def owns_call(self) -> bool:
        """Whether an optimizer or scheduler call now is the guard's own (it is deciding
        or settling a step), to be let through the framework's gates."""
        return self._applying or (self.guard is not None and self.guard.deciding)

    def scheduler_step(self, original: Callable[..., Any], *a: Any, **k: Any) -> Any:
        """The scheduler gate: the guard steps it after each applied step; the
        framework's own call (made after skipped steps too) does nothing."""
        if self.owns_call() or self.guard is None:
            return original(*a, **k)
        return None

    def metrics(self) -> dict[str, float]:
        """``floatguard/*``: totals of applied, skipped and rolled-back steps and faults,
        the LR factor, the last step's loss (NaN when it was) and gradient norm (in the
        deferred mode: of the steps decided so far, read without a wait: one behind)."""
        self.tally()
        out = {f"floatguard/{k}": float(v) for k, v in self.totals.items()}
        if self.guard is not None:
            out["floatguard/faults"] = float(self.guard.events.counts.get("fault", 0))
            out["floatguard/lr_factor"] = float(self.guard.lr_factor)
        if self.last is not None:
            out["floatguard/loss"] = self.last.loss
            out["floatguard/grad_norm"] = self.last.grad_norm
        return out


def _saves_its_dict(obj: Any) -> bool:
    """Whether ``obj.state_dict()`` is built from its ``__dict__`` (torch's LR schedulers)."""
    from torch.optim import lr_scheduler

    return isinstance(obj, (lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau))
