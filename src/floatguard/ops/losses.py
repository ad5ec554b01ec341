"""Cross-entropy that never overflows, and a chunked version that never builds [N, V] logits."""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from floatguard.ops._common import acc_dtype, check_float
from floatguard.ops.softmax import log_softmax

__all__ = ["chunked_cross_entropy", "cross_entropy"]

Reduction = Literal["mean", "sum", "none"]
_REDUCTIONS = ("mean", "sum", "none")


def _check_common(op: str, reduction: str, label_smoothing: float, target: torch.Tensor) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{op}: reduction={reduction!r}; use one of {_REDUCTIONS}")
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing={label_smoothing!r} must be in [0, 1]")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{op}: target must be a torch.Tensor, got {type(target).__name__}")


def _check_class_targets(
    op: str, target: torch.Tensor, num_classes: int, ignore_index: int
) -> None:
    """Range-check integer targets. Only on CPU, where reading them costs no device sync."""
    if target.dtype in (torch.bool,) or target.dtype.is_floating_point or target.is_complex():
        raise TypeError(f"{op}: class targets must be an integer tensor, got {target.dtype}")
    if target.device.type != "cpu" or target.numel() == 0:
        return
    valid = target != ignore_index
    bad = valid & ((target < 0) | (target >= num_classes))
    if bool(bad.any()):
        pos = tuple(int(i) for i in bad.nonzero()[0])
        value = int(target[pos])
        raise IndexError(
            f"{op}: target[{', '.join(map(str, pos))}] = {value} is out of range for "
            f"{num_classes} classes (valid: 0..{num_classes - 1}, or ignore_index={ignore_index})"
        )


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """Cross-entropy from logits, stable for any finite logits (±1e4 in fp16 included).

    Shapes and conventions are torch's: ``logits`` is ``(C,)``, ``(N, C)`` or
    ``(N, C, d1, ...)``; ``target`` holds class indices (integer, shape without the
    C dim) or class probabilities (float, same shape as ``logits``).
    ``weight`` rescales classes, ``label_smoothing`` mixes the target with the
    uniform distribution, ``reduction="mean"`` averages over non-ignored elements
    (weighted, as torch).

    Numerics: log-softmax with the max subtracted, in float32 for half logits, so
    ``cross_entropy([-1000, 1000], 0) = 2000`` exactly. The loss comes back in the
    logits' dtype. Where torch returns NaN for a mean over zero elements (every
    target ignored), this returns 0 with a zero gradient. Integer targets are
    range-checked on CPU (the error names the index); on accelerators that check
    would cost a host sync, so there an out-of-range index fails inside torch.
    """
    op = "cross_entropy"
    check_float(logits, "logits", op)
    _check_common(op, reduction, label_smoothing, target)
    if logits.dim() == 0:
        raise ValueError(f"{op}: logits must have a class dimension, got a 0-d tensor")
    cdim = 0 if logits.dim() == 1 else 1
    num_classes = logits.shape[cdim]
    lsm = log_softmax(logits.to(acc_dtype(logits.dtype)), dim=cdim)
    w = None
    if weight is not None:
        check_float(weight, "weight", op)
        if weight.shape != (num_classes,):
            raise ValueError(
                f"{op}: weight has shape {tuple(weight.shape)}; expected ({num_classes},)"
            )
        w = weight.to(lsm.dtype)
    wshape = [1] * lsm.dim()
    wshape[cdim] = num_classes
    if target.dtype.is_floating_point:  # class probabilities
        if target.shape != logits.shape:
            raise ValueError(
                f"{op}: probability targets must match logits' shape {tuple(logits.shape)}, "
                f"got {tuple(target.shape)}"
            )
        p = target.to(lsm.dtype)
        if label_smoothing > 0:
            p = p * (1 - label_smoothing) + label_smoothing / num_classes
        terms = -p * lsm
        if w is not None:
            terms = terms * w.reshape(wshape)
        loss = terms.sum(dim=cdim)
        if reduction == "mean":
            n = loss.numel()
            out = loss.sum() / max(n, 1)
        elif reduction == "sum":
            out = loss.sum()
        else:
            out = loss
        return out.to(logits.dtype)
    expected = logits.shape[:cdim] + logits.shape[cdim + 1 :]
    if target.shape != expected:
        raise ValueError(
            f"{op}: target has shape {tuple(target.shape)}; for logits of shape "
            f"{tuple(logits.shape)} it must be {tuple(expected)}"
        )
    _check_class_targets(op, target, num_classes, ignore_index)
    valid = target != ignore_index
    safe_t = torch.where(valid, target, torch.zeros_like(target)).long()
    nll = -lsm.gather(cdim, safe_t.unsqueeze(cdim)).squeeze(cdim)
    if w is not None:
        wt = w[safe_t]
        nll = nll * wt
    else:
        wt = torch.ones_like(nll)
    loss = nll
    if label_smoothing > 0:
        smooth = -lsm * w.reshape(wshape) if w is not None else -lsm
        smooth = smooth.sum(dim=cdim) / num_classes
        loss = (1 - label_smoothing) * nll + label_smoothing * smooth
    zero = torch.zeros_like(loss)
    loss = torch.where(valid, loss, zero)
    if reduction == "none":
        return loss.to(logits.dtype)
    total = loss.sum()
    if reduction == "sum":
        return total.to(logits.dtype)
    denom = torch.where(valid, wt, torch.zeros_like(wt)).sum()
    # Every target ignored: 0 instead of torch's 0/0 = NaN (and a zero gradient).
    out = total / torch.where(denom > 0, denom, torch.ones_like(denom))
    return out.to(logits.dtype)


