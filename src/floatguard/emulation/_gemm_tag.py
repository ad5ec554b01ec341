"""Marks the GEMMs that run on emulated (fake-quantized) operands, for the coverage audit.

Every matmul the emulation computes on quantized operands (an emulated layer's forward
GEMM and its two backward GEMMs, the two SDPA matmuls, the accumulator-emulated
chunks) runs inside :func:`emulated_gemm`; the dispatch-level audit
(:func:`floatguard.emulation.coverage.coverage`) asks :func:`is_emulating` for each
GEMM-like aten op it sees, so "GEMM FLOPs emulated" counts what really ran on
emulated operands, not what was swapped. A thread-local depth: autograd runs a CPU
backward on the thread that called ``backward()``; a custom ``backward`` enters the
context itself.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["emulated_gemm", "is_emulating"]

_state = threading.local()


@contextmanager
def emulated_gemm() -> Iterator[None]:
    """The GEMMs run inside this block take emulated operands (re-entrant)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def is_emulating() -> bool:
    """Whether the calling thread is inside :func:`emulated_gemm`."""
    return getattr(_state, "depth", 0) > 0
