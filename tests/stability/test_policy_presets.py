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
