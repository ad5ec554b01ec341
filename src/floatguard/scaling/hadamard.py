"""Moved to :mod:`floatguard.emulation.hadamard` (this path warns; it goes in a later
release)."""

import importlib
import warnings
from typing import Any

_moved = importlib.import_module("floatguard.emulation.hadamard")

warnings.warn(
    "floatguard.scaling.hadamard moved to floatguard.emulation.hadamard: import it from there",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
