"""Runs as the guard logs them, built event by event through ``EventLog.emit`` (so each
event has exactly its kind's fields): the situations of issue 36 that the diagnosis
and the verdict must tell apart."""

from __future__ import annotations

import math
from typing import Any

from floatguard.events import Event, EventLog

FINGERPRINT = "0123456789abcdef"


class Run:
    """A run's event log, written step by step."""

    def __init__(
        self,
        dtypes: tuple[str, ...] = ("float32",),
        precision: str = "fp32",
        norm_measured: str | None = "before_clip",
    ) -> None:
        self.log = EventLog(keep=1_000_000)
        clip: dict[str, Any] = {"kind": "zclip", "max_norm": None, "z_thresh": 2.5}
        if norm_measured is not None:
            clip["norm_measured"] = norm_measured
        self.log.emit("run", 0, precision=precision, loss_scaling=False,
                      param_dtypes=list(dtypes), optimizer="AdamW", world_size=1,
                      clip=clip)  # fmt: skip

    def step(
        self, i: int, loss: float, *, action: str = "applied", reason: str | None = None,
        grad_norm: float = 1.0, lr: float | None = 1e-3, lr_factor: float = 1.0,
    ) -> None:  # fmt: skip
        self.log.emit("step", i, action=action, reason=reason, loss=loss, grad_norm=grad_norm,
                      clip_coef=1.0, scale=None, lr_factor=lr_factor,
                      lr=None if lr is None else lr * lr_factor)  # fmt: skip

    def emit(self, kind: str, step: int, **fields: Any) -> None:
        self.log.emit(kind, step, **fields)

    def spike(
        self, step: int, value: float, reproduced: bool | None = True,
        fingerprint: str | None = None,
    ) -> None:  # fmt: skip
        self.emit("spike", step, signal="loss", value=value, reproduced=reproduced,
                  batch=batch(step, fingerprint or f"{step:016x}"))  # fmt: skip

    def warning(self, step: int, code: str, evidence: dict[str, Any], message: str = "") -> None:
        self.emit("warning", step, transients=None, message=message or code, code=code,
                  evidence=evidence)  # fmt: skip

    def end(self, step: int, nonfinite: list[str] | None = None, lr_factor: float = 1.0) -> None:
        bad = nonfinite or []
        self.emit("end", step, state_finite=not bad, nonfinite=bad, lr_factor=lr_factor,
                  lr=1e-3 * lr_factor, scale=None)  # fmt: skip

    @property
    def events(self) -> list[Event]:
        return self.log.events


def batch(position: int, fingerprint: str = FINGERPRINT) -> dict[str, Any]:
    return {"position": position, "micro_batches": 1, "fingerprint": fingerprint,
            "shapes": [[8, 16]]}  # fmt: skip


def wiggle(i: int, level: float) -> float:
    """A loss at ``level`` with a small deterministic wiggle (medians stay at it)."""
    return level * (1.0 + 0.01 * math.sin(1.7 * i))


def param_fault(run: Run, step: int, op: str, cause: str, tensor: str = "param:weight",
                module: str = "emb") -> None:  # fmt: skip
    run.emit("fault", step, phase="param", module=module, tensor=tensor, kind_of_value="nan",
             shape=[100, 16], op=op, source="non-finite since the last check at step 40",
             deterministic=None, stats=None, fault_rank=None, cause=cause, input_amax=None,
             batch=None)  # fmt: skip


# ------------------------------------------------------------------- the situations
def clean(n: int = 100, end: bool = True) -> list[Event]:
    run = Run()
    for i in range(n):
        run.step(i, wiggle(i, 2.0 - 0.005 * i))
    if end:
        run.end(n)
    return run.events


def corrupt_batch() -> list[Event]:
    """One batch with shuffled labels and inputs x20 at step 50: one spike, skipped; the
    loss is back at once and no spike follows."""
    run = Run()
    for i in range(120):
        if i == 50:
            run.spike(50, 11.0, fingerprint=FINGERPRINT)
            run.step(50, 11.0, action="skipped", reason="loss_spike")
        else:
            run.step(i, wiggle(i, 2.0))
    run.end(120)
    return run.events


def lr_x40() -> list[Event]:
    """The LR x40 from step 60 on: spikes at 61, 62 (a rollback, 8 batches skipped after
    it), 78, 79, 90; LR back-offs; the loss ends 4.1x its level before, factor 0.34."""
    run = Run()
    factor = 1.0
    for i in range(100):
        lr = 1e-3 if i < 60 else 4e-2
        if i in (61, 62, 78, 79, 90):
            run.spike(i, 12.0)
            run.step(i, 12.0, action="skipped", reason="loss_spike", lr=lr, lr_factor=factor)
            if i == 62:
                run.emit("rollback", 62, to_step=55, rollbacks=1, skip_batches=8, cause=None)
                factor = 0.5
                run.emit("lr_backoff", 62, factor=factor)
            if i == 79:
                factor = 0.25
                run.emit("lr_backoff", 79, factor=factor)
            continue
        if 63 <= i <= 70:
            run.step(i, 3.0, action="skipped", reason="after_rollback", lr=lr, lr_factor=factor)
            continue
        if i > 79:
            factor = min(0.34, factor + 0.01)
        level = 1.0 if i <= 60 else 2.0 + 0.3 * (i - 70) if i < 77 else 4.1
        run.step(i, wiggle(i, level), lr=lr, lr_factor=factor)
    run.end(100, lr_factor=factor)
    return run.events


