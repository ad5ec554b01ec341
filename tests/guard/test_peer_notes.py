"""How a rank explains a failed collective from its peers' notes in torch's store
(no process group needed: the notes are read through the store's own API)."""

from __future__ import annotations

import json
from typing import Any

from floatguard.distributed import PeerFailed
from floatguard.guard.peer_notes import PeerNotes


class _Store:
    """The part of torch's Store API the peers use (set, get, check)."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.kv[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.kv[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.kv for k in keys)


def _notes(rank: int, world: int, notes: dict[int, dict[str, Any]]) -> PeerNotes:
    store = _Store()
    for r, note in notes.items():
        store.set(f"floatguard/run/note/{r}", json.dumps(note))
    return PeerNotes(store, rank, world, key="floatguard/run")


def test_a_relayed_stop_names_the_rank_at_fault_not_the_relay() -> None:
    # 3 ranks: rank 1 is gone; rank 0 found it and stopped; rank 2 reads rank 0's note.
    said = "rank 0 stops at guard step 7: rank 1 is gone (exited or killed)"
    note = {"kind": "stop", "step": 7, "type": "PeerFailed", "ranks": [1], "message": said}
    found = _notes(2, 3, {0: note}).explain(7, "the guard's step read")
    assert found is not None
    cls, text, ranks = found
    assert cls is PeerFailed and ranks == (1,)
    assert text.startswith(
        "rank 2 stops: rank 0 stopped at guard step 7, naming rank 1 (not itself): "
    )
    assert text.endswith(": rank 1 is gone (exited or killed)")  # its own "who stops" cut


def test_a_stop_naming_its_own_rank_reads_as_before() -> None:
    said = "rank 0 stops at guard step 3: its data loader raised"
    note = {"kind": "stop", "step": 3, "type": "PeerFailed", "ranks": [0], "message": said}
    cls, text, ranks = _notes(1, 2, {0: note}).explain(3, "guard.finish()") or (None, "", ())
    assert cls is PeerFailed and ranks == (0,)
    assert text == "rank 1 stops: rank 0 stopped at guard step 3: its data loader raised"


def test_a_note_is_left_once_and_read_by_the_peers() -> None:
    store = _Store()
    mine, theirs = PeerNotes(store, 1, 2, key="k"), PeerNotes(store, 0, 2, key="k")
    mine.note("failed", step=4, error="ValueError: bad batch")
    mine.note("finished", steps=5)  # the first note wins
    assert theirs.get("note", 1) == {"kind": "failed", "step": 4, "error": "ValueError: bad batch"}
    found = theirs.explain(4, "the guard's step read")
    assert found == (
        PeerFailed,
        "rank 0 stops: rank 1 failed at guard step 4 (ValueError: bad batch); "
        "the ranks cannot go on without it",
        (1,),
    )
    assert PeerNotes(None, 0, 2).get("note", 1) is None  # no store: nothing, no error
