"""Grouped GEMMs (mixture-of-experts layers) emulated expert by expert.

An MoE layer keeps its experts' weights in 3-D parameters ``[E, ., .]`` and multiplies
them in one of two ways, both emulated during the model's forward:

- ``torch._grouped_mm`` / ``torch.nn.functional.grouped_mm`` (torchtitan's
  ``GroupedExperts``, transformers' ``experts_implementation="grouped_mm"``, the default
  where the kernel exists): ``mat_a [M_total, K]`` sorted by expert with ``offs`` (the
  end row of each group), ``mat_b [E, K, N]``; or ``mat_a [E, M, K]`` with no offsets.
- the per-expert loop (transformers' eager experts): ``F.linear(x_e, W[e])`` on a slice
  of the 3-D parameter.

Each expert's product is the emulated GEMM of :mod:`floatguard.emulation._gemm` on that
expert's rows, so every operand gets the recipe's scale per expert, along each GEMM's
reduction dim: X and W along K in fprop, dY and W along N in dgrad, dY and X along the
expert's own tokens in wgrad (Transformer Engine's ``GroupedLinear`` quantizes each
expert's tensors separately; torchao's MXFP8 and rowwise grouped GEMMs scale per group
along the tokens in the weight-gradient GEMM, ``offs`` bounding each group). So a
grouped GEMM emulates exactly as the same experts written as separate ``nn.Linear``
layers would (tested). Reading the group sizes takes one host read of ``offs`` per
call. 2-D x 2-D and 3-D x 2-D forms (weight gradients written by hand) run in high
precision, as does a grouped GEMM whose weight is not a parameter of the model, or one
``skip`` names; the coverage audit counts their FLOPs as left.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from floatguard.emulation._gemm import _emulated_gemm
from floatguard.emulation.emulation_recipe import EmulationRecipe

__all__ = ["GroupedHooks", "emulated_grouped_mm", "expert_parameters"]


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor a chain of views was taken from (t itself when it is no view)."""
    while t._base is not None:
        t = t._base
    return t


def _source(t: torch.Tensor) -> torch.dtype | None:
    return t.dtype if t.dtype in (torch.bfloat16, torch.float16) else None


def emulated_grouped_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    *,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    recipe: EmulationRecipe,
) -> torch.Tensor:
    """``torch._grouped_mm`` with each group's product emulated under ``recipe``: 2-D
    ``mat_a [M_total, K]`` with ``offs`` (int32 end rows, one per group) and 3-D
    ``mat_b [E, K, N]``, or 3-D ``mat_a [E, M, K]`` without offsets. Rows past
    ``offs[-1]`` come back 0. ``bias [E, N]`` is added per group in float32. Returns
    ``out_dtype`` (default: ``mat_a``'s dtype). ValueError for other layouts."""
    src = _source(mat_a)
    a, b = mat_a.float(), mat_b.float()
    if b.dim() != 3 or a.dim() not in (2, 3):
        raise ValueError(
            f"emulated_grouped_mm: mat_a {tuple(mat_a.shape)} x mat_b {tuple(mat_b.shape)}; "
            "emulated are 2-D x 3-D (with offs) and 3-D x 3-D"
        )
    groups = int(b.shape[0])
    if a.dim() == 2:
        if offs is None:
            raise ValueError(
                "emulated_grouped_mm: a 2-D mat_a needs offs (the end row of each group)"
            )
        ends = [int(e) for e in offs.tolist()]  # the one host read of a grouped call
        if len(ends) != groups:
            raise ValueError(
                f"emulated_grouped_mm: offs has {len(ends)} groups, mat_b {groups} experts"
            )
        starts = [0, *ends[:-1]]
        parts = [a[s:e] for s, e in zip(starts, ends, strict=True)]
    else:
        parts = list(a.unbind(0))
    outs = []
    for g, part in enumerate(parts):
        y = _emulated_gemm(part, b[g].transpose(-1, -2), recipe, None, src)
        if bias is not None:
            y = y + bias[g].float()
        outs.append(y)
    if a.dim() == 3:
        out = torch.stack(outs)
    else:
        rest = a.shape[0] - (ends[-1] if ends else 0)
        if rest > 0:
            outs.append(a.new_zeros(rest, b.shape[-1]))
        out = torch.cat(outs) if outs else a.new_zeros(0, b.shape[-1])
    return out.to(out_dtype or mat_a.dtype)


