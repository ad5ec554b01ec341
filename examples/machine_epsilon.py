"""Lesson exercise 2: find float32's machine epsilon by halving, and check it is 2**-23."""

import numpy as np

from floatguard.formats import get

one = np.float32(1.0)
x = np.float32(1.0)
while one + x / np.float32(2.0) != one:
    x = x / np.float32(2.0)
print(f"smallest power of two with 1 + x != 1 (float32): {float(x)!r}")
print(f"equals 2**-23: {float(x) == 2.0**-23}")
print(f"numpy finfo eps: {float(np.finfo(np.float32).eps)!r}")
print(f"floatguard fp32 eps: {get('fp32').eps!r}")
print(f"1 + eps/2 == 1 in float32: {bool(one + x / np.float32(2.0) == one)}")
