"""Another run's snapshots in a folder that lost its identity file (issue 39, item 4):
without ``floatguard-run.json`` the run id in each snapshot's signed header still
tells runs apart. A resume continues the run most of the folder's snapshots belong
to, passes over the others' with an event each and a warning naming every run, and
refuses (nothing loaded) when no run has the majority. The ``resume`` event names
the run it resumed."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import floatguard
from floatguard.stability.snapshot_folder import SnapshotFolderBusy, read_run_id


def _run(folder: Path, steps: int, seed: int, log: Path) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    policy = floatguard.ResponsePolicy(snapshot_dir=folder, snapshot_every=5, snapshot_keep=2)
    g = floatguard.Guard(model, opt, log=log, response=policy)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for _ in range(steps):
        g.step(lambda: nn.functional.mse_loss(model(x), y))
    g.close()
    return model


def _resume(folder: Path, log: Path) -> tuple[nn.Module, int]:
    torch.manual_seed(123)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    policy = floatguard.ResponsePolicy(snapshot_dir=folder, snapshot_every=5, snapshot_keep=2)
    g = floatguard.Guard(model, opt, log=log, response=policy)
    try:
        return model, g.resume()
    finally:
        g.close()


def _events(log: Path, kind: str) -> list[dict[str, object]]:
    return [e for line in log.read_text().splitlines() if (e := json.loads(line))["kind"] == kind]


def test_a_foreign_newer_snapshot_is_passed_over_without_the_identity_file(
    tmp_path: Path,
) -> None:
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    _run(mine, 16, 0, tmp_path / "mine.jsonl")  # snapshots of steps 10 and 15 kept
    _run(theirs, 21, 1, tmp_path / "theirs.jsonl")  # a newer one: step 20
    my_run, their_run = read_run_id(mine), read_run_id(theirs)
    assert my_run and their_run and my_run != their_run
    shutil.copy(theirs / "snapshot-000000020.fgs", mine / "snapshot-000000020.fgs")
    (mine / "floatguard-run.json").unlink()
    log = tmp_path / "resume.jsonl"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, step = _resume(mine, log)
    assert step == 15
    (resume,) = _events(log, "resume")
    assert resume["run_id"] == my_run and resume["from_step"] == 15
    (fallback,) = _events(log, "snapshot_fallback")
    assert str(fallback["bad"]).endswith("snapshot-000000020.fgs")
    (warning,) = [w for w in _events(log, "warning") if w["code"] == "foreign_snapshots"]
    assert my_run in str(warning["message"]) and their_run in str(warning["message"])
    assert any(their_run in str(w.message) for w in caught)
    # the foreign file is left as it was, and the folder is this run's again
    assert (mine / "snapshot-000000020.fgs").read_bytes() == (
        theirs / "snapshot-000000020.fgs"
    ).read_bytes()


def test_no_majority_is_refused_naming_both_runs(tmp_path: Path) -> None:
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    _run(mine, 16, 0, tmp_path / "mine.jsonl")
    _run(theirs, 26, 1, tmp_path / "theirs.jsonl")  # steps 20 and 25
    my_run, their_run = read_run_id(mine), read_run_id(theirs)
    for name in ("snapshot-000000020.fgs", "snapshot-000000025.fgs"):
        shutil.copy(theirs / name, mine / name)
    (mine / "floatguard-run.json").unlink()
    before = {p.name: p.read_bytes() for p in mine.iterdir()}
    with pytest.raises(floatguard.SnapshotError) as e:
        _resume(mine, tmp_path / "resume.jsonl")
    assert str(my_run) in str(e.value) and str(their_run) in str(e.value)
    assert "resume(path=" in str(e.value)
    assert {p.name: p.read_bytes() for p in mine.iterdir()} == before


def test_one_run_without_its_identity_file_resumes_as_before(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    _run(mine, 16, 0, tmp_path / "mine.jsonl")
    my_run = read_run_id(mine)
    (mine / "floatguard-run.json").unlink()
    log = tmp_path / "resume.jsonl"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        _, step = _resume(mine, log)
    assert step == 15
    (resume,) = _events(log, "resume")
    assert resume["run_id"] == my_run
    assert not _events(log, "snapshot_fallback")


def test_a_full_disk_makes_room_by_pruning_the_oldest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 5: a disk with room for two snapshots and a bit (a fault-injected writer:
    ENOSPC when two snapshot files are already there). With snapshot_keep=2 every save
    from the third on needs the oldest file gone first: it is removed (never the
    newest verified one), the save retried, and the snapshot event names what was
    freed. Without it the resume point would stay at the second snapshot."""
    from floatguard.stability import snapshot as snapshot_module

    save = snapshot_module.Snapshot.save

    def small_disk(self: snapshot_module.Snapshot, path: str | Path) -> Path:
        folder = Path(path).parent
        if len(list(folder.glob("snapshot-*.fgs"))) >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(self, path)

    monkeypatch.setattr(snapshot_module.Snapshot, "save", small_disk)
    folder, log = tmp_path / "snaps", tmp_path / "run.jsonl"
    _run(folder, 21, 0, log)
    assert sorted(p.name for p in folder.glob("snapshot-*.fgs")) == [
        "snapshot-000000015.fgs", "snapshot-000000020.fgs",
    ]  # fmt: skip
    assert not _events(log, "snapshot_error")
    written = [(e["step"], Path(str(e["freed"])).name if e["freed"] else None)
               for e in _events(log, "snapshot")]  # fmt: skip
    assert written == [
        (0, None), (5, None), (10, "snapshot-000000000.fgs"),
        (15, "snapshot-000000005.fgs"), (20, "snapshot-000000010.fgs"),
    ]  # fmt: skip
    assert _resume(folder, tmp_path / "resume.jsonl")[1] == 20


