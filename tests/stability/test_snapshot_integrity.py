"""Snapshot files are verified on load; a store keeps K, falls back, and cleans up."""

from __future__ import annotations

import hashlib
import os
import random
import re
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from floatguard import Snapshot, SnapshotError, SnapshotStore, load_snapshot
from floatguard.stability._process import writer_tag
from floatguard.stability.snapshot import ForeignSnapshotError, read_identity, step_of

pytestmark = pytest.mark.subprocess

RUN_A, RUN_B = "a" * 32, "b" * 32


def _snapshot(step: int, seed: int = 0) -> tuple[Snapshot, nn.Module]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    return Snapshot.capture(step, {"model": model}), model


def test_every_bit_flip_is_detected(tmp_path: Path) -> None:
    snap, _ = _snapshot(3)
    path = snap.save(tmp_path / "s.fgs")
    good = path.read_bytes()
    rng = random.Random(0)
    header = set(range(22, 86))  # length, SHA-256, step and run id: every byte of them
    offsets = sorted({rng.randrange(len(good)) for _ in range(150)} | header | {len(good) - 1})
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


def test_the_header_names_the_step_and_the_run(tmp_path: Path) -> None:
    snap, _ = _snapshot(7)
    snap.run_id = RUN_A
    path = snap.save(tmp_path / "s.fgs")
    assert read_identity(path) == (7, RUN_A)
    assert load_snapshot(path).run_id == RUN_A
    assert load_snapshot(path, run_id=RUN_A).step == 7
    with pytest.raises(ForeignSnapshotError, match=f"written by run {RUN_A}, not by the "
                       f"expected run {RUN_B}"):  # fmt: skip
        load_snapshot(path, run_id=RUN_B)
    # a file written before identities (format 1) still loads, with no run id
    raw = path.read_bytes()
    payload = raw[86:]
    old = b"FLOATGUARD-SNAPSHOT 1\n" + struct.pack(
        ">Q32s", len(payload), hashlib.sha256(payload).digest()
    )
    (tmp_path / "old.fgs").write_bytes(old + payload)
    assert read_identity(tmp_path / "old.fgs") == (None, None)
    legacy = load_snapshot(tmp_path / "old.fgs")
    assert (legacy.step, legacy.run_id) == (7, None)
    with pytest.raises(ForeignSnapshotError, match="written by a floatguard without run ids"):
        load_snapshot(tmp_path / "old.fgs", run_id=RUN_A)
    with pytest.raises(ValueError, match="a run id is 32 lowercase hex digits"):
        SnapshotStore(tmp_path, run_id="not-a-run")


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("snapshot-000000015.fgs", 15),
        ("snapshot-999999999.fgs", 999_999_999),
        ("snapshot-1000000000.fgs", 1_000_000_000),
        ("snapshot-12345678901234.fgs", 12_345_678_901_234),
        ("snapshot-0000000015.fgs", None),  # not how path_for spells step 15
        ("snapshot-15.fgs", None),
        ("snapshot-000000015.fgs.tmp", None),
    ],
    ids=["9 digits", "largest 9", "10 digits", "14 digits", "padded", "short", "suffix"],
)
def test_the_step_a_name_says(name: str, step: int | None) -> None:
    assert step_of(name) == step
    if step is not None:
        assert SnapshotStore("x").path_for(step).name == name


def test_steps_past_nine_digits_are_found_and_pruned(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, keep=2)
    for step in (999_999_998, 999_999_999, 1_000_000_000, 1_000_000_001):
        store.save(_snapshot(step)[0])
        assert store.paths()[0] == store.path_for(step)  # the newest, whatever its digits
    assert [p.name for p in store.paths()] == ["snapshot-1000000001.fgs", "snapshot-1000000000.fgs"]
    snap, used, bad = store.load_latest()
    assert (snap.step, used.name, bad) == (1_000_000_001, "snapshot-1000000001.fgs", [])


def test_a_store_keeps_and_loads_its_own_runs_files_only(tmp_path: Path) -> None:
    a = SnapshotStore(tmp_path, keep=2, run_id=RUN_A)
    b = SnapshotStore(tmp_path, keep=2, run_id=RUN_B)
    for step in (1, 2, 3):
        a.save(_snapshot(step)[0])
    for step in (4, 5, 6):
        b.save(_snapshot(step)[0])
    # each pruned its own files only: a's 2 and 3 are left beside b's 5 and 6
    assert [p.name for p in a.own()] == ["snapshot-000000003.fgs", "snapshot-000000002.fgs"]
    assert [p.name for p in b.own()] == ["snapshot-000000006.fgs", "snapshot-000000005.fgs"]
    assert len(a.paths()) == 4
    snap, used, bad = a.load_latest()
    assert (snap.step, snap.run_id, used) == (3, RUN_A, a.path_for(3))
    assert [(p.name, why) for p, why in bad] == [
        (f"snapshot-00000000{s}.fgs", f"{tmp_path / f'snapshot-00000000{s}.fgs'}: written by "
         f"run {RUN_B}, not by the expected run {RUN_A} (another run's snapshot)")
        for s in (6, 5)
    ]  # fmt: skip
    assert a.load_latest(foreign=True)[0].step == 6


_WRITER = "import sys; print(sys.argv[1], flush=True); sys.stdin.read()"


def test_two_writers_in_one_folder_keep_each_others_temp_files(tmp_path: Path) -> None:
    live = subprocess.Popen(
        [sys.executable, "-c", _WRITER, "live"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        assert live.stdout is not None and live.stdout.readline() == b"live\n"
        temps = {
            who: tmp_path / f".snapshot-000000009.fgs.{tag}.k2j4h5_q.tmp"
            for who, tag in (
                ("live", writer_tag(live.pid)),
                ("dead", writer_tag(dead.pid)),
                ("mine", writer_tag()),
            )
        }
        temps["old"] = tmp_path / ".snapshot-000000009.fgs.abc123.tmp"  # before writer tags
        for t in temps.values():
            t.write_bytes(b"half a snapshot")
        store = SnapshotStore(tmp_path, keep=2)
        assert sorted(store.leftovers()) == sorted([temps["dead"], temps["old"]])
        store.save(_snapshot(1)[0])
        assert {w for w, t in temps.items() if t.exists()} == {"live", "mine"}
        # a store whose user holds the folder's lock: no other process writes there
        locked = SnapshotStore(tmp_path, keep=2, exclusive=True)
        assert locked.leftovers() == [temps["live"]]  # never this process's own
    finally:
        live.kill()
        live.wait()
