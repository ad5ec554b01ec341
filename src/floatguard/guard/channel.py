"""The channel: how the step's packed read reaches every rank, and how ranks agree on a fault.

Three ways, one interface (:class:`ReadChannel`):

- *local* (no torch.distributed): the read is this process's;
- *all-reduced*: one SUM all-reduce of :func:`floatguard.guard.step_check.pack`'s layout,
  the squared gradient norm weighed by DTensor placement
  (:class:`~floatguard.guard.grad_norm.PlacementNorm`: every element counted once);
- *carried*: under DDP, on DDP's own gradient all-reduce (a comm hook on the last
  bucket, :class:`~floatguard.guard.ddp_hook.DDPReadHook`), no extra collective.

Each way lays out its head of the packed tensor and decodes it (:class:`Head`); the
reader appends the hook monitor's records after it and reads the whole once. Both carry
the exact step check (:mod:`floatguard.guard.step_check`): ranks on another guard step
or configured differently stop with GuardDesync at that step, named by an all-gather.
The run's edges are here too: :meth:`ReadChannel.begin` (a step begins: a peer that
failed, finished or exited stops it before any collective), :meth:`ReadChannel.finish`
(the end of the run, together) and :meth:`ReadChannel.stopped` (the ``stop`` event).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from floatguard._foreach import is_dtensor, reduce_partial_grads
from floatguard.distributed import config_fingerprint
from floatguard.guard.ddp_hook import DDPReadHook, attach, detach
from floatguard.guard.grad_norm import PlacementNorm
from floatguard.guard.peers import Peers
from floatguard.guard.step_check import HEAD, desync_error, encode, leaves, pack, unpack
from floatguard.monitor.localize import Fault
from floatguard.stability.clip import total_norm

__all__ = ["Agreed", "Head", "ReadChannel"]


@dataclass(frozen=True)
class Agreed:
    """The step's numbers as every rank decides on them."""

    overflow: bool
    grad_norm: float
    loss: float
    bad_ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Head:
    """The head of the packed read (device float, no sync) and how to decode its host
    copy: ``size`` values, then ``decode(values) -> Agreed``; and the agreed numbers as
    device scalars (``found``: 0 when no rank overflowed, the gradient ``norm`` and the
    mean ``loss``, float64 where the read is), what :meth:`device_ok` decides on (the
    deferred mode): the same on every rank, from the same reduced values."""

    tensor: torch.Tensor
    decode: Callable[[list[float]], Agreed]
    found: torch.Tensor
    norm: torch.Tensor
    loss: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.tensor.numel())

    def device_ok(self) -> torch.Tensor:
        """No overflow (a NaN flag counts as one), a finite norm and loss: device bool."""
        return (self.found == 0) & torch.isfinite(self.norm) & torch.isfinite(self.loss)


def _exact_div(t: torch.Tensor, n: float) -> torch.Tensor:
    """``t / n`` as the host divides (a scalar divisor is a reciprocal product on CUDA)."""
    return torch.div(t, torch.full_like(t, n))


def _local_decode(values: list[float]) -> Agreed:
    # The local layout: [found_inf, total norm, mean loss].
    return Agreed(overflow=values[0] > 0, grad_norm=values[1], loss=values[2])


