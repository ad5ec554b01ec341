"""Lesson exercise 3: log-sum-exp where the naive formula fails."""

import math

import torch

from floatguard.ops import logsumexp


def naive(v: torch.Tensor) -> float:
    return float(torch.log(torch.exp(v).sum()))


cases = {
    "all equal (c=1000, n=4)": torch.full((4,), 1000.0),
    "one dominant (50 among zeros)": torch.tensor([50.0, 0.0, 0.0, 0.0]),
    "all very negative (-1000, n=3)": torch.full((3,), -1000.0),
}
for name, v in cases.items():
    print(f"{name}: naive={naive(v)!r} stable={float(logsumexp(v)):.6f}")
print(f"expected all equal: {1000 + math.log(4):.6f}")
print(f"expected one dominant: {50 + math.log1p(3 * math.exp(-50)):.6f}")
print(f"expected all very negative: {-1000 + math.log(3):.6f}")
