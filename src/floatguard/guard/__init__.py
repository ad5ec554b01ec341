"""The guard: loss scaling, clipping, detection, localization by replay, responses by cause.

:class:`Guard` is the façade; its collaborators each own one concern (see
:mod:`floatguard.guard.core`). The judgement is :mod:`floatguard.guard.policy`.
"""

from floatguard.guard.core import Guard
from floatguard.guard.types import Action, Closure, Precision, StepResult, Watch

__all__ = ["Action", "Closure", "Guard", "Precision", "StepResult", "Watch"]