def test_a_disk_too_small_for_one_more_keeps_the_newest_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Room for one snapshot only: the retry fails too, the newest verified file is
    never the one removed, and the failure says what was tried."""
    from floatguard.stability import snapshot as snapshot_module

    save = snapshot_module.Snapshot.save

    def tiny_disk(self: snapshot_module.Snapshot, path: str | Path) -> Path:
        if list(Path(path).parent.glob("snapshot-*.fgs")):
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(self, path)

    monkeypatch.setattr(snapshot_module.Snapshot, "save", tiny_disk)
    folder, log = tmp_path / "snaps", tmp_path / "run.jsonl"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _run(folder, 11, 0, log)
    assert [p.name for p in folder.glob("snapshot-*.fgs")] == ["snapshot-000000000.fgs"]
    errors = _events(log, "snapshot_error")
    assert [e["step"] for e in errors] == [5, 10]
    assert all("No space left" in str(e["error"]) for e in errors)


def _read_only_resume(folder: Path, tmp_path: Path) -> None:
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    log = tmp_path / "resume.jsonl"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, step = _resume(folder, log)
    assert step == 15
    (warning,) = [w for w in _events(log, "warning") if w["code"] == "read_only_folder"]
    assert "resume(path=" in str(warning["message"])
    assert any("read-only" in str(w.message) for w in caught)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_a_read_only_folder_resumes_without_its_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 6, with the file system's answer injected (EROFS from the lock): the run
    resumes, reading only, and says in one line how to go on writing."""
    from floatguard.stability.snapshot_folder import FolderLock

    folder = tmp_path / "snaps"
    _run(folder, 16, 0, tmp_path / "run.jsonl")

    def read_only(cls: type[FolderLock], where: str | Path) -> FolderLock:
        raise OSError(errno.EROFS, "Read-only file system", str(Path(where) / "floatguard.lock"))

    monkeypatch.setattr(FolderLock, "acquire", classmethod(read_only))
    _read_only_resume(folder, tmp_path)


