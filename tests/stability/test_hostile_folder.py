"""Folders floatguard does not control (issue 39, items 1-3 and 8): a FIFO named like a
snapshot, a link to a device, a directory under a snapshot's name, and a lock file
that is a link to a user's file. Nothing blocks, nothing is read past a real file's
size, nothing is written through a link. Every run in a subprocess with a hard
timeout, so a hang fails the test instead of hanging the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess

ROOT = Path(__file__).resolve().parents[2]

TRAIN = textwrap.dedent(
    """
    import json, sys, warnings
    import torch
    from torch import nn
    import floatguard
    folder, plant, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    def guard():
        return floatguard.Guard(model, opt, log=folder + ".jsonl",
            response=floatguard.ResponsePolicy(snapshot_dir=folder, snapshot_every=2))
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = guard()
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        for i in range(steps):
            if i == 3:
                exec(plant)
            g.step(lambda: nn.functional.mse_loss(model(x), y))
        g.close()
        g = guard()
        try:
            out["resumed"] = g.resume()
        except floatguard.SnapshotError as e:
            out["error"] = str(e)
        g.close()
    out["warnings"] = [str(w.message) for w in caught]
    events = [json.loads(l) for l in open(folder + ".jsonl")]
    out["fallbacks"] = [e["bad"] for e in events if e["kind"] == "snapshot_fallback"]
    print(json.dumps(out))
    """
)


def _train(tmp_path: Path, plant: str, steps: int = 9) -> dict[str, object]:
    folder = tmp_path / "snaps"
    done = subprocess.run(
        [sys.executable, "-c", TRAIN, str(folder), plant, str(steps)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize(
    "what",
    ["fifo", "dev_zero", "directory"],
)
def test_a_stranger_named_like_the_newest_snapshot_is_passed_over(
    tmp_path: Path, what: str
) -> None:
    """Planted mid-run under a name newer than any snapshot the run will write: the
    run's snapshot steps neither block nor read it, and resume() passes over it with
    a snapshot_fallback naming it, to the newest real snapshot."""
    name = f"{tmp_path / 'snaps'}/snapshot-000000099.fgs"
    plant = {
        "fifo": f"import os; os.mkfifo({name!r})",
        "dev_zero": f"import os; os.symlink('/dev/zero', {name!r})",
        "directory": f"import os; os.mkdir({name!r})",
    }[what]
    out = _train(tmp_path, plant)
    assert isinstance(out.get("resumed"), int) and out["resumed"] < 99, out
    (bad,) = out["fallbacks"]  # type: ignore[misc]
    assert bad.endswith("snapshot-000000099.fgs"), out


def test_the_lock_never_writes_through_a_link(tmp_path: Path) -> None:
    """floatguard.lock a symlink (and another run: a hard link) to a user's file: the
    user's file is byte-identical after a run and its close()."""
    victim = tmp_path / "precious.txt"
    content = b"a user's file, 1,400 bytes of it\n" * 42
    victim.write_bytes(content)
    folder = tmp_path / "snaps"
    folder.mkdir()
    os.symlink(victim, folder / "floatguard.lock")
    out = _train(tmp_path, "pass", steps=5)
    assert victim.read_bytes() == content
    assert any("floatguard.lock was a link" in w for w in out["warnings"]), out  # type: ignore[union-attr]
    assert not (folder / "floatguard.lock").is_symlink()
    # a hard link: the same
    (folder / "floatguard.lock").unlink(missing_ok=True)
    os.link(victim, folder / "floatguard.lock")
    _train(tmp_path, "pass", steps=5)
    assert victim.read_bytes() == content


def test_load_snapshot_refuses_what_is_not_a_file(tmp_path: Path) -> None:
    from floatguard import SnapshotError, load_snapshot

    fifo = tmp_path / "snapshot-000000001.fgs"
    os.mkfifo(fifo)
    with pytest.raises(SnapshotError, match="is a FIFO, not a regular file"):
        load_snapshot(fifo)
    dev = tmp_path / "snapshot-000000002.fgs"
    os.symlink("/dev/zero", dev)
    with pytest.raises(SnapshotError, match="is a character device"):
        load_snapshot(dev)
    folder = tmp_path / "snapshot-000000003.fgs"
    folder.mkdir()
    with pytest.raises(SnapshotError, match="is a directory"):
        load_snapshot(folder)


