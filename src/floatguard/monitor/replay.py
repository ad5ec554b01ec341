"""Op-level replay: re-run a step under a dispatch mode and name the first aten op that broke.

Every aten op the step runs, forward and backward, passes through a
``TorchDispatchMode``; the first one whose floating (or complex) tensor inputs
are all finite and whose output is not is reported, or, where an input held
±inf but no NaN, the first whose output holds a NaN (a softmax over a row that
an intended -inf mask filled entirely). Fill-type ops given a non-finite fill
value, such as a mask filled with -inf, are intended and skipped. Inputs are
judged before the op runs (an in-place op overwrites them); ``out=`` buffers
are not inputs; a sparse tensor is judged by the dense tensor it stands for
(duplicate entries summed). The result carries statistics of the op's inputs
and outputs and the line of user code that called it (for backward ops, the
forward line that created the autograd node, recorded by anomaly mode's
traceback). Every op's inputs are read on the host: this is a debugging tool
that costs nothing until you call it.
"""

from __future__ import annotations

import math
import os
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from floatguard._values import values_of
from floatguard.stats import TensorStats, tensor_stats

__all__ = ["ReplayResult", "replay"]

# Uninitialised memory may hold anything: never blame these.
_SKIP = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "set_")
# Ops whose non-finite *scalar* argument is the point (masks filled with -inf):
# their non-finite output is intended. Elsewhere a NaN scalar (x * nan) is a fault.
_FILLS = (
    "fill", "fill_", "masked_fill", "masked_fill_", "full", "full_like", "new_full",
    "scalar_tensor", "where", "index_fill", "index_fill_", "clamp", "clamp_",
)  # fmt: skip
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


@dataclass(frozen=True)
class ReplayResult:
    """The first aten op that turned finite inputs into a non-finite output."""

    op: str
    phase: Literal["forward", "backward"]
    kind: Literal["nan", "inf"]
    source: str | None
    inputs: list[TensorStats] = field(repr=False)
    outputs: list[TensorStats] = field(repr=False)
    deterministic: bool | None = None

    def __str__(self) -> str:
        det = (
            ""
            if self.deterministic is None
            else (" (deterministic)" if self.deterministic else " (NOT deterministic)")
        )
        return f"{self.kind} first produced by {self.op} in {self.phase} at {self.source}{det}"


def _user_frame(frames: list[traceback.FrameSummary]) -> str | None:
    for fr in reversed(frames):
        path = os.path.abspath(fr.filename)
        if path.startswith(_TORCH) or path.startswith(_HERE) or "<frozen" in fr.filename:
            continue
        line = (fr.line or "").strip()
        return f"{fr.filename}:{fr.lineno}: {line}"
    return None


def _from_anomaly_trace(node: Any) -> str | None:
    meta = getattr(node, "metadata", None)
    text = meta.get("traceback_") if isinstance(meta, dict) else None
    if not text:
        return None
    lines = text if isinstance(text, list) else [text]
    frames = traceback.StackSummary.from_list([])
    parsed: list[traceback.FrameSummary] = []
    blob = "".join(lines)
    chunks = blob.split('  File "')[1:]
    for chunk in chunks:
        head, _, rest = chunk.partition("\n")
        try:
            fname, _, tail = head.partition('", line ')
            lineno = int(tail.split(",")[0])
        except ValueError:
            continue
        code = rest.split("\n")[0].strip()
        parsed.append(traceback.FrameSummary(fname, lineno, "", line=code))
    del frames
    return _user_frame(parsed)


def _floats(obj: Any) -> tuple[list[torch.Tensor], list[float]]:
    leaves, _ = tree_flatten(obj)
    tensors = [
        values_of(x)
        for x in leaves
        if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())
    ]
    scalars = [float(x) for x in leaves if isinstance(x, float)]
    return tensors, scalars


_OUT_ARGS: dict[Any, frozenset[str]] = {}


def _out_args(func: Any) -> frozenset[str]:
    """Names of ``func``'s ``out=`` arguments: buffers it writes, not inputs."""
    names = _OUT_ARGS.get(func)
    if names is None:
        schema = getattr(func, "_schema", None)
        args = getattr(schema, "arguments", ())
        names = _OUT_ARGS[func] = frozenset(a.name for a in args if getattr(a, "is_out", False))
    return names


