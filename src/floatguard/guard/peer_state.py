"""What a rank's guard knows of the others under torch.distributed, and what it says.

Words used here:

- *a wait* (:class:`Wait`): a tracked collective of the guard: what it is, the guard step
  it belongs to, since when; for DDP's all-reduce, the *gate* (the future DDP waits on,
  completed by the backend or with this rank's failure) and the backend's error if it
  failed.
- *the failure* (:class:`Failure`): what this rank stops with, raised anew each time.
- *the state* (:class:`PeerState`): the step this rank last began, its waits, and what
  the peers said: who finished after how many steps, who exited.
- *a status*: a peer's answer to "where are you?" (its last step, its waits, its finish).

The messages name the rank, the guard step and what happened; the functions here build
them, :mod:`floatguard.guard.peers` decides when.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from floatguard.distributed import DistributedStop

__all__ = [
    "PREFIX",
    "Failure",
    "PeerState",
    "Wait",
    "arrived",
    "backend_words",
    "collective_error",
    "describe",
    "exited_text",
    "finished_text",
    "ranks_text",
    "resolve_gate",
    "silence",
    "unwrap_gate",
]

PREFIX = re.compile(r"^rank \d+ stops(?: at guard step -?\d+)?: ")  # a message's "who stops"


@dataclass(eq=False)
class Wait:
    """A tracked collective (see the module)."""

    what: str
    step: int
    start: float
    gate: Any = None
    work: Any = None  # the backend's work behind a gate
    error: BaseException | None = None


@dataclass(frozen=True)
class Failure:
    """What this rank stops with, and whether the peers are to be told (they are not
    when every rank found it in the same numbers)."""

    cls: type[DistributedStop]
    message: str
    ranks: tuple[int, ...] = ()
    step: int | None = None
    tell: bool = True

    def error(self) -> DistributedStop:
        return self.cls(self.message, ranks=self.ranks, step=self.step)


@dataclass
class PeerState:
    """Where this rank is and what the peers said (see the module)."""

    step: int = -1  # the guard step this rank last began
    read_done: bool = True  # that step's read is done: what comes next is the next step's
    began_at: float = field(default_factory=time.monotonic)
    waits: list[Wait] = field(default_factory=list)
    finished: dict[int, tuple[int, str]] = field(default_factory=dict)  # rank -> steps, how
    exited: dict[int, dict[str, Any]] = field(default_factory=dict)
    finishing: int | None = None  # this rank's own guard.finish() step count
    done: str | None = None  # "finished" / "closed" / "told" / "exited": nothing to say at exit

    @property
    def steps(self) -> int:
        """How many guard steps this rank has taken (as far as its collectives know)."""
        return max(self.step + 1 if self.read_done else self.step, 0)


_GATE_LOCK = threading.Lock()


def resolve_gate(gate: Any, value: Any) -> None:
    """Complete a hook's gate once (the backend's callback and the watchdog may race)."""
    with _GATE_LOCK:
        if not gate.done():
            gate.set_result(value)


def unwrap_gate(fut: Any) -> Any:
    """The gate's tensor, or its error raised (so that the future DDP waits on fails)."""
    value = fut.value()
    if isinstance(value, BaseException):
        raise value
    return value


def collective_error(e: BaseException) -> bool:
    """Whether an error out of a forward or backward is a collective's (a lost peer)."""
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        s in text for s in ("Connection closed", "Connection reset", "Broken pipe", "gloo", "NCCL")
    )


def backend_words(error: BaseException) -> str:
    """gloo's "[.../pair.cc:553] Connection closed by peer [addr]. This is ...": the words."""
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0][:160]


def ranks_text(ranks: list[int] | tuple[int, ...]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def arrived(status: dict[str, Any] | None, step: int) -> bool:
    """Whether a peer's status shows it waiting in a collective of guard step ``step``."""
    waits = (status or {}).get("waits") or []
    return any(int(s) == step for _what, s in waits)


def describe(rank: int, status: dict[str, Any] | None) -> str:
    """A peer as its status answer shows it (None: it did not answer)."""
    if status is None:
        return f"rank {rank} does not answer (its process exited, was killed or hangs)"
    if status.get("finishing") is not None:
        return f"rank {rank} finished after {status['finishing']} guard steps (guard.finish())"
    if status.get("waits"):
        what, step = status["waits"][0]
        return f"rank {rank} waits in {what} of guard step {step}"
    if int(status.get("step", -1)) < 0:
        return f"rank {rank} is alive and has not begun a guard step"
    return (
        f"rank {rank} is alive, last began guard step {status['step']} "
        f"{status.get('since', 0):g} s ago and is not in a guard collective"
    )


def silence(rank: int, status: dict[str, Any] | None, waited: float) -> str:
    """How long a late peer has been silent, as its status answer shows it (None: it
    did not answer), seen by a rank that has waited ``waited`` seconds for it."""
    if status is None:
        return (
            f"rank {rank} has been silent for at least {waited:.1f} s and does not answer "
            "(stopped, killed, or hung with the interpreter blocked)"
        )
    return (
        f"rank {rank} is alive but has made no progress for {status.get('since', 0):g} s: "
        f"it last began guard step {status['step']} and has not begun the next (a stuck "
        "data loader or host thread?)"
    )


def finished_text(me: int, doing: str, step: int, peer: int, steps: int, how: str) -> str:
    return (
        f"rank {me} {doing} guard step {step}, but rank {peer} finished after {steps} guard "
        f"steps ({how}): the ranks took different numbers of guard steps (a rank skipped or "
        "added a guard.step() call, or had more batches than another: give every rank the "
        "same number of batches, e.g. DistributedSampler(drop_last=True))"
    )


def exited_text(me: int, doing: str, step: int, peer: int, record: dict[str, Any]) -> str:
    why = f" ({record['error']})" if record.get("error") else ""
    return (
        f"rank {me} {doing} guard step {step}, but rank {peer} exited after "
        f"{record.get('steps')} guard steps without guard.finish(){why}"
    )
