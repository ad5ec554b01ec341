"""The GPU check (issue 26, item 3): what only an accelerator can show, in one table.

On one CUDA device, in a few minutes (well under 5 on one H200), six checks print one
markdown table (check | measured | expected | verdict):

(a) ``sync_check``: guarded steps of a GPT at two sizes, bf16 and fp16, under
    ``torch.cuda.set_sync_debug_mode("warn")``; the synchronizing calls (torch warns
    once per call) counted per step after warm-up. Expected: 1, the guard's one read;
    a step with more is a FAIL naming the first extra call's site.
(b) ``overhead_check``: ``Guard.step(closure)`` and ``Guard(stats_every=10)`` against
    the peer loop (fp16: ``GradScaler`` + ``clip_grad_norm_``; bf16: autocast +
    ``clip_grad_norm_``), interleaved rounds, ``torch.cuda.synchronize()`` around each
    round of N steps, median.
(c) ``fp8_gemm_check``: the emulated e4m3 tensorwise GEMM (``EmulatedLinear`` with
    ``Tensorwise("e4m3fn")`` on both operands) against ``torch._scaled_mm`` fed the same
    e4m3 codes and scales, where the device has FP8 (compute capability >= 8.9). The
    tolerance is derived in :func:`gemm_bounds`.
(d) ``memory_check``: peak allocated device memory of N training steps without the
    guard and with it (defaults; and each ``ResponsePolicy.snapshot_on`` place where the
    policy has that field), the difference in MiB and as a share of weights + optimizer
    state.
(f) ``overlap_check``: a host snapshot at every step (``snapshot_every=1``, no budget),
    its copy after the backward (the update waits for it) or overlapping the forward
    and backward (``snapshot_overlap=True``), each against the peer loop in one run,
    bf16, on the larger model: how much of the copy the overlap hides.
(g) ``deferred_check``: ``Guard(sync="deferred")``: syncs per healthy step (expected 0),
    the same steps under ``set_sync_debug_mode("error")``, and the step time against
    ``GradScaler`` + fused AdamW and the exact guard.
(h) ``graph_check``: ``Guard.graphed`` (the deferred step as one CUDA graph replay):
    the steps after warm-up replayed, syncs per replay (expected 0) and under
    ``set_sync_debug_mode("error")``, the weights bit for bit against the eager
    deferred guard, the step time against autocast + clip + fused AdamW.
(e) ``native_stats_check``: :func:`floatguard.tensor_stats` on device tensors against
    the same statistics of the CPU copy (the one-pass C kernel there), the stats
    monitor's records, ``Guard(watch="hooks")`` and ``Guard(stats_every=2)`` on the
    device. Exact: every field is an exact function of the bits.

Words: a *backend* (:class:`Backend`) is the device and every ``torch.cuda`` call the
checks make, looked up when called, so ``tests/test_gpu_check.py`` runs every check on
CPU tensors with those calls mocked; *sizes* (:class:`Sizes`) say how big and how long.

    python benchmarks/gpu_check.py [--quick | --tiny] [--device cuda:N]   (make gpu-check)

Without CUDA it prints one line and exits 0; with it, the exit code is 1 when a row
says FAIL. Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from floatguard import Guard, ResponsePolicy, tensor_stats
from floatguard.demo import GPT, GPTConfig, synthetic_batch
from floatguard.emulation import EmulationRecipe, Tensorwise
from floatguard.emulation.fake_quant import EmulatedLinear
from floatguard.monitor import Monitor
from floatguard.stats import EXP_MIN, TensorStats

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peer_loops import clip_step

Verdict = Literal["PASS", "FAIL", "WARN", "SKIP", "INFO"]
Step = Callable[[], None]
MiB = 2**20
U32 = 2.0**-24  # float32's unit roundoff
E4M3_MAX = float.fromhex("0x1.cp8")  # 448
HOST_SHARE_MAX = 0.10  # host snapshots: the guard's extra device memory, at most this share
RATIO_TARGET = 1.03  # issue 26: Guard.step(closure) against the peer loop


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    check: str
    measured: str
    expected: str
    verdict: Verdict


@dataclass(frozen=True)
class Sizes:
    """How big and how long the checks run (``full`` on a GPU, ``tiny`` for the CPU test)."""

    models: tuple[tuple[str, GPTConfig, int], ...]
    """(name, config, batch) of each model; the last one is (d)'s."""
    warmup: int = 3
    sync_steps: int = 12
    """(a): counted steps (12 covers two default snapshot intervals)."""
    bench_steps: int = 20
    """(b): steps per round (a multiple of 10, so stats_every=10 samples evenly)."""
    bench_rounds: int = 7
    mem_steps: int = 12
    gemm_shapes: tuple[tuple[int, int, int], ...] = (
        (256, 1024, 512),
        (1024, 4096, 1024),
        (128, 16384, 256),
    )
    """(c): (M, K, N), multiples of 16 (``_scaled_mm``'s constraint)."""
    stats_steps: int = 4
    stats_numel: int = 1 << 20

    @classmethod
    def full(cls) -> Sizes:
        """The bench GPT and a bigger one (8 layers, d=512, T=256)."""
        return cls(models=(
            ("bench GPT", GPTConfig(), 16),
            ("GPT 8x512", GPTConfig(block_size=256, n_layer=8, n_head=8, n_embd=512), 16),
        ))  # fmt: skip

    @classmethod
    def quick(cls) -> Sizes:
        """The same models, fewer steps and rounds."""
        return dataclasses.replace(
            cls.full(), sync_steps=6, bench_steps=10, bench_rounds=3, mem_steps=6
        )

    @classmethod
    def tiny(cls) -> Sizes:
        """Two tiny GPTs and few steps: the CPU test's size (seconds)."""
        return cls(
            models=(
                ("tiny GPT", GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2,
                                       n_embd=32), 4),
                ("tiny GPT 2L", GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2,
                                          n_embd=32), 4),
            ),
            warmup=2,
            sync_steps=3,
            bench_steps=2,
            bench_rounds=2,
            mem_steps=3,
            gemm_shapes=((16, 32, 16), (32, 64, 48)),
            stats_steps=4,
            stats_numel=4096,
        )  # fmt: skip


