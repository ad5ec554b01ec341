"""The demo run: a tiny GPT learns a synthetic task while a fault schedule hits it.

The task: sequences of an arithmetic progression mod 32 (random start and stride);
after two tokens the next one is determined, so a model that learned it predicts
positions 2.. almost perfectly (the accuracy printed). The faults, at fixed fractions
of the run:

- ``corrupt_batch``: a batch whose per-token loss weights hold a NaN (a corrupted
  loss mask, as a broken data pipeline makes it);
- ``bit_flip``: the exponent's top bit of one weight flips (a 0.02 becomes ~1e37);
- ``masked_row``: a batch whose first token is padding, so with the causal mask its
  row of attention sees no key at all (softmax of all -inf: NaN);
- ``lr_spike``: the learning rate is 300x for one step, and the weights it writes
  make the loss spike;
- ``fp16_overflow``: one batch's loss is scaled 1e6 (a loss term that blows up), so
  its scaled gradients overflow fp16.

With the guard each one is found, localized and answered; without it (``guarded=
False``: the usual GradScaler loop) the run dies of the first fault it cannot skip.

The schedule (:func:`schedule_for`) keeps every fault at its own step, at least
``FAULT_GAP`` apart, after ``WARMUP`` clean steps and before the last step, for any
``steps`` in ``MIN_STEPS..MAX_STEPS``: a short run pushes the faults later and closer
together, a long one keeps the fractions.
"""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from floatguard.demo.model import GPT, GPTConfig, synthetic_batch
from floatguard.events import EventLog
from floatguard.guard import Guard, StepResult
from floatguard.stability.clip import ZClipConfig
from floatguard.stability.respond import ClipPolicy, ResponsePolicy, SpikePolicy

__all__ = ["DEMO", "FAULTS", "MAX_STEPS", "MIN_STEPS", "DemoResult", "run_demo", "schedule_for"]

DEMO = GPTConfig(vocab_size=32, block_size=24, n_layer=2, n_head=2, n_embd=64, attention="explicit")
"""The demo's GPT: 2 layers, d=64, T=24, hand-written attention."""

# fault -> fraction of the run at which it strikes
FAULTS: dict[str, float] = {
    "corrupt_batch": 0.15,
    "bit_flip": 0.30,
    "masked_row": 0.45,
    "lr_spike": 0.60,
    "fp16_overflow": 0.75,
}
# Clean steps before the first fault: the spike detector's warm-up (its baseline of
# losses) and the guard's first snapshots, so that each fault has something to be
# measured against and a state to roll back to.
WARMUP = 10
FAULT_GAP = 2  # steps between two faults at least: each one's answer is its own step
MIN_STEPS = WARMUP + FAULT_GAP * (len(FAULTS) - 1) + 2  # 20: room for all five, and one after
MAX_STEPS = 1_000_000  # a demo, not a training job: some hours on a CPU already
MAX_SEED = 2**63 - 1  # torch.manual_seed takes a 64-bit integer
Precision = Literal["fp32", "bf16", "fp16"]
# The absolute cap on the gradient norm (ZClip's max_grad_norm; the unguarded loop's
# clip_grad_norm_), set from this model's own norms. ZClip's default of 1.0, the usual
# LLM cap, sits below the demo GPT's healthy norm (mean cross-entropy over 32 tokens):
# on the default run (400 steps, fp16, seed 0) it clipped 382 of 390 applied steps
# (median norm 2.08), so the cap, not ZClip's z-score, set every update, and the demo's
# own diagnosis said so (clipped_most_steps). Measured without a cap on the same run
# with no faults: median 1.75, 99th percentile 3.81, largest 5.04 (the first 25 steps,
# ZClip's warm-up, 1.09 to 3.66). 10.0, about twice the largest healthy norm, is a
# backstop against an absurd gradient (in ZClip's warm-up above all, when its z-score
# does not clip): the default run with faults (largest applied norm 5.97) has no step
# clipped to it, and 11 clipped by the z-score alone.
MAX_GRAD_NORM = 10.0
# where each fault is expected to be found (module, phase), for the demo's checks
EXPECTED: dict[str, tuple[str, str]] = {
    "corrupt_batch": ("", "input"),
    "bit_flip": ("blocks.1.mlp.fc", "param"),
    "masked_row": ("blocks.0.attn", "forward"),
}


