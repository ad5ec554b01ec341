"""What a check reads of a tensor: the values it stands for, as a strided real tensor."""

from __future__ import annotations

import torch

__all__ = ["dense_sum", "grad_to_modify", "local_part", "stored_values", "values_of"]


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (an FSDP2 shard), a plain tensor as it is: a check
    that reads local values runs no collective."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def stored_values(t: torch.Tensor) -> torch.Tensor:
    """The stored values of a sparse tensor, as a strided tensor that shares its memory.

    A COO tensor is coalesced first (duplicate entries summed, as the tensor means
    them): two finite entries for one index whose sum overflows are an inf. Strided
    tensors are returned as they are.
    """
    if t.layout == torch.strided:
        return t
    if t.layout == torch.sparse_coo:
        return t.values() if t.is_coalesced() else t.coalesce().values()
    return t.values()  # compressed layouts (CSR, CSC, BSR, BSC) store no duplicates


def values_of(t: torch.Tensor) -> torch.Tensor:
    """A strided real tensor holding exactly ``t``'s values: sparse tensors by their
    stored values (:func:`stored_values`), complex ones through their real view (real
    and imaginary parts); a DTensor by this rank's part (:func:`local_part`). Detached."""
    t = stored_values(local_part(t.detach()))
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


def dense_sum(t: torch.Tensor) -> torch.Tensor:
    """A sparse COO tensor as the dense tensor it stands for, duplicates summed with
    ``index_add_`` (what a sparse update of a dense parameter does), without a host
    sync: coalescing would size its output on the host. Costs the dense tensor's
    memory. Other tensors are returned as they are."""
    if t.layout != torch.sparse_coo:
        return t
    t = t.detach()
    sd = t.sparse_dim()
    dense = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    idx, vals = t._indices(), t._values()
    if vals.shape[0] == 0:
        return dense
    lin = idx[0]
    for d in range(1, sd):
        lin = lin * t.shape[d] + idx[d]
    dense.view(-1, *t.shape[sd:]).index_add_(0, lin, vals)
    return dense
