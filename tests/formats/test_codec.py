"""Every code of every ≤16-bit format: decode matches ml_dtypes, and quantize/encode round-trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from floatguard.formats import FORMATS, Format, decode, encode, quantize
from floatguard.formats.codec import nan_code

from .reference import ML_CUSTOM, ML_DTYPES, all_codes, same_bits

SMALL = [n for n in ML_DTYPES if FORMATS[n].bits <= 16]
CASES: list[tuple[Format, object]] = [(FORMATS[n], ML_DTYPES[n]) for n in SMALL] + list(
    ML_CUSTOM.values()
)
IDS = [f.name for f, _ in CASES]


def _ml_decode(fmt: Format, dt: object) -> torch.Tensor:
    raw = np.arange(1 << fmt.bits, dtype=np.uint16 if fmt.bits == 16 else np.uint8)
    with np.errstate(invalid="ignore"):
        return torch.from_numpy(raw.view(dt).astype(np.float64))  # type: ignore[call-overload]


@pytest.mark.parametrize(("fmt", "dt"), CASES, ids=IDS)
def test_every_code_decodes_like_ml_dtypes(fmt: Format, dt: object) -> None:
    ours = decode(fmt, all_codes(fmt))
    ref = _ml_decode(fmt, dt)
    assert bool(same_bits(ours, ref).all())


@pytest.mark.parametrize(("fmt", "dt"), CASES, ids=IDS)
@pytest.mark.parametrize("mode", ["nearest", "toward_zero", "stochastic", "ceil", "floor"])
@pytest.mark.parametrize("overflow", ["saturate", "nonsaturate"])
def test_every_value_quantizes_to_itself(fmt: Format, dt: object, mode: str, overflow: str) -> None:
    vals = decode(fmt, all_codes(fmt))
    finite = torch.isfinite(vals)
    for dtype in (torch.float32, torch.float64):
        v = vals[finite].to(dtype)
        q = quantize(v, fmt, rounding=mode, overflow=overflow)  # type: ignore[arg-type]
        assert bool(same_bits(q, v).all()), fmt.name


@pytest.mark.parametrize(("fmt", "dt"), CASES, ids=IDS)
def test_encode_inverts_decode(fmt: Format, dt: object) -> None:
    codes = all_codes(fmt)
    vals = decode(fmt, codes)
    keep = ~torch.isnan(vals)
    assert torch.equal(encode(fmt, vals[keep]), codes[keep])
    code = nan_code(fmt)
    if code is not None:
        assert bool(torch.isnan(decode(fmt, torch.tensor([code]))).all())
        assert int(encode(fmt, torch.tensor([float("nan")]))) == code


def test_encode_rejects_values_off_the_grid() -> None:
    with pytest.raises(ValueError, match="not a value of e4m3fn; round it first"):
        encode("e4m3fn", torch.tensor([0.1]))
    with pytest.raises(ValueError, match="not a value of e4m3fn"):
        encode("e4m3fn", torch.tensor([float("inf")]))
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 2\*\*8\)"):
        decode("e4m3fn", torch.tensor([256]))
    with pytest.raises(TypeError, match="integer tensor"):
        decode("e4m3fn", torch.tensor([1.0]))


def test_e8m0_codes_are_powers_of_two() -> None:
    vals = decode("e8m0fnu", torch.arange(255))
    assert torch.equal(vals, torch.exp2(torch.arange(-127, 128, dtype=torch.float64)))


def test_decode_names_the_out_of_range_code() -> None:
    with pytest.raises(ValueError, match=r"code 256 is out of range for e4m3fn: .*\[0, 255\]"):
        decode("e4m3fn", torch.tensor([3, 256, 7]))
    with pytest.raises(ValueError, match=r"code -1 is out of range"):
        decode("fp16", torch.tensor([-1]))
