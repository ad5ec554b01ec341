"""The Lightning callback: a tiny LightningModule on CPU, a NaN batch, a NaN weight and a
loss spike, with and without gradient accumulation; skipped steps leave the optimizer
state untouched; the guard's state goes through a Lightning checkpoint; a replay logs
nothing (the user's self.log goes on); floatguard/loss is the mean micro-batch loss as
training_step returned it (not divided by accumulate_grad_batches, nor multiplied by a
GradScaler's scale)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from floatguard.events import read_events  # noqa: E402
from floatguard.integrations.lightning import FloatguardCallback  # noqa: E402
from floatguard.stability.respond import ResponsePolicy, SpikePolicy  # noqa: E402

NAN_BATCH, SPIKE, NAN_WEIGHT = 6, 10, 14  # optimizer steps


class Module(pl.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        x, y = batch
        return ((self.net(x) - y) ** 2).mean()

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _data(accum: int) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(1)
    n = 20 * accum
    x, y = torch.randn(n, 8, 4, generator=g), torch.randn(n, 8, 1, generator=g)
    x[NAN_BATCH * accum, 2, 1] = math.nan  # one micro-batch of that step
    x[SPIKE * accum : (SPIKE + 1) * accum] *= 60.0
    y[SPIKE * accum : (SPIKE + 1) * accum] += 80.0
    return torch.utils.data.DataLoader(list(zip(x, y, strict=True)), batch_size=None,
                                       shuffle=False)  # fmt: skip


class Probe(pl.Callback):  # type: ignore[misc]
    def __init__(self, accum: int) -> None:
        self.accum = accum
        self.before: dict[int, Any] = {}
        self.after: dict[int, Any] = {}

    def _opt(self, trainer: Any) -> list[torch.Tensor]:
        st = trainer.optimizers[0].state_dict()["state"]
        return [
            v.clone() for k in sorted(st) for v in st[k].values() if isinstance(v, torch.Tensor)
        ]

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        if idx % self.accum == 0:
            step = idx // self.accum
            self.before[step] = self._opt(trainer)
            if step == NAN_WEIGHT:
                with torch.no_grad():
                    pl_module.net[2].weight[0, 3] = math.nan

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, out: Any, batch: Any, idx: int
    ) -> None:
        if (idx + 1) % self.accum == 0:
            self.after[idx // self.accum] = self._opt(trainer)


@pytest.mark.parametrize("sync", ["exact", "deferred"])
@pytest.mark.parametrize("accum", [1, 2])
def test_lightning_skips_and_rolls_back(tmp_path: Path, accum: int, sync: Any) -> None:
    """(In both modes: Lightning calls training_step, not forward, so a deferred step is
    settled at the next optimizer step with that step's work held apart; the step after
    the NaN weight's rollback ran on the NaN weight and is run again from its batch.)"""
    cb = FloatguardCallback(spikes=SpikePolicy(window=8, warmup=4, z=12.0),
                            response=ResponsePolicy(snapshot_every=2), sync=sync)  # fmt: skip
    probe = Probe(accum)
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", devices=1, callbacks=[cb, probe], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        accumulate_grad_batches=accum, default_root_dir=str(tmp_path),
    )  # fmt: skip
    module = Module()
    trainer.fit(module, _data(accum))
    events = list(read_events(tmp_path / "floatguard-events.jsonl"))
    steps = {e.step: (e["action"], e["reason"]) for e in events if e.kind == "step"}
    assert len(steps) == 20
    assert steps[NAN_BATCH] == ("skipped", "nonfinite_input")
    assert steps[SPIKE] == ("skipped", "loss_spike")
    assert steps[NAN_WEIGHT] == ("rolled_back", "nonfinite_param")
    assert cb.totals == {"applied": 17, "skipped": 2, "rolled_back": 1}
    for s in (NAN_BATCH, SPIKE):
        assert all(torch.equal(a, b) for a, b in zip(probe.before[s], probe.after[s], strict=True))
    assert not all(
        torch.equal(a, b) for a, b in zip(probe.before[3], probe.after[3], strict=True)
    )  # an applied step moves the moments
    assert all(torch.isfinite(p).all() for p in module.parameters())
    # The schedule moved with applied steps only; the rollback took it back with the
    # weights to the snapshot (taken before step to_step was applied).
    sched = trainer.lr_scheduler_configs[0].scheduler
    to_step = next(e["to_step"] for e in events if e.kind == "rollback")
    kept = [s for s, (a, _) in steps.items() if a == "applied" and (s < to_step or s > NAN_WEIGHT)]
    assert sched.last_epoch == len(kept) and to_step < NAN_WEIGHT
    fault = next(e for e in events if e.kind == "fault" and e.step == NAN_WEIGHT)
    assert fault["module"] == "net.2" and fault["tensor"] == "param:weight"
    # The guard's state round-trips through a Lightning checkpoint.
    state = cb.state_dict()
    fresh = FloatguardCallback()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state and state["guard"]["step_count"] == 20
    weights = [p.detach().clone() for p in module.parameters()]
    if sync == "deferred":  # the exact mode's run, bit for bit
        assert cb.guard is not None and cb.guard.sync == "deferred"
        assert (
            cb.guard._deferred is not None and cb.guard._deferred.deferred_steps >= 5
        )  # (snapshot_every=2: the others exact)
        exact = FloatguardCallback(spikes=SpikePolicy(window=8, warmup=4, z=12.0),
                                   response=ResponsePolicy(snapshot_every=2))  # fmt: skip
        again = pl.Trainer(
            max_epochs=1, accelerator="cpu", devices=1, callbacks=[exact, Probe(accum)],
            logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            accumulate_grad_batches=accum, default_root_dir=str(tmp_path / "exact"),
        )  # fmt: skip
        other = Module()
        again.fit(other, _data(accum))
        assert all(torch.equal(a, b) for a, b in zip(weights, other.parameters(), strict=True))
        assert exact.totals == cb.totals


