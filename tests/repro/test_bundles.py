"""Issue 37: the bad step as a file. A guarded run with ``ResponsePolicy(repro_dir=)``
writes one bundle per distinct fault; ``floatguard repro`` re-raises the fault in a
fresh process, at the op the guard named; ``--script`` writes a PyTorch script that
needs nothing of floatguard. Each fault is planted the way a user meets it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import floatguard.cli as cli
from floatguard import ResponsePolicy, SpikePolicy
from floatguard.emulation import EmulationRecipe, emulate
from floatguard.repro import ReproError, load_bundle, reproduce, write_script
from tests.repro import _scenarios as sc

# name -> (plant, run options, expected (module, phase, op, kind) of the birth)
FAULTS: dict[str, tuple[sc.Plant, dict[str, Any], tuple[str, str, str, str]]] = {
    "forward_op": (sc.forward_log, {}, ("b", "forward", "aten.log.default", "nan")),
    "backward_op": (sc.backward_sqrt, {}, ("b", "backward", "aten.div.Tensor", "inf")),
    "grad_hook": (sc.grad_hook, {}, ("b.fc", "param_grad", "aten.mul.Tensor", "nan")),
    "nan_weight": (sc.nan_weight, {}, ("b.fc", "param", "outside", "nan")),
    "nan_exp_avg": (sc.nan_exp_avg, {}, ("b.fc", "param", "parameter", "nan")),
    "nan_input": (sc.nan_input, {}, ("", "input", "input", "nan")),
    "fp16_overflow": (
        sc.overflow,
        {"precision": "fp16"},
        ("a", "forward", "aten.mul.Tensor", "inf"),
    ),
    "mxfp8_emulated": (
        sc.forward_log,
        {"setup": lambda m: emulate(m, EmulationRecipe.mxfp8(), skip=("head",))},
        ("b", "forward", "aten.log.default", "nan"),
    ),
    "mxfp8_gemm_overflow": (
        sc.gemm_overflow,
        {"setup": lambda m: emulate(m, EmulationRecipe.mxfp8(), skip=("head",))},
        ("a.fc", "forward", "aten.mm.default", "nan"),
    ),
}
ROOT = Path(__file__).resolve().parents[2]
FAULTS_EMULATED = ("mxfp8_emulated", "mxfp8_gemm_overflow")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, sc.Outcome]:
    root = tmp_path_factory.mktemp("repro")
    out = {name: sc.run(root / name, plant, **kw) for name, (plant, kw, _) in FAULTS.items()}
    out["spike"] = sc.run(
        root / "spike", sc.spike, at=35, steps=37, level="step", spikes=SpikePolicy()
    )
    out["transient"] = sc.run(root / "transient", sc.first_call_only, steps=11)
    return out


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_a_bad_step_writes_one_bundle_naming_the_birth(
    runs: dict[str, sc.Outcome], name: str
) -> None:
    run = runs[name]
    module, phase, op, kind = FAULTS[name][2]
    fault = run.faults[0]
    assert (fault.module, fault.phase, fault.op, fault.kind) == (module, phase, op, kind)
    assert len(run.bundles) == 1, run.bundles  # one per distinct fault, however often
    path = run.bundles[0]
    assert path.name.startswith("repro-step000000010-") and path.suffix == ".fgr"
    b = load_bundle(path)
    f = b.fault
    assert f is not None and (f["module"], f["phase"], f["op"], f["kind"]) == fault_facts(fault)
    assert b.step == 10 and b.level == "minimal"
    assert b.payload["torch"] == str(torch.__version__) and b.payload["device"] == "cpu"
    assert b.payload["floatguard"]
    # the repro event carries its path and size; the file is sized like the module
    (ev,) = [e for e in run.events if e["kind"] == "repro"]
    assert ev["path"] == str(path) and ev["bytes"] == path.stat().st_size and ev["step"] == 10
    assert path.stat().st_size < 64 * 1024


def fault_facts(fault: Any) -> tuple[str, str, str, str]:
    return (fault.module, fault.phase, fault.op, fault.kind)


def test_what_the_step_computed_in_is_recorded(runs: dict[str, sc.Outcome]) -> None:
    run = runs["fp16_overflow"]
    ctx = load_bundle(run.bundles[0]).payload["context"]
    assert ctx["precision"] == "fp16" and ctx["autocast"] == "float16"
    # the scale the step ran with: the one the last step before it ended with
    before = [e for e in run.events if e["kind"] == "step" and e["step"] < 10]
    assert ctx["loss_scale"] == before[-1]["scale"] and ctx["param_dtypes"] == ["float32"]
    emu = load_bundle(runs["mxfp8_emulated"].bundles[0]).payload["context"]["emulation"]
    assert sorted(emu) == ["a.fc", "b.fc"] and "element='e4m3fn', block=32" in emu["b.fc"]
    # a birth inside a module: the module's inputs, parameters and buffers, the op alone
    b = load_bundle(runs["forward_op"].bundles[0])
    assert b.payload["module"]["name"] == "b" and b.payload["module"]["class"].endswith("Block")
    assert sorted(b.module_state) == ["fc.bias", "fc.weight", "norm.bias", "norm.weight"]
    assert b.payload["single"]["op"] == "aten.log.default"
    tape_ops = [o["op"] for o in b.tape["ops"]] if b.tape else []
    assert tape_ops[-1] == "aten.log.default" and "aten.addmm.default" in tape_ops


@pytest.mark.subprocess
def test_every_bundle_reproduces_in_a_fresh_process(runs: dict[str, sc.Outcome]) -> None:
    names = [*sorted(FAULTS), "spike", "transient"]
    paths = [str(runs[n].bundles[0]) for n in names]
    # `floatguard repro BUNDLE --json` for each bundle, in one fresh interpreter
    code = (
        "import sys\n"
        "import floatguard.cli as cli\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n"
        "        cli.main(['repro', p, '--json'])\n"
        "    except SystemExit as e:\n"
        "        assert e.code in (0, None), (p, e.code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = dict(zip(names, map(json.loads, done.stdout.splitlines()), strict=True))
    for name in FAULTS:
        o = outcomes[name]
        assert o["reproduced"] is True, (name, o)
        assert (o["module"], o["phase"], o["op"], o["kind"]) == FAULTS[name][2], name
    # an op's birth: re-run from the tape, and found at the birth op itself
    for name in ("forward_op", "backward_op", "grad_hook", "fp16_overflow", *FAULTS_EMULATED):
        o = outcomes[name]
        assert o["ran"].startswith("tape of") and o["found_op"] == FAULTS[name][2][2], (name, o)
    for name in ("nan_weight", "nan_exp_avg", "nan_input"):
        assert outcomes[name]["ran"] == "the value"
    spike = outcomes["spike"]
    assert spike["reproduced"] is True and spike["kind"] == "spike" and spike["level"] == "step"
    transient = outcomes["transient"]
    assert transient["reproduced"] is False and "transient" in transient["note"]


def test_floatguard_repro_prints_the_outcome(
    runs: dict[str, sc.Outcome], capsys: pytest.CaptureFixture[str]
) -> None:
    path = runs["forward_op"].bundles[0]
    with pytest.raises(SystemExit) as info:
        cli.main(["repro", str(path), "--json"])
    assert info.value.code in (0, None)
    out = json.loads(capsys.readouterr().out)
    assert out["reproduced"] is True and out["op"] == "aten.log.default" and out["module"] == "b"
    assert out["values"]["output"][0]["nan"] == 32  # every element of the [4, 8] output
    with pytest.raises(SystemExit) as info:
        cli.main(["repro", str(path)])
    text = capsys.readouterr().out
    assert "reproduced" in text and "aten.log.default" in text


@pytest.mark.subprocess
def test_scripts_re_raise_the_fault_without_floatguard(
    runs: dict[str, sc.Outcome], tmp_path: Path
) -> None:
    names = [n for n in FAULTS if n != "nan_input"] + ["nan_input", "spike"]
    scripts = []
    for name in names:
        py, data = write_script(load_bundle(runs[name].bundles[0]), tmp_path / f"{name}.py")
        assert data.exists() and py.exists()
        scripts.append(str(py))
    # every script in one fresh interpreter in which floatguard cannot be imported
    code = (
        "import io, runpy, sys, contextlib\n"
        "sys.modules['floatguard'] = None\n"
        "for p in sys.argv[1:]:\n"
        "    buf = io.StringIO()\n"
        "    sys.argv = [p]\n"
        "    try:\n"
        "        with contextlib.redirect_stdout(buf):\n"
        "            runpy.run_path(p, run_name='__main__')\n"
        "        code = 0\n"
        "    except SystemExit as e:\n"
        "        code = e.code\n"
        "    print(repr((p, code, buf.getvalue())))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *scripts],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,  # where the user's model (tests.repro._user_model) is importable
    )
    assert done.returncode == 0, done.stderr[-3000:]
    import ast

    results = [ast.literal_eval(line) for line in done.stdout.splitlines()]
    assert [r[0] for r in results] == scripts
    for name, (_, code_, printed) in zip(names, results, strict=True):
        assert code_ == 1, (name, printed)
        assert "reproduced" in printed and "not reproduced" not in printed, (name, printed)
        if name in FAULTS and FAULTS[name][2][2].startswith("aten."):
            assert FAULTS[name][2][2] in printed, (name, printed)
        # a forward birth in the user's own module: its class, rebuilt from its import
        # path, gives the value; an emulated layer (floatguard's class, not importable
        # there) falls back to the recorded ops, which re-apply the recipe
        by_class = "reproduced by the module's own class: tests.repro._user_model:Block"
        assert (by_class in printed) == (name in ("forward_op", "fp16_overflow")), (
            name,
            printed,
        )
        if name in FAULTS_EMULATED:
            assert "cannot be used here" in printed and "reproduced:" in printed, printed


def test_the_step_level_keeps_the_state_before_the_rollback(tmp_path: Path) -> None:
    run = sc.run(tmp_path, sc.nan_weight, level="step", steps=11)
    assert run.actions == ["rolled_back"]
    (path,) = run.bundles
    b = load_bundle(path)
    assert b.level == "step"
    state = b.state
    assert state is not None and sorted(state) == ["model", "optimizer", "rng", "scaler"]
    w = state["model"]["b.fc.weight"]
    assert math.isnan(float(w[0, 0])) and bool(w.flatten()[1:].isfinite().all())
    assert set(state["optimizer"]) == {"state", "param_groups"}
    batch = b.payload["batch"]
    assert batch is not None  # the step's inputs (the model's call arguments)
    assert reproduce(b).reproduced


def test_the_same_fault_again_writes_no_second_bundle_and_old_ones_are_pruned(
    tmp_path: Path,
) -> None:
    run = sc.run(tmp_path / "again", sc.forward_log, steps=14)
    assert run.actions == ["skipped"] * 4 and len(run.bundles) == 1
    # three distinct faults with keep=2: the two newest stay; foreign files are kept
    folder = tmp_path / "keep"
    folder.mkdir()
    foreign = folder / "repro-step000000001-deadbeef.fgr"
    foreign.write_bytes(b"not a bundle: a file the user named like one")
    notes = folder / "notes.txt"
    notes.write_text("mine")
    plants = {4: sc.forward_log, 6: sc.grad_hook, 8: sc.nan_input}

    def plant(m: sc.TwoBlocks, o: Any, x: Any, y: Any) -> Any:
        step = plant.step  # type: ignore[attr-defined]
        plant.step += 1  # type: ignore[attr-defined]
        m.b.mode = None
        return plants[step](m, o, x, y) if step in plants else None

    plant.step = 4  # type: ignore[attr-defined]
    run = sc.run(folder, plant, at=4, steps=9, keep=2, every=True)
    written = sorted(p.name for p in folder.glob("repro-step*.fgr") if p != foreign)
    assert [n[:19] for n in written] == ["repro-step000000006", "repro-step000000008"]
    assert foreign.read_bytes().startswith(b"not a bundle") and notes.read_text() == "mine"
    assert len([e for e in run.events if e["kind"] == "repro"]) == 3


def test_the_policy_refuses_bad_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="repro_level='full'"):
        ResponsePolicy(repro_dir=tmp_path, repro_level="full")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="repro_keep=0"):
        ResponsePolicy(repro_dir=tmp_path, repro_keep=0)
    with pytest.raises(ValueError, match="repro_dir"):
        ResponsePolicy(repro_dir=3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- hostile files
def _hostile(tmp_path: Path, good: Path) -> dict[str, Path]:
    import hashlib
    import pickle
    import struct

    from floatguard.repro.bundle import MAGIC

    raw = good.read_bytes()
    flipped = bytearray(raw)
    flipped[len(raw) - 40] ^= 0x04
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps({"kind": "floatguard-repro", "x": Evil()})
    evil = MAGIC + struct.pack(">Q32s", len(payload), hashlib.sha256(payload).digest()) + payload
    files = {
        "flipped": bytes(flipped),
        "truncated": raw[: len(raw) // 2],
        "pickle": evil,
        "empty": b"",
        "text": b"hello\n",
    }
    out = {}
    for name, data in files.items():
        p = tmp_path / f"{name}.fgr"
        p.write_bytes(data)
        out[name] = p
    fifo = tmp_path / "fifo.fgr"
    os.mkfifo(fifo)
    out["fifo"] = fifo
    folder = tmp_path / "folder.fgr"
    folder.mkdir()
    out["folder"] = folder
    out["missing"] = tmp_path / "missing.fgr"
    return out


def test_a_hostile_bundle_is_one_clear_line_and_nothing_runs(
    runs: dict[str, sc.Outcome], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _hostile(tmp_path, runs["forward_op"].bundles[0])
    for name, path in bad.items():
        with pytest.raises(ReproError):
            load_bundle(path)
        with pytest.raises(SystemExit) as info:
            cli.main(["repro", str(path)])
        assert info.value.code == 2, name
        captured = capsys.readouterr()
        lines = [ln for ln in (captured.out + captured.err).splitlines() if ln.strip()]
        assert len(lines) == 1 and str(path.name) in lines[0], (name, lines)
    assert not (tmp_path / "pwned").exists()


def test_the_report_links_each_bundle(runs: dict[str, sc.Outcome], tmp_path: Path) -> None:
    import re

    from floatguard.report.page import render_report

    run = runs["forward_op"]
    out = tmp_path / "report"
    render_report([run.folder / "events.jsonl"], out)
    page = (out / "index.html").read_text()
    assert "<h2>Repro bundles (1)</h2>" in page
    (href,) = re.findall(r"<a href='([^']+\.fgr)'>", page)
    assert (out / href).resolve() == run.bundles[0].resolve()
    assert f"floatguard repro {run.bundles[0]}" in page


@pytest.mark.subprocess
def test_torch_modules_are_rebuilt_by_their_class(tmp_path: Path) -> None:
    """A Linear without bias (a None parameter) and a MultiheadAttention (private plain
    attributes) come back from their import paths, and the script re-raises by them."""
    from torch import nn

    import floatguard

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8, bias=False)
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.proj(x)
            return self.head(self.attn(h, h, h)[0])

    scripts = []
    for name, big in (("proj", 3e38), ("attn", None)):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        folder = tmp_path / name
        guard = floatguard.Guard(model, opt, response=ResponsePolicy(repro_dir=folder))
        y = torch.randn(2, 3, 1)
        for step in range(3):
            x = torch.randn(2, 3, 8)
            if step == 2 and big is not None:  # finite inputs; the GEMM's sum overflows
                with torch.no_grad():
                    model.proj.weight.fill_(1.0)
                x = torch.full((2, 3, 8), big)
            if step == 2 and big is None:  # attention scores overflow: softmax of inf
                model.attn.register_forward_pre_hook(lambda m, a: tuple(t * 1e30 for t in a))
            r = guard.step(lambda x=x, m=model, y=y: F.mse_loss(m(x), y))
        guard.close()
        assert r.fault is not None and r.fault.module == name, r.fault
        (bundle,) = sorted(folder.glob("*.fgr"))
        py, _ = write_script(load_bundle(bundle), tmp_path / f"{name}.py")
        scripts.append(py)
    for py in scripts:
        done = subprocess.run(
            [sys.executable, "-I", str(py)], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 1, done.stdout + done.stderr
        assert "reproduced by the module's own class: torch.nn.modules." in done.stdout


def test_script_and_device_mistakes_are_one_line(
    runs: dict[str, sc.Outcome], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(runs["forward_op"].bundles[0])
    fifo = tmp_path / "pipe.py"
    os.mkfifo(fifo)
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "repro.pt").mkdir()  # the tensors' file name taken by a folder
    cases = {
        ("--script", str(fifo)): "not a regular file",
        ("--script", str(tmp_path / "ro" / "repro.py")): "not a regular file",
        ("--script", "x.pt"): "name the script",
        ("--device", "meta"): "meta tensor holds no values",
        ("--device", "gpu"): "is not a device",
    }
    for args, words in cases.items():
        with pytest.raises(SystemExit) as info:
            cli.main(["repro", path, *args])
        captured = capsys.readouterr()
        lines = [ln for ln in (captured.out + captured.err).splitlines() if ln.strip()]
        assert info.value.code == 2 and len(lines) == 1 and words in lines[0], (args, lines)
    # --json with --script: the two paths, as JSON
    with pytest.raises(SystemExit):
        cli.main(["repro", path, "--script", str(tmp_path / "r.py"), "--json"])
    assert json.loads(capsys.readouterr().out) == {
        "script": str(tmp_path / "r.py"),
        "tensors": str(tmp_path / "r.pt"),
    }


def test_the_script_never_writes_through_a_link(
    runs: dict[str, sc.Outcome], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 39: repro.py and repro.pt (a name the user did not type) as links to a
    user's files: the links are replaced by the outputs, the files stay as they were."""
    path = str(runs["forward_op"].bundles[0])
    victims = {}
    for name in ("repro.py", "repro.pt"):
        victim = tmp_path / f"notes-{name}.txt"
        victim.write_bytes(b"a user's file\n" * 50)
        (tmp_path / name).symlink_to(victim)
        victims[name] = victim
    with pytest.raises(SystemExit) as info:
        cli.main(["repro", path, "--script", str(tmp_path / "repro.py")])
    capsys.readouterr()
    assert info.value.code in (0, 1)
    for name, victim in victims.items():
        assert victim.read_bytes() == b"a user's file\n" * 50
        assert not (tmp_path / name).is_symlink() and (tmp_path / name).stat().st_size > 0
    assert "torch.load" in (tmp_path / "repro.py").read_text()


