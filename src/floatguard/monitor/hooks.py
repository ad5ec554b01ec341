"""The Monitor: module and tensor hooks feeding the sentinel (and statistics) in execution order.

The opt-in, per-module watch: for loops without a closure (``Guard(watch="hooks")``) and
for statistics sampled every k steps. The guard's always-on path needs none of it
(detection is its one read per step; localization is a replay of the bad step).

Words used here:

- *record*: one watched tensor of this step (a module's input, output, parameter, a
  gradient), in execution order, with its call path and role
  (:class:`~floatguard.monitor.localize.Record`).
- *slot*: a record's place in the :class:`~floatguard.monitor.sentinel.Sentinel`: a
  read (one ``aminmax``) or a proof. An *alias* is a record whose tensor was already
  recorded this step (same tensor, same version counter): it shares the slot.
- *frame*: one call of a module whose output (and input gradient) may be proved
  finite from what it was given; its *deps* are the slots of that input and of the
  parameters the rule reads (:mod:`floatguard.monitor.bounds`).
- *sampled step*: with ``mode="stats", every=k > 1``, a step whose hooks are on; the
  others run only the model's own two hooks.

Reading order: :class:`Monitor` (attach, steps, records), then the hooks it makes
(``_pre_hook``, ``_post_hook``, ``_on_grad``, ``_param_grad_hook``), then reading.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import (
    GetAttrKey,
    MappingKey,
    SequenceKey,
    tree_flatten_with_path,
    tree_map_only,
)
from torch.utils.hooks import RemovableHandle

from floatguard._values import local_part, values_of
from floatguard.formats.registry import get
from floatguard.monitor import _context
from floatguard.monitor.bounds import (
    PROVABLE_DTYPES,
    Rule,
    accumulation_roundoff,
    backward_rule,
    forward_rule,
    provable_type,
    rule_params,
    sum_rule,
)
from floatguard.monitor.localize import Alert, Fault, Record, RecordKind, localize
from floatguard.monitor.sentinel import Sentinel
from floatguard.stats import EXP_MIN, TensorStats, stats_and_aminmax

__all__ = ["Monitor"]

Mode = Literal["sentinel", "stats"]
ProofMode = Literal["all", "forward", "off"]


def _watched(t: torch.Tensor) -> bool:
    """Floating and complex tensors are watched (a complex one through its real view);
    integer and bool tensors are not."""
    return t.is_floating_point() or t.is_complex()


def _floats(obj: Any, prefix: str) -> list[tuple[str, torch.Tensor]]:
    """``list(_walk(obj, prefix))``, with the common cases (one tensor, a tuple of
    tensors) taken without the generator."""
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)] if obj.is_floating_point() or obj.is_complex() else []
    if type(obj) is tuple and all(isinstance(o, torch.Tensor) for o in obj):
        return [
            (f"{prefix}[{i}]", o)
            for i, o in enumerate(obj)
            if o.is_floating_point() or o.is_complex()
        ]
    return list(_walk(obj, prefix))


def _has_leaf(outs: list[tuple[str, torch.Tensor]]) -> bool:
    """Whether an output is a leaf that requires grad (no autograd node of its own)."""
    for _, t in outs:
        if t.grad_fn is None and t.requires_grad:
            return True
    return False


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter, or None for an inference tensor (which has none: it can
    be neither aliased by version nor proved)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _role(prefix: str, path: tuple[Any, ...]) -> str:
    """A pytree key path as a role: ``output[0]``, ``output.logits``, ``input[1]``."""
    parts = [prefix]
    for key in path:
        if isinstance(key, SequenceKey):
            parts.append(f"[{key.idx}]")
        elif isinstance(key, MappingKey):
            parts.append(f".{key.key}" if isinstance(key.key, str) else f"[{key.key!r}]")
        elif isinstance(key, GetAttrKey):
            parts.append(f".{key.name}")
        else:
            parts.append(str(key))
    return "".join(parts)


def _walk(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(role, tensor) for every floating tensor in ``obj``: whatever torch's pytree
    walks (tuples, lists, dicts, namedtuples, registered types such as Hugging Face's
    ModelOutput), and the fields of plain dataclasses, which pytree leaves alone."""
    leaves, _ = tree_flatten_with_path(obj, is_leaf=_is_dataclass_instance)
    for path, leaf in leaves:
        role = _role(prefix, path)
        if isinstance(leaf, torch.Tensor):
            if _watched(leaf):
                yield role, leaf
        elif _is_dataclass_instance(leaf):
            for f in dataclasses.fields(leaf):
                yield from _walk(getattr(leaf, f.name), f"{role}.{f.name}")


