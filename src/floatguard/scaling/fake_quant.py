"""Fake-quant training: Linear layers that compute as an FP8/MX/NVFP4 GEMM would, on a CPU.

``emulate(model, EmulationRecipe.hybrid_block())`` swaps every matching
``nn.Linear`` in place for an :class:`EmulatedLinear` that shares its parameters
(the optimizer keeps working); in forward it quantizes the input and the weight
with their recipes and multiplies in float32, in backward it quantizes the output
gradient with the gradient recipe (E5M2 in the HYBRID recipes) before both
gradient GEMMs. ``restore(model)`` swaps the original modules back.

Optional accumulation emulation: round the partial sums to ``accumulate_bits``
mantissa bits every ``accumulate_every`` elements of the reduction (DeepSeek-V3
promotes Tensor Core partial sums to fp32 every 128 elements because the FP8
GEMM accumulator keeps about 14 bits).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from floatguard.formats.quantize import quantize
from floatguard.formats.registry import Format
from floatguard.scaling.recipes import MX, NVFP4, Block, Recipe, Rowwise, Tensorwise

__all__ = [
    "Coverage", "EmulatedLinear", "EmulationRecipe", "FakeQuant", "emulate", "fake_quant",
    "restore",
]  # fmt: skip


@dataclass(frozen=True)
class EmulationRecipe:
    """What each GEMM operand becomes: ``activation`` (the layer input), ``weight``,
    ``grad`` (the output gradient in backward; None = straight-through, not quantized).
    ``accumulate_bits`` / ``accumulate_every``: optional accumulator emulation."""

    activation: Recipe
    weight: Recipe
    grad: Recipe | None = None
    accumulate_bits: int | None = None
    accumulate_every: int = 128

    def __post_init__(self) -> None:
        if self.accumulate_bits is not None and not 1 <= self.accumulate_bits <= 23:
            raise ValueError(f"accumulate_bits={self.accumulate_bits!r} must be in 1..23")
        if not isinstance(self.accumulate_every, int) or self.accumulate_every < 1:
            raise ValueError(f"accumulate_every={self.accumulate_every!r} must be a positive int")

    @classmethod
    def hybrid_tensorwise(cls) -> EmulationRecipe:
        """TE HYBRID with current tensor-wise scales: e4m3 forward, e5m2 gradients."""
        return cls(Tensorwise("e4m3fn"), Tensorwise("e4m3fn"), Tensorwise("e5m2"))

    @classmethod
    def hybrid_rowwise(cls) -> EmulationRecipe:
        """Row-wise e4m3 activations and weights, row-wise e5m2 gradients (torchao rowwise)."""
        return cls(Rowwise("e4m3fn"), Rowwise("e4m3fn"), Rowwise("e5m2"))

    @classmethod
    def hybrid_block(cls) -> EmulationRecipe:
        """DeepSeek-V3 style blocks (1x128 activations, 128x128 weights, e4m3) with e5m2
        1x128 gradients (the HYBRID choice of format for the backward pass)."""
        return cls(
            Block.deepseek_v3_activation(), Block.deepseek_v3_weight(), Block("e5m2", (1, 128))
        )

    @classmethod
    def deepseek_v3(cls) -> EmulationRecipe:
        """DeepSeek-V3 as published: e4m3 everywhere, 1x128 / 128x128 blocks, and partial
        sums promoted to fp32 every 128 elements from a ~14-bit accumulator."""
        act = Block.deepseek_v3_activation()
        return cls(act, Block.deepseek_v3_weight(), act, accumulate_bits=13, accumulate_every=128)

    @classmethod
    def mxfp8(cls) -> EmulationRecipe:
        """MXFP8: e4m3 elements in 32-blocks with E8M0 scales (floor), e5m2 gradients."""
        return cls(MX("e4m3fn"), MX("e4m3fn"), MX("e5m2"))

    @classmethod
    def nvfp4(cls) -> EmulationRecipe:
        """NVFP4 activations and weights, straight-through gradients."""
        return cls(NVFP4(), NVFP4(), None)


class FakeQuant(torch.autograd.Function):
    """Forward: quantize with a recipe. Backward: straight-through, or quantize the
    incoming gradient with ``grad_recipe``."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, recipe: Recipe | None, grad_recipe: Recipe | None
    ) -> torch.Tensor:
        ctx.grad_recipe = grad_recipe
        return x if recipe is None else recipe(x).values

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        gr: Recipe | None = ctx.grad_recipe
        return (g if gr is None else gr(g).values), None, None


def fake_quant(
    x: torch.Tensor, recipe: Recipe | None, grad_recipe: Recipe | None = None
) -> torch.Tensor:
    """Differentiable fake quantization (see :class:`FakeQuant`)."""
    out: torch.Tensor = FakeQuant.apply(x, recipe, grad_recipe)  # type: ignore[no-untyped-call]
    return out


def _accumulated_matmul(a: torch.Tensor, b_t: torch.Tensor, bits: int, every: int) -> torch.Tensor:
    """``a @ b_t.T`` with partial sums over chunks of ``every`` rounded to ``bits`` mantissa
    bits, then summed in float32 (the promotion)."""
    acc_fmt = Format.custom(8, bits, name=f"acc_m{bits}")
    k = a.shape[-1]
    out = None
    for start in range(0, k, every):
        part = a[..., start : start + every] @ b_t[:, start : start + every].T
        part = quantize(part, acc_fmt)
        out = part if out is None else out + part
    assert out is not None
    return out


