"""FloatguardCallback inside transformers.Trainer: tiny GPT-2 and Llama built from configs
(random weights, no download), a NaN batch, a NaN weight and a loss spike injected. The
run ends finite; skipped steps leave the optimizer state exactly as it was."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from floatguard.events import read_events  # noqa: E402
from floatguard.integrations.hf import FloatguardCallback, add_to  # noqa: E402
from floatguard.stability.respond import ResponsePolicy, SpikePolicy  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
D, T, V = 32, 8, 64
NAN_BATCH, SPIKE, NAN_WEIGHT = 6, 10, 14  # optimizer steps (one batch per step)


class Embeds(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Float inputs (inputs_embeds) so a batch can carry a NaN; labels are token ids. An
    iterable dataset: the Trainer keeps its order (it shuffles map-style datasets)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, T, D, generator=g) * 0.5
        self.y = torch.randint(0, V, (n, T), generator=g)
        self.x[NAN_BATCH * 2, 3, 5] = math.nan  # batch size 2: the first item of that batch

    def __iter__(self) -> Any:
        for i in range(len(self.x)):
            yield {"inputs_embeds": self.x[i], "labels": self.y[i]}


def _model(kind: str) -> Any:
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=D, n_head=4, vocab_size=V, n_positions=T,
                                      bos_token_id=0, eos_token_id=0)  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg), "transformer.h.1.mlp.c_fc"
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=D, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, vocab_size=V,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg), "model.layers.1.mlp.up_proj"


class Inject(transformers.TrainerCallback):  # type: ignore[misc]
    """Makes the loss spike on step SPIKE (the LM head scaled for that step only) and
    poisons a weight before step NAN_WEIGHT; records the optimizer state around them."""

    def __init__(self, model: Any, weight: str, guard_cb: FloatguardCallback) -> None:
        self.model, self.weight, self.cb = model, weight, guard_cb
        self.head = model.get_output_embeddings().weight
        self.before: dict[int, Any] = {}
        self.after: dict[int, Any] = {}

    def _opt_state(self, opt: Any) -> list[torch.Tensor]:
        st = opt.state_dict()["state"]
        return [
            v.clone() for k in sorted(st) for v in st[k].values() if isinstance(v, torch.Tensor)
        ]

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        step = state.global_step
        self.before[step] = (self._opt_state(kw["optimizer"]), kw["lr_scheduler"].last_epoch)
        if step == NAN_WEIGHT:
            with torch.no_grad():
                self.model.get_submodule(self.weight).weight[1, 2] = math.nan
        if step == SPIKE:
            with torch.no_grad():
                self.head.mul_(40.0)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        step = state.global_step - 1
        self.after[step] = (self._opt_state(kw["optimizer"]), kw["lr_scheduler"].last_epoch)
        if step == SPIKE:
            with torch.no_grad():
                self.head.div_(40.0)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_trainer_skips_and_rolls_back_for_real(tmp_path: Path, kind: str) -> None:
    model, weight = _model(kind)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=20,
        learning_rate=1e-3, weight_decay=0.1, logging_steps=5, report_to=[], save_strategy="no",
        use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0,
        lr_scheduler_type="linear", max_grad_norm=1.0,
    )  # fmt: skip
    cb = FloatguardCallback(spikes=SpikePolicy(window=8, warmup=4, z=6.0),
                            response=ResponsePolicy(snapshot_every=2))  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Embeds(40))
    add_to(trainer, cb)
    inject = Inject(model, weight, cb)
    trainer.add_callback(inject)
    trainer.train()
    events = list(read_events(tmp_path / "floatguard-events.jsonl"))
    steps = {e.step: e for e in events if e.kind == "step"}
    assert len(steps) == 20
    print({s: (e["action"], e["reason"]) for s, e in steps.items() if e["action"] != "applied"})
    assert (
        steps[NAN_BATCH]["action"] == "skipped" and steps[NAN_BATCH]["reason"] == "nonfinite_input"
    )
    assert steps[SPIKE]["action"] == "skipped" and steps[SPIKE]["reason"] == "loss_spike"
    assert steps[NAN_WEIGHT]["action"] == "rolled_back"
    faults = {e.step: e for e in events if e.kind == "fault"}
    assert faults[NAN_BATCH]["phase"] == "input"
    assert faults[NAN_WEIGHT]["module"] == weight and faults[NAN_WEIGHT]["phase"] == "param"
    # A skipped step is a real skip: AdamW's moments and step count, and the LR
    # schedule, are exactly as before it.
    for s in (NAN_BATCH, SPIKE):
        (st0, lr0), (st1, lr1) = inject.before[s], inject.after[s]
        assert lr0 == lr1
        assert all(torch.equal(a, b) for a, b in zip(st0, st1, strict=True))
    (_, lr_a), (_, lr_b) = inject.before[NAN_BATCH - 1], inject.after[NAN_BATCH - 1]
    assert lr_b == lr_a + 1  # an applied step moves the schedule
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the run ends finite
    logged = [h for h in trainer.state.log_history if "floatguard/skipped" in h]
    assert logged and logged[-1]["floatguard/skipped"] == 2.0
    assert logged[-1]["floatguard/rolled_back"] == 1.0
    assert any(math.isnan(h["floatguard/loss"]) or h["floatguard/loss"] > 0 for h in logged)
    assert cb.totals == {"applied": 17, "skipped": 2, "rolled_back": 1}


def test_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins
    import importlib
    import sys

    real_import = builtins.__import__

    def fake(name: str, *a: Any, **k: Any) -> Any:
        if name.split(".")[0] == "transformers":
            raise ImportError("No module named 'transformers'")
        return real_import(name, *a, **k)

    monkeypatch.delitem(sys.modules, "floatguard.integrations.hf", raising=False)
    monkeypatch.setattr(builtins, "__import__", fake)
    monkeypatch.setattr(importlib, "import_module", lambda n: fake(n))
    with pytest.raises(ImportError, match=r"pip install 'floatguard\[hf\]'"):
        importlib.reload(sys.modules["floatguard.integrations"])
        import floatguard.integrations.hf  # noqa: F401


def test_fp16_overflow_is_the_scalers_and_a_nan_batch_is_the_guards(tmp_path: Path) -> None:
    """Under fp16 the Trainer's GradScaler handles a gradient overflow (finite loss): it
    skips and halves the scale, the guard records it. A NaN batch is the guard's: skipped
    without calling the scaler, whose scale stays; the next steps run normally."""
    model, _ = _model("gpt2")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=12,
        learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True, fp16=True,
        disable_tqdm=True, dataloader_num_workers=0, seed=0, max_grad_norm=1.0,
    )  # fmt: skip
    cb = FloatguardCallback()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Embeds(24),
                                   callbacks=[cb])  # fmt: skip
    # accelerate makes its GradScaler on GPUs only; given one on CPU, the path runs here
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    overflow_at = 9
    block = model.transformer.h[1].mlp

    def blow_up(m: Any, gin: Any, gout: Any) -> Any:
        if trainer.state.global_step == overflow_at:
            return tuple(g * math.inf if g is not None else None for g in gin)
        return None

    block.register_full_backward_hook(blow_up)
    trainer.train()
    events = list(read_events(tmp_path / "floatguard-events.jsonl"))
    steps = {e.step: (e["action"], e["reason"]) for e in events if e.kind == "step"}
    assert steps[NAN_BATCH] == ("skipped", "nonfinite_input")
    assert steps[overflow_at] == ("skipped", "overflow")
    (ov,) = [e for e in events if e.kind == "overflow"]
    assert ov.step == overflow_at and ov["scale_after"] == ov["scale_before"] / 2
    scales = {e.step: e["scale"] for e in events if e.kind == "step"}
    assert scales[NAN_BATCH] == scales[NAN_BATCH - 1]  # the guard's skip: scale untouched
    assert cb.totals == {"applied": 10, "skipped": 2, "rolled_back": 0}
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _ddp_trainer_worker(rank: int, world: int, out: str, sync: str = "exact") -> dict[str, Any]:
    # torch.distributed is initialized (gloo, by the test harness); accelerate reads
    # these and uses the existing group
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # fmt: skip
    model, _ = _model("gpt2")
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, max_steps=10, report_to=[],
        save_strategy="no", use_cpu=True, disable_tqdm=True, ddp_backend="gloo",
        dataloader_num_workers=0, seed=0,
    )  # fmt: skip
    cb = FloatguardCallback(spikes=SpikePolicy(window=8, warmup=4, z=12.0), sync=sync)  # type: ignore[arg-type]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Embeds(40),
                                   callbacks=[cb])  # fmt: skip
    trainer.train()
    assert cb.guard is not None and cb.guard.distributed and cb.guard.sync == sync
    params = [p.detach().clone() for p in model.parameters()]
    return {"totals": cb.totals, "params": params}


@pytest.mark.ranks
@pytest.mark.parametrize("sync", ["exact", "deferred"])
def test_trainer_under_ddp_decides_alike_on_every_rank(tmp_path: Path, sync: str) -> None:
    """Two gloo ranks (the Trainer's own DDP): the NaN item lands in one rank's batch;
    both ranks skip that step, name that rank, and end with identical weights (in both
    modes: deferred, the read rides on DDP's all-reduce and settles a call later)."""
    from tests._ranks import run_ranks

    res = run_ranks(_ddp_trainer_worker, 2, tmp_path, sync, timeout=180)
    assert "totals" in res[0] and "totals" in res[1], res
    assert res[0]["totals"] == res[1]["totals"] == {"applied": 9, "skipped": 1, "rolled_back": 0}
    assert all(torch.equal(a, b) for a, b in zip(res[0]["params"], res[1]["params"], strict=True))
    logs = sorted(tmp_path.glob("ranks-*/floatguard-events*.jsonl"))
    assert len(logs) == 2
    for log in logs:
        events = list(read_events(log))
        skipped = [
            (e.step, e["reason"]) for e in events if e.kind == "step" and e["action"] != "applied"
        ]
        faults = [e.fields["fault_rank"] for e in events if e.kind == "fault"]
        assert len(skipped) == 1 and skipped[0][1] == "nonfinite_input" and faults == [0]


def test_a_reduce_lr_on_plateau_trainer_runs_and_is_stepped_on_its_metric(tmp_path: Path) -> None:
    # Issue 36, item 7: lr_scheduler_type="reduce_lr_on_plateau" crashed on the first
    # step (the guard stepped it without a metric, after optimizer.step had run).
    model, _ = _model("gpt2")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=6,
        learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0, seed=0, eval_strategy="steps",
        eval_steps=3, lr_scheduler_type="reduce_lr_on_plateau", max_grad_norm=1.0,
    )  # fmt: skip
    data = Embeds(40)
    data.x[NAN_BATCH * 2, 3, 5] = 0.0  # no fault here
    evals = [{"inputs_embeds": data.x[i], "labels": data.y[i]} for i in range(4)]
    cb = FloatguardCallback()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, eval_dataset=evals)
    add_to(trainer, cb)
    trainer.train()
    assert cb.totals == {"applied": 6, "skipped": 0, "rolled_back": 0}
    sched = trainer.lr_scheduler
    assert isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau)
    assert sched.last_epoch == 2  # stepped by the Trainer at its two evaluations only
    events = list(read_events(tmp_path / "floatguard-events.jsonl"))
    run = next(e for e in events if e.kind == "run")
    assert run["clip"]["norm_measured"] == "after_clip"  # the Trainer clipped first


