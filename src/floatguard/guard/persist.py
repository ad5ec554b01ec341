"""What the guard saves: the objects a snapshot holds, and the guard's own framework state dict."""

from __future__ import annotations

from typing import Any

__all__ = ["guard_state_dict", "load_guard_state_dict", "stateful_objects"]

_OPTIONAL = ("zclip", "loss_detector", "norm_detector")


def stateful_objects(
    model: Any, optimizer: Any, scaler: Any, scheduler: Any, zclip: Any,
    loss_detector: Any, norm_detector: Any,
) -> dict[str, Any]:  # fmt: skip
    """Everything a snapshot captures and a rollback restores, by the names snapshot
    files have always used (the optional ones only when configured)."""
    objs: dict[str, Any] = {"model": model, "optimizer": optimizer, "scaler": scaler}
    optional = {
        "scheduler": scheduler,
        "zclip": zclip,
        "loss_detector": loss_detector,
        "norm_detector": norm_detector,
    }
    objs.update({k: v for k, v in optional.items() if v is not None})
    return objs


def guard_state_dict(
    step_count: int, counters: dict[str, Any], parts: dict[str, Any]
) -> dict[str, Any]:
    """``{"step_count", "counters", "scaler", and "zclip" / "loss_detector" /
    "norm_detector" when configured}``: the keys ``Guard.state_dict`` has always had."""
    sd: dict[str, Any] = {
        "step_count": step_count,
        "counters": counters,
        "scaler": parts["scaler"].state_dict(),
    }
    for name in _OPTIONAL:
        if parts.get(name) is not None:
            sd[name] = parts[name].state_dict()
    return sd


def load_guard_state_dict(sd: dict[str, Any], parts: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Load the parts' states from ``sd``; the step count and counters to restore. A
    state saved by a guard set up differently is a ValueError naming what is missing."""
    missing = [n for n in _OPTIONAL if parts.get(n) is not None and n not in sd]
    if missing or "counters" not in sd:
        raise ValueError(
            f"Guard.load_state_dict: the state has no {missing or ['counters']}: it was "
            "saved by a guard set up differently"
        )
    parts["scaler"].load_state_dict(sd["scaler"])
    for name in _OPTIONAL:
        if parts.get(name) is not None:
            parts[name].load_state_dict(sd[name])
    return int(sd["step_count"]), dict(sd["counters"])