class _Seen(NamedTuple):
    """A tensor recorded this step: a weak reference (an id alone may be reused), its
    version counter then (an in-place change since means new values), its slot."""

    ref: weakref.ref[torch.Tensor]
    version: int
    slot: int


@dataclasses.dataclass
class _Frame:
    """One call of a module whose output (and input gradient) may be proved finite."""

    module: nn.Module
    x: torch.dtype | None  # dtype of the one floating input (None for an embedding)
    width: int  # its last dimension
    deps: list[int]  # slots: the input (if any), then the rule's parameters
    acc: float  # unit roundoff of the sums inside (bounds.accumulation_roundoff)
    g_slot: int | None = None  # slot of the gradient that arrived at the output


def _only_our_hooks(m: nn.Module) -> bool:
    """Whether ``m`` runs its class's own math and nothing else: no hook but ours (a
    user's forward hook may replace the output, a pre-hook the input, a backward
    hook the gradient), no global module hooks, no ``forward`` set on the instance.
    Only then can its output be proved from what it was given."""
    if len(m._forward_pre_hooks) != 1 or len(m._forward_hooks) != 1:
        return False
    if m._backward_hooks or m._backward_pre_hooks or "forward" in m.__dict__:
        return False
    g = vars(torch.nn.modules.module)
    for name in _GLOBAL_HOOKS:
        if g.get(name):
            return False
    return True


_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def _eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, never traced by torch.compile: the hooks keep host-side records (and
    would make dynamo guard on every tensor's identity), so each runs eagerly, as a
    graph break. Costs ~0.4 us per call in eager mode."""
    eager: Callable[..., Any] = torch.compiler.disable(fn)  # type: ignore[no-untyped-call]
    return eager


def _nth_grad(
    nr: int, fn: Callable[[torch.Tensor], None], grad_outputs: tuple[torch.Tensor | None, ...]
) -> None:
    """Node pre-hook: pass the gradient of output ``nr`` (if any) to ``fn``."""
    g = grad_outputs[nr] if nr < len(grad_outputs) else None
    if g is not None:
        fn(g)


# Whether autocast is on for any device: one cheap call before the per-device ones.
_ANY_AUTOCAST: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype in force for ``t``'s device (None when autocast is off)."""
    if not _ANY_AUTOCAST():
        return None
    dev = t.device.type
    try:
        if not torch.is_autocast_enabled(dev):
            return None
        return torch.get_autocast_dtype(dev)
    except (TypeError, RuntimeError, AttributeError):  # older spellings: assume the worst
        return torch.float16


_HYPER = (
    "p", "eps", "negative_slope", "alpha", "beta", "min_val", "max_val", "inplace", "approximate",
)  # fmt: skip
_NO_HYPER = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.Identity)


def _hyper(m: nn.Module) -> tuple[Any, ...]:
    """The hyper-parameters rules read (part of the rule cache's key: they may change).
    Types whose rule reads none but fixed shapes and flags skip the lookups."""
    if type(m) in _NO_HYPER:
        return ()
    d = m.__dict__
    return tuple(d.get(k) for k in _HYPER)


