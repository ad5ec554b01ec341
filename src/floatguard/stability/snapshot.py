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
import dataclasses
import errno
import io
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch
from torch.utils._pytree import tree_flatten

from floatguard._foreach import is_dtensor
from floatguard._safe_io import NotRegularFile, read_regular
from floatguard.stability._host_copy import HostCopy, HostShard, host_buffer
from floatguard.stability._process import writer_gone, writer_tag
from floatguard.stability._snapshot_file import (
    TEMP_NAME,
    ForeignSnapshotError,
    SnapshotError,
    check_name,
    check_run,
    encode_header,
    read_identity,
    run_bytes,
    step_of,
    verified,
)

__all__ = [
    "ForeignSnapshotError",
    "Snapshot",
    "SnapshotError",
    "SnapshotStore",
    "Stateful",
    "load_snapshot",
    "read_identity",
    "step_of",
]


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


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


_ATOMS = (int, float, str, bool, type(None))


def _copy_plain(v: Any) -> Any:
    """A deep copy of a state made of dicts, lists and tuples of plain values (a
    detector's window, a scaler's counters), without :func:`copy.deepcopy`'s memo;
    anything else through it."""
    if type(v) in _ATOMS:
        return v
    if type(v) is list:  # (a detector's window: floats, copied without a call each)
        return [x if type(x) in _ATOMS else _copy_plain(x) for x in v]
    if type(v) is dict:
        return {k: x if type(x) in _ATOMS else _copy_plain(x) for k, x in v.items()}
    if type(v) is tuple:
        return tuple(_copy_plain(x) for x in v)
    return copy.deepcopy(v)


