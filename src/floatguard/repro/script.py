"""A repro bundle as a standalone PyTorch script (``floatguard repro BUNDLE --script``).

The script imports torch only (and the standard library), loads its tensors from a
``.pt`` file beside it (``torch.load(weights_only=True)``), and re-runs the bundle's
tape as straight-line aten calls (``aten.addmm.default(t1, t0, t3)``), the birth op
last: small enough to paste into a bug report to PyTorch or a kernel library. It
prints the op and its values and exits 1 when the non-finite value is born again,
0 when not. A bundle of a value that was already bad (a weight, an optimizer
state, an input) checks that value; a spike bundle re-runs the step and compares the
loss or gradient norm with the bar it crossed.

Everything written into the script comes from validated bundle values: op names of
the ``aten`` namespace, dtype / layout / memory-format names torch has, Python
literals written with ``repr``; a bundle cannot put code of its own into it.
"""

from __future__ import annotations

import io
import keyword
import math
import os
import re
from pathlib import Path
from typing import Any

import torch

from floatguard._safe_io import read_regular, replacing
from floatguard.repro.bundle import ReproBundle, ReproError
from floatguard.repro.ops import _DTYPES, _FORMATS, _LAYOUTS, op_named

__all__ = ["write_script"]


def _lit(value: Any, prefix: str = "t") -> str:
    """A tape argument as Python source (see :mod:`floatguard.repro.ops`); tensor
    slot ``s`` is the name ``{prefix}{s}``."""
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "float('nan')"
        if math.isinf(value):
            return "float('inf')" if value > 0 else "-float('inf')"
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_lit(v, prefix) for v in value) + "]"
    if isinstance(value, dict) and len(value) == 1:
        ((key, inner),) = value.items()
        if key == "t" and isinstance(inner, int) and not isinstance(inner, bool) and inner >= 0:
            return f"{prefix}{inner}"
        if key == "tuple" and isinstance(inner, list):
            body = ", ".join(_lit(v, prefix) for v in inner)
            return f"({body},)" if len(inner) == 1 else f"({body})"
        if key == "dtype" and inner in _DTYPES:
            return f"torch.{inner}"
        if key == "device" and isinstance(inner, str):
            return "dev"
        if key == "layout" and inner in _LAYOUTS:
            return f"torch.{inner}"
        if key == "memory_format" and inner in _FORMATS:
            return f"torch.{inner}"
        if key == "kwargs" and isinstance(inner, dict):
            items = (f"{_lit(str(k))}: {_lit(v, prefix)}" for k, v in inner.items())
            return "{" + ", ".join(items) + "}"
    raise ReproError(f"not a tape argument: {str(value)[:80]!r}")


def _call(op: dict[str, Any]) -> str:
    name = op.get("op")
    op_named(name)  # an aten op this torch has, or ReproError below
    args = op.get("args")
    kwargs = op.get("kwargs")
    if not (isinstance(args, dict) and isinstance(args.get("tuple"), list)):
        raise ReproError("an op's arguments are not a tuple")
    parts = [_lit(a) for a in args["tuple"]]
    kw = kwargs.get("kwargs") if isinstance(kwargs, dict) else None
    for k, v in (kw or {}).items():
        if not isinstance(k, str) or not k.isidentifier() or keyword.iskeyword(k):
            raise ReproError(f"not an argument name: {str(k)[:40]!r}")
        parts.append(f"{k}={_lit(v)}")
    _, packet, overload = str(name).split(".")
    return f"aten.{packet}.{overload}({', '.join(parts)})"


def _targets(out: Any, path: str = "") -> list[tuple[str, int]]:
    """(index path, slot) for each tensor an op's written output names."""
    if isinstance(out, dict) and "t" in out and isinstance(out["t"], int):
        return [(path, out["t"])]
    if isinstance(out, dict) and "tuple" in out:
        out = out["tuple"]
    if isinstance(out, list):
        found = []
        for i, v in enumerate(out):
            found.extend(_targets(v, f"{path}[{i}]"))
        return found
    return []


