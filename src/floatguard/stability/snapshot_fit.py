"""Whether a snapshot fits the model and optimizer it would be loaded into.

``module.load_state_dict`` copies tensor by tensor and raises on a shape it cannot
copy only after the tensors before it were overwritten; ``optimizer.load_state_dict``
checks the param groups' sizes but not a state tensor's shape (a moment of the wrong
shape fails at the next step, after everything was loaded). So a snapshot is checked
whole first, and loaded only when every tensor fits.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch

__all__ = ["first_misfit"]

# The state of torch's element-wise optimizers (Adam, AdamW, NAdam, RAdam, Adamax, SGD,
# RMSprop, Adagrad, Adadelta) that has its parameter's shape: checked against the
# parameter when the live optimizer has no state yet (a fresh one, as in a resume).
# Other keys may legitimately differ (Adafactor's factored row and column moments).
_PARAM_SHAPED = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf", "momentum_buffer",
     "square_avg", "grad_avg", "sum", "acc_delta"}
)  # fmt: skip


def _desc(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _module_misfit(saved: Any, live: dict[str, Any]) -> str | None:
    if not isinstance(saved, dict):
        return f"the snapshot holds a {type(saved).__name__}, not a state dict"
    for key, t in live.items():
        if not isinstance(t, torch.Tensor):
            continue  # extra state: the module's own business
        if key not in saved:
            return f"{key} {_desc(t)} is not in the snapshot"
        s = saved[key]
        if not isinstance(s, torch.Tensor):
            return f"{key} is a {type(s).__name__} in the snapshot, {_desc(t)} in the model"
        if s.shape != t.shape or s.dtype != t.dtype:
            return f"{key} is {_desc(s)} in the snapshot, {_desc(t)} in the model"
    extra = [k for k in saved if k not in live]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        return f"the snapshot has {extra[0]}{more}, which the model has not"
    return None


def _optimizer_misfit(saved: Any, opt: torch.optim.Optimizer) -> str | None:
    live = opt.state_dict()
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not isinstance(saved.get("state"), dict):
        return "the snapshot holds no optimizer state dict"
    if len(groups) != len(live["param_groups"]):
        return (
            f"param groups: {len(groups)} in the snapshot, {len(live['param_groups'])} in "
            "the optimizer"
        )
    for i, (gs, gl) in enumerate(zip(groups, live["param_groups"], strict=True)):
        if len(gs["params"]) != len(gl["params"]):
            return (
                f"param group {i}: {len(gs['params'])} parameters in the snapshot, "
                f"{len(gl['params'])} in the optimizer"
            )
    # load_state_dict pairs the parameters by position: the snapshot's i-th with the
    # optimizer's i-th, in param-group order
    params = [p for g in opt.param_groups for p in g["params"]]
    ids = zip(
        chain.from_iterable(g["params"] for g in groups),
        chain.from_iterable(g["params"] for g in live["param_groups"]),
        strict=True,
    )
    for n, (sid, lid) in enumerate(ids):
        state, now = saved["state"].get(sid, {}), live["state"].get(lid)
        for key, s in state.items():
            if not isinstance(s, torch.Tensor):
                continue
            ref = now.get(key) if now is not None else None
            if isinstance(ref, torch.Tensor):
                if s.shape != ref.shape or s.dtype != ref.dtype:
                    return (
                        f"state {key!r} of parameter {n} is {_desc(s)} in the snapshot, "
                        f"{_desc(ref)} in the optimizer"
                    )
            elif now is None and key in _PARAM_SHAPED and s.shape != params[n].shape:
                return (
                    f"state {key!r} of parameter {n} is {_desc(s)} in the snapshot; the "
                    f"parameter is {_desc(params[n])}"
                )
    return None


def first_misfit(states: dict[str, Any], objects: dict[str, Any]) -> str | None:
    """The first tensor of ``states`` (a snapshot's) that would not load into
    ``objects`` as it is, described ("model: 0.weight is (16, 8) float32 in the
    snapshot, (32, 8) float32 in the model"); None when everything fits.

    Modules: every tensor of their state dict (parameters and buffers) by name, the
    same names both ways, the same shape and dtype. Optimizers: the param groups'
    sizes, then each state tensor's shape and dtype against the live optimizer's
    state; where the optimizer has none yet (a fresh one), the moments of torch's
    element-wise optimizers against their parameter's shape. Other objects (scaler,
    scheduler, detectors) hold no shaped state and are not checked.
    """
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            why = _module_misfit(states.get(name), obj.state_dict())
        elif isinstance(obj, torch.optim.Optimizer):
            why = _optimizer_misfit(states.get(name), obj)
        else:
            continue
        if why is not None:
            return f"{name}: {why}"
    return None
