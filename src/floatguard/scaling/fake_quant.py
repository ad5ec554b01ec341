"""Moved to :mod:`floatguard.emulation.fake_quant` (this path warns; it goes in a later
release)."""

import importlib
import warnings
from typing import Any

_moved = importlib.import_module("floatguard.emulation.fake_quant")

warnings.warn(
    "floatguard.scaling.fake_quant moved to floatguard.emulation.fake_quant: import it from there",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
