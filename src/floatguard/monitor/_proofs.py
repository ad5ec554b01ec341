"""Proof frames: whether a module call may be proved finite, and the rule that proves it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from floatguard.monitor.bounds import (
    PROVABLE_DTYPES,
    Rule,
    accumulation_roundoff,
    backward_rule,
    forward_rule,
)

__all__ = ["Frame", "RuleCache", "build_frame"]


@dataclasses.dataclass
class Frame:
    """One call of a module whose output (and input gradient) may be proved finite."""

    module: nn.Module
    x: torch.dtype | None  # dtype of the one floating input (None for an embedding)
    width: int  # its last dimension
    deps: list[int]  # slots: the input (if any), then the rule's parameters
    acc: float  # unit roundoff of the sums inside (bounds.accumulation_roundoff)
    g_slot: int | None = None  # slot of the gradient that arrived at the output
    dropped: bool = False  # its forward's records were dropped: its deps are gone


_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def only_our_hooks(m: nn.Module) -> bool:
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


# Whether autocast is on for any device: one cheap call before the per-device ones.
_ANY_AUTOCAST: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
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


def hyper(m: nn.Module) -> tuple[Any, ...]:
    """The hyper-parameters rules read (part of the rule cache's key: they may change).
    Types whose rule reads none but fixed shapes and flags skip the lookups."""
    if type(m) in _NO_HYPER:
        return ()
    d = m.__dict__
    return tuple(d.get(k) for k in _HYPER)


def build_frame(
    module: nn.Module,
    inputs: list[tuple[str, torch.Tensor]],
    params: list[tuple[str, nn.Parameter]],
    input_slots: list[int],
    param_slots: dict[str, int],
    rule_pnames: Sequence[str],
    is_embedding: bool,
) -> Frame | None:
    """The frame of one call of a provable module, or None when this call cannot be
    proved: more than one floating input, a hook or ``forward`` not its class's, an
    input, parameter or autocast dtype outside :data:`PROVABLE_DTYPES`."""
    if len(inputs) > 1 or not only_our_hooks(module):
        return None
    x = inputs[0][1] if inputs else None
    cast = autocast_dtype(x) if x is not None else None
    if not (
        (x is None) == is_embedding
        and (x is None or x.dtype in PROVABLE_DTYPES)
        and (cast is None or cast in PROVABLE_DTYPES)
        and all(p.dtype in PROVABLE_DTYPES for _, p in params)
    ):
        return None
    deps = input_slots + [param_slots["param:" + n] for n in rule_pnames]
    dtypes = [p.dtype for _, p in params] + ([x.dtype] if x is not None else [])
    acc = accumulation_roundoff(*dtypes, low_precision=cast == torch.bfloat16)
    return Frame(
        module,
        None if x is None else x.dtype,
        x.shape[-1] if x is not None and x.dim() else 1,
        deps,
        acc,
    )


class RuleCache:
    """Proof rules, built once per module, pass, width, dtype, roundoff, training flag
    and hyper-parameters; the hyper-parameters themselves looked up once per step."""

    def __init__(self) -> None:
        self._rules: dict[tuple[Any, ...], Rule | None] = {}
        self._hypers: dict[int, tuple[Any, ...]] = {}

    def new_step(self) -> None:
        """Forget the hyper-parameters (they may have changed between steps)."""
        self._hypers.clear()

    def _hyper_of(self, m: nn.Module) -> tuple[Any, ...]:
        h = self._hypers.get(id(m))
        if h is None:
            h = self._hypers[id(m)] = hyper(m)
        return h

    def rule(
        self,
        frame: Frame,
        pass_: Literal["forward", "backward"],
        width: int,
        output: torch.Tensor | None,
    ) -> Rule | None:
        """The proof rule of ``frame``'s module for one pass (None: no proof)."""
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
