"""Source lines for a replay's births: the user's line in a stack, or in a node's anomaly trace."""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_DEMO = os.path.join(_HERE, "demo")


def _user_frame(frames: list[traceback.FrameSummary]) -> str | None:
    for fr in reversed(frames):
        path = os.path.abspath(fr.filename)
        ours = path.startswith(_HERE) and not path.startswith(_DEMO)  # the demo is user code
        if path.startswith(_TORCH) or ours or "<frozen" in fr.filename:
            continue
        line = (fr.line or "").strip()
        return f"{fr.filename}:{fr.lineno}: {line}"
    return None


def _engine_frame(frames: list[traceback.FrameSummary]) -> str | None:
    """The user's frame among those the autograd engine called (hooks, backward())."""
    starts = [i for i, fr in enumerate(frames) if fr.name == "_engine_run_backward"]
    return _user_frame(frames[starts[-1] + 1 :]) if starts else None


def _from_anomaly_trace(node: Any) -> str | None:
    # Expects anomaly mode's record of where the node was made (torch/csrc/autograd/
    # python_anomaly_mode.cpp, PyAnomalyMetadata::store_stack): node.metadata's
    # "traceback_", the list of strings torch.fx.traceback.format_stack() returns (older
    # torch: traceback.format_stack()), one '  File "<path>", line <n>, in <name>\n'
    # plus '    <code>\n' (absent when the source is unknown) per frame; with fx's node
    # meta preserved, one string of such frames (fx's "stack_trace").
    meta = getattr(node, "metadata", None)
    text = meta.get("traceback_") if isinstance(meta, dict) else None
    if not text:
        return None
    blob = "".join(text if isinstance(text, list) else [text])
    parsed: list[traceback.FrameSummary] = []
    for chunk in blob.split('  File "')[1:]:
        head, _, rest = chunk.partition("\n")
        fname, _, tail = head.partition('", line ')
        try:
            lineno = int(tail.split(",")[0])
        except ValueError:
            continue
        parsed.append(traceback.FrameSummary(fname, lineno, "", line=rest.split("\n")[0].strip()))
    return _user_frame(parsed)
