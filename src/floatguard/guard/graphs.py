"""The deferred guard's step in a CUDA graph (:meth:`Guard.graphed
<floatguard.guard.core.Guard.graphed>`): the forward, the backward, the verdict, the
clipping, the gated update and the copy of the read to the host captured once and
replayed every step; the host settles each step from the mailbox as the deferred mode
does.

What a replay cannot see, the host writes before it into device tensors the graph
reads (one small copy): the spike detectors' bars and ZClip's state (whose coefficient
is then computed by device arithmetic whatever the state: the same operations every
step). Whatever else the host decides for a step (a snapshot step, whose state is
vetted in an exact read; a batch skipped after a rollback; an LR backed off; a spike
detector without a bar; the first steps), the step runs eagerly through
:meth:`Guard.step <floatguard.guard.core.Guard.step>`. A replay needs the tensors it
captured: an optimizer whose state was replaced (a rollback loads a snapshot into it)
is captured again.

Two backends. ``"cuda"``: ``torch.cuda.CUDAGraph`` (warm-up steps on a side stream,
capture, replay). ``"check"`` (the CPU's, and a CUDA run's dry run): every step runs
eagerly under a dispatch mode that records each operator with its non-tensor arguments
and its tensors' shapes and dtypes, and a step whose record differs from the captured
one, or that reads a tensor to the host, raises :class:`GraphUnsafe` naming the first
operator that differs: what a CUDA graph would have replayed wrongly (a Python number
that changes from step to step is baked into a captured kernel) or could not capture
(a host read). What only a GPU shows: the capture itself (a kernel that syncs, an
allocation the graph's pool refuses), the memory of the graph's pool, and the speed.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from floatguard.guard.read import Packed
from floatguard.guard.types import Closure, GraphUnsafe, StepResult

__all__ = ["GraphUnsafe", "GraphedStep"]

Backend = Literal["auto", "cuda", "check"]


class _Record(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Every operator a step dispatches, with its non-tensor arguments and its tensors'
    shapes and dtypes. ``expected``: the capture's record; the first operator that
    differs, or a host read, raises :class:`GraphUnsafe` before it runs (a gated update
    stopped so is put back from its copies)."""

    def __init__(self, expected: list[tuple[str, Any]] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: list[tuple[str, Any]] = []
        self.expected = expected
        self.failed = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.failed:  # (what runs after the raise: the update put back)
            return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            self.failed = True
            raise _host_read("a Python number of a tensor (.item(), bool, float)")
        now = (str(func), _shape_of((args, kwargs)))
        i = len(self.ops)
        if self.expected is not None:
            then = self.expected[i] if i < len(self.expected) else ("nothing", ())
            if now != then:
                what = (
                    f"is {now[0]}, was {then[0]} at the capture"
                    if now[0] != then[0]
                    else f"{now[0]}: {_first_difference(then[1], now[1])}"
                )
                self.failed = True
                raise GraphUnsafe(
                    f"floatguard: the step is not the one captured: operator #{i} {what}, "
                    f"at {_site()} (a number that changes from step to step, or a branch "
                    "taken on a value, is baked into a CUDA graph: make it a device tensor "
                    "(a scheduled LR: lr=torch.tensor(...) with fused=True), or keep it "
                    "fixed (OneCycleLR(cycle_momentum=False) for its betas)"
                )
        self.ops.append(now)
        return func(*args, **kwargs)


def _site() -> str:
    """Where the step's code stands now: the innermost frame outside the dispatch
    machinery and this module (the user's line, or torch.optim's)."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        name = frame.filename.replace("\\", "/")
        if not name.endswith(("/guard/graphs.py", "/utils/_python_dispatch.py")) and (
            "/torch/_ops.py" not in name
        ):
            short = "/".join(name.rsplit("/", 2)[-2:])
            return f"{short}:{frame.lineno} in {frame.name}"
    return "an unknown place"


def _host_read(what: str) -> GraphUnsafe:
    return GraphUnsafe(
        f"floatguard: the step reads a tensor to the host ({what}) at {_site()}: a CUDA "
        "graph cannot capture a host read (in loss_fn: keep the value a tensor; in "
        "torch.optim: an optimizer without fused=True or capturable=True reads its step "
        "counter, and a tensor LR without fused=True is read as a number)"
    )


@contextlib.contextmanager
def _no_tolist() -> Iterator[None]:
    """``Tensor.tolist`` and ``Tensor.numpy`` raise :class:`GraphUnsafe` inside (on a CPU
    tensor they read without dispatching an operator)."""
    saved = {n: getattr(torch.Tensor, n) for n in ("tolist", "numpy")}

    def refuse(name: str) -> Any:
        def method(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            raise _host_read(f".{name}()")

        return method

    for n in saved:
        setattr(torch.Tensor, n, refuse(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def _shape_of(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.dtype, x.device.type)
    if isinstance(x, (list, tuple)):
        return tuple(_shape_of(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, _shape_of(v)) for k, v in sorted(x.items()))
    return x if isinstance(x, (int, float, bool, str, type(None))) else repr(type(x))


def _first_difference(then: Any, now: Any, path: str = "argument") -> str:
    """Where two recorded argument lists first differ, and the two values."""
    if isinstance(then, tuple) and isinstance(now, tuple) and len(then) == len(now):
        if len(then) == 2 and isinstance(then[0], str) and then[0] == now[0] != "tensor":
            return _first_difference(then[1], now[1], f"{path} {then[0]!r}")  # a keyword
        for k, (a, b) in enumerate(zip(then, now, strict=True)):
            if a != b:
                return _first_difference(a, b, f"{path}[{k}]")
    return f"{path} was {then!r} at the capture and is {now!r} now"


class _Check:
    """The CPU backend: each step eager, its operators compared with the capture's."""

    name = "check"

    def __init__(self) -> None:
        self.captured: list[tuple[str, Any]] | None = None

    def capture(self, fn: Callable[[], Any]) -> Any:
        record = _Record()
        with record, _no_tolist():
            out = fn()
        self.captured = record.ops
        return out

    def replay(self, fn: Callable[[], Any]) -> Any:
        assert self.captured is not None
        record = _Record(self.captured)
        with record, _no_tolist():
            out = fn()
        if len(record.ops) != len(self.captured):
            raise GraphUnsafe(
                f"floatguard: the step ran {len(record.ops)} operators, the capture "
                f"{len(self.captured)}: its work depends on its values, not capturable"
            )
        return out


class _Cuda:
    """``torch.cuda.CUDAGraph``: captured once, replayed (capturing runs nothing: the
    capture is replayed once to run its step)."""

    name = "cuda"

    def __init__(self) -> None:
        self.graph: Any = None
        self.out: Any = None

    def capture(self, fn: Callable[[], Any]) -> Any:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.out = fn()
        except RuntimeError as e:
            raise GraphUnsafe(
                f"floatguard: the step could not be captured in a CUDA graph ({e}); run "
                "Guard.graphed(..., backend='check') to find the operator"
            ) from e
        self.graph = graph
        graph.replay()
        return self.out

    def replay(self, fn: Callable[[], Any]) -> Any:
        self.graph.replay()
        return self.out


class GraphedStep:
    """A training step the guard runs as one CUDA graph replay (made by
    :meth:`Guard.graphed <floatguard.guard.core.Guard.graphed>`; see the module).
    Calling it with a batch shaped like the example runs one guard step and returns its
    :class:`~floatguard.guard.deferred.PendingResult` (or the eager step's result).
    ``replays``/``eager_steps``/``captures``: how the steps ran."""

    def __init__(
        self,
        loss_fn: Callable[..., torch.Tensor],
        example: Sequence[torch.Tensor],
        *,
        guard: Any,
        stepper: Any,
        run_graphed: Callable[[GraphedStep, list[Closure]], StepResult],
        warmup: int,
        backend: Backend,
    ) -> None:
        if not callable(loss_fn):
            raise TypeError(f"Guard.graphed(loss_fn, ...): loss_fn must be callable, got "
                            f"{type(loss_fn).__name__}")  # fmt: skip
        bad = [type(x).__name__ for x in example if not isinstance(x, torch.Tensor)]
        if bad or not example:
            raise TypeError(
                "Guard.graphed(loss_fn, *example): the example batch is the tensors loss_fn "
                f"takes (the graph's static inputs); got {bad or 'none'}"
            )
        if warmup < 2:
            raise ValueError(f"Guard.graphed(warmup={warmup}): at least 2 eager steps (the "
                             "first is exact, the optimizer's state is made)")  # fmt: skip
        if backend not in ("auto", "cuda", "check"):
            raise ValueError(f"Guard.graphed(backend={backend!r}): use 'auto', 'cuda' or "
                             "'check'")  # fmt: skip
        on_cuda = example[0].is_cuda
        if backend == "cuda" and not on_cuda:
            raise ValueError("Guard.graphed(backend='cuda') needs the example batch on CUDA")
        self._loss_fn, self._guard, self._stepper = loss_fn, guard, stepper
        self._run_graphed = run_graphed
        self._backend: _Check | _Cuda = (
            _Cuda() if backend == "cuda" or (backend == "auto" and on_cuda) else _Check()
        )
        self.backend = self._backend.name
        self.static = [x.detach().clone() for x in example]
        self.warmup_left = warmup
        self.replays = self.eager_steps = self.captures = 0
        self._never = 0
        self.why_eager: str | None = "warm-up"
        self._targets: list[tuple[int, int]] | None = None
        self._out: tuple[Packed, list[torch.Tensor], tuple[Any, ...]] | None = None
        self._batch: tuple[torch.Tensor, ...] = ()
        self._side: Any = (
            torch.cuda.Stream()  # type: ignore[no-untyped-call]
            if isinstance(self._backend, _Cuda)
            else None
        )

    def __call__(self, *batch: torch.Tensor) -> StepResult:
        self._check_batch(batch)
        self._guard.settle()  # the step before, first (a rollback changes what replays)
        why = "warm-up" if self.warmup_left > 0 else self._stepper.graph_ready()
        self.why_eager = why
        if why is not None:
            self.warmup_left -= 1
            self.eager_steps += 1
            self._never = self._never + 1 if self.replays == 0 and why != "warm-up" else 0
            if self._never == 10:  # (not one replay yet, ten steps after the warm-up)
                warnings.warn(f"floatguard: the graphed step has not replayed once: {why}",
                              RuntimeWarning, stacklevel=2)  # fmt: skip
            return self._eager(batch)
        self._batch = batch

        def closure(b: tuple[torch.Tensor, ...] = batch) -> torch.Tensor:
            return self._loss_fn(*b)

        return self._run_graphed(self, [closure])

    def _eager(self, batch: tuple[torch.Tensor, ...]) -> StepResult:
        def closure() -> torch.Tensor:
            return self._loss_fn(*batch)

        if self._side is None:
            result: StepResult = self._guard.step(closure)
            return result
        # (CUDA: eager steps before a capture run on a side stream, as torch asks)
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):
            result = self._guard.step(closure)
        torch.cuda.current_stream().wait_stream(self._side)
        return result

    def _check_batch(self, batch: tuple[torch.Tensor, ...]) -> None:
        if len(batch) != len(self.static):
            raise ValueError(f"the graphed step takes {len(self.static)} tensors (as the "
                             f"example batch), got {len(batch)}")  # fmt: skip
        for i, (x, s) in enumerate(zip(batch, self.static, strict=True)):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                raise ValueError(
                    f"the graphed step's input {i} requires grad: the graph's static inputs "
                    "do not (no gradient flows to a batch); pass it detached (x.detach())"
                )
            if not isinstance(x, torch.Tensor) or x.shape != s.shape or x.dtype != s.dtype:
                got = (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x)
                raise ValueError(
                    f"the graphed step's input {i} must be shaped like the example "
                    f"({tuple(s.shape)}, {s.dtype}), got {got}: a CUDA graph replays "
                    "static shapes (pad the batch, or make another graphed step)"
                )

    def enqueue(self) -> None:
        """Copy the batch into the static inputs, write the host's scalars for the
        graph, and replay it (captured first, or again when the optimizer's tensors were
        replaced)."""
        with torch.no_grad():
            for s, x in zip(self.static, self._batch, strict=True):
                s.copy_(x, non_blocking=True)
        stepper = self._stepper
        scalars = stepper.graph_scalars()
        targets = stepper.graph_targets()
        closures = [lambda: self._loss_fn(*self.static)]

        checking = isinstance(self._backend, _Check)

        def device_step() -> tuple[Packed, list[torch.Tensor], tuple[Any, ...]]:
            out: tuple[Packed, list[torch.Tensor], tuple[Any, ...]]
            out = stepper.device_step(closures, scalars, checking)
            return out

        if self._targets != targets or self._out is None:
            stepper.prepare_capture()
            self._out = self._backend.capture(device_step)
            self._targets = targets
            self.captures += 1
        else:
            self._out = self._backend.replay(device_step)
        self.replays += 1
        stepper.record_batch(self._batch)

    def pend(self, step: int, closures: list[Closure], last_update: Any) -> StepResult:
        """The replayed step left for the host to settle (the deferred mode's)."""
        assert self._out is not None
        packed, losses, update = self._out
        result: StepResult = self._stepper.pend_graphed(
            step, packed, losses, update, closures, last_update
        )
        return result
