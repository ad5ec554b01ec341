"""Op-level replay: re-run a step under a dispatch mode and name where its first harmful
non-finite value was born: module, phase, aten op and the user's line.

Words used here:

- *candidate*: an op whose floating inputs were free of NaN and +inf and whose output
  holds a NaN, or whose inputs were all finite and whose output holds an inf. Inputs
  are judged before the op runs (an in-place op overwrites them); ``out=`` buffers and
  the self of ``fill_`` / ``zero_`` (which read none of it) are not inputs; a sparse
  tensor is judged by the dense tensor it stands for.
- *intended infinity*: ``-inf`` that is data, not a fault: a mask filled with
  ``-inf`` (fill-type ops given an infinite scalar are never candidates), log-space
  padding, ``-inf`` in the model's inputs. An op whose only non-finite outputs are
  ``-inf`` is a candidate of the last resort (``log(0)`` masked by a ``where`` is
  intended; ``log(0)`` that reaches the loss is not).
- *data* (phase "input"): tensors the step was given from outside the model, which
  exist before its forward starts: what the closure captured, what the data loader
  produced, what the step's code builds outside the model's modules (a batch made
  with ``torch.tensor`` before the model runs, a target in the loss code). Their
  NaN and +inf are the step's data, not a birth.
- *module constant*: a tensor a module of the model creates from Python values in
  its forward, which reaches the dispatcher as ``aten.lift_fresh``: a
  ``torch.tensor(...)`` constant, the value of ``h[:, 0] = float("nan")``. It is
  judged like a scalar argument: never data, and an op that uses a NaN constant is
  a candidate (``h + torch.tensor(nan)`` is born at that ``add``, in that module);
  a fill-type op given an infinite constant is intended, as with an infinite scalar.
  A constant written in place by a later op is an ordinary tensor from then on.
  Limit: a tensor a module makes from NumPy memory (``torch.from_numpy``, which no
  op of the dispatcher sees) is taken for data.
- *forward pass*: the ops from the step's start, or from the end of a backward, up to
  the next backward. With gradient accumulation (forward 1, backward 1, forward 2,
  backward 2, ...) each micro-batch is a forward pass of its own, localized as if it
  ran alone: its own input check, its own "input" / "forward" / "loss" phases. Any
  backward ends a pass, also one inside the forward (``torch.autograd.grad`` for a
  gradient penalty): what follows it is searched as a pass of its own.
- *harm*: what made the step bad. A non-finite loss points into the forward passes
  (the model's inputs, its parameters, its modules, the loss code): the first pass
  whose own loss was non-finite, then the others in order. A finite loss with
  non-finite gradients points into the backward passes.
- *birth*: the candidate reported. In order: a non-finite parameter (phase "param");
  within the forward pass the harm points to, NaN or +inf in the model's inputs
  ("input"), then NaN or +inf in other data the step was given when it came in
  before any candidate of that pass that is not ``-inf`` only ("input"), then that
  pass's first candidate that is not ``-inf`` only, then its first candidate; then
  the first candidate of the kind of pass the harm points to that is not ``-inf``
  only; that kind's first candidate; the first candidate at all.

Module context comes from global module hooks, which also tag each autograd node
with the module whose call created it (so a backward op names its module). The
phase of a forward op is "forward" inside a module of the model, "input" before the
model ran in its forward pass, "loss" after it, and "loss" throughout a pass after
the first that never calls the model (the step's code after a backward, such as the
mean of the micro-batches' losses). An op that
runs while the autograd engine runs (a node, a hook, a checkpoint's recomputation) is
a backward op. A backward op whose non-finite output becomes a parameter's gradient
is "param_grad". Backward ops name the forward line that made their node (anomaly
mode's traceback). Every op's inputs are read on the host: this costs nothing until a
step goes bad, and then a few steps' time.

A forward pass's own loss (``loss_of`` gives the step's, not each micro-batch's) is
taken to be the last floating output, in that pass, of a forward op computed from a
floating tensor (factories and ``*_like`` ops, such as the gradient seed
``backward()`` makes, are not losses). It only orders the passes: a pass whose loss
was misjudged is still searched, after the others.
"""

from __future__ import annotations

import contextlib
import math
import os
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from floatguard._values import local_part, values_of
from floatguard.monitor import _context
from floatguard.monitor.localize import Fault, Phase
from floatguard.stats import TensorStats, tensor_stats

