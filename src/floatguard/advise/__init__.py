"""Which layers to keep in high precision under an emulated recipe, measured on a CPU.

``advise(model, batches, recipe)`` answers "which GEMM layers should stay in BF16, and
what will the gap be?" before any GPU time, with the bit-exact fake-quant of
:func:`floatguard.emulate`.

The estimator (``docs/fp8.md``, "Which layers to keep"): *measured ablation*, not a
first-order guess. On each batch the model's loss and full gradient are computed in
high precision (the reference), with every candidate layer emulated, and with one layer
at a time emulated (the others in high precision); with ``per_gemm=True`` also with
only that layer's forward (fprop), input-gradient (dgrad) or weight-gradient (wgrad)
GEMM emulated; with ``leave_one_out=True`` also with every layer emulated but that one.
A configuration's error is the relative squared error of the whole gradient,
``||g - g_ref||^2 / ||g_ref||^2`` (its SQNR in dB is ``-10 log10``), and its loss change
``L - L_ref``, each the mean over the batches. The error of one layer alone ranks the
layers (what the layer adds, free of the others' noise); the leave-one-out gain (the
all-emulated error minus the error with that layer kept) is the second estimator, and
their rank agreement (Spearman) is reported: when it is low, errors interact and the
plan is measured, not only predicted. Against the trained gap each layer closes when
kept alone (``benchmarks/bench_advise.py --oracle``, the tiny GPT under NVFP4) the
error alone agreed best after a 30-step warm-up (Spearman 0.88; the gain 0.64, the
loss change 0.57); on the randomly initialized model none did (0.00, 0.10, -0.24), so
measure a model that has trained: a checkpoint, or ``warmup_steps``. Cost, in forward+backward
passes: ``len(batches) * (3 + L * (1 + G + leave_one_out))`` for ``L`` candidate layers
and ``G`` GEMMs the recipe quantizes (0 with ``per_gemm=False`` or when it quantizes
only one), plus one pass for the operand statistics, one counting the FLOPs and
``warmup_steps``.

The plan: the layers whose errors alone sum highest while their GEMM FLOPs
(forward and backward, counted by :func:`floatguard.emulation.coverage`) fit
``budget``, a fraction of all GEMM FLOPs (a 0/1 knapsack over the shares rounded up to
budget/20000: the errors of layers emulated together add up, e.g. on the demo's tiny
GPT under MXFP8 the nine layers' errors alone sum to the all-emulated error within 1%,
so a cheap sensitive layer can be worth more than a costly one a little more
sensitive), or an int, a number of layers (the top of the ranking). A layer the recipe or ``skip``
already keeps in high precision is never proposed. The plan is then run: ``gap_plan``
is measured, and ``predicted_plan`` is the additive prediction from the leave-one-out
gains. With ``train_steps``, the expected loss gap (:func:`floatguard.expected_gap`)
costs ``3 * seeds * train_steps`` more passes and optimizer steps.

Nothing of the model changes: the work runs on a deep copy (one model's memory), with
torch's RNG forked and reseeded identically for every pass of a batch (dropout draws the
same masks in every configuration). Operand statistics (per layer, from the reference
pass; ``nn.Linear`` and GPT-2's ``Conv1D``): each operand quantized by the recipe in its
GEMM's layout, its SQNR in dB, the fraction of its nonzero values flushed to zero
(underflow), and the fraction clamped (saturation: in the tensor's top octave, more than
half an element ulp below the value; only formats and scale rules that saturate, as MX's
``floor``, show any).
"""

from __future__ import annotations

from floatguard.advise.core import advise
from floatguard.advise.result import Advice, LayerAdvice

__all__ = ["Advice", "LayerAdvice", "advise"]