class Backend:
    """The device the checks run on and the ``torch.cuda`` calls they make, each looked up
    when called (so a test can patch ``torch.cuda`` and run the checks on CPU tensors)."""

    def __init__(self, device: str | torch.device = "cuda") -> None:
        self.device = torch.device(device)
        # the device argument of the torch.cuda calls (None: the current device)
        self._cuda = self.device if self.device.type == "cuda" else None

    @property
    def kind(self) -> str:
        """The device type autocast and GradScaler take ("cuda"; "cpu" under test)."""
        return self.device.type

    def available(self) -> bool:
        return bool(torch.cuda.is_available())

    def describe(self) -> str:
        major, minor = self.capability()
        return f"{torch.cuda.get_device_name(self._cuda)} (compute capability {major}.{minor})"

    def synchronize(self) -> None:
        torch.cuda.synchronize(self._cuda)

    @contextmanager
    def sync_debug(self, mode: Literal["warn", "error"] = "warn") -> Iterator[None]:
        """``torch.cuda.set_sync_debug_mode(mode)`` inside, "default" after."""
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self._cuda)

    def peak_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self._cuda))

    def allocated_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self._cuda))

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def capability(self) -> tuple[int, int]:
        major, minor = torch.cuda.get_device_capability(self._cuda)
        return int(major), int(minor)

    def scaled_mm(
        self, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor
    ) -> torch.Tensor:
        """``torch._scaled_mm`` in float32: ``a`` row-major [M, K], ``b`` column-major
        [K, N], ``scale_a`` / ``scale_b`` the *dequantization* scales (0-dim float32):
        ``(a @ b) * scale_a * scale_b`` with fp32 accumulation (no fast accumulation)."""
        out: torch.Tensor = torch._scaled_mm(
            a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32
        )
        return out


