"""The repro bundle: one file that holds a bad step's birth, and re-running it anywhere.

A bundle is written by the guard on a bad step (``ResponsePolicy(repro_dir=...)``,
see :mod:`floatguard.guard.repro_writer`) and read by ``floatguard repro``. The file
is ``MAGIC``, the payload's length and SHA-256, then the payload: a
``torch.save`` of plain values and tensors only, read with ``weights_only=True``
after its length and checksum verify (a flipped bit, a truncated file, a pickle
payload are refused before anything is unpickled; nothing in a bundle can execute).
A bundle is opened without blocking and must be a regular file (a FIFO or a device
named like a bundle is refused), and is read no further than its real size.

What a bundle holds (``level``):

- ``"minimal"``: the *tape*: the aten ops of the birth's module, from the tensors it
  read (the module's inputs, its parameters and buffers, saved activations, the
  gradients flowing in: each as it was when read) to the op that made the non-finite
  value, cut to the ops the birth depends on; the birth op alone with its inputs
  (``single``); the birth module's name, class, call inputs and ``state_dict``; the
  fault's facts (module, phase, op, line, kind, where); the precision, loss scale and
  emulation recipes in force. Random draws are recorded by value, so no RNG state is
  needed to replay (the step's RNG state is kept too). A value that was already bad
  (a weight, an optimizer state, an input) is kept as ``value``.
- ``"step"``: also the whole step's tape (forward and backward, every op), the step's
  inputs (``batch``: the model's call arguments), and the pre-step ``state``: model,
  optimizer and scaler ``state_dict`` and the RNG state, captured before a rollback.

:func:`reproduce` re-runs a bundle's tape (or its op alone) on a device and says
whether the value is born again at the same op; :func:`floatguard.repro.script`
writes it as a standalone PyTorch script.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import struct
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from floatguard._safe_io import NotRegularFile, open_regular
from floatguard.errors import FloatguardError
from floatguard.repro.ops import assign, decode, finite_level, op_named

__all__ = [
    "ReproBundle", "ReproError", "ReproOutcome", "kind_matches", "load_bundle", "reproduce",
    "save_bundle",
]  # fmt: skip

MAGIC = b"FLOATGUARD-REPRO 1\n"
_HEADER = struct.Struct(">Q32s")  # payload length, SHA-256 of the payload
FORMAT = 1
_ALLOWED = (type(None), bool, int, float, str)
_MAX_DEPTH = 64


class ReproError(FloatguardError, ValueError):
    """A repro bundle that cannot be trusted or read: not a bundle, truncated,
    corrupted, not a regular file, or holding something a bundle never holds."""


# ---------------------------------------------------------------------- the file
def save_bundle(payload: dict[str, Any], path: str | os.PathLike[str]) -> tuple[Path, int]:
    """Write ``payload`` atomically to ``path`` (temp file, fsync, rename, fsync the
    folder); the path and its size in bytes."""
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getbuffer()
    head = MAGIC + _HEADER.pack(len(data), hashlib.sha256(data).digest())
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(head)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass
    return target, len(head) + len(data)


def _read_regular(path: Path) -> bytes:
    """The bytes of a regular file, opened without blocking, read only when its size is
    what its header declares."""
    try:  # the header's length against the real size first: a padded file is not read
        with open_regular(path) as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(len(MAGIC) + _HEADER.size)
            if not head.startswith(MAGIC) or len(head) < len(MAGIC) + _HEADER.size:
                return head  # _verified says why
            length = _HEADER.unpack_from(head, len(MAGIC))[0]
            if len(head) + length != size:
                raise ReproError(
                    f"{path}: truncated or padded repro bundle ({size - len(head)} payload "
                    f"bytes, the header says {length})"
                )
            return head + fh.read(size - len(head))
    except FileNotFoundError:
        raise ReproError(f"{path}: no such file") from None
    except NotRegularFile:
        raise ReproError(f"{path} is not a regular file: not a repro bundle") from None
    except OSError as e:
        raise ReproError(f"{path}: cannot be opened ({e.strerror})") from None


def _verified(path: Path, raw: bytes) -> memoryview:
    if not raw.startswith(MAGIC):
        what = "an empty file" if not raw else "no repro bundle header"
        raise ReproError(f"{path} is not a floatguard repro bundle ({what})")
    head = len(MAGIC) + _HEADER.size
    if len(raw) < head:
        raise ReproError(f"{path}: truncated repro bundle (the header is cut short)")
    length, digest = _HEADER.unpack_from(raw, len(MAGIC))
    data = memoryview(raw)[head:]
    if len(data) != length:
        raise ReproError(
            f"{path}: truncated or padded repro bundle ({len(data)} payload bytes, the "
            f"header says {length})"
        )
    if hashlib.sha256(data).digest() != digest:
        raise ReproError(f"{path}: corrupted repro bundle (SHA-256 of the payload does not match)")
    return data


def _check_plain(value: Any, depth: int = 0) -> None:
    """ReproError unless ``value`` is plain values and tensors only (see the module)."""
    if depth > _MAX_DEPTH:
        raise ReproError("nested deeper than a bundle ever is")
    if isinstance(value, _ALLOWED) or isinstance(value, torch.Tensor):
        return
    if isinstance(value, (list, tuple)):
        for v in value:
            _check_plain(v, depth + 1)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise ReproError(f"a key of type {type(k).__name__}")
            _check_plain(v, depth + 1)
        return
    raise ReproError(f"holds a {type(value).__name__}, which a bundle never holds")


def load_bundle(path: str | os.PathLike[str]) -> ReproBundle:
    """Read and verify a bundle (see the module); :class:`ReproError` if it cannot be
    trusted. Tensors are loaded on the CPU."""
    p = Path(path)
    data = _verified(p, _read_regular(p))
    try:
        with warnings.catch_warnings():  # (torch warns of a pickle protocol it then refuses)
            warnings.simplefilter("ignore", UserWarning)
            payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # the checksum held, yet the payload is not ours
        raise ReproError(f"{p}: the payload is not a repro bundle ({type(e).__name__})") from None
    if not isinstance(payload, dict) or payload.get("kind") != "floatguard-repro":
        raise ReproError(f"{p}: the payload is not a repro bundle")
    if payload.get("format") != FORMAT:
        raise ReproError(
            f"{p}: repro bundle format {payload.get('format')!r}; this floatguard reads "
            f"format {FORMAT} (upgrade floatguard)"
        )
    try:
        _check_plain(payload)
    except ReproError as e:
        raise ReproError(f"{p}: {e}") from None
    return ReproBundle(p, payload)


@dataclass
class ReproBundle:
    """A loaded bundle: its ``path`` and ``payload`` (see the module for the keys);
    the facts are properties."""

    path: Path
    payload: dict[str, Any] = field(repr=False)

    @property
    def level(self) -> str:
        return str(self.payload.get("level", "minimal"))

    @property
    def step(self) -> int | None:
        s = self.payload.get("step")
        return s if isinstance(s, int) else None

    @property
    def fault(self) -> dict[str, Any] | None:
        f = self.payload.get("fault")
        return f if isinstance(f, dict) else None

    @property
    def spike(self) -> dict[str, Any] | None:
        s = self.payload.get("spike")
        return s if isinstance(s, dict) else None

    @property
    def tape(self) -> dict[str, Any] | None:
        t = self.payload.get("tape")
        return t if isinstance(t, dict) else None

    @property
    def state(self) -> dict[str, Any] | None:
        """The pre-step state (``"step"`` level): ``model``, ``optimizer``, ``scaler``
        ``state_dict`` and ``rng``; None at the ``"minimal"`` level."""
        s = self.payload.get("state")
        return s if isinstance(s, dict) else None

    @property
    def module_state(self) -> dict[str, torch.Tensor]:
        """The birth module's ``state_dict`` as it was when the value was born."""
        m = self.payload.get("module")
        sd = m.get("state") if isinstance(m, dict) else None
        return dict(sd) if isinstance(sd, dict) else {}

    def describe(self) -> str:
        """One line: which fault, which step, which rank and device."""
        f = self.fault or {}
        where = f.get("module")
        where = "<root>" if where == "" else where
        op = f.get("op")
        what = (
            f"{f.get('kind')}{f' from {op}' if op else ''} in {where} ({f.get('phase')})"
            if f
            else f"{(self.spike or {}).get('signal', '?')} spike"
        )
        rank = self.payload.get("rank")
        on = f" on rank {rank}" if rank is not None else ""
        return f"step {self.step}: {what}{on}, recorded on {self.payload.get('device')}"


