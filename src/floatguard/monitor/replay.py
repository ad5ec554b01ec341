"""Op-level replay: re-run a step under a dispatch mode and name where its first harmful
non-finite value was born: module, phase, aten op and the user's line.

Words used here:

- *candidate*: an op whose floating inputs were free of NaN and +inf and whose output
  holds a NaN, or whose inputs were all finite and whose output holds an inf. Inputs
  are judged before the op runs (an in-place op overwrites them); ``out=`` buffers are
  not inputs; a sparse tensor is judged by the dense tensor it stands for.
- *intended infinity*: ``-inf`` that is data, not a fault: a mask filled with
  ``-inf`` (fill-type ops given an infinite scalar are never candidates), log-space
  padding, ``-inf`` in the model's inputs. An op whose only non-finite outputs are
  ``-inf`` is a candidate of the last resort (``log(0)`` masked by a ``where`` is
  intended; ``log(0)`` that reaches the loss is not).
- *harm*: what made the step bad. A non-finite loss points into the forward pass
  (the model's inputs, its parameters, its modules, the loss code); a finite loss with
  non-finite gradients points into the backward pass.
- *birth*: the candidate reported. In order: a non-finite parameter (phase "param");
  NaN or +inf in the model's inputs ("input"); the first candidate of the pass the
  harm points to that is not ``-inf`` only; the first candidate of that pass; the
  first candidate at all.

Module context comes from global module hooks, which also tag each autograd node
with the module whose call created it (so a backward op names its module). The
phase of a forward op is "forward" inside a module of the model, "input" before the
model ran, "loss" after it. A backward op whose non-finite output becomes a
parameter's gradient is "param_grad". Backward ops name the forward line that made
their node (anomaly mode's traceback). Every op's inputs are read on the host: this
costs nothing until a step goes bad, and then a few steps' time.
"""

from __future__ import annotations

import contextlib
import math
import os
import traceback
import warnings
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
def _floats(obj: Any) -> tuple[list[torch.Tensor], list[float]]:
    leaves, _ = tree_flatten(obj)
    tensors = [
        values_of(x)
        for x in leaves
        if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())
    ]
    scalars = [float(x) for x in leaves if isinstance(x, float)]
    return tensors, scalars


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


