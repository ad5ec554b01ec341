"""See what is happening: per-module health, first-fault localization, op-level replay."""

from floatguard.monitor.hooks import Monitor
from floatguard.monitor.localize import Alert, Fault
from floatguard.monitor.replay import ReplayResult, replay

__all__ = ["Alert", "Fault", "Monitor", "ReplayResult", "replay"]