def test_missing_extra_names_it() -> None:
    from floatguard.integrations import require

    with pytest.raises(ImportError, match=r"pip install 'floatguard\[lightning\]'"):
        require(
            "lightning_not_installed_anywhere", "lightning", "floatguard.integrations.lightning"
        )


def test_the_guard_state_goes_through_a_lightning_checkpoint(tmp_path: Path) -> None:
    """Saved with trainer.save_checkpoint, restored by fit(ckpt_path=...): the new
    callback's guard continues the step count, totals and spike statistics."""
    kw: dict[str, Any] = dict(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    )  # fmt: skip
    first = FloatguardCallback(spikes=SpikePolicy(window=8, warmup=4, z=12.0))
    trainer = pl.Trainer(max_epochs=1, callbacks=[first], **kw)
    trainer.fit(Module(), _data(1))
    ckpt = tmp_path / "one.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = first.state_dict()
    second = FloatguardCallback(spikes=SpikePolicy(window=8, warmup=4, z=12.0))
    again = pl.Trainer(max_epochs=2, callbacks=[second], **kw)
    again.fit(Module(), _data(1), ckpt_path=str(ckpt))
    assert second.guard is not None
    assert second.guard.step_count == saved["guard"]["step_count"] + 20 == 40
    assert sum(second.totals.values()) == 40  # the totals went on from the checkpoint
    steps = [e.step for e in second.guard.events.of_kind("step")]
    assert steps[0] == 20 and steps[-1] == 39  # its events continue the step numbers


# --------------------------------------------------------------------------------------
# A replay logs nothing; floatguard/loss is the real (mean micro-batch) loss.


class MemoryLogger(pl.loggers.Logger):  # type: ignore[misc]
    """What a logger receives: one row per logging step."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append(dict(metrics))


class LoggingModule(Module):
    """Logs its loss with self.log and self.log_dict; keeps what training_step returned."""

    def __init__(self) -> None:
        super().__init__()
        self.returned: list[torch.Tensor] = []

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        loss = super().training_step(batch, idx)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        self.log_dict({"train_mse": loss}, on_step=True, on_epoch=False)
        self.returned.append(loss.detach().float().clone())
        return loss


class Reference(pl.Callback):  # type: ignore[misc]
    """The reference loss of each batch, recomputed at batch start (the weights the step's
    training_step sees), and the result keys Lightning holds after each batch."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.keys: set[str] = set()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        x, y = batch
        with torch.no_grad():
            self.losses.append(float(((pl_module.net(x) - y) ** 2).mean()))

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, out: Any, batch: Any, idx: int
    ) -> None:
        self.keys |= set(trainer._results.keys())  # Lightning's result collection: "<hook>.<name>"


def _trainer(tmp_path: Path, callbacks: list[Any], logger: Any, **kw: Any) -> Any:
    return pl.Trainer(
        max_epochs=1, accelerator="cpu", devices=1, callbacks=callbacks, logger=logger,
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path), **kw,
    )  # fmt: skip


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6)


