"""Where users train: ``floatguard.integrations.hf`` (transformers' Trainer),
``floatguard.integrations.lightning`` and ``floatguard.integrations.tensorboard``.

Each is an optional extra (``pip install 'floatguard[hf]'``, ``[lightning]``,
``[tensorboard]``) imported only when its module is: importing one without its
framework raises ImportError naming the extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module`` or raise ImportError saying which floatguard extra brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{what} needs {module.split('.')[0]}, which is not installed: "
            f"pip install 'floatguard[{extra}]'"
        ) from e