# ----------------------------------------------------------------------------- models
def _setup(
    backend: Backend, cfg: GPTConfig, batch: int, seed: int = 0
) -> tuple[GPT, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = GPT(cfg).to(backend.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = synthetic_batch(cfg, batch, generator=torch.Generator().manual_seed(seed))
    return model, opt, x.to(backend.device), y.to(backend.device)


def _lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def guarded(
    backend: Backend, cfg: GPTConfig, batch: int, precision: str, **guard_kwargs: Any
) -> tuple[Step, Guard]:
    """A guarded step of a fresh GPT (``Guard(model, opt, precision=..., **guard_kwargs)``)."""
    model, opt, x, y = _setup(backend, cfg, batch)
    guard = Guard(model, opt, precision=precision, **guard_kwargs)  # type: ignore[arg-type]

    def step() -> None:
        guard.step(lambda: _lm_loss(model, x, y))

    return step, guard


def peer(backend: Backend, cfg: GPTConfig, batch: int, precision: str) -> Step:
    """The loop the guard replaces (``_peer_loops.clip_step`` on this device): fp16 with
    PyTorch's recipe (``GradScaler.scale(loss).backward(); unscale_; clip_grad_norm_(1.0);
    step; update``), bf16 or fp32 with ``backward; clip_grad_norm_(1.0); step``."""
    model, opt, x, y = _setup(backend, cfg, batch)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    return clip_step(model, opt, lambda: _lm_loss(model, x, y), backend.kind, dtype)


# ----------------------------------------------------------------- (a) synchronizations
@dataclass(frozen=True)
class SyncCall:
    """One synchronizing call torch warned about: its message and the Python frames
    (innermost last) that made it."""

    message: str
    stack: tuple[traceback.FrameSummary, ...]

    def site(self, frames: int = 3) -> str:
        """The innermost ``frames`` frames, innermost first: ``file:line in fn < ...``."""
        shown = [f for f in self.stack if not f.filename.endswith("warnings.py")]
        return " < ".join(
            f"{_short(f.filename)}:{f.lineno} in {f.name}" for f in reversed(shown[-frames:])
        )

    def is_the_read(self) -> bool:
        """Made by the guard's one read (``StepReader.read``)."""
        return any(
            f.filename.replace("\\", "/").endswith("floatguard/guard/read.py") and f.name == "read"
            for f in self.stack
        )


def _short(path: str) -> str:
    p = path.replace("\\", "/")
    for root in ("/site-packages/", "/src/", "/benchmarks/", "/tests/"):
        if root in p:
            return p.split(root, 1)[1]
    return p.rsplit("/", 1)[-1]


class SyncRecorder:
    """Collects the warnings ``set_sync_debug_mode("warn")`` makes, per step.

    torch warns once per synchronizing call (``"called a synchronizing CUDA
    operation"``; autograd replays warnings of its threads on the calling thread). The
    filter is "always" inside, so repeats at one site are all counted, and
    ``showwarning`` is replaced so each is recorded with the stack that made it; other
    warnings are dropped while recording.
    """

    def __init__(self) -> None:
        self.steps: list[list[SyncCall]] = []
        self._saved: Any = None

    def begin_step(self) -> None:
        self.steps.append([])

    def _show(self, message: Any, category: Any, *_: Any, **__: Any) -> None:
        text = str(message)
        if issubclass(category, UserWarning) and "synchroniz" in text.lower():
            stack = tuple(traceback.extract_stack()[:-1])
            if not self.steps:
                self.begin_step()
            self.steps[-1].append(SyncCall(text.splitlines()[0][:160], stack))

    def __enter__(self) -> SyncRecorder:
        self._saved = warnings.catch_warnings()
        self._saved.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._show
        return self

    def __exit__(self, *exc: object) -> None:
        self._saved.__exit__(*exc)


def count_syncs(backend: Backend, step: Step, steps: int) -> list[list[SyncCall]]:
    """The synchronizing calls of each of ``steps`` calls of ``step``, in warn mode."""
    backend.synchronize()
    with SyncRecorder() as rec, backend.sync_debug("warn"):
        for _ in range(steps):
            rec.begin_step()
            step()
    backend.synchronize()
    return rec.steps


def _sync_row(check: str, per_step: list[list[SyncCall]], applied: list[bool]) -> Row:
    """PASS: one sync in every applied step, and it is the guard's read. Steps not
    applied (a bad step: its localization reads more, by design) are left out."""
    expected = "1 per step (the guard's one read)"
    kept = [calls for calls, ok in zip(per_step, applied, strict=True) if ok]
    left_out = (
        f" ({len(per_step) - len(kept)} bad steps left out)" if len(kept) < len(per_step) else ""
    )
    counts = [len(c) for c in kept]
    if not counts:
        return Row(check, f"no step applied of {len(per_step)}", expected, "FAIL")
    span = f"{min(counts)}-{max(counts)} per step"
    over = [i for i, c in enumerate(counts) if c > 1]
    if over:
        calls = kept[over[0]]
        extra = next((c for c in calls if not c.is_the_read()), calls[0])
        return Row(
            check,
            f"{span} ({len(over)} of {len(counts)} steps over){left_out}; first extra: "
            f"'{extra.message}' at {extra.site()}",
            expected,
            "FAIL",
        )
    if all(c == 1 for c in counts):
        other = next((c[0] for c in kept if not c[0].is_the_read()), None)
        if other is None:
            return Row(check, f"1 in each of {len(counts)} steps{left_out}", expected, "PASS")
        return Row(
            check,
            f"1 per step{left_out}, but not the read's: '{other.message}' at {other.site()}",
            expected,
            "WARN",
        )
    silent = [i for i, c in enumerate(counts) if c == 0]
    return Row(
        check,
        f"{span}{left_out}; none in step(s) {silent[:5]}: the read was not seen as a sync",
        expected,
        "WARN",
    )


def _count_guarded(
    backend: Backend, step: Step, guard: Guard, steps: int
) -> tuple[list[list[SyncCall]], list[bool]]:
    """:func:`count_syncs` of guarded steps, and whether each step was applied."""
    applied: list[bool] = []

    def counted() -> None:
        before = guard.good_steps
        step()
        applied.append(guard.good_steps > before)

    return count_syncs(backend, counted, steps), applied


def sync_check(backend: Backend, sizes: Sizes) -> list[Row]:
    """(a) Synchronizations per guarded step, two GPTs x (bf16, fp16), after warm-up;
    first a calibration: one ``tolist()`` of a device tensor must count as one."""
    probe = torch.zeros(1, device=backend.device)

    def read_probe() -> None:
        probe.tolist()

    cal = count_syncs(backend, read_probe, 1)
    n = sum(len(s) for s in cal)
    rows = [
        Row(
            "(a) calibration: one tolist() of a device tensor",
            f"{n} sync(s) seen",
            "1 (else every (a) row is unproven)",
            "PASS" if n == 1 else "FAIL",
        )
    ]
    for name, cfg, batch in sizes.models:
        for precision in ("bf16", "fp16"):
            step, guard = guarded(backend, cfg, batch, precision)
            for _ in range(sizes.warmup):
                step()
            per_step, applied = _count_guarded(backend, step, guard, sizes.sync_steps)
            guard.close()
            rows.append(_sync_row(f"(a) syncs per step, {name}, {precision}", per_step, applied))
    return rows


# -------------------------------------------------------------------------- (b) overhead
def time_rounds(
    backend: Backend, steps: dict[str, Step], n: int, rounds: int, warmup: int
) -> dict[str, float]:
    """Median seconds per step of each contender: interleaved rounds of ``n`` steps,
    the device synchronized before and after each round."""
    for s in steps.values():
        for _ in range(warmup):
            s()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, s in steps.items():
            backend.synchronize()
            start = time.perf_counter()
            for _ in range(n):
                s()
            backend.synchronize()
            times[name].append((time.perf_counter() - start) / n)
    return {k: statistics.median(v) for k, v in times.items()}


def overhead_check(backend: Backend, sizes: Sizes) -> list[Row]:
    """(b) ``Guard.step(closure)`` and ``Guard(stats_every=10)`` against the peer loop,
    per model and precision, side by side in one run."""
    rows = []
    for name, cfg, batch in sizes.models:
        for precision in ("fp16", "bf16"):
            peer_name = "GradScaler + clip" if precision == "fp16" else "autocast + clip"
            plain, g1 = guarded(backend, cfg, batch, precision)
            sampled, g2 = guarded(backend, cfg, batch, precision, stats_every=10)
            contenders = {
                "peer": peer(backend, cfg, batch, precision),
                "guard": plain,
                "stats": sampled,
            }
            med = time_rounds(
                backend, contenders, sizes.bench_steps, sizes.bench_rounds, sizes.warmup
            )
            g1.close()
            g2.close()
            ref = med["peer"]
            for key, label in (("guard", "Guard.step(closure)"), ("stats", "stats_every=10")):
                ratio = med[key] / ref
                measured = f"{ratio:.3f}x ({med[key] * 1e3:.2f} vs {ref * 1e3:.2f} ms/step)"
                check = f"(b) {name}, {precision}: {label} / {peer_name}"
                if key == "guard":
                    ok = ratio <= RATIO_TARGET
                    rows.append(
                        Row(check, measured, f"<= {RATIO_TARGET:.2f}x (issue 26)",
                            "PASS" if ok else "FAIL")
                    )  # fmt: skip
                else:
                    rows.append(Row(check, measured, "no target (hooks on 1 step in 10)", "INFO"))
    return rows


# ------------------------------------------------------------------------ (c) FP8 GEMM
def gemm_bounds(k: int) -> tuple[float, float]:
    """(fp32 bound, accumulator allowance) on ``|y_mm - y_emu| / P``, elementwise, where
    ``P = sum_k |qa_k qw_k| / (s_a s_w)`` (the dequantized operands' absolute products,
    computed exactly in float64) and ``u = 2**-24``.

    - The emulated GEMM (``EmulatedLinear``) multiplies ``aq = fl(qa / s_a)`` and
      ``wq = fl(qw / s_w)`` (one rounding each, 2u) in a float32 GEMM (each product
      rounded, u; a sum of K terms in any order, (K - 1)u): ``|y_emu - E| <= (K + 2)u P``
      to first order, E the exact ``sum_k qa_k qw_k / (s_a s_w)``.
    - ``_scaled_mm`` multiplies the e4m3 codes exactly (4 + 4 significand bits fit
      float32's 24), accumulates in float32 ((K - 1)u), then scales by
      ``fl(1/s_a) * fl(1/s_w)``: two roundings of the reciprocals, one of their
      product, one of the output (4u): ``|y_mm - E| <= (K + 3)u P``.
    - Hence ``|y_mm - y_emu| <= (2K + 5)u P``; we allow ``(2K + 6)u P``: "equal up to
      the accumulation order".
    - The allowance: NVIDIA does not document the FP8 Tensor Core accumulator; DeepSeek-V3
      (2024, section 3.3.2) measured about 14 bits kept on H800, which is why GEMMs
      without fast accumulation promote partial sums to float32 every 128 products (the
      CUTLASS/DeepSeek interval). Truncation to 14 bits, up to 128 times per interval:
      at most ``128 * 2**-14 = 2**-7`` of P. Between the bound and the allowance the
      verdict is WARN (the scales agree; the hardware accumulates with fewer bits);
      beyond it, FAIL: a scale convention or operand layout that differs errs by a
      factor (``s**2``, a transpose), and a code that rounds differently by 2**-4 of
      its term, which the bit-exact code check catches on its own.
    """
    return (2 * k + 6) * U32, 2.0**-7


def _gemm_operands(m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations ~ N(0, 3) with a few outliers (a column of 40x), weights ~ N(0, 0.02):
    different scales per operand, values across e4m3's normal and subnormal ranges."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * 3.0
    a[:, 3] *= 40.0
    w = torch.randn(n, k, generator=g) * 0.02
    return a, w


@contextmanager
def _ieee_fp32_matmul() -> Iterator[None]:
    """float32 matmuls in float32 (no TF32), restored after."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def fp8_gemm_check(backend: Backend, sizes: Sizes) -> list[Row]:
    """(c) The emulated e4m3 tensorwise GEMM equals ``torch._scaled_mm`` with the same
    scales, to the bound of :func:`gemm_bounds`; and torch's e4m3 cast of ``x * s`` gives
    the codes floatguard's quantization gives (values equal)."""
    check = "(c) emulated e4m3 tensorwise GEMM = torch._scaled_mm"
    cap = backend.capability()
    if cap < (8, 9):
        return [Row(check, f"compute capability {cap[0]}.{cap[1]}", "FP8 needs >= 8.9", "SKIP")]
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return [Row(check, f"torch {torch.__version__}", "torch.float8_e4m3fn", "SKIP")]
    recipe = Tensorwise("e4m3fn")
    emu_recipe = EmulationRecipe(recipe, recipe, None)
    rows = []
    for i, (m, k, n) in enumerate(sizes.gemm_shapes):
        a, w = (t.to(backend.device) for t in _gemm_operands(m, k, n, seed=i))
        ra, rw = recipe(a), recipe(w)
        s_a, s_w = ra.scales.reshape(()), rw.scales.reshape(())
        # The codes: x * s rounded to e4m3 by torch's cast (clamped: amax * s may round
        # a hair past 448, and torch's cast does not saturate on every device).
        a8 = (a * s_a).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        w8 = (w * s_w).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        bad_codes = int(
            (a8.float() / s_a != ra.values).sum() + (w8.float() / s_w != rw.values).sum()
        )
        lin = nn.Linear(k, n, bias=False).to(backend.device)
        with torch.no_grad():
            lin.weight.copy_(w)
        emulated = EmulatedLinear(lin, emu_recipe)
        with torch.no_grad(), _ieee_fp32_matmul():
            y_emu = emulated(a)
            y_mm = backend.scaled_mm(a8, w8.t(), torch.reciprocal(s_a), torch.reciprocal(s_w))
            inv = 1.0 / (s_a.double() * s_w.double())
            qa, qw = a8.double(), w8.double()
            exact = (qa @ qw.t()) * inv  # products exact, float64 sums: ~2**-53 each
            p = (qa.abs() @ qw.abs().t()) * inv
        rows.append(_gemm_row(f"{check}, {m}x{k}x{n}", k, y_emu, y_mm, exact, p, bad_codes))
    return rows


def _normalized(diff: torch.Tensor, p: torch.Tensor) -> float:
    """max |diff| / P, elementwise (where P is 0 both sides must be exactly 0)."""
    zero = p == 0
    rel = torch.where(zero, torch.where(diff == 0, 0.0, math.inf), diff / torch.where(zero, 1, p))
    return float(rel.max())


def _gemm_row(
    check: str,
    k: int,
    y_emu: torch.Tensor,
    y_mm: torch.Tensor,
    exact: torch.Tensor,
    p: torch.Tensor,
    bad_codes: int,
) -> Row:
    bound, allowance = gemm_bounds(k)
    err = _normalized((y_mm.double() - y_emu.double()).abs(), p)
    err_emu = _normalized((y_emu.double() - exact).abs(), p)
    err_mm = _normalized((y_mm.double() - exact).abs(), p)
    measured = (
        f"max|mm - emu|/P = {err / U32:.1f}u (emu {err_emu / U32:.1f}u, mm {err_mm / U32:.1f}u "
        f"from exact); e4m3 codes differing from floatguard's: {bad_codes}"
    )
    expected = (
        f"<= (2K+6)u = {bound / U32:.0f}u, u = 2^-24 (WARN up to 2^-7 = {allowance / U32:.0f}u: "
        "a short FP8 accumulator); 0 codes"
    )
    if bad_codes or not err <= allowance:
        verdict: Verdict = "FAIL"
    else:
        verdict = "PASS" if err <= bound else "WARN"
    return Row(check, measured, expected, verdict)


# --------------------------------------------------------------------------- (d) memory
def snapshot_places() -> tuple[str, ...]:
    """The ``ResponsePolicy.snapshot_on`` places to measure: ("host", "device") where the
    policy has that field, none where it does not (this version keeps snapshots on the
    state's device)."""
    names = {f.name for f in dataclasses.fields(ResponsePolicy)}
    return ("host", "device") if "snapshot_on" in names else ()


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> int:
    """Bytes of the weights and the optimizer state on ``device``."""
    tensors = list(model.parameters()) + [
        t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)
    ]
    return sum(t.numel() * t.element_size() for t in tensors if t.device == device)


def _peak_of(backend: Backend, run: Callable[[], int]) -> tuple[int, int]:
    """(peak allocated bytes above what was allocated before, what ``run`` returns)."""
    if backend.kind != "cpu":  # free what cycles still hold (slow: ~0.3 s with torch loaded)
        gc.collect()
    backend.synchronize()
    backend.empty_cache()
    backend.reset_peak()
    base = backend.allocated_bytes()
    out = run()
    backend.synchronize()
    return backend.peak_bytes() - base, out


def memory_check(backend: Backend, sizes: Sizes, places: Sequence[str] | None = None) -> list[Row]:
    """(d) Peak allocated device memory of ``mem_steps`` fp32 steps of the last model:
    the ``clip_grad_norm_`` loop, then the guard with its defaults and with each of
    ``places`` (default: :func:`snapshot_places`)."""
    name, cfg, batch = sizes.models[-1]
    places = snapshot_places() if places is None else tuple(places)

    def run_peer() -> int:
        model, opt, x, y = _setup(backend, cfg, batch)
        for _ in range(sizes.mem_steps):
            _lm_loss(model, x, y).backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return state_bytes(model, opt, backend.device)

    def run_guard(response: ResponsePolicy | None) -> Callable[[], int]:
        def run() -> int:
            model, opt, x, y = _setup(backend, cfg, batch)
            guard = Guard(model, opt, response=response)
            for _ in range(sizes.mem_steps):
                guard.step(lambda: _lm_loss(model, x, y))
            guard.close()
            return state_bytes(model, opt, backend.device)

        return run

    peer_peak, state = _peak_of(backend, run_peer)
    # "auto" (the default, where the field exists) is host for accelerator state.
    default_place = "host" if places and backend.kind != "cpu" else "device"
    variants: list[tuple[str, str, ResponsePolicy | None]] = [("defaults", default_place, None)]
    for p in places:
        # by keyword from a dict: the field may not exist in this version (then no places)
        kwargs: dict[str, Any] = {"snapshot_on": p}
        variants.append((f'snapshot_on="{p}"', p, ResponsePolicy(**kwargs)))
    rows = []
    for label, place, response in variants:
        peak, _ = _peak_of(backend, run_guard(response))
        extra = peak - peer_peak
        share = extra / state if state else math.inf
        check = f"(d) guard's device memory, {name}, {label}"
        measured = (
            f"{extra / MiB:+.1f} MiB = {share:+.1%} of {state / MiB:.1f} MiB weights + AdamW "
            f"state (peak {peak / MiB:.1f} vs {peer_peak / MiB:.1f} MiB)"
        )
        if place == "host":
            ok = share <= HOST_SHARE_MAX
            expected = f"<= {HOST_SHARE_MAX:.0%} of the state (snapshots on the host)"
            rows.append(Row(check, measured, expected, "PASS" if ok else "FAIL"))
        else:
            expected = "about +100% of the state (a second copy on the device)"
            rows.append(Row(check, measured, expected, "INFO"))
    return rows


# ------------------------------------------------------------------------- (f) overlap
def overlap_check(backend: Backend, sizes: Sizes) -> list[Row]:
    """(f) A host snapshot at every step, without and with ``snapshot_overlap``, against
    the peer loop (bf16, the last model): the overlapped copy should cost less. Where the
    policy has no ``snapshot_overlap`` field: nothing to measure."""
    names = {f.name for f in dataclasses.fields(ResponsePolicy)}
    if "snapshot_overlap" not in names:
        return []
    name, cfg, batch = sizes.models[-1]
    guards, contenders = [], {"peer": peer(backend, cfg, batch, "bf16")}
    for overlap in (False, True):
        kwargs: dict[str, Any] = {
            "snapshot_every": 1, "snapshot_budget": None, "snapshot_on": "host",
            "snapshot_overlap": overlap,
        }  # fmt: skip
        step, g = guarded(backend, cfg, batch, "bf16", response=ResponsePolicy(**kwargs))
        contenders["overlap" if overlap else "after"] = step
        guards.append(g)
    med = time_rounds(backend, contenders, sizes.bench_steps, sizes.bench_rounds, sizes.warmup)
    for g in guards:
        g.close()
    ref = med["peer"]
    rows = []
    for key, label in (("after", "copy after the backward"), ("overlap", "snapshot_overlap")):
        ratio = med[key] / ref
        rows.append(
            Row(
                f"(f) {name}, bf16: host snapshot every step, {label} / autocast + clip",
                f"{ratio:.3f}x ({med[key] * 1e3:.2f} vs {ref * 1e3:.2f} ms/step)",
                "the overlapped copy costs less" if key == "overlap" else "no target",
                "INFO" if key == "after" or med["overlap"] <= med["after"] else "WARN",
            )
        )
    return rows


# ----------------------------------------------------------------------- (e) statistics
SPECIALS = [
    0.0, -0.0, 2.0**-149, -(2.0**-149), 2.0**-126, -(2.0**-126), 2.0**-24, 2.0**-14, 1.0,
    -1.0, 1 + 2.0**-23, 1 - 2.0**-24, 448.0, 57344.0, 65504.0, 3.4028234663852886e38,
    -3.4028234663852886e38, math.inf, -math.inf, math.nan,
]  # fmt: skip


def stats_mismatches(got: TensorStats, ref: TensorStats) -> list[str]:
    """The fields in which two TensorStats differ (exact; NaN never occurs in them)."""
    return [
        f.name
        for f in dataclasses.fields(TensorStats)
        if not torch.equal(getattr(got, f.name).cpu(), getattr(ref, f.name).cpu())
    ]


def _stats_inputs(numel: int) -> list[tuple[str, torch.Tensor]]:
    """The special values and a random tensor over ~80 binades, in fp32, bf16 and fp16."""
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(numel, generator=g) * torch.exp2(
        torch.randint(-40, 40, (numel,), generator=g).float()
    )
    spread[::97] = 0.0
    base = {"specials": torch.tensor(SPECIALS, dtype=torch.float32), "random": spread}
    return [
        (f"{name} {dtype}".replace("torch.", ""), t.to(dtype))
        for name, t in base.items()
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
    ]


def _param_of(model: nn.Module, module: str, role: str) -> torch.Tensor | None:
    """The parameter (or its gradient) a stats record of ``(module, "param:...")`` is of."""
    if not role.startswith("param:"):
        return None
    pname = role[len("param:") :]
    grad = pname.endswith(".grad")
    p = getattr(model.get_submodule(module), pname.removesuffix(".grad"), None)
    if not isinstance(p, torch.Tensor):
        return None
    return p.grad if grad else p


def _summary_of(st: TensorStats) -> dict[str, Any]:
    """The fields a ``stats`` event gives a tensor, from its TensorStats."""
    hist = st.hist.tolist()
    nz = [i for i, c in enumerate(hist) if c]
    lo, hi = (nz[0], nz[-1] + 1) if nz else (0, 0)
    return {
        "numel": int(st.numel),
        "amax": float(st.amax),
        "nonfinite": int(st.nan + st.posinf + st.neginf),
        "zeros": int(st.zeros),
        "hist_from": EXP_MIN + lo,
        "hist": [int(c) for c in hist[lo:hi]],
    }


def native_stats_check(backend: Backend, sizes: Sizes) -> list[Row]:
    """(e) The statistics on device tensors equal those of their CPU copies (read there by
    the one-pass C kernel); the stats monitor, ``Guard(watch="hooks")`` and
    ``Guard(stats_every=2)`` run on the device and agree with the CPU."""
    exact = "equal, field by field (exact functions of the bits: no tolerance)"
    rows = []
    # 1. tensor_stats, device against CPU
    bad = []
    inputs = _stats_inputs(sizes.stats_numel)
    for label, t in inputs:
        diff = stats_mismatches(tensor_stats(t.to(backend.device)), tensor_stats(t))
        if diff:
            bad.append(f"{label}: {', '.join(diff)}")
    rows.append(
        Row(
            "(e) tensor_stats on device = on the CPU copy (specials, random; fp32/bf16/fp16)",
            f"{len(inputs) - len(bad)} of {len(inputs)} equal" + (f"; {bad[:3]}" if bad else ""),
            exact,
            "FAIL" if bad else "PASS",
        )
    )
    # 2. the stats monitor's records of parameters and gradients
    name, cfg, batch = sizes.models[0]
    model, _, x, y = _setup(backend, cfg, batch)
    with Monitor(model, mode="stats") as mon:
        _lm_loss(model, x, y).backward()  # type: ignore[no-untyped-call]
    compared, bad = 0, []
    for (module, role), st in mon.stats.items():
        p = _param_of(model, module, role)
        if p is None:
            continue
        compared += 1
        diff = stats_mismatches(st, tensor_stats(p.detach().cpu()))
        if diff:
            bad.append(f"{module} {role}: {', '.join(diff)}")
    rows.append(
        Row(
            f'(e) Monitor(mode="stats") on device, {name}: params and grads = CPU',
            f"{compared - len(bad)} of {compared} equal" + (f"; {bad[:3]}" if bad else ""),
            exact,
            "FAIL" if bad or not compared else "PASS",
        )
    )
    # 3. Guard(watch="hooks"), bf16: the sentinel monitor on every step
    step, guard = guarded(backend, cfg, batch, "bf16", watch="hooks")
    applied = 0
    for _ in range(sizes.stats_steps):
        before = guard.good_steps
        step()
        applied += guard.good_steps - before
    guard.close()
    rows.append(
        Row(
            f'(e) Guard(watch="hooks"), {name}, bf16',
            f"{applied} of {sizes.stats_steps} steps applied",
            "every step applied",
            "PASS" if applied == sizes.stats_steps else "FAIL",
        )
    )
    # 4. Guard(stats_every=2), bf16: the stats events' parameter entries against the CPU
    rows.append(_guard_stats_row(backend, sizes, exact))
    return rows


def _guard_stats_row(backend: Backend, sizes: Sizes, exact: str) -> Row:
    name, cfg, batch = sizes.models[0]
    model, opt, x, y = _setup(backend, cfg, batch)
    guard = Guard(model, opt, precision="bf16", stats_every=2)
    params = {
        (mname, f"param:{pname}"): p
        for mname, mod in model.named_modules()
        for pname, p in mod.named_parameters(recurse=False)
    }
    before: dict[int, dict[tuple[str, str], dict[str, Any]]] = {}
    for _ in range(sizes.stats_steps):
        before[guard.step_count] = {
            key: _summary_of(tensor_stats(p.detach().cpu())) for key, p in params.items()
        }
        guard.step(lambda: _lm_loss(model, x, y))
    events = guard.events.of_kind("stats")
    guard.close()
    compared, bad = 0, []
    for ev in events:
        for entry in ev["tensors"]:
            ref = before.get(ev.step, {}).get((entry["module"], entry["role"]))
            if ref is None:
                continue
            compared += 1
            diff = [k for k, v in ref.items() if entry[k] != v]
            if diff:
                bad.append(f"step {ev.step} {entry['module']} {entry['role']}: {diff}")
    want = (sizes.stats_steps + 1) // 2
    return Row(
        f"(e) Guard(stats_every=2), {name}, bf16: stats events' parameters = CPU",
        f"{len(events)} events (want {want}), {compared - len(bad)} of {compared} entries equal"
        + (f"; {bad[:2]}" if bad else ""),
        exact,
        "PASS" if len(events) == want and compared and not bad else "FAIL",
    )


# ---------------------------------------------------------------------------- the table
Check = Callable[[Backend, Sizes], list[Row]]


# ----------------------------------------------------------------- (g) deferred mode
def fused_peer(backend: Backend, cfg: GPTConfig, batch: int, precision: str) -> Step:
    """The sync-free peer: ``GradScaler`` (fp16) with a *fused* AdamW, which takes the
    scaler's ``found_inf`` and skips on the device; ``clip_grad_norm_(1.0)`` (no read)."""
    model, _, x, y = _setup(backend, cfg, batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    return clip_step(model, opt, lambda: _lm_loss(model, x, y), backend.kind, dtype)


def no_sync_row(check: str, per_step: list[list[SyncCall]]) -> Row:
    """Expected: no synchronizing call in any counted step (the first one named)."""
    counts = [len(c) for c in per_step]
    first = next((c[0] for c in per_step if c), None)
    where = "" if first is None else f"; first: '{first.message}' at {first.site()}"
    return Row(check, f"{min(counts)}-{max(counts)} per step{where}", "0 per healthy step",
               "PASS" if max(counts) == 0 else "FAIL")  # fmt: skip


def error_mode_row(backend: Backend, check: str, step: Step, steps: int) -> Row:
    """``steps`` calls of ``step`` under ``set_sync_debug_mode("error")``: any sync raises."""
    error: str | None = None
    try:
        with backend.sync_debug("error"):
            for _ in range(steps):
                step()
    except RuntimeError as e:  # the sync debug mode's error
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return Row(check, "no error" if error is None else error, "no error",
               "PASS" if error is None else "FAIL")  # fmt: skip


def deferred_check(backend: Backend, sizes: Sizes) -> list[Row]:
    """(g) ``Guard(sync="deferred")`` (issue 43): the synchronizing calls per healthy step
    after warm-up (warn mode; expected 0: the verdict is on the device, the read posted
    to pinned memory), the same steps under ``set_sync_debug_mode("error")`` (any sync
    raises), and the step time against the GradScaler + fused AdamW loop and against
    the exact guard, per model and precision. Snapshots are set far apart: their steps
    run exactly, with one read each, by design."""
    rows: list[Row] = []
    far = ResponsePolicy(snapshot_every=10**6)
    for name, cfg, batch in sizes.models:
        for precision in ("bf16", "fp16"):
            step, guard = guarded(backend, cfg, batch, precision, sync="deferred", response=far)
            for _ in range(sizes.warmup):
                step()
            per_step = count_syncs(backend, step, sizes.sync_steps)
            rows.append(no_sync_row(f"(g) syncs per deferred step, {name}, {precision}", per_step))
            rows.append(error_mode_row(backend, f"(g) set_sync_debug_mode('error'), {name}, "
                                       f"{precision}", step, sizes.sync_steps))  # fmt: skip
            guard.close()
            exact, g_exact = guarded(backend, cfg, batch, precision)
            deferred, g_def = guarded(backend, cfg, batch, precision, sync="deferred")
            contenders = {"peer": fused_peer(backend, cfg, batch, precision), "exact": exact,
                          "deferred": deferred}  # fmt: skip
            med = time_rounds(
                backend, contenders, sizes.bench_steps, sizes.bench_rounds, sizes.warmup
            )
            g_exact.close()
            g_def.close()
            ref = med["peer"]
            for key in ("exact", "deferred"):
                rows.append(Row(
                    f"(g) {name}, {precision}: Guard(sync={key!r}) / GradScaler + fused AdamW",
                    f"{med[key] / ref:.3f}x ({med[key] * 1e3:.2f} vs {ref * 1e3:.2f} ms/step)",
                    "deferred <= exact (no target yet)", "INFO",
                ))  # fmt: skip
    return rows


def graph_check(backend: Backend, sizes: Sizes) -> list[Row]:
    """(h) ``Guard.graphed``: see ``benchmarks/_gpu_graph.py``."""
    import _gpu_graph

    rows: list[Row] = _gpu_graph.graph_check(backend, sizes, sys.modules[__name__])
    return rows


CHECKS: tuple[tuple[str, Check], ...] = (
    ("(a) syncs per step", sync_check),
    ("(b) overhead", overhead_check),
    ("(c) FP8 GEMM", fp8_gemm_check),
    ("(d) memory", memory_check),
    ("(e) native statistics", native_stats_check),
    ("(f) overlap", overlap_check),
    ("(g) deferred", deferred_check),
    ("(h) CUDA graphs", graph_check),
)


@dataclass
class Timer:
    seconds: dict[str, float] = field(default_factory=dict)


def run_checks(
    backend: Backend,
    sizes: Sizes,
    checks: Sequence[tuple[str, Check]] = CHECKS,
    timer: Timer | None = None,
) -> list[Row]:
    """Every check's rows, in order; a check that raises is one FAIL row naming the
    exception and where it was raised, and the others still run."""
    rows: list[Row] = []
    for name, check in checks:
        print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            rows += check(backend, sizes)
        except Exception as e:
            where = traceback.extract_tb(e.__traceback__)[-1]
            rows.append(
                Row(
                    name,
                    f"raised {type(e).__name__}: {str(e)[:200]} at "
                    f"{_short(where.filename)}:{where.lineno}",
                    "runs",
                    "FAIL",
                )
            )
        if timer is not None:
            timer.seconds[name] = time.perf_counter() - start
    return rows


def render(rows: Sequence[Row]) -> str:
    """The markdown table (a ``|`` inside a cell is escaped)."""

    def cell(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")

    lines = ["| check | measured | expected | verdict |", "|---|---|---|---|"]
    lines += [
        f"| {cell(r.check)} | {cell(r.measured)} | {cell(r.expected)} | {r.verdict} |" for r in rows
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the same models, fewer steps")
    size.add_argument("--tiny", action="store_true", help="two tiny GPTs (the CPU test's size)")
    parser.add_argument(
        "--device", default="cuda", help="the CUDA device (cpu only under the CPU test's mocks)"
    )
    args = parser.parse_args(argv)
    backend = Backend(args.device)
    if not backend.available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__}); nothing checked")
        return 0
    sizes = Sizes.tiny() if args.tiny else Sizes.quick() if args.quick else Sizes.full()
    timer = Timer()
    start = time.perf_counter()
    rows = run_checks(backend, sizes, timer=timer)
    took = ", ".join(f"{k.split()[0]} {v:.0f} s" for k, v in timer.seconds.items())
    print(
        f"# GPU check: {backend.describe()}, torch {torch.__version__}, "
        f"{time.perf_counter() - start:.0f} s ({took})\n"
    )
    print(render(rows))
    return 1 if any(r.verdict == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
