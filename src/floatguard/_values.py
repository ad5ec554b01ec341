"""What a check reads of a tensor: the values it stands for, as a strided real tensor."""

from __future__ import annotations

import torch

__all__ = ["grad_to_modify", "stored_values", "values_of"]


def stored_values(t: torch.Tensor) -> torch.Tensor:
    """The stored values of a sparse tensor, as a strided tensor that shares its memory.

    A COO tensor is coalesced first (duplicate entries summed, as the tensor means
    them): two finite entries for one index whose sum overflows are an inf. Strided
    tensors are returned as they are.
    """
    if t.layout == torch.strided:
        return t
    if t.layout == torch.sparse_coo:
        return t.coalesce().values()
    return t.values()  # compressed layouts (CSR, CSC, BSR, BSC) store no duplicates


def values_of(t: torch.Tensor) -> torch.Tensor:
    """A strided real tensor holding exactly ``t``'s values: sparse tensors by their
    stored values (:func:`stored_values`), complex ones through their real view (real
    and imaginary parts). Detached."""
    t = stored_values(t.detach())
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj() if t.is_conj() else t)
    return t


def grad_to_modify(p: torch.Tensor) -> torch.Tensor:
    """``p.grad`` as a strided tensor to modify in place (unscale, clip, clamp).

    A sparse COO gradient is coalesced first (``p.grad`` is replaced by the coalesced
    tensor, the same values) and its values are returned: they alias the gradient.
    """
    g = p.grad
    if g is None:
        raise ValueError("the parameter has no gradient")
    if g.layout == torch.strided:
        return g
    if g.layout == torch.sparse_coo:
        if not g.is_coalesced():
            p.grad = g = g.coalesce()
        return g._values()
    return g.values()