__all__ = ["ReplayResult", "replay"]

# Uninitialised memory may hold anything: never blame these.
_SKIP = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "set_")
# Ops whose infinite *scalar* argument is the point (masks filled with -inf): their
# non-finite output is intended. A NaN scalar (x * nan, a fill with NaN) is a fault.
_FILLS = (
    "fill", "fill_", "masked_fill", "masked_fill_", "full", "full_like", "new_full",
    "scalar_tensor", "where", "index_fill", "index_fill_", "clamp", "clamp_",
)  # fmt: skip
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_DEMO = os.path.join(_HERE, "demo")
_TAG = "floatguard_module"
# In-place ops that write every element of their self without reading it: what it
# held before (stale or uninitialised memory, a NaN of an earlier run) is no input.
_OVERWRITES = frozenset({"fill_", "zero_"})
# Ops that turn Python values into a tensor (torch.tensor, a scalar written by indexing).
_LIFTS = frozenset({"lift_fresh", "lift_fresh_copy", "lift"})
_LIFT_OPS = frozenset(getattr(torch.ops.aten, n) for n in _LIFTS)
# Ops whose output is never a forward pass's loss (backward()'s seed is a ones_like).
_NOT_A_LOSS = frozenset({
    "ones_like", "zeros_like", "empty_like", "full_like", "rand_like", "randn_like",
    "randint_like", "lift_fresh", "lift_fresh_copy", "lift",
})  # fmt: skip
_MAX_CANDIDATES = 256


@dataclass(frozen=True)
class ReplayResult:
    """Where the step's first harmful non-finite value was born.

    ``op``: the aten op (``"aten.log.default"``), or ``"parameter"`` / ``"input"``
    when the value was already there. ``phase``: "param", "input", "forward",
    "loss", "backward" or "param_grad". ``module``: qualified name in the model
    ("" for the root, None when no module was running). ``tensor``: the role
    (``"output"``, ``"grad"``, ``"input[0]"``, ``"param:weight"``). ``kind``: "nan" or
    "inf". ``source``: the user's line (for backward ops, the forward line that made
    the node). ``deterministic``: with ``repeat >= 2``, whether every run found the
    same op at the same line (None with one run).
    """

    op: str
    phase: Phase
    kind: Literal["nan", "inf"]
    source: str | None
    inputs: list[TensorStats] = field(repr=False)
    outputs: list[TensorStats] = field(repr=False)
    deterministic: bool | None = None
    module: str | None = None
    tensor: str = "output"
    shape: tuple[int, ...] = ()

    def __str__(self) -> str:
        det = (
            ""
            if self.deterministic is None
            else (" (deterministic)" if self.deterministic else " (NOT deterministic)")
        )
        where = "" if self.module is None else f" in {self.module or '<root>'}"
        return (
            f"{self.kind} first produced by {self.op}{where} in {self.phase} "
            f"({self.tensor}) at {self.source}{det}"
        )

    def to_fault(self, step: int, *, deterministic: bool | None) -> Fault:
        """This birth as the guard's :class:`~floatguard.monitor.localize.Fault` of
        ``step`` (the output's statistics kept; ``deterministic`` as the guard judged
        it: whether the replayed step was bad again)."""
        return Fault(
            step=step,
            phase=self.phase,
            module=self.module if self.module is not None else "",
            tensor=self.tensor,
            kind=self.kind,
            shape=self.shape,
            stats=self.outputs[0] if self.outputs else None,
            op=self.op,
            source=self.source,
            deterministic=deterministic,
        )


@dataclass
class _Candidate:
    result: ReplayResult
    backward: bool
    ninf_only: bool
    storages: tuple[int, ...] = ()
    forward_pass: int = 0  # the forward pass it belongs to (backward: the one before)
    # The bad outputs themselves, held so that their memory is not reused while the
    # replay runs (a later gradient at the same address would look like this one).
    held: tuple[torch.Tensor, ...] = ()


# ----------------------------------------------------------------- source lines
def _user_frame(frames: list[traceback.FrameSummary]) -> str | None:
    for fr in reversed(frames):
        path = os.path.abspath(fr.filename)
        ours = path.startswith(_HERE) and not path.startswith(_DEMO)  # the demo is user code
        if path.startswith(_TORCH) or ours or "<frozen" in fr.filename:
            continue
        line = (fr.line or "").strip()
        return f"{fr.filename}:{fr.lineno}: {line}"
    return None


