"""FP8 / MX / NVFP4 emulation: the recipes (how a tensor is scaled and quantized, exact
to Transformer Engine, OCP MX and DeepSeek/DeepGEMM), fake-quant layers that train
as those GEMMs compute, and the coverage check of what a recipe reaches.

(Until 0.1 this lived in :mod:`floatguard.scaling`, which now holds loss scaling and
master weights; the old import paths still work, with a DeprecationWarning.)
"""

from floatguard.emulation._emulate import Coverage, NothingToEmulate, is_emulated
from floatguard.emulation._emulate import check_skip as check_skip
from floatguard.emulation.coverage import Flops, GemmCoverage, GemmRecord, coverage
from floatguard.emulation.fake_quant import (
    EmulatedConv,
    EmulatedLinear,
    EmulationRecipe,
    FakeQuant,
    emulate,
    emulated_sdpa,
    fake_quant,
    restore,
)
from floatguard.emulation.hadamard import random_hadamard_transform, rht_matrix
from floatguard.emulation.recipes import (
    MX,
    NVFP4,
    Block,
    Delayed,
    DelayedScaler,
    EMAScaler,
    NanPolicy,
    QuantResult,
    Rowwise,
    TensorRecipe,
    Tensorwise,
    amax_to_scale,
    amax_to_scale_and_fallbacks,
    quant_metrics,
    tensor_to_amax,
)

__all__ = [
    "MX",
    "NVFP4",
    "Block",
    "Coverage",
    "Delayed",
    "DelayedScaler",
    "EMAScaler",
    "EmulatedConv",
    "EmulatedLinear",
    "EmulationRecipe",
    "FakeQuant",
    "Flops",
    "GemmCoverage",
    "GemmRecord",
    "NanPolicy",
    "NothingToEmulate",
    "QuantResult",
    "Rowwise",
    "TensorRecipe",
    "Tensorwise",
    "amax_to_scale",
    "amax_to_scale_and_fallbacks",
    "coverage",
    "emulate",
    "emulated_sdpa",
    "fake_quant",
    "is_emulated",
    "quant_metrics",
    "random_hadamard_transform",
    "restore",
    "rht_matrix",
    "tensor_to_amax",
]


def __getattr__(name: str) -> object:
    if name == "Recipe":  # deprecated alias of TensorRecipe (see floatguard.emulation.recipes)
        from floatguard.emulation import recipes

        return recipes.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
