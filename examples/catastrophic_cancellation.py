"""Lesson exercise 1: variance by E[x^2] - E[x]^2 vs Welford/Chan moments, in float32."""

import torch

from floatguard import Moments

x = torch.tensor([1_000_000.0, 1_000_001.0, 1_000_002.0], dtype=torch.float32)
naive = (x * x).mean() - x.mean() ** 2  # squares near 1e12 are 65536 apart in float32
moments = Moments.of(x)
true = 2.0 / 3.0
print(f"naive E[x^2]-E[x]^2: {float(naive):.6f}")
print(f"Moments (Welford/Chan): {float(moments.var()):.6f}")
print(f"true population variance: {true:.6f}")
print(f"naive relative error: {abs(float(naive) - true) / true:.3g}")
print(f"Moments relative error: {abs(float(moments.var()) - true) / true:.3g}")