@dataclass
class DemoResult:
    """What the demo run did: per step, the loss and what happened; the faults."""

    guarded: bool
    steps: int
    schedule: dict[str, int]
    """fault -> the step it strikes at"""
    accuracy: float
    final_loss: float
    finite: bool
    died_at: int | None
    seconds: float
    events_path: Path | None
    results: list[StepResult] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    log_error: str | None = None
    """Why the event log could not be written (a full or read-only disk): the run
    stopped at the step that failed (``len(losses)`` steps ran); None when it was."""


def _flip_exponent_msb(w: torch.Tensor) -> tuple[int, float, float]:
    """Flip bit 30 (the exponent's top bit) of the largest weight; (index, before, after)."""
    flat = w.detach().view(-1)
    i = int(flat.abs().argmax())
    before = float(flat[i])
    bits = struct.unpack("<I", struct.pack("<f", before))[0] ^ (1 << 30)
    after = struct.unpack("<f", struct.pack("<I", bits))[0]
    with torch.no_grad():
        flat[i] = after
    return i, before, after


def _accuracy(model: GPT, cfg: GPTConfig, seed: int) -> float:
    x, y = synthetic_batch(cfg, 256, generator=torch.Generator().manual_seed(seed + 12345))
    with torch.no_grad():
        pred = model(x).argmax(-1)
    return float((pred[:, 2:] == y[:, 2:]).float().mean())


def schedule_for(steps: int, faults: list[str]) -> dict[str, int]:
    """fault -> step for a run of ``steps`` (``MIN_STEPS..MAX_STEPS``), in FAULTS' order.

    Each fault strikes at its fraction of the run, but never before ``WARMUP`` and at
    least ``FAULT_GAP`` steps after the one before; the same steps whichever subset of
    faults is chosen. 400 steps: 60, 120, 180, 240, 300; 20 steps: 10, 12, 14, 16, 18.
    """
    _check_steps(steps)
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        raise ValueError(f"unknown fault {unknown[0]!r}; known: {', '.join(FAULTS)}")
    at: dict[str, int] = {}
    earliest = WARMUP
    for name, fraction in sorted(FAULTS.items(), key=lambda kv: kv[1]):
        at[name] = max(int(fraction * steps), earliest)
        earliest = at[name] + FAULT_GAP
    # MIN_STEPS leaves the last fault one step after it at least (the fractions are
    # <= 0.75, so only the pushed-back short runs come near the end)
    assert max(at.values()) <= steps - 2, (steps, at)
    return {f: at[f] for f in FAULTS if f in faults}


def _check_steps(steps: int) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or not MIN_STEPS <= steps <= MAX_STEPS:
        raise ValueError(
            f"steps={steps!r} must be an int in {MIN_STEPS}..{MAX_STEPS:,} (the schedule "
            f"needs {MIN_STEPS} steps; a longer demo is a training job)"
        )


