"""Snapshots for rollback: in memory, and atomically on disk.

A snapshot holds deep copies of the model's and optimizer's state, any number of
other stateful objects (loss scaler, clipper, detectors: anything with
``state_dict`` / ``load_state_dict``), a step counter and the RNG states (torch
CPU and CUDA, numpy, Python). Restoring yields bit-identical state.

On disk the write is atomic: serialise to a temporary file in the same folder,
flush and fsync it, ``os.replace`` it over the target, fsync the folder. A crash
at any point leaves either the old file or the new one, never a torn one.
Loading uses ``torch.load(weights_only=True)``: a snapshot file cannot run code.
"""

from __future__ import annotations

import copy
import os
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["Snapshot", "Stateful", "load_snapshot"]


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


def _rng_state() -> dict[str, Any]:
    np_state: Any = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [list(x) if isinstance(x, tuple) else x for x in random.getstate()],
        # numpy's state as plain values, so weights_only loading accepts it
        "numpy": [
            str(np_state[0]),
            torch.from_numpy(np_state[1].astype(np.int64)),
            *map(float, np_state[2:]),
        ],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), int(n[2]), int(n[3]), float(n[4])))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _copy_into(
    old: dict[str, Any], new: dict[str, Any], plain: set[str], flat: dict[str, Any]
) -> bool:
    """Copy each object's new state into the old state's tensors when the structure,
    shapes and dtypes match; True when done for every object. The states named in
    ``plain`` held no tensor (scalers, detectors): they are replaced by copies.
    ``flat`` caches the old nested states' (leaves, spec), kept up to date here."""
    if old.keys() != new.keys():
        return False
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    rebuilt: dict[str, Any] = {}
    for name, state in new.items():
        if name in plain:
            rebuilt[name] = copy.deepcopy(state)
            continue
        names_to_tensors = _flat_tensors(state)
        if names_to_tensors is not None:  # a model's state_dict
            before = old[name]
            if not isinstance(before, dict) or before.keys() != state.keys():
                return False
            pairs = [(before[k], v) for k, v in state.items()]
        else:
            if name not in flat:
                flat[name] = tree_flatten(old[name])
            old_leaves, old_spec = flat[name]
            new_leaves, new_spec = tree_flatten(state)
            if old_spec != new_spec:
                return False
            pairs = []
            others_same = True
            for a, b in zip(old_leaves, new_leaves, strict=True):
                if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                    pairs.append((a, b))
                elif others_same and a != b:
                    others_same = False
            if not others_same:  # a learning rate changed, say: new plain leaves
                leaves = [
                    a if isinstance(a, torch.Tensor) else copy.deepcopy(b)
                    for a, b in zip(old_leaves, new_leaves, strict=True)
                ]
                rebuilt[name] = tree_unflatten(leaves, old_spec)
                flat[name] = (leaves, old_spec)
        for a, b in pairs:
            if not (
                type(a) is torch.Tensor and type(b) is torch.Tensor
                and a.shape == b.shape and a.dtype == b.dtype
            ):  # fmt: skip
                return False
            dst.append(a)
            src.append(b)
    try:
        with torch.no_grad():
            if dst:
                # (a device or layout change raises here: then a fresh snapshot is made)
                torch._foreach_copy_(dst, src)
    except RuntimeError:
        return False
    old.update(rebuilt)
    return True


def _flat_tensors(state: Any) -> dict[str, torch.Tensor] | None:
    """``state`` when it maps names to tensors only (a module's state_dict), else None."""
    if isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values()):
        return state
    return None


@dataclass
class Snapshot:
    """Saved training state; ``capture`` to take one, ``restore`` to go back to it."""

    step: int
    states: dict[str, Any]
    rng: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    # names of states that held no tensor when captured (copied whole when reused)
    plain: set[str] = field(default_factory=set, repr=False, compare=False)
    _flat: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def capture(
        cls,
        step: int,
        objects: dict[str, Stateful],
        *,
        rng: bool = True,
        meta: dict[str, Any] | None = None,
        reuse: Snapshot | None = None,
    ) -> Snapshot:
        """Deep-copy every object's ``state_dict()`` (tensors cloned) and the RNG states.

        ``reuse``: an earlier snapshot of the same objects, whose tensors are
        overwritten in place when the structure, shapes and dtypes still match (no
        allocation: a snapshot every few steps costs one copy of the state); it is
        returned updated. Otherwise a new snapshot is made.
        """
        states = {name: obj.state_dict() for name, obj in objects.items()}
        meta_d = dict(meta or {})
        if reuse is not None and _copy_into(reuse.states, states, reuse.plain, reuse._flat):
            reuse.step, reuse.rng, reuse.meta = step, (_rng_state() if rng else None), meta_d
            return reuse
        # States that hold nothing but small Python values (a scaler's, a detector's) are
        # copied whole when reused; an optimizer's is not plain even before its first
        # step (its moments come then).
        plain = {
            n for n, (obj, st) in ((n, (objects[n], states[n])) for n in states)
            if not isinstance(obj, (torch.optim.Optimizer, torch.nn.Module))
            and not any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(st)[0])
        }  # fmt: skip
        return cls(step, copy.deepcopy(states), _rng_state() if rng else None, meta_d, plain)

    def restore(self, objects: dict[str, Stateful]) -> None:
        """Load every saved state back (and the RNG states). Missing names raise KeyError."""
        missing = [n for n in objects if n not in self.states]
        if missing:
            raise KeyError(f"snapshot has no state for {missing}; it holds {sorted(self.states)}")
        for name, obj in objects.items():
            obj.load_state_dict(copy.deepcopy(self.states[name]))
        if self.rng is not None:
            _set_rng_state(self.rng)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write atomically to ``path`` (temp file, fsync, rename, fsync the folder)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        payload = {"step": self.step, "states": self.states, "rng": self.rng, "meta": self.meta}
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                torch.save(payload, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return target


def load_snapshot(
    path: str | os.PathLike[str], map_location: str | torch.device | None = None
) -> Snapshot:
    """Read a snapshot written by :meth:`Snapshot.save` (``weights_only=True``)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no snapshot at {p}")
    payload = torch.load(p, map_location=map_location, weights_only=True)
    return Snapshot(
        int(payload["step"]), payload["states"], payload["rng"], payload.get("meta", {})
    )
