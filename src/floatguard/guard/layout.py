"""The world a snapshot was written in, and whether a resume in this one can load it.

A rank's snapshot holds its own part of the state. Under DDP every rank holds the
whole model, so a snapshot written by 4 ranks loads on 2 (the ``resume`` event says
the world changed). Under FSDP2 or tensor parallelism a rank holds DTensor shards
of a device mesh: loaded on another mesh they would be copied between meshes (torch
raises "Cannot run aten.copy_.default on inputs with different meshes", after the
guard's fit check passed, as global shapes agree). That is refused before anything
is touched, naming both worlds; torch.distributed.checkpoint reshards such a state
(save it with ``dcp.save`` and load it in the new world) where that is wanted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from floatguard._foreach import is_dtensor
from floatguard.stability.snapshot import SnapshotError

__all__ = ["check_layout", "layout_of"]


def layout_of(model: nn.Module, peers: Any) -> dict[str, Any]:
    """``{"world_size": int, "meshes": [str, ...]}``: this process's world size (1
    without torch.distributed) and the distinct DTensor meshes of the model's
    parameters, each as its shape and dimension names (``"(2, 2) ('dp', 'tp')"``)."""
    world = int(peers.world) if peers is not None else 1
    meshes: set[str] = set()
    for p in model.parameters():
        if is_dtensor(p):
            mesh = p.device_mesh  # type: ignore[attr-defined]
            names = getattr(mesh, "mesh_dim_names", None)
            meshes.add(f"{tuple(mesh.mesh.shape)} {tuple(names) if names else ()}")
    return {"world_size": world, "meshes": sorted(meshes)}


def _words(layout: dict[str, Any]) -> str:
    meshes = layout.get("meshes") or []
    on = f" on mesh {', '.join(meshes)}" if meshes else " (no DTensor mesh)"
    return f"{layout.get('world_size')} rank(s){on}"


def check_layout(written: Any, now: dict[str, Any], used: Path) -> int | None:
    """The world size ``used`` was written by (None: the snapshot does not say, an
    older floatguard's); SnapshotError before anything is loaded when it holds DTensor
    shards of another world or mesh than this one."""
    if not isinstance(written, dict):
        return None
    size = written.get("world_size")
    size = size if isinstance(size, int) else None
    then = [str(m) for m in written.get("meshes") or []]
    if (then or now["meshes"]) and (then != now["meshes"] or size != now["world_size"]):
        raise SnapshotError(
            f"{used} was written by {_words(written)}; this run has {_words(now)}: "
            "sharded (DTensor) state cannot be loaded on another mesh. Resume with the "
            "world and mesh that wrote it, or reshard through torch.distributed.checkpoint "
            "(dcp.save there, dcp.load here); nothing was loaded"
        )
    return size
