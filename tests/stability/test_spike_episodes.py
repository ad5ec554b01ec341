"""classify_spikes: an isolated spike that did not recur, a burst, or a sustained change
(issue 36, item 5), on planted loss sequences."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from floatguard.stability import episodes as _episodes
from floatguard.stability.episodes import SpikeEpisode, classify_spikes

Losses = list[tuple[int, float]]


def _losses(n: int, level: float = 1.0, *, skipped: tuple[int, ...] = (), seed: int = 0,
            shift: tuple[int, float] | None = None) -> Losses:  # fmt: skip
    """Applied (step, loss): ``level`` with 3% noise, the ``skipped`` steps left out;
    ``shift``: from that step on the level is multiplied by that factor."""
    noise = np.exp(0.03 * np.random.default_rng(seed).normal(size=n))
    out = []
    for s in range(n):
        if s in skipped:
            continue
        f = shift[1] if shift is not None and s >= shift[0] else 1.0
        out.append((s, float(level * f * noise[s])))
    return out


def _kinds(eps: list[SpikeEpisode]) -> list[tuple[str, tuple[int, ...]]]:
    return [(e.kind, e.steps) for e in eps]


def test_one_bad_batch_is_isolated() -> None:
    (ep,) = classify_spikes([80], _losses(200, skipped=(80,)), [])
    assert (ep.kind, ep.steps, ep.n_after, ep.back) == ("isolated", (80,), 10, True)
    assert ep.level_before == pytest.approx(1.0, rel=0.05)
    assert ep.reason == "one spike; the loss was back within 10 steps"
    assert json.loads(json.dumps(ep.to_dict()))["steps"] == [80]


def test_two_bad_batches_far_apart_are_two_isolated_episodes() -> None:
    eps = classify_spikes([40, 150], _losses(300, skipped=(40, 150)), [])
    assert _kinds(eps) == [("isolated", (40,)), ("isolated", (150,))]


def test_an_applied_bad_batch_that_takes_a_while_to_recover_is_a_burst() -> None:
    """The loss 3x for 12 steps after the spike, then back: not isolated (not back
    within the first 10 steps), nothing lasted: a burst."""
    pts = [(s, 3.0 if 80 < s <= 92 else v) for s, v in _losses(300)]
    (ep,) = classify_spikes([80], pts, [])
    assert ep.kind == "burst" and ep.back is False


def test_repeated_spikes_with_the_loss_back_and_no_cause_are_a_burst() -> None:
    eps = classify_spikes([100, 105, 112], _losses(300, skipped=(100, 105, 112)), [])
    assert _kinds(eps) == [("burst", (100, 105, 112))]
    assert eps[0].reason == "3 spikes, then the loss came back"


def test_lr_x40_from_step_60_is_sustained() -> None:
    """Spikes from step 61 on, the loss settling 2.5x higher: sustained from the first
    episode on (the loss stayed up); with the LR given and the loss back, the lasting
    LR rise with repeated spikes makes it sustained too."""
    spikes = [61, 62, 64, 70, 95, 130, 131]
    pts = _losses(300, skipped=tuple(spikes), shift=(60, 2.5))
    eps = classify_spikes(spikes, pts, [])
    assert _kinds(eps) == [
        ("sustained", (61, 62, 64, 70)),
        ("sustained", (95,)),
        ("sustained", (130, 131)),
    ]
    assert eps[0].reason.startswith("the loss stayed up: 2.4")
    assert eps[1].reason == "after the sustained change from step 61"
    lrs = [(s, 1e-3 * (40 if s >= 60 else 1)) for s in range(300)]
    back = _losses(300, skipped=tuple(spikes))
    assert [e.kind for e in classify_spikes(spikes, back, [])] == ["burst", "isolated", "burst"]
    eps = classify_spikes(spikes, back, [], lrs=lrs)
    assert [e.kind for e in eps] == ["sustained"] * 3
    assert eps[0].reason == "7 spikes after the LR rose x40 at step 60 and stayed up"
    # An LR raised for a few steps and then restored is not a lasting change.
    brief = [(s, 1e-3 * (40 if 60 <= s < 65 else 1)) for s in range(300)]
    assert classify_spikes(spikes, back, [], lrs=brief)[0].kind == "burst"


def test_a_level_shift_after_one_spike_is_sustained() -> None:
    (ep,) = classify_spikes([120], _losses(300, skipped=(120,), shift=(121, 2.0)), [])
    assert ep.kind == "sustained" and ep.back is False


def test_a_trend_warning_after_it_makes_it_sustained() -> None:
    pts = [(s, 3.0 if 80 < s <= 92 else v) for s, v in _losses(300)]
    (ep,) = classify_spikes([80], pts, [200])
    assert ep.kind == "sustained" and ep.reason == "a trend warning at step 200 followed"
    # One long before the spike says nothing about it.
    (ep,) = classify_spikes([80], pts, [30])
    assert ep.kind == "burst"


def test_isolated_first_then_sustained() -> None:
    spikes = [50, 200, 203, 210]
    pts = _losses(400, skipped=tuple(spikes), shift=(200, 3.0))
    assert _kinds(classify_spikes(spikes, pts, [])) == [
        ("isolated", (50,)),
        ("sustained", (200, 203, 210)),
    ]


def test_a_spike_at_the_end_is_unresolved() -> None:
    (ep,) = classify_spikes([298], _losses(300, skipped=(298,)), [])
    assert (ep.kind, ep.n_after) == ("unresolved", 1)


def test_no_spikes_no_episodes() -> None:
    assert classify_spikes([], _losses(100), [300]) == []


def test_the_module_imports_no_torch() -> None:
    """The diagnosis reads logs without torch: the module imports the standard library
    and nothing else."""
    tree = ast.parse(Path(_episodes.__file__).read_text())
    names = {
        a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    } | {
        n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
    }
    assert names <= set(sys.stdlib_module_names) | {"__future__"}, names