def _same_plain(a: Any, b: Any) -> bool:
    """Two non-tensor leaves are the same value (NaN counts as changed: copied again)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # an object without a plain truth value: copy it
        return False


_NESTED = (torch.Tensor, dict, list, tuple)


def _pair_up(old: Any, new: Any, dst: list[torch.Tensor], src: list[torch.Tensor]) -> bool:
    """Walk ``old`` (this snapshot's copy) and ``new`` (a live state) together: their
    tensors paired into ``dst``/``src``, a changed plain value (a learning rate) copied
    into ``old`` in place; False when the structure, a shape or a dtype differs (or a
    tensor is a subclass: a fresh snapshot deep-copies it)."""
    tensor = torch.Tensor
    if type(new) is tensor:
        if type(old) is not tensor or old.dtype != new.dtype or old.shape != new.shape:
            return False
        dst.append(old)
        src.append(new)
        return True
    if type(old) is HostShard:  # a host snapshot's DTensor shard
        if not is_dtensor(new) or not old.fits(new):
            return False
        dst.append(old.local)
        with torch.no_grad():
            src.append(new.to_local())
        return True
    if isinstance(new, dict):  # a module's state_dict is an OrderedDict
        if type(old) is not type(new) or old.keys() != new.keys():
            return False
        for k, v in new.items():
            if type(v) is tensor:  # the common leaf, paired without a call
                o = old[k]
                if type(o) is not tensor or o.dtype != v.dtype or o.shape != v.shape:
                    return False
                dst.append(o)
                src.append(v)
            elif isinstance(v, _NESTED):
                if not _pair_up(old[k], v, dst, src):
                    return False
            elif not _same_plain(old[k], v):
                old[k] = _copy_plain(v)
        return True
    if type(new) is list:
        if type(old) is not list or len(old) != len(new):
            return False
        for i, v in enumerate(new):
            if isinstance(v, _NESTED):
                if not _pair_up(old[i], v, dst, src):
                    return False
            elif not _same_plain(old[i], v):
                old[i] = _copy_plain(v)
        return True
    if type(new) is tuple:  # immutable: its plain values must be the same
        if type(old) is not tuple or len(old) != len(new):
            return False
        for o, v in zip(old, new, strict=True):
            if isinstance(v, _NESTED):
                if not _pair_up(o, v, dst, src):
                    return False
            elif not _same_plain(o, v):
                return False
        return True
    return False  # a tensor subclass or another container: a fresh snapshot copies it


def _copy_into(
    old: dict[str, Any],
    new: dict[str, Any],
    plain: set[str],
    copier: HostCopy | None = None,
    new_objects: dict[str, Stateful] | None = None,
) -> bool:
    """Copy each object's new state into the old state's tensors when the structure,
    shapes and dtypes match (one ``torch._foreach_copy_``; with ``copier``, the host
    snapshot's copy, asynchronous from an accelerator); True when
    done for every object (on False the old state may be half updated: the caller
    makes a fresh snapshot). The states named in ``plain`` held no tensor (scalers,
    detectors): they are replaced by copies."""
    if old.keys() != new.keys():
        return False
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    rebuilt: dict[str, Any] = {}
    for name, state in new.items():
        if name in plain:
            rebuilt[name] = _copy_plain(state)
        elif not _pair_up(old[name], state, dst, src):
            return False
    try:
        if copier is not None:
            copier.start(dst, src, written_early(new_objects, src) if new_objects else None)
        else:
            with torch.no_grad():
                if dst:
                    # (a device or layout change raises here: then a fresh snapshot is made)
                    torch._foreach_copy_(dst, src)
    except RuntimeError:
        return False
    old.update(rebuilt)
    return True


def written_early(objects: dict[str, Stateful], src: list[torch.Tensor]) -> list[bool] | None:
    """Which of ``src`` the next forward writes in place: the modules' buffers (by
    memory; None when there are none), for :meth:`HostCopy.start`'s ``early``."""
    with torch.no_grad():  # (a DTensor buffer by its local part, as the copy has it)
        ptrs = {
            (b.to_local() if is_dtensor(b) else b).data_ptr()  # type: ignore[attr-defined]
            for m in objects.values() if isinstance(m, torch.nn.Module)
            for b in m.buffers()
        }  # fmt: skip
    if not ptrs:
        return None
    return [s.data_ptr() in ptrs for s in src]


def _host_tree(v: Any, dst: list[torch.Tensor], src: list[torch.Tensor]) -> Any:
    """A copy of a state with every plain tensor replaced by a new host buffer, and
    every DTensor by a :class:`HostShard` of its local part (the buffers and sources
    paired into ``dst``/``src`` for the copy); other tensor subclasses and other
    leaves deep-copied where they are."""
    if type(v) is torch.Tensor:
        buf = host_buffer(v)
        dst.append(buf)
        src.append(v)
        return buf
    if is_dtensor(v):
        shard = HostShard(v)
        dst.append(shard.local)
        with torch.no_grad():
            src.append(v.to_local())
        return shard
    if isinstance(v, dict):
        out = copy.copy(v)  # keeps an OrderedDict's type
        for k, x in v.items():
            out[k] = _host_tree(x, dst, src)
        return out
    if type(v) in (list, tuple):
        return type(v)(_host_tree(x, dst, src) for x in v)
    return _copy_plain(v)


def _has_shard(v: Any) -> bool:
    if type(v) is HostShard:
        return True
    if isinstance(v, dict):
        return any(_has_shard(x) for x in v.values())
    if type(v) in (list, tuple):
        return any(_has_shard(x) for x in v)
    return False


def _live_copy(v: Any, *, only_shards: bool = False) -> Any:
    """A state as ``load_state_dict`` takes it: a deep copy (nothing aliases the
    snapshot), each :class:`HostShard` rebuilt as its DTensor. ``only_shards``: the
    rest is not copied (for a write). A state without shards is one ``deepcopy``."""
    if not _has_shard(v):
        return v if only_shards else copy.deepcopy(v)
    if type(v) is HostShard:
        return v.rebuild()
    if isinstance(v, dict):
        out = copy.copy(v)
        for k, x in v.items():
            out[k] = _live_copy(x, only_shards=only_shards)
        return out
    if type(v) in (list, tuple):
        return type(v)(_live_copy(x, only_shards=only_shards) for x in v)
    return v if only_shards else copy.deepcopy(v)


def _on_accelerator(v: Any) -> bool:
    """Whether a tensor in ``v`` (dicts, lists, tuples) is on an accelerator (the walk
    stops at the first tensor found there)."""
    if isinstance(v, torch.Tensor):
        return v.device.type != "cpu"
    if isinstance(v, dict):
        return any(_on_accelerator(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_on_accelerator(x) for x in v)
    return False


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
    """A snapshot file's bytes: without blocking, a regular file only, no further than
    its size (a FIFO, a device or a directory named like a snapshot is SnapshotError)."""
    try:
        return read_regular(p)
    except FileNotFoundError:
        raise FileNotFoundError(f"no snapshot at {p}") from None
    except NotRegularFile as e:
        raise SnapshotError(f"{e}: not a snapshot") from None
    except IsADirectoryError:
        raise SnapshotError(f"{p} is a directory, not a snapshot") from None


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


_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)  # a full disk, a full quota


class SnapshotStore:
    """The last ``keep`` snapshots of a run in ``folder``: ``snapshot-<step>.fgs``.

    ``run_id``: the run whose snapshots these are (None: a store without run ids).
    :meth:`save` stamps it in each file's header; :meth:`load_latest` skips files of
    other runs; only the run's own files count toward ``keep`` and are removed (another
    run's files, and files that are not snapshots, are left alone).

    ``exclusive``: the store's user holds the folder's lock (see
    :class:`~floatguard.stability.snapshot_folder.FolderLock`): no other process writes
    there, so any temp file of another process is a leftover. Otherwise only those of
    a writer known to be gone are (a dead pid of this host; a file from an older
    floatguard), and two stores writing one folder never remove each other's.

    :meth:`save` first removes the leftovers of interrupted saves (``.snapshot-*.tmp``;
    never read as snapshots), writes atomically, then removes the run's oldest
    snapshots beyond ``keep``. :meth:`load_latest` returns the newest one that
    verifies, and says which newer ones did not and why.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        keep: int = 2,
        *,
        run_id: str | None = None,
        exclusive: bool = False,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"SnapshotStore(keep={keep!r}) must be an int >= 1")
        run_bytes(run_id)  # a malformed run id is refused here, not at the first save
        self.folder = Path(folder)
        self.keep = keep
        self.run_id = run_id
        self.exclusive = exclusive
        self.freed: Path | None = None  # what the last save removed for room

    def path_for(self, step: int) -> Path:
        """``snapshot-<step>.fgs``, the step with at least 9 digits (more when it needs them)."""
        return self.folder / f"snapshot-{step:09d}.fgs"

    def paths(self) -> list[Path]:
        """The snapshot files (of any run), newest (highest step) first."""
        if not self.folder.is_dir():
            return []
        found = [(s, p) for p in self.folder.iterdir() if (s := step_of(p.name)) is not None]
        return [p for _, p in sorted(found, key=lambda sp: sp[0], reverse=True)]

    def own(self) -> list[Path]:
        """This run's snapshot files (by their header: the run id, and the step their
        name says), newest first."""
        mine = []
        for p in self.paths():
            ident = read_identity(p)
            if ident is None or ident[1] != self.run_id:
                continue
            if ident[0] is None or ident[0] == step_of(p.name):  # not a misnamed one
                mine.append(p)
        return mine

    def leftovers(self) -> list[Path]:
        """Temporary files of interrupted saves (never this process's own: it may be
        writing one in another thread)."""
        if not self.folder.is_dir():
            return []
        me = writer_tag()
        out = []
        for p in self.folder.iterdir():
            if not p.name.startswith(".snapshot-"):
                continue
            m = TEMP_NAME.match(p.name)
            tag = m.group(1) if m else None
            if tag != me and (self.exclusive or writer_gone(tag)):
                out.append(p)
        return out

    def save(self, snapshot: Snapshot) -> Path:
        """Write ``snapshot`` as this run's (its run id set to the store's; the
        snapshot given is not changed), then prune the run's files beyond ``keep``.
        A write the disk has no room for (ENOSPC, EDQUOT) removes the run's oldest
        snapshot that is not its newest verified one and is tried once more;
        :attr:`freed` names the file removed (None when none was)."""
        for p in self.leftovers():
            p.unlink(missing_ok=True)
        stamped = dataclasses.replace(snapshot, run_id=self.run_id)
        self.freed = None
        try:
            path = stamped.save(self.path_for(snapshot.step))
        except OSError as e:
            if e.errno not in _NO_ROOM or (room := self._room_for(snapshot.step)) is None:
                raise
            room.unlink()
            self.freed = room
            try:
                path = stamped.save(self.path_for(snapshot.step))  # once more
            except OSError as again:
                why = f"{again.strerror}, even after removing {room.name} to make room"
                raise OSError(again.errno, why) from again
        for old in self.own()[self.keep :]:
            old.unlink(missing_ok=True)
        return path

    def _room_for(self, step: int) -> Path | None:
        """The file to remove when a save finds the disk full: the run's oldest
        snapshot, never its newest one that verifies (the resume point), nor the file
        being written. None when there is no such file."""
        own = self.own()
        newest_good = None
        for p in own:  # (the file being replaced counts: it may be the resume point)
            try:
                verified(p, _read_file(p))
            except (SnapshotError, OSError):
                continue
            newest_good = p
            break
        spare = [p for p in own if p != newest_good and step_of(p.name) != step]
        return spare[-1] if spare else None

    def load_latest(
        self, map_location: str | torch.device | None = None, *, foreign: bool = False
    ) -> tuple[Snapshot, Path, list[tuple[Path, str]]]:
        """(snapshot, its path, [(newer path passed over, why)]): the newest file that
        verifies, is not misnamed, and is this run's (``foreign=True``: any run's).
        SnapshotError when there is none, with every file's reason."""
        bad: list[tuple[Path, str]] = []
        expected = None if foreign else self.run_id
        for p in self.paths():
            try:
                return load_snapshot(p, map_location, run_id=expected), p, bad
            except (SnapshotError, OSError) as e:
                bad.append((p, str(e)))
        why = "; ".join(f"{p.name}: {e}" for p, e in bad) or "the folder holds none"
        raise SnapshotError(f"no good snapshot in {self.folder} ({why})")

    def verify_all(
        self, *, foreign: bool = False
    ) -> tuple[list[tuple[int, Path]], list[tuple[Path, str]]]:
        """([(step, path)] of the files that pass what :func:`load_snapshot` checks
        before unpickling: header, length, SHA-256, the name's step and the run (any
        run's with ``foreign=True``), [(path, why)] of the others), newest first. Each
        file is read whole, one at a time; nothing is unpickled (a format 1 file's
        step is its name's, checked against its payload when it is loaded)."""
        good: list[tuple[int, Path]] = []
        bad: list[tuple[Path, str]] = []
        expected = None if foreign else self.run_id
        for p in self.paths():
            try:
                step, run, _ = verified(p, _read_file(p))
                if step is not None:
                    check_name(p, step)
                check_run(p, run, expected)
            except (SnapshotError, OSError) as e:
                bad.append((p, str(e)))
                continue
            named = step_of(p.name)
            assert named is not None  # paths() lists named files only
            good.append((named, p))
        return good, bad
