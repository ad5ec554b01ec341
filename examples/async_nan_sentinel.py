"""Lesson question 3, measured: checking every layer for NaN with a host read each, against
the guard's one read per step (and a replay only when a step goes bad), and its
deferred mode's none on a healthy step.

A per-layer ``out.isnan().any().item()`` makes the host wait for the device once per
layer: on a GPU each read drains the queue of launched kernels, so the device idles
while the host decides. The guard packs its flags (overflow, gradient norm, loss)
into one small tensor and reads it once per step; only a bad step pays more, to be
replayed and localized. Host reads are counted by wrapping the Tensor methods that
read the device (item, tolist, __bool__, cpu, numpy), as the tests do.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from floatguard import Guard

READS = ("item", "tolist", "__bool__", "cpu", "numpy")


@contextmanager
def count_reads() -> Iterator[list[str]]:
    calls: list[str] = []
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name: str, orig: Callable[..., object]) -> Callable[..., object]:
        def wrapped(*args: object, **kwargs: object) -> object:
            calls.append(name)
            return orig(*args, **kwargs)

        return wrapped

    for name, orig in saved.items():
        setattr(torch.Tensor, name, counting(name, orig))
    try:
        yield calls
    finally:
        for name, orig in saved.items():
            setattr(torch.Tensor, name, orig)


def make_model(layers: int = 12, width: int = 256) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(width, 1))


def per_layer_checks(model: nn.Module) -> list[object]:
    """The lesson's naive sentinel: a forward hook per module, one host read each."""

    def hook(module: nn.Module, args: object, out: torch.Tensor) -> None:
        if out.isnan().any().item():  # the host waits for the device here
            raise FloatingPointError(f"NaN after {module.__class__.__name__}")

    return [m.register_forward_hook(hook) for m in model.modules() if m is not model]


def main() -> None:
    x, y = torch.randn(64, 256), torch.randn(64, 1)
    steps = 20

    naive = make_model()
    opt = torch.optim.SGD(naive.parameters(), lr=1e-3)
    handles = per_layer_checks(naive)
    with count_reads() as reads:
        start = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            ((naive(x) - y) ** 2).mean().backward()
            opt.step()
        naive_time = time.perf_counter() - start
    naive_reads = len(reads) / steps
    for h in handles:
        h.remove()

    model = make_model()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    with count_reads() as reads:
        start = time.perf_counter()
        for _ in range(steps):
            guard.step(lambda: ((model(x) - y) ** 2).mean())
        guard_time = time.perf_counter() - start
    guard_reads = len(reads) / steps

    # The deferred mode: the verdict on the device, the host learns it a step later; a
    # healthy step reads nothing (the snapshot steps, every 5 good steps by default,
    # read once: their state is vetted in the read).
    lazy = make_model()
    deferred = Guard(lazy, torch.optim.SGD(lazy.parameters(), lr=1e-3), sync="deferred")
    deferred.step(lambda: ((lazy(x) - y) ** 2).mean())  # (the first step runs exactly)
    per_step = []
    for _ in range(steps):
        deferred.settle()  # (the host's settling of the step before: outside the count)
        with count_reads() as reads:
            deferred.step(lambda: ((lazy(x) - y) ** 2).mean())
        per_step.append(len(reads))
    deferred.close()
    healthy = sorted(per_step)[len(per_step) // 2]

    # A bad step: the guard pays more only now, to find where the NaN was born.
    with torch.no_grad():
        model[6].weight[0, 0] = math.nan
    with count_reads() as reads:
        result = guard.step(lambda: ((model(x) - y) ** 2).mean())
    print(f"layers checked per step by the per-layer sentinel: {len(handles)}")
    print(f"host reads per step, per-layer isnan().any().item(): {naive_reads:g}")
    print(f"host reads per step, guard: {guard_reads:g}")
    print(f"host reads per healthy step, guard sync='deferred': {healthy}")
    print(f"steps with a read, guard sync='deferred': {sum(n > 0 for n in per_step)} of {steps}")
    print(f"time per step, per-layer checks (ms): {naive_time / steps * 1e3:.2f}")
    print(f"time per step, guard (ms): {guard_time / steps * 1e3:.2f}")
    print(f"time ratio per-layer / guard: {naive_time / guard_time:.2f}")
    print(f"bad step: {result.action}, {result.reason}, {result.fault}")
    print(f"host reads on the bad step, guard: {len(reads)}")
    print(
        "(on a CPU a read is cheap; on a GPU each per-layer read stalls the device, which "
        "is where the single read per step pays)"
    )


if __name__ == "__main__":
    main()
