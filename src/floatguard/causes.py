"""The one cause vocabulary: why a step was not applied, and why a run was stopped.

The guard's policy decides in these words, :class:`~floatguard.guard.StepResult.reason`
and the ``step``/``fault`` events carry them, and the report and the diagnosis read
them. Pure Python (no torch), so every layer can import it.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["CAUSES", "STOP_REASONS", "Cause", "StopReason", "describe"]

Cause = Literal[
    "nonfinite_input",
    "nonfinite_param",
    "nonfinite_optimizer_state",
    "nonfinite_buffer",
    "optimizer_update",
    "overflow",
    "nonfinite_loss",
    "nonfinite_grad",
    "transient",
    "loss_spike",
    "grad_norm_spike",
    "after_rollback",
]
StopReason = Literal[
    "repeated_fault",
    "max_rollbacks",
    "bad_data",
    "no_clean_snapshot",
    "peer_failed",
    "desync",
]
CAUSES: tuple[str, ...] = get_args(Cause)
STOP_REASONS: tuple[str, ...] = get_args(StopReason)

_TEXT: dict[str, str] = {
    "nonfinite_input": "the batch the step was given holds a non-finite value",
    "nonfinite_param": (
        "a parameter was non-finite (or absurdly large, as after a flipped exponent bit) "
        "before the step"
    ),
    "nonfinite_optimizer_state": "an optimizer state tensor (a moment) was non-finite",
    "nonfinite_buffer": (
        "a floating-point buffer (BatchNorm's running statistics, say) held a NaN or inf"
    ),
    "optimizer_update": (
        "the last optimizer update turned finite parameters and gradients into a "
        "non-finite parameter"
    ),
    "overflow": "fp16 gradients overflowed with a finite loss (the loss scale backs off)",
    "nonfinite_loss": "the forward (or the loss) produced a non-finite value",
    "nonfinite_grad": "the backward produced a non-finite gradient from a finite loss",
    "transient": "the step was bad but its replay was not (nondeterminism or hardware)",
    "loss_spike": "the loss jumped far above its recent values",
    "grad_norm_spike": "the gradient norm jumped far above its recent values",
    "after_rollback": "a batch the policy skips after a rollback (skip_batches)",
    "repeated_fault": "the same deterministic fault came back after a rollback",
    "max_rollbacks": "rollbacks in a row did not restore healthy steps",
    "bad_data": "the data pipeline keeps producing non-finite batches",
    "no_clean_snapshot": "a rollback was needed and no clean snapshot was left",
    "peer_failed": "another rank failed",
    "desync": "the ranks were not deciding the same step with the same configuration",
}


def describe(word: str) -> str:
    """One sentence for a cause or a stop reason (the word itself when unknown)."""
    return _TEXT.get(word, word)