def test_a_replay_logs_nothing(tmp_path: Path) -> None:
    """After the replay of a NaN batch, the user's train_loss goes on with the real loss
    of each batch (it froze at NaN when the replay's self.log, run inside Lightning's
    optimizer_step hook, made an optimizer_step.train_loss entry that shadowed it)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 8, 4, generator=g), torch.randn(12, 8, 1, generator=g)
    x[4, 0, 0] = math.nan
    loader = torch.utils.data.DataLoader(list(zip(x, y, strict=True)), batch_size=None)
    cb, ref, logger, module = FloatguardCallback(), Reference(), MemoryLogger(), LoggingModule()
    _trainer(tmp_path, [cb, ref], logger).fit(module, loader)
    events = list(read_events(tmp_path / "floatguard-events.jsonl"))
    assert [(e.step, e["phase"]) for e in events if e.kind == "fault"] == [(4, "input")]
    assert len(module.returned) > 12  # the NaN step was replayed (training_step ran again)
    assert len(logger.rows) == 12
    for step, (row, want) in enumerate(zip(logger.rows, ref.losses, strict=True)):
        assert _same(row["train_loss"], want), step
        assert _same(row["train_mse"], want), step
        assert _same(row["floatguard/loss"], want), step
    assert math.isnan(ref.losses[4]) and all(math.isfinite(v) for v in ref.losses[5:])
    assert len(set(ref.losses[5:])) == 7  # the values after the replay keep changing
    assert not any(k.startswith("optimizer_step.") for k in ref.keys)
    assert "training_step.train_loss" in ref.keys
    last = float(module.trainer.callback_metrics["train_loss"])
    assert last == pytest.approx(ref.losses[-1], rel=1e-6)
    # Nothing of the callback stays on the module after the run.
    assert not {"log", "log_dict", "training_step"} & set(vars(module))


def _precision_kw(precision: str) -> dict[str, Any]:
    if precision == "32":
        return {}
    # The CUDA path on CPU: Lightning makes no GradScaler for 16-mixed on CPU by itself.
    from lightning.pytorch.plugins import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}


@pytest.mark.parametrize("precision", ["32", "16-mixed with a GradScaler"])
def test_floatguard_loss_is_the_mean_micro_batch_loss(tmp_path: Path, precision: str) -> None:
    """Lightning divides the loss by accumulate_grad_batches (and the GradScaler
    multiplies it by its scale) before on_before_backward; floatguard/loss is the mean of
    the micro-batches' losses as training_step returned them."""
    accum = 2
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(16, 8, 4, generator=g), torch.randn(16, 8, 1, generator=g)
    loader = torch.utils.data.DataLoader(list(zip(x, y, strict=True)), batch_size=None)
    cb, ref, logger, module = FloatguardCallback(), Reference(), MemoryLogger(), LoggingModule()
    trainer = _trainer(
        tmp_path, [cb, ref], logger, accumulate_grad_batches=accum, **_precision_kw(precision)
    )
    trainer.fit(module, loader)
    assert cb.totals == {"applied": 8, "skipped": 0, "rolled_back": 0}
    returned = [float(v) for v in module.returned]
    assert len(returned) == 16  # no replay: one training_step per batch
    if precision == "32":  # what training_step returned is the loss at the step's weights
        assert returned == pytest.approx(ref.losses, rel=1e-6)
    want = [sum(returned[i : i + accum]) / accum for i in range(0, 16, accum)]
    got = [row["floatguard/loss"] for row in logger.rows]
    assert got == pytest.approx(want, rel=1e-6)
    assert cb.guard is not None
    steps = [e["loss"] for e in cb.guard.events.of_kind("step")]
    assert steps == pytest.approx(want, rel=1e-6)  # the guard decided on the same values


def test_logging_off_puts_back_what_was_there() -> None:
    from floatguard.integrations.lightning import _logging_off

    module = LoggingModule()
    own = lambda *a, **k: "own"  # noqa: E731  (an instance attribute of the user's)
    module.log = own
    with _logging_off(module):
        assert module.log("x", 1.0) is None and module.log_dict({"x": 1.0}) is None
    assert module.log is own and "log_dict" not in vars(module)
    with pytest.raises(RuntimeError), _logging_off(module):
        raise RuntimeError  # restored on the way out of an error too
    assert module.log is own and "log_dict" not in vars(module)


class PlateauModule(Module):  # type: ignore[misc]
    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        loss = super().training_step(batch, idx)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": sched, "interval": "step", "monitor": "train_loss"},
        }


def test_a_plateau_scheduler_config_runs_and_lightning_steps_it(tmp_path: Path) -> None:
    # Issue 36, item 7: a ReduceLROnPlateau config crashed on the first step.
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 8, 4, generator=g), torch.randn(12, 8, 1, generator=g)
    data = torch.utils.data.DataLoader(list(zip(x, y, strict=True)), batch_size=None)
    module = PlateauModule()
    cb = FloatguardCallback()
    trainer = pl.Trainer(
        max_steps=12, callbacks=[cb], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(module, data)
    assert cb.totals["applied"] == 12
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert sched.last_epoch == 12  # Lightning stepped it with train_loss, every step
