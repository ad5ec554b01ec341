"""Format limits against ml_dtypes.finfo / torch.finfo, lookup, custom formats."""

from __future__ import annotations

import math

import ml_dtypes
import pytest
import torch

from floatguard.formats import FORMATS, Format, get, names

from .reference import ML_CUSTOM, ML_DTYPES


@pytest.mark.parametrize("name", list(FORMATS))
def test_bits_add_up(name: str) -> None:
    f = FORMATS[name]
    assert f.bits == int(f.signed) + f.exponent_bits + f.mantissa_bits
    if f.signed:
        assert f.bits == 1 + f.exponent_bits + f.mantissa_bits


@pytest.mark.parametrize("name", [n for n in ML_DTYPES if n not in ("fp32", "fp16")])
def test_limits_match_ml_dtypes_finfo(name: str) -> None:
    f = FORMATS[name]
    fi = ml_dtypes.finfo(ML_DTYPES[name])
    assert f.max == float(fi.max)
    assert f.tiny == float(fi.tiny)
    assert f.smallest_subnormal == float(fi.smallest_subnormal)
    assert f.eps == float(fi.eps)
    assert f.bits == fi.bits
    assert f.mantissa_bits == fi.nmant
    assert f.exponent_bits == fi.nexp


@pytest.mark.parametrize("name", list(ML_CUSTOM))
def test_custom_formats_match_ml_dtypes(name: str) -> None:
    f, dt = ML_CUSTOM[name]
    fi = ml_dtypes.finfo(dt)
    assert (f.max, f.tiny, f.smallest_subnormal, f.eps) == (
        float(fi.max),
        float(fi.tiny),
        float(fi.smallest_subnormal),
        float(fi.eps),
    )


@pytest.mark.parametrize("name", [n for n, f in FORMATS.items() if f.torch_dtype is not None])
def test_limits_match_torch_finfo(name: str) -> None:
    f = FORMATS[name]
    assert f.torch_dtype is not None
    fi = torch.finfo(f.torch_dtype)
    assert f.max == fi.max
    assert f.tiny == fi.tiny
    if name == "e5m2fnuz":
        # The gap above 1 is 2**-m = 0.25 (ml_dtypes agrees). torch.finfo gives 0.125 up to
        # at least 2.13; accept a torch that fixes it, and never take torch's value.
        assert f.eps == 2.0**-2 == f.next_up(1.0) - 1.0
        assert fi.eps in (0.125, f.eps)
    else:
        assert f.eps == fi.eps
    if f.has_subnormals:
        assert f.smallest_subnormal == fi.smallest_normal * 2.0**-f.mantissa_bits


def test_eps_is_the_gap_above_one() -> None:
    for f in FORMATS.values():
        assert f.next_up(1.0) == 1.0 + f.eps


def test_tf32_and_lesson_facts() -> None:
    assert FORMATS["fp16"].max == 65504.0
    assert FORMATS["e4m3fn"].max == 448.0
    assert FORMATS["e5m2"].max == 57344.0
    tf32 = FORMATS["tf32"]
    assert tf32.bits == 19 and tf32.tiny == 2.0**-126 and tf32.eps == 2.0**-10
    assert tf32.max == (2 - 2.0**-10) * 2.0**127
    assert FORMATS["fp64"].max == 1.7976931348623157e308
    assert FORMATS["fp64"].smallest_subnormal == 5e-324


def test_special_value_flags() -> None:
    e4 = FORMATS["e4m3fn"]
    assert (e4.has_inf, e4.has_nan, e4.has_negative_zero) == (False, True, True)
    uz = FORMATS["e5m2fnuz"]
    assert (uz.has_inf, uz.has_nan, uz.has_negative_zero) == (False, True, False)
    fp4 = FORMATS["e2m1fn"]
    assert (fp4.has_inf, fp4.has_nan, fp4.has_negative_zero) == (False, False, True)
    e8 = FORMATS["e8m0fnu"]
    assert (e8.signed, e8.has_zero, e8.has_subnormals) == (False, False, False)
    assert (e8.max, e8.tiny) == (2.0**127, 2.0**-127)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("e4m3fn", "e4m3fn"),
        ("float8_e4m3fn", "e4m3fn"),
        ("fp8_e4m3", "e4m3fn"),
        ("E5M2", "e5m2"),
        ("float4_e2m1fn", "e2m1fn"),
        ("float6_e3m2fn", "e3m2fn"),
        ("bfloat16", "bf16"),
        ("half", "fp16"),
        ("torch.float32", "fp32"),
        (torch.float16, "fp16"),
        (torch.bfloat16, "bf16"),
        (torch.float8_e4m3fn, "e4m3fn"),
        (torch.float8_e5m2fnuz, "e5m2fnuz"),
        (torch.float8_e8m0fnu, "e8m0fnu"),
    ],
)
def test_get_aliases(spec: str | torch.dtype, expected: str) -> None:
    assert get(spec).name == expected


