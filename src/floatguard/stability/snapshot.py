"""Snapshots for rollback: in memory, and atomically and verifiably on disk.

A snapshot holds deep copies of the model's and optimizer's state, any number of
other stateful objects (loss scaler, clipper, detectors: anything with
``state_dict`` / ``load_state_dict``), a step counter and the RNG states (torch
CPU and CUDA, numpy, Python). Restoring yields bit-identical state.

Words used here:

- *header*: what precedes a file's payload: a magic line, the payload's length, a
  SHA-256, and the file's *identity*: the step and the *run id* (32 hex digits naming
  one training run across its restarts; :mod:`.snapshot_folder` says whose it is). The
  SHA-256 covers the identity and the payload, so a flipped bit in either is caught.
- *format 1*: files written before identities (magic ``FLOATGUARD-SNAPSHOT 1``, no
  step, no run id in the header); still read, with no run id.
- *misnamed*: a file named ``snapshot-<step>.fgs`` that holds another step's snapshot
  (renamed, or swapped with another file); never loaded.
- *foreign*: a file written by another run than the one expected; refused, or skipped
  by :meth:`SnapshotStore.load_latest`, unless asked for on purpose.

On disk a snapshot file is the header and the payload (``torch.save`` of the state).
The write is atomic: serialise, write a temporary file in the same folder (its name
tagged with the writer's host, pid and start time), flush and fsync it,
``os.replace`` it over the target, fsync the folder; a crash at any point leaves the
old file or the new one, never a torn one. Loading checks the magic line, the length
and the checksum, then the identity, before ``torch.load(weights_only=True)`` (a
snapshot file cannot run code): a corrupted, truncated, misnamed, foreign or
non-snapshot file raises :class:`SnapshotError` naming the path and what is wrong.
:class:`SnapshotStore` keeps the last K snapshots of a run in a folder, removes what
interrupted saves left behind, and loads the newest good one.

Reading order: :class:`Snapshot`, :func:`load_snapshot`, :class:`SnapshotStore`.
"""

from __future__ import annotations

import copy
import errno
import io
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.utils._pytree import tree_flatten

from floatguard._safe_io import NotRegularFile, open_regular
from floatguard.stability._host_copy import HostCopy
from floatguard.stability._process import writer_tag
from floatguard.stability._snapshot_file import (
    HEAD_BYTES,
    ForeignSnapshotError,
    SnapshotError,
    check_name,
    check_run,
    declared,
    encode_header,
    read_identity,
    step_of,
    verified,
)
from floatguard.stability._snapshot_tree import (
    Stateful,
    _copy_into,
    _host_tree,
    _live_copy,
    _on_accelerator,
    written_early,
)

__all__ = [
    "ForeignSnapshotError",
    "Snapshot",
    "SnapshotError",
    "Stateful",
    "load_snapshot",
    "read_identity",
    "step_of",
]


RngKind = Literal["all", "torch"]


