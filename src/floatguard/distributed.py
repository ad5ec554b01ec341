"""The guard under torch.distributed: the errors a run stops with when its ranks are not
in step, and :class:`Peers`, how a rank's guard sees the others.

Words used here:

- *the guard's collectives*: the step's read (all-reduced, or carried on DDP's gradient
  all-reduce by the guard's comm hook, :mod:`floatguard.guard.ddp_hook`), the bad-step
  all-gathers, and :meth:`Peers.finish`. Every one is *tracked* (a :class:`_Wait`: what,
  for which guard step, since when), so a peer's failure or finish, a lost connection or
  ``timeout_s`` of silence ends it with :class:`PeerFailed` or :class:`GuardDesync`
  naming the rank, the step and what happened. The hook's futures are completed with
  that error, so DDP's backward raises it instead of waiting.
- *the peer channel*: a side gloo group for point-to-point messages, one JSON record
  each: ``failed`` (a rank raised out of its guard), ``stop`` (a rank stops with an
  error it found itself), ``finished`` (guard.finish() or guard.close() after n steps),
  ``exited`` (the process ended without either), ``status?`` / ``status`` (a rank that
  waited past the timeout, or lost a connection, asks who is alive and where; a rank
  that does not answer is gone, the others say which guard step they last began).
- *the listener* (a thread) receives messages; *the watchdog* (a thread) ends tracked
  waits past ``timeout_s``, explains a tracked collective whose connection dropped, and
  ends a process blocked in a collective the guard does not own (DDP's forward
  broadcasts, a user's comm hook) ``grace_s`` after a peer failed.

No home-made transport: everything goes through torch.distributed.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

__all__ = ["GuardDesync", "PeerFailed", "Peers", "config_fingerprint"]

_MSG_BYTES = 1024  # one peer-channel message: a JSON record, zero-padded
_FAULT_BYTES = 2048  # one rank's record in a bad-step all-gather
_TAG = 7919  # the peer channel's point-to-point tag
_PREFIX = re.compile(r"^rank \d+ stops(?: at guard step -?\d+)?: ")  # a message's "who stops"
_ASK_S = 2.0  # how long a status question waits for the answers (alive ranks answer at once)


class _StepError(RuntimeError):
    """A distributed stop: ``ranks`` the ranks it names, ``step`` the guard step."""

    def __init__(self, message: str, *, ranks: tuple[int, ...] = (), step: int | None = None):
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.step = step


class PeerFailed(_StepError):
    """Another rank failed (raised out of its guard, exited, was killed, or stopped
    answering): this rank stops too rather than wait in a collective the other will
    never join."""


class GuardDesync(_StepError):
    """The ranks are not deciding the same guard step (another step counter, another
    number of guard steps, a backward outside guard.step()), or their guards are
    configured differently: decisions paired off by a step would be silently wrong."""


def config_fingerprint(parts: Any) -> int:
    """A 64-bit digest of what must be equal on every rank (policies, precision, the
    model's global parameter shapes): blake2b of its repr, with memory addresses
    (``0x7f...`` in a callable's repr) left out: they differ per process."""
    text = re.sub(r"0x[0-9a-fA-F]+", "0x", repr(parts))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


@dataclass(eq=False)
class _Wait:
    """A tracked collective: what it is, the guard step it belongs to, since when; the
    hook's ``gate`` (a future DDP waits on), and the backend's ``error`` if it failed."""

    what: str
    step: int
    start: float
    gate: Any = None
    error: BaseException | None = None


@dataclass(frozen=True)
class _Failure:
    """What this rank stops with (raised anew each time), and whether to tell the peers."""

    cls: type[_StepError]
    message: str
    ranks: tuple[int, ...] = ()
    step: int | None = None
    tell: bool = True

    def error(self) -> _StepError:
        return self.cls(self.message, ranks=self.ranks, step=self.step)


_GATE_LOCK = threading.Lock()


def _resolve(gate: Any, value: Any) -> None:
    """Complete a hook's gate once (the backend's callback and the watchdog may race)."""
    with _GATE_LOCK:
        if not gate.done():
            gate.set_result(value)


def _unwrap(fut: Any) -> Any:
    value = fut.value()
    if isinstance(value, BaseException):
        raise value
    return value


def _collective_error(e: BaseException) -> bool:
    """Whether an error from a backward or forward is a collective's (a lost peer)."""
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        s in text for s in ("Connection closed", "Connection reset", "Broken pipe", "gloo", "NCCL")
    )


def _ranks(ranks: list[int] | tuple[int, ...]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


@dataclass
class _State:
    """What this rank knows of the others, and where it is itself (under ``lock``)."""

    step: int = -1  # the guard step this rank last began
    read_done: bool = True  # that step's read is done: what comes next is the next step's
    began_at: float = field(default_factory=time.monotonic)
    waits: list[_Wait] = field(default_factory=list)
    finished: dict[int, tuple[int, str]] = field(default_factory=dict)  # rank -> steps, how
    exited: dict[int, dict[str, Any]] = field(default_factory=dict)
    finishing: int | None = None  # this rank's own guard.finish() step count
    done: str | None = None  # "finished" / "closed" / "told": nothing to say at exit
    replies: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)
    asked: int = 0


class Peers:
    """The other ranks of ``group``, as the guard sees them (see the module).

    ``timeout_s``: how long a tracked collective waits in silence before
    :class:`PeerFailed` (None: forever). ``grace_s``: after a peer's failure, how long a
    rank blocked in a collective the guard does not own (inside :meth:`region`) may
    stay blocked before the watchdog ends the process, saying why (None: never).
    ``on_stop(step, reason, message)``: writes the ``stop`` event (once).
    """

    def __init__(
        self, group: Any = None, *, timeout_s: float | None, grace_s: float | None,
        device: torch.device | None = None,
        on_stop: Callable[[int, str, str], None] | None = None,
    ) -> None:  # fmt: skip
        import torch.distributed as dist

        self.group = group
        self.device = device or torch.device("cpu")
        self.rank = int(dist.get_rank(group))
        self.world = int(dist.get_world_size(group))
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.on_stop = on_stop
        self.failure: _Failure | None = None
        self.state = _State()
        self._lock = threading.RLock()
        self._telling = threading.Lock()
        self._sends: list[Any] = []
        self._inside = 0
        self._raised = False
        self._closed = False
        self._stop_written = False
        self._wake = threading.Event()
        ranks = list(range(self.world))
        if group is not None:
            ranks = [int(dist.get_global_rank(group, r)) for r in ranks]
        self._global = ranks
        try:  # every rank of the group builds its guard together; only they take part
            self._channel: Any = dist.new_group(
                ranks=ranks, backend="gloo", use_local_synchronization=True
            )
        except (RuntimeError, ValueError) as e:  # a torch built without gloo
            warnings.warn(
                f"floatguard: no gloo group for the peer channel ({e}): a rank that fails "
                "cannot tell the others (they wait for the backend's timeout)",
                stacklevel=3,
            )
            self._channel = None
            return
        for target, name in ((self._listen, "floatguard-peers"), (self._watch, "floatguard-watch")):
            threading.Thread(target=target, name=name, daemon=True).start()
        atexit.register(self._at_exit)

    # ------------------------------------------------------------ the step
    def begin(self, step: int) -> None:
        """This rank begins guard step ``step``: stop now if a peer failed, finished or
        exited (its collectives would have no partner)."""
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
        s = self.state
        return s.step + 1 if s.read_done else s.step

    def _check_partners(self, step: int, doing: str) -> None:
        """A peer that finished after at most ``step`` steps, or exited, will not join."""
        with self._lock:
            finished = [(p, m, how) for p, (m, how) in self.state.finished.items() if m <= step]
            exited = sorted(self.state.exited.items())
        if exited:
            p, rec = exited[0]
            self._fail(PeerFailed, self._exited_text(p, rec, step, doing), (p,), step)
        elif finished:
            p, m, how = min(finished)
            self._fail(GuardDesync, self._finished_text(p, m, how, step, doing), (p,), step)

    def _finished_text(self, peer: int, steps: int, how: str, step: int, doing: str) -> str:
        return (
            f"rank {self.rank} {doing} guard step {step}, but rank {peer} finished after "
            f"{steps} guard steps ({how}): the ranks took different numbers of guard steps "
            "(a rank skipped or added a guard.step() call, or had more batches than another: "
            "give every rank the same number of batches, e.g. DistributedSampler(drop_last=True))"
        )

    def _exited_text(self, peer: int, rec: dict[str, Any], step: int, doing: str) -> str:
        why = f" ({rec['error']})" if rec.get("error") else ""
        return (
            f"rank {self.rank} {doing} guard step {step}, but rank {peer} exited after "
            f"{rec.get('steps')} guard steps without guard.finish(){why}"
        )

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
        group = self._channel
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

    def gated(self, work: Any, what: str, step: int) -> Any:
        """A future of ``work``'s tensor that DDP may wait on: completed by the backend, or
        with this rank's failure (a peer's, a timeout, a lost connection), so that
        DDP's backward raises instead of waiting forever."""
        gate: Any = torch.futures.Future()
        w = self._track(what, step, gate)

        def done(f: Any) -> None:
            try:
                value = f.value()[0]
            except Exception as e:  # the backend's error: the watchdog explains it
                w.error = e
                self._wake.set()
                return
            self._untrack(w)
            _resolve(gate, value)

        work.get_future().add_done_callback(done)
        if self.failure is not None:
            self._interrupt()
        return gate.then(_unwrap)

    def _track(self, what: str, step: int, gate: Any = None) -> _Wait:
        w = _Wait(what, step, time.monotonic(), gate)
        with self._lock:
            self.state.waits.append(w)
        self._check_partners(step, f"waits in {what} of")
        return w

    def _untrack(self, w: _Wait) -> None:
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
        except _StepError:
            raise
        except RuntimeError as e:  # the backend's error: a peer's connection dropped
            self._lost(w, e)
            raise self._error() or e from e
        finally:
            self._untrack(w)

    # -------------------------------------------------------------- failures
    def _fail(
        self, cls: type[_StepError], message: str, ranks: tuple[int, ...] = (),
        step: int | None = None, tell: bool = True,
    ) -> None:  # fmt: skip
        """This rank stops with ``cls(message)``: the first failure wins; pending hook
        gates are completed with it; the peers are told (unless they all know)."""
        with self._telling:  # the failure is told before anyone can flush (stopped())
            with self._lock:
                if self.failure is not None:
                    return
                self.failure = _Failure(cls, message, tuple(ranks), step, tell)
            if tell:
                self._send_all({"kind": "stop", "rank": self.rank, "step": step,
                                "ranks": list(ranks), "type": cls.__name__,
                                "message": message[:700]})  # fmt: skip
        self._interrupt()
        if self._inside and self.grace_s is not None:
            threading.Timer(self.grace_s, self._end_if_stuck).start()

    def fail(self, error: _StepError, tell: bool) -> _StepError:
        """Stop with ``error`` found by the caller (the channel's checks); returns it."""
        self._fail(type(error), str(error), error.ranks, error.step, tell)
        return self._error() or error

    def _error(self) -> _StepError | None:
        return None if self.failure is None else self.failure.error()

    def _interrupt(self) -> None:
        err = self._error()
        if err is None:
            return
        with self._lock:
            waits = list(self.state.waits)
        for w in waits:
            if w.gate is not None:
                _resolve(w.gate, err)

    def raise_if_failed(self) -> None:
        """Raise this rank's failure, if it has one (a fresh exception each time)."""
        err = self._error()
        if err is not None:
            self._raised = True
            raise err

    def _lost(self, w: _Wait, error: BaseException) -> None:
        """A tracked collective failed in the backend: ask who is gone, and stop."""
        if self.failure is None:
            status = self._ask_status()
            gone = [r for r, s in status.items() if s is None]
            who = (
                f"{_ranks(gone)} {'is' if len(gone) == 1 else 'are'} gone (exited or killed): "
                "no answer"
                if gone
                else "a peer's connection dropped"
            )
            # gloo's "[.../pair.cc:553] Connection closed by peer [addr]. This is ...": the words
            text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).splitlines()[0]).split(". ")[0][:160]
            self._fail(PeerFailed, f"rank {self.rank} stops at guard step {w.step}: {who} "
                       f"({w.what} failed: {text})", tuple(gone), w.step)  # fmt: skip

    def _timed_out(self, w: _Wait) -> None:
        status = self._ask_status()
        late = [r for r, s in status.items() if not _arrived(s, w.step)]
        said = "; ".join(self._describe(r, status[r]) for r in (late or list(status)))
        self._fail(
            PeerFailed,
            f"rank {self.rank} stops: no answer within {self.timeout_s:g} s in {w.what} of "
            f"guard step {w.step}: {said}. A rank out of data must call guard.finish(); "
            "Guard(peer_timeout_s=...) sets this limit",
            tuple(late),
            w.step,
        )

    def _describe(self, r: int, s: dict[str, Any] | None) -> str:
        if s is None:
            return f"rank {r} does not answer (its process exited, was killed or hangs)"
        if s.get("finishing") is not None:
            return f"rank {r} finished after {s['finishing']} guard steps (guard.finish())"
        if s.get("waits"):
            what, step = s["waits"][0]
            return f"rank {r} waits in {what} of guard step {step}"
        if int(s.get("step", -1)) < 0:
            return f"rank {r} is alive and has not begun a guard step"
        return (
            f"rank {r} is alive, last began guard step {s['step']} {s.get('since', 0):g} s ago "
            "and is not in a guard collective"
        )

    def announce_failure(self, step: int, error: BaseException) -> None:
        """Tell every other rank that this one raised ``error`` out of the guard."""
        if self._closed or self.failure is not None or self._channel is None or self.state.done:
            return  # a rank that stops because of a peer does not echo the failure
        self.state.done = "told"
        self._send_all({"kind": "failed", "rank": self.rank, "step": step,
                        "error": f"{type(error).__name__}: {error}"[:700]})  # fmt: skip
        self._flush(5.0)

    def stopped(self, step: int, error: BaseException) -> None:
        """The guard stops with ``error`` at ``step``: this rank's failure (if the error
        did not come through :meth:`fail`), the ``stop`` event once, the peers told."""
        if self.failure is None and isinstance(error, _StepError):
            self._fail(
                type(error), str(error), error.ranks, error.step if error.step is not None else step
            )
        if not self._stop_written and self.on_stop is not None:
            self._stop_written = True
            reason = "desync" if isinstance(error, GuardDesync) else "peer_failed"
            self.on_stop(step, reason, str(error))
        self._flush(2.0)

    # ---------------------------------------------------------------- finish
    def finish(self, steps: int) -> None:
        """End the run together after ``steps`` guard steps: tell every peer, wait until
        every one has finished (or exited) after as many. A peer still stepping, or one
        that finished after another number, is a GuardDesync; one that does not answer,
        or stays silent past ``timeout_s``, a PeerFailed."""
        self.raise_if_failed()
        with self._lock:
            self.state.finishing = steps
        self._send_all(
            {"kind": "finished", "rank": self.rank, "step": steps, "how": "guard.finish()"}
        )
        start = last_ask = time.monotonic()
        others = [r for r in range(self.world) if r != self.rank]
        while True:
            self.raise_if_failed()
            with self._lock:
                done = {p: m for p, (m, _how) in self.state.finished.items()}
                done.update({p: int(rec.get("steps", -1)) for p, rec in self.state.exited.items()})
            if all(r in done for r in others):
                break
            now = time.monotonic()
            if self.timeout_s is not None and now - start > self.timeout_s:
                status = self._ask_status()
                late = [r for r in others if r not in done]
                said = "; ".join(self._describe(r, status.get(r)) for r in late)
                self._fail(PeerFailed, f"rank {self.rank} waited {self.timeout_s:g} s in "
                           f"guard.finish() after {steps} guard steps for {_ranks(late)}: "
                           f"{said}", tuple(late), steps)  # fmt: skip
            elif now - last_ask > 1.0:  # a silent peer may be gone: ask
                status = self._ask_status()
                gone = [r for r in others if r not in done and status.get(r) is None]
                if gone and self.failure is None:
                    self._fail(PeerFailed, f"rank {self.rank} stops in guard.finish() after "
                               f"{steps} guard steps: {_ranks(gone)} does not answer (exited "
                               "or killed)", tuple(gone), steps)  # fmt: skip
                last_ask = time.monotonic()
            time.sleep(0.005)
        differ = sorted((p, m) for p, m in done.items() if m != steps)
        if differ:
            p, m = differ[0]
            self._fail(GuardDesync, f"rank {self.rank} finished after {steps} guard steps, "
                       f"but rank {p} after {m}: the ranks took different numbers of guard "
                       "steps (a rank skipped or added a guard.step() call, or had more batches "
                       "than another)", (p,), steps, tell=False)  # fmt: skip
            self.raise_if_failed()
        self.state.done = "finished"

    # ---------------------------------------------------------- peer channel
    def _send(self, peer: int, record: dict[str, Any]) -> None:
        import torch.distributed as dist

        if self._channel is None:
            return
        data = json.dumps(record, default=str).encode()[:_MSG_BYTES]
        buf = torch.zeros(_MSG_BYTES, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        try:
            w = dist.isend(buf, dst=self._global[peer], group=self._channel, tag=_TAG)
        except RuntimeError:  # a peer that is already gone
            return
        if w is not None:
            with self._lock:
                self._sends.append(w)

    def _send_all(self, record: dict[str, Any]) -> None:
        for r in range(self.world):
            if r != self.rank:
                self._send(r, record)

    def _flush(self, seconds: float) -> None:
        """Wait (at most ``seconds``) until the messages sent are out (a gloo send
        reports completion only through ``wait``)."""
        deadline = time.monotonic() + seconds
        with self._telling, self._lock:
            sends, self._sends = self._sends, []
        for w in sends:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                w.wait(timeout=timedelta(seconds=left))
            except RuntimeError:  # a peer that is gone, or the time is up
                pass

    def _ask_status(self) -> dict[int, dict[str, Any] | None]:
        """Every peer's status (None: no answer within a moment: gone)."""
        with self._lock:
            self.state.asked += 1
            qid = self.state.asked
            self.state.replies[qid] = {}
        self._send_all({"kind": "status?", "rank": self.rank, "id": qid})
        deadline = time.monotonic() + _ASK_S
        while time.monotonic() < deadline and len(self.state.replies[qid]) < self.world - 1:
            time.sleep(0.005)
        with self._lock:
            got = self.state.replies.pop(qid)
        return {r: got.get(r) for r in range(self.world) if r != self.rank}

    def _status(self) -> dict[str, Any]:
        s = self.state
        with self._lock:
            waits = [[w.what, w.step] for w in s.waits][:2]
        since = round(time.monotonic() - s.began_at, 1)
        return {"kind": "status", "rank": self.rank, "step": s.step, "since": since,
                "waits": waits, "finishing": s.finishing}  # fmt: skip

    def _listen(self) -> None:
        import torch.distributed as dist

        while not self._closed:
            buf = torch.zeros(_MSG_BYTES, dtype=torch.uint8)
            try:
                work = dist.irecv(buf, group=self._channel, tag=_TAG)  # from any rank
                if work is None:
                    return
                work.wait()
            except RuntimeError:  # the channel was torn down (a peer exited, shutdown)
                return
            try:
                record = json.loads(bytes(buf.tolist()).rstrip(b"\0").decode(errors="replace"))
            except json.JSONDecodeError:
                record = {"kind": "failed", "rank": "?", "step": "?", "error": "unreadable message"}
            self._handle(record)

    def _handle(self, rec: dict[str, Any]) -> None:
        kind, peer, step = rec.get("kind"), rec.get("rank"), rec.get("step", -1)
        if kind == "status?" and isinstance(peer, int):
            self._send(peer, {**self._status(), "id": rec.get("id")})
        elif kind == "status":
            with self._lock:
                if rec.get("id") in self.state.replies:
                    self.state.replies[rec["id"]][peer] = rec  # type: ignore[index]
        elif kind in ("finished", "exited") and isinstance(peer, int):
            with self._lock:
                if kind == "finished":
                    self.state.finished[peer] = (int(step), str(rec.get("how")))
                else:
                    self.state.exited[peer] = rec
                waits = list(self.state.waits)
            if self.state.finishing is None:
                steps = int(step) if kind == "finished" else int(rec.get("steps", -1))
                late = [w for w in waits if w.step >= steps or kind == "exited"]
                if late:
                    self._check_partners(late[0].step, f"waits in {late[0].what} of")
        elif kind == "stop":
            cls = GuardDesync if rec.get("type") == "GuardDesync" else PeerFailed
            said = _PREFIX.sub("", str(rec.get("message")))
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

    def _end_if_stuck(self) -> None:
        """Still inside a guard region, blocked in a collective the guard does not own,
        ``grace_s`` after this rank's failure: write the stop event and end the process."""
        if self._inside and not self._raised and not self._closed and self.failure is not None:
            self.stopped(self.state.step, self.failure.error())
            sys.stderr.write(
                f"floatguard: rank {self.rank} ends: {_PREFIX.sub('', self.failure.message)}; "
                f"this rank has been blocked in a collective it will never complete for "
                f"{self.grace_s:g} s (Guard(peer_grace_s=None) waits for the backend's timeout "
                "instead)\n"
            )
            sys.stderr.flush()
            os._exit(1)

    @contextmanager
    def region(self) -> Iterator[None]:
        """Code that may block in collectives the guard does not own (the closure's
        forward and backward): a backward the guard's hook ended raises this rank's
        failure; the watchdog may end the process in a collective it cannot end."""
        self.raise_if_failed()
        self._inside += 1
        try:
            yield
        except _StepError:
            raise
        except Exception as e:
            err = self._explain(e)
            if err is None:
                raise
            raise err from e
        finally:
            self._inside -= 1

    def _explain(self, e: BaseException) -> _StepError | None:
        """This rank's failure behind an error out of a forward or backward, if any."""
        if self.failure is None:
            with self._lock:
                errored = [w for w in self.state.waits if w.error is not None]
            deadline = time.monotonic() + _ASK_S + 1.0
            while errored and self.failure is None and time.monotonic() < deadline:
                time.sleep(0.01)  # the watchdog is asking who is gone
            if self.failure is None and _collective_error(e):
                self._lost(_Wait("a collective", self.next_step(), time.monotonic()), e)
        return self._error()

    def _at_exit(self) -> None:
        """The process ends: a rank that neither finished nor failed tells the others."""
        s = self.state
        if self._channel is None or s.done is not None or self.failure is not None:
            return
        last = getattr(sys, "last_value", None)
        steps = s.step + 1 if s.read_done else s.step
        error = None if last is None else f"{type(last).__name__}: {last}"[:700]
        try:
            self._send_all({"kind": "exited", "rank": self.rank, "steps": max(steps, 0),
                            "error": error})  # fmt: skip
            self._flush(1.0)
        except Exception:  # the group is already gone
            pass

    def close(self) -> None:
        """Stop listening (the pending receive is left to the process's exit). A guard
        closed without :meth:`finish` (and not failed) tells the peers it is done."""
        s = self.state
        if s.done is None and self.failure is None and self._channel is not None:
            steps = max(s.step + 1 if s.read_done else s.step, 0)
            self._send_all({"kind": "finished", "rank": self.rank, "step": steps,
                            "how": "guard.close()"})  # fmt: skip
            self._flush(1.0)
            s.done = "closed"
        self._closed = True
        self._wake.set()


def _arrived(status: dict[str, Any] | None, step: int) -> bool:
    """Whether a peer's status shows it waiting in a collective of guard step ``step``."""
    return bool(status) and any(int(s) == step for _what, s in status.get("waits") or [])  # type: ignore[union-attr]
