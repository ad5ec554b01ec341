"""Each event kind's field types, and the check a read event passes before anything uses it.

A line valid in the envelope can still hold a field of the wrong type (``"loss":
"high"``, ``"action": 3``, a list where a number belongs): :func:`conform` names the
field, so the reader reports the line as unreadable instead of the diagnosis
treating ``"high"`` as a loss. A field a schema 1 file lacks (``op``, ``cause``,
``reproduced``, ...) is read as None: what is unknown, not an error. Unknown kinds
and fields are kept as they are (a newer writer's additions).

Types: ``num`` (an int or float, non-finite allowed; bool is not a number), ``int``,
``str``, ``bool``, ``list``, ``dict``. A ``?`` marks a field the writer may set to
null; any field may be missing or null in a file read back (then it is unknown: the
report and the diagnosis say so rather than guess).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["FIELD_TYPES", "STATS_TENSOR_TYPES", "conform_fields"]

FIELD_TYPES: dict[str, dict[str, str]] = {
    "run": {
        "precision": "str", "loss_scaling": "bool", "param_dtypes": "list",
        "optimizer": "str?", "world_size": "int", "clip": "dict?",
    },
    "step": {
        "action": "str", "reason": "str?", "loss": "num?", "grad_norm": "num?",
        "clip_coef": "num?", "scale": "num?", "lr_factor": "num?", "lr": "num?",
    },
    "fault": {
        "phase": "str", "module": "str?", "tensor": "str?", "kind_of_value": "str?",
        "shape": "list?", "op": "str?", "source": "str?", "deterministic": "bool?",
        "stats": "dict?", "fault_rank": "int?", "cause": "str?", "input_amax": "num?",
        "batch": "dict?",
    },
    "overflow": {"scale_before": "num?", "scale_after": "num?"},
    "spike": {"signal": "str?", "value": "num?", "reproduced": "bool?", "batch": "dict?"},
    "lr_backoff": {"factor": "num?"},
    "rollback": {"to_step": "int?", "rollbacks": "int?", "skip_batches": "int?", "cause": "str?"},
    "snapshot": {"where": "str?", "freed": "str?"},
    "snapshot_error": {"where": "str?", "error": "str?", "policy": "str?"},
    "snapshot_fallback": {"bad": "str?", "error": "str?", "used": "str?"},
    "resume": {
        "from_step": "int?",
        "path": "str?",
        "newest_step": "int?",
        "ranks_behind": "list?",
        "written_world_size": "int?",
        "run_id": "str?",
    },
    "warning": {"transients": "int?", "message": "str?", "code": "str?", "evidence": "dict?"},
    "stats": {"tensors": "list?"},
    "repro": {
        "path": "str?", "level": "str?", "bytes": "int?", "seconds": "num?",
        "tape_ops": "int?", "reproduced": "bool?",
    },
    "stop": {"reason": "str?", "fault": "str?"},
    "advice": {
        "recipe": "str", "budget": "num?", "keep": "list", "kept_share": "num?",
        "gap_all": "dict?", "gap_plan": "dict?", "expected": "dict?", "expected_plan": "dict?",
        "notes": "list?", "layers": "list",
    },
    "end": {
        "state_finite": "bool?", "nonfinite": "list?", "lr_factor": "num?", "lr": "num?",
        "scale": "num?",
    },
}  # fmt: skip
# Each entry of a stats event's ``tensors`` (floatguard.monitor.stats_view).
STATS_TENSOR_TYPES: dict[str, str] = {
    "module": "str", "role": "str", "numel": "int?", "amax": "num?", "nonfinite": "int?",
    "zeros": "int?", "formats": "dict?", "hist_from": "int?", "hist": "list?",
}  # fmt: skip
# A value this large is not a count or a step any run makes (and past float's range).
_HUGE_INT = 2**63


def _ok(value: Any, kind: str) -> bool:
    if value is None:
        return kind.endswith("?")
    base = kind.rstrip("?")
    if base == "num":
        return type(value) is float or (type(value) is int and abs(value) < _HUGE_INT)
    if base == "int":
        return type(value) is int and abs(value) < _HUGE_INT
    if base == "str":
        return isinstance(value, str)
    if base == "bool":
        return isinstance(value, bool)
    if base == "list":
        return isinstance(value, list)
    if base == "dict":
        return isinstance(value, dict)
    raise AssertionError(kind)


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _tensor_entry(entry: Any, i: int) -> str | None:
    """Why a stats tensor entry is unreadable, or None."""
    if not isinstance(entry, dict):
        return f"'tensors'[{i}] must be an object, got {_describe(entry)}"
    for name, kind in STATS_TENSOR_TYPES.items():
        if not _ok(entry.get(name), kind):
            got = _describe(entry.get(name))
            return f"'tensors'[{i}].{name} must be {kind.rstrip('?')}, got {got}"
    hist = entry.get("hist") or []
    if not all(type(c) is int and 0 <= c < _HUGE_INT for c in hist):
        return f"'tensors'[{i}].hist must hold counts (ints >= 0)"
    hist_from = entry.get("hist_from")
    if hist and (hist_from is None or abs(hist_from) > 10_000 or len(hist) > 10_000):
        return f"'tensors'[{i}]: hist_from {hist_from!r} / {len(hist)} bins out of range"
    formats = entry.get("formats") or {}
    for fmt, fit in formats.items():
        if not isinstance(fit, dict) or not all(_ok(v, "num?") for v in fit.values()):
            return f"'tensors'[{i}].formats.{fmt} must map names to numbers"
    return None


# The fields without which an event says nothing (every floatguard has written them):
# an event missing one is unreadable, never read as a guess.
REQUIRED: dict[str, tuple[str, ...]] = {
    "step": ("action",), "fault": ("phase",), "spike": ("signal",), "stop": ("reason",),
}  # fmt: skip


def conform_fields(kind: str, fields: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """``fields`` with every field of ``kind`` present (a missing one as None), and why
    the event is unreadable (a field of the wrong type, or one of :data:`REQUIRED`
    missing, named), or None. Unknown kinds pass as they are."""
    types = FIELD_TYPES.get(kind)
    if types is None:
        return fields, None
    out = dict(fields)
    for name, want in types.items():
        value = out.setdefault(name, None)  # missing or null: unknown (schema 1 lacks some)
        if value is not None and not _ok(value, want):
            return out, f"{kind} field {name!r} must be {want.rstrip('?')}, got {_describe(value)}"
    if (
        kind == "fault"
        and out["shape"] is not None
        and not all(type(d) is int and 0 <= d < _HUGE_INT for d in out["shape"])
    ):
        return out, f"fault field 'shape' must be a list of sizes, got {_describe(out['shape'])}"
    if (
        kind == "fault"
        and out["stats"] is not None
        and not all(_ok(v, "num?") for v in out["stats"].values())
    ):
        return out, "fault field 'stats' must map names to numbers"
    if kind == "stats":
        for i, entry in enumerate(out["tensors"] or []):
            why = _tensor_entry(entry, i)
            if why is not None:
                return out, f"stats event: {why}"
    for name in REQUIRED.get(kind, ()):
        if out[name] is None:
            return out, f"a {kind} event without its {name!r}"
    if kind == "step" and out["action"] not in ("applied", "skipped", "rolled_back"):
        return (
            out,
            "step field 'action' must be applied, skipped or rolled_back, got "
            + _describe(out["action"]),
        )
    return out, None


def finite(v: object) -> bool:
    """A finite number (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
