"""Moved to :mod:`floatguard.emulation.emulation_recipe` (this path warns; it goes in a later
release)."""

import importlib
import warnings
from typing import Any

_moved = importlib.import_module("floatguard.emulation.emulation_recipe")

warnings.warn(
    "floatguard.scaling.emulation_recipe moved to floatguard.emulation.emulation_recipe: "
    "import it from "
    "there",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
