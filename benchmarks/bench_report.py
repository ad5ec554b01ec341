"""`floatguard diagnose` and `floatguard report` on a generated log of a given size: wall
time and peak memory (RSS of the process; the import baseline, torch included, is
measured in the same run and printed beside it).

The log is a long fp16 run as the guard writes it: a step event per step, a snapshot
event every 5 steps, a stats sample (16 tensors) every 1,000 steps, a bad batch every
5,000 steps with its fault.

    python benchmarks/bench_report.py [--mb 200] [--keep PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from floatguard.events import encode_value


def generate(path: Path, size: int) -> int:
    """Write a log of about ``size`` bytes; the number of steps."""
    rng = random.Random(0)
    fmts = ("fp16", "bf16", "e4m3fn", "e5m2")
    tensors = [
        {"module": f"blocks.{i}.mlp.fc", "role": role, "numel": 4096, "amax": 1.5,
         "nonfinite": 0, "zeros": 3,
         "formats": {f: {"underflow": 0.001, "overflow": 0.0, "subnormal": 0.01} for f in fmts},
         "hist_from": -30, "hist": [rng.randint(0, 99) for _ in range(40)]}
        for i in range(8) for role in ("output[0]", "param:weight.grad")
    ]  # fmt: skip
    written, step = 0, 0
    with open(path, "w", encoding="utf-8") as fh:

        def w(kind: str, **fields: object) -> None:
            nonlocal written
            rec = {"schema": 2, "kind": kind, "step": step, "time": 1.7e9 + step, "rank": 0}
            line = json.dumps(encode_value({**rec, **fields}), allow_nan=False) + "\n"
            fh.write(line)
            written += len(line)

        w("run", precision="fp16", loss_scaling=True, param_dtypes=["float32"],
          optimizer="AdamW", world_size=1, clip={"kind": "zclip", "max_norm": 1.0})  # fmt: skip
        while written < size:
            bad = step % 5000 == 4999
            w("step", action="skipped" if bad else "applied",
              reason="nonfinite_input" if bad else None,
              loss=math.nan if bad else 2.0 / (1 + step / 1e4) + rng.random() * 0.01,
              grad_norm=rng.random() * 3, clip_coef=1.0, scale=65536.0, lr_factor=1.0)  # fmt: skip
            if bad:
                w("fault", phase="input", module="", tensor="input[0]", kind_of_value="nan",
                  shape=[8, 16], op="input", source="train.py:10", deterministic=True,
                  stats=None, fault_rank=None, cause="nonfinite_input",
                  input_amax=None)  # fmt: skip
            if step % 1000 == 0:
                w("stats", tensors=tensors)
            if step % 5 == 0:
                w("snapshot", where="memory")
            step += 1
    return step


def measure(code: str) -> tuple[float, float]:
    """(seconds, peak RSS MB) of a fresh Python process running ``code``."""
    probe = code + "\nimport resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    return time.perf_counter() - t, int(out.strip().splitlines()[-1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0)
    parser.add_argument("--keep", type=Path, default=None, help="write the log here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log = args.keep or Path(tmp) / "events.jsonl"
        steps = generate(log, int(args.mb * 1e6))
        mb = os.path.getsize(log) / 1e6
        base = measure("import floatguard.cli, floatguard.report, matplotlib.pyplot")
        diag = measure(
            "from floatguard.runlog import RunLog\nfrom floatguard.diagnose import diagnose\n"
            f"diagnose(RunLog.read([{str(log)!r}]))"
        )
        rep = measure(
            "from floatguard.report import render_report\n"
            f"render_report({str(log)!r}, {str(Path(tmp) / 'report')!r})"
        )
    print(f"# report/diagnose on a generated log: {mb:.0f} MB, {steps} steps")
    print()
    print("| run | seconds | peak RSS MB | above the import baseline MB |")
    print("|---|---:|---:|---:|")
    print(f"| import floatguard (torch, matplotlib) | {base[0]:.1f} | {base[1]:.0f} | 0 |")
    for name, (sec, rss) in (("diagnose", diag), ("report", rep)):
        print(f"| {name} | {sec:.1f} | {rss:.0f} | {rss - base[1]:.0f} |")


if __name__ == "__main__":
    main()
