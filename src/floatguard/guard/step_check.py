"""The exact step check: every rank's guard step and configuration fingerprint, compared
on the step's own all-reduce (a SUM), and the packed read that carries them.

Words used here:

- *slots*: this rank's step and fingerprint (64 bits each, no residues) written as
  digits base n+1 (n: the world size), k bits per float of the all-reduced tensor, with
  (n+1)**k <= 2**m (m = 24 in a float32 gradient bucket, 53 in float64). Each digit is
  a bit (0 or 1), so the SUM over the ranks adds digit by digit without carries (a
  digit's sum is at most n < n+1) and every partial sum is an integer below 2**m: exact
  whatever order the backend adds in. 2 ranks: 10 float32 or 4 float64 slots; 64 ranks:
  44 / 16; 4096 ranks: 128 / 32 (at most 512 bytes on an all-reduce that carries the
  gradients).
- *the check*: the ranks hold the same step (fingerprint) exactly when every summed slot
  equals n times this rank's own: without carries the sum's digits are the per-bit
  counts of ranks, and n * own has digits 0 or n, which a count equals only when every
  rank has that bit. Two values that differ anywhere differ in a bit.
- *the packed read* (the all-reduced way, float64): the overflow flag, the squared
  gradient norm in two parts (a summed one: each element held by one rank, FSDP2 shards,
  a DTensor's pieces; an averaged one: replicas, DDP's and plain tensors'; weighed by
  placement in :mod:`floatguard.guard.grad_norm`), the loss, the bad-rank bits, then the
  slots (:func:`pack`, :func:`unpack`).

Reading order: :func:`encode` -> :func:`differing`; :func:`pack` -> :func:`unpack`;
:func:`desync_error` (the message when the ranks differ, from an all-gather of each
rank's step and :func:`leaves` of its configuration).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from floatguard.distributed import GuardDesync

__all__ = [
    "BITS",
    "HEAD",
    "Unpacked",
    "bad_ranks_of",
    "desync_error",
    "differing",
    "encode",
    "leaves",
    "pack",
    "slot_count",
    "unpack",
]

BITS = 64  # the step and the fingerprint, each as an unsigned 64-bit integer
_MASK = (1 << BITS) - 1
HEAD = 5  # the packed read's numbers before the slots (see :func:`pack`)
# The configuration parts in the order floatguard.guard._setup.configuration builds them
# (names for messages only; another shape is named by position).
_PARTS = ("precision", "watch", "clip", "spikes", "response", "parameter shapes")


def _bits_per_slot(world: int, mantissa: int) -> int:
    """The largest k with (world + 1)**k <= 2**mantissa (0: this world is too large)."""
    k, base, limit = 0, world + 1, 1 << mantissa
    while base ** (k + 1) <= limit:
        k += 1
    return k


def slot_count(world: int, mantissa: int) -> int:
    """How many slots carry the step and the fingerprint for ``world`` ranks in floats
    with that many mantissa bits (24: float32, 53: float64); 0 when the world is too
    large for an exact check."""
    k = _bits_per_slot(world, mantissa)
    return 0 if k == 0 else 2 * -(-BITS // k)


def _digits(value: int, k: int, base: int) -> list[float]:
    """``value``'s 64 bits, k per slot, each slot the bits as digits base ``base``."""
    out = []
    for first in range(0, BITS, k):
        chunk = value >> first & ((1 << k) - 1)
        if base <= 36:  # int() reads the chunk's binary digits in that base (C speed)
            out.append(float(int(format(chunk, "b"), base)))
        else:
            out.append(float(sum(base**j for j in range(k) if chunk >> j & 1)))
    return out


def encode(step: int, fingerprint: int, world: int, mantissa: int) -> list[float]:
    """This rank's slots: the step's, then the fingerprint's (exact floats)."""
    k, base = _bits_per_slot(world, mantissa), world + 1
    return _digits(step & _MASK, k, base) + _digits(fingerprint & _MASK, k, base)


def differing(
    summed: Sequence[float], mine: Sequence[float], world: int, mantissa: int
) -> tuple[str, ...]:
    """What the ranks do not share, from the summed slots and this rank's own:
    ``"step"``, ``"configuration"``, both or neither; ``("garbled",)`` when a slot is not
    such a sum at all (not an integer below (n+1)**k: the all-reduce met another)."""
    top = float((world + 1) ** _bits_per_slot(world, mantissa))
    if len(summed) != len(mine) or not all(
        math.isfinite(v) and v == int(v) and 0 <= v < top for v in summed
    ):
        return ("garbled",)
    half = len(mine) // 2
    out = []
    for what, part in (("step", slice(0, half)), ("configuration", slice(half, None))):
        if any(v != world * m for v, m in zip(summed[part], mine[part], strict=True)):
            out.append(what)
    return tuple(out)


@dataclass(frozen=True)
class Unpacked:
    """What the packed read says, the same on every rank; ``differs``: what the ranks do
    not share (see :func:`differing`; the channel names the ranks)."""

    found: bool
    grad_norm: float
    loss: float
    bad_ranks: tuple[int, ...]
    differs: tuple[str, ...] = ()


