"""The Monitor: module and tensor hooks feeding the sentinel (and statistics) in execution order."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from floatguard.formats.registry import get
from floatguard.monitor.localize import Alert, Fault, Record, RecordKind, localize
from floatguard.monitor.sentinel import Sentinel
from floatguard.stats import TensorStats, tensor_stats

__all__ = ["Monitor"]

Mode = Literal["sentinel", "stats"]


def _walk(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(role, tensor) for every floating tensor nested in tuples, lists, dicts, dataclasses."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield prefix, obj
    elif isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            yield from _walk(item, f"{prefix}[{i}]")
    elif isinstance(obj, dict):
        for k, item in obj.items():
            yield from _walk(
                item, f"{prefix}[{k!r}]" if not isinstance(k, str) else f"{prefix}.{k}"
            )
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _walk(getattr(obj, f.name), f"{prefix}.{f.name}")


def _map(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Rebuild tuples/lists/dicts with ``fn`` applied to their floating tensors."""
    if isinstance(obj, torch.Tensor):
        return fn(obj) if obj.is_floating_point() else obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_map(o, fn) for o in obj)
    if isinstance(obj, list):
        return [_map(o, fn) for o in obj]
    if type(obj) is dict:
        return {k: _map(v, fn) for k, v in obj.items()}
    return obj


