"""Numerically safe operations: differentiable, every float dtype, contracts written down."""

from floatguard.ops.attention import attention
from floatguard.ops.elementwise import (
    log1mexp,
    log1pexp,
    logaddexp,
    safe_div,
    safe_log,
    safe_sqrt,
    sigmoid,
    softplus,
)
from floatguard.ops.gradcheck import GradcheckEntry, GradcheckReport, gradcheck
from floatguard.ops.losses import chunked_cross_entropy, cross_entropy
from floatguard.ops.norms import DEFAULT_EPS, default_eps, layer_norm, rms_norm
from floatguard.ops.reductions import Moments, compensated_sum, pairwise_sum
from floatguard.ops.softmax import LogSumExp, log_softmax, logsumexp, softmax

__all__ = [
    "DEFAULT_EPS",
    "GradcheckEntry",
    "GradcheckReport",
    "LogSumExp",
    "Moments",
    "attention",
    "chunked_cross_entropy",
    "compensated_sum",
    "cross_entropy",
    "default_eps",
    "gradcheck",
    "layer_norm",
    "log1mexp",
    "log1pexp",
    "log_softmax",
    "logaddexp",
    "logsumexp",
    "pairwise_sum",
    "rms_norm",
    "safe_div",
    "safe_log",
    "safe_sqrt",
    "sigmoid",
    "softmax",
    "softplus",
]
