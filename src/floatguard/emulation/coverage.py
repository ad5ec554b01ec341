"""The GEMM coverage audit: which GEMM FLOPs of a training step ran on emulated operands.

``coverage(model, batch, recipe)`` runs one forward and backward under a
``TorchDispatchMode`` and counts every GEMM-like aten op that reaches the dispatcher,
with its FLOPs, the module it ran in and whether it ran inside
:func:`~floatguard.emulation._gemm_tag.emulated_gemm` (the emulated GEMMs of
:mod:`floatguard.emulation._gemm` run every matmul on quantized operands there). So
"GEMM FLOPs emulated" is what ran, not what ``emulate()`` swapped: an LSTM, an eager
``torch.matmul`` attention, an ``nn.MultiheadAttention(need_weights=True)`` (which calls
no SDPA) or a layer its parent applies with ``F.linear(x, child.weight)`` show up as
FLOPs left in high precision.

Words used here:

- *GEMM-like op*: an aten op in :data:`~floatguard.emulation._gemm_flops.GEMM_OPS`
  (matrix and matrix-vector products, convolutions and their backward, SDPA kernels and
  their backward, mkldnn's RNN layer and its backward, the bilinear ``_trilinear``),
  with its FLOPs (``2 * M * N * K`` per product, ``torch.utils.flop_counter``'s
  formulas; see that module). Composite ops (``linear``, ``matmul``, ``einsum``, a GRU
  on CPU, SDPA's math backend) never reach the dispatcher: the ``mm``/``bmm``/``addmm``
  they decompose into are counted. An op whose name looks like a GEMM (``mm``,
  ``conv``, ``attention``, ``rnn``, ...) but is not in the table is reported in
  ``unmeasured``, never silently dropped.
- *emulated*: the op ran inside ``emulated_gemm()``, read with ``is_emulating()`` when
  it reaches the dispatcher.
- *module*: the innermost module whose forward was running (forward ops), or whose
  forward made the autograd node now running (backward ops: the nodes a module's
  forward made are tagged when it returns). ``""`` is the root; :data:`OUTSIDE` are ops
  outside every module (a loss computed after the model returned).

Reading order: :class:`_ModuleTracker`, :class:`_GemmCounter` (the dispatch mode),
:func:`coverage`, :class:`GemmCoverage`.

``floatguard.emulation.coverage`` is the function (the package re-exports it over this
module's name): import this module's other names with ``from floatguard.emulation.coverage
import GemmCoverage``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from floatguard.batch_loss import batch_loss, check_loss_fn
from floatguard.emulation._emulate import emulate, is_emulated, restore
from floatguard.emulation._gemm_flops import GEMM_OPS, looks_like_gemm
from floatguard.emulation._gemm_tag import is_emulating
from floatguard.emulation.emulation_recipe import EmulationRecipe

__all__ = ["OUTSIDE", "Flops", "GemmCoverage", "GemmRecord", "Phase", "coverage"]

Phase = Literal["forward", "backward"]

OUTSIDE = "(outside the model)"
"""The module name of GEMMs that ran outside every module of the model."""

# ---------------------------------------------------------------- module attribution


def _grad_fns(tree: Any) -> list[Any]:
    """The autograd nodes that made the tensors in a nested structure."""
    leaves = pytree.tree_leaves(tree)
    return [t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]


_TAG = "floatguard_gemm_coverage"  # the key, in a node's metadata: (module, epoch)


class _ModuleTracker:
    """Which module an op runs in: a stack of module names during the forward; during the
    backward, the module whose forward made the autograd node now running
    (``torch._C._current_autograd_node()``, as :mod:`floatguard.monitor` reads it).

    When a module's forward returns, the nodes between its outputs and its inputs that no
    inner module claimed are tagged with its name (innermost first: an inner module's
    forward returns before its parent's; the walk goes on through an inner module's nodes
    to the parent's own before it). Nodes made before the module ran (an earlier
    module's) bound the walk. A tensor reaching a module neither as an argument nor as a
    parameter (a captured one its parent computed) can pull the parent's untagged nodes
    into the module: then those backward FLOPs are attributed to it."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {m: n for n, m in model.named_modules()}
        # (name, epoch at entry, the inputs' nodes (kept alive: their ids bound the walk))
        self.stack: list[tuple[str, int, list[Any]]] = []
        self.epoch = 0
        self.handles = []
        for module in self.names:
            self.handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
            self.handles.append(
                module.register_forward_hook(self._exit, with_kwargs=True, always_call=True)
            )

    def forward_module(self) -> str:
        return self.stack[-1][0] if self.stack else OUTSIDE

    @staticmethod
    def backward_module() -> str:
        node: Any = torch._C._current_autograd_node()
        tag = None if node is None else node.metadata.get(_TAG)
        return OUTSIDE if tag is None else str(tag[0])

    def _enter(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self.stack.append((self.names[module], self.epoch, _grad_fns((args, kwargs))))

    def _exit(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        name, start, inputs = self.stack.pop()
        self.epoch += 1
        frontier = {id(n) for n in inputs}
        todo, seen = _grad_fns(output), set()
        while todo:
            node = todo.pop()
            if id(node) in seen or id(node) in frontier:
                continue
            seen.add(id(node))
            if node.name() == "torch::autograd::AccumulateGrad":
                continue  # a leaf: no GEMM runs in it
            meta = node.metadata
            claimed = meta.get(_TAG)
            if claimed is None:
                meta[_TAG] = (name, self.epoch)
            elif claimed[1] <= start:
                continue  # made before this module's forward began
            todo.extend(n for n, _ in node.next_functions if n is not None)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class _GemmCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the GEMM-like ops that reach the dispatcher: FLOPs and calls per (module,
    op, phase, emulated); asks :func:`is_emulating` at dispatch time. Reads shapes only
    (no sync)."""

    def __init__(self, tracker: _ModuleTracker) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.tracker = tracker
        self.phase: Phase = "forward"
        self.counts: dict[tuple[str, str, Phase, bool], list[int]] = {}
        self.unmeasured: dict[str, int] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        formula = GEMM_OPS.get(packet)
        if formula is None:
            if looks_like_gemm(packet.__name__):
                name = f"aten.{packet.__name__}"
                self.unmeasured[name] = self.unmeasured.get(name, 0) + 1
            return out
        if self.phase == "forward":
            module = self.tracker.forward_module()
        else:
            module = self.tracker.backward_module()
        key = (module, f"aten.{packet.__name__}", self.phase, is_emulating())
        slot = self.counts.setdefault(key, [0, 0])
        slot[0] += 1
        slot[1] += formula(args, kwargs, out)
        return out


# ---------------------------------------------------------------- the result


@dataclass(frozen=True)
class Flops:
    """GEMM FLOPs, of which ``emulated`` ran on emulated operands."""

    emulated: int
    total: int

    @property
    def left(self) -> int:
        """The FLOPs that ran in high precision."""
        return self.total - self.emulated

    @property
    def share(self) -> float:
        """``emulated / total``; NaN when no GEMM ran (0 / 0 is no coverage figure)."""
        return self.emulated / self.total if self.total else math.nan

    def __add__(self, other: Flops) -> Flops:
        return Flops(self.emulated + other.emulated, self.total + other.total)


@dataclass(frozen=True)
class GemmRecord:
    """The GEMM-like calls of one op in one module and phase, emulated or not."""

    module: str
    """Module path (``""`` the root, :data:`OUTSIDE` outside every module)."""
    op: str
    """The aten op, e.g. ``"aten.mm"``."""
    phase: Phase
    emulated: bool
    """Whether the op ran inside ``emulated_gemm()`` (on emulated operands)."""
    calls: int
    flops: int

    def counted(self) -> Flops:
        """These FLOPs, as emulated or not."""
        return Flops(self.flops if self.emulated else 0, self.flops)


@dataclass(frozen=True)
class GemmCoverage:
    """What :func:`coverage` counted: one record per (module, op, phase, emulated)."""

    records: tuple[GemmRecord, ...]
    backward: bool
    """Whether a backward ran (else the forward's GEMMs only)."""
    recipe: str | None = None
    """The recipe the audited copy was emulated with; None: the model as given."""
    unmeasured: tuple[tuple[str, int], ...] = ()
    """(op, calls) of GEMM-like ops the audit has no FLOP formula for: not in the totals."""

    def _group(self, key: Callable[[GemmRecord], str]) -> dict[str, Flops]:
        out: dict[str, Flops] = {}
        for r in self.records:
            out[key(r)] = out.get(key(r), Flops(0, 0)) + r.counted()
        return out

    @property
    def flops(self) -> Flops:
        """All GEMM FLOPs counted, and the emulated ones."""
        return sum((r.counted() for r in self.records), Flops(0, 0))

    @property
    def total_flops(self) -> int:
        return self.flops.total

    @property
    def emulated_flops(self) -> int:
        return self.flops.emulated

    @property
    def share(self) -> float:
        """The share of GEMM FLOPs that ran on emulated operands (NaN: no GEMM ran)."""
        return self.flops.share

    def by_module(self) -> dict[str, Flops]:
        """Per module path, in the order the modules first ran a GEMM."""
        return self._group(lambda r: r.module)

    def by_op(self) -> dict[str, Flops]:
        """Per aten op."""
        return self._group(lambda r: r.op)

    def by_phase(self) -> dict[str, Flops]:
        """``forward`` and ``backward``."""
        return self._group(lambda r: r.phase)

    def left(self) -> dict[str, int]:
        """Per module, the GEMM FLOPs that ran in high precision (modules with none left
        are not listed), largest first."""
        left = {m: f.left for m, f in self.by_module().items() if f.left}
        return dict(sorted(left.items(), key=lambda kv: -kv[1]))

    def summary(self, top: int = 4) -> str:
        """One line: the share, the totals, the largest high-precision modules."""
        f = self.flops
        what = "forward + backward" if self.backward else "forward only"
        if f.total == 0:
            line = f"no GEMM FLOPs counted ({what})"
        else:
            line = (
                f"GEMM FLOPs emulated: {f.share:.1%} ({_si(f.emulated)} of {_si(f.total)}, {what})"
            )
            left = self.left()
            if left:
                ops = self._left_ops()
                shown = [f"{_name(m)} {v / f.total:.1%} ({', '.join(ops[m])})"
                         for m, v in list(left.items())[:top]]  # fmt: skip
                more = f", {len(left) - top} more" if len(left) > top else ""
                line += "; in high precision: " + ", ".join(shown) + more
        if self.unmeasured:
            line += "; not counted (no FLOP formula): " + ", ".join(
                f"{op} x{n}" for op, n in self.unmeasured
            )
        return line

    def _left_ops(self) -> dict[str, list[str]]:
        ops: dict[str, list[str]] = {}
        for r in self.records:
            if not r.emulated and r.op not in ops.setdefault(r.module, []):
                ops[r.module].append(r.op)
        return ops

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (a NaN share is None)."""

        def pair(f: Flops) -> dict[str, Any]:
            share = None if math.isnan(f.share) else f.share
            return {"emulated": f.emulated, "total": f.total, "share": share}

        return {
            **pair(self.flops),
            "backward": self.backward,
            "recipe": self.recipe,
            "by_module": {m: pair(f) for m, f in self.by_module().items()},
            "by_op": {o: pair(f) for o, f in self.by_op().items()},
            "by_phase": {p: pair(f) for p, f in self.by_phase().items()},
            "records": [vars(r) for r in self.records],
            "unmeasured": dict(self.unmeasured),
        }


def _si(n: int) -> str:
    """FLOPs with an SI prefix: ``1.23 GFLOP``."""
    for div, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g} {prefix}FLOP"
    return f"{n} FLOP"


def _name(module: str) -> str:
    """A module path for a sentence: quoted, the root and the outside named."""
    return "the root" if module == "" else module if module == OUTSIDE else repr(module)


# ---------------------------------------------------------------- the audit


@contextmanager
def _state_kept(model: nn.Module, batch: Any) -> Iterator[None]:
    """The model's ``.grad``s, its buffers (BatchNorm's running statistics), the batch
    tensors' ``.grad``s, torch's RNG (CPU and the model's CUDA devices) and the MHA
    fast-path switch as they were, after the block. The ``.grad`` tensors put back are the
    same objects, untouched: they are set aside (to None) before the backward."""
    leaves = [t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    params = list(model.parameters())
    grads = [(t, t.grad) for t in (*params, *leaves) if t.requires_grad]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cuda = sorted({int(t.device.index or 0) for t in (*params, *leaves) if t.device.type == "cuda"})
    fastpath = torch.backends.mha.get_fastpath_enabled()
    for t, _ in grads:
        t.grad = None
    try:
        with torch.random.fork_rng(devices=cuda):
            # torch's fused MHA / TransformerEncoderLayer kernels are turned off (as emulate()
            # does) so their GEMMs reach the dispatcher one by one
            torch.backends.mha.set_fastpath_enabled(False)
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        for t, g in grads:
            t.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def coverage(
    model: nn.Module,
    batch: Any,
    recipe: EmulationRecipe | None = None,
    *,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    backward: bool = True,
    skip: tuple[str, ...] | Callable[[str, nn.Module], bool] | None = None,
    attention: bool = False,
    modules: tuple[type[nn.Module], ...] | None = None,
    inplace: bool = False,
) -> GemmCoverage:
    """Run one training step's forward and backward and count which GEMM FLOPs ran on
    emulated operands (see the module docstring for what is counted and how).

    ``recipe`` None: ``model`` is audited as it is (an ``emulate()``d model, or a plain
    one: then nothing is emulated and the audit is a GEMM FLOP count). ``recipe`` given:
    a deep copy of ``model`` is emulated, ``emulate(copy, recipe, skip=skip,
    attention=attention, modules=modules)``, and audited: the model you hold is never
    swapped (the copy costs one model's memory). ``inplace=True``: no copy, the model
    itself is emulated for the run and ``restore()``d after it (also when it raises).
    ``skip``, ``attention``, ``modules`` and ``inplace`` go with a recipe only; emulate()'s
    ValueError (it would cover nothing) is raised as is.

    ``loss_fn(model, batch)`` runs the forward and returns the loss (the convention of
    :func:`floatguard.audit`; default: the model's own ``.loss``, else the mean of its
    output; a dict batch goes in as keyword arguments). ``backward=False``: the forward
    only, under ``torch.no_grad()`` (an inference audit). The model runs in the mode it
    is in (``train()``: dropout draws).

    Nothing of the model's state changes: its ``.grad``s (and those of the batch's
    tensors) are set aside and put back, its buffers restored, torch's RNG forked; torch's
    fused MHA fast path is off during the run, as ``emulate()`` turns it off. Host-side
    bookkeeping of shapes only: no device sync beyond what the model itself does; CPU
    Tested on CPU; on CUDA, autograd runs the backward on a device thread, where the
    engine carries the dispatch mode and sets the current node, and the emulated GEMM's
    backward enters ``emulated_gemm()`` itself.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"coverage: model must be an nn.Module, got {type(model).__name__}")
    if recipe is None:
        if skip is not None or attention or modules is not None or inplace:
            raise ValueError(
                "coverage: skip=, attention=, modules= and inplace= describe the emulation "
                "and go with recipe=...; with recipe=None the model is audited as it is"
            )
        target, label = model, None
    else:
        if not isinstance(recipe, EmulationRecipe):
            raise TypeError(f"coverage: recipe must be an EmulationRecipe, got {recipe!r}")
        if is_emulated(model):
            raise ValueError(
                "coverage: the model is emulated already; pass recipe=None to audit it as it "
                "is, or restore(model) first to audit it under another recipe"
            )
        target = model if inplace else _copy(model)
        emulate(target, recipe, skip=skip, attention=attention, modules=modules)
        label = repr(recipe)
    try:
        counter = _run(target, batch, loss_fn, backward)
    finally:
        if recipe is not None and inplace:
            restore(target)
    records = tuple(GemmRecord(m, op, phase, emu, calls, flops)
                    for (m, op, phase, emu), (calls, flops) in counter.counts.items())  # fmt: skip
    ran_backward = counter.phase == "backward"
    return GemmCoverage(records, ran_backward, label, tuple(counter.unmeasured.items()))


def _copy(model: nn.Module) -> nn.Module:
    """A deep copy of the model, without its ``.grad``s."""
    try:
        target = copy.deepcopy(model)
    except Exception as e:  # a module holding something deepcopy refuses (a lock, a stream)
        raise TypeError(
            f"coverage: cannot deep-copy the model to emulate it ({type(e).__name__}: {e}); "
            "pass inplace=True (emulated for the run, restore()d after)"
        ) from e
    target.zero_grad(set_to_none=True)
    return target


def _run(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None,
    backward: bool,
) -> _GemmCounter:
    """One forward (and backward) of ``model`` under the counting mode, state kept."""

    check_loss_fn(loss_fn)
    tracker = _ModuleTracker(model)
    counter = _GemmCounter(tracker)
    try:
        with _state_kept(model, batch), counter:
            with torch.set_grad_enabled(backward):
                loss = batch_loss(loss_fn, model, batch)
            if backward and loss.requires_grad:  # a frozen model has no backward to count
                counter.phase = "backward"
                loss.backward()  # type: ignore[no-untyped-call]
    finally:
        tracker.remove()
    return counter
