"""The command line: tables, JSON, and one red line with exit code 2 for user mistakes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from floatguard.cli import app
from floatguard.formats import FORMATS

runner = CliRunner()


def test_formats_table_lists_every_format() -> None:
    result = runner.invoke(app, ["formats"])
    assert result.exit_code == 0
    for name in FORMATS:
        assert name in result.output
    assert "65504" in result.output and "448" in result.output and "57344" in result.output


def test_formats_json() -> None:
    result = runner.invoke(app, ["formats", "--json"])
    rows = json.loads(result.output)
    assert [r["name"] for r in rows] == list(FORMATS)
    assert rows[3]["max"] == 65504.0


def test_explain_side_by_side() -> None:
    result = runner.invoke(app, ["explain", "0.1", "--format", "fp32,bf16,fp16,e4m3fn"])
    assert result.exit_code == 0, result.output
    assert "[0] [01111011] [1001101]" in result.output
    assert "0.10000000149011612" in result.output
    assert "0.1015625" in result.output


def test_explain_json() -> None:
    result = runner.invoke(app, ["explain", "1e-10", "-f", "fp16", "--json"])
    (row,) = json.loads(result.output)
    assert row["klass"] == "zero" and row["underflow"] is True


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "floatguard.cli", *args], capture_output=True, text=True, check=False
    )


@pytest.mark.subprocess
def test_user_mistakes_are_one_red_line_exit_2() -> None:
    for args, needle in [
        (("explain", "0.1", "--format", "e4m3fm"), "unknown format 'e4m3fm'; did you mean"),
        (("explain", "abc"), "cannot read 'abc' as a number"),
        (("explain", "1", "--format", ","), "--format is empty"),
    ]:
        proc = _run(*args)
        assert proc.returncode == 2, proc
        assert needle in proc.stderr
        assert "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) <= 2  # one line (may wrap once)