# ---------------------------------------------------------------------- re-running
@dataclass(frozen=True)
class ReproOutcome:
    """What re-running a bundle found.

    ``reproduced``: the value was born again (at the bundle's op, of its kind; for a
    spike, the loss or gradient norm past the bar it crossed; for a value already
    there, the bundle's tensor holds it). ``module``, ``op``, ``phase``, ``kind``,
    ``source``: the birth as recorded, confirmed by the re-run when ``reproduced``.
    ``ran``: what was re-run ("tape of N ops", "the op alone", "the value",
    "nothing"). ``found_at``: the first op of the tape whose finite inputs gave a
    non-finite output in this re-run (None: none did). ``values``: the birth op's
    inputs' and output's statistics in this re-run. ``note``: why not, in words.
    """

    reproduced: bool
    module: str | None
    op: str | None
    phase: str | None
    kind: str | None
    source: str | None
    ran: str
    found_at: int | None = None
    found_op: str | None = None
    values: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    step: int | None = None
    rank: int | None = None
    level: str = "minimal"
    device: str = "cpu"

    def to_json(self) -> dict[str, Any]:
        return {
            "reproduced": self.reproduced,
            "module": self.module,
            "op": self.op,
            "phase": self.phase,
            "kind": self.kind,
            "source": self.source,
            "step": self.step,
            "rank": self.rank,
            "level": self.level,
            "device": self.device,
            "ran": self.ran,
            "found_at": self.found_at,
            "found_op": self.found_op,
            "values": self.values,
            "note": self.note,
        }


