"""Peers: how a rank's guard sees the other ranks, on torch.distributed's own machinery.

No thread, no at-exit handler, no ``os._exit``: every wait the guard owns is a
collective on a group torch created with a timeout, and what a failure means is read
from torch's own tools after it happened. Words used here:

- *the guard's groups* (created once, by every rank, when the guard is built): ``timed``,
  the guarded group's ranks and backend with ``timeout=peer_timeout_s``, carries every
  collective of the guard (the step's read, DDP's gradient all-reduce through the
  guard's comm hook, the bad-step all-gathers, the resume agreement): a wait for a
  silent peer ends in the backend's own error after that long (under NCCL its watchdog
  owns the wait, ``TORCH_NCCL_ASYNC_ERROR_HANDLING``); ``side``, a gloo group with the
  same timeout for the small host records (``timed`` itself under gloo); ``barrier``, a
  gloo group for the one ``monitored_barrier`` after a failure.
- *a note*: a small JSON record a rank leaves in the group's store (the TCPStore or
  FileStore torch rendezvoused with), under ``floatguard/<token>/note/<rank>``, one per
  rank: ``failed`` (it raised out of its guard), ``stop`` (it stopped with an error,
  which the others take up), ``finished`` (guard.finish() or guard.close() after n
  steps), ``exited`` (a ``with`` block left by an error). Nothing is written or read on
  a healthy step.
- *a status*: ``.../status/<rank>``, where a rank was when a collective failed it.
- *the explanation*: a guard collective failed (its timeout, a closed connection), or
  a forward or backward raised a collective's error: the rank leaves its status, reads
  the notes, and if none explains it passes ``monitored_barrier(wait_all_ranks=True)``
  (at most :data:`BARRIER_S`): rank 0's names the ranks that did not arrive, and every
  rank names those that left no status. It stops with the most specific error: a
  peer's failure, its stop, its exit or finish, ranks on another step, the silent ranks.

A wait in a collective the guard does not own (DDP's buffer broadcast, FSDP's
all-gathers, the model's own) ends at the process group's own timeout
(``init_process_group(timeout=...)``), and is explained the same way.
"""

from __future__ import annotations

import json
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch

from floatguard.distributed import DistributedStop, GuardDesync, PeerFailed
from floatguard.guard.peer_notes import PeerNotes, find_store
from floatguard.guard.peer_words import (
    _MISSING,
    PREFIX,
    _Failure,
    _new_group,
    _Why,
    collective_error,
    ranks_text,
    silence_why,
)

__all__ = ["BARRIER_S", "PREFIX", "Peers", "collective_error", "ranks_text"]

BARRIER_S = 5.0  # the longest the monitored barrier after a failure waits
_SETTLE_S = 1.0  # guard.finish() waits this long for the peers' finishes before release
_RECORD_BYTES = 2048  # one rank's record in a bad-step all-gather
_NOTE_CHARS = 700  # a message kept in a note
_REGION = "a collective of the forward or backward"  # one the guard does not own


