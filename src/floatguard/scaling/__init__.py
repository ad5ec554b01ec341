"""How values are kept inside a format's window: loss scaling, master weights, FP8 recipes."""

from floatguard.scaling.fake_quant import (
    EmulatedLinear,
    EmulationRecipe,
    FakeQuant,
    emulate,
    fake_quant,
    restore,
)
from floatguard.scaling.loss_scale import DynamicLossScaler
from floatguard.scaling.master import MasterWeights
from floatguard.scaling.recipes import (
    MX,
    NVFP4,
    Block,
    Delayed,
    DelayedScaler,
    EMAScaler,
    QuantResult,
    Recipe,
    Rowwise,
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
    "Delayed",
    "DelayedScaler",
    "DynamicLossScaler",
    "EMAScaler",
    "EmulatedLinear",
    "EmulationRecipe",
    "FakeQuant",
    "MasterWeights",
    "QuantResult",
    "Recipe",
    "Rowwise",
    "Tensorwise",
    "amax_to_scale",
    "amax_to_scale_and_fallbacks",
    "emulate",
    "fake_quant",
    "quant_metrics",
    "restore",
    "tensor_to_amax",
]
