"""FP8 lesson, question 2: why attention divides the scores by sqrt(d_k).

With q and k of unit variance, q . k has variance d_k: at d_k = 128 the scores have a
standard deviation of ~11, and the softmax of many rows turns one-hot. For such a
row the softmax Jacobian ``diag(p) - p p^T`` is ~0: no gradient flows back through
the attention weights. Dividing by sqrt(d_k) brings the variance back to 1.
"""

import math

import torch

from floatguard.ops import softmax

g = torch.Generator().manual_seed(0)
d_k, n = 128, 64
q = torch.randn(n, d_k, generator=g)
k = torch.randn(n, d_k, generator=g)

for name, scale in [("unscaled", 1.0), ("scaled by 1/sqrt(d_k)", 1 / math.sqrt(d_k))]:
    p = softmax((q @ k.T) * scale, dim=-1)
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    # Frobenius norm of each row's softmax Jacobian diag(p) - p p^T, in closed form.
    s2 = (p * p).sum(-1)
    jac = torch.sqrt(torch.clamp(s2 - 2 * (p**3).sum(-1) + s2 * s2, min=0.0))
    print(f"{name} score std: {float((q @ k.T * scale).std()):.2f}")
    print(f"{name} mean max probability: {float(p.max(-1).values.mean()):.3f}")
    print(f"{name} mean entropy nats: {float(entropy.mean()):.3f}")
    one_hot = float((p.max(-1).values > 0.99).float().mean())
    vanishing = float((jac < 0.01).float().mean())
    print(f"{name} rows with max probability > 0.99: {one_hot:.3f}")
    print(f"{name} rows with vanishing softmax gradient (Jacobian norm < 0.01): {vanishing:.3f}")
