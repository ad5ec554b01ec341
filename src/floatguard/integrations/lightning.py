"""floatguard inside Lightning (the ``floatguard[lightning]`` extra).

```python
from floatguard.integrations.lightning import FloatguardCallback
trainer = lightning.Trainer(callbacks=[FloatguardCallback()], ...)
trainer.fit(module, loader)  # events: <default_root_dir>/floatguard-events.jsonl
```

Lightning's hooks cannot veto an optimizer step either, so the callback puts the guard in
front of it: at ``on_train_start`` it wraps each optimizer's ``step`` (the torch
optimizer Lightning's precision plugin calls) and, for schedulers stepped every step
(``interval="step"``), the scheduler's ``step``. When Lightning steps an optimizer, the
wrapped step runs Lightning's closure (``training_step``, backward, Lightning's own
gradient clipping), then the guard decides (one host read) on the mean of the losses
``training_step`` returned since the last step (every micro-batch under
``accumulate_grad_batches``). They are taken as returned, by a wrapper the callback
puts on the module's ``training_step`` for the run (removed at ``on_train_end`` and
``on_exception``): the loss Lightning hands ``on_before_backward`` is divided by
``accumulate_grad_batches`` and, under ``16-mixed``, multiplied by the GradScaler's
scale, so ``floatguard/loss`` and the spike detector would see a fraction, or a
multiple that moves with the scale, of the real loss. Then:

- *applied*: the optimizer steps, then the step-interval schedulers;
- *skipped* or *rolled back*: the optimizer does not step (so AdamW's moments and weight
  decay stay as they were), nor do the schedulers; a rollback restores the module,
  optimizer and schedulers from the guard's snapshot.

A bad step is localized by replaying ``training_step`` on the step's batches (kept by
reference from ``on_train_batch_start``). A replay logs nothing: the module's ``log``
and ``log_dict`` are no-ops while it runs (restored after), so the user's own metrics
(``self.log("train_loss", ...)``) keep the values of the real runs. Without this the
replay, which runs inside Lightning's ``optimizer_step`` hook, created an
``optimizer_step.train_loss`` entry that shadowed the real one for the rest of the run
(frozen at the bad step's value). Other side effects of ``training_step`` do happen
again in a replay (a torchmetrics ``update``, a counter on the module): keep them out
of ``training_step`` or expect the bad step's batches counted twice.

Under ``16-mixed`` Lightning's GradScaler sees the gradients before the guard: any
non-finite gradient (an overflow, but also a NaN batch) is its skip and back-off,
which the guard records as an ``overflow`` step; Lightning also calls
``scaler.update()`` after the guard's own skips (spikes), which counts them toward the
scale's growth. (In transformers' Trainer the guard decides first: there only a
finite-loss overflow goes to the scaler.) Metrics are logged with
``pl_module.log_dict`` (``floatguard/*``; ``floatguard/loss`` is the step's mean
micro-batch loss, as ``training_step`` returned it) and the guard's state goes into
Lightning checkpoints (:meth:`FloatguardCallback.state_dict`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from floatguard.integrations import require

_pl = require("lightning.pytorch", "lightning", "floatguard.integrations.lightning")
from floatguard.guard import Precision  # noqa: E402
from floatguard.integrations._common import GuardedLoop  # noqa: E402

__all__ = ["FloatguardCallback"]

_Callback: Any = _pl.Callback


def _precision_of(trainer: Any) -> Precision:
    p = str(trainer.precision)
    if p.startswith("bf16"):
        return "bf16"
    if p.startswith("16"):
        return "fp16"
    return "fp32"


def _loss_of(out: Any) -> torch.Tensor | None:
    loss = out.get("loss") if isinstance(out, dict) else out
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def _logging_off(module: Any) -> Iterator[None]:
    """``module.log`` and ``module.log_dict`` do nothing inside (instance attributes
    over the class's methods; a module's own instance attributes are put back)."""
    names = ("log", "log_dict")
    own = {n: vars(module)[n] for n in names if n in vars(module)}
    for n in names:
        setattr(module, n, _no_log)
    try:
        yield
    finally:
        for n in names:
            if n in own:
                setattr(module, n, own[n])
            else:
                delattr(module, n)


class FloatguardCallback(_Callback, GuardedLoop):  # type: ignore[misc]
    """The guard inside a Lightning ``Trainer`` (see the module docstring). One optimizer
    (Lightning's automatic optimization); ``log``, ``clip``, ``spikes``, ``response`` and
    ``watch`` as for :class:`floatguard.Guard` (``clip`` defaults to none when the Trainer
    clips, ``gradient_clip_val``, else ZClip). ``sync="deferred"``: no host read on a
    healthy step (:class:`floatguard.Guard`); Lightning calls ``training_step``, not the
    module's ``forward``, so a step is settled at the next optimizer step, its work held
    apart (run again from its batch where the settling rolled back); the logged
    metrics are those of the steps decided so far. Under 16-mixed the precision
    plugin's GradScaler reads the device every step anyway: exact, warned."""

    # (the constructor is GuardedLoop's; these are set up per run in on_train_start)
    _module: Any = None
    _awaiting_step = False
    _scaler: Any = None
    _restored: dict[str, Any] | None = None
    _batches: tuple[tuple[Any, int], ...] = ()

    # ----------------------------------------------------------- set-up
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"FloatguardCallback guards one optimizer; this module configured "
                f"{len(trainer.optimizers)}"
            )
        if not pl_module.automatic_optimization:
            raise ValueError("FloatguardCallback needs automatic optimization")
        opt = trainer.optimizers[0]
        per_step = [c.scheduler for c in trainer.lr_scheduler_configs if c.interval == "step"]
        self._module = pl_module
        self._scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.make_guard(pl_module, opt, precision=_precision_of(trainer),
                        scheduler=per_step[0] if per_step else None,
                        framework_clips=bool(trainer.gradient_clip_val),
                        folder=trainer.default_root_dir, rank=int(trainer.global_rank),
                        framework_scales=self._scaler is not None)  # fmt: skip
        assert self.guard is not None
        if self._restored is not None:
            self.guard.load_state_dict(self._restored["guard"])
            self.totals = dict(self._restored["totals"])
        self.wrap(pl_module, "training_step", self._training_step)
        self.wrap(opt, "step", self._optimizer_step)
        for sched in per_step:
            self.wrap_scheduler(sched)

    # ------------------------------------------------------- collecting
    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches = (*self._batches, (batch, batch_idx))

    def _training_step(self, original: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        """Lightning's (and only Lightning's: not a replay's) ``training_step``: its
        loss, as returned, is recorded for the step's decision (a device op)."""
        out = original(*a, **kw)
        if self.guard is not None and not self._replaying:
            loss = _loss_of(out)
            if loss is not None:
                self.guard.record_loss(loss)
        return out

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._awaiting_step = True  # cleared when the (wrapped) optimizer step runs

    # ------------------------------------------------------------ gates
    def _optimizer_step(
        self, original: Callable[..., Any], closure: Callable[[], Any] | None = None, **kw: Any
    ) -> Any:
        guard = self.guard
        if guard is None or self.owns_call():
            return original(closure, **kw) if closure is not None else original(**kw)
        result = closure() if closure is not None else None
        self._awaiting_step = False
        if closure is not None and result is None and not guard.has_recorded_losses():
            return None  # training_step returned None: Lightning skips this batch itself
        try:
            self.decide(self._replay_closures())
        finally:
            self._batches = ()
        return result

    def _replay_closures(self) -> list[Callable[[], torch.Tensor]]:
        module = self._module

        def closure_for(batch: Any, idx: int) -> Callable[[], torch.Tensor]:
            def closure() -> torch.Tensor:
                self._replaying = True
                try:
                    with _logging_off(module):
                        loss = _loss_of(module.training_step(batch, idx))
                finally:
                    self._replaying = False
                if loss is None:
                    raise RuntimeError("the replayed training_step returned no loss")
                return loss

            return closure

        return [closure_for(b, i) for b, i in self._batches]

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._awaiting_step and self.guard is not None:
            # on_before_optimizer_step ran but the optimizer was not called: the fp16
            # GradScaler found an inf and skipped the step itself.
            self._awaiting_step = False
            scale = float(self._scaler.get_scale()) if self._scaler is not None else None
            self.last = self.guard.skip_external(
                "overflow", scale_before=None if scale is None else scale * 2, scale_after=scale
            )
            self.totals["skipped"] += 1
            self._batches = ()
        if self.last is not None and self.guard is not None:
            pl_module.log_dict(self.metrics(), on_step=True, on_epoch=False)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.unwrap(finished=True)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # The module outlives the run: its training_step must not stay wrapped (a later
        # fit would record every loss twice). The optimizer is the run's own.
        self.unwrap()

    # ------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The guard's own state (:meth:`floatguard.Guard.state_dict`) and the totals,
        for Lightning's checkpoint."""
        if self.guard is None:
            return self._restored or {}
        guard = self.guard.state_dict()  # (settles a deferred step first)
        self.tally()
        return {"guard": guard, "totals": dict(self.totals)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self._restored = state_dict
        if self.guard is not None:
            self.guard.load_state_dict(state_dict["guard"])
            self.totals = dict(state_dict["totals"])
