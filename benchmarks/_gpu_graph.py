"""gpu_check's (h): the deferred guard's step as a CUDA graph (``Guard.graphed``, issue 43
item 5). Kept apart from gpu_check.py, which imports :func:`graph_check`.

Per model, bf16, fused AdamW: a graphed guard, a deferred guard stepping eagerly and the
sync-free peer (autocast, ``clip_grad_norm_``, fused AdamW) on the same batches.

- the steps after warm-up replayed, not run eagerly (expected: all of them);
- the synchronizing calls per replayed step in warn mode (expected 0), and the same
  steps under ``set_sync_debug_mode("error")``;
- the weights after the steps, graphed against the eager deferred guard (expected:
  bit for bit: the same kernels);
- the step time of each against the peer (INFO).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from floatguard import Guard, ResponsePolicy


def _build(backend: Any, cfg: Any, batch: int, setup: Callable[..., Any]) -> tuple[Any, ...]:
    model, _, x, y = setup(backend, cfg, batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return model, opt, x, y


def _guarded(
    backend: Any, cfg: Any, batch: int, gc: Any, sizes: Any, kind: str | None
) -> tuple[Callable[[], Any], Guard, nn.Module, Any]:
    """A deferred bf16 guard on a fresh GPT: graphed (``kind``: its backend) or eager."""
    model, opt, x, y = _build(backend, cfg, batch, gc._setup)
    guard = Guard(model, opt, precision="bf16", sync="deferred",
                  response=ResponsePolicy(snapshot_every=10**6))  # fmt: skip

    def loss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return gc._lm_loss(model, a, b)  # type: ignore[no-any-return]

    if kind is not None:
        g = guard.graphed(loss, x, y, warmup=sizes.warmup, backend=kind)
        return (lambda: g(x, y)), guard, model, g
    return (lambda: guard.step(lambda: loss(x, y))), guard, model, None


def graph_check(backend: Any, sizes: Any, gc: Any) -> list[Any]:
    """(h) the rows (see the module); ``gc``: gpu_check's module (its helpers)."""
    rows: list[Any] = []
    for name, cfg, batch in sizes.models:
        rows += _model_rows(backend, sizes, gc, name, cfg, batch)
    return rows


def _model_rows(backend: Any, sizes: Any, gc: Any, name: str, cfg: Any, batch: int) -> list[Any]:
    rows: list[Any] = []
    steps = sizes.sync_steps
    kind = "cuda" if backend.kind == "cuda" else "check"
    step, guard, model, g = _guarded(backend, cfg, batch, gc, sizes, kind)
    plain, g_plain, m_plain, _ = _guarded(backend, cfg, batch, gc, sizes, None)
    for _ in range(sizes.warmup):
        step()
        plain()
    per_step = gc.count_syncs(backend, step, steps)
    for _ in range(steps):
        plain()
    rows.append(gc.Row(
        f"(h) graphed steps replayed, {name}, bf16",
        f"{g.replays} of {g.replays + g.eager_steps} ({g.captures} capture, backend "
        f"{g.backend}; last eager: {g.why_eager or '-'})",
        f"all {steps} after the {sizes.warmup} warm-up",
        "PASS" if g.eager_steps == sizes.warmup and g.replays == steps else "FAIL",
    ))  # fmt: skip
    rows.append(gc.no_sync_row(f"(h) syncs per replayed step, {name}, bf16", per_step))

    def both() -> None:
        step()
        plain()

    rows.append(gc.error_mode_row(
        backend, f"(h) set_sync_debug_mode('error') on replays, {name}, bf16", both, steps
    ))  # fmt: skip
    guard.settle()
    g_plain.settle()
    same = all(
        torch.equal(a, b) for a, b in zip(model.parameters(), m_plain.parameters(), strict=True)
    )
    rows.append(gc.Row(
        f"(h) weights, graphed vs eager deferred, {name}, bf16",
        "bit for bit" if same else "differ", "bit for bit", "PASS" if same else "FAIL",
    ))  # fmt: skip
    model_p, opt_p, xp, yp = _build(backend, cfg, batch, gc._setup)
    peer = gc.clip_step(model_p, opt_p, lambda: gc._lm_loss(model_p, xp, yp), backend.kind,
                        torch.bfloat16)  # fmt: skip
    contenders = {"peer": peer, "deferred": plain, "graphed": step}
    med = gc.time_rounds(backend, contenders, sizes.bench_steps, sizes.bench_rounds, 1)
    guard.close()
    g_plain.close()
    for key in ("deferred", "graphed"):
        rows.append(gc.Row(
            f"(h) {name}, bf16: {key} guard / autocast + clip + fused AdamW",
            f"{med[key] / med['peer']:.3f}x ({med[key] * 1e3:.2f} vs "
            f"{med['peer'] * 1e3:.2f} ms/step)", "graphed <= deferred (no target yet)", "INFO",
        ))  # fmt: skip
    return rows
