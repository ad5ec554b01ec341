"""benchmarks/gpu_check.py on a CPU: the no-CUDA exit, and every check's code path on CPU
tensors with the ``torch.cuda`` calls mocked (so the script cannot rot between GPU runs).

The mock (:class:`FakeCuda`) stands for a CUDA device as the checks see it: FP8 capable
(9.0), a sync warning per ``tolist()`` while the sync debug mode is "warn" (the guard's
one read is a ``tolist``; the optimizer's ``item()`` calls read CPU step tensors, which
do not synchronize on CUDA either), a peak-memory figure per reset, and ``_scaled_mm``
replaced by its float reference.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gc() -> Iterator[ModuleType]:
    """benchmarks/gpu_check.py as a module (registered while the tests run: its
    dataclasses resolve their module through sys.modules)."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["gpu_check"]


def reference_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    **_: Any,
) -> torch.Tensor:
    """What torch._scaled_mm computes: (a @ b) * scale_a * scale_b, in float32."""
    return (a.float() @ b.float()) * (scale_a * scale_b)


class FakeCuda:
    """The torch.cuda calls of the checks, on a CPU (see the module's docstring)."""

    def __init__(self) -> None:
        self.mode: object = "default"
        self.modes: list[object] = []
        self.silent = False  # True: warn mode sees no sync at all
        self.capability = (9, 0)
        self.peaks: list[int] = []  # the peak after each reset, in order (else 0)
        self.resets = 0
        self.syncs = 0
        self.scaled_mm: Callable[..., torch.Tensor] | None = reference_scaled_mm

    def set_sync_debug_mode(self, mode: object) -> None:
        self.mode = mode
        self.modes.append(mode)

    def warn_if_syncing(self) -> None:
        if self.mode == "error" and not self.silent:
            raise RuntimeError("called a synchronizing CUDA operation")
        if self.mode == "warn" and not self.silent:
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=3)

    def reset(self, *_: object) -> None:
        self.resets += 1

    def peak(self, *_: object) -> int:
        return self.peaks[self.resets - 1] if self.resets <= len(self.peaks) else 0

    def synchronize(self, *_: object) -> None:
        self.syncs += 1


@pytest.fixture
def cuda() -> Iterator[FakeCuda]:
    fake = FakeCuda()
    original_tolist = torch.Tensor.tolist

    def tolist(t: torch.Tensor) -> Any:
        fake.warn_if_syncing()
        return original_tolist(t)

    with ExitStack() as stack:
        for name, value in {
            "is_available": lambda: True,
            "synchronize": fake.synchronize,
            "set_sync_debug_mode": fake.set_sync_debug_mode,
            "max_memory_allocated": fake.peak,
            "reset_peak_memory_stats": fake.reset,
            "memory_allocated": lambda *_: 0,
            "empty_cache": lambda: None,
            "get_device_capability": lambda *_: fake.capability,
            "get_device_name": lambda *_: "mocked device",
        }.items():
            stack.enter_context(mock.patch.object(torch.cuda, name, value))
        stack.enter_context(mock.patch.object(torch.Tensor, "tolist", tolist))
        original_mm = torch._scaled_mm

        def scaled_mm(*args: Any, **kwargs: Any) -> torch.Tensor:
            return (fake.scaled_mm or original_mm)(*args, **kwargs)

        stack.enter_context(mock.patch.object(torch, "_scaled_mm", scaled_mm))
        yield fake


@pytest.fixture
def backend(gc: ModuleType) -> Any:
    return gc.Backend("cpu")


@pytest.fixture
def sizes(gc: ModuleType) -> Any:
    return gc.Sizes.tiny()


def verdicts(rows: list[Any]) -> list[str]:
    return [r.verdict for r in rows]


@pytest.mark.subprocess
def test_without_cuda_it_prints_one_line_and_exits_0() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") == 1 and "no CUDA device" in r.stdout, r.stdout


