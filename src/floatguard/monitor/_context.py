"""Whether a replay is running: the hook Monitor ignores a replay's passes (they are
not steps of the run, and must not advance its step count or add records)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_depth = [0]


def is_replaying() -> bool:
    return _depth[0] > 0


@contextlib.contextmanager
def replaying() -> Iterator[None]:
    _depth[0] += 1
    try:
        yield
    finally:
        _depth[0] -= 1
