"""How values are kept inside a format's window: loss scaling and master weights."""

from floatguard.scaling.loss_scale import DynamicLossScaler
from floatguard.scaling.master import MasterWeights

__all__ = ["DynamicLossScaler", "MasterWeights"]
