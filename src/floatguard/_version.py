"""floatguard's version (one place: the package and the repro bundles read it)."""

__version__ = "0.1.0"
