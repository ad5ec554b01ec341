"""The random Hadamard transform (RHT) of NVIDIA's NVFP4 training recipe.

NVIDIA, "Pretraining Large Language Models with NVFP4" (arXiv 2509.25149, 2025,
section 4.2) multiplies every 16-element block of both weight-gradient GEMM inputs
(``dY`` and ``X``, blocks along the tokens: the Wgrad reduction dim) by ``D H``:
``H`` the 16x16 Sylvester Hadamard matrix scaled by ``1/sqrt(16)`` (orthonormal,
entries +-1/4) and ``D`` a diagonal of random signs, one vector shared by every layer
for the whole run. ``(a D H)(b D H)^T = a b^T``, so the transform cancels in the GEMM
and only changes what gets quantized: outliers are spread over their block.

Transformer Engine's ``NVFP4BlockScaling`` does it with a hard-coded sign vector
(``transformer_engine/pytorch/tensor/nvfp4_tensor.py``: ``get_wgrad_sign_vector``,
``get_rht_matrix`` = ``diag(signs) @ H``; its reference quantizer
``custom_recipes/reference_nvfp4.py``: ``_apply_rht`` computes ``x_blocks @ (D H)``),
on the column-wise (transposed) copy only: the Wgrad operands. :data:`TE_SIGNS` is
that vector; ``seed=`` draws another one, reproducibly.

Numerics: the transform is computed as a sign flip, a Walsh-Hadamard butterfly
(additions only, no matmul: the dispatch-level coverage audit does not count it as
a GEMM) and one multiplication by ``1/sqrt(n)``, in float64, rounded once to float32.
For float32 inputs of one block within 2**29 of each other the float64 sums are
exact, so the result is the correctly rounded ``x_block @ (D H)``. inf or NaN in a
block spreads over the whole block (inf - inf = NaN), as in the kernel.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["TE_SIGNS", "hadamard_matrix", "random_hadamard_transform", "rht_matrix", "rht_signs"]

TE_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
"""Transformer Engine's fixed "random" sign vector for its 16-point RHT
(``get_wgrad_sign_vector``)."""


def _check_size(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 2 or n & (n - 1):
        raise ValueError(f"Hadamard size {n!r} must be a power of two >= 2 (NVFP4 uses 16)")


def hadamard_matrix(n: int = 16) -> torch.Tensor:
    """The ``n x n`` Sylvester Hadamard matrix scaled by ``1/sqrt(n)`` (orthonormal:
    ``H H^T = I``; symmetric), float32. Exact for n a power of 4 (entries +-2**-k)."""
    _check_size(n)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(torch.float32)


@functools.lru_cache(maxsize=32)
def _signs(n: int, seed: int | None) -> tuple[float, ...]:
    if seed is None:
        if n != len(TE_SIGNS):
            raise ValueError(
                f"Transformer Engine's sign vector has 16 entries, not {n}: "
                "pass seed= for another size"
            )
        return tuple(float(s) for s in TE_SIGNS)
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2, (n,), generator=g)
    return tuple(float(1 - 2 * b) for b in bits.tolist())  # host-side, once per (n, seed)


def rht_signs(n: int = 16, seed: int | None = None) -> torch.Tensor:
    """The diagonal of ``D`` (float32 +-1): Transformer Engine's :data:`TE_SIGNS` when
    ``seed`` is None (n must be 16), else ``n`` signs drawn from a
    ``torch.Generator`` seeded with ``seed`` (the same vector on every call)."""
    _check_size(n)
    return torch.tensor(_signs(n, seed), dtype=torch.float32)


@functools.lru_cache(maxsize=32)
def _signs_on(n: int, seed: int | None, device: torch.device) -> torch.Tensor:
    """The sign vector in float64 on ``device``, copied there once (not every step)."""
    return rht_signs(n, seed).to(device=device, dtype=torch.float64)


def rht_matrix(n: int = 16, seed: int | None = None) -> torch.Tensor:
    """``D H`` (float32): a block ``x`` (a row of ``n`` elements) is transformed to
    ``x @ rht_matrix(n, seed)``, as TE's ``get_rht_matrix`` (``diag(signs) @ H``)."""
    return (torch.diag(rht_signs(n, seed)).double() @ hadamard_matrix(n).double()).float()


def random_hadamard_transform(
    x: torch.Tensor, n: int = 16, seed: int | None = None
) -> torch.Tensor:
    """Every block of ``n`` consecutive elements along x's last dim times ``D H``
    (:func:`rht_matrix`): float64 butterfly, rounded once to float32; returns float32
    of x's shape. The last dim must be a multiple of ``n`` (zero-pad first: padding
    transforms to padding in neither operand, but cancels in the GEMM). Stays on x's
    device; no sync."""
    _check_size(n)
    if x.shape[-1] % n:
        raise ValueError(
            f"random_hadamard_transform: last dim {x.shape[-1]} is not a multiple of the "
            f"Hadamard size {n}; zero-pad it to {x.shape[-1] + (-x.shape[-1]) % n}"
        )
    signs = _signs_on(n, seed, x.device)
    y = x.to(torch.float64).reshape(*x.shape[:-1], -1, n) * signs
    h = 1
    while h < n:  # Sylvester butterfly: [a, b] -> [a + b, a - b] over pairs h apart
        y = y.reshape(*y.shape[:-1], n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*x.shape[:-1], -1, n)
        h *= 2
    return (y * (1.0 / math.sqrt(n))).reshape(x.shape).to(torch.float32)