def _lines_of(tape: dict[str, Any], fault: dict[str, Any]) -> tuple[list[str], str | None]:
    """The script lines of a tape's ops, and the name holding the birth op's output."""
    lines: list[str] = []
    birth = tape.get("birth")
    birth_name = None
    for i, op in enumerate(tape.get("ops") or []):
        if not isinstance(op, dict):
            raise ReproError("a tape op that is not an op")
        call = _call(op)
        targets = _targets(op.get("out"))
        note = ""
        if i == birth:
            where = fault.get("module")
            where = "<root>" if where == "" else where
            note = f"  # <- the birth: {fault.get('kind')} in {where} ({fault.get('phase')})"
        if len(targets) == 1 and targets[0][0] == "":
            lines.append(f"t{targets[0][1]} = {call}{note}")
            name = f"t{targets[0][1]}"
        else:
            lines.append(f"o{i} = {call}{note}")
            lines.extend(f"t{slot} = o{i}{path}" for path, slot in targets)
            name = f"o{i}"
        if i == birth:
            birth_name = name
    return lines, birth_name


_CHECK = """

def stats(t):
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return repr(t)
    v = t.detach().float()
    fin = v[v.isfinite()]
    bad = (~v.isfinite()).nonzero()
    return (f"{str(t.dtype)[6:]}{list(t.shape)} nan={int(v.isnan().sum())} "
            f"+inf={int((v == float('inf')).sum())} -inf={int((v == -float('inf')).sum())} "
            + (f"finite in [{float(fin.min()):.6g}, {float(fin.max()):.6g}]"
               if fin.numel() else "no finite value")
            + (f" first non-finite at {[int(i) for i in bad[0].tolist()]}" if bad.numel() else ""))


def outputs(o):
    if isinstance(o, torch.Tensor):
        return [o]
    if isinstance(o, (list, tuple)):
        return [t for x in o for t in outputs(x)]
    return []


def born(o, kind):
    for t in outputs(o):
        if t.is_floating_point() and t.numel():
            if kind == "nan" and bool(t.isnan().any()):
                return True
            if kind != "nan" and bool(t.isinf().any()):
                return True
    return False
"""


_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

_REBUILD = """

def rebuild(tree, prefix):
    # The module's own class from its import path, without its __init__: its plain
    # attributes, parameters and buffers as recorded, its children likewise.
    import importlib
    mod, _, qual = tree["class"].partition(":")
    cls = importlib.import_module(mod)
    for part in qual.split("."):
        cls = getattr(cls, part)
    m = cls.__new__(cls)
    torch.nn.Module.__init__(m)
    for k, v in tree["attrs"].items():
        setattr(m, k, v)
    for k, present in tree["params"]:
        m.register_parameter(k, torch.nn.Parameter(T["s:" + prefix + k]) if present else None)
    for k, present, persistent in tree["buffers"]:
        m.register_buffer(k, T["s:" + prefix + k] if present else None, persistent=persistent)
    for k, child in tree["children"].items():
        m.add_module(k, rebuild(child, prefix + k + "."))
    return m
"""


def _tree_ok(tree: Any, depth: int = 0) -> bool:
    """A module tree a script may hold: import paths of dotted names, plain values."""
    if not isinstance(tree, dict) or depth > 32:
        return False
    mod, _, qual = str(tree.get("class")).partition(":")
    params, buffers = tree.get("params"), tree.get("buffers")
    if not isinstance(params, list) or not isinstance(buffers, list):
        return False
    entries_ok = all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[1], bool) for p in params
    ) and all(
        isinstance(b, list) and len(b) == 3 and all(isinstance(x, bool) for x in b[1:])
        for b in buffers
    )
    if not entries_ok:
        return False
    names_ok = all(
        isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k)
        for k in [*(tree.get("attrs") or {}), *(e[0] for e in [*params, *buffers])]
    )
    return (
        bool(_DOTTED.match(mod))
        and bool(_DOTTED.match(qual))
        and isinstance(tree.get("attrs"), dict)
        and names_ok
        and isinstance(tree.get("children"), dict)
        and all(
            isinstance(k, str) and k.isidentifier() and _tree_ok(c, depth + 1)
            for k, c in tree["children"].items()
        )
    )