def value_stats(t: torch.Tensor) -> dict[str, Any]:
    """A tensor's values in brief: dtype, shape, NaN / +inf / -inf counts, finite min,
    max and largest magnitude, and the first non-finite element's index."""
    out: dict[str, Any] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return out
    v = torch.view_as_real(t) if t.is_complex() else t
    v = v.detach().float()
    fin = v[v.isfinite()]
    out.update(
        nan=int(v.isnan().sum()),
        posinf=int((v == math.inf).sum()),
        neginf=int((v == -math.inf).sum()),
        min=float(fin.min()) if fin.numel() else None,
        max=float(fin.max()) if fin.numel() else None,
        amax=float(fin.abs().max()) if fin.numel() else None,
    )
    bad = (~v.isfinite()).nonzero()
    out["first_bad"] = [int(i) for i in bad[0].tolist()] if bad.numel() else None
    return out


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v)]
    return []


def kind_matches(out: list[torch.Tensor], kind: str | None) -> bool:
    """Whether ``out`` holds a non-finite value of ``kind`` ("nan", "inf": either sign)."""
    for t in out:
        if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
            continue
        v = torch.view_as_real(t) if t.is_complex() else t
        if kind == "nan" and bool(v.isnan().any()):
            return True
        if kind in ("inf", "-inf") and bool(v.isinf().any()):
            return True
        if kind is None and not bool(v.isfinite().all()):
            return True
    return False


# Ops that return uninitialized memory (what they hold is written by the ops after).
_ALLOCATIONS = frozenset(
    {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "empty_permuted"}
)


@dataclass
class TapeRun:
    """One run of a tape: the slots after it, the first birth in it, the birth op's
    values (inputs as they were before it ran)."""

    slots: dict[int, torch.Tensor]
    first: int | None = None
    first_op: str | None = None
    birth_out: list[torch.Tensor] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)