@pytest.mark.subprocess
def test_a_read_only_bind_mount_resumes(tmp_path: Path) -> None:
    """Item 6 on a real read-only mount (root only: a read-only bind of the folder)."""
    folder, mount = tmp_path / "snaps", tmp_path / "archive"
    _run(folder, 16, 0, tmp_path / "run.jsonl")
    mount.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "--bind", "-o", "ro", str(folder), str(mount)], capture_output=True
        ).returncode
    ):
        pytest.skip("needs root and mount(8) for a read-only bind")
    try:
        _read_only_resume(mount, tmp_path)
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_lock_removed_while_held_is_taken_again_and_a_second_guard_found(
    tmp_path: Path,
) -> None:
    """The lock file of a running guard deleted by hand: a second guard can lock the
    folder anew, but the first finds its lock gone at its next snapshot write and
    meets the second there (SnapshotFolderBusy), instead of both writing."""
    folder = tmp_path / "snaps"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    policy = floatguard.ResponsePolicy(snapshot_dir=folder, snapshot_every=2)
    first = floatguard.Guard(model, opt, log=tmp_path / "a.jsonl", response=policy)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for _ in range(3):
        first.step(lambda: nn.functional.mse_loss(model(x), y))
    (folder / "floatguard.lock").unlink()  # a cleaner of "stale" files
    other = floatguard.Guard(model, opt, log=tmp_path / "b.jsonl", response=policy)
    other.resume()  # takes a new lock: the first guard is not told yet
    with (
        pytest.raises(SnapshotFolderBusy),
        pytest.warns(RuntimeWarning, match="removed or replaced while this guard held it"),
    ):
        for _ in range(3):
            first.step(lambda: nn.functional.mse_loss(model(x), y))
    other.close()
    first.close()
    (warning,) = [w for w in _events(tmp_path / "a.jsonl", "warning") if w["code"] == "lock_lost"]
    assert "snapshot_dir" in str(warning["message"])


def test_a_lock_removed_while_held_alone_is_taken_again(tmp_path: Path) -> None:
    folder = tmp_path / "snaps"
    log = tmp_path / "a.jsonl"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    policy = floatguard.ResponsePolicy(snapshot_dir=folder, snapshot_every=2)
    g = floatguard.Guard(model, opt, log=log, response=policy)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    g.step(lambda: nn.functional.mse_loss(model(x), y))
    (folder / "floatguard.lock").unlink()
    with pytest.warns(RuntimeWarning, match="taken again"):
        for _ in range(4):
            g.step(lambda: nn.functional.mse_loss(model(x), y))
    assert (folder / "floatguard.lock").exists()  # held again
    g.close()
    assert not _events(log, "snapshot_error")
    assert [e["step"] for e in _events(log, "snapshot") if e["where"] != "memory"] == [0, 2, 4]