def _map(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` rebuilt by torch's pytree with ``fn`` applied to its floating tensors
    (a plain dataclass is left as it is: its tensors are read, not replaced)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj) if _watched(obj) else obj
    if type(obj) is tuple and all(isinstance(o, torch.Tensor) for o in obj):
        return tuple(fn(o) if _watched(o) else o for o in obj)  # the common case
    return tree_map_only(
        torch.Tensor, lambda t: fn(t) if _watched(t) else t, obj, is_leaf=_is_dataclass_instance
    )


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
        self.model = model
        self.mode: Mode = mode
        self.every = every
        self.auto_step = auto_step
        self.step = 0
        self._names = {id(m): n for n, m in model.named_modules()}
        self._handles: list[RemovableHandle] = []
        # Sampling (stats every k > 1 steps): the hooks of every module but the model's,
        # made once at attach and registered on sampled steps only.
        self._wiring: list[tuple[nn.Module, Any, Any]] = []
        self._param_wiring: list[tuple[nn.Parameter, Any]] = []
        self._sampled_handles: list[RemovableHandle] = []
        self._quiet = False  # an unsampled step: the model's hooks record nothing
        self._sentinel = Sentinel()
        self._records: list[Record] = []
        self._seen: dict[int, _Seen] = {}
        self._hooked: dict[
            int,
            tuple[weakref.ref[torch.Tensor], list[tuple[tuple[str, ...], str]], list[_Frame]],
        ] = {}
        self._stack: list[str] = []
        self._backward_seen = False
        self._last_forward_grad = True
        self._analysis: list[Fault] | None = None
        self._last_grad: tuple[torch.Tensor, tuple[Any, ...], int] | None = None
        self._slot_stats: dict[int, TensorStats] = {}
        modes = {True: "all", False: "off", "all": "all", "forward": "forward"}
        if isinstance(proofs, bool) or proofs in ("all", "forward", "off"):
            self.proofs: ProofMode = modes.get(proofs, "off")  # type: ignore[assignment]
        else:
            raise ValueError(f"proofs={proofs!r}; use 'all' (default), 'forward', 'off' or a bool")
        self._frames: list[_Frame | None] = []
        self._step_handles: list[RemovableHandle] = []  # hooks on leaves, for one step
        self._rules: dict[tuple[Any, ...], Rule | None] = {}
        self._hypers: dict[int, tuple[Any, ...]] = {}
        self._provable = {id(m) for m in model.modules() if provable_type(m)}

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

    def _saw_backward(self, grad_outputs: Any) -> None:
        self._backward_seen = True

    def detach(self) -> None:
        """Remove every hook. Records of the current step stay readable."""
        for h in self._handles + self._step_handles + self._sampled_handles:
            h.remove()
        self._handles.clear()
        self._step_handles.clear()
        self._sampled_handles = []
        self._wiring = []
        self._param_wiring = []
        self._stack.clear()
        self._frames.clear()

    def __enter__(self) -> Monitor:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # ----------------------------------------------------------------- steps
    def next_step(self) -> None:
        """Start a new step: clear the records (the step counter advances)."""
        self.step += 1
        self._clear()
        if self._sampling and self._handles:
            self._rewire()

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
        self._hypers.clear()
        for h in self._step_handles:
            h.remove()
        self._step_handles.clear()

    def _ignored(self) -> bool:
        """Passes the monitor does not record: a replay's (not a step of the run), and,
        when the caller drives the steps (``auto_step=False``, as the guard does),
        forwards without grad (evaluation between steps: they would pile up)."""
        return _context.is_replaying() or (not self.auto_step and not torch.is_grad_enabled())

    def packed_records(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(min, max) of every read record of this step as two device vectors, for a
        caller that folds them into its own single host read (the guard does); give
        the host copies to :meth:`faults_from`. None when nothing was recorded."""
        return self._sentinel.packed()

    def _rule(
        self,
        frame: _Frame,
        pass_: Literal["forward", "backward"],
        width: int,
        output: torch.Tensor | None,
    ) -> Rule | None:
        """The proof rule of ``frame``'s module for one pass, built once per module,
        width, dtype, roundoff, training flag and hyper-parameters."""
        m = frame.module
        key = (id(m), pass_, width, frame.x, frame.acc, m.training, self._hyper_of(m))
        if key in self._rules:
            return self._rules[key]
        if pass_ == "forward":
            assert output is not None
            rule = forward_rule(m, frame.x, output, frame.acc)
        else:
            assert frame.x is not None  # a backward proof needs the input's dtype
            rule = backward_rule(m, width, frame.x, frame.acc)
        self._rules[key] = rule
        return rule

    def _seen_slot(self, t: torch.Tensor, version: int | None) -> int | None:
        """The slot of ``t`` if this very tensor, at this version, was recorded this step."""
        hit = self._seen.get(id(t))
        if hit is not None and hit.ref() is t and hit.version == version:
            return hit.slot
        return None

    def _remember(self, t: torch.Tensor, version: int, slot: int) -> None:
        self._seen[id(t)] = _Seen(weakref.ref(t), version, slot)

    def _hyper_of(self, m: nn.Module) -> tuple[Any, ...]:
        """The module's rule hyper-parameters, looked up once per step."""
        h = self._hypers.get(id(m))
        if h is None:
            h = self._hypers[id(m)] = _hyper(m)
        return h

    def _stats_on(self) -> bool:
        return self.mode == "stats" and self.step % self.every == 0

    # --------------------------------------------------------------- records
    def _add(
        self,
        kind: RecordKind,
        path: tuple[str, ...],
        role: str,
        t: torch.Tensor,
        proof: tuple[Rule, list[int]] | None = None,
    ) -> Record:
        # A DTensor (FSDP2's sharded parameters and gradients) is read by this rank's
        # part: a DTensor op here would run a collective inside a hook, out of step
        # with the other ranks' collectives (a deadlock).
        t = local_part(t)
        stats_on = self._stats_on()
        stats: TensorStats | None = None
        if proof is not None and not stats_on:
            slot = self._sentinel.prove(t, proof[0], proof[1])
        elif t.is_sparse and not stats_on and not t.is_coalesced():
            # Reading it exactly means coalescing it, which sizes its output on the host
            # (a sync on CUDA). Its stored values are read instead (non-finite there is
            # non-finite after summing), and the sums of duplicates are proved finite
            # from them; a sum the bound cannot settle is coalesced and read when the
            # monitor is read.
            values = t.detach()._values()
            if values.is_complex():
                values = torch.view_as_real(values)
            vslot = self._sentinel.add(values)
            width = t.shape[-1] if t.dim() else 1
            rule = sum_rule(max(t._nnz(), 1), values.dtype, width)
            slot = self._sentinel.prove(t, rule, [vslot])
        else:
            strided = t.layout == torch.strided
            r = t if strided and not t.is_complex() else values_of(t)
            if stats_on:
                # one read for both where it can; a sparse tensor's stats count the
                # zeros it does not store
                sparse = not strided and not t.is_complex()
                stats, minmax = stats_and_aminmax(t if sparse else r)
                slot = self._sentinel.add(r, minmax)
            else:
                slot = self._sentinel.add(r)
        rec = Record(kind, [(path, role)], slot, tuple(t.shape))
        if stats is not None:
            rec.stats = self._slot_stats[rec.slot] = stats
        self._records.append(rec)
        self._analysis = None
        return rec

    def _add_forward(
        self,
        kind: RecordKind,
        path: tuple[str, ...],
        role: str,
        t: torch.Tensor,
        proof: tuple[Rule, list[int]] | None = None,
    ) -> int:
        try:
            version = t._version
        except RuntimeError:  # an inference tensor (no version): read it wherever seen
            return self._add(kind, path, role, t).slot
        slot = self._seen_slot(t, version)
        if slot is not None:
            # Already checked this step (e.g. the previous module's output): alias it.
            stats = self._slot_stats.get(slot)
            self._records.append(Record(kind, [(path, role)], slot, tuple(t.shape), stats))
            return slot
        if proof is not None and (t.layout != torch.strided or t.is_complex()):
            proof = None
        rec = self._add(kind, path, role, t, proof)
        self._remember(t, version, rec.slot)
        return rec.slot

    def _pre_hook(self, name: str, module: nn.Module) -> Callable[..., Any]:
        params = [(f"param:{n}", p) for n, p in module.named_parameters(recurse=False)]
        is_root = module is self.model
        rule_pnames = rule_params(module)
        own = {n for n, _ in module.named_parameters(recurse=False)}
        # A rule reads the module's own parameters; one computed by a pre-hook
        # (old-style weight_norm, pruning) is not a parameter: no proof.
        provable = id(module) in self._provable and all(n in own for n in rule_pnames)
        is_embedding = type(module) is nn.Embedding

        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if self._ignored():
                return None
            if is_root and not self._stack:
                if self.auto_step and (self._backward_seen or not self._last_forward_grad):
                    self.next_step()
                self._last_forward_grad = torch.is_grad_enabled()
                if self._sampling:
                    self._rewire()
                    if not self._stats_on():
                        self._quiet = True
                        return None
            self._stack.append(name)
            path = tuple(self._stack)
            inputs = _floats(args, "input")
            if kwargs:
                inputs += _floats(kwargs, "input")
            slots = [self._add_forward("fwd_input", path, role, t) for role, t in inputs]
            pslots = {role: self._add_forward("fwd_param", path, role, p) for role, p in params}
            frame: _Frame | None = None
            if provable and self.proofs != "off" and len(inputs) <= 1 and _only_our_hooks(mod):
                x = inputs[0][1] if inputs else None
                cast = _autocast_dtype(x) if x is not None else None
                if (
                    (x is None) == is_embedding
                    and (x is None or x.dtype in PROVABLE_DTYPES)
                    and (cast is None or cast in PROVABLE_DTYPES)
                    and all(p.dtype in PROVABLE_DTYPES for _, p in params)
                ):
                    deps = slots + [pslots["param:" + n] for n in rule_pnames]
                    dtypes = [p.dtype for _, p in params] + ([x.dtype] if x is not None else [])
                    acc = accumulation_roundoff(*dtypes, low_precision=cast == torch.bfloat16)
                    frame = _Frame(
                        mod,
                        None if x is None else x.dtype,
                        x.shape[-1] if x is not None and x.dim() else 1,
                        deps,
                        acc,
                    )
            if mod.__dict__.get("inplace") is True:
                # It will overwrite its input: a proof of that input must read it now.
                for slot in slots:
                    self._sentinel.materialize(slot)
            self._frames.append(frame)
            if not torch.is_grad_enabled():
                return None
            counter = [0]
            x = inputs[0][1] if frame is not None and inputs else None

            def watch(t: torch.Tensor) -> torch.Tensor:
                i = counter[0]
                counter[0] += 1
                if not t.requires_grad:
                    return t
                # A view gives this module its own autograd edge: the hook sees exactly
                # the gradient this module sends back to its input.
                v = t.view_as(t)
                slot = self._seen_slot(t, t._version)
                if slot is not None:
                    # Same memory, same version counter: what the module's children see
                    # through the view was checked as the module's input.
                    self._remember(v, v._version, slot)
                # A module may return this very view (an identity, dropout with p=0):
                # then its gradient arrives here before any node hook could see it as
                # the module's grad_output. The post-hook files those roles in
                # ``before`` (through _hooked), recorded ahead of the grad_input.
                before: tuple[list[tuple[tuple[str, ...], str]], list[_Frame]] = ([], [])
                self._hooked[id(v)] = (weakref.ref(v), before[0], before[1])
                hook = functools.partial(
                    self._on_grad,
                    "bwd_grad_input",
                    [(path, f"grad_input[{i}]")],
                    frame if t is x else None,
                    None,
                    before,
                )
                v.register_hook(hook)  # type: ignore[no-untyped-call]
                return v

            return _map(args, watch), (_map(kwargs, watch) if kwargs else kwargs)

        return hook

    def _post_hook(self, name: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
            if self._ignored():
                return None
            if self._quiet and module is self.model and not self._stack:
                # An unsampled step: only notice its backward (to know when it ends).
                self._quiet = False
                node = next(
                    (t.grad_fn for _, t in _floats(output, "output") if t.grad_fn is not None),
                    None,
                )
                if node is not None:
                    node.register_prehook(self._saw_backward)
                return None
            on_top = bool(self._stack) and self._stack[-1] == name
            path = tuple(self._stack) if on_top else (name,)
            frame = self._frames[-1] if on_top and self._frames else None
            grad = torch.is_grad_enabled()
            proof: tuple[Rule, list[int]] | None = None
            if frame is not None and isinstance(output, torch.Tensor):
                if output.dtype in PROVABLE_DTYPES:
                    width = output.shape[-1] if output.dim() else 1
                    rule = self._rule(frame, "forward", width, output)
                    if rule is not None:
                        proof = (rule, frame.deps)
            # A lone tensor is output[0], like the first element of a tuple.
            outs = _floats((output,) if isinstance(output, torch.Tensor) else output, "output")
            replaced = None
            if grad and _has_leaf(outs):
                # A leaf returned as output (the module's own parameter, say) has no node
                # for the hook, and its own hooks (the parameter's gradient) would run
                # first: the module returns a view of it instead, whose node is its own.
                replaced = _map(output, self._view_of_leaf)
                outs = _floats(
                    (replaced,) if isinstance(replaced, torch.Tensor) else replaced, "output"
                )
            for role, t in outs:
                self._add_forward("fwd_output", path, role, t, proof)
                if grad and t.requires_grad:
                    gi_role = "grad_" + role
                    entry = self._hooked.get(id(t))
                    if entry is not None and entry[0]() is t:
                        entry[1].append((path, gi_role))  # a parent returning its child's output
                        if frame is not None:
                            entry[2].append(frame)
                    else:
                        roles = [(path, gi_role)]
                        frames = [frame] if frame is not None else []
                        on_grad = self._grad_hook("bwd_grad_output", roles, out_frames=frames)
                        node = t.grad_fn
                        if node is not None:
                            # A pre-hook on the node that made t runs after every tensor
                            # hook on t (a user's may rescale or replace the gradient):
                            # it sees the gradient this module's backward consumes.
                            node.register_prehook(
                                functools.partial(_nth_grad, t.output_nr, on_grad)
                            )
                        else:  # a leaf nested where it could not be replaced
                            h = t.register_hook(on_grad)  # type: ignore[no-untyped-call]
                            self._step_handles.append(h)
                        self._hooked[id(t)] = (weakref.ref(t), roles, frames)
            if on_top:
                self._stack.pop()
                self._frames.pop()
            return replaced

        return hook

    def _view_of_leaf(self, t: torch.Tensor) -> torch.Tensor:
        if not (t.requires_grad and t.grad_fn is None):
            return t
        v = t.view_as(t)
        slot = self._seen_slot(t, _version(t))
        if slot is not None:
            self._remember(v, v._version, slot)  # same values
        return v

    def _grad_hook(
        self,
        kind: RecordKind,
        roles: list[tuple[tuple[str, ...], str]],
        frame: _Frame | None = None,
        out_frames: list[_Frame] | None = None,
    ) -> Callable[[torch.Tensor], None]:
        # A partial, not a closure: one is made per watched tensor per step.
        return functools.partial(self._on_grad, kind, roles, frame, out_frames, None)

    def _on_grad(
        self,
        kind: RecordKind,
        roles: list[tuple[tuple[str, ...], str]],
        frame: _Frame | None,
        out_frames: list[_Frame] | None,
        before: tuple[list[tuple[tuple[str, ...], str]], list[_Frame]] | None,
        grad: torch.Tensor,
    ) -> None:
        self._backward_seen = True
        if grad is None or not (grad.is_floating_point() or grad.is_complex()):
            return
        if before is not None and before[0]:
            # The module returned its input view: this gradient is its grad_output too.
            self._on_grad("bwd_grad_output", before[0], None, before[1], None, grad)
        # The gradient a module sends to its input view usually arrives, as a view of
        # the same memory, at the previous module's output right after: check it once.
        # The last checked gradient is held (one buffer at most), so its memory cannot
        # have been reused: equal (address, layout, version) means equal values.
        strided = grad.layout == torch.strided
        key = (
            (grad.data_ptr(), grad.shape, grad.stride(), grad.dtype, grad._version)
            if strided
            else None
        )
        last = self._last_grad
        if key is not None and last is not None and last[1] == key:
            slot = last[2]
            self._records.append(
                Record(kind, roles, slot, tuple(grad.shape), self._slot_stats.get(slot))
            )
            self._analysis = None
        else:
            proof: tuple[Rule, list[int]] | None = None
            if (
                frame is not None
                and frame.g_slot is not None
                and frame.x is not None
                and grad.dtype in PROVABLE_DTYPES
                and strided
                and self.proofs == "all"
            ):
                rule = self._rule(frame, "backward", frame.width, None)
                if rule is not None:
                    proof = (rule, [frame.g_slot, *frame.deps])
            rec = self._add(kind, roles[0][0], roles[0][1], grad, proof)
            rec.paths = roles
            slot = rec.slot
            if key is not None:
                self._last_grad = (grad, key, slot)
        if out_frames:
            for f in out_frames:
                f.g_slot = slot

    def _param_grad_hook(self, module: str, pname: str) -> Callable[[torch.Tensor], None]:
        # Ownership path ("", "layers", "layers.0", ...): parameters have no call path.
        parts = module.split(".") if module else []
        path = ("", *(".".join(parts[: i + 1]) for i in range(len(parts))))
        if not module:
            path = ("",)

        def hook(grad: torch.Tensor) -> None:
            if _context.is_replaying():
                return None
            self._backward_seen = True
            if grad is not None and (grad.is_floating_point() or grad.is_complex()):
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
                    has_inf=bool(s.has_inf) if s is not None else st in ("inf", "ninf"),
                    min=float(s.min) if s is not None and int(s.finite_nonzero + s.zeros) else None,
                    max=float(s.max) if s is not None and int(s.finite_nonzero + s.zeros) else None,
                )
            )
        return out

    @property
    def stats(self) -> dict[tuple[str, str], TensorStats]:
        """Stats mode: ``{(module, role): TensorStats}`` of this step (merged over repeats).

        A parameter's values are under ``"param:weight"``, its gradient under
        ``"param:weight.grad"``."""
        out: dict[tuple[str, str], TensorStats] = {}
        for rec in self._records:
            if rec.stats is None:
                continue
            path, role = rec.paths[0]
            if rec.kind == "bwd_param_grad":
                role += ".grad"
            key = (path[-1] if path else "", role)
            out[key] = out[key].merge(rec.stats) if key in out else rec.stats
        return out

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
        stats = self.stats
        if not stats:
            return {}
        fmts = [get(f) for f in self.formats]
        rows = []
        for st in stats.values():
            n = torch.clamp(st.numel, min=1).double()
            for f in fmts:
                rows.append(
                    torch.stack(
                        [
                            st.overflow_count(f).double() / n,
                            st.underflow_count(f).double() / n,
                            st.subnormal_count(f).double() / n,
                            st.recommended_scale(f).double(),
                            st.recommended_scale(f, power_of_two=True).double(),
                        ]
                    )
                )
        devices = {r.device for r in rows}
        target = next(iter(devices)) if len(devices) == 1 else torch.device("cpu")
        values = torch.stack([r.to(target) for r in rows]).tolist()  # the one host read
        out: dict[tuple[str, str], dict[str, dict[str, float]]] = {}
        it = iter(values)
        names = ("overflow", "underflow", "subnormal", "scale", "scale_pow2")
        for key in stats:
            out[key] = {f.name: dict(zip(names, next(it), strict=True)) for f in fmts}
        return out

    def stats_summary(self) -> list[dict[str, Any]]:
        """Stats mode: a JSON-ready summary of this step's tensors, for the event stream.

        Per ``(module, role)``: ``numel``, ``amax``, ``nonfinite``, ``zeros``, per format of
        :attr:`formats` the ``underflow`` / ``overflow`` / ``subnormal`` fractions (unscaled
        casts, from :meth:`format_fit`), and ``hist``: the exponent histogram's non-empty
        span (``hist_from`` is the binary exponent of its first bin). Two host reads.
        Empty when the step kept no statistics."""
        stats = self.stats
        if not stats:
            return []
        fit = self.format_fit()
        keys = list(stats)
        rows = torch.stack(
            [
                torch.stack(
                    [
                        st.numel.double(),
                        st.amax.double(),
                        (st.nan + st.posinf + st.neginf).double(),
                        st.zeros.double(),
                    ]
                ).cpu()
                for st in stats.values()
            ]
        ).tolist()
        hists = torch.stack([st.hist.cpu() for st in stats.values()]).tolist()
        out = []
        for key, (numel, amax, nonfinite, zeros), hist in zip(keys, rows, hists, strict=True):
            nz = [i for i, c in enumerate(hist) if c]
            lo, hi = (nz[0], nz[-1] + 1) if nz else (0, 0)
            out.append(
                {
                    "module": key[0], "role": key[1], "numel": int(numel), "amax": amax,
                    "nonfinite": int(nonfinite), "zeros": int(zeros),
                    "formats": {
                        f: {k: v[k] for k in ("underflow", "overflow", "subnormal")}
                        for f, v in fit[key].items()
                    },
                    "hist_from": EXP_MIN + lo, "hist": [int(c) for c in hist[lo:hi]],
                }
            )  # fmt: skip
        return out
