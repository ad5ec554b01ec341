"""Statistics of a watched tensor, read from memory that holds exactly its values.

On CPU, :mod:`floatguard.stats` reads float32 / bfloat16 / float16 data with a one-pass
C kernel that walks ``numel()`` values from ``x.reshape(-1).data_ptr()``. That is the
tensor's values only when the flat view is contiguous, and ``reshape(-1)`` returns a
*view* whenever it can: the gradient of ``loss.sum()`` or ``loss.mean()`` reaching the
model's output is a scalar expanded to the output's shape (stride 0: one stored value,
and the kernel read what lay beyond it), and a strided slice (``x[::2]``,
``pair[..., 0]``) flattens to a stride-2 view (the kernel read the skipped values).
Either made up NaN / +inf in stats mode, whose sentinel takes its min/max from the same
read, so a clean step reported a fault (``inf born in <root> (loss, grad_output[0])``,
issue 36 item 10). A tensor that is not contiguous is copied first: stats mode reads
every watched tensor in full anyway.
"""

from __future__ import annotations

import torch

from floatguard.stats import TensorStats, stats_and_aminmax, tensor_stats

__all__ = ["stats_and_minmax", "stats_of"]


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy of it when its memory has gaps or repeats."""
    if t.layout != torch.strided or t.is_contiguous():
        return t
    return t.contiguous()


def stats_and_minmax(
    t: torch.Tensor,
) -> tuple[TensorStats, tuple[torch.Tensor, torch.Tensor] | None]:
    """:func:`floatguard.stats.stats_and_aminmax` of ``t``'s values, whatever its strides."""
    return stats_and_aminmax(_dense(t))


def stats_of(t: torch.Tensor) -> TensorStats:
    """:func:`floatguard.stats.tensor_stats` of ``t``'s values, whatever its strides."""
    return tensor_stats(_dense(t))
