"""Updates lost to rounding: 16-bit weights that stop learning without a NaN.

A bfloat16 weight has 8 significant bits: an update smaller than half its unit in the
last place (``|dw| < ulp(w) / 2``, about ``|w| / 512``) rounds back to the same value
and is lost. AdamW at lr 1e-4 moves every element by about 1e-4 a step, so a bf16
weight of magnitude above ~0.05 never moves at all; fp16 (11 bits) loses updates below
``|w| / 4096``. The run does not NaN; it stops learning (or drifts).

The measure, on sampled applied steps only (every ``every``-th; other steps cost one
counter): for each 16-bit (or narrower) floating parameter the optimizer updates and
that has a gradient, a fixed sample of at most ``sample`` elements (evenly strided over
the flattened tensor) is copied before ``optimizer.step()``; after it, an element whose
gradient was nonzero (so its intended update was nonzero) but whose stored value did
not change lost its update to rounding. The per-layer fraction of such elements is read
on that sampled step (its one extra host read). Parameters in float32 or float64 (the
optimizer's fp32 master weights, autocast with fp32 weights) are not measured: their
updates are not lost at any LR a run uses, so such runs never pay nor warn; frozen
parameters (no gradient, or not in the optimizer) are not measured either.

The warning: over the last ``window`` samples, a layer whose mean lost fraction is at
least ``threshold`` ("most elements") is named, with the fraction, in one ``warning``
event (code ``stalled_updates``), once per run: only when most of that layer's sampled
elements also never moved since the window's first sample (an update lost on one step
and made on the next is noise; a weight that never moves has stopped learning). Not at
the end of a schedule: a sample taken while the LR is below ``lr_floor`` times the
largest LR the group has used so far (a cosine or linear decay's tail, where tiny
updates are intended) does not count, and resets the window: an update lost there is
the schedule's choice, not a precision bug.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["StallWatch"]

_NARROW = (torch.bfloat16, torch.float16)


def _narrow(p: torch.Tensor) -> bool:
    if p.dtype in _NARROW:
        return True
    return p.is_floating_point() and p.element_size() == 1  # float8 weights


@dataclass
class _Sample:
    param: torch.Tensor
    name: str
    index: torch.Tensor
    before: torch.Tensor
    intended: torch.Tensor


class StallWatch:
    """Measures how much of each sampled update is lost to rounding (see the module)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        names: dict[int, str],
        *,
        every: int = 10,
        window: int = 5,
        threshold: float = 0.5,
        lr_floor: float = 0.5,
        sample: int = 4096,
    ) -> None:
        self.optimizer = optimizer
        self.names = names
        self.every, self.window, self.threshold = every, window, threshold
        self.lr_floor, self.sample = lr_floor, sample
        self.active = any(
            _narrow(p) for g in optimizer.param_groups for p in g["params"] if p.requires_grad
        )
        self._count = 0
        self._pending: list[_Sample] = []
        self._history: list[dict[str, tuple[int, int]]] = []  # per sample: name -> (lost, n)
        self._steps: list[int] = []
        self._dtypes: dict[str, str] = {}
        self._numel: dict[str, int] = {}
        self._peak: list[float] = [0.0] * len(optimizer.param_groups)
        self._lr = 0.0
        self.warned: set[str] = set()
        # the sampled values as the window's first sample began: a layer is only said
        # to stall when most of its sampled elements also never moved since then
        self._origins: list[dict[str, torch.Tensor]] = []  # per kept sample: its befores
        self._unmoved: dict[str, float] = {}

    def before(self, lr_factor: float) -> None:
        """Before ``optimizer.step()`` of an applied step: on a sampled one, copy each
        measured parameter's sample and whether its gradient there is nonzero."""
        if not self.active:
            return
        self._count += 1
        if self._count % self.every:
            return
        if len(self._peak) != len(self.optimizer.param_groups):
            self._peak = [0.0] * len(self.optimizer.param_groups)
        low = False
        for i, group in enumerate(self.optimizer.param_groups):
            lr = group.get("lr")
            if not isinstance(lr, (int, float)) or not lr:
                continue
            lr = float(lr) * lr_factor
            self._peak[i] = max(self._peak[i], lr)
            low = low or lr < self.lr_floor * self._peak[i]
            self._lr = lr
        if low:  # a schedule's tail: tiny updates are intended (see the module)
            self._history.clear()
            self._steps.clear()
            self._origins.clear()
            return
        pending: list[_Sample] = []
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                if not group.get("lr"):  # lr 0: a group frozen by its LR moves by design
                    continue
                for p in group["params"]:
                    g = p.grad
                    if g is None or not _narrow(p) or g.layout != torch.strided:
                        continue
                    flat = p.detach().reshape(-1)
                    n = flat.numel()
                    if n == 0:
                        continue
                    stride = max(1, n // self.sample)
                    index = torch.arange(0, n, stride, device=p.device)[: self.sample]
                    name = self.names.get(id(p), f"param{len(pending)}")
                    self._dtypes[name] = str(p.dtype).removeprefix("torch.")
                    self._numel[name] = n
                    intended = g.detach().reshape(-1)[index] != 0
                    pending.append(_Sample(p, name, index, flat[index].clone(), intended))
        self._pending = pending

    def after(self, step: int) -> dict[str, Any] | None:
        """After the update of a sampled step: read the lost fractions (this step's one
        extra read) and return the warning's evidence when a layer newly stalled."""
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        with torch.no_grad():
            self._origins.append({s.name: s.before for s in pending})
            del self._origins[: -self.window]
            first = self._origins[0]
            counts = []
            for s in pending:
                now = s.param.detach().reshape(-1)[s.index]
                lost = s.intended & (now == s.before)
                origin = first.get(s.name, s.before)
                same = origin.shape == now.shape
                unmoved = (now == origin).sum() if same else torch.zeros((), device=now.device)
                counts += [lost.sum(), s.intended.sum(), unmoved, now.new_tensor(now.numel())]
            values = torch.stack([c.double() for c in counts]).tolist()  # the sampled read
        self._history.append(
            {s.name: (int(values[4 * i]), int(values[4 * i + 1])) for i, s in enumerate(pending)}
        )
        self._unmoved = {
            s.name: values[4 * i + 2] / max(values[4 * i + 3], 1.0) for i, s in enumerate(pending)
        }
        self._steps.append(step)
        del self._history[: -self.window]
        del self._steps[: -self.window]
        if len(self._history) < self.window:
            return None
        totals: dict[str, list[int]] = {}
        for sample in self._history:
            for name, (lost_n, count) in sample.items():
                acc = totals.setdefault(name, [0, 0])
                acc[0] += lost_n
                acc[1] += count
        fractions = {name: lost / n for name, (lost, n) in totals.items() if n}
        stalled = [
            n
            for n, f in fractions.items()
            if f >= self.threshold and self._unmoved.get(n, 1.0) >= self.threshold
        ]
        if not stalled or self.warned:
            return None
        self.warned.update(stalled)
        lost_all = sum(t[0] for t in totals.values())
        n_all = sum(t[1] for t in totals.values())
        layers = sorted(stalled, key=lambda n: -fractions[n])
        return {
            "layers": [
                {
                    "name": n,
                    "dtype": self._dtypes.get(n, "?"),
                    "fraction": round(fractions[n], 4),
                    "numel": self._numel.get(n, 0),
                }
                for n in layers
            ],
            "fraction": round(lost_all / n_all, 4) if n_all else 0.0,
            "window": [self._steps[0], self._steps[-1]],
            "samples": len(self._history),
            "lr": self._lr,
            "unmoved": {n: round(self._unmoved.get(n, 0.0), 4) for n in layers},
        }

    @staticmethod
    def message(evidence: dict[str, Any]) -> str:
        layers = evidence["layers"]
        named = ", ".join(f"{x['name']} ({x['fraction']:.0%}, {x['dtype']})" for x in layers[:4])
        more = f" and {len(layers) - 4} more" if len(layers) > 4 else ""
        a, b = evidence["window"]
        return (
            f"updates lost to rounding in 16-bit weights: over steps {a}-{b}, "
            f"{evidence['fraction']:.0%} of the sampled updates (elements with a nonzero "
            f"gradient) rounded back to the same weight, and most sampled elements of "
            f"{named}{more} never moved over the window, at lr {evidence['lr']:.3g}. "
            "Keep the weights in fp32 and compute in 16 bits (Guard(precision='bf16'): "
            "autocast over fp32 weights), or fp32 master weights (floatguard.MasterWeights "
            "in a loop of your own), or stochastic rounding / Kahan-compensated updates; "
            "raise the LR only if that is the intent"
        )