def test_get_unknown_names_the_closest_and_the_known() -> None:
    with pytest.raises(ValueError, match=r"did you mean 'e4m3fnuz'\?.*Known: fp64, fp32") as ei:
        get("e4m3fz")
    assert "e2m1fn" in str(ei.value)
    with pytest.raises(ValueError, match="not a floating-point format"):
        get(torch.int8)
    with pytest.raises(TypeError, match="a format is a name"):
        get(3)  # type: ignore[arg-type]


def test_custom_format_validation() -> None:
    with pytest.raises(ValueError, match="exponent_bits=0"):
        Format.custom(0, 3)
    with pytest.raises(ValueError, match="IEEE-like format needs exponent_bits >= 2"):
        Format.custom(1, 3)
    with pytest.raises(ValueError, match="has_nan=False only applies"):
        Format.custom(3, 2, has_nan=False)
    with pytest.raises(TypeError, match="mantissa_bits must be an int"):
        Format.custom(3, 2.5)  # type: ignore[arg-type]
    f = Format.custom(3, 2, ieee=False, has_nan=False)
    ref = FORMATS["e3m2fn"]
    assert (f.bias, f.special, f.has_nan, f.has_inf) == (ref.bias, ref.special, False, False)
    assert (f.max, f.tiny, f.smallest_subnormal) == (ref.max, ref.tiny, ref.smallest_subnormal)
    assert Format.custom(5, 2).max == FORMATS["e5m2"].max


def test_neighbours() -> None:
    f = FORMATS["e4m3fn"]
    assert f.next_up(448.0) is None
    assert f.next_down(448.0) == 416.0
    assert f.next_down(1.0) == 1.0 - 2.0**-4
    assert f.next_up(0.0) == f.smallest_subnormal
    assert f.next_down(0.0) == -f.smallest_subnormal
    assert f.next_up(-f.smallest_subnormal) == 0.0
    assert FORMATS["fp16"].next_up(65504.0) == math.inf
    e8 = FORMATS["e8m0fnu"]
    assert e8.next_down(e8.tiny) is None
    assert e8.next_up(1.0) == 2.0
    assert e8.next_down(1.0) == 0.5


def test_names_in_display_order() -> None:
    assert names()[:5] == ["fp64", "fp32", "tf32", "fp16", "bf16"]
    assert len(names()) == 13


@pytest.mark.parametrize(
    ("name", "layout"),
    [("e3m4", (3, 4, 3, "ieee")), ("e5m10", (5, 10, 15, "ieee")), ("e4m2fn", (4, 2, 7, "fn")),
     ("e3m2fnuz", (3, 2, 4, "fnuz")), ("float8_e3m4", (3, 4, 3, "ieee"))],
)  # fmt: skip
def test_any_exmy_spelling_is_a_custom_format(name: str, layout: tuple[int, int, int, str]) -> None:
    f = get(name)
    assert (f.exponent_bits, f.mantissa_bits, f.bias, f.special) == layout
    if name == "e5m10":
        assert f.max == get("fp16").max and f.tiny == get("fp16").tiny  # fp16's layout
    if name == "e3m4":  # ml_dtypes' float8_e3m4
        assert f.max == float(ml_dtypes.finfo(ml_dtypes.float8_e3m4).max)


@pytest.mark.parametrize(
    ("name", "message"),
    [("fp8", "ambiguous: e4m3fn .* or e5m2"), ("nvfp4", "scaling recipe.*NVFP4"),
     ("mxfp8", "scaling recipe.*MX\\('e4m3fn'\\)"), ("mxfp6", "MX\\('e3m2fn'\\)"),
     ("mxfp4", "MX\\('e2m1fn'\\)"), ("zzz", "unknown format 'zzz'\\. Known: fp64"),
     ("e4m3fm", "did you mean 'e4m3fn'\\? Known")],
)  # fmt: skip
def test_names_that_are_not_one_format(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get(name)


def test_custom_format_arguments_are_checked_where_given() -> None:
    with pytest.raises(TypeError, match=r"bias must be an int, got 1\.5"):
        Format.custom(4, 3, bias=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"name must be a str, got 123"):
        Format.custom(4, 3, name=123)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["e99999999999999999999m1", "e0m3", "e12m3"])
def test_an_out_of_range_custom_format_is_a_value_error_naming_it(name: str) -> None:
    with pytest.raises(ValueError, match=rf"format {name!r}: exponent_bits=\d+ is out of range"):
        get(name)
