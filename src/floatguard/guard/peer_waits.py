"""What a rank's guard waits for under torch.distributed, and what it stops with.

Words used here:

- *tracked collectives*: every collective of the guard (the step's read, the bad-step
  all-gathers, DDP's gradient all-reduce through the guard's hook, :meth:`PeerWaits.gated`)
  is a :class:`~floatguard.guard.peer_state.Wait` with its guard step, so this rank can
  say where it waits, and a failure ends the wait (:meth:`PeerWaits.raise_if_failed`;
  a DDP gate is completed with the error, so DDP's backward raises it).
- *partners*: a peer that finished after n steps, or exited, will not join a collective
  of guard step n or later: such a collective (begun, or waiting) stops this rank now.
- *the failure*: the first one wins (a peer's message, a finish or exit, a lost
  connection, the timeout, the channel's checks); the peers are told, unless every rank
  found it in the same numbers.
- *the region*: the closure's forward and backward, where this rank may block in
  collectives the guard does not own; an error out of it that a failure explains is
  raised as that failure, and a rank still blocked there ``grace_s`` after its failure
  is ended, with its ``stop`` event written.

:class:`floatguard.guard.peers.Peers` adds what the peers say (the messages), the
watchdog, :meth:`~floatguard.guard.peers.Peers.finish` and the exit.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from floatguard.distributed import DistributedStop, GuardDesync, PeerFailed
from floatguard.guard.peer_mail import ASK_S, Mailbox
from floatguard.guard.peer_state import (
    PREFIX,
    Failure,
    PeerState,
    Wait,
    arrived,
    backend_words,
    collective_error,
    describe,
    exited_text,
    finished_text,
    ranks_text,
    resolve_gate,
    silence,
    unwrap_gate,
)

__all__ = ["PeerWaits"]

_FAULT_BYTES = 2048  # one rank's record in a bad-step all-gather


class PeerWaits:
    """This rank's tracked collectives and failure over ``group`` (see the module);
    ``mail``: the peer channel, set by :class:`~floatguard.guard.peers.Peers`."""

    mail: Mailbox

    def __init__(
        self, group: Any, timeout_s: float | None, grace_s: float | None,
        device: torch.device | None, on_stop: Callable[[int, str, str], None] | None,
    ) -> None:  # fmt: skip
        import torch.distributed as dist

        self.group = group
        self.device = device or torch.device("cpu")
        self.rank = int(dist.get_rank(group))
        self.world = int(dist.get_world_size(group))
        self.timeout_s, self.grace_s, self.on_stop = timeout_s, grace_s, on_stop
        self.failure: Failure | None = None
        self.state = PeerState()
        self._lock = threading.RLock()
        self._inside = 0
        self._region_at: float | None = None  # when this rank entered the step's region
        self._region_asked = 0.0  # when the watchdog last asked about it
        self._raised = self._closed = self._stop_written = False
        self._wake = threading.Event()  # wakes the watchdog
        self._works: queue.SimpleQueue[tuple[Any, Wait] | None] = queue.SimpleQueue()
        self._waiter = threading.Thread(target=self._await_works, name="floatguard-waiter",
                                        daemon=True)  # fmt: skip
        self._waiter.start()
        ranks = list(range(self.world))
        if group is not None:
            ranks = [int(dist.get_global_rank(group, r)) for r in ranks]
        self.global_ranks = ranks

    # ------------------------------------------------------------ the step
    def begin(self, step: int) -> None:
        """This rank begins guard step ``step``: stop now if it failed, or if a peer
        finished or exited (the step's collectives would have no partner)."""
        self.raise_if_failed()
        with self._lock:
            self.state.step, self.state.read_done = step, False
            self.state.began_at = time.monotonic()
        self._check_partners(step, "begins")
        self.raise_if_failed()

    def read_done(self) -> None:
        """The step's read is done: collectives outside a guard step now belong to the next."""
        self.state.read_done = True

    def next_step(self) -> int:
        """The guard step a collective run now belongs to (for an unarmed DDP backward)."""
        return self.state.step + 1 if self.state.read_done else self.state.step

    def _check_partners(self, step: int, doing: str) -> None:
        """A peer that finished or exited after at most ``step`` steps will not join
        (a collective of an earlier step it took part in: it completes)."""
        with self._lock:
            finished = [(p, m, how) for p, (m, how) in self.state.finished.items() if m <= step]
            exited = sorted((p, rec) for p, rec in self.state.exited.items()
                            if int(rec.get("steps", -1)) <= step)  # fmt: skip
        if exited:
            p, rec = exited[0]
            self._fail(PeerFailed, exited_text(self.rank, doing, step, p, rec), (p,), step)
        elif finished:
            p, m, how = min(finished)
            text = finished_text(self.rank, doing, step, p, m, how)
            self._fail(GuardDesync, text, (p,), step)

    # ---------------------------------------------------------- collectives
    def all_reduce_sum(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """SUM-all-reduce ``t`` in place, tracked (see the module)."""
        import torch.distributed as dist

        self._wait(lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group,
                                           async_op=True), what)  # fmt: skip
        return t

    def all_gather_json(
        self, record: dict[str, Any], what: str, size: int = _FAULT_BYTES
    ) -> list[dict[str, Any]]:
        """Every rank's ``record`` (a small JSON object, at most ``size`` bytes), in rank order."""
        import torch.distributed as dist

        data = json.dumps(record, default=str).encode()[:size]
        buf = torch.zeros(size, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        group = self.mail.group
        if group is None:  # no gloo channel: the guard's own group, on its device
            group, buf = self.group, buf.to(self.device)
        out = [torch.zeros_like(buf) for _ in range(self.world)]
        self._wait(lambda: dist.all_gather(out, buf, group=group, async_op=True), what)
        records = []
        for t in out:
            raw = bytes(t.tolist()).rstrip(b"\0")
            try:
                records.append(json.loads(raw.decode(errors="replace")))
            except json.JSONDecodeError:  # truncated at size
                records.append({"error": "record truncated"})
        return records

    def count(self, flag: bool, what: str) -> int:
        """How many ranks pass ``flag`` True: one all-reduce of one number (on the side
        gloo group where there is one), tracked; for an agreement that is usually "none"."""
        import torch.distributed as dist

        group, t = self.mail.group, torch.tensor([float(flag)], dtype=torch.float64)
        if group is None:
            group, t = self.group, t.to(self.device)
        self._wait(lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group,
                                           async_op=True), what)  # fmt: skip
        return int(t.item())

    def gated(self, work: Any, what: str, step: int) -> Any:
        """A future of ``work``'s tensor (a CPU all-reduce) that DDP may wait on:
        completed when the work is, or with this rank's failure (a peer's, a timeout, a
        lost connection), so that DDP's backward raises instead of waiting forever.

        The waiter thread polls the work: neither a callback on it nor a thread blocked
        in its ``wait``, for either returns into Python when a pending work fails
        during the interpreter's teardown (the peer's connection closes), and the
        process aborts there (SIGABRT instead of the error's exit code)."""
        gate: Any = torch.futures.Future()
        w = self._track(what, step, gate, work)
        self._works.put((work, w))
        if self.failure is not None:
            self._interrupt()
        return gate.then(unwrap_gate)

    def _await_works(self) -> None:
        """The waiter thread: every gated work in turn (a group's works end in order),
        polled (see :meth:`gated`); it ends at the None that :meth:`end_waiter` queues."""
        while True:
            item = self._works.get()
            if item is None:
                return
            work, w = item
            delay = 2e-5
            try:
                while not work.is_completed():
                    time.sleep(delay)
                    delay = min(delay * 2, 1e-3)
                work.wait()
                value = work.get_future().value()[0]
            except Exception as e:  # the backend's error: the watchdog explains it
                w.error = e
                err = self._error()
                if err is not None:  # explained already (see _interrupt)
                    resolve_gate(w.gate, err)
                self._wake.set()
                continue
            self._untrack(w)
            resolve_gate(w.gate, value)

    def end_waiter(self, seconds: float) -> None:
        """End the waiter thread once the works queued before are done (at most
        ``seconds``): closing, when no gated collective is launched any more."""
        self._works.put(None)
        self._waiter.join(seconds)

    def _track(self, what: str, step: int, gate: Any = None, work: Any = None) -> Wait:
        w = Wait(what, step, time.monotonic(), gate, work)
        with self._lock:
            self.state.waits.append(w)
        self._check_partners(step, f"waits in {what} of")
        return w

    def _untrack(self, w: Wait) -> None:
        with self._lock:
            if w in self.state.waits:
                self.state.waits.remove(w)

    def _wait(self, launch: Callable[[], Any], what: str) -> None:
        """Run a guard collective and wait for it by polling: this rank's failure (a
        peer's, the watchdog's timeout) ends the wait; a backend error is explained."""
        self.raise_if_failed()
        w = self._track(what, self.state.step)
        try:
            self.raise_if_failed()
            work = launch()
            delay = 2e-5
            while not work.is_completed():
                self.raise_if_failed()
                time.sleep(delay)
                delay = min(delay * 2, 0.005)
            work.wait()
        except DistributedStop:
            raise
        except RuntimeError as e:  # the backend's error: a peer's connection dropped
            self._lost(w, e)
            raise self._error() or e from e
        finally:
            self._untrack(w)

    # -------------------------------------------------------------- failures
    def _fail(
        self, cls: type[DistributedStop], message: str, ranks: tuple[int, ...] = (),
        step: int | None = None, tell: bool = True,
    ) -> None:  # fmt: skip
        """This rank stops with ``cls(message)``: the first failure wins; pending hook
        gates are completed with it; the peers are told (unless they all know)."""
        with self.mail.telling:  # told before anyone may flush and exit (stopped())
            with self._lock:
                if self.failure is not None:
                    return
                self.failure = Failure(cls, message, tuple(ranks), step, tell)
            if tell:
                self.mail.send_all({"kind": "stop", "rank": self.rank, "step": step,
                                    "ranks": list(ranks), "type": cls.__name__,
                                    "message": message[:700]})  # fmt: skip
        self._interrupt()
        if self._inside and self.grace_s is not None:
            timer = threading.Timer(self.grace_s, self._end_if_stuck)
            timer.daemon = True  # the process's exit does not wait for it
            timer.start()

    def fail(self, error: DistributedStop, tell: bool) -> DistributedStop:
        """Stop with ``error`` found by the caller (the channel's checks); returns it."""
        self._fail(type(error), str(error), error.ranks, error.step, tell)
        return self._error() or error

    def _error(self) -> DistributedStop | None:
        return None if self.failure is None else self.failure.error()

    def _interrupt(self) -> None:
        err = self._error()
        if err is None:
            return
        with self._lock:
            gated = [w for w in self.state.waits if w.gate is not None]
        for w in gated:
            if w.error is None and w.work is not None and w.work.is_completed():
                continue  # it succeeded (or failed, unseen yet): the waiter completes it
            resolve_gate(w.gate, err)

    def raise_if_failed(self) -> None:
        """Raise this rank's failure, if it has one (a fresh exception each time)."""
        err = self._error()
        if err is not None:
            self._raised = True
            raise err

    def _lost(self, w: Wait, error: BaseException) -> None:
        """A tracked collective failed in the backend: ask who is gone, and stop."""
        if self.failure is not None:
            return
        gone = [r for r, s in self.mail.ask().items() if s is None]
        verb = "is" if len(gone) == 1 else "are"
        who = f"{ranks_text(gone)} {verb} gone (exited or killed): no answer" if gone else (
            "a peer's connection dropped")  # fmt: skip
        self._fail(PeerFailed, f"rank {self.rank} stops at guard step {w.step}: {who} "
                   f"({w.what} failed: {backend_words(error)})", tuple(gone), w.step)  # fmt: skip

    def _timed_out(self, w: Wait) -> None:
        status = self.mail.ask()
        late = [r for r, s in status.items() if not arrived(s, w.step)]
        said = "; ".join(describe(r, status[r]) for r in (late or list(status)))
        where = f"of guard step {w.step}" if w.step >= 0 else "(before the first guard step)"
        hint = (
            "guard.resume() runs on every rank together: call it on every rank or on none"
            if "resume()" in w.what
            else "A rank out of data must call guard.finish()"
        )
        self._fail(
            PeerFailed,
            f"rank {self.rank} stops: no answer within {self.timeout_s:g} s in {w.what} "
            f"{where}: {said}. {hint}; Guard(peer_timeout_s=...) sets this limit",
            tuple(late),
            w.step,
        )

    def check_region(self, now: float) -> None:
        """The watchdog's liveness check of the region: this rank has run the step's
        forward and backward for ``timeout_s`` (where it may wait in a collective the
        guard does not own: DDP's buffer broadcast, FSDP's all-gathers, the model's
        own), so it asks the peers where they are. A peer that does not answer
        (stopped, killed, deadlocked) or has not begun this guard step (a stuck data
        loader) stops every rank with PeerFailed naming it and how long it has been
        silent; peers in the same step are computing too, and are asked again after
        another ``timeout_s``. Free on a healthy step: nothing is sent before then."""
        since, step = self._region_at, self.state.step
        if since is None or self.timeout_s is None or self.failure is not None:
            return
        if now - self._region_asked < self.timeout_s:
            return
        self._region_asked = now
        status = self.mail.ask()
        late = [
            r for r, s in status.items()
            if s is None or (s.get("finishing") is None and int(s.get("step", -1)) < step)
        ]  # fmt: skip
        if not late or self._region_at is None:  # all in this step, or the region ended
            return
        waited = time.monotonic() - since
        said = "; ".join(silence(r, status[r], waited) for r in late)
        self._fail(
            PeerFailed,
            f"rank {self.rank} stops: {said}, while rank {self.rank} has run the forward "
            f"and backward of guard step {step} for {waited:.1f} s (a collective there "
            "waits for it). Guard(peer_timeout_s=...) sets this limit",
            tuple(late),
            step,
        )

    def stopped(self, step: int, error: BaseException) -> None:
        """The guard stops with ``error`` at ``step``: this rank's failure (if the error
        did not come through :meth:`fail`), the ``stop`` event once, the peers told."""
        if self.failure is None and isinstance(error, DistributedStop):
            at = error.step if error.step is not None else step
            self._fail(type(error), str(error), error.ranks, at)
        if not self._stop_written and self.on_stop is not None:
            self._stop_written = True
            reason = "desync" if isinstance(error, GuardDesync) else "peer_failed"
            self.on_stop(step, reason, str(error))
        self.mail.flush(2.0)

    # ------------------------------------------------------------ the region
    def _end_if_stuck(self) -> None:
        """Still inside a guard region, blocked in a collective the guard does not own,
        ``grace_s`` after this rank's failure: write the stop event and end the process."""
        if self._inside and not self._raised and not self._closed and self.failure is not None:
            self.stopped(self.state.step, self.failure.error())
            sys.stderr.write(
                f"floatguard: rank {self.rank} ends: {PREFIX.sub('', self.failure.message)}; "
                f"this rank has been blocked in a collective it will never complete for "
                f"{self.grace_s:g} s (Guard(peer_grace_s=None) waits for the backend's timeout "
                "instead)\n"
            )
            sys.stderr.flush()
            os._exit(1)  # no bye: its flush would let the main thread run on meanwhile

    @contextmanager
    def region(self) -> Iterator[None]:
        """Code that may block in collectives the guard does not own (the closure's
        forward and backward): a backward the guard's hook ended raises this rank's
        failure; the watchdog may end the process in a collective it cannot end."""
        self.raise_if_failed()
        self._inside += 1
        if self._inside == 1:
            self._region_at = self._region_asked = time.monotonic()
        try:
            yield
        except DistributedStop:
            raise
        except Exception as e:
            err = self._explain(e)
            if err is None:
                raise
            raise err from e
        finally:
            self._inside -= 1
            if not self._inside:
                self._region_at = None

    def _explain(self, e: BaseException) -> DistributedStop | None:
        """This rank's failure behind an error out of a forward or backward, if any."""
        if self.failure is None:
            with self._lock:
                errored = [w for w in self.state.waits if w.error is not None]
            deadline = time.monotonic() + ASK_S + 1.0
            while errored and self.failure is None and time.monotonic() < deadline:
                time.sleep(0.01)  # the watchdog is asking who is gone
            if self.failure is None and collective_error(e):
                self._lost(Wait("a collective", self.next_step(), time.monotonic()), e)
        return self._error()
