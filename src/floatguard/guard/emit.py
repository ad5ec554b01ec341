"""The guard's typed emitters: every event a step writes, in one place."""

from __future__ import annotations

from typing import Any

import torch

from floatguard.events import EventLog
from floatguard.guard.types import StepResult
from floatguard.monitor.localize import Fault
from floatguard.stability.respond import ClipPolicy
from floatguard.stats import TensorStats

__all__ = ["GuardEvents", "clip_fields", "input_amax", "stats_fields"]

_STATS = ("numel", "nan", "posinf", "neginf", "zeros", "amax", "min", "max")


def clip_fields(clip: ClipPolicy) -> dict[str, Any]:
    """The clipping a run uses, for its ``run`` event: the kind and the absolute cap on
    the gradient norm (``max_norm``: ClipPolicy.max_norm, or ZClip's max_grad_norm; None:
    no cap), and ZClip's z threshold."""
    if clip.kind == "zclip":
        return {"kind": "zclip", "max_norm": clip.zclip.max_grad_norm,
                "z_thresh": clip.zclip.z_thresh}  # fmt: skip
    if clip.kind == "norm":
        return {"kind": "norm", "max_norm": clip.max_norm, "z_thresh": None}
    return {"kind": clip.kind, "max_norm": None, "z_thresh": None}


def input_amax(inputs: tuple[TensorStats, ...]) -> float | None:
    """The largest finite magnitude among a birth's op inputs (one read; bad steps only),
    or None when the fault has no input statistics."""
    if not inputs:
        return None
    return float(torch.stack([s.amax.double().reshape(()) for s in inputs]).max().cpu())


def stats_fields(stats: TensorStats | None) -> dict[str, Any] | None:
    """A birth's statistics for the event stream: counts and finite extremes (one read;
    bad steps only)."""
    if stats is None:
        return None
    parts = [getattr(stats, name).double() for name in _STATS]
    values = torch.stack(parts).cpu().tolist()
    return {
        n: (int(v) if i < 5 else v) for i, (n, v) in enumerate(zip(_STATS, values, strict=True))
    }


