"""The peers' words and helpers: ranks in words, a collective's error told apart and
shortened to the backend's own words, a failure's class and message, the guard's
process groups made (see :mod:`floatguard.guard.peers`).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from floatguard.distributed import DistributedStop, GuardDesync, PeerFailed

__all__ = ["PREFIX", "backend_words", "collective_error", "ranks_text", "silence_why"]


PREFIX = re.compile(r"^rank \d+ stops(?: at guard step -?\d+)?: ")  # a message's "who stops"


_CALLBACK = re.compile(r"(Got the following error when running the callback: \w+: )+")


_MISSING = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


def ranks_text(ranks: list[int] | tuple[int, ...]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def collective_error(e: BaseException) -> bool:
    """Whether an error out of a forward or backward is a collective's (a lost or silent peer)."""
    return isinstance(e, RuntimeError) and (_timed_out(e) or any(
        s in str(e).lower() for s in ("connection closed", "connection reset", "broken pipe",
                                      "pair closure", "gloo", "nccl")
    ))  # fmt: skip


def _timed_out(e: BaseException) -> bool:
    """gloo's "Timed out waiting 2000ms for recv", "Application timeout caused pair closure"."""
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def backend_words(error: BaseException) -> str:
    """gloo's "[.../pair.cc:553] Connection closed by peer [addr]. This is ...": the words."""
    text = _CALLBACK.sub("", str(error))  # DDP's future wraps it, once per .then()
    first = text.splitlines()[0] if text else type(error).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0][:160]


def _finished_text(me: int, doing: str, step: int, peer: int, steps: int, how: str) -> str:
    return (
        f"rank {me} {doing} guard step {step}, but rank {peer} finished after {steps} guard "
        f"steps ({how}): the ranks took different numbers of guard steps (a rank skipped or "
        "added a guard.step() call, or had more batches than another: give every rank the "
        "same number of batches, e.g. DistributedSampler(drop_last=True))"
    )


_Why = tuple[type[DistributedStop], str, tuple[int, ...]]  # a failure's class, words, ranks


@dataclass(frozen=True)
class _Failure:
    """What this rank stops with (raised anew each time)."""

    cls: type[DistributedStop]
    message: str
    ranks: tuple[int, ...] = ()
    step: int | None = None

    def error(self) -> DistributedStop:
        return self.cls(self.message, ranks=self.ranks, step=self.step)


def _new_group(
    ranks: list[int], limit: timedelta | None, backend: str, *, world: bool, need: bool = True
) -> Any:
    """A process group of ``ranks`` (``world``: every rank of the job is in it, and every
    rank builds its guard together, so torch names it by its counter; else only its
    ranks take part, and torch names it by its ranks: one such group at a time).
    ``need``: a failure raises; else it is warned about and None returned."""
    import torch.distributed as dist

    try:
        return dist.new_group(
            ranks, timeout=limit, backend=backend, use_local_synchronization=not world
        )
    except (RuntimeError, ValueError) as e:  # a torch built without gloo; a name taken
        if need:
            raise
        warnings.warn(
            f"floatguard: no {backend} side group ({e}): a failure's silent ranks are named "
            "by the store alone, without torch.distributed.monitored_barrier",
            stacklevel=5,
        )
        return None


def silence_why(
    me: int, silent: list[int], statuses: dict[int, dict[str, Any]], step: int, what: str,
    error: BaseException, timeout_s: float | None,
) -> _Why:  # fmt: skip
    """Why a collective failed rank ``me`` when no note explains it: the ``silent`` ranks
    (no status left, or named by the barrier), else ranks on another step (their
    ``statuses``), else the backend's words. ``timeout_s``: the guard's own bound,
    None for a collective the guard does not own."""
    how = backend_words(error)
    where = f"of guard step {step}" if step >= 0 else "(before the first guard step)"
    if silent:
        if _timed_out(error):
            verb = "does" if len(silent) == 1 else "do"
            own = timeout_s is not None
            limit = f" within {timeout_s:g} s" if own else ""
            hint = (
                "guard.resume() runs on every rank together: call it on every rank or on none"
                if "resume()" in what
                else "A rank out of data must call guard.finish()"
            )
            bound = (
                "Guard(peer_timeout_s=...) sets this limit"
                if own
                else "init_process_group(timeout=...) bounds this wait (a collective the "
                "guard does not own)"
            )
            text = (
                f"rank {me} stops: no answer{limit} in {what} {where} ({how}): "
                f"{ranks_text(silent)} {verb} not answer (stopped, hung, or stuck outside "
                "the guard: a data loader, work of its own; torch.distributed."
                f"monitored_barrier found it missing). {hint}; {bound}"
            )
        else:
            verb = "is" if len(silent) == 1 else "are"
            text = (
                f"rank {me} stops {where.replace('of ', 'at ')}: {ranks_text(silent)} {verb} "
                "gone "
                f"(exited or killed): its connection closed in {what} ({how}), and it "
                "left no note and did not pass torch.distributed.monitored_barrier"
            )
        return PeerFailed, text, tuple(silent)
    other = [(r, st) for r, st in sorted(statuses.items()) if st.get("step") != step]
    if other:
        r, st = other[0]
        text = (
            f"rank {me} stops: rank {me} waits in {what} of guard step {step}, but rank {r} "
            f"in {st.get('what')} of guard step {st.get('step')}: the ranks are not in "
            "step (a rank skipped or added a guard.step() call, or ran a collective of "
            "its own)"
        )
        return GuardDesync, text, (r,)
    return PeerFailed, f"rank {me} stops at guard step {step}: {what} failed ({how})", ()
