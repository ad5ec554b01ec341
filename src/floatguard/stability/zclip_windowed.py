"""WindowedZClip: ZClip's z-score test over a plain sliding window (a reference for
the EMA statistics ZClip keeps; see :mod:`floatguard.stability.clip`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from floatguard.stability.clip import _grads, _scale_, total_norm

__all__ = ["WindowedZClip"]


class WindowedZClip:
    """The lessons' windowed variant, repaired: z-score over the last ``window`` finite
    norms; an outlier (z > ``z_thresh``) is clipped to ``mean + z_thresh * std`` (the
    lesson clips to the window mean, which throws away the step's whole excess *and*
    its ordinary size); non-finite norms never enter the window. Host-side floats."""

    def __init__(self, window: int = 10, z_thresh: float = 3.0, eps: float = 1e-6) -> None:
        if not isinstance(window, int) or window < 2:
            raise ValueError(f"window={window!r} must be an int >= 2")
        if not z_thresh > 0:
            raise ValueError(f"z_thresh={z_thresh!r} must be > 0")
        self.window, self.z_thresh, self.eps = window, z_thresh, eps
        self.history: list[float] = []

    def threshold(self) -> float | None:
        if len(self.history) < self.window:
            return None
        recent = self.history[-self.window :]
        mean = sum(recent) / len(recent)
        std = math.sqrt(sum((v - mean) ** 2 for v in recent) / len(recent))
        return mean + self.z_thresh * (std + self.eps)

    def step(self, parameters: Iterable[torch.Tensor] | torch.Tensor) -> float:
        """Clip in place; returns the pre-clip norm. Reads the norm on the host."""
        grads = _grads(parameters)
        norm = float(total_norm(grads)) if grads else 0.0
        if not math.isfinite(norm):
            return norm
        thr = self.threshold()
        if thr is not None and norm > thr:
            _scale_(grads, thr / (norm + 1e-12))
            self.history.append(thr)
        else:
            self.history.append(norm)
        del self.history[: -self.window * 4]
        return norm

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "z_thresh": self.z_thresh, "history": list(self.history)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.window, self.z_thresh = int(sd["window"]), float(sd["z_thresh"])
        self.history = [float(v) for v in sd["history"]]