def test_the_script_never_replaces_a_users_pt_file(
    runs: dict[str, sc.Outcome], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--script model.py beside a user's model.pt (a checkpoint): refused in one line,
    the checkpoint kept; an earlier repro's script and tensors are replaced."""
    path = str(runs["forward_op"].bundles[0])
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(b"a user's weights")
    with pytest.raises(SystemExit) as info:
        cli.main(["repro", path, "--script", str(tmp_path / "model.py")])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert info.value.code == 2 and len(err) == 1 and "model.pt exists" in err[0]
    assert checkpoint.read_bytes() == b"a user's weights"
    assert not (tmp_path / "model.py").exists()
    for _ in range(2):  # a repro written twice: the second replaces the first
        with pytest.raises(SystemExit) as info:
            cli.main(["repro", path, "--script", str(tmp_path / "repro.py")])
        capsys.readouterr()
        assert info.value.code in (0, 1)


def test_a_mask_made_before_the_birth_is_not_a_birth() -> None:
    """A tape whose ops make a -inf from finite inputs (T5's log of a zero relative
    position) before the birth: the re-run names the birth, not the mask."""
    from floatguard.repro.bundle import run_tape

    zero, neg = torch.zeros(3), -torch.ones(3)
    tape = {
        "ops": [
            {"op": "aten.log.default", "args": {"tuple": [{"t": 0}]}, "kwargs": {"kwargs": {}},
             "out": {"t": 2}},
            {"op": "aten.sqrt.default", "args": {"tuple": [{"t": 1}]}, "kwargs": {"kwargs": {}},
             "out": {"t": 3}},
        ],
        "leaves": {0: zero, 1: neg},
        "birth": 1,
    }  # fmt: skip
    run = run_tape(tape, torch.device("cpu"))
    assert run.first == 1 and run.first_op == "aten.sqrt.default"
    assert bool(run.slots[2].eq(-math.inf).all()) and bool(run.birth_out[0].isnan().all())


def test_the_report_says_which_bundles_are_gone(tmp_path: Path) -> None:
    from floatguard.report.page import render_report

    plants = {4: sc.forward_log, 6: sc.grad_hook, 8: sc.nan_input}

    def plant(m: sc.TwoBlocks, o: Any, x: Any, y: Any) -> Any:
        step = plant.step  # type: ignore[attr-defined]
        plant.step += 1  # type: ignore[attr-defined]
        m.b.mode = None
        return plants[step](m, o, x, y) if step in plants else None

    plant.step = 4  # type: ignore[attr-defined]
    run = sc.run(tmp_path / "run", plant, at=4, steps=9, keep=1, every=True)
    assert len(run.bundles) == 1
    render_report([run.folder / "events.jsonl"], tmp_path / "report")
    page = (tmp_path / "report" / "index.html").read_text()
    assert page.count("pruned by repro_keep") == 2 and page.count(".fgr'>") == 1
