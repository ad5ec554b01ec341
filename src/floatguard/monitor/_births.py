"""Finding a step's births: the dispatch mode that collects candidates, and the choice."""

from __future__ import annotations

import math
import traceback
import weakref
from dataclasses import replace
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from floatguard.monitor._replay_context import _MODULE_TAG, _Context, _in_backward
from floatguard.monitor._replay_result import ReplayResult, _Candidate
from floatguard.monitor._replay_values import _float_operands, _has_nan, _severity, _storage
from floatguard.monitor._sources import _engine_frame, _from_anomaly_trace, _user_frame
from floatguard.monitor._stats_read import stats_of
from floatguard.monitor.localize import Phase
from floatguard.repro.tape import Mark, TapeRecorder

# Uninitialised memory may hold anything: never blame these.
_SKIP = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "set_")
# Ops whose infinite *scalar* argument is the point (masks filled with -inf): their
# non-finite output is intended. A NaN scalar (x * nan, a fill with NaN) is a fault.
_FILLS = (
    "fill", "fill_", "masked_fill", "masked_fill_", "full", "full_like", "new_full",
    "scalar_tensor", "where", "index_fill", "index_fill_", "clamp", "clamp_",
)  # fmt: skip
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
_COLLECTIVES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor"})
# A collective's arguments whose values it reads (its output buffers are not inputs);
# a broadcast reads only the root's, and the wait for a collective reads nothing.
_READ_ARGS = frozenset({"input", "tensors", "input_tensor", "input_tensors", "inputs"})
_NOT_READ = frozenset({"broadcast", "broadcast_", "wait_tensor", "_wrap_tensor_autograd"})

_OUT_ARGS: dict[Any, frozenset[str]] = {}


def _out_args(func: Any) -> frozenset[str]:
    """Names of ``func``'s ``out=`` arguments: buffers it writes, not inputs."""
    names = _OUT_ARGS.get(func)
    if names is None:
        schema = getattr(func, "_schema", None)
        args = getattr(schema, "arguments", ())
        names = _OUT_ARGS[func] = frozenset(a.name for a in args if getattr(a, "is_out", False))
    return names