class _ChunkedCE(torch.autograd.Function):
    """Forward: online log-sum-exp over vocabulary chunks. Backward: recompute per chunk."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        chunk_size: int,
        ignore_index: int,
        label_smoothing: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        acc = acc_dtype(hidden.dtype)
        h = hidden.to(acc)
        n, vocab = h.shape[0], weight.shape[0]
        valid = target != ignore_index
        safe_t = torch.where(valid, target, torch.zeros_like(target)).long()
        m = torch.full((n,), -math.inf, dtype=acc, device=h.device)
        s = torch.zeros((n,), dtype=acc, device=h.device)
        target_logit = torch.zeros((n,), dtype=acc, device=h.device)
        logit_sum = torch.zeros((n,), dtype=acc, device=h.device)
        for start in range(0, vocab, chunk_size):
            stop = min(start + chunk_size, vocab)
            z = h @ weight[start:stop].to(acc).T  # [n, chunk]: the only large temporary
            cm = torch.maximum(m, z.amax(dim=1))
            cm_safe = torch.where(torch.isfinite(cm), cm, torch.zeros_like(cm))
            s = s * torch.exp(m - cm_safe) + torch.exp(z - cm_safe[:, None]).sum(dim=1)
            m = cm
            inside = (safe_t >= start) & (safe_t < stop)
            idx = (safe_t - start).clamp(0, stop - start - 1)
            target_logit = target_logit + torch.where(
                inside, z.gather(1, idx[:, None]).squeeze(1), torch.zeros_like(target_logit)
            )
            if label_smoothing > 0:
                logit_sum = logit_sum + z.sum(dim=1)
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        lse = m_safe + torch.log(s)
        loss = lse - target_logit
        if label_smoothing > 0:
            smooth = lse - logit_sum / vocab
            loss = (1 - label_smoothing) * loss + label_smoothing * smooth
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        ctx.save_for_backward(hidden, weight, safe_t, valid, lse)
        ctx.chunk_size = chunk_size
        ctx.label_smoothing = label_smoothing
        return loss, lse

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, grad_lse: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, safe_t, valid, lse = ctx.saved_tensors
        acc = acc_dtype(hidden.dtype)
        h = hidden.to(acc)
        eps = ctx.label_smoothing
        vocab = weight.shape[0]
        g = torch.where(valid, grad_loss.to(acc), torch.zeros_like(lse))
        g_lse = grad_lse.to(acc) if grad_lse is not None else torch.zeros_like(lse)
        grad_h = torch.zeros_like(h) if ctx.needs_input_grad[0] else None
        grad_w = (
            torch.zeros(weight.shape, dtype=acc, device=weight.device)
            if ctx.needs_input_grad[1]
            else None
        )
        for start in range(0, vocab, ctx.chunk_size):
            stop = min(start + ctx.chunk_size, vocab)
            w_chunk = weight[start:stop].to(acc)
            p = torch.exp(h @ w_chunk.T - lse[:, None])  # softmax of this chunk
            # d loss / d z = p - (1 - eps) * onehot - eps / V, per row times g;
            # d lse / d z = p, times the lse output's gradient (if any).
            dz = p * (g + g_lse)[:, None]
            if eps > 0:
                dz = dz - (eps / vocab) * g[:, None]
            inside = (safe_t >= start) & (safe_t < stop)
            rows = inside.nonzero().squeeze(1)
            cols = safe_t[rows] - start
            dz[rows, cols] -= (1 - eps) * g[rows]
            if grad_h is not None:
                grad_h += dz @ w_chunk
            if grad_w is not None:
                grad_w[start:stop] = dz.T @ h
        return (
            None if grad_h is None else grad_h.to(hidden.dtype),
            None if grad_w is None else grad_w.to(weight.dtype),
            None,
            None,
            None,
            None,
        )


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    chunk_size: int = 4096,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` without materialising the ``[N, V]`` logits.

    ``hidden`` is ``[N, d]`` (or ``[..., d]``, flattened), ``weight`` is the
    ``[V, d]`` output projection, ``target`` the class indices. The forward pass
    walks the vocabulary in chunks of ``chunk_size`` rows of ``weight``, keeping a
    running (max, sum) log-sum-exp per row; the backward pass recomputes each
    chunk's logits. Peak extra memory is ``O(N * chunk_size)`` instead of
    ``O(N * V)``; the cost is one extra matmul (the recompute). Accumulation is in
    float32 for half inputs. Values and gradients match
    ``F.cross_entropy(hidden @ weight.T, target)``; the mean over all-ignored
    targets is 0, as in :func:`cross_entropy`.
    """
    op = "chunked_cross_entropy"
    check_float(hidden, "hidden", op)
    check_float(weight, "weight", op)
    _check_common(op, reduction, label_smoothing, target)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size={chunk_size!r} must be a positive int")
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{op}: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not fit; "
            "expected hidden [..., d] and weight [V, d]"
        )
    if target.shape != hidden.shape[:-1]:
        raise ValueError(
            f"{op}: target has shape {tuple(target.shape)}; expected {tuple(hidden.shape[:-1])}"
        )
    _check_class_targets(op, target, weight.shape[0], ignore_index)
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t1 = target.reshape(-1)
    res: tuple[torch.Tensor, torch.Tensor] = _ChunkedCE.apply(  # type: ignore[no-untyped-call]
        h2, weight, t1, chunk_size, ignore_index, float(label_smoothing)
    )
    loss = res[0]
    loss = loss.reshape(target.shape)
    if reduction == "none":
        return loss.to(hidden.dtype)
    total = loss.sum()
    if reduction == "sum":
        return total.to(hidden.dtype)
    count = (t1 != ignore_index).sum()
    return (total / count.clamp(min=1)).to(hidden.dtype)
