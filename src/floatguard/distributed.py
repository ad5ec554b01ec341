"""The guard under torch.distributed: what a run stops with when its ranks are not in
step, and the map of the code that sees to it.

Words used here:

- *the step's read*: every rank's step numbers, reduced once per step (all-reduced by
  the guard, :mod:`floatguard.guard.channel`, or carried on DDP's own gradient
  all-reduce by the guard's comm hook, :mod:`floatguard.guard.ddp_hook`), with the
  exact step check: every rank's 64-bit step and configuration fingerprint, compared
  exactly on the same collective (:mod:`floatguard.guard.step_check`). Ranks on another
  step, or configured differently, stop with :class:`GuardDesync` at that step.
- *the peers* (:class:`floatguard.guard.peers.Peers`): every collective of the guard
  runs on a group torch created with ``timeout=peer_timeout_s``; a collective's error
  (that timeout, a closed connection) is explained from the peers' notes in the store
  torch rendezvoused with and torch's ``monitored_barrier``, and raised as
  :class:`PeerFailed` or :class:`GuardDesync` naming the rank, the step and what
  happened, after a ``stop`` event. No thread, no at-exit handler, no forced exit.
- *agreement*: on a bad step only, each rank's localization is all-gathered, so every
  rank names the faulting rank and takes the same response.

No home-made transport: everything goes through torch.distributed.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from floatguard.errors import FloatguardError

__all__ = ["DistributedStop", "GuardDesync", "PeerFailed", "config_fingerprint"]


class DistributedStop(FloatguardError, RuntimeError):
    """A distributed stop: ``ranks`` the ranks it names (the one that failed, finished,
    exited or differs), ``step`` the guard step it happened at."""

    def __init__(self, message: str, *, ranks: tuple[int, ...] = (), step: int | None = None):
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.step = step


class PeerFailed(DistributedStop):
    """Another rank failed (raised out of its guard, exited, was killed, or stopped
    answering): this rank stops too rather than wait in a collective the other will
    never join. The process group is unusable after it: end the process."""


class GuardDesync(DistributedStop):
    """The ranks are not deciding the same guard step (another step counter, another
    number of guard steps, a backward outside guard.step()), or their guards are
    configured differently: decisions paired off by a step would be silently wrong."""


def config_fingerprint(parts: Any) -> int:
    """A 64-bit digest of what must be equal on every rank (policies, precision, the
    model's global parameter shapes): blake2b of its repr, with memory addresses
    (``0x7f...`` in a callable's repr) left out: they differ per process."""
    text = re.sub(r"0x[0-9a-fA-F]+", "0x", repr(parts))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