# ----------------------------------------------------------------- the dispatch mode
class _Births(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Collects the candidates, in execution order, with their module, phase and
    forward pass."""

    def __init__(self, ctx: _Context, tape: TapeRecorder | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ctx = ctx
        self.tape = tape  # a repro bundle's recording (see floatguard.repro.tape)
        self.seq = 0  # ops dispatched so far in this replay
        # How many times each (op, module, backward, forward pass) ran: a birth's mark,
        # stable across replays where code runs more ops on a first call (a cache).
        self._counts: dict[tuple[str, str | None, bool, int], int] = {}
        self.mark: Mark = ("", None, False, 0, 0)
        self.candidates: list[_Candidate] = []
        self.made: set[int] = set()  # storages the step's ops wrote
        # Per forward pass: NaN/+inf data the step was given, and how many candidates
        # came before it.
        self.outside: dict[int, tuple[int, _Candidate]] = {}
        # Module constants (see replay.py), by identity: a dead one's id may be reused.
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
        loss, until a later one (see replay.py)."""
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
            mem = _storage(t)
            made = mem in self.made or mem in self.ctx.known or mem in self.ctx.delivered
            if sev == 2 and (given or not made):
                kind: Literal["nan", "inf"] = "nan" if _has_nan(t) else "inf"
                module = self.ctx.current()
                phase: Phase = "input"
                res = ReplayResult(
                    op="input",
                    phase=phase,
                    kind=kind,
                    source=_user_frame(traceback.extract_stack()[:-2]),
                    inputs=[],
                    outputs=[stats_of(t)],
                    deterministic=None,
                    module=module if module is not None else "",
                    tensor=f"data into {func}",
                    shape=tuple(t.shape),
                )
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
        in_t, _, _ = _float_operands((args, ins))
        sevs = [_severity(t) for t in in_t]
        if max(sevs, default=0) == 2:
            self._outside_data(func, in_t, sevs, given=True)
        return out

    def _collective(
        self, func: Any, name: str, args: Any, kwargs: dict[str, Any], backward: bool
    ) -> Any:
        """A collective brings other ranks' values: a NaN it delivers was born on another
        rank, whose own replay names it (see floatguard.distributed), so its outputs are
        neither births nor the step's data, nor (unless a broadcast's, the root's data
        as it is) the model's input data. What it reads that no op made is data."""
        if not backward and name not in _NOT_READ:
            schema = getattr(func, "_schema", None)
            names = [a.name for a in getattr(schema, "arguments", ())]
            read = [v for n, v in zip(names, args, strict=False) if n in _READ_ARGS]
            read += [v for n, v in kwargs.items() if n in _READ_ARGS]
            in_t, _, _ = _float_operands(read)
            sevs = [_severity(t) for t in in_t]
            if max(sevs, default=0) == 2:
                self._outside_data(func, in_t, sevs)
        out = func(*args, **kwargs)
        if "broadcast" not in name:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.ctx.delivered.add(_storage(t))
        return out

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        backward = _in_backward()
        if backward:
            self.ctx.backward_seen = True
        else:
            self.ctx.forward_now()
        self.seq += 1
        scope = self._module_now(backward)
        key = (str(func), scope, backward, self.ctx.forward_pass)
        n = self._counts[key] = self._counts.get(key, -1) + 1
        self.mark = (*key, n)
        rec = None
        if self.tape is not None:
            rec = self.tape.before(
                self.seq, self.mark, func, args, kwargs or {}, scope, backward,
                self.ctx.forward_pass,
            )  # fmt: skip
        out = self._dispatch(func, args, kwargs or {}, backward)
        if rec is not None:
            assert self.tape is not None
            self.tape.after(rec, out, args, None)
        if not getattr(func, "is_view", False):  # a view writes nothing: its base stays
            self._note_outputs(out, lifted=getattr(func, "overloadpacket", None) in _LIFT_OPS)
        return out

    def _module_now(self, backward: bool) -> str | None:
        """The module an op runs in as the replay sees it: the tag of the autograd node
        running (backward), else the innermost named module running."""
        if backward:
            node = torch._C._current_autograd_node()
            return node.metadata.get(_MODULE_TAG) if node is not None else None  # type: ignore[attr-defined, no-any-return]
        return self.ctx.current()

    def _dispatch(self, func: Any, args: Any, kwargs: dict[str, Any], backward: bool) -> Any:
        if len(self.candidates) >= _MAX_CANDIDATES:
            return func(*args, **kwargs)
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        if getattr(func, "namespace", "") in _COLLECTIVES:
            return self._collective(func, name, args, kwargs, backward)
        if name in _SKIP:
            return func(*args, **kwargs)
        outs = _out_args(func)
        ins = {k: v for k, v in kwargs.items() if k not in outs} if outs else kwargs
        if name in _LIFTS and not backward:
            return self._lift(func, args, kwargs, ins)
        read = args[1:] if name in _OVERWRITES else args  # fill_ reads none of its self
        in_t, in_s, consts = _float_operands(
            (read, ins), self._is_constant if self.constants else None
        )
        if name in _FILLS and (
            any(math.isinf(v) for v in in_s)
            or any(_severity(c) > 0 and not _has_nan(c) for c in consts)
        ):
            return func(*args, **kwargs)  # a mask filled with -inf: intended (NaN is not)
        sevs = [_severity(t) for t in in_t]  # (constants are judged like scalars: not here)
        level = max(sevs, default=0)
        node = torch._C._current_autograd_node()
        if level == 2:
            # A view reads no value: a view of memory no op wrote yet (FSDP2's all-gather
            # outputs, viewed before the copy into them) is no data of the step.
            if not backward and not getattr(func, "is_view", False):
                self._outside_data(func, in_t, sevs)
            out = func(*args, **kwargs)  # NaN or +inf in: a consequence
            if not backward:
                self._note_loss(name, in_t, [_severity(t) for t in _float_operands(out)[0]])
            return out
        # before an in-place op changes them; constants after the other inputs
        stats_in = [stats_of(t) for t in (*in_t, *consts)]
        out = func(*args, **kwargs)
        out_t, _, _ = _float_operands(out)
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
            module = node.metadata.get(_MODULE_TAG) if node is not None else None  # type: ignore[attr-defined]
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
            op=str(func),
            phase=phase,
            kind=kind,
            source=source,
            inputs=stats_in,
            outputs=[stats_of(t) for t in out_t],
            deterministic=None,
            module=module,
            tensor=role,
            shape=tuple(bad[0].shape),
        )
        storages = tuple(_storage(t) for t in bad)
        k = self.ctx.forward_pass
        self.candidates.append(
            _Candidate(res, backward, ninf_only, storages, k, tuple(bad), self.mark, self.mark[1])
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


def _forward_birth(ctx: _Context, births: _Births, k: int) -> ReplayResult | None:
    """The birth in forward pass ``k`` taken alone: NaN/+inf in the model's inputs, data
    given to the step that held NaN/+inf before anything was born, the first candidate
    that is not ``-inf`` only, the first candidate, a ``-inf`` in the model's inputs
    when nothing else was born; None if it has none."""
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
    if fwd:
        return fwd[0][1].result
    # Nothing was born in this pass, yet its loss went bad: the -inf the model was given
    # (taken as a mask while anything else could explain the harm) is the data's fault.
    ninf = ctx.ninf_inputs.get(k)
    return ninf.result if ninf is not None else None


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
        # Nothing was born anywhere: a -inf the model was given is the data's fault.
        ninf = [ctx.ninf_inputs[k] for k in sorted(ctx.ninf_inputs)]
        return ninf[0].result if ninf else None
    pool = [c for c in cands if c.backward != forward_harm] or cands
    strong = [c for c in pool if not c.ninf_only]
    return (strong or pool)[0].result