def _engine_frame(frames: list[traceback.FrameSummary]) -> str | None:
    """The user's frame among those the autograd engine called (hooks, backward())."""
    starts = [i for i, fr in enumerate(frames) if fr.name == "_engine_run_backward"]
    return _user_frame(frames[starts[-1] + 1 :]) if starts else None


def _from_anomaly_trace(node: Any) -> str | None:
    meta = getattr(node, "metadata", None)
    text = meta.get("traceback_") if isinstance(meta, dict) else None
    if not text:
        return None
    blob = "".join(text if isinstance(text, list) else [text])
    parsed: list[traceback.FrameSummary] = []
    for chunk in blob.split('  File "')[1:]:
        head, _, rest = chunk.partition("\n")
        fname, _, tail = head.partition('", line ')
        try:
            lineno = int(tail.split(",")[0])
        except ValueError:
            continue
        parsed.append(traceback.FrameSummary(fname, lineno, "", line=rest.split("\n")[0].strip()))
    return _user_frame(parsed)


# ----------------------------------------------------------------- values
def _floats(
    obj: Any, constant: Callable[[torch.Tensor], bool] | None = None
) -> tuple[list[torch.Tensor], list[float], list[torch.Tensor]]:
    """The floating tensors in ``obj`` (by their values), its float scalars, and the
    floating tensors ``constant`` picks out (module constants), apart."""
    leaves, _ = tree_flatten(obj)
    tensors: list[torch.Tensor] = []
    consts: list[torch.Tensor] = []
    for x in leaves:
        if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
            (consts if constant is not None and constant(x) else tensors).append(values_of(x))
    scalars = [float(x) for x in leaves if isinstance(x, float)]
    return tensors, scalars, consts


_COLLECTIVES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor"})


def _severity(t: torch.Tensor) -> int:
    """0 finite, 1 -inf only (no NaN, no +inf), 2 NaN or +inf. One host read."""
    t = local_part(t)  # a DTensor (FSDP2): this rank's values, no collective
    if t.numel() == 0:
        return 0
    lo, hi = torch.aminmax(t.detach().reshape(-1).float() if t.dtype.itemsize < 2 else t)
    a, b = float(lo), float(hi)  # NaN propagates through aminmax
    if a != a or b != b or b == math.inf:
        return 2
    return 1 if a == -math.inf else 0


def _has_nan(t: torch.Tensor) -> bool:
    return bool(torch.isnan(t).any())


_OUT_ARGS: dict[Any, frozenset[str]] = {}


def _out_args(func: Any) -> frozenset[str]:
    """Names of ``func``'s ``out=`` arguments: buffers it writes, not inputs."""
    names = _OUT_ARGS.get(func)
    if names is None:
        schema = getattr(func, "_schema", None)
        args = getattr(schema, "arguments", ())
        names = _OUT_ARGS[func] = frozenset(a.name for a in args if getattr(a, "is_out", False))
    return names


