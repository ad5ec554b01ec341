"""The Monitor: module and tensor hooks feeding the sentinel (and statistics) in execution order.

The opt-in, per-module watch: for loops without a closure (``Guard(watch="hooks")``) and
for statistics sampled every k steps. The guard's always-on path needs none of it
(detection is its one read per step; localization is a replay of the bad step).

Words used here:

- *record*: one watched tensor of this step (a module's input, output, parameter, a
  gradient), in execution order, with its call path and role
  (:class:`~floatguard.monitor.localize.Record`), kept in the
  :class:`~floatguard.monitor._records.RecordBook`.
- *slot*: a record's place in the :class:`~floatguard.monitor.sentinel.Sentinel`: a
  read (one ``aminmax``) or a proof. An *alias* is a record whose tensor was already
  recorded this step (same tensor, same version counter): it shares the slot.
- *frame*: one call of a module whose output (and input gradient) may be proved
  finite from what it was given; its *deps* are the slots of that input and of the
  parameters the rule reads (:mod:`floatguard.monitor._proofs`,
  :mod:`floatguard.monitor.bounds`).
- *pending*: a tensor a module returned whose gradient is awaited (a parent returning
  its child's output adds its own role to the child's pending entry).
- *sampled step*: with ``mode="stats", every=k > 1``, a step whose hooks are on; the
  others run only the model's own two hooks.

Reading order: :class:`Monitor` (attach, steps, the hooks it registers), then what the
hooks do (:class:`~floatguard.monitor._recorder.Recorder`: ``enter`` and ``exit`` for a
module call, ``on_grad`` for a gradient), then reading (the views themselves are in
:mod:`floatguard.monitor.stats_view`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from floatguard.formats.registry import get
from floatguard.monitor import _context, stats_view
from floatguard.monitor._recorder import Callee, ProofMode, Recorder
from floatguard.monitor._tree import floats, watched
from floatguard.monitor.bounds import provable_type
from floatguard.monitor.localize import Alert, Fault, localize
from floatguard.stats import TensorStats

__all__ = ["Held", "Monitor"]

Mode = Literal["sentinel", "stats"]


class Held(NamedTuple):
    """What a :class:`Monitor` holds for the current step (:attr:`Monitor.held`)."""

    records: int  # records (reads, proofs and aliases)
    slots: int  # sentinel slots (each a read or a proof)
    awaited: int  # returned tensors whose gradient is awaited
    device_bytes: int  # the reads' (min, max) scalars and the tensors proofs keep


def _eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, never traced by torch.compile: the hooks keep host-side records (and
    would make dynamo guard on every tensor's identity), so each runs eagerly, as a
    graph break. Costs ~0.4 us per call in eager mode."""
    eager: Callable[..., Any] = torch.compiler.disable(fn)  # type: ignore[no-untyped-call]
    return eager


