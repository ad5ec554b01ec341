"""The passes :func:`floatguard.advise` measures: the reference, a configuration against
it, the operand statistics."""

from __future__ import annotations

import math
import warnings
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from floatguard.advise.result import db
from floatguard.batch_loss import batch_loss, output_loss
from floatguard.emulation import EmulationRecipe
from floatguard.formats import get as get_format

__all__ = ["GEMMS", "OPERANDS", "Runner", "cuda_devices", "gap_of", "no_flops", "only_gemm",
           "operand_stats"]  # fmt: skip

GEMMS = ("fprop", "dgrad", "wgrad")
OPERANDS: dict[str, tuple[Any, ...]] = {
    "fprop": ("fprop_input", "fprop_weight"),
    "dgrad": ("dgrad_grad", "dgrad_weight"),
    "wgrad": ("wgrad_grad", "wgrad_input"),
}
OFF = {
    "fprop": {"activation": None, "weight": None},
    "dgrad": {"dgrad_grad": None, "dgrad_weight": None},
    "wgrad": {"wgrad_grad": None, "wgrad_input": None, "wgrad_rht": None},
}


def cuda_devices(model: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


def no_flops() -> Any:
    from floatguard.emulation.coverage import Flops

    return Flops(0, 0)


def gap_of(m: tuple[float, float]) -> dict[str, float]:
    return {"error": m[0], "sqnr_db": db(m[0]), "loss_delta": m[1]}


def only_gemm(recipe: EmulationRecipe, gemm: str) -> EmulationRecipe:
    """``recipe`` with only ``gemm``'s operands quantized (the others' resolved to None)."""
    ops = recipe.operands()
    explicit = {
        "dgrad_grad": ops["dgrad_grad"], "dgrad_weight": ops["dgrad_weight"],
        "wgrad_grad": ops["wgrad_grad"], "wgrad_input": ops["wgrad_input"],
    }  # fmt: skip
    off: dict[str, Any] = {}
    for g in GEMMS:
        if g != gemm:
            off.update(OFF[g])
    return replace(recipe, **{**explicit, **off})


class Runner:
    """Forward and backward passes of the work copy, reseeded per batch."""

    def __init__(self, model: nn.Module, batches: list[Any], loss_fn: Any, seed: int) -> None:
        self.model, self.batches, self.loss_fn, self.seed = model, batches, loss_fn, seed
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.devices = cuda_devices(model)
        self.warned = False

    def loss(self, batch: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            return batch_loss(self.loss_fn, self.model, batch, "advise")
        out = self.model(**batch) if isinstance(batch, dict) else self.model(batch)
        loss, own = output_loss(out, "advise")
        if not own and not self.warned:
            self.warned = True
            warnings.warn(
                "advise: the model returned no loss (a Hugging Face model given no labels?): "
                "ranking on the mean of its output, which says little of training; put "
                "labels in the batches or pass loss_fn=...",
                stacklevel=5,
            )
        return loss

    def one(self, i: int, batch: Any) -> tuple[float, torch.Tensor]:
        with torch.random.fork_rng(devices=self.devices):
            torch.manual_seed(self.seed + i)
            for p in self.params:
                p.grad = None
            loss = self.loss(batch)
            if loss.numel() != 1:
                raise ValueError(
                    f"advise: the loss of batch {i} has shape {tuple(loss.shape)}; loss_fn "
                    "must return one number (reduce it: .mean())"
                )
            if not loss.requires_grad:
                raise ValueError(
                    f"advise: the loss of batch {i} does not require grad (detached, under "
                    "no_grad, or no parameter requires grad): nothing can be measured"
                )
            loss.backward()  # type: ignore[no-untyped-call]
        grads = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().flatten()
            for p in self.params
        ]
        for p in self.params:
            p.grad = None
        return float(loss.detach()), torch.cat(grads) if grads else torch.zeros(0)

    def reference(self) -> list[tuple[float, torch.Tensor]]:
        """The high-precision loss and gradient per batch; an error naming the batch
        when the model cannot run it or its loss or gradient is already non-finite."""
        out = []
        for i, b in enumerate(self.batches):
            try:
                got = self.one(i, b)
            except (RuntimeError, TypeError, IndexError, KeyError, AttributeError) as e:
                if hasattr(e, "add_note"):
                    e.add_note(
                        f"advise: raised by the high-precision pass on batch {i}: each batch "
                        "is given to loss_fn(model, batch), or, without loss_fn, to the "
                        "model (a dict as keywords); pass loss_fn=... for any other call"
                    )
                raise
            if not math.isfinite(got[0]) or not bool(torch.isfinite(got[1]).all()):
                what = "loss" if not math.isfinite(got[0]) else "gradient"
                raise ValueError(
                    f"advise: the high-precision {what} of batch {i} is already non-finite "
                    "(before any emulation): nothing can be ranked against it; fix the model "
                    "or the data first (floatguard.Guard or replay() locate where)"
                )
            out.append(got)
        return out

    def against(self, ref: list[tuple[float, torch.Tensor]]) -> tuple[float, float, list[float]]:
        """(mean relative squared gradient error, mean loss change, the loss changes per
        batch) against ``ref``."""
        errors, deltas = [], []
        for i, b in enumerate(self.batches):
            loss, g = self.one(i, b)
            r_loss, r = ref[i]
            denom = float(r.pow(2).sum())
            diff = float((g - r).pow(2).sum())
            err = diff / denom if denom > 0 else (0.0 if diff == 0 else math.inf)
            errors.append(err if math.isfinite(err) else math.inf)
            deltas.append(loss - r_loss)
        return sum(errors) / len(errors), sum(deltas) / len(deltas), deltas

    def operands(self, recipe: EmulationRecipe, names: list[str]) -> dict[str, dict[str, Any]]:
        """Per linear layer, its operands on the first batch quantized in their GEMMs'
        layouts: SQNR dB, underflow and saturation fractions."""
        seen: dict[str, dict[str, torch.Tensor]] = {}
        handles = []
        for name, m in self.model.named_modules():
            w = getattr(m, "weight", None)
            conv1d = type(m).__name__ == "Conv1D"
            if name not in names or not (isinstance(m, nn.Linear) or conv1d):
                continue
            if not isinstance(w, torch.Tensor) or w.dim() != 2:
                continue

            def fwd(
                mod: nn.Module, args: Any, out: Any, name: str = name, t: bool = conv1d
            ) -> None:
                x = args[0].detach().reshape(-1, args[0].shape[-1])
                wt = getattr(mod, "weight").detach()  # noqa: B009
                seen[name] = {"x": x, "w": wt.t() if t else wt}
                if isinstance(out, torch.Tensor) and out.requires_grad:  # dY, as backward sees it

                    def grad(g: torch.Tensor, name: str = name) -> None:
                        seen[name]["dy"] = g.detach().reshape(-1, g.shape[-1])

                    out.register_hook(grad)  # type: ignore[no-untyped-call]

            handles.append(m.register_forward_hook(fwd))
        try:
            self.one(0, self.batches[0])
        finally:
            for h in handles:
                h.remove()
        ops = recipe.operands()
        out: dict[str, dict[str, Any]] = {}
        for name, t in seen.items():
            layouts = {  # [rows, reduction] as each GEMM reads it (docs/fp8.md)
                "fprop_input": t["x"], "fprop_weight": t["w"],
                "dgrad_weight": t["w"].t(), "wgrad_input": t["x"].t(),
            }  # fmt: skip
            if "dy" in t:
                layouts.update(dgrad_grad=t["dy"], wgrad_grad=t["dy"].t())
            with torch.random.fork_rng(devices=self.devices):  # stochastic rounding draws
                torch.manual_seed(self.seed)
                out[name] = {
                    op: operand_stats(ops[op], v.contiguous().float())  # type: ignore[index]
                    for op, v in layouts.items() if ops[op] is not None  # type: ignore[index]
                }  # fmt: skip
        return out


def operand_stats(r: Any, x: torch.Tensor) -> dict[str, float]:
    q = r.quantize(x)
    nonzero = x != 0
    n = int(nonzero.sum())
    noise = float((q - x).double().pow(2).sum())
    signal = float(x.double().pow(2).sum())
    fmt = getattr(r, "fmt", None) or getattr(r, "element", None) or "e2m1fn"
    half_ulp = 2.0 ** -(get_format(fmt).mantissa_bits + 1)
    top = q.abs() >= 0.5 * float(q.abs().max()) if q.numel() else q.bool()
    clamped = top & (q.abs() < x.abs() * (1 - half_ulp * 1.001)) & nonzero
    return {
        "sqnr_db": db(noise / signal) if signal > 0 else math.inf,
        "underflow": float(((q == 0) & nonzero).sum()) / n if n else 0.0,
        "saturation": float(clamped.sum()) / n if n else 0.0,
    }