class GuardEvents:
    """Writes the guard's events to ``log`` (the :class:`EventLog` stays public as
    ``guard.events``); one method per kind, keyword fields only."""

    def __init__(self, log: EventLog) -> None:
        self.log = log

    def run(
        self,
        precision: str,
        loss_scaling: bool,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        process_group: Any,
        clip: ClipPolicy,
        norm_measured: str = "before_clip",
    ) -> None:
        """What the run computes in, for the diagnosis: autocast precision, loss scaling,
        the parameters' dtypes (16-bit weights: no fp32 master copy), the optimizer, and
        the clipping (its absolute cap: the report tells cap clipping from ZClip's)."""
        import torch.distributed as dist

        world = (
            dist.get_world_size(process_group)
            if dist.is_available() and dist.is_initialized()
            else 1
        )
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
        self.log.emit(
            "run",
            0,
            precision=precision,
            loss_scaling=bool(loss_scaling),
            param_dtypes=dtypes,
            optimizer=type(optimizer).__name__,
            world_size=int(world),
            clip={**clip_fields(clip), "norm_measured": norm_measured},
        )

    def step(self, result: StepResult) -> None:
        self.log.emit(
            "step",
            result.step,
            action=result.action,
            reason=result.reason,
            loss=result.loss,
            grad_norm=result.grad_norm,
            clip_coef=result.clip_coef,
            scale=result.scale,
            lr_factor=result.lr_factor,
            lr=result.lr,
        )

    def fault(
        self, step: int, fault: Fault, cause: str | None, batch: dict[str, Any] | None = None
    ) -> None:
        self.log.emit(
            "fault",
            step,
            phase=fault.phase,
            module=fault.module,
            tensor=fault.tensor,
            kind_of_value=fault.kind,
            shape=list(fault.shape),
            op=fault.op,
            source=fault.source,
            deterministic=fault.deterministic,
            stats=stats_fields(fault.stats),
            fault_rank=fault.rank,
            cause=cause,
            input_amax=input_amax(fault.inputs),
            batch=batch,
        )

    def overflow(self, step: int, scale_before: float, scale_after: float) -> None:
        self.log.emit("overflow", step, scale_before=scale_before, scale_after=scale_after)

    def spike(
        self,
        step: int,
        signal: str,
        value: float,
        reproduced: bool | None,
        batch: dict[str, Any] | None = None,
    ) -> None:
        self.log.emit("spike", step, signal=signal, value=value, reproduced=reproduced, batch=batch)

    def lr_backoff(self, step: int, factor: float) -> None:
        self.log.emit("lr_backoff", step, factor=factor)

    def rollback(
        self, step: int, to_step: int, rollbacks: int, skip_batches: int, fault: Fault | None
    ) -> None:
        cause = None if fault is None else f"{fault.phase}:{fault.module}:{fault.tensor}"
        self.log.emit(
            "rollback",
            step,
            to_step=to_step,
            rollbacks=rollbacks,
            skip_batches=skip_batches,
            cause=cause,
        )

    def snapshot(self, step: int, where: str, freed: str | None = None) -> None:
        """``freed``: the older snapshot removed because the disk had no room for it."""
        self.log.emit("snapshot", step, where=where, freed=freed)

    def snapshot_error(self, step: int, where: str, error: str, policy: str) -> None:
        self.log.emit("snapshot_error", step, where=where, error=error, policy=policy)

    def snapshot_fallback(self, step: int, bad: str, error: str, used: str) -> None:
        self.log.emit("snapshot_fallback", step, bad=bad, error=error, used=used)

    def resume(
        self,
        step: int,
        path: str,
        newest: int | None = None,
        behind: list[int] | None = None,
        written_world_size: int | None = None,
        run_id: str | None = None,
    ) -> None:
        self.log.emit(
            "resume",
            step,
            from_step=step,
            path=path,
            newest_step=newest,
            ranks_behind=behind,
            written_world_size=written_world_size,
            run_id=run_id,
        )

    def warning(
        self,
        step: int,
        message: str,
        transients: int | None = None,
        *,
        code: str | None = None,
        evidence: dict[str, Any] | None = None,
    ) -> None:
        """A warning: ``code`` names its kind for the diagnosis ("transients",
        "stalled_updates", "loss_trend", "grad_norm_trend", "nonfinite_buffer", ...),
        ``evidence`` the numbers behind it."""
        self.log.emit(
            "warning", step, transients=transients, message=message, code=code, evidence=evidence
        )

    def end(
        self,
        step: int,
        state_finite: bool | None,
        nonfinite: list[str],
        lr_factor: float,
        lr: float | None,
        scale: float | None,
    ) -> None:
        """How the run ended: whether the weights, optimizer state and floating buffers
        were all finite (one read at close), which were not, the LR factor, LR, scale.
        A non-finite buffer is also a warning (a run never ends with one unsaid)."""
        buffers = [n.removeprefix("buffer:") for n in nonfinite if n.startswith("buffer:")]
        if buffers:
            self.warning(
                step,
                f"the run ends with non-finite buffer(s) {', '.join(buffers[:5])}: "
                "evaluation with them gives NaN; restore a snapshot or recompute them",
                code="nonfinite_buffer",
                evidence={"buffers": buffers},
            )
        self.log.emit(
            "end",
            step,
            state_finite=state_finite,
            nonfinite=nonfinite,
            lr_factor=lr_factor,
            lr=lr,
            scale=scale,
        )

    def repro(
        self,
        step: int,
        path: str,
        level: str,
        size: int,
        seconds: float,
        summary: dict[str, Any],
    ) -> None:
        """A repro bundle was written: where, at which level, its size and write time,
        how many ops its tape holds, whether the guard's own replay gave the fault again."""
        self.log.emit(
            "repro",
            step,
            path=path,
            level=level,
            bytes=size,
            seconds=seconds,
            tape_ops=summary.get("tape_ops"),
            reproduced=summary.get("reproduced_in_guard"),
        )

    def stats(self, step: int, tensors: list[dict[str, Any]]) -> None:
        self.log.emit("stats", step, tensors=tensors)

    def stop(self, step: int, reason: str, fault: str | None) -> None:
        self.log.emit("stop", step, reason=reason, fault=fault)

    def count(self) -> int:
        """How many events were written (all kinds, not only the in-memory tail)."""
        return sum(self.log.counts.values())