def burst() -> list[Event]:
    """One update too large (the LR x300 for step 120 only): spikes on four batches in a
    row, a rollback, then none; the loss back (the demo's lr_spike)."""
    run = Run()
    for i in range(200):
        lr = 0.3 if i == 120 else 1e-3
        if 124 <= i <= 127:
            run.spike(i, 23.5)
            run.step(i, 23.5, action="skipped", reason="loss_spike", lr=lr)
        else:
            run.step(i, wiggle(i, 2.0), lr=lr)
    run.emit("rollback", 127, to_step=118, rollbacks=1, skip_batches=0, cause=None)
    run.end(200)
    return run.events


_CREEP_MEANS = (4.63, 0.72, 0.99, 1.36, 1.71, 2.41)  # mean loss per 50 steps (issue 36)


def trend_evidence(lr: tuple[float, float] | None, jump: float | None = None) -> dict[str, Any]:
    """A loss_trend warning's evidence as TrendAlarm.evidence() writes it (the best
    window 50-99, the rise from step 100, the last four windows)."""
    ends = [149, 199, 249, 299]
    return {
        "signal": "loss", "step": 299, "ratio": 3.35, "best_start": 50, "best_end": 99,
        "best_value": 0.72, "window_starts": [e - 49 for e in ends], "window_ends": ends,
        "window_values": list(_CREEP_MEANS[2:]), "slope_per_step": 0.0069,
        "slope_per_window": 0.34, "rise_start": 100, "rise_windows": 4, "loss_ratio": 3.35,
        "lr_best": None if lr is None else lr[0], "lr_rise": None if lr is None else lr[1],
        "lr_jump": jump, "lr_jump_step": None if jump is None else 100, "scale_best": None,
        "scale_rise": None, "again_after": None,
        "lr_ratio": None if lr is None else lr[1] / lr[0], "scale_ratio": None,
        "message": "loss rising since step 100",
    }  # fmt: skip


def lr_creep(changed: bool = True) -> list[Event]:
    """The LR creeping from 1e-3 to 0.3 over 300 steps; the loss per 50 steps as in the
    issue; a loss_trend warning at step 299 (``changed``: with the trend's own LR
    evidence; else the diagnosis reads the steps' LR)."""
    run = Run()
    for i in range(300):
        lr = 1e-3 * 300 ** (i / 299)
        run.step(i, wiggle(i, _CREEP_MEANS[i // 50]), lr=lr)
    lrs = (1e-3 * 300 ** (75 / 299), 1e-3 * 300 ** (125 / 299))  # best window, rise's first
    run.warning(299, "loss_trend", trend_evidence(lrs if changed else None))
    run.end(300)
    return run.events


def label_noise() -> list[Event]:
    """The LR constant at 1e-3; labels growing noisy from step 100: the loss rises."""
    run = Run()
    means = (2.3, 0.72, 0.99, 1.36, 1.71, 2.41)
    for i in range(300):
        run.step(i, wiggle(i, means[i // 50]))
    run.warning(299, "loss_trend", trend_evidence((1e-3, 1e-3)))
    run.end(300)
    return run.events


def nan_buffer(rolled_back: bool) -> list[Event]:
    """BatchNorm's running_var[3] = nan at step 7: the training loss stays finite. The
    guard rolls back (``rolled_back``), or (an older guard) the run ends with it."""
    run = Run()
    for i in range(20):
        if rolled_back and i == 7:
            param_fault(run, 7, "parameter", "nonfinite_buffer", tensor="buffer:bn.running_var",
                        module="bn")  # fmt: skip
            run.step(7, wiggle(7, 1.0), action="rolled_back", reason="nonfinite_buffer")
            run.emit("rollback", 7, to_step=5, rollbacks=1, skip_batches=0,
                     cause="param:bn:buffer:bn.running_var")  # fmt: skip
            continue
        run.step(i, wiggle(i, 1.0))
    if rolled_back:
        run.end(20)
    else:
        run.warning(20, "nonfinite_buffer", {"buffers": ["bn.running_var"]})
        run.end(20, nonfinite=["buffer:bn.running_var"])
    return run.events


STALLED = {
    "layers": [
        {"name": "fc1.weight", "dtype": "bfloat16", "fraction": 0.81, "numel": 4096},
        {"name": "fc2.weight", "dtype": "bfloat16", "fraction": 0.74, "numel": 1024},
    ],
    "fraction": 0.78, "window": [10, 150], "samples": 5, "lr": 1e-4,
}  # fmt: skip


def stalled() -> list[Event]:
    """model.to(torch.bfloat16) + AdamW at lr 1e-4: most updates rounded away."""
    run = Run(dtypes=("bfloat16",))
    for i in range(151):
        run.step(i, wiggle(i, 2.0 + 0.001 * i), lr=1e-4)
    run.warning(150, "stalled_updates", STALLED)
    run.end(151)
    return run.events


def memorized() -> list[Event]:
    """A memorized cross-entropy: the loss reaches exactly 0, and so does the gradient."""
    run = Run()
    for i in range(60):
        done = i >= 40
        run.step(i, 0.0 if done else 2.0 * (1 - i / 40), grad_norm=0.0 if done else 1.0)
    run.end(60)
    return run.events


def weight_fault(op: str, dtypes: tuple[str, ...] = ("float32",)) -> list[Event]:
    """A NaN row in emb.weight found at step 45 by the given check (``op``)."""
    run = Run(dtypes=dtypes)
    cause = "nonfinite_param" if op == "outside" else "optimizer_update"
    for i in range(60):
        if i == 45:
            param_fault(run, 45, op, cause)
            run.step(45, wiggle(45, 1.0), action="rolled_back", reason=cause)
            continue
        run.step(i, wiggle(i, 1.0))
    run.end(60)
    return run.events
