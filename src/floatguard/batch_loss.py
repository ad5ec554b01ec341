"""The loss convention of the audit and the coverage check: ``loss_fn(model, batch)``.

:func:`batch_loss` is one batch's loss: ``loss_fn(model, batch)`` checked to be a
tensor, or the model's own loss (:func:`default_loss`: a Hugging Face output's
``.loss``, else the mean of its logits or output). :func:`check_loss_fn` refuses a
criterion passed as is (``nn.CrossEntropyLoss()`` takes ``(output, target)``), naming
the lambda to pass instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["WRAP", "batch_loss", "check_loss_fn", "default_loss", "output_loss"]


def default_loss(model: nn.Module, batch: Any, who: str = "audit") -> torch.Tensor:
    """The model's own loss when it returns one (a Hugging Face ``ModelOutput`` with
    ``.loss``), else the mean of its logits or output. A dict batch is passed as
    keyword arguments."""
    out = model(**batch) if isinstance(batch, dict) else model(batch)
    return output_loss(out, who)[0]


def output_loss(out: Any, who: str = "audit") -> tuple[torch.Tensor, bool]:
    """The loss :func:`default_loss` takes from a model's output, and whether it is the
    model's own (``.loss``) rather than the mean of its logits or output."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss, True
    if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
        found: torch.Tensor = out["loss"]
        return found, True
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, dict):
        logits = out.get("logits")
    if isinstance(logits, torch.Tensor):
        return logits.float().mean(), False
    if isinstance(out, torch.Tensor):
        return out.float().mean(), False
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0].float().mean(), False
    raise TypeError(
        f"{who}: cannot make a loss from the model's output ({type(out).__name__}); "
        "pass loss_fn=lambda model, batch: ..."
    )


WRAP = "loss_fn=lambda model, batch: criterion(model(batch[0]), batch[1])"


def check_loss_fn(loss_fn: object, who: str = "audit") -> None:
    """A torch loss module is a criterion(output, target), not a loss_fn(model, batch)."""
    if isinstance(loss_fn, nn.modules.loss._Loss):
        raise TypeError(
            f"{who}: loss_fn={type(loss_fn).__name__}() is a criterion(output, target); "
            f"{who} calls loss_fn(model, batch): pass {WRAP}"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"{who}: loss_fn must be callable as loss_fn(model, batch), got {loss_fn!r}"
        )


def batch_loss(
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None,
    model: nn.Module,
    batch: Any,
    who: str = "audit",
) -> torch.Tensor:
    """``loss_fn(model, batch)`` (or the default loss), checked to be a tensor; a TypeError
    it raises says how ``who`` (the caller: audit, advise, ...) calls it (a criterion
    passed as is fails that way)."""
    if loss_fn is None:
        return default_loss(model, batch, who)
    try:
        loss = loss_fn(model, batch)
    except TypeError as e:
        raise TypeError(
            f"{who}: loss_fn(model, batch) raised TypeError: {e} ({who} calls loss_fn with "
            f"the model and one element of batches; for a criterion(output, target) pass {WRAP})"
        ) from e
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"{who}: loss_fn(model, batch) returned {type(loss).__name__}; it must return the "
            "loss as a scalar tensor"
        )
    return loss
