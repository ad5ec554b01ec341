"""Shared fixtures: seeded RNGs for every test; the process markers kept honest.

Markers (registered in pyproject.toml): ``ranks`` (starts torch.distributed ranks),
``subprocess`` (starts another Python or a browser), ``slow`` (tens of seconds on its
own). ``make test-fast`` runs the rest. A test without ``ranks`` or ``subprocess`` that
starts a process fails, naming the marker it needs, so the fast loop stays fast and
the markers stay true.
"""

from __future__ import annotations

import multiprocessing.process
import random
import subprocess
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

_PROCESS_MARKERS = ("ranks", "subprocess")


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _processes_are_marked(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    if any(request.node.get_closest_marker(m) for m in _PROCESS_MARKERS):
        yield
        return

    def unmarked(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{request.node.nodeid} starts a process: mark it @pytest.mark.subprocess "
            "(another program) or @pytest.mark.ranks (torch.distributed ranks)"
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", unmarked)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", unmarked)
    yield


@pytest.fixture(params=["exact", "deferred"])
def guard_sync(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a guard test in both modes: ``Guard(sync=...)`` defaults to the parameter for
    the test (``pytestmark = pytest.mark.usefixtures("guard_sync")``). A test marked
    ``exact_only(reason)`` watches what the exact mode does within the same call (the
    scheduler stepped, a patched internal raising): skipped in the deferred run."""
    from floatguard import Guard

    marker = request.node.get_closest_marker("exact_only")
    if request.param == "deferred" and marker is not None:
        pytest.skip(f"exact mode only: {marker.args[0] if marker.args else ''}")
    defaults = Guard.__init__.__kwdefaults__
    assert defaults is not None and "sync" in defaults
    monkeypatch.setitem(defaults, "sync", request.param)
    return str(request.param)
