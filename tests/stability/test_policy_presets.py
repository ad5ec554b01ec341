"""ResponsePolicy: its per-rank fields declared (not guessed from their names), and the
named presets set what they say (old keywords keep working, and override them)."""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn

from floatguard import ResponsePolicy
from floatguard.guard._setup import configuration


def test_the_per_rank_fields_are_the_folders() -> None:
    assert ResponsePolicy.per_rank_fields() == ("snapshot_dir", "repro_dir")
    model = nn.Linear(2, 2)

    def fingerprint(policy: ResponsePolicy) -> object:
        return configuration("fp32", "full", None, None, policy, model)

    base = ResponsePolicy(snapshot_dir="/a/rank0", repro_dir="/r/rank0")
    same = dataclasses.replace(base, snapshot_dir="/a/rank1", repro_dir="/r/rank1")
    assert fingerprint(base) == fingerprint(same)  # each rank its own folders
    for name, value in (("snapshot_every", 7), ("disk_every", 2), ("repro_keep", 9)):
        assert fingerprint(dataclasses.replace(base, **{name: value})) != fingerprint(base)


def test_durable_writes_every_snapshot_and_raises_on_a_failed_write(tmp_path: object) -> None:
    p = ResponsePolicy.durable(str(tmp_path))
    assert (p.snapshot_dir, p.disk_every, p.snapshot_keep, p.on_snapshot_error) == (
        str(tmp_path), 1, 3, "raise",
    )  # fmt: skip
    assert ResponsePolicy.durable(str(tmp_path), snapshot_keep=5).snapshot_keep == 5
    with pytest.raises(ValueError, match="snapshot_keep"):
        ResponsePolicy.durable(str(tmp_path), snapshot_keep=0)


def test_debugging_writes_whole_step_bundles(tmp_path: object) -> None:
    p = ResponsePolicy.debugging(str(tmp_path))
    assert (p.repro_dir, p.repro_level) == (str(tmp_path), "step")
    assert ResponsePolicy.debugging(str(tmp_path), repro_keep=1).repro_keep == 1


def test_a_policy_composes_from_its_parts_and_reads_them_back() -> None:
    from floatguard import BadDataPolicy, LadderPolicy, ReproPolicy, SnapshotPolicy

    composed = ResponsePolicy(
        ladder=LadderPolicy(rollback_after=2, skip_batches=1),
        snapshots=SnapshotPolicy(every=3, dir="/runs/a", keep=4, on_error="raise"),
        bad_data=BadDataPolicy(stop_after=5),
        repro=ReproPolicy(dir="/runs/r", level="step"),
    )
    flat = ResponsePolicy(
        rollback_after=2, skip_batches=1, snapshot_every=3, snapshot_dir="/runs/a",
        snapshot_keep=4, on_snapshot_error="raise", bad_data_stop_after=5,
        repro_dir="/runs/r", repro_level="step",
    )  # fmt: skip
    assert composed == flat and hash(composed) == hash(flat)
    assert composed.snapshots == SnapshotPolicy(every=3, dir="/runs/a", keep=4, on_error="raise")
    assert composed.ladder.rollback_after == 2 and composed.bad_data.stop_after == 5
    assert composed.repro == ReproPolicy(dir="/runs/r", level="step")
    assert ResponsePolicy().snapshots == SnapshotPolicy()  # the defaults are the same
    # a part and a keyword of it: the keyword may repeat the part, not contradict it
    same = ResponsePolicy(snapshot_every=3, snapshots=SnapshotPolicy(every=3))
    assert same.snapshot_every == 3
    with pytest.raises(ValueError, match=r"snapshot_every=4, snapshots=.*says 3"):
        ResponsePolicy(snapshot_every=4, snapshots=SnapshotPolicy(every=3))
    # replace() keeps working on the flat keywords
    assert dataclasses.replace(composed, snapshot_every=7).snapshots.every == 7


def test_a_part_is_checked_when_built_in_its_own_names() -> None:
    from floatguard import LadderPolicy, SnapshotPolicy

    with pytest.raises(ValueError, match=r"^SnapshotPolicy\.keep=0 must be an int >= 1"):
        SnapshotPolicy(keep=0)
    with pytest.raises(ValueError, match=r"^LadderPolicy\.lr_backoff_factor=1\.5 must be in"):
        LadderPolicy(lr_backoff_factor=1.5)
    with pytest.raises(ValueError, match=r"^ResponsePolicy\.snapshot_on='gpu'; use 'auto'"):
        ResponsePolicy(snapshot_on="gpu")
    with pytest.raises(TypeError, match=r"give a SnapshotPolicy"):
        ResponsePolicy(snapshots=LadderPolicy())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"did you mean 'snapshot_every'"):
        ResponsePolicy(snapshot_evry=3)


def test_replace_and_presets_take_parts() -> None:
    from pathlib import Path

    from floatguard import ReproPolicy, SnapshotPolicy

    p = ResponsePolicy(snapshot_every=3, snapshot_dir="/a")
    q = dataclasses.replace(p, snapshots=SnapshotPolicy(every=7))  # the part replaces its fields
    assert (q.snapshot_every, q.snapshot_dir) == (7, None)
    d = ResponsePolicy.durable("/runs/a", snapshots=SnapshotPolicy(every=2))
    assert (d.snapshot_every, d.snapshot_dir, d.on_snapshot_error) == (2, "/runs/a", "raise")
    r = ResponsePolicy.debugging("/runs/r", repro=ReproPolicy(keep=2))
    assert (r.repro_dir, r.repro_level, r.repro_keep) == ("/runs/r", "step", 2)
    same = ResponsePolicy(snapshot_dir=Path("/x"), snapshots=SnapshotPolicy(dir="/x"))
    assert same.snapshot_dir == "/x"  # a path and its string agree
    with pytest.raises(ValueError, match=r"^SnapshotPolicy\.dir=5 must be a folder path"):
        SnapshotPolicy(dir=5)  # type: ignore[arg-type]