def run_tape(tape: dict[str, Any], device: torch.device, *, upto: int | None = None) -> TapeRun:
    """Run a tape's ops on ``device`` (leaves copied there); ValueError for a tape that
    is not one (an unknown op, a bad argument)."""
    ops = tape.get("ops")
    leaves = tape.get("leaves")
    if not isinstance(ops, list) or not isinstance(leaves, dict):
        raise ValueError("the tape has no ops or leaves")
    birth = tape.get("birth")
    slots: dict[int, torch.Tensor] = {}
    for s, t in leaves.items():
        if not isinstance(s, int) or not isinstance(t, torch.Tensor):
            raise ValueError("a tape leaf that is not a numbered tensor")
        slots[s] = t.to(device).clone()
    run = TapeRun(slots)
    for i, op in enumerate(ops):
        if upto is not None and i > upto:
            break
        if not isinstance(op, dict):
            raise ValueError(f"op {i} of the tape is not an op")
        func = op_named(op.get("op"))
        args = decode(op.get("args"), slots, device)
        kwargs = decode(op.get("kwargs"), slots, device)
        if not isinstance(args, tuple) or not isinstance(kwargs, dict):
            raise ValueError(f"op {i} of the tape has malformed arguments")
        ins = _tensors_in((args, kwargs))
        level = (
            max((finite_level(t) for t in ins), default=0) if run.first is None or i == birth else 0
        )
        if i == birth:
            run.values["inputs"] = [value_stats(t) for t in ins if t.is_floating_point()]
        out = func(*args, **kwargs)
        outs = _tensors_in(out)
        if str(op.get("op")).split(".")[1] in _ALLOCATIONS:
            for t in outs:  # uninitialized memory that the next ops write: not a value
                t.zero_()
            outs = []
        assign(op.get("out"), out, slots)
        if run.first is None and level < 2:
            # From finite inputs, an output holding -inf only is a mask (T5's log of a
            # zero relative position, an attention bias) unless it is the birth itself.
            levels = [finite_level(t) for t in outs]
            top = max(levels, default=0)
            if (level == 0 and (top == 2 or (top == 1 and i == birth))) or (
                level == 1 and kind_matches(outs, "nan")
            ):
                run.first, run.first_op = i, str(op.get("op"))
        if i == birth:
            run.birth_out = outs
            run.values["output"] = [value_stats(t) for t in outs if t.is_floating_point()]
    return run


def _device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ReproError(
            f"--device {device!r} is not a device (use cpu, cuda, cuda:1, mps)"
        ) from None
    if dev.type == "meta":
        raise ReproError(f"--device {device}: a meta tensor holds no values (use --device cpu)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ReproError(f"--device {device}: this machine has no CUDA device (use --device cpu)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ReproError(
            f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s) "
            "(use --device cuda:0)"
        )
    return dev


