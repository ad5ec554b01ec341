"""Every Python block of the README (and of docs/*.md) runs as written, so none can rot.

Each ```python block is executed on its own, in a fresh namespace, in a temporary
working directory (what it writes stays there). A first line ``# requires: a, b`` runs
the block only where those modules import (the optional extras); ``# sketch: see
PATH`` marks a block that is not a complete program, and PATH must be a file of the
repository that the tests run (an example script).
"""

from __future__ import annotations

import linecache
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
REQUIRES = re.compile(r"#\s*requires:\s*(.+)")
SKETCH = re.compile(r"#\s*sketch:\s*see\s+(\S+)")


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """(line of the opening fence, code) of each ```python block of ``page``."""
    text = page.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in FENCE.finditer(text)]


BLOCKS = [(page, line, code) for page in PAGES for line, code in python_blocks(page)]


def test_the_readme_has_python_blocks() -> None:
    """The parser finds the README's blocks: a broken one cannot make the suite vacuous."""
    assert len(python_blocks(ROOT / "README.md")) >= 5  # ten today


@pytest.mark.parametrize(
    ("page", "line", "code"),
    BLOCKS,
    ids=[f"{page.relative_to(ROOT)}:{line}" for page, line, _ in BLOCKS],
)
def test_block_runs(
    page: Path, line: int, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = code.splitlines()[0] if code.strip() else ""
    sketch = SKETCH.match(first)
    if sketch:
        target = ROOT / sketch.group(1)
        assert target.is_file(), f"{page.name}:{line}: the sketch points to {target}, missing"
        tested = " ".join(p.read_text(encoding="utf-8") for p in (ROOT / "tests").glob("*.py"))
        assert target.name in tested, f"{page.name}:{line}: no test runs {target.name}"
        return
    requires = REQUIRES.match(first)
    for module in requires.group(1).split(",") if requires else []:
        pytest.importorskip(module.strip())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a block builds models from configs only
    name = f"{page.relative_to(ROOT)}:{line}"
    # Tracebacks (and the replay's source lines) show the block's own text.
    linecache.cache[name] = (len(code), None, code.splitlines(keepends=True), name)
    try:
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
    finally:
        linecache.cache.pop(name, None)
        _leave_no_process_group()


def _leave_no_process_group() -> None:
    """A block that failed before tearing down its torch.distributed group leaves none."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
