"""The callbacks' common part: wrapping a framework's step methods and putting them back."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from floatguard.integrations._common import GuardedLoop


def test_wrap_and_unwrap_restore_exactly_what_was_there() -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)  # patches opt.step on the instance
    own_step = vars(opt)["step"]
    calls: list[str] = []

    def gate(original: Any, *a: Any, **k: Any) -> Any:
        calls.append("gate")
        return original(*a, **k)

    loop = GuardedLoop()
    loop.wrap(opt, "step", gate)
    loop.wrap(sched, "step", gate)
    assert "step" in vars(sched)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    sched.step()
    assert calls == ["gate", "gate"]
    loop.unwrap()
    assert vars(opt)["step"] is own_step  # the scheduler's instance wrapper, as it was
    assert "step" not in vars(sched)  # the class's method shows through again
    opt.step()
    assert calls == ["gate", "gate"]


def test_a_wrapped_scheduler_still_saves_a_picklable_state_of_its_own() -> None:
    import io
    import pickle

    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    before = sched.state_dict()
    loop = GuardedLoop()
    loop.wrap(sched, "step", lambda original, *a, **k: original(*a, **k))
    state = sched.state_dict()  # what a Trainer / Lightning checkpoint saves
    assert set(state) == set(before)  # the wrapper is not part of the scheduler's state
    torch.save(state, io.BytesIO())
    pickle.dumps(state)
    opt.step()
    sched.step()
    restored = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    restored.load_state_dict(sched.state_dict())
    assert restored.last_epoch == 1 and "step" not in vars(restored)
    loop.unwrap()
    assert "state_dict" not in vars(sched) and "step" not in vars(sched)
