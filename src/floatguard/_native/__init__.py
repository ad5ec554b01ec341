"""An optional one-pass CPU kernel for :func:`floatguard.tensor_stats`, built on first use.

``stats.c`` (plain C, no Python or torch headers) is compiled once with the
system C compiler (``$CC``, else ``cc``) into a per-user cache directory
(``$FLOATGUARD_CACHE``, else ``$XDG_CACHE_HOME/floatguard``, else
``~/.cache/floatguard``) and called through :mod:`ctypes` on the tensor's
memory. It reads each value once (the torch path makes about fifteen passes)
and gives identical results; the tests compare the two on every kind of value.

Nothing is required: without a compiler, or with ``FLOATGUARD_NATIVE=0``, the
torch path is used. Only contiguous CPU float32 / bfloat16 tensors go through it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

__all__ = ["library"]

_FLAGS = ["-O3", "-fPIC", "-shared"]
# Tried in order: tuned for this CPU with OpenMP, then portable, then single-threaded.
_VARIANTS: tuple[list[str], ...] = (["-march=native", "-fopenmp"], ["-fopenmp"], [])
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    if os.environ.get("FLOATGUARD_CACHE"):
        return Path(os.environ["FLOATGUARD_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "floatguard"


def _cpu_signature() -> str:
    sig = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    sig += line
    except OSError:
        pass
    return sig


def _build(src: Path, out: Path) -> None:
    cc = os.environ.get("CC", "cc")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent first uses never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        for extra in _VARIANTS:
            r = subprocess.run(
                [cc, *_FLAGS, *extra, "-o", tmp, str(src)],
                capture_output=True,
                timeout=120,
                check=False,
            )
            if r.returncode == 0:
                os.replace(tmp, out)
                return
        raise OSError(r.stderr.decode(errors="replace")[-500:])
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None when it is disabled or cannot be built."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("FLOATGUARD_NATIVE", "1") == "0":
            return None
        try:
            src = Path(__file__).with_name("stats.c")
            # -march=native: one build per CPU kind (a shared home may span machines).
            key = hashlib.sha256(
                src.read_bytes() + repr((_FLAGS, _VARIANTS, _cpu_signature())).encode()
            ).hexdigest()[:16]
            so = _cache_dir() / f"stats-{key}.so"
            if not so.exists():
                _build(src, so)
            lib = ctypes.CDLL(str(so))
            if lib.fg_abi_version() != 2:
                return None
            for name in ("fg_stats_f32", "fg_stats_bf16"):
                fn = getattr(lib, name)
                fn.restype = None
                fn.argtypes = [
                    ctypes.c_void_p,
                    ctypes.c_int64,
                    ctypes.c_int,
                    ctypes.c_void_p,
                    ctypes.c_void_p,
                ]
            _lib = lib
        except Exception:  # optional by construction: any failure means the torch path
            _lib = None
        return _lib
