"""Lesson exercise 5: how many small gradients fp16 flushes to zero, before and after x1024."""

import torch

from floatguard import quantize

g = torch.Generator().manual_seed(0)
n = 1_000_000
grads = 10 ** (torch.rand(n, generator=g, dtype=torch.float64) * 6 - 9)  # log-uniform [1e-9, 1e-3]
plain = quantize(grads, "fp16")
scaled = quantize(grads * 1024, "fp16") / 1024
print(f"gradients: {n} log-uniform in [1e-9, 1e-3]")
print(f"zero in fp16 without scaling: {float((plain == 0).double().mean()):.4f}")
print(f"zero in fp16 with loss scale 1024: {float((scaled == 0).double().mean()):.4f}")
print(f"fp16 smallest subnormal: {torch.finfo(torch.float16).smallest_normal * 2**-10:.3e}")