def _plain_lit(v: Any) -> str:
    """A plain attribute value (numbers, strings, None, lists and tuples of them)."""
    if isinstance(v, float):
        return _lit(v)
    if v is None or isinstance(v, (bool, int, str)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_plain_lit(x) for x in v) + "]"
    if isinstance(v, tuple):
        body = ", ".join(_plain_lit(x) for x in v)
        return f"({body},)" if len(v) == 1 else f"({body})"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_plain_lit(k)}: {_plain_lit(x)}" for k, x in v.items()) + "}"
    raise ReproError(f"not a plain value: {str(v)[:80]!r}")


def _module_lines(
    module: dict[str, Any], fault: dict[str, Any], context: Any, tensors: dict[str, torch.Tensor]
) -> list[str]:
    """The script lines that call the birth module's own class (when importable where
    the script runs) on its recorded inputs; where the bundle cannot support that, a
    line that says why (the recorded ops follow either way)."""
    why = _class_step_missing(module, fault)
    if why is not None:
        return [f"print({('the module' + chr(39) + 's class is not re-run: ' + why)!r})", ""]
    tree, inputs, state = module["tree"], module["inputs"], module["state"]
    call = inputs["calls"]["kwargs"]
    args = _lit(call["args"], "m")
    kwargs = _lit(call["kwargs"], "m")
    leaves = inputs["leaves"]
    for k, t in state.items():
        tensors[f"s:{k}"] = t
    for slot, t in leaves.items():
        tensors[f"m{slot}"] = t
    auto = context.get("autocast") if isinstance(context, dict) else None
    cast = f"torch.autocast(dev.type, dtype=torch.{auto})" if auto in _DTYPES else None
    other = [str(o) for o in tree.get("other") or []]
    said = (
        f"the module holds attributes a bundle cannot write ({', '.join(other[:4])}): "
        "its class may not run without them"
    )
    caveat = [f"print({said!r})"] if other else []
    return [
        "# 1. The module's own class, from its import path, on the inputs it had.",
        *caveat,
        f"TREE = {_plain_lit(tree)}",
        *[f'm{s} = T["m{s}"].to(dev)' for s in sorted(leaves)],
        "try:",
        '    module = rebuild(TREE, "").to(dev)',
        f"    with {cast or 'contextlib.nullcontext()'}:",
        f"        out = module(*{args}, **{kwargs})",
        '    print("module", TREE["class"], "output:", *[stats(t) for t in outputs(out)])',
        '    if born(out, "nan") or born(out, "inf"):',
        '        print("reproduced by the module\'s own class:", TREE["class"],',
        f'              "- the birth:", {str(fault.get("op"))!r})',
        "        sys.exit(1)",
        '    print("the module\'s class gave no such value; the recorded ops follow")',
        "except Exception as e:  # not importable here, or built differently",
        '    print("the module\'s class cannot be used here (", type(e).__name__, e, ")",',
        '          "- the recorded ops follow")',
        "",
        "# 2. The ops the replay recorded, from the module's inputs to the birth.",
    ]


def _class_step_missing(module: dict[str, Any], fault: dict[str, Any]) -> str | None:
    """Why the module's class cannot be re-run from this bundle (None: it can)."""
    if fault.get("phase") != "forward":
        return f"the value was born in the {fault.get('phase')} pass, not the module's forward"
    tree, inputs, state = module.get("tree"), module.get("inputs"), module.get("state")
    if not _tree_ok(tree):
        return "the module's structure was not recorded in a form a script can hold"
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in state.items()
    ):
        return "its parameters and buffers were not recorded"
    if not isinstance(inputs, dict):
        return (
            "its call's inputs could not be written (an argument that is not a tensor, "
            "a number or a string: a cache object, a function)"
        )
    calls, leaves = inputs.get("calls"), inputs.get("leaves")
    call = calls.get("kwargs") if isinstance(calls, dict) else None
    if not isinstance(call, dict) or set(call) != {"args", "kwargs"}:
        return "its call's inputs were not recorded"
    if not isinstance(leaves, dict) or not all(
        isinstance(k, int) and isinstance(t, torch.Tensor) for k, t in leaves.items()
    ):
        return "its call's inputs were not recorded"
    try:
        _lit(call["args"], "m")
        _lit(call["kwargs"], "m")
    except ReproError:
        return "its call's inputs hold a value a script cannot write"
    return None