def test_a_directory_named_like_the_identity_file_does_not_stop_snapshots(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "snaps"
    (folder / "floatguard-run.json").mkdir(parents=True)
    log = tmp_path / "run.jsonl"
    with pytest.warns(RuntimeWarning, match="cannot write"):
        _run(folder, 11, 0, log)
    assert not _events(log, "snapshot_error")
    (warning,) = [w for w in _events(log, "warning") if w["code"] == "identity_unwritable"]
    assert "floatguard-run.json" in str(warning["message"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, step = _resume(folder, tmp_path / "resume.jsonl")
    assert step == 10


def test_a_full_disk_frees_room_when_the_step_resumed_from_is_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a resume the first snapshot rewrites the step resumed from: with room for
    two files, the older one goes (never the one being replaced, the resume point)."""
    from floatguard.stability import snapshot as snapshot_module

    folder = tmp_path / "snaps"

    def guard(log: Path) -> tuple[floatguard.Guard, nn.Module]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        policy = floatguard.ResponsePolicy(snapshot_dir=folder, snapshot_every=2)
        return floatguard.Guard(model, opt, log=log, response=policy), model

    g, model = guard(tmp_path / "run.jsonl")
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for _ in range(9):
        g.step(lambda: nn.functional.mse_loss(model(x), y))
    g.close()
    assert sorted(p.name for p in folder.glob("snapshot-*.fgs")) == [
        "snapshot-000000006.fgs", "snapshot-000000008.fgs",
    ]  # fmt: skip
    save = snapshot_module.Snapshot.save

    def small_disk(self: snapshot_module.Snapshot, path: str | Path) -> Path:
        if len(list(Path(path).parent.glob("snapshot-*.fgs"))) >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(self, path)

    monkeypatch.setattr(snapshot_module.Snapshot, "save", small_disk)
    log = tmp_path / "resume.jsonl"
    g, model = guard(log)
    assert g.resume() == 8
    for _ in range(2):
        g.step(lambda: nn.functional.mse_loss(model(x), y))
    g.close()
    assert not _events(log, "snapshot_error")
    written = [(e["step"], Path(str(e["freed"])).name if e["freed"] else None)
               for e in _events(log, "snapshot") if e["where"] != "memory"]  # fmt: skip
    assert written[0] == (8, "snapshot-000000006.fgs"), written


@pytest.mark.parametrize(
    "name", ["", "floatguard.lock", "floatguard-run.json", "snapshot-000000004.fgs"]
)
def test_an_event_log_among_the_guards_own_files_is_refused(tmp_path: Path, name: str) -> None:
    """The log inside snapshot_dir under a name the store owns (or the folder itself)
    would be replaced or removed, events and all: refused at construction."""
    folder = tmp_path / "snaps"
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = floatguard.ResponsePolicy(snapshot_dir=folder)
    log = folder / name if name else folder
    with pytest.raises(ValueError, match="the guard writes and removes its own files there"):
        floatguard.Guard(model, opt, log=log, response=policy)
    assert not folder.exists()  # refused before anything was made
    floatguard.Guard(model, opt, log=folder / "events.jsonl", response=policy).close()
    repro = floatguard.ResponsePolicy(repro_dir=tmp_path / "bundles")
    with pytest.raises(ValueError, match="repro_dir"):
        floatguard.Guard(model, opt, log=tmp_path / "bundles" / "x.fgr", response=repro)


@pytest.mark.parametrize(
    "owner",
    ['{"pid": 7, "host": "h", "since": "yesterday"}', '{"since": null}', '{"since": [1]}',
     '{"since": 1e300}', "[" * 4000, '{"pid": "' + "x" * 3000 + '"}'],
)  # fmt: skip
def test_a_planted_lock_file_of_any_content_is_taken_over(tmp_path: Path, owner: str) -> None:
    folder = tmp_path / "snaps"
    folder.mkdir()
    (folder / "floatguard.lock").write_text(owner)
    log = tmp_path / "run.jsonl"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(folder, 6, 0, log)
    if owner.startswith("{"):  # what it says of its holder is shown, whatever it holds
        assert any("took over the lock" in str(w.message) for w in caught)
    assert not _events(log, "snapshot_error")
    assert sorted(p.name for p in folder.glob("snapshot-*.fgs")) == [
        "snapshot-000000000.fgs", "snapshot-000000005.fgs",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "run_id", ["AB" * 16, "_" + "a" * 31, " " + "a" * 31, "+" + "a" * 31, "[" * 5000]
)
def test_an_identity_file_with_a_malformed_run_id_is_unreadable_not_fatal(
    tmp_path: Path, run_id: str
) -> None:
    folder = tmp_path / "snaps"
    _run(folder, 16, 0, tmp_path / "run.jsonl")
    mine = read_run_id(folder)
    bad = run_id if run_id.startswith("[") else json.dumps({"run_id": run_id})
    (folder / "floatguard-run.json").write_text(bad)
    with pytest.warns(RuntimeWarning, match="is unreadable"):
        _, step = _resume(folder, tmp_path / "resume.jsonl")
    assert step == 15  # the run told from the snapshots' headers
    (resume,) = _events(tmp_path / "resume.jsonl", "resume")
    assert resume["run_id"] == mine


def test_only_a_saves_own_temp_files_are_cleaned_up(tmp_path: Path) -> None:
    """A user's `.snapshot-...` file or folder in the snapshot folder is not a leftover."""
    folder = tmp_path / "snaps"
    (folder / ".snapshot-cache").mkdir(parents=True)
    (folder / ".snapshot-notes.txt").write_text("mine")
    leftover = folder / ".snapshot-000000003.fgs.abc123.tmp"  # an interrupted save's
    leftover.write_bytes(b"half")
    log = tmp_path / "run.jsonl"
    _run(folder, 11, 0, log)
    assert not _events(log, "snapshot_error")
    assert (folder / ".snapshot-cache").is_dir()
    assert (folder / ".snapshot-notes.txt").read_text() == "mine"
    assert not leftover.exists()


def test_a_link_loop_is_a_snapshot_error(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    model = nn.Linear(2, 1)
    g = floatguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(floatguard.SnapshotError, match="link loop"):
        g.resume(tmp_path / "a")
    g.close()