def _run_gpt2(tmp_path: Path, sync: Any, accum: int = 1) -> tuple[Any, ...]:
    model, weight = _model("gpt2")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2 // accum, max_steps=20,
        gradient_accumulation_steps=accum,
        learning_rate=1e-3, weight_decay=0.1, logging_steps=5, report_to=[], save_strategy="no",
        use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0,
        lr_scheduler_type="linear", max_grad_norm=1.0,
    )  # fmt: skip
    cb = FloatguardCallback(spikes=SpikePolicy(window=8, warmup=4, z=6.0),
                            response=ResponsePolicy(snapshot_every=4), sync=sync)  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Embeds(40))
    add_to(trainer, cb)
    trainer.add_callback(Inject(model, weight, cb))
    trainer.train()
    events = list(read_events(tmp_path / "floatguard-events.jsonl"))
    steps = [(e.step, e["action"], e["reason"], e["loss"]) for e in events if e.kind == "step"]
    logged = [
        h["floatguard/applied"] for h in trainer.state.log_history if "floatguard/applied" in h
    ]
    assert cb.guard is not None and cb.guard.sync == sync
    deferred = cb.guard._deferred.deferred_steps if cb.guard._deferred is not None else 0
    return steps, [p.detach().clone() for p in model.parameters()], cb.totals, logged, deferred