# --------------------------------------------------------------------------------- (a)
def test_sync_check_counts_the_one_read(gc: ModuleType, cuda: FakeCuda, backend: Any,
                                        sizes: Any) -> None:  # fmt: skip
    rows = gc.sync_check(backend, sizes)
    assert [r.check for r in rows] == ["(a) calibration: one tolist() of a device tensor"] + [
        f"(a) syncs per step, {name}, {p}" for name, _, _ in sizes.models for p in ("bf16", "fp16")
    ]
    assert verdicts(rows) == ["PASS"] * 5, rows
    assert rows[1].measured == f"1 in each of {sizes.sync_steps} steps"
    assert cuda.modes == ["warn", "default"] * 5  # warn mode on only while counting


def test_an_extra_sync_per_step_fails_and_names_its_site(
    gc: ModuleType, cuda: FakeCuda, backend: Any, sizes: Any
) -> None:
    original_step = torch.optim.AdamW.step

    def step_with_a_read(self: torch.optim.AdamW, *args: Any, **kwargs: Any) -> Any:
        torch.zeros(1).tolist()  # a sync of the optimizer's, beyond the guard's read
        return original_step(self, *args, **kwargs)

    with mock.patch.object(torch.optim.AdamW, "step", step_with_a_read):
        rows = gc.sync_check(backend, sizes)
    assert verdicts(rows) == ["PASS"] + ["FAIL"] * 4, rows
    for r in rows[1:]:
        assert r.measured.startswith(f"2-2 per step ({sizes.sync_steps} of "), r.measured
        assert "'called a synchronizing CUDA operation'" in r.measured
        assert "in step_with_a_read" in r.measured, r.measured  # the site, not the read


def test_no_sync_seen_fails_the_calibration_and_warns(
    gc: ModuleType, cuda: FakeCuda, backend: Any, sizes: Any
) -> None:
    cuda.silent = True
    rows = gc.sync_check(backend, sizes)
    assert verdicts(rows) == ["FAIL"] + ["WARN"] * 4, rows
    assert "the read was not seen" in rows[1].measured


def _call(gc: ModuleType, where: str) -> Any:
    """A recorded sync made in ``where``: "read" (the guard's read) or a function name."""
    if where == "read":
        frame = ("/x/src/floatguard/guard/read.py", 93, "read")
    else:
        frame = ("/x/src/floatguard/guard/act.py", 7, where)
    stack = (traceback.FrameSummary(*frame, lookup_line=False),)
    return gc.SyncCall("called a synchronizing CUDA operation", stack)


