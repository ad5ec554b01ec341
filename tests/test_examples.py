"""Each example script runs and prints what the lesson's exercise expects."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(name: str) -> dict[str, str]:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    out: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        if ": " in line:
            key, value = line.split(": ", 1)
            out[key.strip()] = value.strip()
    return out


def test_catastrophic_cancellation() -> None:
    out = run("catastrophic_cancellation.py")
    assert abs(float(out["naive E[x^2]-E[x]^2"]) - 2 / 3) > 0.1
    assert float(out["Moments (Welford/Chan)"]) == pytest.approx(2 / 3, rel=1e-6)
    assert float(out["Moments relative error"]) < 1e-6


def test_machine_epsilon() -> None:
    out = run("machine_epsilon.py")
    assert float(out["smallest power of two with 1 + x != 1 (float32)"]) == 2.0**-23
    assert out["equals 2**-23"] == "True"
    assert float(out["floatguard fp32 eps"]) == float(out["numpy finfo eps"]) == 2.0**-23


def test_logsumexp_edge_cases() -> None:
    out = run("logsumexp_edge_cases.py")
    stable = {
        k: float(re.search(r"stable=(\S+)", v).group(1)) for k, v in out.items() if "stable=" in v
    }  # type: ignore[union-attr]
    assert stable["all equal (c=1000, n=4)"] == pytest.approx(1000 + math.log(4), abs=1e-3)
    assert stable["all very negative (-1000, n=3)"] == pytest.approx(-1000 + math.log(3), abs=1e-3)
    assert stable["one dominant (50 among zeros)"] == pytest.approx(50.0, abs=1e-6)
    assert "naive=inf" in out["all equal (c=1000, n=4)"]
    assert "naive=-inf" in out["all very negative (-1000, n=3)"]


def test_gradcheck_linear() -> None:
    out = run("gradcheck_linear.py")
    assert out["linear ok"] == "True"
    assert out["buggy ok"] == "False"
    assert out["buggy bias verdict"] in ("suspicious", "wrong")


def test_fp16_loss_scaling() -> None:
    out = run("fp16_loss_scaling.py")
    before = float(out["zero in fp16 without scaling"])
    after = float(out["zero in fp16 with loss scale 1024"])
    # log10(2**-25) = -7.53: about (9 - 7.53) / 6 = 24.5% of log-uniform [1e-9, 1e-3] underflows.
    assert before == pytest.approx(0.245, abs=0.01)
    assert after < 1e-3


def test_fp8_outlier_channels_question_1() -> None:
    out = run("fp8_outlier_channels.py")
    spread = "100x, ordinary spread over 5 decades"
    assert float(out[f"{spread} | tensorwise underflow %"]) > 20.0
    assert float(out[f"{spread} | 1x128 blocks underflow %"]) < 1.0
    extreme = "1e5x, Gaussian ordinary"
    gain = float(out[f"{extreme} | 1x128 blocks SQNR dB"]) - float(
        out[f"{extreme} | tensorwise SQNR dB"]
    )
    assert gain >= 10.0
    # At 100x with Gaussian values the SQNR barely moves: the error is relative.
    gauss = "100x, Gaussian ordinary"
    assert (
        abs(
            float(out[f"{gauss} | tensorwise SQNR dB"])
            - float(out[f"{gauss} | 1x128 blocks SQNR dB"])
        )
        < 2
    )


def test_attention_scaling_question_2() -> None:
    out = run("attention_scaling.py")
    u, s = "unscaled", "scaled by 1/sqrt(d_k)"
    assert float(out[f"{u} score std"]) > 10 and float(out[f"{s} score std"]) < 1.2
    assert (
        float(out[f"{u} mean max probability"])
        > 0.8
        > 0.3
        > float(out[f"{s} mean max probability"])
    )
    assert float(out[f"{u} mean entropy nats"]) < 0.5 and float(out[f"{s} mean entropy nats"]) > 3.0
    key = "rows with vanishing softmax gradient (Jacobian norm < 0.01)"
    assert float(out[f"{u} {key}"]) > 0.2 and float(out[f"{s} {key}"]) == 0.0


def test_async_nan_sentinel_counts_host_reads() -> None:
    """Lesson Q3: one host read per layer for the naive sentinel, one per step for the
    guard; a bad step is localized (the counts are asserted, never the times)."""
    out = run("async_nan_sentinel.py")
    layers = int(out["layers checked per step by the per-layer sentinel"])
    assert layers == 25
    assert float(out["host reads per step, per-layer isnan().any().item()"]) == layers
    assert float(out["host reads per step, guard"]) == 1
    assert int(out["host reads per healthy step, guard sync='deferred'"]) == 0
    assert out["steps with a read, guard sync='deferred'"] == "4 of 20"  # the snapshot steps
    assert out["bad step"].startswith("rolled_back, nonfinite_param")
    assert "nan born in 6 (param, param:weight)" in out["bad step"]
    assert float(out["time ratio per-layer / guard"]) > 0


def test_torchrun_guard_runs_alone_and_resumes(tmp_path: Path) -> None:
    """The torchrun example without torchrun: one rank; started again, it resumes (its
    launches under torchrun are tests/test_torchrun.py)."""
    out = tmp_path / "run"
    args = ["--out", str(out), "--snapshot-every", "2", "--nan-batch", "0:2"]

    def launch(steps: int) -> str:
        proc = subprocess.run(
            [sys.executable, str(EXAMPLES / "torchrun_guard.py"), *args, "--steps", str(steps)],
            capture_output=True, text=True, check=True, timeout=120,
        )  # fmt: skip
        return proc.stdout

    first = launch(6)
    assert "world size 1, attempt 0, starting at step 0" in first
    assert "step 2: skipped, nan in the input on rank 0" in first
    assert "rank 0: steps 0..6 (5 applied, 1 skipped, 0 rolled_back)" in first
    again = launch(8)
    assert "starting at step 5" in again  # the newest snapshot of the first run
    assert "rank 0: steps 5..8 (3 applied, 0 skipped, 0 rolled_back)" in again
