"""Module and phase context of a replay: global module hooks, forward passes, node tagging."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from floatguard._values import values_of
from floatguard.monitor._replay_result import ReplayResult, _Candidate
from floatguard.monitor._replay_values import _severity, _storage
from floatguard.monitor._stats_read import stats_of

# The key, in an autograd node's metadata, of the module whose call made the node.
_MODULE_TAG = "floatguard_module"


def _in_backward() -> bool:
    """Whether the autograd engine is running now (a node, a hook, a recomputation)."""
    if torch._C._current_autograd_node() is not None:
        return True
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and int(task()) != -1


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
        # per pass: the first model input holding -inf (an intended mask, unless nothing
        # else explains a bad loss: then it is the data's, see _births._forward_birth)
        self.ninf_inputs: dict[int, _Candidate] = {}
        self.known: set[int] = set()  # storages of the model's parameters and buffers
        # storages a collective wrote in this replay: other ranks' values, no input data
        self.delivered: set[int] = set()
        # Forward passes (micro-batches): one begins with the step and after each backward.
        self.forward_pass = 0
        self.backward_seen = False  # a backward ran since this forward pass began
        self.ran: list[bool] = [False]  # per pass: the model was called in it
        self.loss_bad: list[bool] = [False]  # per pass: its loss (see replay.py) non-finite
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
                res = _already_there(p, op="parameter", module=owner, tensor=f"param:{pname}")
                self.early.append(_Candidate(res, False, False, held=(p,)))
                return

    def _check_inputs(self, args: Any, kwargs: Any) -> None:
        leaves, _ = tree_flatten((args, kwargs))
        i = 0
        for x in leaves:
            if not isinstance(x, torch.Tensor) or not (x.is_floating_point() or x.is_complex()):
                continue
            if self.delivered and _storage(x) in self.delivered:
                i += 1  # a collective's output: born on a rank whose replay names it
                continue
            sev = _severity(values_of(x))
            if sev == 2:
                res = _already_there(x, op="input", module="", tensor=f"input[{i}]")
                self.early.append(
                    _Candidate(res, False, False, forward_pass=self.forward_pass, held=(x,))
                )
                return
            if sev == 1:
                self.notes.append(f"input[{i}] holds -inf (taken as an intended mask)")
                if self.forward_pass not in self.ninf_inputs:
                    res = _already_there(x, op="input", module="", tensor=f"input[{i}]")
                    cand = _Candidate(res, False, True, forward_pass=self.forward_pass, held=(x,))
                    self.ninf_inputs[self.forward_pass] = cand
            i += 1


def _grad_fns(obj: Any) -> list[Any]:
    leaves, _ = tree_flatten(obj)
    return [t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]


def _tag(outputs: Any, inputs: Any, name: str) -> None:
    """Tag the autograd nodes a module's call made with its name: those reachable from
    its outputs without passing its inputs' nodes. A node already tagged by one of its
    own children (tagged when the child returned) keeps its tag and is walked through,
    to the module's own ops between its children; one tagged by any other module (a
    value made before the call, not passed as an argument) ends the walk there. Custom
    Functions' nodes are tagged too."""
    frontier = {id(n) for n in _grad_fns(inputs)}
    todo = _grad_fns(outputs)
    seen: set[int] = set()
    inside = name + "." if name else ""
    while todo:
        n = todo.pop()
        if id(n) in seen or id(n) in frontier:
            continue
        seen.add(id(n))
        meta = n.metadata
        if n.name() == "torch::autograd::AccumulateGrad":
            continue
        tag = meta.get(_MODULE_TAG)
        if tag is None:
            meta[_MODULE_TAG] = name
        elif tag == name or not str(tag).startswith(inside):
            continue
        todo.extend(nxt for nxt, _ in n.next_functions if nxt is not None)


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


def _already_there(
    t: torch.Tensor, *, op: Literal["parameter", "input"], module: str, tensor: str
) -> ReplayResult:
    """A non-finite value that was there when the model ran (a parameter, the model's
    input): no op made it. ``kind`` "nan" when it holds a NaN, else "inf"."""
    values = values_of(t)
    return ReplayResult(
        op=op,
        phase="param" if op == "parameter" else "input",
        kind="nan" if bool(torch.isnan(values).any()) else "inf",
        source=None,
        inputs=[],
        outputs=[stats_of(values)],
        deterministic=None,
        module=module,
        tensor=tensor,
        shape=tuple(t.shape),
    )
