"""Fake-quant training: GEMMs computed as an FP8/MX/NVFP4 GEMM would, on a CPU.

``emulate(model, EmulationRecipe.hybrid_block())`` swaps, in place, every
``nn.Linear`` (and transformers' ``Conv1D``) for an :class:`EmulatedLinear` and
every ``nn.Conv1d``/``nn.Conv2d`` for an :class:`EmulatedConv`, each sharing the
original's parameters (the optimizer keeps working). Each of the layer's three GEMMs
(forward, dgrad, wgrad) quantizes its two operands along its own reduction dim with
the recipe's choice for that operand (:class:`EmulationRecipe`, six operand recipes)
and multiplies in float32; with ``attention=True`` the two matmuls inside
``F.scaled_dot_product_attention`` are emulated too. ``restore(model)`` undoes all of
it. The layers live in :mod:`floatguard.emulation._emulated_layers`, the swapping in
:mod:`floatguard.emulation._emulate`: this module is their one public face.
"""

from __future__ import annotations

from floatguard.emulation._emulate import Coverage, emulate, restore
from floatguard.emulation._emulated_layers import (
    EmulatedConv,
    EmulatedLinear,
    FakeQuant,
    emulated_sdpa,
    fake_quant,
)
from floatguard.emulation.emulation_recipe import EmulationRecipe

__all__ = [
    "Coverage", "EmulatedConv", "EmulatedLinear", "EmulationRecipe", "FakeQuant", "emulate",
    "emulated_sdpa", "fake_quant", "restore",
]  # fmt: skip
