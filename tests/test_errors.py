"""One error family: every exception class floatguard defines is a FloatguardError and
also the builtin it stands for; the ones a user can catch are exported."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import floatguard
from floatguard.errors import FloatguardError

# what each family member must also be, so an existing ``except`` keeps working
ALSO = {
    "SnapshotError": ValueError, "ForeignSnapshotError": ValueError,
    "SnapshotFolderBusy": ValueError, "ReproError": ValueError,
    "NothingToEmulate": ValueError, "GuardStopped": RuntimeError,
    "DistributedStop": RuntimeError, "PeerFailed": RuntimeError,
    "GuardDesync": RuntimeError, "NotRegularFile": OSError, "GraphUnsafe": RuntimeError,
}  # fmt: skip


def _exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(floatguard.__path__, "floatguard."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == module.__name__
            ):
                found[name] = obj
    return found


def test_every_exception_floatguard_defines_is_a_floatguard_error() -> None:
    classes = _exception_classes()
    assert set(ALSO) <= set(classes)
    outside = [n for n, c in classes.items() if not issubclass(c, FloatguardError)]
    assert all(n.startswith("_") for n in outside), outside  # private control flow only
    for name, builtin in ALSO.items():
        assert issubclass(classes[name], builtin), name


def test_the_errors_a_user_catches_are_exported() -> None:
    for name in [*ALSO, "FloatguardError"]:
        assert name in floatguard.__all__ and getattr(floatguard, name).__name__ == name