def expert_parameters(
    model: nn.Module, skipped: Callable[[str, nn.Module], bool]
) -> tuple[dict[int, str], list[str]]:
    """The model's 3-D parameters (expert weights), by id, named ``module.param``; and
    the names of those left out because ``skipped(module_name, module)`` says so. The
    parameters of torch's own modules (nn.Bilinear, convolutions) are not experts."""
    kept: dict[int, str] = {}
    left: list[str] = []
    for mname, module in model.named_modules():
        if type(module).__module__.startswith(("torch.", "floatguard.")):
            continue  # torch's own layers (a Bilinear's or a conv's 3-D weight), ours
        for pname, p in module.named_parameters(recurse=False):
            if p.dim() != 3:
                continue
            name = f"{mname}.{pname}" if mname else pname
            if skipped(mname, module):
                left.append(name)
            else:
                kept[id(p)] = name
    return kept, left


class GroupedHooks:
    """Root-module hooks: during each forward, ``torch._grouped_mm``,
    ``F.grouped_mm`` and ``F.linear`` are replaced so that grouped GEMMs and per-expert
    ``F.linear`` calls on the listed expert parameters are emulated (everything else
    goes to the original functions); put back when the forward returns or raises.
    ``calls``: the emulated grouped GEMMs and per-expert products so far."""

    def __init__(self, model: nn.Module, recipe: EmulationRecipe, experts: dict[int, str]) -> None:
        self.recipe = recipe
        self.experts = experts
        self.depth = 0
        self.calls = 0
        self.saved: dict[str, Any] = {}
        self.handles = [
            model.register_forward_pre_hook(self._enter),
            model.register_forward_hook(self._exit, always_call=True),
        ]

    def _ours(self, w: torch.Tensor) -> bool:
        return id(_root(w)) in self.experts

    def _grouped(self, mat_a: torch.Tensor, mat_b: torch.Tensor, *args: Any, **kw: Any
                 ) -> torch.Tensor:  # fmt: skip
        names = ("offs", "bias", "out_dtype")
        kw.update(zip(names, args, strict=False))
        if self._ours(mat_b) and mat_b.dim() == 3 and mat_a.dim() in (2, 3):
            self.calls += 1
            return emulated_grouped_mm(mat_a, mat_b, recipe=self.recipe, **kw)
        fn = self.saved["torch._grouped_mm"]
        out: torch.Tensor = fn(mat_a, mat_b, **kw)
        return out

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                ) -> torch.Tensor:  # fmt: skip
        if weight.dim() == 2 and weight._base is not None and self._ours(weight):
            self.calls += 1
            y = _emulated_gemm(x.float(), weight.float(), self.recipe, None, _source(x))
            if bias is not None:
                y = y + bias.float()
            return y.to(x.dtype)
        out: torch.Tensor = self.saved["F.linear"](x, weight, bias)
        return out

    def _enter(self, module: nn.Module, args: Any) -> None:
        if self.depth == 0:
            self.saved = {
                "torch._grouped_mm": getattr(torch, "_grouped_mm", None),
                "F.grouped_mm": getattr(F, "grouped_mm", None),
                "F.linear": F.linear,
            }
            if self.saved["torch._grouped_mm"] is not None:
                torch._grouped_mm = self._grouped  # type: ignore[assignment]
            if self.saved["F.grouped_mm"] is not None:
                F.grouped_mm = self._grouped
            F.linear = self._linear  # type: ignore[assignment]
        self.depth += 1

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1
        if self.depth != 0:
            return
        if self.saved["torch._grouped_mm"] is not None:
            torch._grouped_mm = self.saved["torch._grouped_mm"]
        if self.saved["F.grouped_mm"] is not None:
            F.grouped_mm = self.saved["F.grouped_mm"]
        F.linear = self.saved["F.linear"]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