class Monitor:
    """Watch a model's numerics: forward inputs/outputs, parameters, and every gradient.

    ``mode="sentinel"`` (default) keeps one on-device record per watched tensor
    and nothing else: no statistics and no host sync inside forward or backward.
    A record is a read (one ``torch.aminmax``) or a *proof*: for ``Linear``,
    ``Conv1d/2d/3d``, ``LayerNorm``, ``RMSNorm``, ``Embedding`` and elementwise
    activations / dropout in float32, float64 or bfloat16 (not under float16
    autocast), the output and the gradient sent back to the input are bounded
    from records already made (the input's amax, the parameters'), and a bound
    below the dtype's largest value proves them finite without reading them
    (:mod:`floatguard.monitor.bounds`). Proved tensors are kept (referenced, not
    copied) until the next step; a proof that does not settle is read when you
    read the monitor, so every verdict stays exact.

    ``proofs``: ``"all"`` (default, or True) proves outputs and gradients;
    ``"forward"`` outputs only (no gradient is kept); ``"off"`` (or False) reads
    every tensor. ``mode="stats"`` also keeps a
    :class:`TensorStats` per record on every ``every``-th step (read in full on
    those steps), on device until read; :meth:`format_fit` turns them into the
    overflow / underflow / subnormal fractions and scales for each of ``formats``.

    Use it as a context manager or with ``attach()`` / ``detach()`` (detach
    removes every hook; the records of the last step stay readable).

    Steps: a new step starts at a forward of the model that follows a backward
    (or a no-grad forward), or when you call :meth:`next_step`. For gradient
    accumulation (several forwards before one backward) that is automatic; for
    several forward+backward micro-batches per optimizer step, call
    ``next_step()`` yourself (with ``auto_step=False``, only ``next_step()`` starts a
    step: the guard drives the monitor that way) or read after each micro-batch.
    A forward that no backward reached and whose autograd graph is gone (an
    evaluation run with grad enabled, say) is dropped from the step at the next
    top-level call, so such forwards do not pile up (:attr:`held`).

    Reading: :attr:`found_nonfinite` is an exact device bool (no sync; it reads
    the proved tensors, so it costs what the proofs saved); :attr:`first_nonfinite`,
    :attr:`faults` and :attr:`alerts` read the records once (one small
    device-to-host copy, plus one more only if a proof did not settle) and apply
    the localization rules.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        mode: Mode = "sentinel",
        every: int = 1,
        formats: Sequence[str] = ("fp16", "bf16", "e4m3fn", "e5m2"),
        auto_step: bool = True,
        proofs: bool | ProofMode = "all",
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Monitor needs an nn.Module, got {type(model).__name__}")
        if mode not in ("sentinel", "stats"):
            raise ValueError(f"mode={mode!r}; use 'sentinel' or 'stats'")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every={every!r} must be a positive int")
        if isinstance(formats, str):  # one format named alone, not its characters
            formats = (formats,)
        self.formats = tuple(get(f).name for f in formats)
        modes: dict[object, ProofMode] = {
            True: "all",
            False: "off",
            "all": "all",
            "forward": "forward",
        }
        if not (isinstance(proofs, bool) or proofs in ("all", "forward", "off")):
            raise ValueError(f"proofs={proofs!r}; use 'all' (default), 'forward', 'off' or a bool")
        self.model = model
        self.mode: Mode = mode
        self.every = every
        self.auto_step = auto_step
        self.step = 0
        self._handles: list[RemovableHandle] = []
        # Sampling (stats every k > 1 steps): the hooks of every module but the model's,
        # made once at attach and registered on sampled steps only.
        self._wiring: list[tuple[nn.Module, Any, Any]] = []
        self._param_wiring: list[tuple[nn.Parameter, Any]] = []
        self._sampled_handles: list[RemovableHandle] = []
        self._quiet = False  # an unsampled step: the model's hooks record nothing
        self._last_forward_grad = True
        self._rec = Recorder(self._stats_on, modes.get(proofs, "off"))
        self._provable = {id(m) for m in model.modules() if provable_type(m)}

    @property
    def proofs(self) -> ProofMode:
        """``"all"``, ``"forward"`` or ``"off"``: what is proved instead of read."""
        return self._rec.proofs

    @proofs.setter
    def proofs(self, value: ProofMode) -> None:
        self._rec.proofs = value

    # ---------------------------------------------------------------- wiring
    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self) -> Monitor:
        """Register the hooks (idempotent). With statistics sampled every k > 1 steps,
        only the model's own two hooks stay on; the others are registered on sampled
        steps and removed on the next unsampled one, so the other steps cost two hook
        calls."""
        if self._handles:
            return self
        off = _eager
        self._wiring = []
        for name, mod in self.model.named_modules():
            pre, post = off(self._pre_hook(name, mod)), off(self._post_hook(name))
            if mod is self.model:
                self._handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
                self._handles.append(
                    mod.register_forward_hook(post, with_kwargs=True, always_call=True)
                )
            else:
                self._wiring.append((mod, pre, post))
        seen: set[int] = set()
        for mname, mod in self.model.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                if id(p) in seen or not p.requires_grad:
                    continue
                seen.add(id(p))
                self._param_wiring.append((p, self._param_grad_hook(mname, pname)))
        if not self._sampling:
            self._handles += self._wire()
        return self

    @property
    def _sampling(self) -> bool:
        return self.mode == "stats" and self.every > 1

    def _wire(self) -> list[RemovableHandle]:
        handles = []
        for mod, pre, post in self._wiring:
            handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(mod.register_forward_hook(post, with_kwargs=True, always_call=True))
        for p, hook in self._param_wiring:
            handles.append(p.register_hook(hook))  # type: ignore[no-untyped-call]
        return handles

    def _rewire(self) -> None:
        """Sampling: hooks on every module on sampled steps only."""
        want = self._stats_on()
        if want and not self._sampled_handles:
            self._sampled_handles = self._wire()
        elif not want and self._sampled_handles:
            for h in self._sampled_handles:
                h.remove()
            self._sampled_handles = []

    def detach(self) -> None:
        """Remove every hook. Records of the current step stay readable."""
        rec = self._rec
        for h in self._handles + rec.step_handles + self._sampled_handles:
            h.remove()
        self._handles.clear()
        rec.step_handles.clear()
        self._sampled_handles = []
        self._wiring = []
        self._param_wiring = []
        rec.stack.clear()
        rec.frames.clear()

    def __enter__(self) -> Monitor:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # ----------------------------------------------------------------- steps
    def next_step(self) -> None:
        """Start a new step: clear the records (the step counter advances)."""
        self.step += 1
        self._rec.clear()
        if self._sampling and self._handles:
            self._rewire()

    def reset(self) -> None:
        """Clear the records of the current step, keeping the step counter."""
        self._rec.clear()

    def _ignored(self) -> bool:
        """Passes the monitor does not record: a replay's (not a step of the run), and,
        when the caller drives the steps (``auto_step=False``, as the guard does),
        forwards without grad (evaluation between steps: they would pile up)."""
        return _context.is_replaying() or (not self.auto_step and not torch.is_grad_enabled())

    def _stats_on(self) -> bool:
        return self.mode == "stats" and self.step % self.every == 0

    def _begin_model_call(self) -> bool:
        """At the model's outermost call: start a new step when this call begins one;
        with sampling, wire the step's hooks. False: an unsampled step (record nothing)."""
        if self.auto_step and (self._rec.backward_seen or not self._last_forward_grad):
            self.next_step()
        self._last_forward_grad = torch.is_grad_enabled()
        if self._sampling:
            self._rewire()
            if not self._stats_on():
                self._quiet = True
                return False
        return True

    # ----------------------------------------------------------------- hooks
    def _pre_hook(self, name: str, module: nn.Module) -> Callable[..., Any]:
        callee = Callee.of(module, id(module) in self._provable)
        is_root = module is self.model
        rec = self._rec

        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if self._ignored():
                return None
            if is_root and not rec.stack and not self._begin_model_call():
                return None  # an unsampled step
            return rec.enter(name, callee, mod, args, kwargs)

        return hook

    def _post_hook(self, name: str) -> Callable[..., Any]:
        rec = self._rec

        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
            if self._ignored():
                return None
            if self._quiet and module is self.model and not rec.stack:
                # An unsampled step: only notice its backward (to know when it ends).
                self._quiet = False
                outs = floats(output, "output")
                node = next((t.grad_fn for _, t in outs if t.grad_fn is not None), None)
                if node is not None:
                    node.register_prehook(rec.saw_backward)
                return None
            return rec.exit(name, output)

        return hook

    def _param_grad_hook(self, module: str, pname: str) -> Callable[[torch.Tensor], None]:
        # Ownership path ("", "layers", "layers.0", ...): parameters have no call path.
        parts = module.split(".") if module else []
        path = ("", *(".".join(parts[: i + 1]) for i in range(len(parts))))
        if not module:
            path = ("",)
        rec = self._rec

        def hook(grad: torch.Tensor) -> None:
            if _context.is_replaying():
                return None
            rec.backward_seen = True
            if grad is not None and watched(grad):
                rec.add("bwd_param_grad", path, f"param:{pname}", grad)
            return None

        return hook

    def check_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Record a loss computed outside any module (phase "loss"); returns it unchanged."""
        if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
            raise TypeError(
                f"check_loss expects a floating-point tensor, got {type(loss).__name__}"
            )
        self._rec.add("loss", (), "loss", loss)
        return loss

    # --------------------------------------------------------------- reading
    @property
    def held(self) -> Held:
        """What the monitor holds for this step: records, slots, awaited gradients and
        device bytes. No sync."""
        rec = self._rec
        book = rec.book
        return Held(len(book.records), len(book.sentinel), len(rec.hooked), book.held_bytes())

    def packed_records(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(min, max) of every read record of this step as two device vectors, for a
        caller that folds them into its own single host read (the guard does); give
        the host copies to :meth:`faults_from`. None when nothing was recorded."""
        return self._rec.book.sentinel.packed()

    @property
    def found_nonfinite(self) -> torch.Tensor:
        """Device bool for the current step: any watched tensor non-finite. No sync."""
        return self._rec.book.sentinel.flag()

    def faults_from(self, lo: list[float], hi: list[float]) -> list[Fault]:
        """Localize from host copies of the packed records (for a caller that read them
        as part of its own single transfer, as the guard does)."""
        rec = self._rec
        rec.status = rec.book.sentinel.status_of(lo, hi)
        rec.analysis = localize(rec.book.records, rec.status, self.step)
        return list(rec.analysis)

    def _read(self) -> list[Fault]:
        """This step's faults, and its verdict per slot (``Recorder.status``): read and
        localized once, until a record is added."""
        rec = self._rec
        if rec.analysis is None:
            rec.status = rec.book.sentinel.read()
            rec.analysis = localize(rec.book.records, rec.status, self.step)
        return rec.analysis

    @property
    def faults(self) -> list[Fault]:
        """Every fault born this step, in execution order (reads the records once)."""
        return list(self._read())

    @property
    def first_nonfinite(self) -> Fault | None:
        """The first fault of the step in execution order, or None."""
        faults = self._read()
        return faults[0] if faults else None

    @property
    def alerts(self) -> list[Alert]:
        """Per non-finite tensor: module, role, shape, NaN/inf flags, finite min/max (stats)."""
        self._read()
        return stats_view.alerts(self._rec.book.records, self._rec.status, self.step)

    @property
    def stats(self) -> dict[tuple[str, str], TensorStats]:
        """Stats mode: ``{(module, role): TensorStats}`` of this step (merged over repeats).

        A parameter's values are under ``"param:weight"``, its gradient under
        ``"param:weight.grad"``."""
        return stats_view.stats_of(self._rec.book.records)

    def format_fit(self) -> dict[tuple[str, str], dict[str, dict[str, float]]]:
        """Stats mode: how each tensor watched this step would fit each of ``formats``.

        ``{(module, role): {format: {"overflow", "underflow", "subnormal", "scale",
        "scale_pow2"}}}`` with the keys of :attr:`stats`. From each tensor's
        :class:`TensorStats`, without reading the tensor again: the fractions of its
        elements that would overflow (finite, beyond the format's largest value),
        underflow (non-zero, rounding to zero) or land in the subnormal range if cast
        to the format unscaled (binade-exact, see :class:`TensorStats`), and the
        recommended scale ``fmt.max / amax`` and its power-of-two floor. One
        device-to-host copy. Empty when the step kept no stats (sentinel mode, or
        not an ``every``-th step).
        """
        return stats_view.format_fit(self.stats, self.formats)

    def stats_summary(self) -> list[dict[str, Any]]:
        """Stats mode: a JSON-ready summary of this step's tensors, for the event stream.

        Per ``(module, role)``: ``numel``, ``amax``, ``nonfinite``, ``zeros``, per format of
        :attr:`formats` the ``underflow`` / ``overflow`` / ``subnormal`` fractions (unscaled
        casts, as :meth:`format_fit` gives them), and ``hist``: the exponent histogram's
        non-empty span (``hist_from`` is the binary exponent of its first bin). One
        device-to-host copy for all of it. Empty when the step kept no statistics."""
        return stats_view.stats_summary(self.stats, self.formats)
