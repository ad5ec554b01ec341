"""Moved to :mod:`floatguard.emulation.coverage` (this path warns; it goes in a later
release)."""

import importlib
import warnings
from typing import Any

_moved = importlib.import_module("floatguard.emulation.coverage")

warnings.warn(
    "floatguard.scaling.coverage moved to floatguard.emulation.coverage: import it from there",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
