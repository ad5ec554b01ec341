"""The guard under torch.distributed: one all-reduce per step, agreement on bad steps,
and no rank left waiting when another one fails.

Words used here:

- *the packed read*: every rank's step numbers in one float64 tensor, all-reduced
  (SUM) once per step: the overflow flag, the squared gradient norm (sharded and
  replicated parts apart, so FSDP2 shards add up and DDP replicas average), the
  loss, which ranks saw a non-finite loss or norm locally (bits), and the step
  counter and configuration fingerprint with their squares, so that a rank deciding
  a different step, or configured differently, is detected in the same collective:
  ``n * sum(s**2) == sum(s)**2`` holds exactly when every ``s`` is equal. The step
  and fingerprint are taken modulo 4096 so these sums stay exact in float64 for up
  to 4096 ranks.
- *agreement*: on a bad step only, each rank's localization (its own replay under
  ``no_sync()``) is all-gathered as a short JSON record; every rank then holds the
  same list, names the faulting rank and takes the same response.
- *the peer channel*: a side gloo group on which a rank that raises out of the guard
  (a user error in the closure, an error in its own localization) tells every other
  rank, with its step and message. A rank waiting in one of the guard's collectives
  stops at once with :class:`PeerFailed`; a rank blocked in a collective the guard
  does not own (DDP's gradient all-reduce in backward) is ended by the watchdog
  after ``grace_s`` with that message on stderr, instead of waiting for the
  backend's timeout. The guard's own collectives are awaited by polling, so a
  silent peer ends them after ``timeout_s`` too.

No home-made transport: everything goes through torch.distributed (the peer channel
is a gloo group's point-to-point send/recv).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import threading
import time
import warnings
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DDPReadHook", "GuardDesync", "PeerFailed", "Peers", "config_fingerprint"]

_MOD = 4096.0  # step and fingerprint are compared modulo this (exact sums, see above)
_MSG_BYTES = 1024  # one peer-channel message: a JSON record, zero-padded
_FAULT_BYTES = 2048  # one rank's localization record in the bad-step all-gather
_TAG = 7919  # the peer channel's point-to-point tag


class PeerFailed(RuntimeError):
    """Another rank failed (raised out of its guard, or stopped answering): this rank
    stops too rather than wait in a collective the other will never join."""


class GuardDesync(RuntimeError):
    """The ranks are not deciding the same guard step, or their guards are configured
    differently: decisions paired off by a step would be silently wrong."""


def config_fingerprint(parts: Any) -> int:
    """A small integer summarising what must be equal on every rank (policies,
    precision, the model's global parameter shapes): crc32 of its repr, mod 4096, with
    memory addresses (``0x7f...`` in a callable's repr) left out: they differ per process."""
    text = re.sub(r"0x[0-9a-fA-F]+", "0x", repr(parts))
    return zlib.crc32(text.encode()) % int(_MOD)


@dataclass(frozen=True)
class PackedSlots:
    """Positions in the packed read (after the all-reduce, as sums over ranks)."""

    found: int = 0
    norm_sq_sharded: int = 1
    norm_sq_replicated: int = 2
    loss: int = 3
    bad_bits: int = 4
    step: int = 5
    step_sq: int = 6
    fingerprint: int = 7
    fingerprint_sq: int = 8
    size: int = 9


SLOTS = PackedSlots()


@dataclass(frozen=True)
class Agreed:
    """What the packed read says, the same on every rank."""

    found: bool
    grad_norm: float
    loss: float
    bad_ranks: tuple[int, ...]


def pack(
    found: torch.Tensor,
    norm_sq_sharded: torch.Tensor,
    norm_sq_replicated: torch.Tensor,
    loss: torch.Tensor,
    local_bad: torch.Tensor,
    rank: int,
    step: int,
    fingerprint: int,
) -> torch.Tensor:
    """This rank's packed read (device float64, no sync)."""
    s, f = float(step % int(_MOD)), float(fingerprint % int(_MOD))
    bit = float(2**rank) if rank < 52 else 0.0  # bits beyond float64's mantissa: not named
    dev = loss.device
    head = torch.stack(
        [found.double().reshape(()), norm_sq_sharded.double().reshape(()),
         norm_sq_replicated.double().reshape(()), loss.double().reshape(()),
         local_bad.double().reshape(()) * bit]
    )  # fmt: skip
    tail = torch.tensor([s, s * s, f, f * f], dtype=torch.float64, device=dev)
    return torch.cat([head, tail])


def unpack(values: list[float], world: int, rank: int, step: int, fingerprint: int) -> Agreed:
    """The agreed numbers from the all-reduced read, after checking that every rank
    decided the same step with the same configuration (:class:`GuardDesync` if not)."""
    n = float(world)
    for what, i, mine in (
        ("step", SLOTS.step, step % int(_MOD)),
        ("configuration", SLOTS.fingerprint, fingerprint % int(_MOD)),
    ):
        total, squares = values[i], values[i + 1]
        if n * squares != total * total:
            mean = total / n
            if squares < 0:  # from DDPReadHook: the one-hot residues differed
                detail = f"{what}s differ between ranks (modulo 16); this rank's {mine}"
                raise GuardDesync(
                    f"rank {rank}: the ranks' {detail}: "
                    + ("a rank skipped or added a guard.step() call. Every rank must call "
                       "guard.step() exactly once per training step" if what == "step" else
                       "give every rank the same precision, policies and model")
                )  # fmt: skip
            if what == "step":
                raise GuardDesync(
                    f"rank {rank} is deciding guard step {step}, but the ranks are not on the "
                    f"same step (their mean, mod 4096, is {mean:g}, this rank's {mine}): a "
                    "rank skipped or added a guard.step() call. Every rank must call "
                    "guard.step() exactly once per training step"
                )
            raise GuardDesync(
                f"rank {rank}'s guard is configured differently from another rank's "
                f"(fingerprint {mine} vs a mean of {mean:g}): give every rank the same "
                "precision, policies and model"
            )
    norm_sq = values[SLOTS.norm_sq_sharded] + values[SLOTS.norm_sq_replicated] / n
    bits = values[SLOTS.bad_bits]
    bad: tuple[int, ...] = ()
    if math.isfinite(bits) and bits > 0:
        b = int(bits)
        bad = tuple(r for r in range(min(world, 52)) if b >> r & 1)
    return Agreed(
        found=not values[SLOTS.found] == 0.0,  # NaN counts as found
        grad_norm=math.sqrt(norm_sq) if norm_sq >= 0 or math.isnan(norm_sq) else math.nan,
        loss=values[SLOTS.loss] / n,
        bad_ranks=bad,
    )


_ONE_HOT = 16  # the DDP-hook read compares step and fingerprint modulo 16, one-hot


class DDPReadHook:
    """The step's read carried by DDP's own gradient all-reduce: a comm hook that
    appends a small float32 tensor (the loss, this rank's bad bit, the step counter and
    the fingerprint one-hot modulo 16) to the last gradient bucket, so a DDP step pays
    no extra collective. Registered by the guard with ``register_comm_hook`` (when the
    model has no hook of its own); without a pending read it is DDP's default
    all-reduce (gradients divided by the world size, then summed). Bad bits are exact
    in float32 for ranks below 24 (above, the bad-step all-gather names the rank)."""

    def __init__(self, group: Any, world: int) -> None:
        self.group = group
        self.world = world
        self.pending: torch.Tensor | None = None
        self.result: torch.Tensor | None = None
        self.size = 4 + 2 * _ONE_HOT  # the carried read's length (see take)

    def arm(self, loss: torch.Tensor, local_bad: torch.Tensor, rank: int, step: int,
            fingerprint: int) -> None:  # fmt: skip
        """Set the read to send with the next backward's last bucket (device, no sync)."""
        dev = loss.device
        extra = torch.zeros(2 + 2 * _ONE_HOT, dtype=torch.float32, device=dev)
        extra[0] = loss.float().reshape(())
        bit = float(2**rank) if rank < 24 else 0.0
        extra[1] = local_bad.float().reshape(()) * bit
        extra[2 + step % _ONE_HOT] = 1.0
        extra[2 + _ONE_HOT + fingerprint % _ONE_HOT] = 1.0
        self.pending, self.result = extra, None

    def as_comm_hook(self) -> Any:
        """The hook for ``DistributedDataParallel.register_comm_hook(None, ...)``: an
        unannotated callable (DDP checks annotations, and these would be strings here)."""
        return lambda state, bucket: self(state, bucket)

    def __call__(self, state: Any, bucket: Any) -> Any:
        import torch.distributed as dist

        buf = bucket.buffer()
        extra = self.pending
        if extra is None or not bucket.is_last() or buf.dtype != torch.float32:
            work = dist.all_reduce(buf.div_(self.world), group=self.group, async_op=True)
            return work.get_future().then(lambda f: f.value()[0])
        self.pending = None
        n = buf.numel()
        both = torch.cat([buf.div(self.world), extra.to(buf.device)])
        fut = dist.all_reduce(both, group=self.group, async_op=True).get_future()

        def split(f: Any) -> torch.Tensor:
            out: torch.Tensor = f.value()[0]
            self.result = out[n:].clone()
            return out[:n]

        return fut.then(split)

    def take(self, found: torch.Tensor, norm: torch.Tensor) -> torch.Tensor | None:
        """The step's read as carried (float64: this rank's overflow flag and squared
        norm, then the summed extras), for :meth:`values`; None when the hook did not
        carry it (no float32 gradient bucket: the guard then all-reduces its read)."""
        r, self.result = self.result, None
        if r is None:
            return None
        head = torch.stack([found.double().reshape(()), norm.double().reshape(()) ** 2])
        return torch.cat([head.to(r.device), r.double()])

    def values(self, read: list[float], rank: int, step: int, fingerprint: int) -> list[float]:
        """The host copy of :meth:`take`'s tensor in :func:`pack`'s layout (summed), for
        :func:`unpack`: a step or fingerprint residue that not every rank shares becomes
        a sum whose squares do not match (a negative square), reported as GuardDesync."""
        found, norm_sq, loss, bits = read[0], read[1], read[2], read[3]
        hot = read[4:]
        w = float(self.world)
        if not math.isfinite(norm_sq) and bits == 0 and rank < 24:
            bits = float(2**rank)  # nobody's loss was bad: every rank saw the bad norm
        s, f = float(step % int(_MOD)), float(fingerprint % int(_MOD))
        s_sq = w * s * s if hot[step % _ONE_HOT] == w else -1.0
        f_sq = w * f * f if hot[_ONE_HOT + fingerprint % _ONE_HOT] == w else -1.0
        return [found, 0.0, norm_sq * w, loss, bits, w * s, s_sq, w * f, f_sq]


class Peers:
    """The other ranks of ``group``, as the guard sees them: the packed all-reduce,
    the bad-step all-gather, and the peer channel with its watchdog.

    ``timeout_s``: how long the guard's own collectives wait before :class:`PeerFailed`
    (None: forever). ``grace_s``: after a peer's failure message, how long a rank blocked
    outside the guard's collectives (inside :meth:`region`) may stay blocked before the
    watchdog ends the process with the message (None: never; wait for the backend's own
    timeout).
    """

    def __init__(
        self, group: Any = None, *, timeout_s: float | None, grace_s: float | None,
        device: torch.device | None = None,
    ) -> None:  # fmt: skip
        import torch.distributed as dist

        self.group = group
        self.device = device or torch.device("cpu")
        self.rank = int(dist.get_rank(group))
        self.world = int(dist.get_world_size(group))
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.failure: dict[str, Any] | None = None
        self._inside = 0
        self._raised = False
        self._closed = False
        ranks = list(range(self.world))
        if group is not None:
            ranks = [int(dist.get_global_rank(group, r)) for r in ranks]
        self._global = ranks
        # Every rank of the group builds its guard together; only they take part (a
        # guard on a subgroup does not need the other ranks to call this).
        try:
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
        self._listener = threading.Thread(target=self._listen, name="floatguard-peers", daemon=True)
        self._listener.start()

    # ---------------------------------------------------------- collectives
    def all_reduce_sum(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """SUM-all-reduce ``t`` in place, waiting by polling (a peer's failure or the
        timeout ends the wait with :class:`PeerFailed`)."""
        import torch.distributed as dist

        self.raise_if_failed()
        work = dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._wait(work, what)
        return t

    def all_gather_json(self, record: dict[str, Any], what: str) -> list[dict[str, Any]]:
        """Every rank's ``record`` (a small JSON object), in rank order."""
        import torch.distributed as dist

        self.raise_if_failed()
        data = json.dumps(record, default=str).encode()[:_FAULT_BYTES]
        buf = torch.zeros(_FAULT_BYTES, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        group = self._channel
        if group is None:  # no gloo channel: the guard's own group, on its device
            group, buf = self.group, buf.to(self.device)
        out = [torch.zeros_like(buf) for _ in range(self.world)]
        work = dist.all_gather(out, buf, group=group, async_op=True)
        self._wait(work, what)
        records = []
        for t in out:
            raw = bytes(t.tolist()).rstrip(b"\0")
            try:
                records.append(json.loads(raw.decode(errors="replace")))
            except json.JSONDecodeError:  # truncated at _FAULT_BYTES
                records.append({"error": "record truncated"})
        return records

    def _wait(self, work: Any, what: str) -> None:
        start = time.monotonic()
        delay = 2e-5
        while not work.is_completed():
            self.raise_if_failed()
            if self.timeout_s is not None and time.monotonic() - start > self.timeout_s:
                self._raised = True
                raise PeerFailed(
                    f"rank {self.rank}: no answer from the other ranks within "
                    f"{self.timeout_s:g} s in the guard's {what}: another rank stopped calling "
                    "guard.step() or hangs (Guard(peer_timeout_s=...) sets this limit)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.005)
        work.wait()

    # -------------------------------------------------------- peer channel
    def raise_if_failed(self) -> None:
        """Raise :class:`PeerFailed` if another rank said it failed."""
        f = self.failure
        if f is not None:
            self._raised = True
            raise PeerFailed(
                f"rank {self.rank} stops: rank {f.get('rank')} failed at guard step "
                f"{f.get('step')} ({f.get('error')}); the ranks cannot go on without it"
            )

    def announce_failure(self, step: int, error: BaseException) -> None:
        """Tell every other rank that this one raised ``error`` out of the guard."""
        import torch.distributed as dist

        if self._closed or self.failure is not None or self._channel is None:
            return  # a rank that stops because of a peer does not echo the failure
        record = {"rank": self.rank, "step": step, "error": f"{type(error).__name__}: {error}"}
        data = json.dumps(record).encode()[:_MSG_BYTES]
        buf = torch.zeros(_MSG_BYTES, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        works = []
        for r in range(self.world):
            if r != self.rank:
                try:
                    w = dist.isend(buf, dst=self._global[r], group=self._channel, tag=_TAG)
                except RuntimeError:  # a peer that is already gone
                    continue
                if w is not None:
                    works.append(w)
        deadline = time.monotonic() + 5.0
        for w in works:
            while not w.is_completed() and time.monotonic() < deadline:
                time.sleep(1e-3)

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
            if self._closed:
                return
            try:
                record = json.loads(bytes(buf.tolist()).rstrip(b"\0").decode(errors="replace"))
            except json.JSONDecodeError:
                record = {"rank": "?", "step": "?", "error": "unreadable message"}
            self.failure = record
            if self._inside and self.grace_s is not None:
                threading.Timer(self.grace_s, self._end_if_stuck).start()

    def _end_if_stuck(self) -> None:
        """The watchdog: still inside a guard region, blocked in a collective the guard
        does not own, ``grace_s`` after a peer failed: end this process, saying why."""
        if self._inside and not self._raised and not self._closed:
            f = self.failure or {}
            sys.stderr.write(
                f"floatguard: rank {self.rank} ends: rank {f.get('rank')} failed at guard "
                f"step {f.get('step')} ({f.get('error')}), and this rank has been blocked in a "
                f"collective it will never complete for {self.grace_s:g} s "
                "(Guard(peer_grace_s=None) waits for the backend's timeout instead)\n"
            )
            sys.stderr.flush()
            os._exit(1)

    @contextmanager
    def region(self) -> Iterator[None]:
        """Mark code that may block in collectives the guard does not own (the
        closure's forward and backward): the watchdog may end the process there."""
        self.raise_if_failed()
        self._inside += 1
        try:
            yield
        finally:
            self._inside -= 1

    def close(self) -> None:
        """Stop listening (the pending receive is left to the process's exit)."""
        self._closed = True
