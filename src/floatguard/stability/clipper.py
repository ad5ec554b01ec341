"""The guard's clipping: a :class:`~floatguard.stability.respond.ClipPolicy` made
executable (the policy is configuration, :mod:`floatguard.stability.clip` the
arithmetic; this joins them, so neither imports the other).
"""

from __future__ import annotations

import math

import torch

from floatguard.stability.clip import ZClip, _scale_, clip_grad_value_
from floatguard.stability.respond import ClipPolicy

__all__ = ["Clipper"]


class Clipper:
    """A :class:`~floatguard.stability.respond.ClipPolicy` made executable, for the guard.

    ``coefficient(norm)`` on the host (the norm was just read in the step's one read):
    ZClip's coefficient, or ``clip_grad_norm_``'s ``min(1, max_norm / (norm + 1e-6))``
    (1 for a non-finite norm: nothing is clipped, the step is skipped anyway);
    ``apply`` multiplies the gradients (one foreach op, no sync) or clamps them
    (``kind="value"``); ``update`` folds an applied step's norm into ZClip's statistics.
    The norm is the policy's ``norm_type`` norm (2 by default; ``inf`` for the largest
    element).
    """

    def __init__(self, policy: ClipPolicy) -> None:
        self.policy = policy
        self.norm_type = float(policy.norm_type)
        # ZClip on the host: the norm is in the step's one read, so its statistics and
        # coefficient cost no device op (the same float64 arithmetic as on device).
        self.zclip = ZClip(policy.zclip, on_host=True) if policy.kind == "zclip" else None

    def coefficient(self, grad_norm: float) -> tuple[float, tuple[float, bool] | None]:
        """The clip coefficient for this norm and ZClip's (clip value, clipped) for its
        update (None without ZClip)."""
        if self.zclip is not None:
            clip_value, clipped, coef = self.zclip.compute(grad_norm)
            return float(coef), (clip_value, clipped)
        if self.policy.kind == "norm" and math.isfinite(grad_norm):
            return min(1.0, self.policy.max_norm / (grad_norm + 1e-6)), None
        return 1.0, None

    def apply(self, params: list[torch.Tensor], grads: list[torch.Tensor], coef: float) -> None:
        """Clip the gradients in place (no sync; DTensor gradients through their local
        parts, see :func:`clip_grad_value_`)."""
        if self.policy.kind == "value":
            clip_grad_value_(params, self.policy.max_value)
        elif grads and coef != 1.0:
            _scale_(grads, coef)

    def apply_on_device(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        norm: torch.Tensor,
        zstate: torch.Tensor | None = None,
    ) -> None:
        """Clip from the device norm, no host read (the guard's deferred mode): the value
        clamp as :meth:`apply`; ``kind="norm"``: the coefficient :meth:`coefficient`
        computes, in float64 on the device (the same float64 operations, so the same
        bits), 1 for a non-finite norm; ZClip: its coefficient from its host state and
        the device norm (:meth:`ZClip.compute_on_device`), or from ``zstate``, a device
        copy of its state (:meth:`ZClip.compute_from`: a captured step's)."""
        if self.policy.kind == "value":
            clip_grad_value_(params, self.policy.max_value)
        elif self.zclip is not None and grads:
            coef = (
                self.zclip.compute_on_device(norm.detach())
                if zstate is None
                else self.zclip.compute_from(norm.detach(), zstate)
            )
            _scale_(grads, coef)
        elif self.policy.kind == "norm" and grads:
            n = norm.detach().double()
            quotient = torch.full_like(n, self.policy.max_norm) / (n + 1e-6)
            coef = torch.where(torch.isfinite(n), quotient.clamp(max=1.0), torch.ones_like(n))
            _scale_(grads, coef)

    def update(self, grad_norm: float, zstate: tuple[float, bool] | None) -> None:
        """Fold an applied step's norm into ZClip's statistics."""
        if self.zclip is not None and zstate is not None:
            self.zclip.update(grad_norm, *zstate)