def pack(
    found: torch.Tensor,
    norm_sq_summed: torch.Tensor,
    norm_sq_averaged: torch.Tensor,
    loss: torch.Tensor,
    local_bad: torch.Tensor,
    rank: int,
    slots: Sequence[float],
) -> torch.Tensor:
    """This rank's packed read (device float64, no sync): :data:`HEAD` numbers, then its
    ``slots`` (:func:`encode` of its step and fingerprint, float64's)."""
    bit = float(2**rank) if rank < 52 else 0.0  # bits beyond float64's mantissa: not named
    head = torch.stack(
        [found.double().reshape(()), norm_sq_summed.double().reshape(()),
         norm_sq_averaged.double().reshape(()), loss.double().reshape(()),
         local_bad.double().reshape(()) * bit]
    )  # fmt: skip
    tail = torch.tensor(list(slots), dtype=torch.float64)
    return torch.cat([head, tail.to(loss.device)])


def bad_ranks_of(bits: float, world: int, named: int) -> tuple[int, ...]:
    """The ranks whose bit is set in a sum of ``2**rank`` (ranks below ``named``)."""
    if not math.isfinite(bits) or bits <= 0:
        return ()
    b = int(bits)
    return tuple(r for r in range(min(world, named)) if b >> r & 1)


def unpack(values: Sequence[float], world: int, mine: Sequence[float]) -> Unpacked:
    """The agreed numbers from the all-reduced read (:func:`pack`'s layout, summed);
    ``mine``: this rank's slots (:func:`encode`, float64), for the step check."""
    n = float(world)
    differs = differing(values[HEAD:], mine, world, 53)
    norm_sq = values[1] + values[2] / n
    return Unpacked(
        found=not values[0] == 0.0,  # NaN counts as found
        grad_norm=math.sqrt(norm_sq) if norm_sq >= 0 or math.isnan(norm_sq) else math.nan,
        loss=values[3] / n,
        bad_ranks=bad_ranks_of(values[4], world, 52),
        differs=differs,
    )


# ---------------------------------------------------------------- messages
def leaves(configuration: Any) -> dict[str, str]:
    """The configuration as named, printable leaves (``"response.max_rollbacks": "3"``),
    so a message can say what differs; a long list (the parameter shapes) is one leaf:
    its length and a digest."""
    out: dict[str, str] = {}

    def walk(path: str, value: Any) -> None:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                walk(f"{path}.{f.name}", getattr(value, f.name))
        elif isinstance(value, list | tuple) and all(
            isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str) for v in value
        ) and value:  # fmt: skip
            for key, v in value:
                walk(f"{path}.{key}", v)
        elif isinstance(value, list) and len(value) > 4:
            text = repr(value)
            out[path] = f"{len(value)} items (crc32 {zlib.crc32(text.encode()):08x})"
        else:
            out[path] = repr(value)[:80]

    parts = configuration if isinstance(configuration, tuple) else (configuration,)
    names = _PARTS if len(parts) == len(_PARTS) else tuple(f"item {i}" for i in range(len(parts)))
    for name, part in zip(names, parts, strict=True):
        walk(name, part)
    return out


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def desync_error(
    rank: int, step: int, differs: tuple[str, ...], records: list[dict[str, Any]]
) -> GuardDesync:
    """The GuardDesync every rank raises when the exact check fails, from every rank's
    ``{"step": ..., "config": leaves(...)}`` (all-gathered, rank order)."""
    if "garbled" in differs:
        return GuardDesync(
            f"rank {rank} stops at guard step {step}: the step check arrived garbled (the "
            "guard's all-reduce met a collective of another kind): the ranks are not running "
            "the same collectives; every rank must run the same guard steps",
            step=step,
        )
    if "step" in differs:
        groups: dict[int, list[int]] = {}
        for r, rec in enumerate(records):
            groups.setdefault(int(rec.get("step", -1)), []).append(r)
        ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
        named = tuple(r for _, rs in ordered[1:] for r in rs)
        where = ", ".join(f"{_ranks_text(rs)} at guard step {s}" for s, rs in ordered)
        spread = max(groups) - min(groups)
        # Skipped or added guard.step() calls do not show here (the steps pair off, or
        # finish() or DDP's hook names them): the counters started apart.
        return GuardDesync(
            f"rank {rank} stops at guard step {step}: the ranks are not on the same guard "
            f"step ({where}): their step counters are {spread} apart, so they started from "
            "different steps (a rank restored another checkpoint through "
            "Guard.load_state_dict, or its step_count was set apart; guard.resume() agrees "
            "on a step every rank has a snapshot of). Give every rank the state of one step",
            ranks=named,
            step=step,
        )
    mine = records[rank].get("config", {}) if rank < len(records) else {}
    for r, rec in enumerate(records):
        theirs = rec.get("config", {})
        for path in sorted(set(mine) | set(theirs)):
            if r != rank and mine.get(path) != theirs.get(path):
                return GuardDesync(
                    f"rank {rank} stops at guard step {step}: its guard is configured "
                    f"differently from rank {r}'s: {path} is {mine.get(path, '(none)')} on "
                    f"rank {rank} and {theirs.get(path, '(none)')} on rank {r}; give every "
                    "rank the same precision, policies and model",
                    ranks=(r,),
                    step=step,
                )
    return GuardDesync(
        f"rank {rank} stops at guard step {step}: its guard is configured differently from "
        "another rank's (their configuration fingerprints differ); give every rank the same "
        "precision, policies and model",
        step=step,
    )
