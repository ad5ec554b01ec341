"""The resume agreement's decision, as a table: every rank's good snapshot steps (as the
all-gather delivers them) -> the step agreed, this rank's newest, the ranks behind; or
the SnapshotError every rank raises. The processes around it:
tests/test_guard_resume_ranks.py."""

from __future__ import annotations

from typing import Any

import pytest

from floatguard import SnapshotError
from floatguard.guard.resume_agree import Agreement, agree, loaded


def _steps(*lists: list[int]) -> list[dict[str, Any]]:
    return [{"steps": s, "error": None} for s in lists]


AGREED: list[tuple[str, list[dict[str, Any]], int, Agreement]] = [
    ("all the same", _steps([12, 6], [12, 6]), 0, Agreement(12, 12, ())),
    ("one rank's newest lost", _steps([12, 6], [6, 0]), 0, Agreement(6, 12, (1,))),
    ("seen from the rank behind", _steps([12, 6], [6, 0]), 1, Agreement(6, 6, (1,))),
    ("newest apart, an older one shared", _steps([12, 6], [9, 6]), 1, Agreement(6, 9, (1,))),
    ("four ranks, one behind", _steps([8, 4], [8, 4], [4, 0], [8, 4]), 3, Agreement(4, 8, (2,))),
    ("one rank", _steps([5, 0]), 0, Agreement(5, 5, ())),
]  # fmt: skip


@pytest.mark.parametrize(("records", "rank", "want"), [c[1:] for c in AGREED],
                         ids=[c[0] for c in AGREED])  # fmt: skip
def test_the_step_agreed(records: list[dict[str, Any]], rank: int, want: Agreement) -> None:
    assert agree(records, rank) == want


REFUSED: list[tuple[str, list[dict[str, Any]], str]] = [
    ("nothing in common", _steps([12, 10], [6, 4]),
     "guard.resume() on rank 0: no step has a good snapshot on every rank (the good "
     "snapshots' steps, newest first: rank 0: 12, 10; rank 1: 6, 4); nothing was loaded "
     "on any rank. A rank keeps its last ResponsePolicy.snapshot_keep snapshots"),
    ("a rank without snapshots", _steps([3, 0], [3, 0], []),
     "(the good snapshots' steps, newest first: ranks 0, 1: 3, 0; rank 2: none)"),
    ("a rank that could not list its snapshots",
     [{"steps": [4], "error": None}, {"steps": [], "error": "SnapshotFolderBusy: held"}],
     "guard.resume() on rank 0: rank 1 cannot resume (SnapshotFolderBusy: held); nothing "
     "was loaded on any rank"),
    ("two ranks that could not",
     [{"steps": [], "error": "E1"}, {"steps": [4], "error": None}, {"error": "E2"}],
     "guard.resume() on rank 0: ranks 0, 2 cannot resume (rank 0: E1; rank 2: E2)"),
    ("a record cut short", [{"steps": [4], "error": None}, {"error": "record truncated"}],
     "rank 1 cannot resume (record truncated)"),
]  # fmt: skip


@pytest.mark.parametrize(("records", "words"), [c[1:] for c in REFUSED],
                         ids=[c[0] for c in REFUSED])  # fmt: skip
def test_no_agreement_is_one_error_naming_the_ranks(
    records: list[dict[str, Any]], words: str
) -> None:
    with pytest.raises(SnapshotError) as e:
        agree(records, 0)
    assert words in str(e.value)


def test_a_rank_that_cannot_load_the_step_agreed() -> None:
    loaded([{"error": None}, {"error": None}], 0, 6)  # every rank loaded it: no error
    with pytest.raises(SnapshotError) as e:
        loaded([{"error": None}, {"error": "SnapshotError: x does not fit: ..."}], 0, 6)
    assert str(e.value) == (
        "guard.resume() on rank 0: rank 1 cannot load its snapshot of the step agreed, 6 "
        "(SnapshotError: x does not fit: ...); nothing was loaded on any rank"
    )
