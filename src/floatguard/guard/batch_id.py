"""The batch a step was given, as something a user can find in their pipeline.

A forward pre-hook on the model keeps references to the inputs of the step's forward
calls (one per micro-batch; no copy, no device work: the tensors are alive anyway
until the step ends). Only when a step spikes or goes bad are they read, once, into
an identity: the step's position in the run, how many micro-batches it had, their
shapes, and a content fingerprint (SHA-256 over every input tensor's dtype, shape and
bytes, and the repr of the other leaves, first 16 hex digits): the same batch gives the
same fingerprint in any process, so it can be searched for in a data loader's output.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = ["BatchInputs", "fingerprint"]


def fingerprint(inputs: list[tuple[Any, ...]]) -> tuple[str, list[list[int]]]:
    """The SHA-256 fingerprint (16 hex digits) of ``inputs`` and the shapes of their
    tensors (one read of the tensors to the host: bad steps only)."""
    h = hashlib.sha256()
    shapes: list[list[int]] = []
    leaves, _ = tree_flatten(inputs)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach()
            if t.layout != torch.strided:
                t = t.to_dense()
            shapes.append(list(t.shape))
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            flat = t.contiguous().reshape(-1).cpu()
            h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            h.update(repr(leaf).encode())
        else:  # an object (a cache, a config): its type only (its repr may hold an address)
            h.update(type(leaf).__qualname__.encode())
    return h.hexdigest()[:16], shapes


class BatchInputs:
    """Keeps the current step's root-forward inputs (see the module)."""

    def __init__(self, model: nn.Module) -> None:
        self._calls: list[tuple[Any, ...]] = []
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if len(self._calls) < 64:  # a step's micro-batches (a runaway loop is not kept)
            self._calls.append((args, kwargs))

    def take(self) -> list[tuple[Any, ...]]:
        """The inputs recorded since the last take (and forget them)."""
        calls, self._calls = self._calls, []
        return calls

    def put(self, calls: list[tuple[Any, ...]]) -> None:
        """Record ``calls`` again (before any recorded since): a held step's inputs."""
        self._calls = [*calls, *self._calls]

    def identity(self, step: int, calls: list[tuple[Any, ...]]) -> dict[str, Any] | None:
        """The batch identity of a step given ``calls`` (None when none was recorded)."""
        if not calls:
            return None
        digest, shapes = fingerprint(calls)
        return {
            "position": step,
            "micro_batches": len(calls),
            "fingerprint": digest,
            "shapes": shapes[:16],
        }

    def close(self) -> None:
        self._handle.remove()
        self._calls = []
