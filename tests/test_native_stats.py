"""The one-pass C kernel gives exactly what the torch path gives, on every kind of value."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import fields

import pytest
import torch

from floatguard import _native, stats
from floatguard.stats import TensorStats, stats_and_aminmax, tensor_stats

pytestmark = pytest.mark.skipif(_native.library() is None, reason="no C compiler here")


def _reference(x: torch.Tensor) -> TensorStats:
    xf = x.detach().reshape(-1).float()
    return stats._stats_f32(xf, torch.full((), xf.numel(), dtype=torch.int64))


def _same(a: TensorStats, b: TensorStats) -> None:
    for f in fields(TensorStats):
        va, vb = getattr(a, f.name), getattr(b, f.name)
        assert va.dtype == vb.dtype and torch.equal(va, vb), (f.name, va, vb)


def _bits(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)


def _cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(300_000, generator=g) * torch.exp2(
        torch.randint(-170, 130, (300_000,), generator=g).float()
    )
    spread[::997] = float("nan")
    spread[1::991] = float("inf")
    spread[2::983] = -float("inf")
    spread[3::101] = 0.0
    spread[4::103] = -0.0
    special = torch.tensor(
        [0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, 1.17549435e-38, 3.4028235e38, -3.4028235e38]
    )
    return [
        _bits(1_000_000, 1).view(torch.float32),  # every bit pattern class, NaN payloads
        spread,
        special,
        torch.full((70_000,), float("nan")),
        torch.full((5,), float("inf")),
        torch.full((3,), -float("inf")),
        torch.zeros(66_000),
        -torch.zeros(9),
        torch.tensor([1e-40]),
        torch.tensor([-2.5]),
        *(torch.randn(n, generator=g) for n in (1, 3, 2047, 2048, 2049, 65535, 65536, 65537)),
        torch.randn(64, 96, generator=g).t(),  # not contiguous
    ]


@pytest.mark.parametrize("i", range(len(_cases())))
def test_native_equals_torch_for_float32(i: int) -> None:
    x = _cases()[i]
    _same(tensor_stats(x), _reference(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_equals_torch_for_half_types(dtype: torch.dtype) -> None:
    for x in _cases()[:3]:
        if dtype == torch.bfloat16:
            h = (x.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)  # every pattern
        else:
            h = x.to(dtype)
        _same(tensor_stats(h), _reference(h))


def test_the_aminmax_pair_is_torchs() -> None:
    for x in _cases():
        _, pair = stats_and_aminmax(x)
        assert pair is not None
        lo, hi = torch.aminmax(x)
        for got, want in zip(pair, (lo, hi), strict=True):
            w = want.double()
            assert (got.isnan() and w.isnan()) or torch.equal(got, w), (got, w)


def test_thread_count_does_not_change_the_result() -> None:
    x = _cases()[1]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = tensor_stats(x)
    finally:
        torch.set_num_threads(before)
    _same(one, tensor_stats(x))


@pytest.mark.parametrize(
    "env", [{"FLOATGUARD_NATIVE": "0"}, {"CC": "false-compiler-that-is-missing"}]
)
@pytest.mark.subprocess
def test_without_the_kernel_the_torch_path_answers(env: dict[str, str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    code = (
        "import torch\n"
        "from floatguard import _native, tensor_stats\n"
        "assert _native.library() is None\n"
        "s = tensor_stats(torch.tensor([1.0, float('nan'), -float('inf'), 0.0]))\n"
        "assert (int(s.nan), int(s.neginf), int(s.zeros), float(s.amax)) == (1, 1, 1, 1.0)\n"
    )
    full = {**os.environ, "FLOATGUARD_CACHE": str(tmp_path), **env}
    r = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------ amax of many tensors
def _amax_reference(t: torch.Tensor) -> float:
    if t.numel() == 0:
        return 0.0
    return float(t.double().abs().max())  # NaN-propagating, like the inf-norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_amax_many_matches_torch_on_every_bit_pattern_kind(dtype: torch.dtype) -> None:
    width = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    bits = _bits(50_000, 3)
    if width[dtype] is torch.int16:
        bits = (bits & 0xFFFF).to(torch.int32).sub(2**15).to(torch.int16)
    every = bits.view(dtype)
    finite = every[torch.isfinite(every)]
    subnormal = torch.tensor([torch.finfo(dtype).smallest_normal / 4, 0.0, -0.0], dtype=dtype)
    cases = [
        every,  # holds NaNs
        finite,
        subnormal,
        torch.tensor([-float("inf"), 1.0], dtype=dtype),
        torch.tensor([torch.finfo(dtype).max, -torch.finfo(dtype).max], dtype=dtype),
        torch.empty(0, dtype=dtype),
        torch.zeros(7, dtype=dtype),
    ]
    out = _native.amax_many(cases)
    assert out is not None and out.dtype == torch.float64
    for t, got in zip(cases, out.tolist(), strict=True):
        want = _amax_reference(t)
        assert (math.isnan(got) and math.isnan(want)) or got == want, (t.dtype, got, want)


def test_amax_plan_refuses_what_it_cannot_read_and_sees_replaced_memory() -> None:
    assert _native.AmaxPlan.build([torch.ones(4, dtype=torch.float64)]) is None
    assert _native.AmaxPlan.build([torch.ones(4, 4).t()]) is None  # not contiguous
    assert _native.AmaxPlan.build([]) is None
    p = torch.nn.Parameter(torch.ones(3))
    plan = _native.AmaxPlan.build([p])
    assert plan is not None and plan.valid() and plan.run().tolist() == [1.0]
    p.data = torch.full((3,), -5.0)  # new memory: the plan must be rebuilt
    assert not plan.valid()
    with torch.no_grad():
        p.data[1] = float("nan")  # written in place: the plan reads it
    assert math.isnan(_native.AmaxPlan.build([p]).run()[0])  # type: ignore[union-attr]
