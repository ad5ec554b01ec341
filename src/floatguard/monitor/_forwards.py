"""A step's top-level calls (its forwards): which ones the step still wants, and dropping the rest.

A forward is *dead* once it is over, no gradient of it arrived and its autograd graph
is gone: no backward can come for it (an evaluation run with grad enabled, say), so
no step wants its records. Its graph's life is seen through a token put in the
``metadata`` of its outputs' autograd nodes: the token dies with the last of them.
"""

from __future__ import annotations

import dataclasses
import weakref

from torch.utils.hooks import RemovableHandle

from floatguard.monitor._proofs import Frame
from floatguard.monitor._records import RecordBook

__all__ = ["Forward", "drop_dead"]


class _Token:
    """Held by the autograd nodes of one forward's outputs (in their ``metadata``)."""

    __slots__ = ("__weakref__",)


@dataclasses.dataclass(eq=False)
class Forward:
    """One top-level module call (usually a forward of the model) and what it left:
    its records (``book.records[start:end]``), its frames, the entries it made in the
    recorder's awaited table (``hooked``, kept by identity) and its hooks on leaves;
    whether a gradient of it arrived (``reached``), and its graph's token."""

    start: int
    token: _Token | None  # held while the call runs, then only by its graph's nodes
    graph: weakref.ref[_Token]
    end: int = -1  # -1 while the call runs
    frames: list[Frame] = dataclasses.field(default_factory=list)
    hooked: list[tuple[int, object]] = dataclasses.field(default_factory=list)
    handles: list[RemovableHandle] = dataclasses.field(default_factory=list)
    reached: bool = False

    @classmethod
    def open(cls, start: int) -> Forward:
        """A forward whose records begin at ``start``."""
        token = _Token()
        return cls(start, token, weakref.ref(token))

    def close(self, end: int) -> None:
        """The call is over; from now on only its graph holds the token."""
        self.end = end
        self.token = None

    @property
    def dead(self) -> bool:
        """Over, no gradient of it arrived, and its graph is gone (or it had none)."""
        return self.end >= 0 and not self.reached and self.graph() is None


def drop_dead(
    forwards: list[Forward], book: RecordBook
) -> tuple[list[Forward], list[Forward], dict[int, int]]:
    """Drop the dead forwards' records, and the slots only they used, from ``book``;
    renumber the live forwards (their spans and frames; the dead ones' frames are
    marked dropped). Returns the live forwards, the dead ones and each kept slot's
    new number."""
    live: list[Forward] = []
    dead: list[Forward] = []
    spans: list[tuple[int, int]] = []
    removed = 0
    for f in forwards:
        if f.dead:
            spans.append((f.start, f.end))
            removed += f.end - f.start
            dead.append(f)
            for frame in f.frames:
                frame.dropped = True
        else:
            f.start -= removed
            if f.end >= 0:
                f.end -= removed
            live.append(f)
    remap = book.drop(spans)
    for f in live:
        for frame in f.frames:
            if frame.dropped:
                continue
            if all(d in remap for d in frame.deps):
                frame.deps = [remap[d] for d in frame.deps]
                frame.g_slot = None if frame.g_slot is None else remap.get(frame.g_slot)
            else:  # cannot happen (a live frame reads its own records): no proof then
                frame.dropped = True
    return live, dead, remap