def reproduce(bundle: ReproBundle, device: str | torch.device = "cpu") -> ReproOutcome:
    """Re-run ``bundle`` on ``device`` (see :class:`ReproOutcome`). Runs only aten ops
    the bundle names, on the tensors it holds."""
    dev = _device(device)
    p = bundle.payload
    fault = bundle.fault or {}
    spike = bundle.spike
    base: dict[str, Any] = {
        "module": fault.get("module"),
        "op": fault.get("op"),
        "phase": fault.get("phase"),
        "kind": fault.get("kind"),
        "source": fault.get("source"),
        "step": bundle.step,
        "rank": p.get("rank") if isinstance(p.get("rank"), int) else None,
        "level": bundle.level,
        "device": str(dev),
    }
    if spike is not None:
        return _reproduce_spike(bundle, dev, base)
    value = p.get("value")
    if isinstance(value, dict) and isinstance(value.get("tensor"), torch.Tensor):
        t = value["tensor"]
        kind = fault.get("kind")
        if kind == "huge":
            bound = value.get("bound")
            amax = float(t.detach().abs().float().max()) if t.numel() else 0.0
            ok = isinstance(bound, (int, float)) and amax > bound
        else:
            ok = kind_matches([t], kind if kind in ("nan", "inf") else None)
        note = "" if ok else "the bundle's tensor holds no such value (was it edited?)"
        return ReproOutcome(
            reproduced=ok, ran="the value", values={"value": value_stats(t)}, note=note, **base
        )
    tape = bundle.tape
    errors: list[str] = []
    if tape is not None and tape.get("birth") is not None:
        try:
            run = run_tape(tape, dev)
            ok = kind_matches(run.birth_out, base["kind"])
            birth = tape.get("birth")
            note = "" if ok else _not_again(p)
            if ok and run.first is not None and run.first != birth:
                note = (
                    f"on {dev} an earlier op of the tape (#{run.first}, {run.first_op}) "
                    "already gave a non-finite value"
                )
            return ReproOutcome(
                reproduced=ok,
                ran=f"tape of {len(tape['ops'])} ops",
                found_at=run.first,
                found_op=run.first_op,
                values=run.values,
                note=note,
                **base,
            )
        except (ValueError, RuntimeError, TypeError, IndexError) as e:
            errors.append(f"the tape did not run here ({type(e).__name__}: {str(e)[:200]})")
    single = p.get("single")
    if isinstance(single, dict):
        try:
            one = {
                "ops": [{"op": single.get("op"), "args": single.get("args"),
                         "kwargs": single.get("kwargs"), "out": None}],
                "leaves": single.get("leaves"),
                "birth": 0,
            }  # fmt: skip
            run = run_tape(one, dev)
            ok = kind_matches(run.birth_out, base["kind"])
            note = "; ".join([*errors, *([] if ok else [_not_again(p)])])
            return ReproOutcome(
                reproduced=ok, ran="the op alone", found_at=run.first, found_op=run.first_op,
                values=run.values, note=note, **base,
            )  # fmt: skip
        except (ValueError, RuntimeError, TypeError, IndexError) as e:
            errors.append(f"the op alone did not run here ({type(e).__name__}: {str(e)[:200]})")
    if tape is not None and tape.get("birth") is None:  # a step tape with no birth in it
        try:
            run = run_tape(tape, dev)
            note = _not_again(p) if run.first is None else ""
            return ReproOutcome(
                reproduced=run.first is not None, ran=f"tape of {len(tape['ops'])} ops",
                found_at=run.first, found_op=run.first_op, note=note, **base,
            )  # fmt: skip
        except (ValueError, RuntimeError, TypeError, IndexError) as e:
            errors.append(f"the tape did not run here ({type(e).__name__}: {str(e)[:200]})")
    why = p.get("why_no_tape") if isinstance(p.get("why_no_tape"), str) else None
    if p.get("reproduced_in_guard") is False:
        errors.insert(0, _not_again(p))
    elif why:
        errors.append(why)
    return ReproOutcome(
        reproduced=False, ran="nothing", note="; ".join(errors) or "nothing to re-run", **base
    )


def _not_again(p: dict[str, Any]) -> str:
    if p.get("reproduced_in_guard") is False:
        return (
            "did not reproduce: the guard's own replay of the step from its starting "
            "state was clean too (transient: hardware, a race, nondeterminism)"
        )
    return (
        "did not reproduce: the op gave no such value on this device (transient or device-specific)"
    )


def _reproduce_spike(bundle: ReproBundle, dev: torch.device, base: dict[str, Any]) -> ReproOutcome:
    spike = bundle.spike or {}
    tape = bundle.tape
    base = {**base, "op": "spike", "phase": "loss" if spike.get("signal") == "loss" else "backward",
            "kind": "spike", "module": ""}  # fmt: skip
    if tape is None:
        why = bundle.payload.get("why_no_tape") or "the bundle holds no tape of the step"
        return ReproOutcome(reproduced=False, ran="nothing", note=str(why), **base)
    run = run_tape(tape, dev)
    bar = spike.get("threshold")
    if spike.get("signal") == "loss":
        slot = spike.get("loss_slot")
        value = (
            float(run.slots[slot].detach().double())
            if isinstance(slot, int) and slot in run.slots
            else math.nan
        )
    else:
        slots = [s for s in spike.get("grad_slots") or [] if isinstance(s, int) and s in run.slots]
        norms = [run.slots[s].detach().double().norm() for s in slots]
        value = float(torch.stack(norms).norm()) if norms else math.nan
    ok = isinstance(bar, (int, float)) and math.isfinite(value) and value > bar
    values = {"value": value, "recorded": spike.get("value"), "threshold": bar}
    note = "" if ok else f"the re-run's {spike.get('signal')} {value:.6g} is not past the bar {bar}"
    return ReproOutcome(
        reproduced=ok, ran=f"tape of {len(tape['ops'])} ops", found_at=run.first,
        found_op=run.first_op, values=values, note=note, **base,
    )  # fmt: skip