EVENT_LOG = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    from floatguard.events import EventLog, read_events
    where = Path(sys.argv[1])
    out = {}
    fifo = where / "fifo.jsonl"
    os.mkfifo(fifo)
    for name, make in (("write", lambda: EventLog(fifo)), ("read", lambda: list(read_events(fifo))),
                       ("dir", lambda: EventLog(where))):
        try:
            make()
            out[name] = "ok"
        except OSError as e:
            out[name] = f"{type(e).__name__}: {e}"
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader that never reads
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log = EventLog(fifo)
        for i in range(5000):  # far past a pipe's buffer
            log.emit("snapshot", i, where="memory", freed=None)
        log.close()
    out["stalled"] = [str(w.message) for w in caught]
    out["kept"] = len(log.events)
    os.close(reader)
    log = EventLog(os.devnull)  # a device the user named: written to
    log.emit("snapshot", 0, where="memory", freed=None)
    log.close()
    out["devnull"] = log.write_error
    print(json.dumps(out))
    """
)


def test_the_event_log_never_waits_on_a_fifo(tmp_path: Path) -> None:
    """A FIFO with no reader at the event log's path: refused at once, naming it, for
    writing and for reading (a plain open waits for the other end forever); a
    directory there is named with the fix; /dev/null, a device the user chose, works."""
    done = subprocess.run(
        [sys.executable, "-c", EVENT_LOG, str(tmp_path)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["write"].startswith("NotRegularFile") and "FIFO with no reader" in out["write"]
    assert out["read"].startswith("NotRegularFile") and "is a FIFO" in out["read"]
    assert out["dir"].startswith("IsADirectoryError") and "events.jsonl" in out["dir"]
    assert out["devnull"] is None
    (stalled,) = out["stalled"]  # the writes stop, training does not
    assert "its reader is not reading" in stalled and out["kept"] == 5000


PADDED = textwrap.dedent(
    """
    import json, os, resource, sys
    from pathlib import Path
    from floatguard.stability._snapshot_file import encode_header
    from floatguard.stability.snapshot import load_snapshot
    from floatguard.repro.bundle import MAGIC, _HEADER, load_bundle
    where = Path(sys.argv[1])
    out = {}
    snap = where / "snapshot-000000099.fgs"
    with open(snap, "wb") as fh:
        fh.write(encode_header(99, None, b"x" * 16) + b"x" * 16)
        fh.truncate(2 << 30)  # sparse: 2 GiB the header does not declare
    bundle = where / "repro.fgr"
    with open(bundle, "wb") as fh:
        fh.write(MAGIC + _HEADER.pack(16, bytes(32)) + b"x" * 16)
        fh.truncate(2 << 30)
    for name, load in (("snapshot", lambda: load_snapshot(snap)),
                       ("bundle", lambda: load_bundle(bundle))):
        try:
            load()
        except ValueError as e:
            out[name] = str(e)
    out["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))
    """
)


def test_a_file_padded_past_its_header_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A snapshot or repro bundle whose size is not what its header declares (a
    sparse 2 GiB file declaring 16 bytes) is refused from its header and size: no
    gigabytes read into memory first."""
    done = subprocess.run(
        [sys.executable, "-c", PADDED, str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "truncated or padded snapshot" in out["snapshot"]
    assert "truncated or padded repro bundle" in out["bundle"]
    assert out["max_rss_mb"] < 1024, out  # (reading it whole: over 2 GiB)


LONG_LINE = textwrap.dedent(
    """
    import json, resource, sys, warnings
    from floatguard.events import EventLog, read_events
    path = sys.argv[1]
    log = EventLog(path)
    for i in range(3):
        log.emit("snapshot", i, where="memory", freed=None)
    log.close()
    with open(path, "ab") as fh:
        fh.truncate(fh.tell() + (400 << 20))  # a zero-filled tail of 400 MiB, no newline
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        events = list(read_events(path))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"events": len(events), "grew_mb": after - before,
                      "warnings": [str(w.message) for w in caught]}))
    """
)


def test_a_line_longer_than_any_event_is_skipped_without_holding_it(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", LONG_LINE, str(tmp_path / "events.jsonl")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["events"] == 3
    (warning,) = out["warnings"]
    assert f"a line of {400 << 20} bytes" in warning and "skipped" in warning
    assert out["grew_mb"] < 200, out  # one bounded buffer, not the 400 MiB line
