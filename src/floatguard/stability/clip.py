"""Gradient clipping that never hides a non-finite gradient, and ZClip done sync-free.

The lessons referred to here: docs/lessons.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from floatguard._foreach import local_groups, mesh_groups, reduce_partial_grads
from floatguard._values import grad_to_modify, stored_values
from floatguard.stability._zclip_ops import DeviceOps, HostOps, MixedOps

__all__ = [
    "ZClip",
    "ZClipConfig",
    "clip_grad_norm_",
    "clip_grad_value_",
    "total_norm",
]

NonFinite = Literal["skip", "zero", "error"]


def _grads(parameters: Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    """The gradients to measure and modify in place, all strided: a sparse gradient is
    coalesced and stands here by its values (``grad_to_modify``)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    return [grad_to_modify(p) for p in params if p.grad is not None]


def _scale_(grads: list[torch.Tensor], coef: torch.Tensor | float) -> None:
    """Multiply every gradient by ``coef`` in place (a DTensor through its local part:
    a scale is the same op on every rank's piece, even a Partial addend)."""
    for (group,) in local_groups(grads):
        c = coef.to(group[0].device) if isinstance(coef, torch.Tensor) else coef
        torch._foreach_mul_(group, c)


def total_norm(grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients together, on device (float32 or the grads' dtype).

    DTensor gradients are measured as DTensors, per mesh (``full_tensor()`` of their
    norm: a collective over that mesh, as ``torch.nn.utils.clip_grad_norm_`` runs one;
    Replicate counted once, Shard pieces added), plain ones as they are, then the parts
    together: a model mixing both (a TP model's plain head), which torch's
    ``get_total_norm`` refuses, gets the global norm on every rank. (The guard measures
    its step's norm with no collective of its own: :mod:`floatguard.guard.grad_norm`.)
    """
    if not grads:
        return torch.zeros(())
    parts: list[torch.Tensor] = []
    for mesh, group in mesh_groups(grads):
        # A sparse gradient counts by its coalesced values (the dense tensor's nonzeros).
        norms = torch._foreach_norm([stored_values(g) for g in group], norm_type)
        part = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), norm_type)
        parts.append(part if mesh is None else part.full_tensor())
    if len(parts) == 1:
        return parts[0]
    dev = parts[0].device
    out: torch.Tensor = torch.linalg.vector_norm(torch.stack([p.to(dev) for p in parts]), norm_type)
    return out


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    nonfinite: NonFinite = "skip",
) -> torch.Tensor:
    """Scale gradients so their total norm is at most ``max_norm``; return the pre-clip norm.

    As ``torch.nn.utils.clip_grad_norm_`` (coefficient ``max_norm / (norm + 1e-6)``
    clamped to 1, same norm returned), except for a non-finite total norm, where
    torch multiplies every gradient by 0 (inf norm) or NaN (NaN norm) and training
    silently goes on (pytorch #46849):

    - ``"skip"`` (default): leave the gradients untouched, so the non-finite values
      stay visible and the caller can skip the step;
    - ``"zero"``: set every gradient to 0;
    - ``"error"``: raise RuntimeError (this one reads the norm on the host).

    No host sync for "skip" and "zero".
    """
    if nonfinite not in ("skip", "zero", "error"):
        raise ValueError(f"nonfinite={nonfinite!r}; use 'skip', 'zero' or 'error'")
    if not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r} must be a positive number")
    grads = _grads(parameters)
    if not grads:
        return torch.zeros(())
    norm = total_norm(grads, float(norm_type))
    finite = torch.isfinite(norm)
    if nonfinite == "error" and not bool(finite):
        raise RuntimeError(
            f"the total gradient norm is {float(norm)}; a gradient is NaN or inf "
            "(use nonfinite='skip' to leave them for a guard to handle)"
        )
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    coef = torch.where(finite, coef, torch.ones_like(coef))
    if nonfinite == "zero":
        for (group,) in local_groups(grads):
            for g in group:
                g.masked_fill_(~finite.to(g.device), 0.0)
    _scale_(grads, coef)
    return norm


def clip_grad_value_(parameters: Iterable[torch.Tensor] | torch.Tensor, clip_value: float) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]`` (NaN stays NaN).

    A DTensor gradient is clamped through its local part (the element-wise op on every
    rank's piece); one with a Partial placement (its ranks hold addends, which a clamp
    of each would not bound) is made Replicate first, a collective for such gradients
    only (:func:`~floatguard._foreach.reduce_partial_grads`)."""
    if not isinstance(clip_value, (int, float)) or not clip_value > 0:
        raise ValueError(f"clip_value={clip_value!r} must be a positive number")
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    reduce_partial_grads(params)
    for (group,) in local_groups(_grads(params)):
        torch._foreach_clamp_min_(group, -float(clip_value))
        torch._foreach_clamp_max_(group, float(clip_value))


@dataclass(frozen=True)
class ZClipConfig:
    """ZClip's published defaults (Kumar et al. 2025): EMA ``alpha`` 0.97, ``z_thresh`` 2.5,
    ``warmup_steps`` 25, ``max_grad_norm`` 1.0 (None: no absolute cap), ``mode``
    "zscore" (clip_option "adaptive_scaling" or "mean") or "percentile"."""

    alpha: float = 0.97
    z_thresh: float = 2.5
    max_grad_norm: float | None = 1.0
    eps: float = 1e-6
    warmup_steps: int = 25
    mode: Literal["zscore", "percentile"] = "zscore"
    clip_option: Literal["adaptive_scaling", "mean"] = "adaptive_scaling"
    clip_factor: float = 1.0
    skip_update_on_spike: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            raise ValueError(f"ZClipConfig.alpha={self.alpha!r} must be in (0, 1)")
        if not self.z_thresh > 0:
            raise ValueError(f"ZClipConfig.z_thresh={self.z_thresh!r} must be > 0")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(
                f"ZClipConfig.max_grad_norm={self.max_grad_norm!r} must be > 0 or None"
            )
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 1:
            raise ValueError(f"ZClipConfig.warmup_steps={self.warmup_steps!r} must be an int >= 1")
        if self.mode not in ("zscore", "percentile"):
            raise ValueError(f"ZClipConfig.mode={self.mode!r}; use 'zscore' or 'percentile'")
        if self.clip_option not in ("adaptive_scaling", "mean"):
            raise ValueError(
                f"ZClipConfig.clip_option={self.clip_option!r}; use 'adaptive_scaling' or 'mean'"
            )
        if not self.clip_factor > 0 or not self.eps > 0:
            raise ValueError("ZClipConfig.clip_factor and eps must be > 0")


class ZClip:
    """Adaptive gradient clipping on the EMA z-score of the gradient norm, on device.

    The published algorithm (the ``zclip`` package), with three repairs:

    - NaN-safe: a non-finite norm never enters the statistics (zclip's EMA would be
      NaN for ever after one bad step) and clips nothing (the gradients stay
      visibly bad for a guard to skip);
    - sync-free: mean, variance, the warmup accumulator and the "initialized" flag are
      device tensors; ``step`` never calls ``.item()`` (zclip syncs on every step);
    - checkpointable: ``state_dict`` / ``load_state_dict`` (zclip loses it on resume).

    ``compute`` (no state change) and ``update`` (fold the step into the EMA) are
    separate so a guard can decide to skip a step without polluting the statistics.
    With ``on_host=True`` the state is Python floats and ``compute`` / ``update``
    take the norm as a float: the same float64 arithmetic, written once, for a caller
    that has read the norm already (the guard reads it in its one read per step), at
    no device cost.
    """

    def __init__(
        self, config: ZClipConfig | None = None, *, on_host: bool = False, **kwargs: Any
    ) -> None:
        if config is not None and kwargs:
            raise TypeError("pass either a ZClipConfig or keyword arguments, not both")
        self.config = config or ZClipConfig(**kwargs)
        self.on_host = bool(on_host)
        self._ops: Any = HostOps if on_host else DeviceOps
        self._state: dict[str, Any] | None = None

    def _init_state(self, norm: Any) -> dict[str, Any]:
        if self.on_host:
            if self._state is None:
                self._state = dict.fromkeys(("mean", "var", "count", "w_mean", "w_m2"), 0.0)
                self._state["initialized"] = False
            return self._state
        device = norm.device
        if self._state is None or self._state["mean"].device != device:
            z = torch.zeros((), dtype=torch.float64, device=device)
            self._state = {
                "mean": z.clone(),
                "var": z.clone(),
                "count": z.clone(),
                "w_mean": z.clone(),
                "w_m2": z.clone(),
                "initialized": torch.zeros((), dtype=torch.bool, device=device),
            }
        return self._state

    def compute(self, norm: Any) -> tuple[Any, Any, Any]:
        """``(clip_value, clipped, coef)`` for this norm: the adaptive threshold (or the norm
        itself when not clipping), whether the z-test fired, and the factor to multiply the
        gradients by (max_grad_norm included; 1 for a non-finite norm). Tensors, or
        floats with ``on_host``."""
        c, o = self.config, self._ops
        st = self._init_state(norm)
        n = o.num(norm)
        finite = o.isfinite(n)
        std = o.sqrt(st["var"])
        if c.mode == "percentile":
            thr = st["mean"] + c.z_thresh * std
            fire = n > thr
        else:
            z = o.div(n - st["mean"], std + c.eps)
            fire = z > c.z_thresh
            if c.clip_option == "adaptive_scaling":
                eta = o.div(z, c.z_thresh)  # larger outliers are pulled further down
                thr = (st["mean"] + o.div(c.z_thresh * std, eta)) * c.clip_factor
            else:
                thr = st["mean"]
        clipped = st["initialized"] & finite & fire
        clip_value = o.where(clipped, thr, n)
        if c.max_grad_norm is not None:
            effective = o.clamp_max(clip_value, c.max_grad_norm)
        else:
            effective = clip_value
        warm = st["initialized"]
        # After warmup zclip scales only when the norm exceeds the threshold; during
        # warmup it calls torch's clip_grad_norm_ (coefficient clamped to 1).
        coef_after = o.where(n > effective, o.div(effective, n + 1e-6), o.one(n))
        if c.max_grad_norm is not None:
            coef_warm = o.clamp_max(o.div(c.max_grad_norm, n + 1e-6), 1.0)
        else:
            coef_warm = o.one(n)
        coef = o.where(warm, coef_after, coef_warm)
        coef = o.where(finite, coef, o.one(coef))
        return clip_value, clipped, coef

    def compute_on_device(self, norm: torch.Tensor) -> torch.Tensor:
        """The clip coefficient :meth:`compute` gives for ``norm`` (a device tensor),
        without reading it: for a host ZClip, its state (Python floats) enters the device
        arithmetic as scalars; the same float64 operations, so the same bits."""
        if not self.on_host:
            coef: torch.Tensor = self.compute(norm)[2]
            return coef
        saved = self._ops
        self._ops = MixedOps
        try:
            coef = self.compute(norm)[2]
        finally:
            self._ops = saved
        return (
            coef
            if isinstance(coef, torch.Tensor)
            else torch.full_like(norm, coef, dtype=torch.float64)
        )

    def host_state(self) -> list[float]:
        """A host ZClip's state as six floats (mean, var, count, w_mean, w_m2, and
        initialized as 1 or 0): what a captured step reads from a device copy
        (:meth:`compute_from`)."""
        if not self.on_host:
            raise ValueError("host_state() is a host ZClip's (ZClip(on_host=True))")
        st = self._init_state(0.0)
        names = ("mean", "var", "count", "w_mean", "w_m2")
        return [float(st[k]) for k in names] + [1.0 if st["initialized"] else 0.0]

    def compute_from(self, norm: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The coefficient :meth:`compute_on_device` gives, from ``state``: a float64
        device copy of :meth:`host_state`, read by device arithmetic only (both branches
        of every choice computed, then selected: the same operations whatever the
        state, so a CUDA graph can capture them; the same IEEE float64 operations as the
        host's, so the same bits)."""
        saved = (self._ops, self._state, self.on_host)
        self._ops, self.on_host = DeviceOps, False
        self._state = {
            "mean": state[0], "var": state[1], "count": state[2], "w_mean": state[3],
            "w_m2": state[4], "initialized": state[5] > 0,
        }  # fmt: skip
        try:
            coef: torch.Tensor = self.compute(norm.to(torch.float64))[2]
        finally:
            self._ops, self._state, self.on_host = saved
        return coef

    def update(self, norm: Any, clip_value: Any, clipped: Any) -> None:
        """Fold this step into the statistics (warmup buffer, then EMA). Non-finite: no-op."""
        c, o = self.config, self._ops
        st = self._init_state(norm)
        n = o.num(norm)
        finite = o.isfinite(n)
        warm = st["initialized"]
        # Warmup: Welford over the finite norms; initialise at warmup_steps of them.
        take = finite & o.not_(warm)
        count = st["count"] + o.num(take)
        safe_n = o.where(take, n, st["w_mean"])
        delta = safe_n - st["w_mean"]
        w_mean = o.where(take, st["w_mean"] + delta / o.clamp_min(count, 1.0), st["w_mean"])
        w_m2 = o.where(take, st["w_m2"] + delta * (safe_n - w_mean), st["w_m2"])
        now_init = take & (count >= c.warmup_steps)
        # After warmup: EMA of the clip value (or the norm when not clipped).
        value = o.where(clipped, o.num(clip_value), n)
        ema_ok = warm & finite
        if c.skip_update_on_spike:
            ema_ok = ema_ok & o.not_(clipped)
        value = o.where(ema_ok, value, st["mean"])
        new_mean = c.alpha * st["mean"] + (1 - c.alpha) * value
        dev = value - new_mean
        new_var = c.alpha * st["var"] + (1 - c.alpha) * (dev * dev)
        mean = o.where(ema_ok, new_mean, st["mean"])
        var = o.where(ema_ok, new_var, st["var"])
        mean = o.where(now_init, w_mean, mean)
        var = o.where(now_init, w_m2 / o.clamp_min(count, 1.0), var)
        st.update(
            mean=mean, var=var, count=count, w_mean=w_mean, w_m2=w_m2,
            initialized=warm | now_init,
        )  # fmt: skip

    def step(self, parameters: Iterable[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """Clip ``parameters``' gradients in place and update; returns the pre-clip norm.
        No host sync (with ``on_host``, one read of the norm)."""
        grads = _grads(parameters)
        if not grads:
            return torch.zeros(())
        norm = total_norm(grads)
        arg: Any = float(norm) if self.on_host else norm
        clip_value, clipped, coef = self.compute(arg)
        if self.on_host:
            _scale_(grads, float(coef))
        else:
            _scale_(grads, coef.to(dtype=torch.float32))
        self.update(arg, clip_value, clipped)
        return norm

    @property
    def mean(self) -> Any:
        return None if self._state is None else self._state["mean"]

    @property
    def var(self) -> Any:
        return None if self._state is None else self._state["var"]

    def state_dict(self) -> dict[str, Any]:
        state = {} if self._state is None else {k: _clone(v) for k, v in self._state.items()}
        return {"config": self.config.__dict__.copy(), "state": state}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load a state saved on device or on host, into this clipper's kind."""
        self.config = ZClipConfig(**sd["config"])
        if not sd["state"]:
            self._state = None
        elif self.on_host:
            self._state = {
                k: bool(v) if k == "initialized" else float(v) for k, v in sd["state"].items()
            }
        else:
            self._state = {
                k: v.clone() if isinstance(v, torch.Tensor) else
                torch.tensor(v, dtype=torch.bool if k == "initialized" else torch.float64)
                for k, v in sd["state"].items()
            }  # fmt: skip


def _clone(v: Any) -> Any:
    return v.clone() if isinstance(v, torch.Tensor) else v
