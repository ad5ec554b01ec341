"""Sentinel mode adds no host-device sync to forward or backward (counted, not timed)."""

from __future__ import annotations

import torch
from torch import nn

from floatguard import Monitor, tensor_stats

SYNC_NAMES = {"item", "__bool__", "tolist", "cpu", "numpy"}


class CountSyncs:
    """Count calls of the syncing Tensor methods, on every thread (backward included).

    A TorchFunctionMode would be thread-local and miss hooks that the autograd
    engine runs; patching the methods themselves sees them all.
    """

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._saved: dict[str, object] = {}

    def __enter__(self) -> CountSyncs:
        for name in SYNC_NAMES:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def counted(*args, __name=name, __orig=original, **kwargs):  # type: ignore[no-untyped-def]
                self.calls.append(__name)
                return __orig(*args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), Block(32), Block(32), nn.Linear(32, 4))


def step(m: nn.Module) -> None:
    x = torch.randn(8, 16)
    out = m(x)
    loss = out.pow(2).mean()
    loss.backward()


def test_sentinel_mode_makes_no_sync_in_forward_and_backward() -> None:
    m = model()
    with Monitor(m) as mon, CountSyncs() as counter:
        step(m)
        mon.check_loss(torch.ones(()))
        flag = mon.found_nonfinite  # reading the device flag does not sync either
    assert counter.calls == []
    assert flag.dtype == torch.bool
    assert mon.first_nonfinite is None  # reading the result is the one sync, on request


def test_the_counter_sees_syncs_in_forward_and_backward_hooks() -> None:
    """Control: a naive health check (the lessons' .item() per output) is counted."""
    m = model()

    def naive(module, args, out):  # type: ignore[no-untyped-def]
        if out.isnan().any().item():
            raise RuntimeError

    handles = [mod.register_forward_hook(naive) for mod in m.modules()]
    for p in m.parameters():
        handles.append(p.register_hook(lambda g: g if bool(g.isfinite().all()) else g * 0))
    with CountSyncs() as counter:
        step(m)
    for h in handles:
        h.remove()
    assert counter.calls.count("item") == len(list(m.modules()))
    assert counter.calls.count("__bool__") == len(list(m.parameters()))


def test_tensor_stats_makes_no_sync() -> None:
    x = torch.randn(1000)
    with CountSyncs() as counter:
        st = tensor_stats(x)
        st.merge(st).overflow_count("fp16")
    assert counter.calls == []