SYNC_ROWS = [
    # (id, calls per step, applied per step, verdict, text in measured)
    ("one-read", [["read"], ["read"]], [True, True], "PASS", "1 in each of 2 steps"),
    ("extra", [["read"], ["read", "apply"]], [True, True], "FAIL", "act.py:7 in apply"),
    ("none", [[], []], [True, True], "WARN", "the read was not seen"),
    ("not-the-read", [["apply"], ["apply"]], [True, True], "WARN", "not the read's"),
    ("bad-step-left-out", [["read", "read", "read"], ["read"]], [False, True], "PASS",
     "(1 bad steps left out)"),
    ("none-applied", [["read"]], [False], "FAIL", "no step applied of 1"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("calls", "applied", "verdict", "text"),
    [c[1:] for c in SYNC_ROWS],
    ids=[c[0] for c in SYNC_ROWS],
)
def test_sync_row(
    gc: ModuleType, calls: list[list[str]], applied: list[bool], verdict: str, text: str
) -> None:
    per_step = [[_call(gc, w) for w in step] for step in calls]
    row = gc._sync_row("(a) x", per_step, applied)
    assert row.verdict == verdict and text in row.measured, row


# --------------------------------------------------------------------------------- (b)
def test_overhead_rows(gc: ModuleType, cuda: FakeCuda, backend: Any, sizes: Any) -> None:
    rows = gc.overhead_check(backend, sizes)
    assert len(rows) == len(sizes.models) * 2 * 2
    for r in rows:
        assert re.fullmatch(r"\d+\.\d{3}x \(\d+\.\d\d vs \d+\.\d\d ms/step\)", r.measured), r
        if "Guard.step(closure)" in r.check:
            ratio = float(r.measured.split("x")[0])
            assert r.verdict == ("PASS" if ratio <= gc.RATIO_TARGET else "FAIL")
        else:
            assert "stats_every=10" in r.check and r.verdict == "INFO"
    rounds = len(rows) // 2 * 3 * sizes.bench_rounds  # 3 contenders per model and precision
    assert cuda.syncs >= 2 * rounds  # synchronized around every round


# --------------------------------------------------------------------------------- (c)
def test_fp8_gemm_matches_the_reference(
    gc: ModuleType, cuda: FakeCuda, backend: Any, sizes: Any
) -> None:
    rows = gc.fp8_gemm_check(backend, sizes)
    assert verdicts(rows) == ["PASS"] * len(sizes.gemm_shapes), rows
    assert all(r.measured.endswith("differing from floatguard's: 0") for r in rows)


def test_fp8_gemm_against_torchs_own_kernel(
    gc: ModuleType, cuda: FakeCuda, backend: Any, sizes: Any
) -> None:
    """torch's CPU _scaled_mm (where it has one) takes the same scale convention."""
    cuda.scaled_mm = None
    try:
        rows = gc.fp8_gemm_check(backend, sizes)
    except (RuntimeError, NotImplementedError) as e:  # no CPU kernel in this torch
        pytest.skip(f"torch._scaled_mm on CPU: {e}")
    assert verdicts(rows) == ["PASS"] * len(sizes.gemm_shapes), rows


def test_fp8_gemm_fails_on_the_other_scale_convention(
    gc: ModuleType, cuda: FakeCuda, backend: Any, sizes: Any
) -> None:
    def encode_scales(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                      scale_b: torch.Tensor, **_: Any) -> torch.Tensor:  # fmt: skip
        return (a.float() @ b.float()) / (scale_a * scale_b)  # scales taken as encode scales

    cuda.scaled_mm = encode_scales
    assert verdicts(gc.fp8_gemm_check(backend, sizes)) == ["FAIL"] * len(sizes.gemm_shapes)


def test_fp8_gemm_skips_without_fp8(
    gc: ModuleType, cuda: FakeCuda, backend: Any, sizes: Any
) -> None:
    cuda.capability = (8, 6)
    (row,) = gc.fp8_gemm_check(backend, sizes)
    assert row.verdict == "SKIP" and "8.6" in row.measured and ">= 8.9" in row.expected


@pytest.mark.parametrize("k", [16, 1024, 8192])
def test_gemm_bounds(gc: ModuleType, k: int) -> None:
    bound, allowance = gc.gemm_bounds(k)
    assert bound == (2 * k + 6) * 2.0**-24
    assert allowance == 2.0**-7


# --------------------------------------------------------------------------------- (d)
def _state_mib(gc: ModuleType, sizes: Any) -> float:
    """Weights + AdamW state of (d)'s model, as the check counts them."""
    _, cfg, batch = sizes.models[-1]
    model, opt, x, y = gc._setup(gc.Backend("cpu"), cfg, batch)
    gc._lm_loss(model, x, y).backward()
    opt.step()
    return float(gc.state_bytes(model, opt, torch.device("cpu"))) / gc.MiB


@pytest.mark.parametrize(
    ("host_extra_mib", "host_verdict"), [(0.001, "PASS"), (100.0, "FAIL")], ids=["small", "big"]
)
def test_memory_rows(
    gc: ModuleType,
    cuda: FakeCuda,
    backend: Any,
    sizes: Any,
    host_extra_mib: float,
    host_verdict: str,
) -> None:
    state = _state_mib(gc, sizes)
    base = 100.0
    # runs in order: the peer, the guard's defaults ("auto": device state on a CPU),
    # snapshot_on="host", snapshot_on="device"
    cuda.peaks = [int(m * gc.MiB) for m in (base, base + state, base + host_extra_mib,
                                            base + state)]  # fmt: skip
    rows = gc.memory_check(backend, sizes, places=("host", "device"))
    assert [r.check.rsplit(", ", 1)[1] for r in rows] == [
        "defaults",
        'snapshot_on="host"',
        'snapshot_on="device"',
    ]
    assert verdicts(rows) == ["INFO", host_verdict, "INFO"], rows
    assert rows[0].measured.startswith(f"{state:+.1f} MiB = +100.0% of {state:.1f} MiB")
    assert cuda.resets == 4


def test_memory_without_the_snapshot_field(
    gc: ModuleType, cuda: FakeCuda, backend: Any, sizes: Any
) -> None:
    (row,) = gc.memory_check(backend, sizes, places=())
    assert row.check.endswith("defaults") and row.verdict == "INFO"
    assert "a second copy on the device" in row.expected


def test_memory_detects_the_policys_places(
    gc: ModuleType, cuda: FakeCuda, backend: Any, sizes: Any
) -> None:
    rows = gc.memory_check(backend, sizes)
    assert len(rows) == 1 + len(gc.snapshot_places())
    assert gc.snapshot_places() in ((), ("host", "device"))


# --------------------------------------------------------------------------------- (e)
def test_native_stats_rows(gc: ModuleType, cuda: FakeCuda, backend: Any, sizes: Any) -> None:
    rows = gc.native_stats_check(backend, sizes)
    assert verdicts(rows) == ["PASS"] * 4, rows
    assert rows[0].measured == "6 of 6 equal"
    assert re.fullmatch(r"2 events \(want 2\), (\d+) of \1 entries equal", rows[3].measured)


def test_stats_mismatches_names_the_field(gc: ModuleType) -> None:
    x = torch.tensor([1.0, 2.0, math.inf])
    got = gc.tensor_stats(x)
    ref = gc.tensor_stats(torch.tensor([1.0, 4.0, math.inf]))
    assert gc.stats_mismatches(got, got) == []
    assert gc.stats_mismatches(got, ref) == ["amax", "max", "hist"]


# ---------------------------------------------------------------------------- the table
def test_main_prints_one_table(
    gc: ModuleType, cuda: FakeCuda, capsys: pytest.CaptureFixture[str]
) -> None:
    code = gc.main(["--tiny", "--device", "cpu"])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("# GPU check: mocked device (compute capability 9.0), torch ")
    table = out[2:]
    assert table[:2] == ["| check | measured | expected | verdict |", "|---|---|---|---|"]
    assert all(line.startswith("| ") and line.count(" | ") >= 3 for line in table[2:])
    checks = {line.split(" ", 2)[1] for line in table[2:]}
    assert checks == {"(a)", "(b)", "(c)", "(d)", "(e)", "(f)", "(g)", "(h)"}
    failed = [line for line in table if line.endswith("| FAIL |")]
    # on a CPU only the overhead target may be missed (timing noise), nothing else
    assert all("(b)" in line for line in failed), failed
    assert code == (1 if failed else 0)


def test_a_check_that_raises_is_one_fail_row(gc: ModuleType, backend: Any, sizes: Any) -> None:
    def broken(_: Any, __: Any) -> list[Any]:
        raise ValueError("no such thing")

    def fine(_: Any, __: Any) -> list[Any]:
        return [gc.Row("fine", "1", "1", "PASS")]

    rows = gc.run_checks(backend, sizes, [("(x) broken", broken), ("(y) fine", fine)])
    assert verdicts(rows) == ["FAIL", "PASS"]
    assert rows[0].measured.startswith("raised ValueError: no such thing at ")
    assert "test_gpu_check.py" in rows[0].measured


def test_render_escapes_bars(gc: ModuleType) -> None:
    table = gc.render([gc.Row("a | b", "x", "y", "INFO")])
    assert table.splitlines()[2] == "| a \\| b | x | y | INFO |"


# --------------------------------------------------------------------------------- (f)
def test_overlap_rows(gc: ModuleType, cuda: FakeCuda, backend: Any, sizes: Any) -> None:
    rows = gc.overlap_check(backend, sizes)
    assert [r.check.split("every step, ")[1].split(" /")[0] for r in rows] == [
        "copy after the backward",
        "snapshot_overlap",
    ]
    for r in rows:
        assert re.fullmatch(r"\d+\.\d{3}x \(\d+\.\d\d vs \d+\.\d\d ms/step\)", r.measured), r
    assert rows[0].verdict == "INFO" and rows[1].verdict in ("INFO", "WARN")
    assert cuda.syncs >= 2 * 3 * sizes.bench_rounds  # around every round of 3 contenders


# --------------------------------------------------------------------------------- (g)
def test_deferred_rows(gc: ModuleType, cuda: FakeCuda, backend: Any, sizes: Any) -> None:
    rows = gc.deferred_check(backend, sizes)
    syncs = [r for r in rows if "syncs per deferred step" in r.check]
    errors = [r for r in rows if "set_sync_debug_mode('error')" in r.check]
    timings = [r for r in rows if "fused AdamW" in r.check]
    n = len(sizes.models) * 2
    assert len(syncs) == len(errors) == n and len(timings) == 2 * n
    assert all(r.verdict == "PASS" and r.measured == "0-0 per step" for r in syncs), syncs
    assert all(r.verdict == "PASS" and r.measured == "no error" for r in errors), errors
    for r in timings:
        assert re.fullmatch(r"\d+\.\d{3}x \(\d+\.\d\d vs \d+\.\d\d ms/step\)", r.measured), r
        assert r.verdict == "INFO"
    assert "error" in cuda.modes


def test_a_deferred_step_that_reads_fails_and_names_the_read(
    gc: ModuleType, cuda: FakeCuda, backend: Any, sizes: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check can fail: the exact guard in the deferred rows' place reads once a step."""
    guarded = gc.guarded

    def exact(*args: Any, **kwargs: Any) -> Any:
        kwargs["sync"] = "exact"
        return guarded(*args, **kwargs)

    monkeypatch.setattr(gc, "guarded", exact)
    rows = gc.deferred_check(backend, sizes)
    syncs = [r for r in rows if "syncs per deferred step" in r.check]
    errors = [r for r in rows if "set_sync_debug_mode('error')" in r.check]
    assert all(r.verdict == "FAIL" and "read.py" in r.measured for r in syncs), syncs
    assert all(r.verdict == "FAIL" and "synchronizing" in r.measured for r in errors), errors


# --------------------------------------------------------------------------------- (h)
def test_graph_rows(gc: ModuleType, cuda: FakeCuda, backend: Any, sizes: Any) -> None:
    """On the CPU the graphed guard runs the "check" backend (every step eager, compared
    with the captured one): the rows' code runs, and on a GPU the same rows measure
    torch.cuda.CUDAGraph."""
    rows = gc.graph_check(backend, sizes)
    by = {r.check.split(",")[0]: r for r in rows}
    assert by["(h) graphed steps replayed"].verdict == "PASS", rows
    assert "backend check" in by["(h) graphed steps replayed"].measured
    assert by["(h) syncs per replayed step"].measured == "0-0 per step"
    assert by["(h) set_sync_debug_mode('error') on replays"].verdict == "PASS"
    assert by["(h) weights"].measured == "bit for bit", rows
    timings = [r for r in rows if "fused AdamW" in r.check]
    assert len(timings) == 2 * len(sizes.models) and all(r.verdict == "INFO" for r in timings)
