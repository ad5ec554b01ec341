"""The snapshot file's header: how it is written, verified and named (no torch here).

A file is ``MAGIC``, a fixed header and the payload. The header holds the payload's
length, a SHA-256 over the *identity* (step, run id) and the payload, then the
identity itself, so a flipped bit anywhere is caught before anything is unpickled.
Format 1 (before identities: length and SHA-256 of the payload only) is still read.
:mod:`floatguard.stability.snapshot` builds on this; its docstring has the words.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from pathlib import Path

from floatguard._safe_io import read_regular
from floatguard.errors import FloatguardError

__all__ = [
    "TEMP_NAME",
    "ForeignSnapshotError",
    "SnapshotError",
    "check_name",
    "check_run",
    "encode_header",
    "read_identity",
    "run_bytes",
    "step_of",
    "verified",
]

MAGIC = b"FLOATGUARD-SNAPSHOT 2\n"
_MAGIC_V1 = b"FLOATGUARD-SNAPSHOT 1\n"  # the same length as MAGIC
# payload length, SHA-256 of (identity, payload), then the identity: step, run id
_HEADER = struct.Struct(">Q32sQ16s")
_HEADER_V1 = struct.Struct(">Q32s")  # payload length, SHA-256 of the payload
_IDENTITY = struct.Struct(">Q16s")  # what the SHA-256 covers before the payload
_NO_RUN = bytes(16)  # the run id of a snapshot saved without one
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")
_NAME = re.compile(r"^snapshot-(\d{9,})\.fgs$")  # 9 digits, more from step 10**9 on
# Snapshot.save's temp file for a store's name: .snapshot-<step>.fgs.<writer tag>.<random>.tmp
TEMP_NAME = re.compile(r"^\.snapshot-\d+\.fgs\.([0-9a-f]{8}-\d+-\d+)\.[^.]*\.tmp$")


class SnapshotError(FloatguardError, ValueError):
    """A snapshot file that cannot be trusted: corrupted, truncated, misnamed, written
    by another run, or not a snapshot; or a snapshot that does not fit what it would be
    loaded into."""


class ForeignSnapshotError(SnapshotError):
    """A verified snapshot written by another run than the one expected."""


def run_bytes(run_id: str | None) -> bytes:
    """A run id's 16 header bytes (zeros for None); ValueError when malformed."""
    if run_id is None:
        return _NO_RUN
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise ValueError(f"run_id={run_id!r}: a run id is 32 lowercase hex digits (uuid4().hex)")
    return bytes.fromhex(run_id)


def encode_header(step: int, run_id: str | None, data: memoryview | bytes) -> bytes:
    """``MAGIC`` and the header for a payload ``data`` of step ``step`` by run ``run_id``."""
    run = run_bytes(run_id)
    digest = hashlib.sha256(_IDENTITY.pack(step, run))
    digest.update(data)
    return MAGIC + _HEADER.pack(len(data), digest.digest(), step, run)


def step_of(name: str) -> int | None:
    """The step a snapshot file's name says (``snapshot-<step>.fgs``, the step written
    with 9 digits or more: ``snapshot-000000015.fgs``, ``snapshot-1000000000.fgs``), or
    None for any other name, a spelling :meth:`SnapshotStore.path_for` would not
    write (``snapshot-0000000015.fgs``) included."""
    m = _NAME.match(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if f"{step:09d}" == m.group(1) else None


def read_identity(path: str | os.PathLike[str]) -> tuple[int | None, str | None] | None:
    """(step, run id) from a snapshot file's header, unverified (the header alone is
    read: for bookkeeping such as pruning, never for loading); (None, None) for a
    format 1 file; None when the file is not a snapshot or cannot be read."""
    try:  # without blocking, a regular file only (a FIFO named like one: None)
        head = read_regular(path, len(MAGIC) + _HEADER.size)
    except OSError:
        return None
    if head.startswith(_MAGIC_V1):
        return None, None
    if not head.startswith(MAGIC) or len(head) < len(MAGIC) + _HEADER.size:
        return None
    _, _, step, run = _HEADER.unpack_from(head, len(MAGIC))
    return step, (run.hex() if run != _NO_RUN else None)


HEAD_BYTES = len(MAGIC) + _HEADER.size  # enough for either format's header


def declared(head: bytes) -> tuple[int, int] | None:
    """(header bytes, payload bytes) a file starting with ``head`` says it holds; None
    when ``head`` is no snapshot header (or is cut short)."""
    header = (
        _HEADER if head.startswith(MAGIC) else _HEADER_V1 if head.startswith(_MAGIC_V1) else None
    )
    if header is None or len(head) < len(MAGIC) + header.size:
        return None
    return len(MAGIC) + header.size, header.unpack_from(head, len(MAGIC))[0]


def verified(p: Path, raw: bytes) -> tuple[int | None, str | None, memoryview]:
    """(header step, header run id, payload) of a file whose length and checksum
    verify; step and run id None for format 1. SnapshotError otherwise."""
    if raw.startswith(MAGIC):
        header = _HEADER
    elif raw.startswith(_MAGIC_V1):
        header = _HEADER_V1
    else:
        what = "an empty file" if not raw else "no snapshot header"
        raise SnapshotError(f"{p} is not a floatguard snapshot ({what})")
    head = len(MAGIC) + header.size
    if len(raw) < head:
        raise SnapshotError(f"{p}: truncated snapshot (the header is cut short)")
    step: int | None = None
    run: str | None = None
    if header is _HEADER:
        length, digest, step, run_raw = _HEADER.unpack_from(raw, len(MAGIC))
        covered = _IDENTITY.pack(step, run_raw)
        run = run_raw.hex() if run_raw != _NO_RUN else None
    else:
        length, digest = _HEADER_V1.unpack_from(raw, len(MAGIC))
        covered = b""
    data = memoryview(raw)[head:]
    if len(data) != length:
        raise SnapshotError(
            f"{p}: truncated or padded snapshot ({len(data)} payload bytes, the header "
            f"says {length})"
        )
    check = hashlib.sha256(covered)
    check.update(data)
    if check.digest() != digest:
        raise SnapshotError(f"{p}: corrupted snapshot (SHA-256 of the payload does not match)")
    return step, run, data


def check_name(p: Path, step: int) -> None:
    """SnapshotError when ``p``'s name (``snapshot-<step>.fgs``) says another step."""
    named = step_of(p.name)
    if named is not None and named != step:
        raise SnapshotError(
            f"{p}: holds the snapshot of step {step}, not of step {named} (renamed, or "
            "swapped with another file)"
        )


def check_run(p: Path, run: str | None, expected: str | None) -> None:
    """ForeignSnapshotError when ``expected`` is a run id and ``run`` is not it."""
    if expected is not None and run != expected:
        writer = f"run {run}" if run is not None else "a floatguard without run ids"
        raise ForeignSnapshotError(
            f"{p}: written by {writer}, not by the expected run {expected} (another run's snapshot)"
        )
