"""Who wrote a bad weight: the last optimizer update, verified from the optimizer's own state.

A weight found non-finite (or absurdly large) on the step after an applied update was
written either by that update or by something outside it between the steps (an
embedding resize, a callback, a checkpoint load, a flipped bit). The guard says "by
optimizer.step" only when it verified it, and "not by the update" only when it
verified that: where the optimizer's rule is known, the step the last update took at
the bad elements is recomputed from the state it left (the state holds everything the
step depended on besides the gradient, and the gradient went into the state):

- ``Adam`` / ``AdamW`` (any implementation: single-tensor, foreach, fused): the step
  is ``lr * (m / bc1) / (sqrt(v) / sqrt(bc2) + eps)`` with ``v`` the ``max_exp_avg_sq``
  under amsgrad, the denominator rounded to the state's dtype as torch computes it (in
  fp16, ``eps=1e-8`` rounds to 0, and ``0/0`` is the NaN pure-fp16 AdamW makes);
  AdamW's decoupled decay multiplies the weight by ``1 - lr * weight_decay`` first.
- ``SGD`` with momentum (not Nesterov): the step is ``lr * momentum_buffer``.

Then: a step that is non-finite at a bad element made it (verified); a finite step
cannot turn a finite weight into a NaN, so a NaN with finite steps was written outside
(verified); an inf or an absurd magnitude is the update's when the step (and the decay
factor times the largest weight the magnitude rule allows before it) reaches it, and
not the update's when they cannot. Any other optimizer (plain SGD keeps no state,
Nesterov's step needs the gradient, others are not modelled): unknown, and the fault
says "written by the update or outside it". Bad steps only: one small read.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from floatguard._values import values_of

__all__ = ["UpdateCheck"]


def _num(x: Any) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


class UpdateCheck:
    """Records the LR and weight decay each parameter group's last update used
    (:meth:`record`, before ``optimizer.step()``: plain floats, no sync) and answers
    :meth:`made` on a bad step."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._last: list[tuple[Any, Any]] | None = None

    def record(self) -> None:
        """The hyper-parameters the update about to run uses (the guard's LR factor
        included): kept as given (a tensor LR is read only on a bad step)."""
        self._last = [
            (g.get("lr"), g.get("weight_decay", 0.0)) for g in self.optimizer.param_groups
        ]

    def last(self) -> list[tuple[Any, Any]] | None:
        """What :meth:`record` holds (to put back when an update is undone)."""
        return self._last

    def restore(self, last: list[tuple[Any, Any]] | None) -> None:
        """Put back what :meth:`last` returned: an update that did not stand (a deferred
        step the device or the host did not keep) is not the last update."""
        self._last = last

    def made(
        self, param: torch.Tensor, kind: Literal["nan", "inf", "huge"], bound: float
    ) -> bool | None:
        """Whether the last update wrote ``param``'s bad elements: True (verified), False
        (verified not), None (unknown). ``bound``: the largest magnitude the magnitude
        rule allowed the weight before (what an update could have started from)."""
        found = self._group_of(param)
        if found is None or self._last is None:
            return None
        index, group = found
        if index >= len(self._last) or self._last[index][0] is None:
            return None
        lr, wd = (abs(_num(x)) for x in self._last[index])
        state = self.optimizer.state.get(param, {})
        w = values_of(param.detach())
        bad = ~w.isfinite() if kind != "huge" else w.abs() > bound
        if not bool(bad.any()):
            return None
        step = self._step(group, state, bad, lr)
        if step is None:
            return None
        decay = abs(1.0 - lr * wd) if isinstance(self.optimizer, torch.optim.AdamW) else 1.0
        if not bool(step.isfinite().all()) or not math.isfinite(decay):
            return True
        if kind == "nan":
            return False  # finite * finite - finite is never a NaN
        reach = decay * bound + step.double()
        if kind == "inf":
            top = torch.finfo(param.dtype).max if param.is_floating_point() else math.inf
            return None if bool((reach >= top).any()) else False
        now = w[bad].abs().double()
        return bool((reach >= 0.5 * now).any())

    def _group_of(self, param: torch.Tensor) -> tuple[int, dict[str, Any]] | None:
        for i, group in enumerate(self.optimizer.param_groups):
            if any(p is param for p in group["params"]):
                return i, group
        return None

    def _step(
        self, group: dict[str, Any], state: dict[Any, Any], bad: torch.Tensor, lr: float
    ) -> torch.Tensor | None:
        """The magnitude of the step the last update took at the ``bad`` elements."""
        opt = self.optimizer
        if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            sq = "max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq"
            if "exp_avg" not in state or sq not in state or "step" not in state:
                return None
            n = _num(state["step"])
            beta1, beta2 = (_num(b) for b in group["betas"])
            bc1, bc2 = 1.0 - beta1**n, 1.0 - beta2**n
            if bc1 <= 0.0 or bc2 <= 0.0:
                return None
            m = values_of(state["exp_avg"])[bad].float()
            v_t = values_of(state[sq])
            v = v_t[bad].float()
            denom = (v.sqrt() / math.sqrt(bc2) + _num(group["eps"])).to(v_t.dtype).float()
            step: torch.Tensor = (lr / bc1) * (m / denom).abs()
            return step
        if isinstance(opt, torch.optim.SGD):
            buf = state.get("momentum_buffer")
            if buf is None or group.get("nesterov") or not _num(group.get("momentum", 0.0)):
                return None
            moved: torch.Tensor = lr * values_of(buf)[bad].float().abs()
            return moved
        return None