class EmulatedLinear(nn.Module):
    """``nn.Linear`` computed under an :class:`EmulationRecipe`; shares ``weight`` and
    ``bias`` with the module it replaces (``original``)."""

    def __init__(self, original: nn.Module, recipe: EmulationRecipe) -> None:
        super().__init__()
        self.original = [original]  # a list keeps it out of the module tree
        weight = getattr(original, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            raise TypeError(f"cannot emulate {type(original).__name__}: no 2-D weight")
        self.weight = weight
        self.bias = getattr(original, "bias", None)
        self.recipe = recipe
        # transformers' Conv1D (GPT-2) stores the weight as (in, out): y = x @ W + b
        self.transposed = not isinstance(original, nn.Linear)
        out_f, in_f = (weight.shape[1], weight.shape[0]) if self.transposed else weight.shape
        self.in_features, self.out_features = int(in_f), int(out_f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.recipe
        xq = fake_quant(x.float(), r.activation)
        # Blocks of the weight run along the reduction dim, as for nn.Linear's (out, in).
        w = self.weight.float().t() if self.transposed else self.weight.float()
        wq = fake_quant(w, r.weight)
        if r.accumulate_bits is not None:
            y = _accumulated_matmul(xq, wq, r.accumulate_bits, r.accumulate_every)
        else:
            y = xq @ wq.T
        # The output gradient is what both backward GEMMs consume: quantize it once here.
        y = fake_quant(y, None, r.grad)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, recipe={self.recipe}"


class Coverage(list[str]):
    """What :func:`emulate` swapped (the list of names), and what it left in high
    precision: ``left`` maps a module type to the names of its GEMM-like modules that
    were skipped or cannot be emulated."""

    def __init__(self, swapped: list[str], left: dict[str, list[str]]) -> None:
        super().__init__(swapped)
        self.left = left

    def summary(self) -> str:
        parts = [f"emulated {len(self)} layer(s)"]
        parts += [f"left {len(v)} {k} in high precision" for k, v in sorted(self.left.items())]
        return "; ".join(parts)


def _is_conv1d(m: nn.Module) -> bool:
    """transformers' Conv1D (matched by name and shape: transformers is not imported)."""
    w = getattr(m, "weight", None)
    return type(m).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.dim() == 2


_OTHER_GEMMS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Bilinear, nn.MultiheadAttention)


def emulate(
    model: nn.Module,
    recipe: EmulationRecipe,
    *,
    modules: tuple[type[nn.Module], ...] | None = None,
    skip: tuple[str, ...] | Callable[[str, nn.Module], bool] = (),
) -> Coverage:
    """Swap matching modules in place for emulated ones; returns what was covered.

    Covered: ``nn.Linear`` (and subclasses) and transformers' ``Conv1D`` (GPT-2's
    linear layers, weight stored (in, out)), or the ``modules`` given (subclasses of
    nn.Linear). ``skip`` is a tuple of name substrings (e.g. ``("head",)`` to keep the
    LM head in high precision, as DeepSeek-V3 does) or a predicate ``(name, module) ->
    bool``. The result lists the swapped names and, in ``.left``, by module type, the
    GEMM-like modules left in high precision (skipped, or not emulated: nn.Conv1d/2d/3d,
    nn.Bilinear, the attention matmuls); it is also logged (logger "floatguard").
    Covering nothing raises ValueError saying why: the model would train in full
    precision while you believe it is emulated.
    """
    if not isinstance(recipe, EmulationRecipe):
        raise TypeError(f"recipe must be an EmulationRecipe, got {type(recipe).__name__}")
    for m in modules or ():
        if not (isinstance(m, type) and issubclass(m, nn.Linear)):
            raise ValueError(f"only nn.Linear subclasses can be emulated, got {m!r}")
    swapped: list[str] = []
    left: dict[str, list[str]] = {}
    n_skipped = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, EmulatedLinear) or not name:
            continue
        covered = isinstance(module, modules) if modules else (
            isinstance(module, nn.Linear) or _is_conv1d(module)
        )  # fmt: skip
        if not covered:
            if isinstance(module, _OTHER_GEMMS) or (modules and isinstance(module, nn.Linear)):
                left.setdefault(type(module).__name__, []).append(name)
            continue
        skipped = skip(name, module) if callable(skip) else any(s in name for s in skip)
        if skipped:
            left.setdefault(type(module).__name__, []).append(name)
            n_skipped += 1
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, EmulatedLinear(module, recipe))
        swapped.append(name)
    coverage = Coverage(swapped, left)
    if not swapped:
        found = sorted(
            {type(m).__name__ for _, m in model.named_modules()} - {type(model).__name__}
        )
        why = (
            f"every candidate was skipped ({coverage.summary()})"
            if n_skipped
            else "the model has no nn.Linear or Conv1D (it has: "
            f"{', '.join(found[:8]) or 'no submodule'})"
        )
        raise ValueError(f"emulate covered no layer: {why}")
    logging.getLogger("floatguard").info("emulate: %s", coverage.summary())
    return coverage


def restore(model: nn.Module) -> list[str]:
    """Undo :func:`emulate`: put every original module back; returns their names."""
    names = []
    for name, module in list(model.named_modules()):
        if isinstance(module, EmulatedLinear):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.original[0])
            names.append(name)
    return names
