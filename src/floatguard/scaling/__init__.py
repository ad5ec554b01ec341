"""Loss scaling and master weights: keeping gradients and updates inside a 16-bit
format's window (:class:`DynamicLossScaler`, :class:`MasterWeights`).

FP8/MX/NVFP4 emulation moved to :mod:`floatguard.emulation`; its names (and the
modules ``floatguard.scaling.recipes``, ``.fake_quant``, ``.coverage``, ``.hadamard``,
``.emulation_recipe``) still import from here, with a DeprecationWarning.
"""

import warnings

from floatguard.scaling.loss_scale import DynamicLossScaler
from floatguard.scaling.master import MasterWeights

__all__ = ["DynamicLossScaler", "MasterWeights"]

_MOVED = frozenset(
    [
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
        "MX",
        "NVFP4",
        "NanPolicy",
        "NothingToEmulate",
        "QuantResult",
        "Recipe",
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
)


def __getattr__(name: str) -> object:
    if name in _MOVED:
        warnings.warn(
            f"floatguard.scaling.{name} moved to floatguard.emulation.{name}; import it "
            "from there (the old path goes in a later release)",
            DeprecationWarning,
            stacklevel=2,
        )
        import floatguard.emulation as emulation

        return getattr(emulation, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
