"""Moved to :mod:`floatguard.emulation.recipes` (this path warns; it goes in a later
release)."""

import importlib
import warnings
from typing import Any

_moved = importlib.import_module("floatguard.emulation.recipes")

warnings.warn(
    "floatguard.scaling.recipes moved to floatguard.emulation.recipes: import it from there",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
