"""An optional one-pass CPU kernel for :func:`floatguard.tensor_stats`, built on first use.

``stats.c`` (plain C, no Python or torch headers) is compiled once with the
system C compiler (``$CC``, else ``cc``) into a per-user cache directory
(``$FLOATGUARD_CACHE``, else ``$XDG_CACHE_HOME/floatguard``, else
``~/.cache/floatguard``) and called through :mod:`ctypes` on the tensor's
memory. It reads each value once (the torch path makes about fifteen passes)
and gives identical results; the tests compare the two on every kind of value.

Nothing is required: without a compiler, or with ``FLOATGUARD_NATIVE=0``, the
torch path is used. Only contiguous CPU float32 / bfloat16 tensors go through it.

:func:`amax_many` (the same library): the largest magnitude of each of many
contiguous CPU float32 / bfloat16 / float16 tensors in one call, for vetting a
snapshot step's state where per-tensor dispatch would dominate (a small model on CPU).
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

import torch

__all__ = ["AmaxPlan", "amax_many", "library"]

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
            if lib.fg_abi_version() != 3:
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
            lib.fg_amax_many.restype = None
            lib.fg_amax_many.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p]
            _lib = lib
        except Exception:  # optional by construction: any failure means the torch path
            _lib = None
        return _lib


_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class AmaxPlan:
    """Each of a fixed list of tensors' largest magnitude (float64, NaN for one holding
    a NaN, 0 for an empty one) in one native call: built once (:meth:`build`), run
    while :meth:`valid` (the tensors still have the memory, size and dtype it was built
    for). Reads the tensors' memory directly: run it where nothing writes them."""

    def __init__(self, tensors: list[torch.Tensor], kinds: list[int], lib: ctypes.CDLL) -> None:
        count = len(tensors)
        self._tensors = tensors
        self._lib = lib
        self._count = count
        self._sig = [(t.data_ptr(), t.numel(), t.dtype) for t in tensors]
        self._ptrs = (ctypes.c_void_p * count)(*(p for p, _, _ in self._sig))
        self._sizes = (ctypes.c_int64 * count)(*(n for _, n, _ in self._sig))
        self._kinds = (ctypes.c_int * count)(*kinds)

    @classmethod
    def build(cls, tensors: list[torch.Tensor]) -> AmaxPlan | None:
        """A plan, or None when the kernel is unavailable or a tensor is not a dense
        contiguous CPU float32 / bfloat16 / float16 tensor (then use the torch path)."""
        kinds = []
        for t in tensors:
            kind = _KINDS.get(t.dtype)
            if (
                kind is None
                or t.device.type != "cpu"
                or t.layout != torch.strided
                or not t.is_contiguous()
                or type(t) not in (torch.Tensor, torch.nn.Parameter)
            ):
                return None
            kinds.append(kind)
        lib = library()
        if lib is None or not tensors:
            return None
        return cls(tensors, kinds, lib)

    def valid(self) -> bool:
        """The tensors still hold the memory, size and dtype the plan was built for, in
        one pass (a tensor made non-contiguous in place, by ``as_strided_`` or ``set_``
        on the same memory, is not seen: nothing in a training step does that)."""
        return [(t.data_ptr(), t.numel(), t.dtype) for t in self._tensors] == self._sig

    def run(self) -> torch.Tensor:
        out = torch.empty(self._count, dtype=torch.float64)
        self._lib.fg_amax_many(self._ptrs, self._sizes, self._kinds, self._count, out.data_ptr())
        return out


def amax_many(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """Each tensor's largest magnitude (:class:`AmaxPlan`, built and run once); None
    when the kernel cannot read these tensors."""
    plan = AmaxPlan.build(tensors)
    return plan.run() if plan is not None else None
