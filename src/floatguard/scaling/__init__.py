"""How values are kept inside a format's window: loss scaling, master weights, FP8 recipes."""

from floatguard.scaling._emulate import Coverage, NothingToEmulate, is_emulated
from floatguard.scaling.coverage import Flops, GemmCoverage, GemmRecord, coverage
from floatguard.scaling.fake_quant import (
    EmulatedConv,
    EmulatedLinear,
    EmulationRecipe,
    FakeQuant,
    emulate,
    emulated_sdpa,
    fake_quant,
    restore,
)
from floatguard.scaling.hadamard import random_hadamard_transform, rht_matrix
from floatguard.scaling.loss_scale import DynamicLossScaler
from floatguard.scaling.master import MasterWeights
from floatguard.scaling.recipes import (
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
    "DynamicLossScaler",
    "EMAScaler",
    "EmulatedConv",
    "EmulatedLinear",
    "EmulationRecipe",
    "FakeQuant",
    "Flops",
    "GemmCoverage",
    "GemmRecord",
    "MasterWeights",
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
    if name == "Recipe":  # deprecated alias of TensorRecipe (see floatguard.scaling.recipes)
        from floatguard.scaling import recipes

        return recipes.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
