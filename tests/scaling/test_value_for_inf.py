"""The scale of a block whose quotient ``fmt.max / amax`` overflows float32.

Transformer Engine's ``compute_scale_from_amax`` (``transformer_engine/common/recipe/
recipe_common.cuh``) replaces an infinite ``__fdiv_rn(max, amax)`` by ``value_for_inf``,
then, for power-of-two scales, keeps the sign and exponent bits (``& 0xFF800000``). Its
block-scaling kernels (``quantize_transpose_vector_blockwise.cu``,
``quantize_transpose_square_blockwise.cu``) call it through ``compute_scale_from_types``
with ``value_for_inf = TypeInfo<IType>::max_finite_value``: the *input* dtype's max
(bf16: ``0x7f7f0000``; fp16: 65504; float32: FLT_MAX). Current scaling
(``current_scaling.cu``: ``compute_scale_from_amax_kernel``) and delayed scaling pass
FLT_MAX whatever the input.
"""

from __future__ import annotations

import struct

import pytest
import torch

from floatguard.emulation import Block, Tensorwise, amax_to_scale_and_fallbacks

FLT_MAX_BITS = 0x7F7FFFFF
BF16_MAX_BITS = 0x7F7F0000  # bf16's largest value, as a float32 pattern
FP16_MAX = 65504.0


def bits(t: torch.Tensor) -> list[int]:
    return t.float().reshape(-1).view(torch.int32).tolist()


def from_bits(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b))[0]


def te_block_scale(amax: float, fmt_max: float, vfi: float, pow2: bool) -> float:
    """compute_scale_from_amax with epsilon 0, in float32 (struct rounds to float32)."""
    if amax == 0.0:
        return 1.0
    q = fmt_max / amax  # double, then rounded once to float32 below (innocuous: 53 >= 2*24+2)
    try:
        s = struct.unpack("<f", struct.pack("<f", q))[0]
    except OverflowError:
        s = vfi
    if s == float("inf"):
        s = vfi
    if pow2:
        (b,) = struct.unpack("<I", struct.pack("<f", s))
        s = from_bits(b & 0xFF800000)
    return s


def tiles_with_tiny_amaxes(dtype: torch.dtype) -> torch.Tensor:
    """Row i is a 1x128 tile whose amax is AMAXES[i] (representable in dtype)."""
    amaxes = torch.tensor([1e-38, 3e-39, 1e-40, 1.3e-36, 1e-30, 0.5, 0.0]).to(dtype)
    g = torch.Generator().manual_seed(4)
    x = (torch.rand(len(amaxes), 128, generator=g) * 2 - 1).to(dtype)
    x[:, 0] = 1.0
    return (x.float() * amaxes.float()[:, None]).to(dtype)


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32", "pow2"])
@pytest.mark.parametrize(
    ("dtype", "vfi_bits"),
    [(torch.bfloat16, BF16_MAX_BITS), (torch.float32, FLT_MAX_BITS)],
    ids=["bf16", "fp32"],
)
def test_block_scale_of_an_overflowing_quotient_is_the_input_dtypes_max(
    dtype: torch.dtype, vfi_bits: int, pow2: bool
) -> None:
    x = tiles_with_tiny_amaxes(dtype)
    r = Block("e4m3fn", (1, 128), scale="pow2" if pow2 else "fp32")(x)
    amax = x.float().abs().amax(-1).tolist()
    ref = [te_block_scale(a, 448.0, from_bits(vfi_bits), pow2) for a in amax]
    assert bits(r.scales) == bits(torch.tensor(ref)), (r.scales.tolist(), ref)
    overflowed = sum(1 for a in amax if a and 448.0 / a > from_bits(FLT_MAX_BITS))
    assert overflowed >= 3  # 1e-38, 3e-39, 1e-40
    assert int(r.fallbacks) == overflowed + 1  # and the all-zero tile
    # values: quantize(x * s) / s with the scale above, back in x's dtype
    s = torch.tensor(ref)[:, None]
    q = torch.clamp(x.float() * s, -448.0, 448.0).to(torch.float8_e4m3fn).float() / s
    assert torch.equal(r.values, q.to(dtype))
    assert r.values.dtype == dtype and bool((r.values[:3] != 0).any())


def test_fp16_inputs_cannot_overflow_the_quotient_and_the_rule_gives_65504() -> None:
    # fp16's smallest subnormal is 2**-24: 448 / 2**-24 = 7516192768 is finite, so for fp16
    # inputs value_for_inf is never reached in the block recipe.
    x = torch.zeros(1, 128, dtype=torch.float16)
    x[0, 5] = -(2.0**-24)
    r = Block("e4m3fn", (1, 128))(x)
    assert float(r.scales) == 448.0 * 2**24 and int(r.fallbacks) == 0
    assert float(r.values[0, 5]) == -(2.0**-24)
    # TE's rule itself, with fp16's max: 65504, and 2**15 once the mantissa is masked off
    tiny = torch.tensor([1e-40, 1.0])
    s, fell = amax_to_scale_and_fallbacks(tiny, "e4m3fn", value_for_inf=FP16_MAX)
    assert s.tolist() == [FP16_MAX, 448.0] and fell.tolist() == [True, False]
    s2, _ = amax_to_scale_and_fallbacks(tiny, "e4m3fn", value_for_inf=FP16_MAX, power_of_two=True)
    assert s2.tolist() == [te_block_scale(1e-40, 448.0, FP16_MAX, True), 256.0] == [32768.0, 256.0]


def test_current_scaling_keeps_flt_max_for_bf16_inputs() -> None:
    x = torch.tensor([1e-40, -3e-41], dtype=torch.bfloat16)
    r = Tensorwise("e4m3fn")(x)
    assert bits(r.scales) == [FLT_MAX_BITS] and int(r.fallbacks) == 1


def test_value_for_inf_is_checked() -> None:
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="value_for_inf"):
            amax_to_scale_and_fallbacks(torch.tensor([1.0]), "e4m3fn", value_for_inf=bad)
