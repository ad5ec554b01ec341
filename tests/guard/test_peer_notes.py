"""How a rank explains a failed collective from its peers' notes in torch's store
(no process group needed: the notes are read through the store's own API)."""

from __future__ import annotations

import json
from typing import Any

from floatguard.distributed import PeerFailed
from floatguard.guard.peers import Peers


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


def _peers(rank: int, world: int, notes: dict[int, dict[str, Any]]) -> Peers:
    store = _Store()
    for r, note in notes.items():
        store.set(f"floatguard/run/note/{r}", json.dumps(note))
    peers = Peers.__new__(Peers)  # a rank's view without a process group
    peers.rank, peers.world, peers.store, peers._key = rank, world, store, "floatguard/run"
    return peers


def test_a_relayed_stop_names_the_rank_at_fault_not_the_relay() -> None:
    # 3 ranks: rank 1 is gone; rank 0 found it and stopped; rank 2 reads rank 0's note.
    said = "rank 0 stops at guard step 7: rank 1 is gone (exited or killed)"
    note = {"kind": "stop", "step": 7, "type": "PeerFailed", "ranks": [1], "message": said}
    found = _peers(2, 3, {0: note})._from_notes(7, "the guard's step read")
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
    cls, text, ranks = _peers(1, 2, {0: note})._from_notes(3, "guard.finish()") or (None, "", ())
    assert cls is PeerFailed and ranks == (0,)
    assert text == "rank 1 stops: rank 0 stopped at guard step 3: its data loader raised"
