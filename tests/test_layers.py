"""The house's layers, checked: every import (top-level, inside functions, under
TYPE_CHECKING) runs down the layer table or across one layer, no import circle among
modules or packages, and no package imports another package's private names or
private modules (``floatguard._x`` modules are the whole library's plumbing)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import floatguard

SRC = Path(floatguard.__file__).resolve().parent

# Top to bottom: a package imports its own layer's packages (without a circle) or lower.
LAYERS: list[set[str]] = [
    {"cli"},
    {"floatguard", "integrations", "demo"},
    {"guard"},
    {"audit", "report", "advise"},
    {"diagnose", "monitor", "scaling", "stability", "gap"},
    {"emulation"},
    {"repro", "ops", "runlog", "stats", "formats", "batch_loss", "distributed"},
    {"events", "_event_schema", "_safe_io", "_values", "_foreach", "_native", "errors",
     "_version", "causes"},
]  # fmt: skip


def _modules() -> dict[str, Path]:
    out = {}
    for p in SRC.rglob("*.py"):
        parts = p.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _imports(mods: dict[str, Path]) -> list[tuple[str, str, str | None]]:
    """(importer, imported module, name imported from it or None), every import."""
    out = []
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [
                    (f"{base}.{a.name}", None) if f"{base}.{a.name}" in mods else (base, a.name)
                    for a in node.names
                ]
            else:
                continue
            for mod, attr in targets:
                while mod not in mods and "." in mod:
                    mod = mod.rsplit(".", 1)[0]
                if mod in mods and mod != name and mod.startswith("floatguard"):
                    out.append((name, mod, attr))
    return out


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "floatguard"


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one member (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


MODS = _modules()
IMPORTS = _imports(MODS)


def test_every_package_has_a_layer() -> None:
    placed = set().union(*LAYERS)
    assert {_package(m) for m in MODS} <= placed, {_package(m) for m in MODS} - placed


def test_imports_run_down_the_layers() -> None:
    layer = {p: i for i, ps in enumerate(LAYERS) for p in ps}
    upward = sorted({(a, b) for a, b, _ in IMPORTS if layer[_package(a)] > layer[_package(b)]})
    assert upward == [], f"imports up the layer table: {upward}"


def test_no_import_circle_among_modules_or_packages() -> None:
    modules: dict[str, set[str]] = defaultdict(set)
    packages: dict[str, set[str]] = defaultdict(set)
    for a, b, _ in IMPORTS:
        modules[a].add(b)
        if _package(a) != _package(b):
            packages[_package(a)].add(_package(b))
    assert _cycles(modules) == []
    assert _cycles(packages) == []


def test_no_package_imports_anothers_private_names() -> None:
    leaks = []
    for a, b, attr in IMPORTS:
        if _package(a) == _package(b):
            continue
        inner = b.split(".")[2:]  # below floatguard.<package>: floatguard._x is plumbing
        private_module = any(part.startswith("_") for part in inner)
        private_name = attr is not None and attr.startswith("_") and not attr.startswith("__")
        if private_module or private_name:
            leaks.append((a, b, attr))
    assert leaks == [], leaks


def test_the_checks_see_what_they_check() -> None:
    """The scan finds the imports it must (a test that cannot fail is a defect)."""
    pairs = {(a, b) for a, b, _ in IMPORTS}
    assert ("floatguard.guard.core", "floatguard.guard.judge") in pairs  # top level
    assert ("floatguard.audit", "floatguard.emulation") in pairs  # inside a function
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
