"""floatguard.quantize vs torch's native cast and ml_dtypes' astype, measured in one run.

A 16M-element float32 tensor (normal values spread over many binades) is rounded
to each format; each contender does the full round trip back to float32. Prints
a Markdown table of median times and the ratio floatguard / peer (< 1 is faster).

    python benchmarks/bench_quantize.py [--numel N] [--repeats R]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import ml_dtypes
import numpy as np
import torch

from floatguard import quantize
from floatguard.formats import FORMATS, Format

TORCH_NATIVE = ["e4m3fn", "e5m2", "fp16", "bf16"]
ML = {
    "bf16": ml_dtypes.bfloat16,
    "fp16": np.float16,
    "e4m3fn": ml_dtypes.float8_e4m3fn,
    "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "e5m2": ml_dtypes.float8_e5m2,
    "e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
    "e8m0fnu": ml_dtypes.float8_e8m0fnu,
    "e3m2fn": ml_dtypes.float6_e3m2fn,
    "e2m3fn": ml_dtypes.float6_e2m3fn,
    "e2m1fn": ml_dtypes.float4_e2m1fn,
    "e4m3 (ieee)": ml_dtypes.float8_e4m3,
    "e3m4 (ieee)": ml_dtypes.float8_e3m4,
    "e4m3b11fnuz": ml_dtypes.float8_e4m3b11fnuz,
}
CUSTOM = {
    "e4m3 (ieee)": Format.custom(4, 3),
    "e3m4 (ieee)": Format.custom(3, 4),
    "e4m3b11fnuz": Format.custom(4, 3, bias=11, special="fnuz"),
}


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.numel, generator=g) * torch.exp2(
        torch.randint(-12, 12, (args.numel,), generator=g).float()
    )
    xn = x.numpy()
    print(
        f"# quantize benchmark: {args.numel:,} float32 elements, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}\n"
    )
    print("| format | floatguard ms | torch cast ms | vs torch | ml_dtypes ms | vs ml_dtypes |")
    print("|---|---:|---:|---:|---:|---:|")
    names = list(dict.fromkeys(TORCH_NATIVE + list(ML)))
    for name in names:
        fmt = CUSTOM.get(name) or FORMATS[name]
        ours = median_ms(lambda fmt=fmt: quantize(x, fmt), args.repeats)
        t_cell = r_cell = m_cell = rm_cell = "-"
        if name in TORCH_NATIVE:
            dt = fmt.torch_dtype
            assert dt is not None
            t = median_ms(lambda dt=dt: x.to(dt).to(torch.float32), args.repeats)
            t_cell, r_cell = f"{t:.1f}", f"{ours / t:.2f}x"
        if name in ML:
            npdt = ML[name]

            def ml_round_trip(npdt: object = npdt) -> object:
                with np.errstate(all="ignore"):
                    return xn.astype(npdt).astype(np.float32)

            m = median_ms(ml_round_trip, max(3, args.repeats // 2))
            m_cell, rm_cell = f"{m:.1f}", f"{ours / m:.2f}x"
        print(f"| {name} | {ours:.1f} | {t_cell} | {r_cell} | {m_cell} | {rm_cell} |")


if __name__ == "__main__":
    main()
