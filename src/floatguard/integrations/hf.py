"""floatguard inside Hugging Face's ``transformers.Trainer`` (the ``floatguard[hf]`` extra).

```python
from floatguard.integrations.hf import FloatguardCallback
trainer = Trainer(model, args, train_dataset=ds, callbacks=[FloatguardCallback()])
trainer.train()  # logs gain floatguard/* metrics; events: <output_dir>/floatguard-events.jsonl
```

A Trainer callback cannot veto an optimizer step, so the callback puts the guard in
front of it: at ``on_train_begin`` it wraps the Trainer's optimizer ``step`` and its LR
scheduler's ``step``. When the Trainer steps the optimizer (after its own gradient
clipping), the guard decides on the step (its one host read) from the losses the
model returned in this step's forwards:

- *applied*: the Trainer's optimizer step runs (through accelerate's GradScaler under
  fp16), then the LR scheduler;
- *skipped* or *rolled back*: the optimizer step does **not** run (AdamW's moments and
  weight decay stay as they were: zeroing gradients would not be a skip), nor does the
  scheduler; under fp16 the GradScaler keeps its scale and its growth count (its
  per-step state is reset with ``scaler.update(scaler.get_scale())``). A rollback also
  restores the model, optimizer and scheduler from the guard's snapshot.

A bad step is localized by replaying the step's micro-batches (the inputs the model was
called with, kept by reference until the step ends) under the guard's op-level replay.
Under fp16, a gradient overflow with a finite loss is left to the Trainer's GradScaler
(it skips the step and backs the scale off; the guard records it): that costs one more
host read per step. The Trainer's ``state.global_step`` still counts every step it
attempted; the guard's metrics say which were applied.

Metrics (``on_log``): ``floatguard/loss`` (the guard's mean loss of the last step, NaN
when it was: the Trainer's own ``loss`` filters NaN out), ``floatguard/grad_norm``,
``floatguard/applied``, ``floatguard/skipped``, ``floatguard/rolled_back`` and
``floatguard/faults`` (totals), ``floatguard/lr_factor``. They are added to the Trainer's
``log_history``; to have the Trainer's printer and ``report_to`` loggers see them too,
register with :func:`add_to`, which puts the callback first.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from floatguard.integrations import require

_tf = require("transformers", "hf", "floatguard.integrations.hf")
from floatguard.guard import Guard, Precision  # noqa: E402
from floatguard.integrations._common import GuardedLoop  # noqa: E402

__all__ = ["FloatguardCallback", "add_to"]


def _loss_of(output: Any) -> torch.Tensor | None:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)) and output:
        first = output[0]
        loss = first if isinstance(first, torch.Tensor) and first.numel() == 1 else None
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


_TrainerCallback: Any = _tf.TrainerCallback


class FloatguardCallback(_TrainerCallback, GuardedLoop):  # type: ignore[misc]
    """The guard inside ``transformers.Trainer`` (see the module docstring).

    Args:
        log: the JSONL event stream (default ``<output_dir>/floatguard-events.jsonl``,
            ``floatguard-events-rank<r>.jsonl`` on rank r > 0 under torch.distributed).
        clip: the guard's clipping; default: none when the Trainer clips
            (``max_grad_norm > 0``), else ZClip. With the Trainer's clipping on, the
            guard sees the clipped norm (set ``max_grad_norm=0`` to let it see and
            clip the raw one).
        spikes, response: the guard's policies.
        watch: "replay" (default) or "off".
        sync: "exact" (default) or "deferred" (no host read on a healthy step: see
            :class:`floatguard.Guard`; the step is settled when the next forward
            begins, and the metrics are those of the steps decided so far). Under fp16
            the Trainer's GradScaler reads the device every step anyway: exact, warned.
    """

    # (the constructor is GuardedLoop's; these are set up per run in on_train_begin)
    _warned_no_loss = False
    _scaler: Any = None
    _accumulation = 1

    # ----------------------------------------------------------- set-up
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model: nn.Module = kwargs["model"]
        optimizer = kwargs["optimizer"]
        self._batches: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        scheduler = kwargs.get("lr_scheduler")
        precision: Precision = "bf16" if args.bf16 else ("fp16" if args.fp16 else "fp32")
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        # The Trainer's GradScaler (accelerate's, fp16 on GPUs) scales the losses.
        self._scaler = getattr(optimizer, "scaler", None)
        self._accumulation = max(1, int(args.gradient_accumulation_steps))
        self.make_guard(model, optimizer, precision=precision, scheduler=scheduler,
                        framework_clips=args.max_grad_norm > 0, folder=args.output_dir,
                        rank=rank, framework_scales=self._scaler is not None)  # fmt: skip
        self.wrap(optimizer, "step", self._optimizer_step)
        if scheduler is not None:
            self.wrap_scheduler(scheduler)
        self._handles: list[Any] = [
            model.register_forward_pre_hook(self._keep_inputs, with_kwargs=True),
            model.register_forward_hook(self._keep_loss),
        ]

    def _training(self, module: nn.Module) -> bool:
        return module.training and torch.is_grad_enabled() and not self._replaying

    def _keep_inputs(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._training(module):
            self._batches.append((tuple(args), dict(kwargs)))

    def _keep_loss(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._training(module) or self.guard is None:
            return
        loss = _loss_of(output)
        if loss is not None and self._batches and "num_items_in_batch" in self._batches[-1][1]:
            # The model divided by the whole step's token count: this micro-batch's loss
            # is a share of the step's; scaled so the guard's mean is the step's loss.
            loss = loss * self._accumulation
        if loss is None:
            if not self._warned_no_loss:
                self._warned_no_loss = True
                warnings.warn(
                    "floatguard: the model's output has no .loss (a custom compute_loss?): "
                    "the guard decides on gradients only and cannot replay the step",
                    stacklevel=2,
                )
            return
        self.guard.record_loss(loss)

    # ------------------------------------------------------------ gates
    def _optimizer_step(self, original: Callable[..., Any], *a: Any, **k: Any) -> Any:
        guard = self.guard
        if guard is None or self.owns_call():  # the guard's own apply: really step
            return original(*a, **k)
        try:
            if self._scaler is not None and self._scaler_overflow(guard, original, a, k):
                return None
            replay = self._replay_closures() if not self._warned_no_loss else None
            result = self.decide(replay)
            if self._scaler is not None and result.action != "applied":  # (exact mode)
                # The optimizer did not step: reset the GradScaler's per-step state
                # (its unscale_ record) without touching its scale or growth count.
                self._scaler.update(self._scaler.get_scale())
            return None
        finally:
            self._batches = []  # the step is decided: its batches are released

    def _scaler_overflow(
        self, guard: Guard, original: Callable[..., Any], a: Any, k: Any
    ) -> bool:  # fmt: skip
        """fp16: non-finite gradients with a finite loss are the GradScaler's to handle
        (it skips and backs off); the guard records the step. One host read."""
        grads = [p.grad for g in guard.optimizer.param_groups for p in g["params"]
                 if p.grad is not None]  # fmt: skip
        if not grads:
            return False
        bad = torch.stack([g.detach().isfinite().all() for g in grads]).all().logical_not()
        bad_grads, finite_loss = torch.stack([bad, guard.recorded_losses_finite()]).tolist()
        if not (bad_grads and finite_loss):
            return False
        before = float(self._scaler.get_scale())
        original(*a, **k)  # scaler.step skips the optimizer, scaler.update backs off
        self.last = guard.skip_external(
            "overflow", scale_before=before, scale_after=float(self._scaler.get_scale())
        )
        self.totals["skipped"] += 1
        return True

    def _replay_closures(self) -> list[Callable[[], torch.Tensor]]:
        assert self.guard is not None
        model = self.guard.model

        def closure_for(
            args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> Callable[[], torch.Tensor]:
            def closure() -> torch.Tensor:
                self._replaying = True
                try:
                    loss = _loss_of(model(*args, **kwargs))
                finally:
                    self._replaying = False
                if loss is None:
                    raise RuntimeError("the replayed forward returned no loss")
                if "num_items_in_batch" in kwargs:  # scaled as the recorded loss was
                    loss = loss * self._accumulation
                return loss

            return closure

        return [closure_for(a, k) for a, k in self._batches]

    # -------------------------------------------------------------- logs
    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs is None or ("loss" not in logs and "train_loss" not in logs):
            return
        m = self.metrics()
        logs.update(m)
        if state.log_history:
            state.log_history[-1].update(m)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.unwrap(finished=True)


def add_to(trainer: Any, callback: FloatguardCallback | None = None) -> FloatguardCallback:
    """Register ``callback`` (a new one by default) first among the trainer's callbacks,
    so the Trainer's printer and ``report_to`` loggers see its metrics."""
    cb = callback or FloatguardCallback()
    trainer.callback_handler.callbacks.insert(0, cb)
    return cb