class Peers:
    """The other ranks of ``group``, as the guard sees them (see the module).

    ``timeout_s``: how long a guard collective waits for a silent peer before
    :class:`PeerFailed` (None: the process group's default timeout). ``on_stop(step,
    reason, message)``: writes the ``stop`` event (once)."""

    def __init__(
        self, group: Any = None, *, timeout_s: float | None,
        device: torch.device | None = None, on_stop: Any = None,
    ) -> None:  # fmt: skip
        import torch.distributed as dist

        self.group, self.device = group, device or torch.device("cpu")
        self.rank, self.world = int(dist.get_rank(group)), int(dist.get_world_size(group))
        ranks = list(range(self.world))
        if group is not None:
            ranks = [int(dist.get_global_rank(group, r)) for r in ranks]
        self.global_ranks = ranks
        self.timeout_s, self.on_stop = timeout_s, on_stop
        self.failure: _Failure | None = None
        self.step, self._read_done = -1, True
        self.finishing: int | None = None
        self.launched: str | None = None  # the guard's last collective in the region (DDP's)
        self.closed = self._stop_written = self._barrier_used = False
        limit = None if timeout_s is None else timedelta(seconds=timeout_s)
        backend = str(dist.get_backend(group))
        world = self.world == dist.get_world_size()
        self.timed: Any = _new_group(ranks, limit, backend, world=world)
        self.side: Any = self.timed
        if backend != "gloo":  # a gloo group for the host records (one, off the world)
            self.side = _new_group(ranks, limit, "gloo", world=world, need=False) if world else None
        self.barrier: Any = (
            _new_group(ranks, None, "gloo", world=True, need=False) if world else None
        )
        self.notes = PeerNotes(find_store(self.timed), self.rank, self.world)
        token = self.all_gather_json({"token": uuid.uuid4().hex}, "the guard's start")[0]
        self.notes.key = f"floatguard/{token.get('token')}"  # the run's keys from now on

    # ------------------------------------------------------------ the step
    def begin(self, step: int) -> None:
        """This rank begins guard step ``step`` (its failure, if any, raises now)."""
        self.raise_if_failed()
        self.step, self._read_done = step, False

    def read_done(self) -> None:
        """The step's read is done: collectives outside a guard step now belong to the next."""
        self._read_done = True

    def next_step(self) -> int:
        """The guard step a collective run now belongs to (for an unarmed DDP backward)."""
        return self.step + 1 if self._read_done else self.step

    @property
    def steps(self) -> int:
        """How many guard steps this rank has taken (as far as its collectives know)."""
        return max(self.step + 1 if self._read_done else self.step, 0)

    # ---------------------------------------------------------- collectives
    def all_reduce_sum(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """SUM-all-reduce ``t`` in place on the timed group."""
        import torch.distributed as dist

        with self._collective(what):
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.timed)
        return t

    def all_gather_json(
        self, record: dict[str, Any], what: str, size: int = _RECORD_BYTES
    ) -> list[dict[str, Any]]:
        """Every rank's ``record`` (a small JSON object, at most ``size`` bytes), in rank order."""
        import torch.distributed as dist

        data = json.dumps(record, default=str).encode()[:size]
        buf = torch.zeros(size, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        group = self.side
        if group is None:  # no gloo group: the timed group, on its device
            group, buf = self.timed, buf.to(self.device)
        out = [torch.zeros_like(buf) for _ in range(self.world)]
        with self._collective(what):
            dist.all_gather(out, buf, group=group)
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
        group where there is one); for an agreement that is usually "none"."""
        import torch.distributed as dist

        group, t = self.side, torch.tensor([float(flag)], dtype=torch.float64)
        if group is None:
            group, t = self.timed, t.to(self.device)
        with self._collective(what):
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return int(t.item())

    @contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """A guard collective: this rank's failure raises before it; the backend's error
        (the timeout, a closed connection) is explained."""
        self.raise_if_failed()
        if self.timed is None:
            raise RuntimeError(f"floatguard: {what} after guard.finish() or guard.close()")
        try:
            yield
        except DistributedStop:
            raise
        except RuntimeError as e:
            raise self.explain(e, what, self.step) from e

    @contextmanager
    def region(self) -> Iterator[None]:
        """Code that may block in collectives the guard does not own (the closure's
        forward and backward, where DDP's backward runs the guard's comm hook): a
        collective's error out of it is explained."""
        self.raise_if_failed()
        self.launched = None
        try:
            yield
        except DistributedStop:
            raise
        except Exception as e:
            if not collective_error(e):
                raise
            what = self.launched or _REGION
            raise self.explain(e, what, self.next_step()) from e
        finally:
            self.launched = None

    # -------------------------------------------------------------- failures
    def _fail(
        self, cls: type[DistributedStop], message: str, ranks: tuple[int, ...] = (),
        step: int | None = None, tell: bool = True,
    ) -> DistributedStop:  # fmt: skip
        """This rank stops with ``cls(message)`` (the first failure wins); ``tell``: the
        others take it up from this rank's ``stop`` note."""
        if self.failure is None:
            self.failure = _Failure(cls, message, tuple(ranks), step)
            if tell:
                self.notes.note("stop", step=step, type=cls.__name__, ranks=list(ranks),
                           message=message[:_NOTE_CHARS])  # fmt: skip
        return self.failure.error()

    def fail(self, error: DistributedStop, tell: bool) -> DistributedStop:
        """Stop with ``error`` found by the caller (the channel's checks); returns it."""
        return self._fail(type(error), str(error), error.ranks, error.step, tell)

    def raise_if_failed(self) -> None:
        """Raise this rank's failure, if it has one (a fresh exception each time)."""
        if self.failure is not None:
            raise self.failure.error()

    def announce_failure(self, step: int, error: BaseException) -> None:
        """This rank raised ``error`` out of its guard: its ``failed`` note."""
        if not self.closed and self.failure is None:
            self.notes.note(
                "failed", step=step, error=f"{type(error).__name__}: {error}"[:_NOTE_CHARS]
            )

    def stopped(self, step: int, error: BaseException) -> None:
        """The guard stops with ``error`` at ``step``: this rank's failure (if the error
        did not come through :meth:`fail`), the ``stop`` event once."""
        if self.failure is None and isinstance(error, DistributedStop):
            at = error.step if error.step is not None else step
            self._fail(type(error), str(error), error.ranks, at)
        if not self._stop_written and self.on_stop is not None:
            self._stop_written = True
            reason = "desync" if isinstance(error, GuardDesync) else "peer_failed"
            self.on_stop(step, reason, str(error))

    def explain(self, error: BaseException, what: str, step: int) -> DistributedStop:
        """A collective failed this rank in ``what`` of guard step ``step``: why (see the
        module), as this rank's failure."""
        if self.failure is not None:
            return self.failure.error()
        self.notes.put("status", {"step": step, "what": what})
        found = self.notes.explain(step, what)
        if found is None:
            start = time.monotonic()
            named = self._barrier()
            found = self.notes.explain(step, what) or self._silence(
                named, start + self._barrier_s() + 0.5, step, what, error
            )
        cls, text, ranks = found
        return self._fail(cls, text, ranks, step)

    def _barrier_s(self) -> float:
        return BARRIER_S if self.timeout_s is None else min(BARRIER_S, self.timeout_s)

    def _barrier(self) -> list[int]:
        """torch's ``monitored_barrier`` (once): the ranks rank 0's names as missing."""
        import torch.distributed as dist

        if self.barrier is None or self._barrier_used:
            return []
        self._barrier_used = True
        try:
            dist.monitored_barrier(
                group=self.barrier, timeout=timedelta(seconds=self._barrier_s()),
                wait_all_ranks=True,
            )  # fmt: skip
        except RuntimeError as e:
            m = _MISSING.search(str(e))
            if m:
                return [int(r) for r in m.group(1).replace(" ", "").split(",") if r]
        return []

    def _silence(
        self, named: list[int], until: float, step: int, what: str, error: BaseException
    ) -> _Why:
        """No note explains it: the ranks that left no status by ``until`` (and those the
        barrier named), or the ranks on another step."""
        late = [r for r in range(self.world) if r != self.rank]
        statuses: dict[int, dict[str, Any]] = {}
        while True:
            for r in late:
                st = self.notes.get("status", r)
                if st is not None:
                    statuses[r] = st
            late = [r for r in late if r not in statuses]
            if not late or time.monotonic() >= until:
                break
            time.sleep(0.05)
        silent = sorted(set(late) | set(named))
        return silence_why(
            self.rank, silent, statuses, step, what, error,
            self.timeout_s if what != _REGION else None,
        )  # fmt: skip

    # ---------------------------------------------------------------- the end
    def finish(self, steps: int) -> None:
        """End the run together after ``steps`` guard steps: this rank's ``finished``
        note, then every peer's (through the store: no collective, so a peer still
        stepping meets no collective of another shape). A peer that finished after
        another number, or waits in a collective of a later step, is a GuardDesync; one
        that failed, or is silent past ``timeout_s``, a PeerFailed."""
        self.raise_if_failed()
        self.finishing = steps
        if self.notes.store is None:  # no store: the steps, all-gathered
            records = self.all_gather_json({"steps": steps}, "guard.finish()")
            done = {r: int(rec.get("steps", -1)) for r, rec in enumerate(records)}
            done.pop(self.rank)
        else:
            self.notes.note("finished", steps=steps, how="guard.finish()")
            try:
                done = self._await_finishes(steps)
            finally:
                self._release()
        differ = sorted((p, m) for p, m in done.items() if m != steps)
        if differ:
            p, m = differ[0]
            raise self._fail(GuardDesync, f"rank {self.rank} finished after {steps} guard steps, "
                             f"but rank {p} after {m}: the ranks took different numbers of guard "
                             "steps (a rank skipped or added a guard.step() call, or had more "
                             "batches than another)", (p,), steps, tell=False)  # fmt: skip

    def _await_finishes(self, steps: int) -> dict[int, int]:
        """Every peer's finish (or exit) note: its step count, by rank."""
        me, start, delay = self.rank, time.monotonic(), 0.002
        late, done = [r for r in range(self.world) if r != me], {}
        grace = None if self.timeout_s is None else self.timeout_s + self._barrier_s()
        while late:
            if time.monotonic() - start > _SETTLE_S:
                self._release()  # a peer still stepping: its collective ends now
            for r in list(late):
                rec = self.notes.get("note", r)
                if rec is not None and rec.get("kind") in ("finished", "exited"):
                    done[r] = int(rec.get("steps", -1))
                    late.remove(r)
                    continue
                if rec is not None:  # a peer's failure or stop: take it up
                    found = self.notes.explain(steps, "guard.finish()")
                    if found is not None:
                        raise self._fail(*found, steps, tell=False)
                st = self.notes.get("status", r)
                if st is not None:  # its collective failed: its own stop, if it says one
                    said = self.notes.wait(r, time.monotonic() + 2.0)
                    if said is not None and said.get("kind") == "stop":
                        found = self.notes.explain(steps, "guard.finish()")
                        if found is not None:
                            raise self._fail(*found, steps, tell=False)
                    text = (f"rank {me} finished after {steps} guard steps, but rank {r} "
                            f"waits in {st.get('what')} of guard step {st.get('step')}: "
                            "the ranks took different numbers of guard steps (a rank out "
                            "of data must call guard.finish())")  # fmt: skip
                    raise self._fail(GuardDesync, text, (r,), steps, tell=False)
            waited = time.monotonic() - start
            if late and grace is not None and waited > grace:
                raise self._fail(PeerFailed, f"rank {me} waited {waited:.0f} s in guard.finish() "
                                 f"after {steps} guard steps for {ranks_text(late)}: no finish "
                                 "and no answer (stopped, killed, or still stepping outside "
                                 "the guard's collectives). Guard(peer_timeout_s=...) sets "
                                 "this limit", tuple(late), steps, tell=False)  # fmt: skip
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        return done

    def _release(self, everything: bool = False) -> None:
        """Destroy the guard's timed group (after :meth:`finish`: nothing of the guard
        runs on it any more), so that a peer still waiting in a collective on it (a
        rank that took more guard steps) hears a closed connection now, not at its
        timeout; ``everything``: its other groups too (:meth:`close`). A process group
        closes its connections when the last reference to it goes."""
        import torch.distributed as dist

        groups = [self.timed, self.side] + ([self.barrier] if everything else [])
        self.timed = self.side = None
        if everything:
            self.barrier = None
        for i, g in enumerate(groups):
            if g is None or any(g is h for h in groups[:i]):
                continue
            try:
                dist.destroy_process_group(g)
            except (RuntimeError, ValueError, AssertionError):  # already gone
                pass
        groups.clear()

    def close(self, error: BaseException | None = None) -> None:
        """This rank's guard ends: a guard closed without :meth:`finish` leaves its note
        (``finished`` after its steps; with ``error``, raised outside the guard,
        ``exited`` with it). Nothing is waited for: no thread, no pending receive."""
        if not self.closed and self.failure is None and self.finishing is None:
            if error is None:
                self.notes.note("finished", steps=self.steps, how="guard.close()")
                if self.steps:
                    warnings.warn(
                        f"floatguard: rank {self.rank}'s guard closed after {self.steps} guard "
                        "steps without guard.finish() under torch.distributed: that every "
                        "rank took as many guard steps is unchecked (a rank with one more or "
                        "one fewer batch trained on shifted batches unseen); call "
                        "guard.finish() on every rank before guard.close()",
                        RuntimeWarning,
                        stacklevel=4,
                    )
            else:
                self.notes.note("exited", steps=self.steps,
                           error=f"{type(error).__name__}: {error}"[:_NOTE_CHARS])  # fmt: skip
        self.closed = True
        self._release(everything=True)
