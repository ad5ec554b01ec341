"""Lesson exercise 4: check the gradient of y = Wx + b with a 3x2 weight, and catch a bug."""

import torch
from torch import nn

import floatguard

torch.manual_seed(0)
layer = nn.Linear(2, 3)  # weight 3x2
x = torch.randn(5, 2)
report = floatguard.gradcheck(layer, (x,), wrt="parameters")
print(report)
print(f"linear ok: {report.ok}")


class BuggyLinear(torch.autograd.Function):
    """y = x W^T + b with a backward that forgets to sum the bias gradient over the batch."""

    @staticmethod
    def forward(ctx, x, w, b):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x, w)
        return x @ w.T + b

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        x, w = ctx.saved_tensors
        return g @ w, g.T @ x, g[0]  # bug: should be g.sum(0)


w = torch.randn(3, 2)
b = torch.randn(3)
buggy = floatguard.gradcheck(BuggyLinear.apply, (x, w, b))
print(buggy)
print(f"buggy ok: {buggy.ok}")
print(f"buggy bias verdict: {buggy['input[2]'].verdict}")