def run_demo(
    *,
    steps: int = 400,
    precision: Precision = "fp16",
    faults: list[str] | None = None,
    seed: int = 0,
    guarded: bool = True,
    log: str | Path | None = None,
    on_step: Callable[[int, StepResult | None, float], None] | None = None,
    on_event: Callable[[Any], None] | None = None,
) -> DemoResult:
    """Train the demo GPT for ``steps`` under the fault schedule; see the module.

    A log that cannot be written (a full disk) stops the run at that step, with
    ``log_error`` saying why: a demo's log is its product."""
    _check_steps(steps)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed={seed!r} must be an int in 0..{MAX_SEED} (2**63 - 1)")
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision={precision!r}; use 'fp16', 'bf16' or 'fp32'")
    schedule = schedule_for(steps, list(FAULTS) if faults is None else faults)
    at = {v: k for k, v in schedule.items()}
    cfg = DEMO
    torch.manual_seed(seed)
    model = GPT(cfg)
    lr = 3e-3
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    guard = None
    if guarded:
        guard = Guard(
            model, opt, precision=precision, log=log,
            clip=ClipPolicy(zclip=ZClipConfig(max_grad_norm=MAX_GRAD_NORM)),
            spikes=SpikePolicy(window=30, z=8.0, warmup=WARMUP),
            response=ResponsePolicy(rollback_after=4),
            stats_every=max(2, steps // 20),  # per-layer statistics on 20 steps of the run
        )  # fmt: skip
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16") if not guarded else None
    plain_log = EventLog(log if not guarded else None, keep=0)  # the unguarded run's steps
    if on_event is not None:
        (guard.events if guard is not None else plain_log).subscribe(on_event)
    result = DemoResult(guarded, steps, schedule, 0.0, math.nan, True, None, 0.0, None)
    start = time.perf_counter()
    for step in range(steps):
        x, y = synthetic_batch(cfg, 16, generator=gen)
        weights = torch.ones(y.shape)
        pad: torch.Tensor | None = None
        fault = at.get(step)
        scale = 1.0
        if fault == "corrupt_batch":
            weights[3, 5] = math.nan
        elif fault == "bit_flip":
            fc = model.get_submodule("blocks.1.mlp.fc")
            assert isinstance(fc, torch.nn.Linear)
            _flip_exponent_msb(fc.weight)
        elif fault == "masked_row":
            pad = torch.zeros(y.shape, dtype=torch.bool)
            pad[0, 0] = True  # token 0 of sequence 0 is padding: row 0 sees no key
        elif fault == "lr_spike":
            for g in opt.param_groups:
                g["lr"] = lr * 300
        elif fault == "fp16_overflow":
            scale = 1e6

        def closure(
            x: torch.Tensor = x, y: torch.Tensor = y, w: torch.Tensor = weights,
            pad: torch.Tensor | None = pad, scale: float = scale,
        ) -> torch.Tensor:  # fmt: skip
            logits = model(x, pad).float()
            per_token = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1),
                                        reduction="none")  # fmt: skip
            return (per_token * w.reshape(-1)).sum() / w.sum() * scale

        r: StepResult | None = None
        if guard is not None:
            r = guard.step(closure)
            loss = r.loss
            result.results.append(r)
        else:
            scale_before = scaler.get_scale() if scaler is not None and scaler.is_enabled() else 1.0
            loss, norm = _plain_step(model, opt, scaler, closure, precision)
            scale_after = scaler.get_scale() if scaler is not None and scaler.is_enabled() else 1.0
            # GradScaler skips a step whose gradients hold an inf or NaN: it halves the
            # scale then, until the scale itself reaches 0 (a dead run's steps)
            skipped = scale_after < scale_before or not math.isfinite(norm)
            plain_log.emit(
                "step", step, action="skipped" if skipped else "applied",
                reason="overflow" if skipped else None, loss=loss, grad_norm=norm,
                clip_coef=min(1.0, MAX_GRAD_NORM / (norm + 1e-6)) if math.isfinite(norm) else 1.0,
                scale=scale_before, lr_factor=1.0, lr=opt.param_groups[0]["lr"],
            )  # fmt: skip
        if fault == "lr_spike":
            for g in opt.param_groups:
                g["lr"] = lr
        result.losses.append(loss)
        if not guarded and result.died_at is None and not math.isfinite(loss) and _dead(model):
            result.died_at = step  # a non-finite loss from a weight no step can heal
        if on_step is not None:
            on_step(step, r, loss)
        result.log_error = (guard.events if guard is not None else plain_log).write_error
        if result.log_error is not None:
            break
    result.seconds = time.perf_counter() - start
    result.finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    result.accuracy = _accuracy(model, cfg, seed) if result.finite else 0.0
    # the last 20 steps no fault hit: fp16_overflow's loss is scaled 1e6 on purpose
    last = range(max(0, len(result.losses) - 20), len(result.losses))
    tail = [result.losses[i] for i in last if i not in at and math.isfinite(result.losses[i])]
    result.final_loss = sum(tail) / len(tail) if tail else math.nan
    if guard is not None:
        guard.close()
    plain_log.close()
    result.events_path = Path(log) if log is not None else None
    return result


def _dead(model: GPT) -> bool:
    """A model no step can heal: a weight that is not finite (or past fp16's range)."""
    return any(not bool((p.abs() <= 65504).all()) for p in model.parameters())


def _plain_step(
    model: GPT,
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    closure: Callable[[], torch.Tensor],
    precision: Precision,
) -> tuple[float, float]:
    """The usual loop: autocast, GradScaler (fp16), clip_grad_norm_, step; (loss, norm)."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = closure()
    opt.zero_grad(set_to_none=True)
    if scaler is not None and scaler.is_enabled():
        scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()  # type: ignore[no-untyped-call]
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        opt.step()
    return float(loss.detach()), float(norm)