class ReadChannel:
    """Local, all-reduced or carried on DDP (see the module); agreement on bad steps.

    ``peers``: the other ranks (None without torch.distributed). ``configuration``:
    what every rank must share, fingerprinted for the exact check of each step.
    """

    def __init__(
        self,
        model: nn.Module,
        peers: Peers | None,
        process_group: Any,
        configuration: tuple[Any, ...],
        norm_type: float = 2.0,
    ) -> None:
        self.model = model
        self.peers = peers
        self.norm_type = norm_type
        self.configuration = configuration
        self.fingerprint = config_fingerprint(configuration)
        self.ddp_hook = self._register_ddp_hook(process_group)
        self._norms = PlacementNorm(peers.world if peers is not None else 1)
        # DTensor parameters (FSDP2, tensor parallelism; never under DDP, which refuses
        # them): only then can a gradient be Partial.
        self._placed = any(is_dtensor(p) for p in model.parameters())
        self.finished = self.closed = False
        # The other ranks' distinct faults of the last agreement (not the one chosen):
        # each is an event too, so a second bad host is not invisible.
        self.others: list[Fault] = []

    @property
    def rank(self) -> int:
        return self.peers.rank if self.peers is not None else 0

    @property
    def distributed(self) -> bool:
        return self.peers is not None

    def _register_ddp_hook(self, group: Any) -> DDPReadHook | None:
        """Under DDP, carry the step's read on DDP's own gradient all-reduce (no extra
        collective per step); a model with a comm hook of its own keeps it, and the
        read is all-reduced separately."""
        if self.peers is None or not isinstance(self.model, nn.parallel.DistributedDataParallel):
            return None
        hook = DDPReadHook(group, self.peers)
        return hook if attach(self.model, hook) else None  # the user's own hook stays

    # ------------------------------------------------------------ the run
    def begin(self, step: int) -> None:
        """Guard step ``step`` begins: refused after :meth:`finish` or :meth:`close`; under
        torch.distributed, this rank's failure (or a peer's finish or exit) raises now."""
        if self.closed:
            raise RuntimeError(
                f"guard.step() after guard.close(): the guard ended after {step} guard steps "
                "(build a new Guard to go on)"
            )
        if self.finished:
            raise RuntimeError(
                f"guard.step() after guard.finish(): the run ended after {step} guard steps"
            )
        if self.peers is not None:
            self.peers.begin(step)

    def finish(self, steps: int) -> None:
        """End the run after ``steps`` guard steps; under torch.distributed together with
        every rank (:meth:`Peers.finish`: GuardDesync if another rank took another number
        of steps, PeerFailed if one is gone)."""
        if self.closed:
            raise RuntimeError(
                f"guard.finish() after guard.close(): the guard ended after {steps} guard steps"
            )
        if self.peers is not None:
            self.peers.finish(steps)
        self.finished = True

    def read_sent(self) -> None:
        """(The deferred mode) The step's read was reduced over the ranks and posted, to
        be decoded a call later: the collectives after it belong to the next step (the
        step check, at the decode, still stops every rank if it fails)."""
        if self.peers is not None:
            self.peers.read_done()

    def stopped(self, step: int, error: BaseException) -> None:
        """The guard stops with PeerFailed / GuardDesync: the ``stop`` event, written once."""
        if self.peers is not None:
            self.peers.stopped(step, error)

    # ------------------------------------------------------------ the step
    def region(self) -> contextlib.AbstractContextManager[None]:
        """Where this rank may block in collectives the guard does not own."""
        return self.peers.region() if self.peers is not None else contextlib.nullcontext()

    def arm_for(self, step: int) -> Callable[[torch.Tensor], None] | None:
        """Under DDP with the guard's comm hook: a callable the runner gives the step's
        mean loss before the last backward (None otherwise)."""
        hook, peers = self.ddp_hook, self.peers
        if hook is None or peers is None:
            return None

        def arm(loss: torch.Tensor) -> None:
            hook.arm(loss, ~torch.isfinite(loss), step, self.fingerprint)

        return arm

    def reduce_partial(self, params: list[torch.Tensor]) -> None:
        """Under torch.distributed: the DTensor gradients with a Partial placement made
        Replicate before the step's read (:func:`~floatguard._foreach.reduce_partial_grads`:
        a collective only where such gradients exist; a model without DTensor
        parameters skips it)."""
        if self.peers is not None and self._placed:
            with self.region():
                reduce_partial_grads(params)

    def head(
        self,
        step: int,
        found: torch.Tensor,
        grads: list[torch.Tensor],
        loss: torch.Tensor,
        dev: torch.device,
    ) -> Head:
        """This step's head of the packed read, reduced over the ranks (no sync)."""
        if self.peers is None:
            norm = (
                total_norm(grads, self.norm_type).to(dev).float()
                if grads
                else torch.zeros((), device=dev)
            )
            t = torch.stack([found.float(), norm, loss.float()])
            return Head(t, _local_decode, t[0], t[1], t[2])
        peers = self.peers
        if self.ddp_hook is not None:
            # DDP: every rank's gradients are the same average, so norm and overflow need
            # no reduction; the losses and the step check came with the gradients.
            hook = self.ddp_hook
            n = total_norm(grads).to(dev).double() if grads else torch.zeros((), device=dev)
            carried = hook.take(found, n)
            if carried is not None:

                def decode_carried(values: list[float]) -> Agreed:
                    c = hook.decode(values, step)
                    self._check(c.differs, step)
                    sq = c.norm_sq
                    norm = math.sqrt(sq) if sq >= 0 or math.isnan(sq) else math.nan
                    found = not c.found == 0.0  # NaN counts as found
                    return Agreed(found, norm, c.loss / peers.world, c.bad_ranks)

                # [found, norm_sq] (the same on every rank), then the summed loss
                return Head(carried, decode_carried, carried[0], torch.sqrt(carried[1]),
                            _exact_div(carried[2], peers.world))  # fmt: skip
        # By placement (guard.grad_norm): the part every element of which one rank holds
        # adds up over the ranks, the replicas' part is averaged.
        summed, averaged = self._norms.parts(grads, dev)
        local_bad = ~torch.isfinite(loss) | ~torch.isfinite(averaged) | ~torch.isfinite(summed)
        mine = encode(step, self.fingerprint, peers.world, 53)
        packed = pack(found, summed, averaged, loss, local_bad, peers.rank, mine)
        reduced = peers.all_reduce_sum(packed, "the guard's step read")
        assert reduced.numel() == HEAD + len(mine)
        world = peers.world
        norm = torch.sqrt(reduced[1] + _exact_div(reduced[2], world))  # (pack's layout)
        return Head(reduced, lambda values: self._agreed(values, step, mine), reduced[0], norm,
                    _exact_div(reduced[3], world))  # fmt: skip

    def _agreed(self, summed: list[float], step: int, mine: list[float]) -> Agreed:
        assert self.peers is not None
        agreed = unpack(summed, self.peers.world, mine)
        self._check(agreed.differs, step)
        return Agreed(agreed.found, agreed.grad_norm, agreed.loss, agreed.bad_ranks)

    def _check(self, differs: tuple[str, ...], step: int) -> None:
        """The exact step check's verdict: every rank sees the same sums, so every rank
        that fails it all-gathers its step and configuration and raises the same
        GuardDesync, naming the ranks and what differs; else the step's read is done."""
        peers = self.peers
        assert peers is not None
        if differs:
            record = {"step": step, "config": leaves(self.configuration)}
            records = peers.all_gather_json(record, "the step check", size=16384)
            raise peers.fail(desync_error(peers.rank, step, differs, records), tell=False)
        peers.read_done()

    # ------------------------------------------------------- a bad step
    def agree(
        self, local: Fault | None, bad_ranks: tuple[int, ...], what: str, *, rare: bool = False
    ) -> Fault | None:
        """Under torch.distributed, the fault every rank takes: the ranks all-gather their
        own finding (bad steps only) and take the first reproduced one (lowest rank),
        else the first finding, named with its rank; without distributed, ``local``.
        ``rare``: a finding is rare (the snapshot step's state check): the ranks first
        count their findings (one all-reduce of one number) and all-gather only if one
        has one."""
        self.others = []
        if self.peers is None:
            return local
        if rare and self.peers.count(local is not None, f"count of the {what}'s findings") == 0:
            return None
        mine = None if local is None else dataclasses.replace(local, rank=self.peers.rank)
        records = self.peers.all_gather_json(
            {"fault": None if mine is None else mine.to_record()}, f"agreement on the {what}"
        )
        found = [Fault.from_record(r["fault"]) for r in records if r.get("fault")]
        # reproduced first, then localized (an op named) first, then the lowest rank
        found.sort(key=lambda f: (f.deterministic is not True, f.op is None, f.rank or 0))
        if not found:
            return None
        best = found[0]
        seen = {(best.rank, best.module, best.tensor)}
        for f in found[1:]:  # every distinct (rank, module, tensor) finding, in rank order
            key = (f.rank, f.module, f.tensor)
            # A rank's own localized fault only (an op named: not the agreed loss it
            # saw), reproduced there or with a bad local loss/norm before the reduction:
            # not a value the gradient all-reduce brought it.
            own = f.op is not None and (f.deterministic is True or f.rank in bad_ranks)
            if own and key not in seen:
                seen.add(key)
                self.others.append(mine if mine is not None and f == mine else f)
        self.others.sort(key=lambda f: f.rank or 0)
        if mine is not None and best == mine:
            best = mine  # this rank's own finding, with its value statistics (not sent)
        if best.deterministic is not True and bad_ranks:
            best = dataclasses.replace(best, rank=bad_ranks[0])  # where the read saw it
        return best

    @contextlib.contextmanager
    def no_gradient_sync(self) -> Iterator[None]:
        """DDP's ``no_sync()`` around a replay: each rank's gradients stay its own, so
        only the faulting rank reproduces the fault. FSDP2 replays with its collectives
        (every rank replays a bad step, so they match): without gradient sync it keeps
        the replay's unsharded gradients and adds them to the next step's. The replay
        does not take a value a collective delivers for a birth, so there too only the
        faulting rank names one."""
        sync = getattr(self.model, "no_sync", None)
        if callable(sync):
            with sync():
                yield
        else:
            yield

    # ------------------------------------------------------- failures
    def announce_failure(self, step: int, error: BaseException) -> None:
        """This rank alone raised out of its guard: tell the others, who wait on it."""
        if self.peers is not None:
            self.peers.announce_failure(step, error)

    def close(self, error: BaseException | None = None) -> None:
        """The guard ends (once): DDP's default all-reduce again, and the peers told
        (:meth:`Peers.close`; ``error``: what ends the run, raised outside the guard)."""
        if self.closed:
            return
        self.closed = True
        if self.ddp_hook is not None:  # the model's DDP all-reduce is DDP's default again
            detach(self.model, self.ddp_hook)
        if self.peers is not None:
            self.peers.close(error)
