"""DynamicLossScaler: GradScaler's semantics, plus bounds, hysteresis and a static mode."""

from __future__ import annotations

import math
from typing import Any

import torch

from floatguard._foreach import local_groups
from floatguard._values import grad_to_modify, values_of

__all__ = ["DynamicLossScaler"]


class DynamicLossScaler:
    """Loss scaling for fp16: multiply the loss by ``scale`` so small gradients survive,
    unscale the gradients before the optimizer, and adapt ``scale`` to overflows.

    Drop-in for ``torch.amp.GradScaler`` (``scale``, ``unscale_``, ``step``,
    ``update``, ``get_scale``, ``state_dict``) with its defaults (init 2**16,
    growth 2, backoff 0.5, interval 2000), and:

    - ``min_scale`` / ``max_scale``: the scale never leaves these bounds (GradScaler
      has neither; it can shrink to 0 and, without its finiteness check, grow to inf);
    - ``hysteresis``: back off only after that many consecutive overflow steps
      (Megatron-LM's DynamicGradScaler); 1 is GradScaler's behaviour;
    - ``dynamic=False``: a static scale (overflow steps are still skipped);
    - ``last_overflow``: which step overflowed, NaN or inf, and in which parameter.

    ``found_inf`` is computed on device by torch's fused check-and-unscale; ``step``
    reads it once (the same one sync as GradScaler's step). ``last_overflow["param"]``
    is the index of the first non-finite gradient in the optimizer's parameter order.
    Inside :class:`floatguard.Guard` the scaler's flag travels in the guard's single
    packed read instead.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        *,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        hysteresis: int = 1,
        dynamic: bool = True,
        enabled: bool = True,
    ) -> None:
        checks = [
            (0 < init_scale < math.inf, "init_scale", init_scale, "> 0 and finite"),
            (growth_factor > 1, "growth_factor", growth_factor, "> 1"),
            (0 < backoff_factor < 1, "backoff_factor", backoff_factor, "in (0, 1)"),
            (
                isinstance(growth_interval, int) and growth_interval >= 1,
                "growth_interval", growth_interval, "an int >= 1",
            ),
            (0 < min_scale <= max_scale, "min_scale", min_scale, "in (0, max_scale]"),
            (math.isfinite(max_scale), "max_scale", max_scale, "finite"),
            (isinstance(hysteresis, int) and hysteresis >= 1, "hysteresis", hysteresis, "int >= 1"),
        ]  # fmt: skip
        for ok, name, value, want in checks:
            if not ok:
                raise ValueError(f"DynamicLossScaler: {name}={value!r} must be {want}")
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.hysteresis = hysteresis
        self.dynamic = dynamic
        self.enabled = enabled
        self._scale = min(max(float(init_scale), self.min_scale), self.max_scale)
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis
        self._found_inf: torch.Tensor | None = None
        self._params: list[torch.Tensor] = []
        self._unscaled = False
        self._step = 0
        self.last_overflow: dict[str, Any] | None = None

    # ------------------------------------------------------------ GradScaler API
    def get_scale(self) -> float:
        return self._scale if self.enabled else 1.0

    def is_enabled(self) -> bool:
        return self.enabled

    def scale(self, outputs: torch.Tensor) -> torch.Tensor:
        """``outputs * scale`` (in float32 for half outputs, as GradScaler)."""
        if not self.enabled:
            return outputs
        # torch.full, not torch.tensor: a fill kernel, no host-to-device copy.
        return outputs * torch.full((), self._scale, dtype=torch.float32, device=outputs.device)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Divide the gradients by the scale in place; return the device found-inf flag.

        Uses torch's fused ``_amp_foreach_non_finite_check_and_unscale_`` where the
        gradients allow it; a per-gradient non-finite flag is kept for
        :attr:`last_overflow`. DTensor gradients are unscaled through their local parts
        (the flag is this rank's; the guard's read sums it over the ranks), one fused
        call per device. No host sync.
        """
        if self._unscaled:
            raise RuntimeError("unscale_() was already called since the last update()")
        self._params = [
            p for g in optimizer.param_groups for p in g["params"] if p.grad is not None
        ]
        # A sparse gradient is coalesced and unscaled through its values, as GradScaler
        # does for fp16 (coalescing sums duplicate rows: their overflow is found too).
        grads = [grad_to_modify(p) for p in self._params]
        device = grads[0].device if grads else torch.device("cpu")
        found = torch.zeros((), dtype=torch.float32, device=device)
        for (group,) in local_groups(grads):
            dev = group[0].device
            inv = torch.full((), 1.0 / self.get_scale(), dtype=torch.float32, device=dev)
            here = found if dev == device else torch.zeros_like(inv)
            torch._amp_foreach_non_finite_check_and_unscale_(group, here, inv)
            if here is not found:
                found = torch.maximum(found, here.to(device))
        self._found_inf = found
        self._unscaled = True
        return found

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale if needed and run ``optimizer.step`` unless a gradient overflowed.
        Reads the found-inf flag once (one host sync, as GradScaler)."""
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        if not self._unscaled:
            self.unscale_(optimizer)
        assert self._found_inf is not None
        if bool(self._found_inf):  # the one sync of a standalone scaler step
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | None = None, *, found_inf: bool | None = None) -> None:
        """Adapt the scale to this step's overflow (``found_inf``; read from the flag of
        ``unscale_`` when not given, which syncs)."""
        self._step += 1
        if not self.enabled:
            return
        if new_scale is not None:
            self._scale = min(max(float(new_scale), self.min_scale), self.max_scale)
        else:
            if found_inf is None:
                found_inf = bool(self._found_inf) if self._found_inf is not None else False
            self._apply(found_inf)
        self._unscaled = False
        self._found_inf = None

    def skip_step(self) -> None:
        """Forget this step's unscale without changing the scale or counting a step: the
        step was not taken for a reason other than overflow (a NaN batch, a spike), so
        the scale neither backs off nor moves toward its next growth."""
        self._unscaled = False
        self._found_inf = None

    def _apply(self, found_inf: bool) -> None:
        before = self._scale
        if found_inf:
            self._record_overflow(before)
            if not self.dynamic:
                return
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
        elif self.dynamic:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                grown = self._scale * self.growth_factor
                # Never to inf (GradScaler checks finiteness too) and never past max_scale.
                self._scale = min(grown, self.max_scale) if math.isfinite(grown) else self._scale

    def _record_overflow(self, scale: float) -> None:
        """Which gradient overflowed, NaN or inf: read on the overflow path only."""
        info: dict[str, Any] = {"step": self._step - 1, "scale": scale, "kind": None, "param": None}
        for i, p in enumerate(self._params):
            g = values_of(p.grad) if p.grad is not None else None
            if g is not None and not bool(torch.isfinite(g).all()):
                info.update(kind="nan" if bool(torch.isnan(g).any()) else "inf", param=i)
                break
        self.last_overflow = info

    # -------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "hysteresis": self.hysteresis,
            "dynamic": self.dynamic,
            "step": self._step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])
        for k in ("growth_factor", "backoff_factor", "min_scale", "max_scale"):
            setattr(self, k, float(state[k]))
        self.growth_interval = int(state["growth_interval"])
        self.hysteresis = int(state["hysteresis"])
        self.dynamic = bool(state["dynamic"])
        self._step = int(state.get("step", 0))
        self._unscaled = False
