"""What every scaling recipe shares: the amax, the scale from it, the result type.

Words used here and in the recipe modules:

- *amax*: ``max |x|`` over a tensor, a row or a block, in float32.
- *scale* (encode scale, Transformer Engine's convention): ``s = fmt.max / amax``;
  values go into the format as ``x * s`` and come back as ``q / s``.
- *fallback*: a scale not taken from the formula, because the amax was 0 or not
  finite, or the quotient overflowed float32; counted in ``QuantResult.fallbacks``.
- *NaN policy*: whether a NaN element makes its amax NaN (``"propagate"``) or is
  skipped by it (``"skip_elements"``, TE's ``fmaxf`` reductions).

Reading order: :class:`QuantResult`, :func:`tensor_to_amax`,
:func:`amax_to_scale_and_fallbacks`, :class:`TensorRecipe`. The recipes themselves live
in :mod:`floatguard.emulation.recipes` (current scaling, MX), ``_nvfp4`` and ``_delayed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from floatguard.formats.registry import Format, get

__all__ = [
    "FLT_MAX",
    "FLT_MIN",
    "NanPolicy",
    "QuantResult",
    "TensorRecipe",
    "amax_to_scale",
    "amax_to_scale_and_fallbacks",
    "tensor_to_amax",
]

FLT_MAX = float.fromhex("0x1.fffffep127")  # float32's largest value, ~3.4028e38
FLT_MIN = 2.0**-126  # float32's smallest normal
NanPolicy = Literal["propagate", "skip_elements"]


@dataclass(frozen=True)
class QuantResult:
    """A fake-quantized tensor and how it was scaled (device tensors, no sync).

    - ``values``: what the format gives back, in the input's dtype;
    - ``scales``: the scales used (shape per recipe);
    - ``fallbacks``: how many scales fell back (amax 0 or non-finite, quotient overflow);
    - ``nan_skipped``: how many NaN elements the amax reductions skipped (an int64
      count): nonzero only under ``nan_policy="skip_elements"`` and for NVFP4, whose
      scales always skip NaN (TE's kernels); ``0`` from every other recipe, ``None``
      only for a QuantResult built by hand without it.
    """

    values: torch.Tensor
    scales: torch.Tensor
    fallbacks: torch.Tensor
    nan_skipped: torch.Tensor | None = None


def _check_nan_policy(owner: str, policy: object) -> None:
    if policy not in get_args(NanPolicy):
        raise ValueError(
            f"{owner}.nan_policy={policy!r}; use one of {', '.join(get_args(NanPolicy))} "
            "('skip_elements' is Transformer Engine's NaN-skipping amax)"
        )


def tensor_to_amax(
    x: torch.Tensor,
    dim: int | tuple[int, ...] | None = None,
    *,
    keepdim: bool = False,
    nan_policy: NanPolicy = "propagate",
) -> torch.Tensor:
    """``max |x|`` in float32, over ``dim`` (all of x when None; 0 for an empty tensor).

    ``nan_policy="propagate"``: a NaN element gives a NaN amax (a fallback downstream).
    ``"skip_elements"``: NaN elements are left out, as Transformer Engine's amax kernels
    reduce ``fmaxf(|x|, max)`` (``transformer_engine/common/recipe/current_scaling.cu``:
    ``amax_kernel``; the block and NVFP4 casts likewise); an all-NaN slice gives 0; inf
    is kept either way. Detached, no sync. The one amax expression of every recipe
    (torchao's ``tensor_to_amax``)."""
    a = x.detach().abs()
    if nan_policy == "skip_elements":
        a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    if dim is None:
        return a.amax().float() if x.numel() else torch.zeros((), device=x.device)
    return a.amax(dim=dim, keepdim=keepdim).float()


def _amax_and_skipped(
    x: torch.Tensor, dim: int | tuple[int, ...] | None, nan_policy: NanPolicy
) -> tuple[torch.Tensor, torch.Tensor]:
    """The amax (keepdim when ``dim`` is given) and the number of NaN elements it skipped."""
    amax = tensor_to_amax(x, dim, keepdim=dim is not None, nan_policy=nan_policy)
    if nan_policy == "skip_elements":
        return amax, torch.isnan(x.detach()).sum()
    return amax, _no_skips(x)


def _no_skips(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device=x.device)


def _f32_quotient(num: float, denom: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fl32(num / denom)`` for a float32 ``denom`` (and ``num`` exact in float64), as the
    float64 quotient and a mask of where the float32 rounding is infinite.

    One float64 division (``torch.div`` of two tensors: torch's ``scalar / tensor`` would
    be ``reciprocal(denom) * num``), rounded to float64, then to float32 by the caller.
    For float32 operands that double rounding is innocuous (53 >= 2 * 24 + 2 bits;
    Figueroa, "When is double rounding innocuous?", 1995): the result is the correctly
    rounded float32 quotient, TE's ``__fdiv_rn``. The overflow test is on the float32
    rounding itself (a quotient just past FLT_MAX that rounds down to it is no overflow).
    """
    d64 = denom.to(torch.float64)
    q = torch.div(torch.full_like(d64, num), d64)
    return q, torch.isinf(q.to(torch.float32))


def _floor_pow2(v: float) -> float:
    """The largest power of two <= v (v > 0): TE's ``scale_bits &= 0xFF800000``."""
    _, e = math.frexp(v)  # v = m * 2**e, m in [0.5, 1)
    return math.ldexp(1.0, e - 1)


def amax_to_scale(
    amax: torch.Tensor,
    fmt: str | Format,
    *,
    margin: float = 0,
    eps: float = 0.0,
    power_of_two: bool = False,
    fallback: torch.Tensor | float = 1.0,
    value_for_inf: float = FLT_MAX,
) -> torch.Tensor:
    """``fmt.max / max(amax, eps) / 2**margin`` as float32, or ``fallback`` where amax is 0
    (with ``eps=0``) or not finite. See :func:`amax_to_scale_and_fallbacks`."""
    return amax_to_scale_and_fallbacks(
        amax, fmt, margin=margin, eps=eps, power_of_two=power_of_two, fallback=fallback,
        value_for_inf=value_for_inf,
    )[0]  # fmt: skip


def amax_to_scale_and_fallbacks(
    amax: torch.Tensor,
    fmt: str | Format,
    *,
    margin: float = 0,
    eps: float = 0.0,
    power_of_two: bool = False,
    fallback: torch.Tensor | float = 1.0,
    value_for_inf: float = FLT_MAX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales for ``amax``, and a bool mask of those that fell back.

    - The scale is the correctly rounded float32 quotient ``fmt.max * 2**-margin /
      max(amax, eps)`` (Transformer Engine's ``__fdiv_rn``). What runs: the numerator
      ``fmt.max * 2**-margin`` in float64 (exact for an integer margin), one float64
      division by the float32 amax (a tensor-by-tensor ``torch.div``, not torch's
      ``scalar / tensor``, which is ``reciprocal(amax) * max``), then one rounding to
      float32. Two roundings, to 53 bits then to 24: innocuous for a quotient of float32
      numbers, since 53 >= 2 * 24 + 2 (Figueroa, "When is double rounding innocuous?",
      1995). A float32 division in torch would be the same; ``scalar / tensor`` in
      float32 is 1 ulp off for ~38% of amaxes.
    - ``power_of_two``: the largest power of two ``s`` with ``amax * s <= fmt.max /
      2**margin``, from the exponent bits (``frexp``), never through a float32 ``log2``
      (TE masks the mantissa of the rounded quotient: the same power of two).
    - A tiny but finite amax whose quotient rounds to inf in float32 gets
      ``value_for_inf`` (TE's name; ``FLT_MAX`` by default, as TE's current and delayed
      scaling; TE's block scaling passes the input dtype's max) and, for powers of two,
      the largest power of two below it (``2**127`` for FLT_MAX or bf16's max, ``2**15``
      for fp16's), so its values are kept rather than flushed by a scale of 1; it counts
      as a fallback.
    - ``eps=0`` is Transformer Engine's formula (amax 0 falls back), ``eps=1e-12``
      torchao's (amax 0 gives ``fmt.max / 1e-12``). Non-finite amax falls back (TE's
      ``compute_scale_from_amax`` returns 1.0 there).

    Float32 scales on amax's device, no sync.
    """
    if isinstance(value_for_inf, bool) or not (
        isinstance(value_for_inf, (int, float)) and 0 < value_for_inf <= FLT_MAX
    ):
        raise ValueError(
            f"value_for_inf={value_for_inf!r} must be a positive finite float32 number "
            "(TE uses the input dtype's max: FLT_MAX, bf16's 3.3895e38 or fp16's 65504)"
        )
    f = get(fmt)
    a = amax.to(torch.float32)
    denom = torch.clamp(a, min=eps) if eps > 0 else a
    q, overflow = _f32_quotient(f.max * 2.0**-margin, denom)
    usable = torch.isfinite(a) & (denom > 0)
    if power_of_two:
        _, e = torch.frexp(q)  # q = m * 2**e, m in [0.5, 1): 2**(e - 1) <= q
        s = torch.ldexp(torch.ones_like(q), e - 1)
        # q was rounded: where it rounded up onto a power of two, amax * s is past max.
        d64 = denom.to(torch.float64)
        s = torch.where(d64 * s * (2.0**margin) > f.max, s * 0.5, s)
        s = torch.where(overflow, torch.full_like(s, _floor_pow2(value_for_inf)), s)
    else:
        s = torch.where(overflow, torch.full_like(q, value_for_inf), q)
    fb = torch.as_tensor(fallback, dtype=torch.float32, device=a.device)
    scale = torch.where(usable, s.to(torch.float32), fb)
    return scale, ~usable | (usable & overflow)


def _blocks_last(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """View x's last dim as [..., nblocks, block] (zero-padded); returns the pad."""
    k = x.shape[-1]
    pad = (-k) % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, block), pad


class TensorRecipe:
    """How *one tensor* is scaled and quantized (Tensorwise, Rowwise, Block, MX, NVFP4):
    ``__call__(x) -> QuantResult``. Not to be confused with
    :class:`~floatguard.emulation.EmulationRecipe`, which picks a TensorRecipe for each
    operand of a GEMM (activation, weight, gradient). Called ``Recipe`` in 0.1.0;
    that name still works, with a DeprecationWarning."""

    def __call__(self, x: torch.Tensor) -> QuantResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Just the fake-quantized values, in x's dtype."""
        return self(x).values.to(x.dtype)
