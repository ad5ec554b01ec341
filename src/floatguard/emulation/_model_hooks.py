"""The hooks :func:`~floatguard.emulation.emulate` puts around a model's forward
(:class:`RootHooks`: the SDPA replacement, torch's MHA fast path turned off) and around
an nn.MultiheadAttention's (:class:`MHAHooks`: its ``F.linear`` calls emulated)."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from floatguard.emulation._emulated_layers import emulated_sdpa, source_dtype
from floatguard.emulation._gemm import _emulated_gemm
from floatguard.emulation._scale_state import LayerCasts, ScalingState
from floatguard.emulation.emulation_recipe import EmulationRecipe

__all__ = ["MHAHooks", "RootHooks"]


class RootHooks:
    """Root-module hooks around each forward of an emulated model.

    ``attention``: ``F.scaled_dot_product_attention`` is replaced in
    ``torch.nn.functional`` for the duration of the forward (and put back after it,
    also when it raises): a TorchFunctionMode would not see the call
    nn.MultiheadAttention makes inside ``F.multi_head_attention_forward``. A name
    imported with ``from torch.nn.functional import scaled_dot_product_attention``
    before emulate() is not replaced; nor are attention matmuls written with
    ``torch.matmul`` (a forward that calls no SDPA logs a warning once).
    ``mha``: torch's fused fast paths for nn.MultiheadAttention and
    nn.TransformerEncoderLayer (eval mode) are turned off during the forward, so the
    emulated projections are the ones that run. ``calls`` counts the emulated SDPA calls,
    ``forwards`` the model's forwards (what :attr:`Coverage.attention` reads). Not
    thread-safe: two threads running forwards at once would share the replacements."""

    def __init__(self, model: nn.Module, recipe: EmulationRecipe, *, attention: bool,
                 mha: bool) -> None:  # fmt: skip
        self.recipe = recipe
        self.attention = attention
        self.mha = mha
        self.depth = 0
        self.calls = 0
        self.forwards = 0
        self.calls_before = 0
        self.warned = False
        self.saved: Any = None
        self.fastpath = True
        self.handles = [
            model.register_forward_pre_hook(self._enter),
            model.register_forward_hook(self._exit, always_call=True),
        ]

    def _sdpa(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1

        return emulated_sdpa(*args, recipe=self.recipe, **kwargs)

    def _enter(self, module: nn.Module, args: Any) -> None:
        if self.depth == 0:
            if self.attention:
                self.calls_before = self.calls
                self.saved = F.scaled_dot_product_attention
                F.scaled_dot_product_attention = self._sdpa
            if self.mha:
                self.fastpath = torch.backends.mha.get_fastpath_enabled()
                torch.backends.mha.set_fastpath_enabled(False)
        self.depth += 1

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1
        if self.depth != 0:
            return
        self.forwards += 1
        if self.mha:
            torch.backends.mha.set_fastpath_enabled(self.fastpath)
        if not self.attention:
            return
        F.scaled_dot_product_attention = self.saved
        if self.calls == self.calls_before and not self.warned:
            self.warned = True
            logging.getLogger("floatguard").warning(
                "emulate(attention=True): %s's forward called no "
                "scaled_dot_product_attention; its attention matmuls (if any, e.g. an "
                "eager torch.matmul implementation) ran in high precision",
                type(module).__name__,
            )

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class MHAHooks:
    """nn.MultiheadAttention's in- and out-projections emulated: it applies its own
    parameters with ``F.linear`` inside ``F.multi_head_attention_forward`` (its out_proj
    module is never called), so ``F.linear`` is the emulated GEMM during its forward."""

    def __init__(
        self, module: nn.Module, recipe: EmulationRecipe, name: str, state: ScalingState | None
    ) -> None:
        self.recipe = recipe
        self.saved: Any = None
        # one scaling state per projection weight (in_proj, out_proj, q/k/v_proj)
        self.casts: dict[int, LayerCasts] = {}
        if state is not None:
            for pname, p in module.named_parameters():
                if p.dim() == 2:
                    self.casts[id(p)] = state.layer(f"{name}.{pname}", p.device)
        self.handles = [
            module.register_forward_pre_hook(self._enter),
            module.register_forward_hook(self._exit, always_call=True),
        ]

    def _linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        root = weight  # cross-attention splits in_proj_weight into q and kv views
        while root._base is not None:
            root = root._base
        casts = self.casts.get(id(weight), self.casts.get(id(root)))
        y = _emulated_gemm(x.float(), weight.float(), self.recipe, casts, source_dtype(x))
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)

    def _enter(self, module: nn.Module, args: Any) -> None:
        self.saved = F.linear
        F.linear = self._linear  # type: ignore[assignment]

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        F.linear = self.saved

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
