"""Peers: how a rank's guard sees the other ranks (see :mod:`floatguard.distributed`).

Words used here (the tracked collectives, the failure and the region are
:mod:`floatguard.guard.peer_waits`'):

- *messages* (:mod:`floatguard.guard.peer_mail`), by kind: ``failed`` (a rank raised
  out of its guard), ``stop`` (a rank stops with an error it found itself: the others
  stop with the same class), ``finished`` (guard.finish() or guard.close() after n
  steps), ``exited`` (the process ended without either, or a ``with`` block was left
  by an error raised outside the guard); ``status?`` / ``status``.
- *finish*: the end of the run, together: every rank tells the others after how many
  steps, and waits until every one has said the same (a GuardDesync if not).
- *the watchdog* (a thread): ends waits past ``timeout_s`` (asking the peers where they
  are, to name the ones that did not arrive), and explains a wait whose connection
  dropped (the peers that do not answer are gone).

Reading order: :meth:`Peers.finish`, :meth:`Peers._handle`, :meth:`Peers._watch`.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from floatguard.distributed import GuardDesync, PeerFailed
from floatguard.guard.peer_mail import Mailbox
from floatguard.guard.peer_state import PREFIX, describe, ranks_text
from floatguard.guard.peer_waits import PeerWaits

__all__ = ["EXIT_DRAIN_S", "Peers"]

EXIT_DRAIN_S = 10.0  # how long a process waits at exit for its peers' byes (see _at_exit)


class Peers(PeerWaits):
    """The other ranks of ``group``, as the guard sees them (see the module).

    ``timeout_s``: how long a tracked collective waits in silence before
    :class:`PeerFailed` (None: forever). ``grace_s``: after this rank's failure, how long
    it may stay blocked in a collective the guard does not own (inside :meth:`region`)
    before the watchdog ends the process, saying why (None: never).
    ``on_stop(step, reason, message)``: writes the ``stop`` event (once).
    """

    def __init__(
        self, group: Any = None, *, timeout_s: float | None, grace_s: float | None,
        device: torch.device | None = None,
        on_stop: Callable[[int, str, str], None] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(group, timeout_s, grace_s, device, on_stop)
        self._left: list[Any] = []  # works of guard collectives this rank stopped waiting for
        self.mail = Mailbox(self.global_ranks, self.rank, self._handle, self._status)
        self.mail.start()
        self._watchdog = threading.Thread(target=self._watch, name="floatguard-watch", daemon=True)
        self._watchdog.start()
        atexit.register(self._at_exit)

    def announce_failure(self, step: int, error: BaseException) -> None:
        """Tell every other rank that this one raised ``error`` out of the guard."""
        if self._closed or self.failure is not None or self.state.done:
            return  # a rank that stops because of a peer does not echo the failure
        self.state.done = "told"
        self.mail.send_all({"kind": "failed", "rank": self.rank, "step": step,
                            "error": f"{type(error).__name__}: {error}"[:700]})  # fmt: skip
        self.mail.flush(5.0)

    # ---------------------------------------------------------------- finish
    def finish(self, steps: int) -> None:
        """End the run together after ``steps`` guard steps: tell every peer, wait until
        every one has finished (or exited) after as many. A peer still stepping, or one
        that finished after another number, is a GuardDesync; one that does not answer,
        or stays silent past ``timeout_s``, a PeerFailed."""
        self.raise_if_failed()
        with self._lock:
            self.state.finishing = steps
        if not self.mail.available:  # no peer channel: the steps, all-gathered
            records = self.all_gather_json({"steps": steps}, "guard.finish()")
            done = {r: int(rec.get("steps", -1)) for r, rec in enumerate(records)}
            done.pop(self.rank)
        else:
            done = self._await_finishes(steps)
        differ = sorted((p, m) for p, m in done.items() if m != steps)
        if differ:
            p, m = differ[0]
            self._fail(GuardDesync, f"rank {self.rank} finished after {steps} guard steps, "
                       f"but rank {p} after {m}: the ranks took different numbers of guard "
                       "steps (a rank skipped or added a guard.step() call, or had more batches "
                       "than another)", (p,), steps, tell=False)  # fmt: skip
            self.raise_if_failed()
        self.state.done = "finished"
        self.mail.bye()  # every peer has finished: the channel is done with

    def _await_finishes(self, steps: int) -> dict[int, int]:
        """Every peer's finish (or exit) message: its step count, by rank."""
        msg = {"kind": "finished", "rank": self.rank, "step": steps, "how": "guard.finish()"}
        self.mail.send_all(msg)
        start = last_ask = time.monotonic()
        others = [r for r in range(self.world) if r != self.rank]
        while True:
            self.raise_if_failed()
            with self._lock:
                done = {p: m for p, (m, _how) in self.state.finished.items()}
                done.update({p: int(rec.get("steps", -1)) for p, rec in self.state.exited.items()})
            if all(r in done for r in others):
                return done
            now, late = time.monotonic(), [r for r in others if r not in done]
            if self.timeout_s is not None and now - start > self.timeout_s:
                status = self.mail.ask()
                said = "; ".join(describe(r, status.get(r)) for r in late)
                self._fail(PeerFailed, f"rank {self.rank} waited {self.timeout_s:g} s in "
                           f"guard.finish() after {steps} guard steps for {ranks_text(late)}: "
                           f"{said}", tuple(late), steps)  # fmt: skip
            elif now - last_ask > 1.0:  # a silent peer may be gone: ask
                status = self.mail.ask()
                gone = [r for r in late if status.get(r) is None]
                if gone:
                    self._fail(PeerFailed, f"rank {self.rank} stops in guard.finish() after "
                               f"{steps} guard steps: {ranks_text(gone)} does not answer "
                               "(exited or killed)", tuple(gone), steps)  # fmt: skip
                last_ask = time.monotonic()
            time.sleep(0.005)

    # ------------------------------------------------------------- messages
    def _status(self) -> dict[str, Any]:
        s = self.state
        with self._lock:
            waits = [[w.what, w.step] for w in s.waits][:2]
        since = round(time.monotonic() - s.began_at, 1)
        return {"rank": self.rank, "step": s.step, "since": since, "waits": waits,
                "finishing": s.finishing}  # fmt: skip

    def _handle(self, rec: dict[str, Any]) -> None:
        """A peer's message (the listener's thread)."""
        kind, peer, step = rec.get("kind"), rec.get("rank"), rec.get("step", -1)
        if kind in ("finished", "exited") and isinstance(peer, int):
            with self._lock:
                if kind == "finished":
                    self.state.finished[peer] = (int(step), str(rec.get("how")))
                else:
                    self.state.exited[peer] = rec
                waits = list(self.state.waits)
            if self.state.finishing is None:
                steps = int(step) if kind == "finished" else int(rec.get("steps", -1))
                late = [w for w in waits if w.step >= steps]
                if late:
                    self._check_partners(late[0].step, f"waits in {late[0].what} of")
        elif kind == "stop":
            cls = GuardDesync if rec.get("type") == "GuardDesync" else PeerFailed
            said = PREFIX.sub("", str(rec.get("message")))
            text = f"rank {self.rank} stops: rank {peer} stopped at guard step {step}: {said}"
            self._fail(cls, text, tuple(rec.get("ranks") or ()), step, tell=False)
        else:  # "failed": a peer raised out of its guard
            self._fail(PeerFailed, f"rank {self.rank} stops: rank {peer} failed at guard step "
                       f"{step} ({rec.get('error')}); the ranks cannot go on without it",
                       (peer,) if isinstance(peer, int) else (), step, tell=False)  # fmt: skip

    # ------------------------------------------------------------- watchdog
    def _watch(self) -> None:
        """End tracked waits past the timeout, explain those whose connection dropped."""
        tick = 0.1 if self.timeout_s is None else min(0.1, self.timeout_s / 10)
        while not self._closed:
            self._wake.wait(tick)
            self._wake.clear()
            with self._lock:
                waits = list(self.state.waits)
            now = time.monotonic()
            for w in waits:
                if self.failure is not None:
                    self._interrupt()
                    break
                if w.error is not None:
                    self._lost(w, w.error)
                elif self.timeout_s is not None and now - w.start > self.timeout_s:
                    self._timed_out(w)
            self.check_region(now)

    def _wait(self, launch: Callable[[], Any], what: str) -> None:
        """:meth:`PeerWaits._wait`, keeping the work a failure left pending (see _at_exit)."""
        works: list[Any] = []

        def launched() -> Any:
            works.append(launch())
            return works[-1]

        try:
            super()._wait(launched, what)
        finally:
            if works and works[0] is not None and not works[0].is_completed():
                self._left.append(works[0])

    # ------------------------------------------------------------- the end
    def _pending(self) -> bool:
        """A collective of this rank is still pending (a failure left it: its peer will
        never join)."""
        with self._lock:
            works = [w.work for w in self.state.waits if w.work is not None] + self._left
        try:
            return any(not work.is_completed() for work in works)
        except RuntimeError:  # the backend is gone
            return False

    def _end_at_exit(self) -> None:
        """The process ends after this rank's failure with a collective still pending:
        the interpreter's teardown would wait for it forever (gloo's process group joins
        the thread that runs it), so write the stop event, flush, and end the process
        (exit code 1)."""
        assert self.failure is not None
        try:
            self.stopped(self.state.step, self.failure.error())
        except Exception:  # the stop event is written already, or the log is closed
            pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        try:
            sys.stderr.write(
                f"floatguard: rank {self.rank} ends: {PREFIX.sub('', self.failure.message)}; "
                "a collective this rank began will never complete (its peer is gone), and the "
                "interpreter's teardown would wait for it forever\n"
            )
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):
            pass
        try:
            self.mail.bye()  # the peers need not wait for this rank at their exit
        except Exception:  # the group is already gone
            pass
        os._exit(1)

    def _at_exit(self) -> None:
        """The process ends: a rank that failed with a collective left pending ends at
        once (_end_at_exit); one that neither finished nor failed tells the others; then
        its part of the channel ended (:meth:`Mailbox.part`: the waits of close and exit
        together at most :data:`EXIT_DRAIN_S`) before the interpreter finalizes."""
        s = self.state
        if self.failure is not None and self._pending():
            self._end_at_exit()
        if not self.mail.available:
            return
        try:
            if self.failure is None and s.done is None and not self._closed:
                last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
                self._exited(None if last is None else f"{type(last).__name__}: {last}")
            self.mail.part(EXIT_DRAIN_S, "at exit")
        except Exception:  # the group is already gone
            pass

    def _exited(self, error: str | None) -> None:
        self.mail.send_all({"kind": "exited", "rank": self.rank, "steps": self.state.steps,
                            "error": None if error is None else error[:700]})  # fmt: skip
        self.state.done = "exited"

    def close(self, error: BaseException | None = None) -> None:
        """Stop the watchdog and end this rank's part of the channel: the peers that have
        not said bye asked where they are (one that does not answer is gone), bye, and a
        wait (at most :data:`EXIT_DRAIN_S`, said on stderr past 1 s) for the other
        peers' byes, so that no receive of the channel is pending when the caller goes on
        to ``dist.destroy_process_group()`` and the interpreter's exit: the listener's
        thread woken inside gloo's wait by a bye landing there aborted the process
        (SIGABRT, about one run in thirty on a loaded machine, after a barrier and the
        destroy). A guard closed without :meth:`finish` tells the peers it is done,
        after how many steps; with ``error`` (raised outside the guard), that it exited
        with it. A failed rank, or one closed with ``error``, does not wait for byes (its
        peers may be gone or stopping; the at-exit handler waits what is left of the time)."""
        s = self.state
        if s.done is None and self.failure is None and self.mail.available:
            if error is None:
                self.mail.send_all({"kind": "finished", "rank": self.rank, "step": s.steps,
                                    "how": "guard.close()"})  # fmt: skip
                s.done = "closed"
            else:
                self._exited(f"{type(error).__name__}: {error}")
        self._closed = True
        self._wake.set()
        if self.failure is None:  # every bye, before the group's teardown (but after error)
            self.mail.part(EXIT_DRAIN_S if error is None else 0.0, "in guard.close()")
        else:
            self.mail.bye()
        self._watchdog.join(1.0)  # it ends within its tick, once closed
        # no thread of this guard left for the caller's teardown (but a failure's work)
        self.end_waiter(1.0 if self.failure is None and error is None else 0.0)
        if self.failure is None and not self.mail.listening:  # nothing left for the exit
            atexit.unregister(self._at_exit)  # (nor a reference keeping this guard's parts)