class Monitor:
    """Watch a model's numerics: forward inputs/outputs, parameters, and every gradient.

    ``mode="sentinel"`` (default) keeps one on-device (min, max) record per
    watched tensor and nothing else: no statistics and no host sync inside
    forward or backward. ``mode="stats"`` also keeps a :class:`TensorStats` per
    record on every ``every``-th step, on device until read.

    Use it as a context manager or with ``attach()`` / ``detach()`` (detach
    removes every hook; the records of the last step stay readable).

    Steps: a new step starts at a forward of the model that follows a backward
    (or a no-grad forward), or when you call :meth:`next_step`. For gradient
    accumulation (several forwards before one backward) that is automatic; for
    several forward+backward micro-batches per optimizer step, call
    ``next_step()`` yourself (with ``auto_step=False``, only ``next_step()`` starts a
    step: the guard drives the monitor that way) or read after each micro-batch.

    Reading: :attr:`found_nonfinite` is a device bool (no sync);
    :attr:`first_nonfinite`, :attr:`faults` and :attr:`alerts` read the records
    once (one small device-to-host copy) and apply the localization rules.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        mode: Mode = "sentinel",
        every: int = 1,
        formats: Sequence[str] = ("fp16", "bf16", "e4m3fn", "e5m2"),
        auto_step: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Monitor needs an nn.Module, got {type(model).__name__}")
        if mode not in ("sentinel", "stats"):
            raise ValueError(f"mode={mode!r}; use 'sentinel' or 'stats'")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every={every!r} must be a positive int")
        self.formats = tuple(get(f).name for f in formats)
        self.model = model
        self.mode: Mode = mode
        self.every = every
        self.auto_step = auto_step
        self.step = 0
        self._names = {id(m): n for n, m in model.named_modules()}
        self._handles: list[RemovableHandle] = []
        self._sentinel = Sentinel()
        self._records: list[Record] = []
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int, int]] = {}
        self._hooked: dict[
            int, tuple[weakref.ref[torch.Tensor], list[tuple[tuple[str, ...], str]]]
        ] = {}
        self._stack: list[str] = []
        self._backward_seen = False
        self._last_forward_grad = True
        self._analysis: list[Fault] | None = None
        self._last_grad: tuple[torch.Tensor, tuple[Any, ...], int] | None = None
        self._slot_stats: dict[int, TensorStats] = {}

    # ---------------------------------------------------------------- wiring
    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self) -> Monitor:
        """Register the hooks (idempotent)."""
        if self._handles:
            return self
        for name, mod in self.model.named_modules():
            self._handles.append(
                mod.register_forward_pre_hook(self._pre_hook(name, mod), with_kwargs=True)
            )
            self._handles.append(
                mod.register_forward_hook(self._post_hook(name), with_kwargs=True, always_call=True)
            )
        seen: set[int] = set()
        for mname, mod in self.model.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                if id(p) in seen or not p.requires_grad:
                    continue
                seen.add(id(p))
                self._handles.append(p.register_hook(self._param_grad_hook(mname, pname)))
        return self

    def detach(self) -> None:
        """Remove every hook. Records of the current step stay readable."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._stack.clear()

    def __enter__(self) -> Monitor:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # ----------------------------------------------------------------- steps
    def next_step(self) -> None:
        """Start a new step: clear the records (the step counter advances)."""
        self.step += 1
        self._clear()

    def reset(self) -> None:
        """Clear the records of the current step, keeping the step counter."""
        self._clear()

    def _clear(self) -> None:
        self._sentinel.clear()
        self._records.clear()
        self._seen.clear()
        self._hooked.clear()
        self._backward_seen = False
        self._analysis = None
        self._last_grad = None
        self._slot_stats.clear()

    def _stats_on(self) -> bool:
        return self.mode == "stats" and self.step % self.every == 0

    # --------------------------------------------------------------- records
    def _add(self, kind: RecordKind, path: tuple[str, ...], role: str, t: torch.Tensor) -> Record:
        rec = Record(kind, [(path, role)], self._sentinel.add(t), tuple(t.shape))
        if self._stats_on():
            rec.stats = self._slot_stats[rec.slot] = tensor_stats(t)
        self._records.append(rec)
        self._analysis = None
        return rec

    def _add_forward(
        self, kind: RecordKind, path: tuple[str, ...], role: str, t: torch.Tensor
    ) -> None:
        key = id(t)
        hit = self._seen.get(key)
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            # Already checked this step (e.g. the previous module's output): alias it.
            stats = self._slot_stats.get(hit[2])
            self._records.append(Record(kind, [(path, role)], hit[2], tuple(t.shape), stats))
            return
        rec = self._add(kind, path, role, t)
        self._seen[key] = (weakref.ref(t), t._version, rec.slot)

    def _pre_hook(self, name: str, module: nn.Module) -> Callable[..., Any]:
        params = [(f"param:{n}", p) for n, p in module.named_parameters(recurse=False)]
        is_root = module is self.model

        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if is_root and not self._stack:
                if self.auto_step and (self._backward_seen or not self._last_forward_grad):
                    self.next_step()
                self._last_forward_grad = torch.is_grad_enabled()
            self._stack.append(name)
            path = tuple(self._stack)
            for role, t in _walk(args, "input"):
                self._add_forward("fwd_input", path, role, t)
            if kwargs:
                for role, t in _walk(kwargs, "input"):
                    self._add_forward("fwd_input", path, role, t)
            for role, p in params:
                self._add_forward("fwd_param", path, role, p)
            if not torch.is_grad_enabled():
                return None
            counter = [0]

            def watch(t: torch.Tensor) -> torch.Tensor:
                i = counter[0]
                counter[0] += 1
                if not t.requires_grad:
                    return t
                # A view gives this module its own autograd edge: the hook sees exactly
                # the gradient this module sends back to its input.
                v = t.view_as(t)
                hook = self._grad_hook("bwd_grad_input", [(path, f"grad_input[{i}]")])
                v.register_hook(hook)  # type: ignore[no-untyped-call]
                return v

            return _map(args, watch), (_map(kwargs, watch) if kwargs else kwargs)

        return hook

    def _post_hook(self, name: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            on_top = bool(self._stack) and self._stack[-1] == name
            path = tuple(self._stack) if on_top else (name,)
            grad = torch.is_grad_enabled()
            # A lone tensor is output[0], like the first element of a tuple.
            outs = _walk((output,) if isinstance(output, torch.Tensor) else output, "output")
            for role, t in outs:
                self._add_forward("fwd_output", path, role, t)
                if grad and t.requires_grad:
                    gi_role = "grad_" + role
                    entry = self._hooked.get(id(t))
                    if entry is not None and entry[0]() is t:
                        entry[1].append((path, gi_role))  # a parent returning its child's output
                    else:
                        roles = [(path, gi_role)]
                        t.register_hook(  # type: ignore[no-untyped-call]
                            self._grad_hook("bwd_grad_output", roles)
                        )
                        self._hooked[id(t)] = (weakref.ref(t), roles)
            if on_top:
                self._stack.pop()

        return hook

    def _grad_hook(
        self, kind: RecordKind, roles: list[tuple[tuple[str, ...], str]]
    ) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._backward_seen = True
            if grad is None or not grad.is_floating_point():
                return
            # The gradient a module sends to its input view usually arrives, as a view of
            # the same memory, at the previous module's output right after: check it once.
            # The last checked gradient is held (one buffer at most), so its memory cannot
            # have been reused: equal (address, layout, version) means equal values.
            key = (grad.data_ptr(), grad.shape, grad.stride(), grad.dtype, grad._version)
            last = self._last_grad
            if last is not None and last[1] == key:
                rec = Record(kind, roles, last[2], tuple(grad.shape), self._slot_stats.get(last[2]))
                self._records.append(rec)
                self._analysis = None
                return
            rec = self._add(kind, roles[0][0], roles[0][1], grad)
            rec.paths = roles
            self._last_grad = (grad, key, rec.slot)
            return None

        return hook

    def _param_grad_hook(self, module: str, pname: str) -> Callable[[torch.Tensor], None]:
        # Ownership path ("", "layers", "layers.0", ...): parameters have no call path.
        parts = module.split(".") if module else []
        path = ("", *(".".join(parts[: i + 1]) for i in range(len(parts))))
        if not module:
            path = ("",)

        def hook(grad: torch.Tensor) -> None:
            self._backward_seen = True
            self._add("bwd_param_grad", path, f"param:{pname}", grad)
            return None

        return hook

    def check_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Record a loss computed outside any module (phase "loss"); returns it unchanged."""
        if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
            raise TypeError(
                f"check_loss expects a floating-point tensor, got {type(loss).__name__}"
            )
        self._add("loss", (), "loss", loss)
        return loss

    # --------------------------------------------------------------- reading
    @property
    def found_nonfinite(self) -> torch.Tensor:
        """Device bool for the current step: any watched tensor non-finite. No sync."""
        return self._sentinel.flag()

    def faults_from(self, lo: list[float], hi: list[float]) -> list[Fault]:
        """Localize from host copies of the packed records (for a caller that read them
        as part of its own single transfer, as the guard does)."""
        self._status = self._sentinel.status_of(lo, hi)
        self._analysis = localize(self._records, self._status, self.step)
        return list(self._analysis)

    @property
    def faults(self) -> list[Fault]:
        """Every fault born this step, in execution order (reads the records once)."""
        if self._analysis is None:
            status = self._sentinel.read()
            self._analysis = localize(self._records, status, self.step)
            self._status = status
        return list(self._analysis)

    @property
    def first_nonfinite(self) -> Fault | None:
        """The first fault of the step in execution order, or None."""
        faults = self.faults
        return faults[0] if faults else None

    @property
    def alerts(self) -> list[Alert]:
        """Per non-finite tensor: module, role, shape, NaN/inf flags, finite min/max (stats)."""
        self.faults  # noqa: B018 (fills self._status)
        out = []
        phase_of = {
            "fwd_input": "input",
            "fwd_param": "forward",
            "fwd_output": "forward",
            "loss": "loss",
            "bwd_grad_output": "backward",
            "bwd_param_grad": "param_grad",
            "bwd_grad_input": "backward",
        }
        for rec in self._records:
            st = self._status[rec.slot]
            if st == "ok":
                continue
            path, role = rec.paths[0]
            s = rec.stats
            out.append(
                Alert(
                    step=self.step,
                    phase=phase_of[rec.kind],
                    module=path[-1] if path else "",
                    tensor=role,
                    shape=rec.shape,
                    has_nan=bool(s.has_nan) if s is not None else st == "nan",
                    has_inf=bool(s.has_inf) if s is not None else st == "inf",
                    min=float(s.min) if s is not None and int(s.finite_nonzero + s.zeros) else None,
                    max=float(s.max) if s is not None and int(s.finite_nonzero + s.zeros) else None,
                )
            )
        return out

    @property
    def stats(self) -> dict[tuple[str, str], TensorStats]:
        """Stats mode: ``{(module, role): TensorStats}`` of this step (merged over repeats)."""
        out: dict[tuple[str, str], TensorStats] = {}
        for rec in self._records:
            if rec.stats is None:
                continue
            path, role = rec.paths[0]
            key = (path[-1] if path else "", role)
            out[key] = out[key].merge(rec.stats) if key in out else rec.stats
        return out
