"""The guard: loss scaling, clipping, detection, localization by replay, responses by cause.

:class:`Guard` is the façade; its collaborators each own one concern (see
:mod:`floatguard.guard.core`). The judgement is :mod:`floatguard.guard.policy`.
"""

from floatguard.guard.core import Guard
from floatguard.guard.graphs import GraphedStep
from floatguard.guard.types import Action, Closure, GraphUnsafe, Precision, StepResult, Watch

__all__ = [
    "Action", "Closure", "GraphUnsafe", "GraphedStep", "Guard", "Precision", "StepResult",
    "Watch",
]  # fmt: skip