@pytest.mark.parametrize("accum", [1, 2])
def test_the_trainer_in_the_deferred_mode_does_what_the_exact_mode_does(
    tmp_path: Path, accum: int
) -> None:
    """sync="deferred": the step is settled when the Trainer's next forward begins (its
    scheduler stepped then, by the guard, through the callback's gate); the same
    actions, causes and losses, the same weights bit for bit, the same totals at the end.
    The logged totals are of the steps decided so far (one behind, no wait). With
    gradient accumulation the settling falls on the next step's first micro-batch,
    where accelerate's optimizer ignores zero_grad: the guard clears the gradients
    itself."""
    exact = _run_gpt2(tmp_path / "exact", "exact", accum)
    deferred = _run_gpt2(tmp_path / "deferred", "deferred", accum)
    assert [s[1:3] for s in exact[0] if s[1] != "applied"] == [
        ("skipped", "nonfinite_input"), ("skipped", "loss_spike"),
        ("rolled_back", "nonfinite_param"),
    ]  # fmt: skip
    # The injected spike (the LM head scaled at the step's begin, put back at its end) is
    # gone when the step settles, at the next forward: its replay is clean, so the
    # deferred mode calls it transient (docs/guard.md: a cause removed between the
    # calls). Skipped either way.
    spike = [(s, "skipped", "transient", loss) for s, _, _, loss in exact[0][SPIKE : SPIKE + 1]]
    expected = exact[0][:SPIKE] + spike + exact[0][SPIKE + 1 :]
    same = [a[:3] == b[:3] and (a[3] == b[3] or (a[3] != a[3] and b[3] != b[3]))
            for a, b in zip(expected, deferred[0], strict=True)]  # fmt: skip
    assert all(same), (exact[0], deferred[0])
    assert all(torch.equal(a, b) for a, b in zip(exact[1], deferred[1], strict=True))
    assert exact[2] == deferred[2] == {"applied": 17, "skipped": 2, "rolled_back": 1}
    assert deferred[4] >= 8  # (the snapshot steps run exactly)
    assert len(deferred[3]) == len(exact[3])  # logged: the steps decided so far
    assert all(d in (e, e - 1) for d, e in zip(deferred[3], exact[3], strict=True))


def test_deferred_under_the_trainers_fp16_scaler_is_exact_and_says_so(tmp_path: Path) -> None:
    model, _ = _model("gpt2")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, report_to=[],
        save_strategy="no", use_cpu=True, fp16=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    cb = FloatguardCallback(sync="deferred")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Embeds(16),
                                   callbacks=[cb])  # fmt: skip
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with pytest.warns(UserWarning, match="GradScaler.*exact mode"):
        trainer.train()
    assert cb.guard is not None and cb.guard.sync == "exact"
    with pytest.raises(ValueError, match="sync='later'"):
        FloatguardCallback(sync="later")  # type: ignore[arg-type]
