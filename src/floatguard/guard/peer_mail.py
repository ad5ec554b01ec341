"""The peer channel: one-record messages between the ranks' guards, on a side gloo group.

Words used here:

- *a message*: a small JSON record (at most 1 KiB, zero-padded), sent point to point
  with ``isend``; its ``kind`` says what it is (see :mod:`floatguard.guard.peers`).
- *the listener*: a thread that receives from any rank and hands every message on,
  except the status questions and answers, which it handles itself: a rank asked
  "status?" answers at once with :attr:`Mailbox.status`'s record, so a rank whose main
  thread is blocked in a collective still answers; one that does not is gone.
- *flushing*: waiting (bounded) until the messages sent are out, before a process that
  stops may exit. A gloo send reports its completion only through ``wait``.
- *bye*: a rank's last message of its own (sent once, by guard.finish(), guard.close()
  or at exit; its listener still answers status questions until it ends).
  The listener ends once every peer has said it, so no receive is left pending when the
  interpreter finalizes (:meth:`Mailbox.drain`): a receive that completes then wakes the
  listener's thread inside gloo's wait, and a daemon thread taking the GIL back while
  the interpreter finalizes is ended by the interpreter in the middle of C++ code,
  which aborts the process (SIGABRT, "terminate called without an active exception")
  after a run that ended well.

No home-made transport: everything goes through torch.distributed.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

__all__ = ["ASK_S", "Mailbox"]

_MSG_BYTES = 1024
_TAG = 7919  # the peer channel's point-to-point tag
ASK_S = 2.0  # how long a status question waits for the answers (alive ranks answer at once)


class Mailbox:
    """Messages to and from the other ranks of a group (``ranks``: their global ranks, in
    group order; ``rank``: this one's index). ``on_message(record)``: what the listener
    does with a message; ``status()``: this rank's answer to a status question."""

    def __init__(
        self,
        ranks: list[int],
        rank: int,
        on_message: Callable[[dict[str, Any]], None],
        status: Callable[[], dict[str, Any]],
    ) -> None:
        import torch.distributed as dist

        self.ranks, self.rank, self.world = ranks, rank, len(ranks)
        self.on_message, self.status = on_message, status
        self.telling = threading.Lock()  # held while a failure is told (flush waits for it)
        self._lock = threading.Lock()
        self._sends: list[Any] = []
        self._replies: dict[int, dict[int, dict[str, Any]]] = {}
        self._asked = 0
        self._byes: set[int] = set()  # the peers that said bye (they send nothing more)
        self._silent: set[int] = set()  # asked, no answer, nothing heard since
        self._said_bye = False
        self._drained = 0.0  # seconds the drains waited so far (one budget)
        self._listener: threading.Thread | None = None
        try:  # every rank of the group builds its guard together; only they take part
            self.group: Any = dist.new_group(
                ranks=ranks, backend="gloo", use_local_synchronization=True
            )
        except (RuntimeError, ValueError) as e:  # a torch built without gloo
            warnings.warn(
                f"floatguard: no gloo group for the peer channel ({e}): a rank that fails "
                "cannot tell the others (they wait for their timeout)",
                stacklevel=4,
            )
            self.group = None

    def start(self) -> None:
        """Start the listener (once its owner is ready for messages)."""
        if self.group is not None and self._listener is None:
            self._listener = threading.Thread(target=self._listen, name="floatguard-peers",
                                              daemon=True)  # fmt: skip
            self._listener.start()

    @property
    def available(self) -> bool:
        return self.group is not None

    def send(self, peer: int, record: dict[str, Any]) -> None:
        """Send ``record`` to rank ``peer`` (of the group); a peer already gone is skipped."""
        import torch.distributed as dist

        if self.group is None:
            return
        data = json.dumps(record, default=str).encode()[:_MSG_BYTES]
        buf = torch.zeros(_MSG_BYTES, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        try:
            w = dist.isend(buf, dst=self.ranks[peer], group=self.group, tag=_TAG)
        except RuntimeError:  # a peer that is already gone
            return
        if w is not None:
            with self._lock:
                self._sends.append(w)

    def send_all(self, record: dict[str, Any]) -> None:
        for r in range(self.world):
            if r != self.rank:
                self.send(r, record)

    def flush(self, seconds: float) -> None:
        """Wait (at most ``seconds``) until the messages sent are out."""
        deadline = time.monotonic() + seconds
        with self.telling, self._lock:
            sends, self._sends = self._sends, []
        for w in sends:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                w.wait(timeout=timedelta(seconds=left))
            except RuntimeError:  # a peer that is gone, or the time is up
                pass

    @property
    def listening(self) -> bool:
        """The listener runs (a receive is pending): a peer has not said bye yet."""
        return self._listener is not None and self._listener.is_alive()

    def bye(self) -> None:
        """Say bye to every peer (once): this rank sends nothing more of its own (its
        listener still answers status questions until every peer has said bye)."""
        if self.group is None or self._said_bye:
            return
        self._said_bye = True
        self.send_all({"kind": "bye", "rank": self.rank})
        self.flush(1.0)

    def part(self, seconds: float, where: str) -> None:
        """End this rank's part of the channel (guard.close(), at exit): the peers that
        have not said bye are asked where they are, then bye, then :meth:`drain`. Asked
        before this rank's bye, a live peer answers (its listener ends only once it has
        had every peer's bye, this one's too), so one that does not is gone (killed, or
        its group destroyed) and is not waited for."""
        if not self._said_bye and self.listening:
            late = self._late()
            if late:
                self.ask(late)
        self.bye()
        self.drain(seconds, where)

    def _late(self) -> list[int]:
        """The peers not heard to say bye, but the silent ones."""
        with self._lock:
            heard = self._byes | self._silent | {self.rank}
        return [r for r in range(self.world) if r not in heard]

    def drain(self, seconds: float, where: str = "at exit") -> None:
        """Wait until every peer has said bye (the listener has ended), but for the
        silent ones (the last status question they were asked went unanswered, and they
        sent nothing since: stopped or killed); at most ``seconds`` less what the
        earlier drains waited (guard.close()'s, then the exit's: one budget). Called by
        guard.close() (before its caller may destroy the group under the listener) and at
        exit, before the interpreter finalizes (see the module); ``where`` is said on
        stderr when the wait lasts past 1 s, and when it gives up. No question is asked
        here: a peer that already had this rank's bye may have ended its listener (it
        would not answer) and still send its own messages and bye later. Past the
        budget the receive stays pending, and a peer's message arriving during the
        interpreter's finalization would still abort the process."""
        start = time.monotonic()
        left = seconds - self._drained
        said = False
        try:
            while self.listening:
                late = self._late()
                waited = time.monotonic() - start
                if not late:
                    return
                if waited >= left:
                    if said:  # (a wait of under 1 s gives up silently)
                        _say(f"rank {self.rank} stops waiting {where} for rank(s) "
                             f"{_ranks(late)} after {self._drained + waited:.0f} s; a message "
                             "they send while this process exits may abort it")  # fmt: skip
                    return
                if not said and waited >= 1.0:  # say why the exit lingers
                    said = True
                    _say(f"rank {self.rank} waits {where} (at most {left:.0f} s) for rank(s) "
                         f"{_ranks(late)} to close their guard (guard.close(), "
                         "guard.finish() or their exit)")  # fmt: skip
                assert self._listener is not None
                self._listener.join(min(0.02, max(left - waited, 0.001)))
        finally:
            self._drained += time.monotonic() - start

    def ask(self, ranks: list[int] | None = None) -> dict[int, dict[str, Any] | None]:
        """Every peer's status, or those of ``ranks`` (None: no answer within
        :data:`ASK_S` seconds: gone)."""
        asked = [r for r in range(self.world) if r != self.rank] if ranks is None else ranks
        with self._lock:
            self._asked += 1
            qid = self._asked
            self._replies[qid] = {}
        for r in asked:
            self.send(r, {"kind": "status?", "rank": self.rank, "id": qid})
        deadline = time.monotonic() + ASK_S
        while time.monotonic() < deadline and len(self._replies[qid]) < len(asked):
            time.sleep(0.005)
        with self._lock:
            got = self._replies.pop(qid)
            self._silent.update(r for r in asked if r not in got)
        return {r: got.get(r) for r in asked}

    def _listen(self) -> None:
        import torch.distributed as dist

        while len(self._byes) < self.world - 1:
            buf = torch.zeros(_MSG_BYTES, dtype=torch.uint8)
            try:
                work = dist.irecv(buf, group=self.group, tag=_TAG)  # from any rank
                if work is None:
                    return
                work.wait()
            except RuntimeError:  # the channel was torn down (a peer exited, shutdown)
                return
            try:
                record = json.loads(bytes(buf.tolist()).rstrip(b"\0").decode(errors="replace"))
            except json.JSONDecodeError:
                record = {"kind": "failed", "rank": "?", "step": "?", "error": "unreadable message"}
            kind, peer = record.get("kind"), record.get("rank")
            with self._lock:
                self._silent.discard(peer)  # heard from: alive
            if kind == "status?" and isinstance(peer, int):
                self.send(peer, {**self.status(), "kind": "status", "id": record.get("id")})
            elif kind == "status" and isinstance(peer, int):
                with self._lock:
                    if record.get("id") in self._replies:
                        self._replies[record["id"]][peer] = record
            elif kind == "bye" and isinstance(peer, int):
                with self._lock:
                    self._byes.add(peer)
            else:
                self.on_message(record)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _say(line: str) -> None:
    try:
        sys.stderr.write(f"floatguard: {line}\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # stderr closed at exit
        pass
