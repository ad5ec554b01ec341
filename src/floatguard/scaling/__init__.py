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


def __getattr__(name: str) -> object:
    import floatguard.emulation as emulation  # (what moved: its __all__, and Recipe)

    if name in emulation.__all__ or name == "Recipe":
        warnings.warn(
            f"floatguard.scaling.{name} moved to floatguard.emulation.{name}; import it "
            "from there (the old path goes in a later release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(emulation, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
