"""Regenerate docs/report.png: the demo's report, rendered from a relative log path (so
the page's "from" line shows ``floatguard-demo/events.jsonl``, not a temporary folder),
screenshotted in headless Chromium (Debian's ``chromium``).

    .venv/bin/python docs/report_png.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from floatguard.demo.run import run_demo
from floatguard.report import render_report

FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--virtual-time-budget=5000", "--window-size=1100,1500",
]  # fmt: skip


def main() -> None:
    target = Path(__file__).resolve().with_name("report.png")
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("chromium is not installed (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        run_demo(steps=400, log="floatguard-demo/events.jsonl")
        index = render_report(
            "floatguard-demo/events.jsonl", "floatguard-demo", title="floatguard demo (guarded)"
        )
        shot = Path(tmp) / "shot.png"
        subprocess.run(
            [browser, *FLAGS, f"--user-data-dir={tmp}/profile", f"--screenshot={shot}",
             index.resolve().as_uri()],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        shutil.copyfile(shot, target)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