def _storage(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


def _in_backward() -> bool:
    """Whether the autograd engine is running now (a node, a hook, a recomputation)."""
    if torch._C._current_autograd_node() is not None:
        return True
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and int(task()) != -1


# ----------------------------------------------------------------- module context
class _Context:
    """The module running now, the forward pass the step is in, whether the model has
    run in it, and the model's parameters (checked once, before it first runs) and
    inputs (checked on each call of the model that is not inside another).

    The model's modules get hooks of their own for the replay, a pre-hook before any
    of the user's and a forward hook after them, so what a user's hook computes
    counts as the module's; modules outside the model are seen by global hooks. With
    no model given, the first module called is the model.
    """

    def __init__(self, model: nn.Module | None) -> None:
        # A compiled model (torch.compile's wrapper) is named by the module it wraps.
        model = getattr(model, "_orig_mod", model)
        self.model = model
        self.names: dict[int, str] = {}
        self.own: set[int] = set()  # modules with hooks of their own
        self.handles: list[Any] = []
        self.stack: list[str | None] = []
        self.params_checked = False
        self.done = False  # the model has returned in this forward pass
        self.early: list[_Candidate] = []  # parameter and input births, found in pre-hooks
        self.notes: list[str] = []
        self.known: set[int] = set()  # storages of the model's parameters and buffers
        # Forward passes (micro-batches): one begins with the step and after each backward.
        self.forward_pass = 0
        self.backward_seen = False  # a backward ran since this forward pass began
        self.ran: list[bool] = [False]  # per pass: the model was called in it
        self.loss_bad: list[bool] = [False]  # per pass: its loss (see the module) non-finite
        if model is not None:
            self._adopt(model, with_root=True)

    def _adopt(self, model: nn.Module, *, with_root: bool) -> None:
        self.names = {id(m): n for n, m in model.named_modules()}
        self.known = {_storage(t) for t in (*model.parameters(), *model.buffers())}
        for m in model.modules():
            if m is model and not with_root:
                continue
            self.own.add(id(m))
            self.handles.append(
                m.register_forward_pre_hook(self.pre, with_kwargs=True, prepend=True)
            )
            self.handles.append(m.register_forward_hook(self.post, always_call=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def current(self) -> str | None:
        for name in reversed(self.stack):
            if name is not None:
                return name
        return None

    def forward_now(self) -> None:
        """A forward op or module call is about to run: after a backward, it begins the
        next forward pass (the next micro-batch), with the model not yet run in it."""
        if self.backward_seen:
            self.backward_seen = False
            self.forward_pass += 1
            self.done = False
            self.ran.append(False)
            self.loss_bad.append(False)

    def global_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if id(module) in self.own:
            return
        if self.model is None:
            self.model = module  # the first module called is the model
            self._adopt(module, with_root=False)
        self.pre(module, args, {})

    def global_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if id(module) not in self.own:
            self.post(module, args, output)

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        is_root = module is self.model and not any(n is not None for n in self.stack)
        if not _in_backward():  # (a checkpoint's recomputation runs inside the backward)
            self.forward_now()
            if is_root:
                self.ran[self.forward_pass] = True
                if not self.params_checked:
                    self.params_checked = True
                    self._check_params(module)
                param_bad = any(c.result.phase == "param" for c in self.early)
                seen = any(c.forward_pass == self.forward_pass for c in self.early)
                if not param_bad and not seen:
                    self._check_inputs(args, kwargs)
        self.stack.append(self.names.get(id(module)))

    def post(self, module: nn.Module, args: Any, *rest: Any) -> None:
        output = rest[-1]  # (output) from global hooks, (kwargs, output) would not occur
        name = self.stack.pop() if self.stack else None
        if name is not None and torch.is_grad_enabled():
            _tag(output, args, name)
        root = module is self.model and not any(n is not None for n in self.stack)
        if root and not _in_backward():
            self.done = True

    def _check_params(self, model: nn.Module) -> None:
        for name, p in model.named_parameters():
            if (p.is_floating_point() or p.is_complex()) and _severity(values_of(p)):
                owner, _, pname = name.rpartition(".")
                kind: Literal["nan", "inf"] = (
                    "nan" if bool(torch.isnan(values_of(p)).any()) else "inf"
                )
                st = tensor_stats(values_of(p))
                res = ReplayResult(
                    "parameter", "param", kind, None, [], [st], None, owner,
                    f"param:{pname}", tuple(p.shape),
                )  # fmt: skip
                self.early.append(_Candidate(res, False, False))
                return

    def _check_inputs(self, args: Any, kwargs: Any) -> None:
        leaves, _ = tree_flatten((args, kwargs))
        i = 0
        for x in leaves:
            if not isinstance(x, torch.Tensor) or not (x.is_floating_point() or x.is_complex()):
                continue
            sev = _severity(values_of(x))
            if sev == 2:
                kind: Literal["nan", "inf"] = (
                    "nan" if bool(torch.isnan(values_of(x)).any()) else "inf"
                )
                st = tensor_stats(values_of(x))
                res = ReplayResult(
                    "input", "input", kind, None, [], [st], None, "", f"input[{i}]",
                    tuple(x.shape),
                )  # fmt: skip
                self.early.append(_Candidate(res, False, False, forward_pass=self.forward_pass))
                return
            if sev == 1:
                self.notes.append(f"input[{i}] holds -inf (taken as an intended mask)")
            i += 1


def _grad_fns(obj: Any) -> list[Any]:
    leaves, _ = tree_flatten(obj)
    return [t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]


def _tag(outputs: Any, inputs: Any, name: str) -> None:
    """Tag the autograd nodes a module's call made with its name: those reachable from
    its outputs without passing its inputs' nodes or nodes already tagged (a child's,
    tagged when the child returned). Custom Functions' nodes are tagged too."""
    frontier = {id(n) for n in _grad_fns(inputs)}
    todo = _grad_fns(outputs)
    seen: set[int] = set()
    while todo:
        n = todo.pop()
        if id(n) in seen or id(n) in frontier:
            continue
        seen.add(id(n))
        meta = n.metadata
        if _TAG in meta or n.name() == "torch::autograd::AccumulateGrad":
            continue
        meta[_TAG] = name
        todo.extend(nxt for nxt, _ in n.next_functions if nxt is not None)


# ----------------------------------------------------------------- the dispatch mode
class _Births(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Collects the candidates, in execution order, with their module, phase and
    forward pass."""

    def __init__(self, ctx: _Context) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ctx = ctx
        self.candidates: list[_Candidate] = []
        self.made: set[int] = set()  # storages the step's ops wrote
        # Per forward pass: NaN/+inf data the step was given, and how many candidates
        # came before it.
        self.outside: dict[int, tuple[int, _Candidate]] = {}
        # Module constants (see the module), by identity: a dead one's id may be reused.
        self.constants: dict[int, weakref.ref[torch.Tensor]] = {}

    def _is_constant(self, t: torch.Tensor) -> bool:
        ref = self.constants.get(id(t))
        return ref is not None and ref() is t

    def _note_outputs(self, out: Any, *, lifted: bool) -> None:
        """Remember the memory the step's ops wrote (to tell it from data given to it);
        a constant an op other than its lift wrote in place is a constant no longer."""
        leaves, _ = tree_flatten(out)
        for t in leaves:
            if isinstance(t, torch.Tensor):
                self.made.add(_storage(t))
                if not lifted and self.constants and self._is_constant(t):
                    del self.constants[id(t)]

    def _note_loss(self, name: str, in_t: list[torch.Tensor], out_sev: list[int]) -> None:
        """A forward op's floating output computed from a floating tensor: the pass's
        loss, until a later one (see the module)."""
        if in_t and out_sev and name not in _NOT_A_LOSS:
            self.ctx.loss_bad[self.ctx.forward_pass] = any(out_sev)

    def _outside_data(
        self, func: Any, in_t: list[torch.Tensor], sevs: list[int], *, given: bool = False
    ) -> None:
        """NaN or +inf in a tensor no op of the step made (the batch, a loss weight the
        closure captured): born outside the step, in its data (phase "input"). Memory
        allocated before the replay cannot be reused by it while alive, so a storage
        the step's ops never wrote was given to it. ``given``: the tensors are data
        whatever their memory (Python values the step's code outside the model turned
        into a tensor). The first per forward pass."""
        k = self.ctx.forward_pass
        if k in self.outside:
            return
        for t, sev in zip(in_t, sevs, strict=True):
            if sev == 2 and (
                given or (_storage(t) not in self.made and _storage(t) not in self.ctx.known)
            ):
                kind: Literal["nan", "inf"] = "nan" if _has_nan(t) else "inf"
                module = self.ctx.current()
                phase: Phase = "input"
                res = ReplayResult(
                    "input", phase, kind, _user_frame(traceback.extract_stack()[:-2]),
                    [], [tensor_stats(t)], None, module if module is not None else "",
                    f"data into {func}", tuple(t.shape),
                )  # fmt: skip
                cand = _Candidate(res, False, False, (), k, (t,))
                self.outside[k] = (len(self.candidates), cand)
                return

    def _lift(self, func: Any, args: Any, kwargs: dict[str, Any], ins: Any) -> Any:
        """Python values becoming a tensor in the forward: inside a module of the model,
        a module constant (judged where it is used); elsewhere, the step's data."""
        out = func(*args, **kwargs)
        if self.ctx.current() is not None:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
                    self.constants[id(t)] = weakref.ref(t)
            return out
        in_t, _, _ = _floats((args, ins))
        sevs = [_severity(t) for t in in_t]
        if max(sevs, default=0) == 2:
            self._outside_data(func, in_t, sevs, given=True)
        return out

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        backward = _in_backward()
        if backward:
            self.ctx.backward_seen = True
        else:
            self.ctx.forward_now()
        out = self._dispatch(func, args, kwargs or {}, backward)
        self._note_outputs(out, lifted=getattr(func, "overloadpacket", None) in _LIFT_OPS)
        return out

    def _dispatch(self, func: Any, args: Any, kwargs: dict[str, Any], backward: bool) -> Any:
        if len(self.candidates) >= _MAX_CANDIDATES:
            return func(*args, **kwargs)
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        if name in _SKIP or getattr(func, "namespace", "") in _COLLECTIVES:
            # A collective brings other ranks' values: a NaN it delivers was born on
            # another rank, whose own replay names it (see floatguard.distributed).
            return func(*args, **kwargs)
        outs = _out_args(func)
        ins = {k: v for k, v in kwargs.items() if k not in outs} if outs else kwargs
        if name in _LIFTS and not backward:
            return self._lift(func, args, kwargs, ins)
        read = args[1:] if name in _OVERWRITES else args  # fill_ reads none of its self
        in_t, in_s, consts = _floats((read, ins), self._is_constant if self.constants else None)
        if name in _FILLS and (
            any(math.isinf(v) for v in in_s)
            or any(_severity(c) > 0 and not _has_nan(c) for c in consts)
        ):
            return func(*args, **kwargs)  # a mask filled with -inf: intended (NaN is not)
        sevs = [_severity(t) for t in in_t]  # (constants are judged like scalars: not here)
        level = max(sevs, default=0)
        node = torch._C._current_autograd_node()
        if level == 2:
            if not backward:
                self._outside_data(func, in_t, sevs)
            out = func(*args, **kwargs)  # NaN or +inf in: a consequence
            if not backward:
                self._note_loss(name, in_t, [_severity(t) for t in _floats(out)[0]])
            return out
        # before an in-place op changes them; constants after the other inputs
        stats_in = [tensor_stats(t) for t in (*in_t, *consts)]
        out = func(*args, **kwargs)
        out_t, _, _ = _floats(out)
        sev = [_severity(t) for t in out_t]
        if not backward:
            self._note_loss(name, in_t, sev)
        # Finite in: any non-finite out is born here. -inf in (a mask): only a NaN is
        # (the softmax of a fully masked row); -(-inf) = +inf is the mask's own value.
        if level == 0:
            bad = [t for t, s in zip(out_t, sev, strict=True) if s > 0]
        else:
            bad = [t for t, s in zip(out_t, sev, strict=True) if s == 2 and _has_nan(t)]
        if not bad:
            return out
        kind: Literal["nan", "inf"] = "nan" if any(_has_nan(t) for t in bad) else "inf"
        ninf_only = kind == "inf" and all(_severity(t) == 1 for t in bad)
        module: str | None
        if backward:
            phase: Phase = "backward"
            module = node.metadata.get(_TAG) if node is not None else None  # type: ignore[attr-defined]
            # Python code the engine runs (a hook, a custom Function's backward) is the
            # line to name; otherwise the forward line that made the node.
            source = _engine_frame(traceback.extract_stack()[:-1]) or _from_anomaly_trace(node)
            role = "grad"
        else:
            module = self.ctx.current()
            phase = "forward" if module is not None else ("loss" if self.ctx.done else "input")
            if phase == "loss":
                module = ""
            source = _user_frame(traceback.extract_stack()[:-1])
            role = "output" if phase != "loss" else "loss"
        res = ReplayResult(
            str(func), phase, kind, source, stats_in, [tensor_stats(t) for t in out_t],
            None, module, role, tuple(bad[0].shape),
        )  # fmt: skip
        storages = tuple(_storage(t) for t in bad)
        k = self.ctx.forward_pass
        self.candidates.append(_Candidate(res, backward, ninf_only, storages, k, tuple(bad)))
        return out


def _param_grad_hooks(
    model: nn.Module | None, births: _Births
) -> tuple[list[Any], dict[int, tuple[str, str]]]:
    """Hooks that tell which backward candidate became which parameter's gradient."""
    handles: list[Any] = []
    hits: dict[int, tuple[str, str]] = {}
    if model is None:
        return handles, hits
    seen: set[int] = set()
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))

            def hook(g: torch.Tensor, owner: str = mname, pn: str = pname) -> None:
                if g is None or g.layout != torch.strided:
                    return
                ptr = _storage(g)
                for i, c in enumerate(births.candidates):
                    if c.backward and ptr in c.storages and i not in hits:
                        hits[i] = (owner, pn)

            handles.append(p.register_hook(hook))
    return handles, hits


@contextlib.contextmanager
def _module_hooks(ctx: _Context) -> Iterator[None]:
    from torch.nn.modules import module as mod

    pre = mod.register_module_forward_pre_hook(ctx.global_pre)
    try:
        post = mod.register_module_forward_hook(ctx.global_post, always_call=True)
    except TypeError:  # torch without always_call for global hooks
        post = mod.register_module_forward_hook(ctx.global_post)
    try:
        yield
    finally:
        pre.remove()
        post.remove()
        ctx.remove()


@contextlib.contextmanager
def _eager() -> Iterator[None]:
    """Run compiled models eagerly, so every op passes through the modes."""
    stance = getattr(torch.compiler, "set_stance", None)
    if stance is None:
        from torch._dynamo import config as dynamo_config

        with dynamo_config.patch(disable=True):
            yield
        return
    with stance("force_eager"):
        yield


def _forward_birth(ctx: _Context, births: _Births, k: int) -> ReplayResult | None:
    """The birth in forward pass ``k`` taken alone: NaN/+inf in the model's inputs, data
    given to the step that held NaN/+inf before anything was born, the first candidate
    that is not ``-inf`` only, the first candidate; None if it has none."""
    for c in ctx.early:
        if c.forward_pass == k:
            return c.result
    fwd = [
        (i, c) for i, c in enumerate(births.candidates) if c.forward_pass == k and not c.backward
    ]
    if k in births.outside:
        at, data = births.outside[k]
        if not any(not c.ninf_only for i, c in fwd if i < at):
            return data.result  # bad data came in before anything was born
    strong = [c for _, c in fwd if not c.ninf_only]
    if strong:
        return strong[0].result
    return fwd[0][1].result if fwd else None


def _choose(
    ctx: _Context,
    births: _Births,
    hits: dict[int, tuple[str, str]],
    loss_bad: bool | None,
) -> ReplayResult | None:
    for c in ctx.early:
        if c.result.phase == "param":
            return c.result
    cands = births.candidates
    for i, (owner, pname) in hits.items():
        c = cands[i]
        c.result = replace(c.result, phase="param_grad", module=owner, tensor=f"param:{pname}")
    for c in cands:
        if c.forward_pass > 0 and not ctx.ran[c.forward_pass] and c.result.phase == "input":
            # after a backward, a pass that never called the model: the step's own code
            # after its backward (a mean of the losses), not a micro-batch's data
            c.result = replace(c.result, phase="loss", module="", tensor="loss")
    forward_harm = any(ctx.loss_bad) if loss_bad is None else loss_bad
    if forward_harm:
        flagged = [k for k, bad in enumerate(ctx.loss_bad) if bad]
        for k in flagged + [k for k in range(len(ctx.loss_bad)) if k not in flagged]:
            found = _forward_birth(ctx, births, k)
            if found is not None:
                return found
    elif ctx.early:
        return ctx.early[0].result
    if not cands:
        return None
    pool = [c for c in cands if c.backward != forward_harm] or cands
    strong = [c for c in pool if not c.ninf_only]
    return (strong or pool)[0].result


def _gradients_bad(model: nn.Module | None) -> bool:
    """Whether a gradient of ``model``'s parameters holds NaN or an inf (one host read)."""
    if model is None:
        return False
    grads = [values_of(p.grad) for p in model.parameters() if p.grad is not None]
    grads = [g for g in grads if g.numel() > 0]
    if not grads:
        return False
    dev = grads[0].device
    return not bool(torch.stack([g.isfinite().all().to(dev) for g in grads]).all())


def _run(
    step_fn: Callable[[], object],
    model: nn.Module | None,
    loss_of: Callable[[object], torch.Tensor | None] | None,
) -> tuple[ReplayResult | None, bool]:
    """One replay: the birth (or None), and whether the step was bad (its loss or a
    gradient of the model's parameters non-finite)."""
    ctx = _Context(model)
    births = _Births(ctx)
    handles, hits = _param_grad_hooks(model, births)
    result: object = None
    # Anomaly mode records each node's forward traceback, so backward ops can name
    # the user line that created them; check_nan=False keeps it from raising.
    with warnings.catch_warnings(), _context.replaying():
        warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when")
        try:
            with (
                _eager(),
                torch.autograd.detect_anomaly(check_nan=False),
                _module_hooks(ctx),
                births,
            ):
                result = step_fn()
        except Exception as exc:
            if not births.candidates and not ctx.early:
                raise
            # A step that stops on a non-finite loss is expected here: what it found counts.
            warnings.warn(
                f"replay: step_fn raised {type(exc).__name__}: {exc} after the first "
                "non-finite value was produced; returning where it was born",
                RuntimeWarning,
                stacklevel=3,  # replay()'s caller
            )
        finally:
            for h in handles:
                h.remove()
            ctx.remove()
    loss = loss_of(result) if loss_of is not None else None
    if loss is None and isinstance(result, torch.Tensor) and result.numel() == 1:
        loss = result
    loss_bad = None if loss is None else _severity(values_of(loss.detach())) > 0
    bad = (any(ctx.loss_bad) if loss_bad is None else loss_bad) or _gradients_bad(ctx.model)
    return _choose(ctx, births, hits, loss_bad), bad


def run_localized(
    step_fn: Callable[[], object],
    *,
    model: nn.Module | None = None,
    loss_of: Callable[[object], torch.Tensor | None] | None = None,
) -> ReplayResult | None:
    """One replay of ``step_fn`` with module context; the birth, or None.

    ``loss_of`` maps what ``step_fn`` returned to its loss (to tell forward harm from
    backward harm); without it, a returned scalar tensor is taken as the loss, and
    otherwise each forward pass's own loss is (see the module). ``step_fn`` may run
    several forward and backward passes (gradient accumulation): each is localized as
    if it ran alone, the first whose loss was non-finite first.

    This does not judge whether the step was bad (the guard replays bad steps only,
    and checks that the replay was bad again): a clean step's harmless non-finite
    values, such as a ``log(0)`` masked away, can be returned. :func:`replay` returns
    None for a clean step.
    """
    return _run(step_fn, model, loss_of)[0]


def replay(
    step_fn: Callable[[], object], *, repeat: int = 1, model: nn.Module | None = None
) -> ReplayResult | None:
    """Run ``step_fn`` (forward and backward) under a dispatch mode; return where its
    first harmful non-finite value was born (see the module's words), or None.

    ``model``: the module whose names and parameters to use (default: the first
    module ``step_fn`` calls). A parameter that is already non-finite is reported as
    phase "param" before anything runs. ``step_fn`` should only compute (no optimizer
    step); if it returns its loss (a one-element tensor), the loss tells forward harm
    from backward harm; it may run several forward and backward passes (gradient
    accumulation).

    A clean step returns None, whatever non-finite values it computed: a value that
    harms nothing is not a fault (an ``-inf`` mask, T5's ``log(0)`` in its
    relative-position buckets, a ``log`` whose ``-inf`` a ``where`` removes). The step
    is clean when its loss is finite (the returned one; without one, each forward
    pass's own loss, see the module) and so is every gradient of the model's
    parameters after ``step_fn`` (including gradients it found there: zero them
    first). With ``repeat=2`` (or more) the step runs again and ``deterministic`` says
    whether the same op at the same line was found every time (a run that was clean
    found nothing). A compiled model runs eagerly here. A step that raises after the
    birth (a NaN-loss check) returns the birth with a RuntimeWarning; before it, the
    exception propagates. Replays never advance a :class:`Monitor`'s steps.
    """
    if not callable(step_fn):
        raise TypeError(f"replay needs a callable, got {type(step_fn).__name__}")
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat={repeat!r} must be a positive int")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"replay(model=...) needs an nn.Module, got {type(model).__name__}")
    runs = [_run(step_fn, model, None) for _ in range(repeat)]
    results = [birth if bad else None for birth, bad in runs]
    first = results[0]
    if repeat == 1:
        return first
    found = [r for r in results if r is not None]
    if not found:
        return None
    same = len(found) == repeat and all(
        (r.op, r.source) == (found[0].op, found[0].source) for r in found
    )
    return replace(first if first is not None else found[0], deterministic=same)
