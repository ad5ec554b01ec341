"""The Lightning callback: a tiny LightningModule on CPU, a NaN batch, a NaN weight and a
loss spike, with and without gradient accumulation; skipped steps leave the optimizer
state untouched; the guard's state goes through a Lightning checkpoint."""

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


@pytest.mark.parametrize("accum", [1, 2])
def test_lightning_skips_and_rolls_back(tmp_path: Path, accum: int) -> None:
    cb = FloatguardCallback(spikes=SpikePolicy(window=8, warmup=4, z=12.0),
                            response=ResponsePolicy(snapshot_every=2))  # fmt: skip
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