# ----------------------------------------------------------------- module context
class _Context:
    """The module running now, whether the model has run, and the model's parameters
    and inputs (checked once, before it first runs).

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
        self.started = False
        self.done = False
        self.early: list[_Candidate] = []  # parameter and input births, found in pre-hooks
        self.notes: list[str] = []
        self.known: set[int] = set()  # storages of the model's parameters and buffers
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
        if is_root and not self.started:
            self.started = True
            self._check_params(module)
            if not self.early:
                self._check_inputs(args, kwargs)
        self.stack.append(self.names.get(id(module)))

    def post(self, module: nn.Module, args: Any, *rest: Any) -> None:
        output = rest[-1]  # (output) from global hooks, (kwargs, output) would not occur
        name = self.stack.pop() if self.stack else None
        if name is not None and torch.is_grad_enabled():
            _tag(output, args, name)
        if module is self.model and not any(n is not None for n in self.stack):
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
                self.early.append(_Candidate(res, False, False))
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
    """Collects the candidates, in execution order, with their module and phase."""

    def __init__(self, ctx: _Context) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ctx = ctx
        self.candidates: list[_Candidate] = []
        self.made: set[int] = set()  # storages the step's ops wrote
        self.outside: _Candidate | None = None  # NaN/+inf data the step was given
        self.outside_at = 0  # how many candidates came before it
        self.backward_started = False
        self.last_forward_bad = False

    def _note_outputs(self, out: Any) -> None:
        """Remember the memory the step's ops wrote (to tell it from data given to it)."""
        leaves, _ = tree_flatten(out)
        for t in leaves:
            if isinstance(t, torch.Tensor):
                self.made.add(_storage(t))

    def _outside_data(self, func: Any, in_t: list[torch.Tensor], sevs: list[int]) -> None:
        """NaN or +inf in a tensor no op of the step made (the batch, a loss weight the
        closure captured): born outside the step, in its data (phase "input"). Memory
        allocated before the replay cannot be reused by it while alive, so a storage
        the step's ops never wrote was given to it."""
        if self.outside is not None:
            return
        for t, sev in zip(in_t, sevs, strict=True):
            if sev == 2 and _storage(t) not in self.made and _storage(t) not in self.ctx.known:
                kind: Literal["nan", "inf"] = "nan" if _has_nan(t) else "inf"
                module = self.ctx.current()
                phase: Phase = "input"
                res = ReplayResult(
                    "input", phase, kind, _user_frame(traceback.extract_stack()[:-2]),
                    [], [tensor_stats(t)], None, module if module is not None else "",
                    f"data into {func}", tuple(t.shape),
                )  # fmt: skip
                self.outside = _Candidate(res, False, False, (), (t,))
                self.outside_at = len(self.candidates)
                return

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = self._dispatch(func, args, kwargs or {})
        self._note_outputs(out)
        return out

    def _dispatch(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        if len(self.candidates) >= _MAX_CANDIDATES:
            return func(*args, **kwargs)
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        if name in _SKIP or getattr(func, "namespace", "") in _COLLECTIVES:
            # A collective brings other ranks' values: a NaN it delivers was born on
            # another rank, whose own replay names it (see floatguard.distributed).
            return func(*args, **kwargs)
        outs = _out_args(func)
        ins = {k: v for k, v in kwargs.items() if k not in outs} if outs else kwargs
        in_t, in_s = _floats((args, ins))
        if name in _FILLS and any(math.isinf(v) for v in in_s):
            return func(*args, **kwargs)  # a mask filled with -inf: intended (NaN is not)
        sevs = [_severity(t) for t in in_t]
        level = max(sevs, default=0)
        node = torch._C._current_autograd_node()
        if node is not None:
            self.backward_started = True
        forward = node is None and not self.backward_started
        if level == 2:
            if forward:
                self._outside_data(func, in_t, sevs)
            out = func(*args, **kwargs)  # NaN or +inf in: a consequence
            if forward:
                self.last_forward_bad = True
            return out
        stats_in = [tensor_stats(t) for t in in_t]  # before an in-place op changes them
        out = func(*args, **kwargs)
        out_t, _ = _floats(out)
        sev = [_severity(t) for t in out_t]
        if forward:
            self.last_forward_bad = any(sev)
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
        if node is not None:
            phase: Phase = "backward"
            module = node.metadata.get(_TAG)  # type: ignore[attr-defined]
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
        self.candidates.append(
            _Candidate(
                res, node is not None, ninf_only, tuple(_storage(t) for t in bad), tuple(bad)
            )
        )
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


def _choose(
    ctx: _Context,
    births: _Births,
    hits: dict[int, tuple[str, str]],
    loss_bad: bool | None,
) -> ReplayResult | None:
    if ctx.early:
        return ctx.early[0].result
    forward_harm = births.last_forward_bad if loss_bad is None else loss_bad
    before = births.candidates[: births.outside_at] if births.outside is not None else []
    if births.outside is not None and forward_harm and not any(not c.ninf_only for c in before):
        return births.outside.result  # bad data came in before anything was born
    cands = list(births.candidates)
    for i, (owner, pname) in hits.items():
        c = cands[i]
        c.result = replace(c.result, phase="param_grad", module=owner, tensor=f"param:{pname}")
    if not cands:
        return None
    pool = [c for c in cands if c.backward != forward_harm] or cands
    strong = [c for c in pool if not c.ninf_only]
    return (strong or pool)[0].result


def run_localized(
    step_fn: Callable[[], object],
    *,
    model: nn.Module | None = None,
    loss_of: Callable[[object], torch.Tensor | None] | None = None,
) -> ReplayResult | None:
    """One replay of ``step_fn`` with module context; the birth, or None.

    ``loss_of`` maps what ``step_fn`` returned to its loss (to tell forward harm from
    backward harm); without it, a returned scalar tensor is taken as the loss, and
    otherwise the last forward op's output before the backward is.
    """
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
                stacklevel=3,
            )
        finally:
            for h in handles:
                h.remove()
            ctx.remove()
    loss = loss_of(result) if loss_of is not None else None
    if loss is None and isinstance(result, torch.Tensor) and result.numel() == 1:
        loss = result
    loss_bad = None if loss is None else _severity(values_of(loss.detach())) > 0
    return _choose(ctx, births, hits, loss_bad)


def replay(
    step_fn: Callable[[], object], *, repeat: int = 1, model: nn.Module | None = None
) -> ReplayResult | None:
    """Run ``step_fn`` (forward and backward) under a dispatch mode; return where its
    first harmful non-finite value was born (see the module's words), or None.

    ``model``: the module whose names and parameters to use (default: the first
    module ``step_fn`` calls). A parameter that is already non-finite is reported as
    phase "param" before anything runs. ``-inf`` masks are intended: a replay of a
    clean step returns None whatever its masks hold. With ``repeat=2`` (or more) the
    step runs again and ``deterministic`` says whether the same op at the same line
    was found every time. ``step_fn`` should only compute (no optimizer step); if it
    returns its loss, the loss tells forward harm from backward harm. A compiled
    model runs eagerly here. A step that raises after the birth (a NaN-loss check)
    returns the birth with a RuntimeWarning; before it, the exception propagates.
    Replays never advance a :class:`Monitor`'s steps.
    """
    if not callable(step_fn):
        raise TypeError(f"replay needs a callable, got {type(step_fn).__name__}")
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat={repeat!r} must be a positive int")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"replay(model=...) needs an nn.Module, got {type(model).__name__}")
    results = [run_localized(step_fn, model=model) for _ in range(repeat)]
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
