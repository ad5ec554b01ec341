"""explain(): bit fields against torch's own bit patterns, classes, errors, neighbours."""

from __future__ import annotations

import math

import pytest
import torch

from floatguard.formats import FORMATS, explain

VALUES = [0.1, 1.0, -2.5, 1e-7, 3e-5, 65504.0, 300.0, -0.0, 1 / 3, 6e-8, 2.0**-9]


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16", "e4m3fn", "e5m2", "e4m3fnuz"])
@pytest.mark.parametrize("value", VALUES)
def test_code_is_torchs_bit_pattern(name: str, value: float) -> None:
    fmt = FORMATS[name]
    assert fmt.torch_dtype is not None
    # torch's fnuz casts overflow to NaN (non-saturating); its e4m3fn cast saturates.
    ex = explain(value, fmt, overflow="nonsaturate" if name.endswith("fnuz") else None)
    t = torch.tensor([value], dtype=torch.float64).to(torch.float32).to(fmt.torch_dtype)
    int_dtype = {32: torch.int32, 16: torch.int16, 8: torch.uint8}[fmt.bits]
    code = int(t.view(int_dtype).item()) & ((1 << fmt.bits) - 1)
    if math.isnan(ex.stored):
        assert math.isnan(float(t.float().item()))
        return
    assert ex.code == code
    assert ex.bits == f"[{ex.sign}] [{ex.exponent}] [{ex.mantissa}]"
    assert int(ex.sign + ex.exponent + ex.mantissa, 2) == code
    assert ex.stored == float(t.double().item()) or name == "fp32"


def test_lesson_layouts() -> None:
    assert explain(0.1, "bf16").bits == "[0] [01111011] [1001101]"
    ex = explain("0.1", "fp32")
    assert abs(ex.stored - 0.100000001490116) < 1e-15
    assert ex.klass == "normal" and ex.exponent_unbiased == -4
    assert ex.abs_error == abs(ex.stored - 0.1)
    assert ex.rel_error == pytest.approx(ex.abs_error / 0.1)
    assert ex.ulp == 2.0**-27
    assert ex.next_down == ex.stored - 2.0**-27 and ex.next_up == ex.stored + 2.0**-27
    assert str(explain(0.1, "bf16")).startswith("bf16: [0] [01111011] [1001101] = 0.10009765625")


def test_classes() -> None:
    assert explain(1e6, "fp16").klass == "overflow"
    assert explain(1e6, "fp16").stored == math.inf
    assert explain(500, "e4m3fn").klass == "overflow"
    assert explain(500, "e4m3fn").stored == 448.0  # saturating default
    assert explain(1e-10, "fp16").klass == "zero" and explain(1e-10, "fp16").underflow
    assert explain(1e-6, "fp16").klass == "subnormal"
    assert explain(1e-6, "fp16").exponent_unbiased == -14
    assert explain(math.inf, "fp16").klass == "inf"
    assert explain(math.inf, "e4m3fn").klass == "overflow"
    assert explain("nan", "e4m3fn").klass == "nan"
    assert explain("nan", "e4m3fn").bits == "[0] [1111] [111]"
    assert explain("nan", "e2m1fn").bits == "(no code)" and explain("nan", "e2m1fn").code is None
    assert explain(-3, "e8m0fnu").klass == "nan"
    assert explain(0, "e8m0fnu").klass == "nan"
    e8 = explain(0.3, "e8m0fnu")
    assert e8.bits == "[01111101]" and e8.stored == 0.25
    assert explain(-0.0, "fp16").bits == "[1] [00000] [0000000000]"
    assert explain(-0.0, "e5m2fnuz").bits == "[0] [00000] [00]"
    assert explain("0x1.cp8", "e4m3fn").stored == 448.0


def test_bad_values() -> None:
    with pytest.raises(ValueError, match="cannot read 'abc' as a number"):
        explain("abc", "fp16")
    with pytest.raises(TypeError, match="value must be a number"):
        explain([1.0], "fp16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown format"):
        explain(1.0, "fp7")


def test_to_dict_is_plain() -> None:
    d = explain(0.1, "fp16").to_dict()
    assert d["bits"] == "[0] [01011] [1001100110]" and d["format"] == "fp16"
