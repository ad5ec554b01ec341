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
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
from torch import nn

from floatguard._values import values_of
from floatguard.monitor import _context
from floatguard.monitor._births import _Births, _choose, _param_grad_hooks
from floatguard.monitor._replay_context import _Context, _module_hooks
from floatguard.monitor._replay_result import ReplayResult
from floatguard.monitor._replay_values import _severity
from floatguard.repro.tape import Site, TapeRecorder

__all__ = ["ReplayResult", "replay"]


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
    found, bad, _, _ = run_traced(step_fn, model, loss_of)
    return found, bad


def run_traced(
    step_fn: Callable[[], object],
    model: nn.Module | None,
    loss_of: Callable[[object], torch.Tensor | None] | None = None,
    tape: TapeRecorder | None = None,
) -> tuple[ReplayResult | None, bool, Site | None, object]:
    """:func:`_run`, with where the birth was found (its :class:`Site`: the op's number
    in the step's dispatch order, for a repro bundle's recording replay), what
    ``step_fn`` returned, and ``tape`` (a recorder) fed every op the step ran."""
    ctx = _Context(model)
    births = _Births(ctx, tape)
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
    chosen = _choose(ctx, births, hits, loss_bad)
    return chosen, bad, _site_of(ctx, births, chosen), result


def _site_of(ctx: _Context, births: _Births, chosen: ReplayResult | None) -> Site | None:
    """The :class:`Site` of the chosen birth (None when nothing was chosen)."""
    if chosen is None:
        return None
    pool = [
        *ctx.early,
        *births.candidates,
        *(c for _, c in births.outside.values()),
        *ctx.ninf_inputs.values(),
    ]
    for c in pool:
        if c.result is chosen:
            held = c.held[0] if c.held else None
            if c.seq is None or chosen.op in ("input", "parameter"):
                return Site(None, chosen.module, False, c.forward_pass, chosen.op, held)
            return Site(c.seq, c.scope, c.backward, c.forward_pass, chosen.op, held)
    return None


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
