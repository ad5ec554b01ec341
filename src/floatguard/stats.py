"""One read of a tensor into counts, extremes and a histogram of binary exponents.

A :class:`TensorStats` answers, for *any* format and without reading the tensor
again, how much of it would overflow, underflow to zero or land in subnormals,
and which scale would fit it: every finite non-zero value ``x`` is binned by its
binary exponent ``floor(log2|x|)``. Bins cover ``[-149, 127]`` (float32 and
float64-from-float32 data, subnormals included); float64 values beyond that
range are counted in the end bins, and ``amax`` / ``min_nonzero`` stay exact.

All fields are tensors on the input's device; nothing syncs with the host until
you call :meth:`TensorStats.to_dict` or one of the ``fraction`` helpers. On CPU,
float32 / bfloat16 / float16 data is read in one pass by a small C kernel built on
first use (:mod:`floatguard._native`; identical results, the torch path otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch

from floatguard import _native
from floatguard._values import local_part, stored_values
from floatguard.formats.codec import decode_unchecked
from floatguard.formats.registry import Format, get

__all__ = ["EXP_MAX", "EXP_MIN", "TensorStats", "audit_tensor_numerics", "tensor_stats"]

EXP_MIN = -149
"""Exponent of the first histogram bin (float32's smallest subnormal, 2**-149)."""
EXP_MAX = 127
"""Exponent of the last histogram bin (float32's largest binade)."""
_NBINS = EXP_MAX - EXP_MIN + 1
_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class TensorStats:
    """Statistics of one tensor (or of several, merged). Integer counts are int64
    tensors; ``amax``, ``min_nonzero``, ``min`` and ``max`` are float64 tensors over
    the *finite* values (``amax = 0`` and ``min_nonzero = inf`` when there are none);
    ``hist[i]`` counts finite non-zero values with ``floor(log2|x|) == EXP_MIN + i``."""

    numel: torch.Tensor
    nan: torch.Tensor
    posinf: torch.Tensor
    neginf: torch.Tensor
    zeros: torch.Tensor
    amax: torch.Tensor
    min_nonzero: torch.Tensor
    min: torch.Tensor
    max: torch.Tensor
    hist: torch.Tensor

    # ----------------------------------------------------------------- merging
    def merge(self, other: TensorStats) -> TensorStats:
        """Statistics of both tensors together (sums, max, min): across micro-batches,
        steps or ranks (all-reduce each field with SUM / MAX / MIN for the same result)."""
        if not isinstance(other, TensorStats):
            raise TypeError(f"can only merge TensorStats, got {type(other).__name__}")
        return TensorStats(
            numel=self.numel + other.numel,
            nan=self.nan + other.nan,
            posinf=self.posinf + other.posinf,
            neginf=self.neginf + other.neginf,
            zeros=self.zeros + other.zeros,
            amax=torch.maximum(self.amax, other.amax),
            min_nonzero=torch.minimum(self.min_nonzero, other.min_nonzero),
            min=torch.minimum(self.min, other.min),
            max=torch.maximum(self.max, other.max),
            hist=self.hist + other.hist,
        )

    # --------------------------------------------------------------- questions
    @property
    def has_nan(self) -> torch.Tensor:
        """Device bool: any NaN."""
        return self.nan > 0

    @property
    def has_inf(self) -> torch.Tensor:
        """Device bool: any ±inf."""
        return (self.posinf + self.neginf) > 0

    @property
    def finite_nonzero(self) -> torch.Tensor:
        """Count of finite non-zero values (the histogram's total)."""
        return self.hist.sum()

    def _bins(self, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        """Count of values whose exponent lies in [lo, hi] (inclusive; None = open end)."""
        a = 0 if lo is None else min(max(lo - EXP_MIN, 0), _NBINS)
        b = _NBINS if hi is None else min(max(hi - EXP_MIN + 1, 0), _NBINS)
        return self.hist[a:b].sum() if b > a else torch.zeros_like(self.numel)

    def overflow_count(self, fmt: str | Format) -> torch.Tensor:
        """Finite values beyond ``fmt``'s range (binade-exact: values in the top binade
        above ``fmt.max`` count only when ``amax`` says some value is there)."""
        f = get(fmt)
        above = self._bins(f.emax + 1, None)
        # The top binade holds values up to 2**(emax+1); those above max overflow too.
        # The histogram cannot split that binade; amax tells whether any value is there.
        top = self._bins(f.emax, f.emax)
        return above + torch.where(self.amax > f.max, top, torch.zeros_like(top))

    def underflow_count(self, fmt: str | Format) -> torch.Tensor:
        """Finite non-zero values that round to zero in ``fmt`` (below half its smallest
        subnormal; for formats without zero, such as e8m0, none do)."""
        f = get(fmt)
        if not f.has_zero:
            return torch.zeros_like(self.numel)
        return self._bins(None, f.emin - f.mantissa_bits - 2)

    def subnormal_count(self, fmt: str | Format) -> torch.Tensor:
        """Finite non-zero values that land in ``fmt``'s subnormal range (to a binade)."""
        f = get(fmt)
        if not f.has_subnormals:
            return torch.zeros_like(self.numel)
        return self._bins(f.emin - f.mantissa_bits - 1, f.emin - 1)

    def fraction(self, count: torch.Tensor) -> float:
        """``count / numel`` as a Python float (reads the device)."""
        n = int(self.numel)
        return float(count) / n if n else 0.0

    def recommended_scale(self, fmt: str | Format, *, power_of_two: bool = False) -> torch.Tensor:
        """``fmt.max / amax`` (1 when amax is 0), or its power-of-two floor."""
        f = get(fmt)
        scale = torch.where(self.amax > 0, f.max / torch.clamp(self.amax, min=1e-300), 1.0)
        if power_of_two:
            scale = torch.exp2(torch.floor(torch.log2(scale)))
        return scale

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values (one host read per field)."""
        out: dict[str, Any] = {}
        for fld in fields(self):
            t: torch.Tensor = getattr(self, fld.name)
            out[fld.name] = t.tolist() if t.dim() else t.item()
        return out

    @classmethod
    def from_dict(
        cls, d: Mapping[str, Any], device: torch.device | str | None = None
    ) -> TensorStats:
        """Inverse of :meth:`to_dict`."""
        missing = [f.name for f in fields(cls) if f.name not in d]
        if missing:
            raise ValueError(f"TensorStats.from_dict: missing fields {missing}")
        ints = {"numel", "nan", "posinf", "neginf", "zeros", "hist"}
        return cls(
            **{
                f.name: torch.tensor(
                    d[f.name], dtype=torch.int64 if f.name in ints else torch.float64, device=device
                )
                for f in fields(cls)
            }
        )


def _count(idx: torch.Tensor, size: int) -> torch.Tensor:
    """Histogram of non-negative int64 ``idx`` into ``size`` bins, without a device sync."""
    if idx.device.type == "cpu":
        return torch.bincount(idx, minlength=size)[:size]
    # bincount sizes its output from max(idx): a device sync; scatter_add does not.
    return torch.zeros(size, dtype=torch.int64, device=idx.device).scatter_add_(
        0, idx, torch.ones_like(idx)
    )


def _stats_f32(xf: torch.Tensor, numel: torch.Tensor) -> TensorStats:
    """float32 fast path: everything from the bit pattern, one histogram for all counts.

    With ``ab`` the bits of |x| as an int: the exponent field is ``ab >> 23`` (255 for
    inf/NaN, 0 for zero and subnormals); a subnormal's exponent is that of its mantissa
    read as an integer (exact in float32) minus 149. Bits of non-negative floats sort
    like their values, so amax and min_nonzero are integer reductions.
    """
    b = xf.view(torch.int32)
    ab = b & 0x7FFFFFFF
    field = ab >> 23
    # key: 0 for zeros; 127 + bin for finite non-zero values; 404 for inf and NaN.
    sub_key = ab.to(torch.float32).view(torch.int32) >> 23
    key = torch.where(field == 0, sub_key, field + 149)
    counts = _count(key.to(torch.int64), 405)
    nan = (ab > 0x7F800000).sum()
    posinf = (b == 0x7F800000).sum()
    finite = field < 255
    ab_fin = torch.where(finite, ab, 0)
    amax = ab_fin.amax().view(torch.float32)
    min_nz = torch.where(ab_fin > 0, ab_fin, 0x7F800000).amin().view(torch.float32)
    f64 = torch.float64
    return TensorStats(
        numel=numel,
        nan=nan,
        posinf=posinf,
        neginf=counts[404] - nan - posinf,
        zeros=counts[0],
        amax=amax.to(f64),
        min_nonzero=min_nz.to(f64),
        min=torch.where(finite, xf, math.inf).amin().to(f64),
        max=torch.where(finite, xf, -math.inf).amax().to(f64),
        hist=counts[127:404],
    )


def _stats_native(xf: torch.Tensor) -> tuple[TensorStats, torch.Tensor, torch.Tensor] | None:
    """The one-pass C kernel (contiguous CPU float32/bfloat16): the stats and what
    ``torch.aminmax`` would return (as float64), or None if the kernel is unavailable."""
    lib = _native.library()
    if lib is None:
        return None
    counts = torch.empty(409, dtype=torch.int64)
    ext = torch.empty(6, dtype=torch.float64)
    fn = lib.fg_stats_f32 if xf.dtype == torch.float32 else lib.fg_stats_bf16
    fn(xf.data_ptr(), xf.numel(), torch.get_num_threads(), counts.data_ptr(), ext.data_ptr())
    # Few view ops per call: this runs once per watched tensor in stats mode.
    numel, nan, posinf, neginf, zeros = counts[[408, 405, 406, 407, 0]].unbind()
    amax, min_nonzero, lo, hi, amin_t, amax_t = ext.unbind()
    stats = TensorStats(
        numel, nan, posinf, neginf, zeros, amax, min_nonzero, lo, hi, counts[127:404]
    )
    return stats, amin_t, amax_t


def stats_and_aminmax(
    x: torch.Tensor,
) -> tuple[TensorStats, tuple[torch.Tensor, torch.Tensor] | None]:
    """:func:`tensor_stats` plus, when the one-pass kernel read it, the pair
    ``torch.aminmax(x)`` would give (so a caller needing both reads ``x`` once)."""
    native = _native_read(x) if x.layout == torch.strided else None
    if native is not None:
        return native[0], (native[1], native[2])
    return tensor_stats(x), None


def _unpack_fp4(x: torch.Tensor) -> torch.Tensor:
    """The values of a packed FP4 tensor (two E2M1 codes per byte), in float32 (exact),
    decoded on its device. Stats do not depend on order, so the two nibbles are
    simply concatenated."""
    codes = x.detach().view(torch.uint8).reshape(-1)
    nibbles = torch.cat([codes & 0xF, codes >> 4]).long()
    return decode_unchecked(get("e2m1fn"), nibbles).float()


def _sparse_stats(x: torch.Tensor) -> TensorStats:
    """Stats of a sparse tensor: its stored values (coalesced: duplicate COO entries
    are summed) plus the zeros it does not store."""
    x = x.detach()
    values = stored_values(x)
    s = tensor_stats(values)
    implicit = x.numel() - values.numel()
    if implicit <= 0:
        return s
    return replace(
        s,
        numel=torch.full_like(s.numel, x.numel()),
        zeros=s.zeros + implicit,
        min=s.min.clamp(max=0.0),
        max=s.max.clamp(min=0.0),
    )


def _native_read(x: torch.Tensor) -> tuple[TensorStats, torch.Tensor, torch.Tensor] | None:
    """The one-pass kernel's answer for a non-empty CPU float32/bf16/fp16 tensor. A
    DTensor is read by this rank's part; other tensor subclasses (whose data pointer
    need not be real memory) go to the torch path."""
    x = local_part(x)
    if type(x) not in (torch.Tensor, torch.nn.Parameter):
        return None
    if x.device.type != "cpu" or x.dtype not in _NATIVE_DTYPES or x.numel() == 0:
        return None
    xf = x.detach().reshape(-1)
    return _stats_native(xf.float() if xf.dtype == torch.float16 else xf)


def tensor_stats(x: torch.Tensor) -> TensorStats:
    """Read ``x`` into a :class:`TensorStats` on its device, without a host sync.

    Half inputs are read in float32; integer, bool and complex tensors raise
    TypeError (pass ``torch.view_as_real(z)`` for a complex one's components). A
    sparse tensor's stats are those of the dense tensor it stands for: its stored
    values, coalesced, plus the zeros it does not store. A DTensor (an FSDP2 shard) is
    read by this rank's part, with no collective (the report reduces over ranks).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"tensor_stats expects a torch.Tensor, got {type(x).__name__}")
    x = local_part(x)
    if not x.is_floating_point():
        raise TypeError(f"tensor_stats needs a floating-point tensor, got {x.dtype}")
    if x.layout != torch.strided:
        return _sparse_stats(x)
    if str(x.dtype) == "torch.float4_e2m1fn_x2":
        x = _unpack_fp4(x)
    native = _native_read(x)
    if native is not None:
        return native[0]
    xf = x.detach().reshape(-1)
    if xf.dtype not in (torch.float32, torch.float64):
        xf = xf.float()
    dev = xf.device
    i64 = torch.int64
    # torch.full, not torch.tensor: no host-to-device copy (which would wait on the device).
    numel = torch.full((), xf.numel(), dtype=i64, device=dev)
    if xf.numel() == 0:
        z = torch.zeros((), dtype=i64, device=dev)
        return TensorStats(
            numel, z, z, z, z,
            torch.zeros((), dtype=torch.float64, device=dev),
            torch.full((), math.inf, dtype=torch.float64, device=dev),
            torch.full((), math.inf, dtype=torch.float64, device=dev),
            torch.full((), -math.inf, dtype=torch.float64, device=dev),
            torch.zeros(_NBINS, dtype=i64, device=dev),
        )  # fmt: skip
    if xf.dtype == torch.float32:
        return _stats_f32(xf, numel)
    a = xf.abs()
    nan_m = torch.isnan(xf)
    inf_m = a == math.inf
    finite = ~(nan_m | inf_m)
    posinf = (inf_m & (xf > 0)).sum()
    nonzero = finite & (a > 0)
    amax = torch.where(finite, a, 0.0).amax()
    _, e = torch.frexp(xf)
    # floor(log2|x|) = frexp exponent - 1; non-finite and zero go to an overflow bin.
    idx = (e.to(i64) - 1 - EXP_MIN).clamp_(0, _NBINS - 1)
    idx = torch.where(nonzero, idx, _NBINS)
    hist = _count(idx, _NBINS + 1)[:_NBINS]
    return TensorStats(
        numel=numel,
        nan=nan_m.sum(),
        posinf=posinf,
        neginf=inf_m.sum() - posinf,
        zeros=(xf == 0).sum(),
        amax=amax.to(torch.float64),
        min_nonzero=torch.where(nonzero, a, math.inf).amin().to(torch.float64),
        min=torch.where(finite, xf, math.inf).amin().to(torch.float64),
        max=torch.where(finite, xf, -math.inf).amax().to(torch.float64),
        hist=hist,
    )


def audit_tensor_numerics(
    layers_data: Mapping[str, torch.Tensor | np.ndarray],
    target_fp_max: float = 448.0,
    underflow_thresh: float = 1e-4,
) -> dict[str, Any]:
    """The lessons' (docs/lessons.md) audit: per layer NaN/Inf, underflow ratio and a safe scale.

    ``layers_data`` maps layer names (in execution order) to torch tensors or
    numpy arrays. Returns ``{"first_nan_layer": name | None, "layer_reports":
    {name: {"has_nan", "has_inf", "underflow_ratio", "optimal_scale"}}}`` where
    ``underflow_ratio`` is the share of finite non-zero values with
    ``|x| < underflow_thresh`` and ``optimal_scale = target_fp_max / (amax + 1e-12)``
    over the finite values (1.0 when there are none), as the lesson defines it.
    Reads each tensor on the host: an offline audit, not a hot path.
    """
    if not isinstance(layers_data, Mapping):
        raise TypeError(
            "layers_data must be a mapping of layer name to tensor, "
            f"got {type(layers_data).__name__}"
        )
    first_nan: str | None = None
    reports: dict[str, dict[str, Any]] = {}
    for name, data in layers_data.items():
        t = torch.from_numpy(np.asarray(data)) if not isinstance(data, torch.Tensor) else data
        if not t.is_floating_point():
            t = t.to(torch.float64)
        st = tensor_stats(t)
        has_nan = bool(st.has_nan)
        if has_nan and first_nan is None:
            first_nan = name
        tf = t.detach().reshape(-1)
        a = tf.abs().to(torch.float64)
        nonzero = torch.isfinite(a) & (a > 0)
        n_nonzero = int(nonzero.sum())
        below = int((nonzero & (a < underflow_thresh)).sum())
        amax = float(st.amax)
        reports[name] = {
            "has_nan": has_nan,
            "has_inf": bool(st.has_inf),
            "underflow_ratio": below / n_nonzero if n_nonzero else 0.0,
            "optimal_scale": float(target_fp_max / (amax + 1e-12)) if amax > 0 else 1.0,
        }
    return {"first_nan_layer": first_nan, "layer_reports": reports}