def _rng_state(kind: RngKind = "all") -> dict[str, Any]:
    """The RNG states: torch's (CPU, and every CUDA device's when CUDA is there) and,
    for ``kind="all"``, Python's ``random`` and NumPy's global generator (those two
    cost ~60 us a capture: NumPy builds its 624-word key anew)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if kind == "all":
        np_state: Any = np.random.get_state()
        state["python"] = [list(x) if isinstance(x, tuple) else x for x in random.getstate()]
        # numpy's state as plain values, so weights_only loading accepts it
        state["numpy"] = [
            str(np_state[0]),
            torch.from_numpy(np_state[1].astype(np.int64)),
            *map(float, np_state[2:]),
        ]
    return state


def _set_rng_state(state: dict[str, Any], kind: RngKind = "all") -> None:
    """Put back the RNG states ``state`` holds (``kind="torch"``: torch's only)."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if kind == "torch":
        return
    if "python" in state:
        py = state["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
    if "numpy" in state:
        n = state["numpy"]
        np.random.set_state(
            (n[0], n[1].numpy().astype(np.uint32), int(n[2]), int(n[3]), float(n[4]))
        )


SnapshotOn = Literal["auto", "host", "device"]


@dataclass
class Snapshot:
    """Saved training state; ``capture`` to take one, ``restore`` to go back to it."""

    step: int
    states: dict[str, Any]
    rng: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    # the run that wrote it (32 hex digits) when read from disk; None: saved without one
    run_id: str | None = None
    # names of states that held no tensor when captured (copied whole when reused)
    plain: set[str] = field(default_factory=set, repr=False, compare=False)
    # a host snapshot's copy from the device (None: the tensors were cloned where they are)
    copier: HostCopy | None = field(default=None, repr=False, compare=False)
    # a device snapshot's capture, wall seconds on the host (see copy_seconds)
    seconds: float | None = field(default=None, repr=False, compare=False)

    @property
    def on(self) -> str:
        """Where the snapshot's tensors are: ``"host"`` or ``"device"`` (their own)."""
        return "host" if self.copier is not None else "device"

    def fence(self) -> None:
        """Before the live state is overwritten (the optimizer step): the current stream
        waits for a host snapshot's copy still in flight (device-side, no host wait)."""
        if self.copier is not None:
            self.copier.fence()

    def wait(self) -> None:
        """Block until a host snapshot's copy is complete (before its buffers are read)."""
        if self.copier is not None:
            self.copier.wait()

    def copy_seconds(self) -> float | None:
        """What the last capture cost: a host snapshot's copy (device time from its
        events; None while it is in flight), else the capture's wall time on the host
        (the whole cost for a CPU state, whose copies are synchronous; the host's part,
        the walk and the launches, for an accelerator's)."""
        return self.copier.seconds() if self.copier is not None else self.seconds

    @classmethod
    def capture(
        cls,
        step: int,
        objects: dict[str, Stateful],
        *,
        rng: bool | RngKind = True,
        meta: dict[str, Any] | None = None,
        reuse: Snapshot | None = None,
        on: SnapshotOn = "device",
    ) -> Snapshot:
        """Deep-copy every object's ``state_dict()`` (tensors cloned) and the RNG states.

        ``reuse``: an earlier snapshot of the same objects, whose tensors are
        overwritten in place when the structure, shapes and dtypes still match (no
        allocation: a snapshot every few steps costs one copy of the state); it is
        returned updated. Otherwise a new snapshot is made.

        ``on``: ``"device"`` clones each tensor on its own device; ``"host"`` copies
        plain tensors into host buffers (pinned for CUDA sources, allocated once and
        reused) on a side stream, asynchronously (:class:`_host_copy.HostCopy`: call
        :meth:`fence` before the state is overwritten, :meth:`wait` before reading the
        buffers; :meth:`restore` and :meth:`save` wait themselves); ``"auto"``: host
        when a tensor is on an accelerator, else device. On the host a DTensor (an
        FSDP2 parameter) is kept as this rank's shard (its local part, with what
        rebuilds it); other tensor subclasses are deep-copied on their device.

        ``rng``: the RNG states kept with it: ``True`` (or ``"all"``) torch's, Python's
        and NumPy's; ``"torch"`` torch's only (CPU and CUDA; a tenth of the cost);
        ``False`` none.
        """
        began = time.perf_counter()
        states = {name: obj.state_dict() for name, obj in objects.items()}
        meta_d = dict(meta or {})
        if rng not in (True, False, "all", "torch"):
            raise ValueError(f"Snapshot.capture(rng={rng!r}); use True, False, 'all' or 'torch'")
        kind: RngKind = "torch" if rng == "torch" else "all"
        if on == "auto":
            on = "host" if _on_accelerator(states) else "device"
        if on not in ("host", "device"):
            raise ValueError(f"Snapshot.capture(on={on!r}); use 'host', 'device' or 'auto'")
        if reuse is not None and reuse.on == on:
            if _copy_into(reuse.states, states, reuse.plain, reuse.copier, objects):
                reuse.step, reuse.rng = step, (_rng_state(kind) if rng else None)
                reuse.meta = meta_d
                reuse.seconds = time.perf_counter() - began if on == "device" else None
                return reuse
            reuse.wait()  # a fresh snapshot follows: nothing may still write the old one
        # States that hold nothing but small Python values (a scaler's, a detector's) are
        # copied whole when reused; an optimizer's is not plain even before its first
        # step (its moments come then).
        plain = {
            n for n, (obj, st) in ((n, (objects[n], states[n])) for n in states)
            if not isinstance(obj, (torch.optim.Optimizer, torch.nn.Module))
            and not any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(st)[0])
        }  # fmt: skip
        rng_state = _rng_state(kind) if rng else None
        if on == "device":
            kept_here = copy.deepcopy(states)
            took = time.perf_counter() - began
            return cls(step, kept_here, rng_state, meta_d, plain=plain, seconds=took)
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        kept = {name: _host_tree(st, dst, src) for name, st in states.items()}
        copier = HostCopy()
        copier.start(dst, src, written_early(objects, src))
        return cls(step, kept, rng_state, meta_d, plain=plain, copier=copier)

    def restore(self, objects: dict[str, Stateful], *, rng: bool | RngKind = True) -> None:
        """Load every saved state back, and the RNG states it holds (``rng="torch"``:
        torch's only; False: none). Missing names raise KeyError."""
        missing = [n for n in objects if n not in self.states]
        if missing:
            raise KeyError(f"snapshot has no state for {missing}; it holds {sorted(self.states)}")
        self.wait()
        for name, obj in objects.items():
            obj.load_state_dict(_live_copy(self.states[name]))
        if self.rng is not None and rng:
            _set_rng_state(self.rng, "torch" if rng == "torch" else "all")

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write atomically to ``path`` (temp file, fsync, rename, fsync the folder),
        with a header holding the payload's length, the step and ``run_id``, and a
        SHA-256 over those and the payload. The payload is serialised in memory first
        (to checksum it): a save briefly holds one more copy of the state in host
        memory. The temp file's name carries the writer's host, pid and start time
        (:meth:`SnapshotStore.leftovers` never removes a live writer's)."""
        self.wait()
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        # (a host snapshot's DTensor shards are written as DTensors: rebuilt on their
        # device for the write, then let go)
        payload = {
            "step": self.step, "states": _live_copy(self.states, only_shards=True),
            "rng": self.rng, "meta": self.meta,
        }  # fmt: skip
        torch.save(payload, buf)
        data = buf.getbuffer()
        header = encode_header(self.step, self.run_id, data)
        fd, tmp = tempfile.mkstemp(
            prefix=f".{target.name}.{writer_tag()}.", suffix=".tmp", dir=target.parent
        )
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(header)
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(target.parent)
        return target


def _fsync_dir(folder: Path) -> None:
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _read_file(p: Path) -> bytes:
    """A snapshot file's bytes: without blocking, a regular file only, read only when its
    size is what its header declares (a FIFO, a device or a directory named like a
    snapshot, or a file truncated or padded, is SnapshotError before it is read)."""
    try:  # the header's length against the real size first: a padded file is not read
        with open_regular(p) as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(HEAD_BYTES)
            says = declared(head)
            if says is None:
                return head  # no snapshot header: verified() says why
            if says[0] + says[1] != size:
                raise SnapshotError(
                    f"{p}: truncated or padded snapshot ({size - says[0]} payload bytes, the "
                    f"header says {says[1]})"
                )
            return head + fh.read(size - len(head))
    except FileNotFoundError:
        raise FileNotFoundError(f"no snapshot at {p}") from None
    except NotRegularFile as e:
        raise SnapshotError(f"{e}: not a snapshot") from None
    except IsADirectoryError:
        raise SnapshotError(f"{p} is a directory, not a snapshot") from None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise SnapshotError(
            f"{p} is a link loop (links naming each other), not a snapshot"
        ) from None


def load_snapshot(
    path: str | os.PathLike[str],
    map_location: str | torch.device | None = None,
    *,
    run_id: str | None = None,
) -> Snapshot:
    """Read and verify a snapshot written by :meth:`Snapshot.save`.

    ``run_id``: the run the file must have been written by (None: any run, and a file
    without a run id). Checked in this order, before the payload is unpickled: the
    header, the length, the SHA-256 (over the identity and the payload), the step the
    file's name says (``snapshot-<step>.fgs``: a file holding another step is
    misnamed), then the run.

    Raises FileNotFoundError when there is no file, :class:`ForeignSnapshotError` for
    another run's file, and :class:`SnapshotError` (naming the path) when it is not a
    snapshot, is truncated, fails its checksum, is misnamed, or its payload does not
    load as one (``weights_only=True``: it cannot run code).
    """
    p = Path(path)
    step, run, data = verified(p, _read_file(p))
    if step is not None:  # a format 1 file's step is in its payload: checked below
        check_name(p, step)
    check_run(p, run, run_id)
    try:
        payload = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
        snap = Snapshot(
            int(payload["step"]),
            payload["states"],
            payload["rng"],
            payload.get("meta", {}),
            run_id=run,
        )
    except Exception as e:  # a payload that verifies but is not ours
        raise SnapshotError(
            f"{p}: the payload is not a floatguard snapshot ({type(e).__name__})"
        ) from None
    if step is not None and snap.step != step:
        raise SnapshotError(f"{p}: the header says step {step}, the payload {snap.step}")
    check_name(p, snap.step)
    return snap
