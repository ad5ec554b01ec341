"""Delayed scaling: the scale of a step comes from the amax history of the steps before.

Transformer Engine's rule, from its fused update (``transformer_engine/common/recipe/
delayed_scaling.cu``: ``amax_and_scale_update_impl::kernel_bulk``, which PyTorch's
``fused_amax_and_scale_update_after_reduction`` runs):

- a step whose amax is 0 does not roll the history and does not change the scale
  (``if (last_amax != 0.0f)`` around the roll; an MoE expert that saw no tokens, a frozen
  path);
- otherwise the history rolls and its window maximum is taken with ``fmaxf``;
- ``scale = scaled_max / amax`` with ``scaled_max = fp8_max * 2**-margin`` in float32,
  the previous scale where that amax is 0 or not finite, FLT_MAX where it overflows.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

from floatguard.emulation._core import (
    FLT_MAX,
    NanPolicy,
    QuantResult,
    _amax_and_skipped,
    _check_nan_policy,
    _f32_quotient,
    _no_skips,
)
from floatguard.formats.registry import get
from floatguard.formats.rounding import quantize

__all__ = ["AmaxAlgo", "Delayed", "DelayedScaler"]

AmaxAlgo = Literal["max", "most_recent"]


def _to_f32(v: float) -> float:
    """v rounded to the nearest float32 (ties to even), as a Python float."""
    return float(struct.unpack("<f", struct.pack("<f", v))[0])


@dataclass(frozen=True)
class Delayed:
    """Delayed scaling as Transformer Engine does it (TE ``DelayedScaling``).

    The scale used on a step comes from the amaxes of the steps before it:
    ``fl(scaled_max / amax_h)`` with ``scaled_max = fl(fmt.max * fl(2**-margin))`` (TE's
    float32 expression) and ``amax_h`` the maximum (``algo="max"``) or the most recent
    entry (``"most_recent"``) of the last ``history_len`` recorded amaxes; FLT_MAX where
    the quotient overflows. A step whose amax is 0 records nothing and leaves the scale
    alone (TE's ``kernel_bulk``; floatguard used to record the 0 and drop the oldest
    entry); it counts as a fallback. An amax_h that is not finite keeps the previous
    scale, also counted.

    ``nan_policy``:

    - ``"propagate"`` (default): a NaN element makes the step's amax NaN; it is recorded,
      the window maximum is NaN while it is in the window, and the previous scale is kept
      for up to ``history_len`` steps, each counted in ``fallbacks``: the NaN stays
      visible to the guard. (TE never records a NaN amax: see the next item.)
    - ``"skip_elements"``: TE's semantics. The amax skips NaN elements (its ``fmaxf``
      amax kernels), so a tensor with one NaN still gets its finite amax and an all-NaN
      tensor an amax of 0 (a step that records nothing); inf is kept (the scale is held
      while an inf is in the window). ``QuantResult.nan_skipped`` counts the NaN
      elements of the step.

    ``skip_nonfinite`` (kept for compatibility; not TE's rule): the window maximum ignores
    NaN *and inf* entries (0 when none is finite: the previous scale). It acts on history
    entries, not elements: with ``"propagate"`` a step with one NaN element loses its
    whole amax, and an inf step does not hold the scale as it does in TE.

    In every case NaN elements come back NaN in ``values``; the scales are never NaN.
    ``margin`` may be fractional (``2**0.5`` of headroom).
    """

    fmt: str = "e4m3fn"
    history_len: int = 16
    algo: AmaxAlgo = "max"
    margin: float = 0
    skip_nonfinite: bool = False
    nan_policy: NanPolicy = "propagate"

    def __post_init__(self) -> None:
        get(self.fmt)
        if (
            isinstance(self.history_len, bool)
            or not isinstance(self.history_len, int)
            or self.history_len < 1
        ):
            raise ValueError(f"Delayed.history_len={self.history_len!r} must be an int >= 1")
        if self.algo not in get_args(AmaxAlgo):
            raise ValueError(f"Delayed.algo={self.algo!r}; use 'max' or 'most_recent'")
        if (
            isinstance(self.margin, bool)
            or not isinstance(self.margin, (int, float))
            or (not math.isfinite(self.margin))
        ):
            raise ValueError(f"Delayed.margin={self.margin!r} must be a finite number")
        _check_nan_policy("Delayed", self.nan_policy)
        f = get(self.fmt)
        if not (0 < f.max <= FLT_MAX):
            raise ValueError(
                f"Delayed.fmt={self.fmt!r}: its max {f.max:g} is past float32's range; "
                "delayed scales are float32 (use an FP8 format such as 'e4m3fn' or 'e5m2')"
            )
        if not 0 < self.scaled_max <= FLT_MAX:
            raise ValueError(
                f"Delayed.margin={self.margin!r}: fl({self.fmt} max * 2**-margin) is "
                f"{self.scaled_max:g} in float32, no usable scale; TE's margins are small "
                "non-negative integers (0, 1, 2)"
            )

    @property
    def scaled_max(self) -> float:
        """``fl(fmt.max * fl(2**-margin))``: TE's ``fp8_dtype_max(dtype) * std::pow(2.f,
        -margin)`` in float32 (exact for an integer margin)."""
        return _to_f32(get(self.fmt).max * _to_f32(2.0**-self.margin))

    def scaler(self) -> DelayedScaler:
        return DelayedScaler(self)


@dataclass
class DelayedScaler:
    """State of a :class:`Delayed` recipe: the amax history (most recent first), the
    current scale and the amax pending since the last update, on x's device.

    Two ways to drive it:

    - ``__call__(x)``: one cast and its update at once (``cast`` then ``update``): the
      recipe as a stand-alone operand recipe, one tensor per step.
    - ``cast(x)`` any number of times, then ``update()`` once per step: Transformer
      Engine's order. Every cast uses the current scale and folds its amax into the
      pending one (the max, as TE's cast kernels ``atomicMax`` into slot 0 of the
      history); ``update(amax)`` takes the pending amax (or ``amax``, the pending one
      after a reduction across ranks), rolls the history and computes the next scale.
      What :func:`~floatguard.emulation.emulate` does per layer and role.

    ``values = fmt(x * s) / s`` (saturating); the result's ``scales`` is the scale used,
    ``fallbacks`` 1 when the next scale could not be taken from the history (or
    overflowed to FLT_MAX; from ``__call__``, else 0: ``update`` returns it), and
    ``nan_skipped`` the NaN elements of x its amax skipped. No host-device sync.
    """

    recipe: Delayed
    history: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    steps: int = field(default=0)
    pending: torch.Tensor | None = None
    last_used: torch.Tensor | None = None

    def init(self, device: torch.device | str) -> None:
        """Create the state on ``device`` (zeros, scale 1) if it does not exist yet."""
        if self.history is None or self.scale is None:
            self.history = torch.zeros(self.recipe.history_len, device=device)
            self.scale = torch.ones((), device=device)
        if self.pending is None:
            self.pending = torch.zeros((), device=self.history.device)

    def cast(self, x: torch.Tensor, *, recompute: bool = False) -> QuantResult:
        """x quantized with the current scale; its amax is folded into the pending one.
        ``recompute``: an activation-checkpointing recompute of a forward that already
        ran: the scale that forward used, nothing recorded (TE copies the forward's
        scales for the recompute)."""
        r = self.recipe
        self.init(x.device)
        assert self.scale is not None and self.pending is not None
        if recompute and self.last_used is not None:
            used = self.last_used
            values = (
                quantize(x.to(torch.float32) * used, get(r.fmt), overflow="saturate") / used
            ).to(x.dtype)
            return QuantResult(values, used, torch.zeros((), dtype=torch.int64), _no_skips(x))
        used = self.scale.clone()
        self.last_used = used
        values = (quantize(x.to(torch.float32) * used, get(r.fmt), overflow="saturate") / used).to(
            x.dtype
        )
        amax, skipped = _amax_and_skipped(x, None, r.nan_policy)
        self.pending = torch.maximum(self.pending, amax.to(self.pending.dtype))
        return QuantResult(values, used, torch.zeros((), dtype=torch.int64), skipped)

    def update(self, amax: torch.Tensor | None = None) -> torch.Tensor:
        """Roll the history with the step's amax (``amax``, else the pending one) and
        compute the next scale; returns the fallback flag (0-dim int64). A step with
        amax 0 (no cast, or only zeros) leaves history and scale alone."""
        r = self.recipe
        if self.history is None or self.scale is None or self.pending is None:
            device = amax.device if amax is not None else "cpu"
            self.init(device)
        assert self.history is not None and self.scale is not None and self.pending is not None
        last = (self.pending if amax is None else amax).reshape(()).to(self.history.dtype)
        idle = last == 0  # TE: a zero amax neither rolls the history nor moves the scale
        rolled = torch.cat([last.reshape(1), self.history[:-1]])
        self.history = torch.where(idle, self.history, rolled)
        h = self.history
        if r.skip_nonfinite:  # the largest finite entry (0 when none: falls back)
            h = torch.where(torch.isfinite(h), h, torch.zeros_like(h))
        elif r.nan_policy == "skip_elements":  # fmaxf over the window, as TE's kernel
            h = torch.where(torch.isnan(h), torch.zeros_like(h), h)
        amax_h = h.amax() if r.algo == "max" else h[0]
        q, overflow = _f32_quotient(r.scaled_max, amax_h.to(torch.float32))
        usable = torch.isfinite(amax_h) & (amax_h > 0)
        new = torch.where(overflow, torch.full_like(q, FLT_MAX), q).to(torch.float32)
        self.scale = torch.where(usable & ~idle, new, self.scale)
        self.pending = torch.zeros_like(self.pending)
        self.steps += 1
        fell = ~usable | idle | overflow  # an overflowing quotient gets FLT_MAX, counted
        return fell.to(torch.int64)

    def __call__(self, x: torch.Tensor) -> QuantResult:
        res = self.cast(x)
        fell = self.update()
        return QuantResult(res.values, res.scales, fell, res.nan_skipped)

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": None if self.history is None else self.history.clone(),
            "scale": None if self.scale is None else self.scale.clone(),
            "steps": self.steps,
            "pending": None if self.pending is None else self.pending.clone(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.history, self.scale, self.steps = sd["history"], sd["scale"], int(sd["steps"])
        self.pending = sd.get("pending")
