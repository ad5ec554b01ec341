"""Repro bundles: a bad step as a small file that re-raises the fault anywhere.

The guard writes a bundle on a bad step when ``ResponsePolicy(repro_dir=...)`` is
set; ``floatguard repro BUNDLE`` (or :func:`reproduce`) re-runs it on any device and
says whether the same value is born again at the same op; ``floatguard repro BUNDLE
--script repro.py`` (or :func:`write_script`) writes it as a standalone PyTorch
script that needs nothing of floatguard. See ``docs/repro.md``.
"""

from floatguard.repro.bundle import (
    ReproBundle,
    ReproError,
    ReproOutcome,
    load_bundle,
    reproduce,
)
from floatguard.repro.script import write_script

__all__ = [
    "ReproBundle",
    "ReproError",
    "ReproOutcome",
    "load_bundle",
    "reproduce",
    "write_script",
]