class _FirstNonFinite(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The birth rule, per op: finite inputs and a non-finite output, or inputs free of
    NaN (an intended -inf mask, say) and a NaN output. Inputs are judged before the op
    runs (an in-place op overwrites them); ``out=`` buffers are not inputs."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.found: ReplayResult | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.found is not None:
            return func(*args, **kwargs)
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        if name in _SKIP:
            return func(*args, **kwargs)
        outs = _out_args(func)
        ins = {k: v for k, v in kwargs.items() if k not in outs} if outs else kwargs
        in_t, in_s = _floats((args, ins))
        if name in _FILLS and any(not math.isfinite(v) for v in in_s):
            return func(*args, **kwargs)  # a mask filled with -inf: intended
        finite = all(bool(torch.isfinite(t).all()) for t in in_t)
        if not finite and any(bool(torch.isnan(t).any()) for t in in_t):
            return func(*args, **kwargs)  # NaN in, NaN out: a consequence
        stats_in = [tensor_stats(t) for t in in_t]  # before an in-place op changes them
        out = func(*args, **kwargs)
        out_t, _ = _floats(out)
        if finite:
            bad = [t for t in out_t if not bool(torch.isfinite(t).all())]
        else:
            bad = [t for t in out_t if bool(torch.isnan(t).any())]
        if not bad:
            return out
        kind: Literal["nan", "inf"] = (
            "nan" if any(bool(torch.isnan(t).any()) for t in bad) else "inf"
        )
        node = torch._C._current_autograd_node()
        phase: Literal["forward", "backward"] = "backward" if node is not None else "forward"
        source = (
            _from_anomaly_trace(node)
            if node is not None
            else _user_frame(traceback.extract_stack()[:-1])
        )
        self.found = ReplayResult(
            op=str(func),
            phase=phase,
            kind=kind,
            source=source,
            inputs=stats_in,
            outputs=[tensor_stats(t) for t in out_t],
        )
        return out


def _run_once(step_fn: Callable[[], object]) -> ReplayResult | None:
    mode = _FirstNonFinite()
    # Anomaly mode records each node's forward traceback, so backward ops can name
    # the user line that created them; check_nan=False keeps it from raising.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
        try:
            with torch.autograd.detect_anomaly(check_nan=False), mode:
                step_fn()
        except Exception as exc:
            if mode.found is None:
                raise
            # A step that stops on a non-finite loss is expected here: what it found counts.
            warnings.warn(
                f"replay: step_fn raised {type(exc).__name__}: {exc} after {mode.found.op} "
                "produced the first non-finite value; returning that op",
                RuntimeWarning,
                stacklevel=3,
            )
    return mode.found


def replay(step_fn: Callable[[], object], *, repeat: int = 1) -> ReplayResult | None:
    """Run ``step_fn`` (forward and backward) under a dispatch mode; return the first op
    that turned finite inputs into a non-finite output, or None.

    With ``repeat=2`` (or more) the step runs again and ``deterministic`` says whether
    the same op at the same line was first every time. ``step_fn`` should only compute
    (no optimizer step), since it runs ``repeat`` times. If ``step_fn`` raises after
    the first non-finite op was found (a step that stops on a NaN loss), the op is
    returned with a RuntimeWarning naming the exception; before that, it propagates.
    """
    if not callable(step_fn):
        raise TypeError(f"replay needs a callable, got {type(step_fn).__name__}")
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat={repeat!r} must be a positive int")
    results = [_run_once(step_fn) for _ in range(repeat)]
    first = results[0]
    if repeat == 1:
        return first
    found = [r for r in results if r is not None]
    if not found:
        return None
    same = len(found) == repeat and all(
        (r.op, r.source) == (found[0].op, found[0].source) for r in found
    )
    base = first if first is not None else found[0]
    return ReplayResult(
        base.op, base.phase, base.kind, base.source, base.inputs, base.outputs, deterministic=same
    )