_FIRST_LINES = b'#!/usr/bin/env python3\n"""Repro of '


def _ours(script: Path) -> bool:
    """Whether ``script`` is a repro script :func:`write_script` wrote (its first line
    and docstring), so the tensors beside it are an earlier repro's too."""
    try:
        return read_regular(script, len(_FIRST_LINES)) == _FIRST_LINES
    except OSError:
        return False


def write_script(bundle: ReproBundle, path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write ``bundle`` as a standalone script at ``path`` and its tensors beside it
    (``path`` with the suffix ``.pt``); the two paths. :class:`ReproError` when the
    bundle holds nothing a script can re-run, or a directory, FIFO or device is at one
    of the two names. Each is written to a temp file and renamed over its name: a link
    there is replaced, never written through."""
    script = Path(path)
    if not script.name or script.name in (".", ".."):
        raise ReproError(f"--script {str(path)!r}: name the script file (repro.py)")
    data = script.with_suffix(".pt")
    for target in (script, data):  # (a link there is replaced below, never written through)
        if not target.is_symlink() and target.exists() and not target.is_file():
            raise ReproError(f"--script {path}: {target} exists and is not a regular file")
    if data.is_file() and not data.is_symlink() and not _ours(script):
        raise ReproError(
            f"--script {path}: {data} exists and is not an earlier repro's tensors (the "
            "script beside it is not a repro script); name the script otherwise "
            "(--script repro.py) so nothing of yours is replaced"
        )
    p = bundle.payload
    fault = bundle.fault or {}
    spike = bundle.spike
    head = [
        "#!/usr/bin/env python3",
        f'"""Repro of {_doc(bundle.describe())}.',
        "",
        f"Recorded by floatguard {_doc(str(p.get('floatguard')))} with torch "
        f"{_doc(str(p.get('torch')))} on {_doc(str(p.get('device')))}.",
    ]
    if fault.get("source"):
        head.append(f"Where: {_doc(str(fault.get('source')))}")
    recipes = (
        (p.get("context") or {}).get("emulation") if isinstance(p.get("context"), dict) else None
    )
    if recipes:
        head.append("Emulation (its quantization ops are among the ops below): ")
        head.extend(f"    {_doc(str(k))}: {_doc(str(v))}" for k, v in list(recipes.items())[:8])
    module = p.get("module") if isinstance(p.get("module"), dict) else None
    if module and module.get("class"):
        head.append(f"Module class: {_doc(str(module.get('class')))}")
    head += [
        "",
        "Run: python " + script.name + " [device]   (default: cpu)",
        "Exit status 1 when the non-finite value is born again, 0 when not.",
        f"Needs torch only; tensors from {data.name} beside this file.",
        '"""',
        "import sys",
        "from pathlib import Path",
        "",
        "import torch",
        "",
        "aten = torch.ops.aten",
        'dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")',
        f"T = torch.load(Path(__file__).with_name({data.name!r}),",
        '               map_location="cpu", weights_only=True)',
    ]
    tensors: dict[str, torch.Tensor] = {}
    body: list[str] = []
    value = p.get("value") if isinstance(p.get("value"), dict) else None
    kind = str(fault.get("kind") or "nan")
    op_name = str(fault.get("op"))
    if spike is None and value is not None and isinstance(value.get("tensor"), torch.Tensor):
        tensors["value"] = value["tensor"]
        body += [
            'v = T["value"].to(dev)',
            f"name = {str(value.get('name'))!r}",
            f'print("op:", {op_name!r}, "-", name, "(a value already there when the step ran)")',
            'print("value:", stats(v))',
            "bad = bool((~v.float().isfinite()).any())"
            + (f" or float(v.float().abs().max()) > {float(value['bound'])!r}"
               if isinstance(value.get("bound"), (int, float)) else ""),
            'print("reproduced" if bad else "not reproduced: the value is finite")',
            "sys.exit(1 if bad else 0)",
        ]  # fmt: skip
    else:
        if spike is None and module is not None:
            mod_lines = _module_lines(module, fault, p.get("context"), tensors)
            if any(k.startswith("s:") for k in tensors):
                head.insert(head.index("import sys"), "import contextlib")
            body += mod_lines
        tape = bundle.tape
        if tape is None and isinstance(p.get("single"), dict):
            single = p["single"]
            leaves = single.get("leaves") if isinstance(single.get("leaves"), dict) else {}
            free = max((k for k in leaves if isinstance(k, int)), default=-1) + 1
            tape = {
                "ops": [{"op": single.get("op"), "args": single.get("args"),
                         "kwargs": single.get("kwargs"), "out": {"t": free}}],
                "leaves": leaves,
                "birth": 0,
            }  # fmt: skip
        if tape is None:
            why = p.get("why_no_tape") or "the bundle holds no ops to re-run"
            raise ReproError(f"{bundle.path}: no script can be written: {why}")
        leaves = tape.get("leaves") or {}
        for s, t in leaves.items():
            if not isinstance(s, int) or not isinstance(t, torch.Tensor):
                raise ReproError("a tape leaf that is not a numbered tensor")
            tensors[f"t{s}"] = t
            body.append(f't{s} = T["t{s}"].to(dev)')
        lines, birth_name = _lines_of(tape, fault)
        body += lines
        if spike is not None:
            sig = str(spike.get("signal"))
            bar = spike.get("threshold")
            if sig == "loss" and isinstance(spike.get("loss_slot"), int):
                body.append(f"value = float(t{spike['loss_slot']}.double())")
            else:
                slots = [s for s in spike.get("grad_slots") or [] if isinstance(s, int)]
                norms = ", ".join(f"t{s}.double().norm()" for s in slots) or "torch.zeros(())"
                body.append(f"value = float(torch.stack([{norms}]).norm())")
            body += [
                f"bar = {float(bar)!r}" if isinstance(bar, (int, float)) else "bar = None",
                f"recorded = {float(spike.get('value') or math.nan)!r}".replace(
                    "nan", "float('nan')"
                ),
                f'print("{sig} spike: re-run value", value, "recorded", recorded, "bar", bar)',
                "near = abs(value - recorded) <= 1e-3 * abs(recorded)",
                "bad = value > bar if bar is not None else near",
                'print("reproduced" if bad else "not reproduced")',
                "sys.exit(1 if bad else 0)",
            ]
        elif birth_name is not None:
            body += [
                f'print("op:", {op_name!r})',
                f'print("output:", *[stats(t) for t in outputs({birth_name})])',
                f"bad = born({birth_name}, {kind!r})",
                f'print("reproduced: {kind} born by", {op_name!r} if bad else "not reproduced")',
                "sys.exit(1 if bad else 0)",
            ]
        else:
            body += [
                "print('the step ran through with no birth recorded: not reproduced')",
                "sys.exit(0)",
            ]
    rebuild = _REBUILD if any(k.startswith("s:") for k in tensors) else ""
    text = "\n".join(head) + "\n" + _CHECK + rebuild + "\n\n" + "\n".join(body) + "\n"
    script.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()  # (torch.save into a path it cannot open is a RuntimeError)
    torch.save({k: v.detach().clone() for k, v in tensors.items()}, buf)
    with replacing(data) as tmp:  # a temp file renamed over: a link is replaced
        tmp.write_bytes(buf.getvalue())
    with replacing(script) as tmp:
        tmp.write_text(text)
    return script, data


def _doc(text: str) -> str:
    """Text safe inside a triple-quoted docstring (no quotes, backslashes, newlines)."""
    return text.replace("\\", "/").replace('"', "'").replace("\n", " ")[:300]
