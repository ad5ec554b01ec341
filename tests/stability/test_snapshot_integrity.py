"""Snapshot files are verified on load; a store keeps K, falls back, and cleans up."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from floatguard import Snapshot, SnapshotError, SnapshotStore, load_snapshot


def _snapshot(step: int, seed: int = 0) -> tuple[Snapshot, nn.Module]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    return Snapshot.capture(step, {"model": model}), model


def test_every_bit_flip_is_detected(tmp_path: Path) -> None:
    snap, _ = _snapshot(3)
    path = snap.save(tmp_path / "s.fgs")
    good = path.read_bytes()
    rng = random.Random(0)
    offsets = sorted({rng.randrange(len(good)) for _ in range(150)} | {0, 25, 30, len(good) - 1})
    for off in offsets:
        bad = bytearray(good)
        bad[off] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(bad))
        with pytest.raises(SnapshotError, match=r"s\.fgs"):
            load_snapshot(path)
    path.write_bytes(good)
    assert load_snapshot(path).step == 3


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "not a floatguard snapshot (an empty file)"),
        (b"step,loss\n1,0.5\n", "not a floatguard snapshot (no snapshot header)"),
        (b"FLOATGUARD-SNAPSHOT 1\n\x00\x01", "truncated snapshot"),
    ],
    ids=["empty", "text", "cut header"],
)
def test_foreign_or_broken_files_name_the_path(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "x.fgs"
    path.write_bytes(content)
    with pytest.raises(SnapshotError, match=re.escape(message)) as ei:
        load_snapshot(path)
    assert str(path) in str(ei.value) and "weights_only" not in str(ei.value)


def test_a_truncated_payload_and_a_plain_torch_file(tmp_path: Path) -> None:
    snap, _ = _snapshot(1)
    path = snap.save(tmp_path / "s.fgs")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(SnapshotError, match=r"truncated or padded snapshot \(\d+ payload bytes"):
        load_snapshot(path)
    torch.save({"step": 1}, tmp_path / "plain.pt")  # torch's own file, no header
    with pytest.raises(SnapshotError, match="no snapshot header"):
        load_snapshot(tmp_path / "plain.pt")


def test_the_store_keeps_k_falls_back_and_cleans_leftovers(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, keep=3)
    for step in range(5):
        store.save(_snapshot(step, seed=step)[0])
    assert [p.name for p in store.paths()] == [
        "snapshot-000000004.fgs",
        "snapshot-000000003.fgs",
        "snapshot-000000002.fgs",
    ]
    newest = store.paths()[0]
    raw = bytearray(newest.read_bytes())
    raw[-10] ^= 0xFF
    newest.write_bytes(bytes(raw))
    snap, used, bad = store.load_latest()
    assert snap.step == 3 and used.name == "snapshot-000000003.fgs"
    assert [p.name for p, _ in bad] == [newest.name] and "corrupted" in bad[0][1]
    # what an interrupted save leaves is never read as a snapshot, and goes at the next save
    left = tmp_path / ".snapshot-000000005.fgs.abc123.tmp"
    left.write_bytes(b"half a snapshot")
    assert left not in store.paths()
    store.save(_snapshot(6)[0])
    assert not left.exists() and store.leftovers() == []
    for p in store.paths():
        p.write_bytes(b"")
    with pytest.raises(SnapshotError, match="no good snapshot in"):
        store.load_latest()
    with pytest.raises(ValueError, match="keep=0"):
        SnapshotStore(tmp_path, keep=0)


_SAVER = textwrap.dedent(
    """
    import sys, torch
    from floatguard import Snapshot, SnapshotStore
    store = SnapshotStore(sys.argv[1], keep=2)
    torch.manual_seed(0)
    state = {"w": torch.randn(1_000_000)}  # 4 MB: a save takes a while

    class Obj:
        def state_dict(self):
            return state

    step = 0
    while True:
        state["w"].add_(1.0)
        store.save(Snapshot.capture(step, {"obj": Obj()}))
        print(step, flush=True)
        step += 1
    """
)


def test_kill_9_during_saves_leaves_a_verified_snapshot(tmp_path: Path) -> None:
    rng = random.Random(7)
    runs = 6 if os.environ.get("CI") else 12
    for run in range(runs):
        folder = tmp_path / f"run{run}"
        proc = subprocess.Popen(
            [sys.executable, "-c", _SAVER, str(folder)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        proc.stdout.readline()  # the first save is complete
        time.sleep(rng.uniform(0.0, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        store = SnapshotStore(folder, keep=2)
        snap, _, bad = store.load_latest()
        assert bad == [], bad
        torch.manual_seed(0)
        expected = torch.randn(1_000_000)
        for _ in range(snap.step + 1):
            expected.add_(1.0)
        assert torch.equal(snap.states["obj"]["w"], expected)  # the state of that step
        store.save(snap)
        assert store.leftovers() == []
