"""The peers' notes and statuses in torch's store (see :mod:`floatguard.guard.peers`).

Keys ``floatguard/<token>/<kind>/<rank>`` in the store torch rendezvoused with (the
TCPStore or FileStore), a small JSON record each: this rank's one *note* (``failed``,
``stop``, ``finished``, ``exited``: the first wins) and its *status* (where it was
when a collective failed it). Nothing is written or read on a healthy step.
"""

from __future__ import annotations

import json
import time
from typing import Any

from floatguard.distributed import DistributedStop, GuardDesync, PeerFailed
from floatguard.guard.peer_words import PREFIX, _finished_text, _Why, ranks_text

__all__ = ["PeerNotes", "find_store"]


def find_store(group: Any) -> Any:
    """The store torch rendezvoused with (``group``'s, else the default group's)."""
    import torch.distributed as dist

    for get in (
        lambda: group.get_group_store(),
        lambda: dist.distributed_c10d._get_default_store(),
    ):
        try:
            return get()
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


class PeerNotes:
    """This rank's records in ``store`` and its peers' (``world`` ranks; none without a
    store). ``key``: the run's prefix, agreed at the guard's start."""

    def __init__(self, store: Any, rank: int, world: int, key: str = "floatguard/start") -> None:
        self.store, self.rank, self.world, self.key = store, rank, world, key
        self.noted = False

    def put(self, kind: str, record: dict[str, Any]) -> None:
        """This rank's record of ``kind`` (``note``, ``status``); a store gone is ignored."""
        if self.store is None:
            return
        try:
            self.store.set(f"{self.key}/{kind}/{self.rank}", json.dumps(record, default=str))
        except Exception:  # the store's host is gone: the others learn it from the barrier
            pass

    def get(self, kind: str, rank: int) -> dict[str, Any] | None:
        """Rank ``rank``'s record of ``kind``, or None (none yet, unreachable, not ours)."""
        if self.store is None:
            return None
        key = f"{self.key}/{kind}/{rank}"
        try:
            if not self.store.check([key]):
                return None
            rec = json.loads(self.store.get(key))
        except Exception:  # unreachable, or not ours
            return None
        return rec if isinstance(rec, dict) else None

    def note(self, kind: str, **fields: Any) -> None:
        """Leave this rank's one note (the first wins)."""
        if not self.noted:
            self.noted = True
            self.put("note", {"kind": kind, **fields})

    def explain(self, step: int, what: str) -> _Why | None:
        """The first peer note that explains a failed collective of guard step ``step``."""
        notes = {r: self.get("note", r) for r in range(self.world) if r != self.rank}
        me = self.rank
        for kind in ("failed", "stop", "exited", "finished"):
            for p, rec in notes.items():
                if rec is None or rec.get("kind") != kind:
                    continue
                at = rec.get("step", rec.get("steps", -1))
                if kind == "failed":
                    text = (f"rank {me} stops: rank {p} failed at guard step {at} "
                            f"({rec.get('error')}); the ranks cannot go on without it")  # fmt: skip
                    return PeerFailed, text, (p,)
                if kind == "stop":
                    cls: type[DistributedStop] = (
                        GuardDesync if rec.get("type") == "GuardDesync" else PeerFailed
                    )
                    said = PREFIX.sub("", str(rec.get("message")))
                    named = tuple(int(r) for r in rec.get("ranks") or ())
                    whose = (  # a relay: the rank at fault is another (3 ranks or more)
                        f", naming {ranks_text(named)} (not itself)"
                        if named and p not in named
                        else ""
                    )
                    text = f"rank {me} stops: rank {p} stopped at guard step {at}{whose}: {said}"
                    return cls, text, named
                if int(at) > step:
                    continue  # it took part in this step: not why
                if kind == "exited":
                    why = f" ({rec['error']})" if rec.get("error") else ""
                    text = (
                        f"rank {me} waits in {what} of guard step {step}, but rank "
                        f"{p} exited after {at} guard steps without guard.finish(){why}"
                    )
                    return PeerFailed, text, (p,)
                how, doing = str(rec.get("how")), f"waits in {what} of"
                return GuardDesync, _finished_text(me, doing, step, p, at, how), (p,)
        return None

    def wait(self, rank: int, until: float) -> dict[str, Any] | None:
        """Rank ``rank``'s note, waited for until ``until`` (``time.monotonic()``)."""
        while True:
            rec = self.get("note", rank)
            if rec is not None or time.monotonic() >= until:
                return rec
            time.sleep(0.02)
