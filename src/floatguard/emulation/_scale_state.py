"""Per-layer scaling state of an emulated model: delayed scaling per layer and tensor
role, and the amax reduction across the ranks that hold a tensor's shards.

Transformer Engine's ``DelayedScaling`` (``transformer_engine/pytorch/quantization.py``,
``FP8GlobalStateManager``; docs "FP8 Delayed Scaling"), as emulated here:

- every module keeps an amax history and a scale per quantized tensor: the layer's
  input X, its weight W and its output gradient dY (TE's forward slots "input, weight"
  and backward slot "grad_output"). Each is cast once per step and the FP8 copy serves
  both GEMMs it enters (X in fprop and wgrad, W in fprop and dgrad, dY in dgrad and
  wgrad), so the backward GEMMs reuse the forward's casts;
- a cast uses the current scale and folds its amax into slot 0 (``atomicMax``: a layer
  called twice in a step records the larger amax);
- the forward roles update when the autocast region exits (here: when the emulated
  model's own forward returns) and only with grad enabled (``autocast_exit``: an
  evaluation forward under ``torch.no_grad()`` records amaxes that the next training
  update takes in); the backward role updates when the backward pass ends (TE: after
  the backward of the first FP8 module of the forward, the last to run);
- with ``reduce_amax`` the step's amaxes of every layer are concatenated and reduced
  with one MAX all-reduce over the amax reduction group before the update
  (``reduce_and_update_fp8_tensors``), then each history rolls with its reduced amax
  (``kernel_bulk`` takes the reduced amax where it is not 0).

Current tensor-wise scaling (:class:`~floatguard.emulation.recipes.Tensorwise`) with an
amax group reduces each cast's amax over the group before quantizing (TE's
``Float8CurrentScalingQuantizer`` with ``with_amax_reduction``, used for
sequence- and tensor-parallel tensors): every shard then gets the scale of the whole
tensor. Rowwise, block, MX and NVFP4 scales are never reduced (neither do TE's block
recipes): a block that does not cross a shard boundary has its global scale already.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist

from floatguard.emulation._core import QuantResult
from floatguard.emulation._delayed import Delayed, DelayedScaler
from floatguard.emulation.emulation_recipe import EmulationRecipe, Operand
from floatguard.emulation.recipes import Block, TensorRecipe, Tensorwise

__all__ = ["LayerCasts", "Role", "ScalingState"]

Role = Literal["input", "weight", "grad"]
ROLE: dict[Operand, Role] = {
    "fprop_input": "input", "wgrad_input": "input", "fprop_weight": "weight",
    "dgrad_weight": "weight", "dgrad_grad": "grad", "wgrad_grad": "grad",
}  # fmt: skip
FORWARD_ROLES: tuple[Role, ...] = ("input", "weight")


def plain_cast(
    recipe: TensorRecipe | Delayed | None, t: torch.Tensor, source: torch.dtype | None = None
) -> QuantResult | None:
    """``recipe(t)`` for a stateless recipe (None: not quantized); ``source``, the dtype
    the operand had before it was widened to float32, reaches the block quantizer (TE's
    ``value_for_inf`` is the input type's max). A Delayed recipe needs a layer's state."""
    if recipe is None or t.numel() == 0:
        return None
    if isinstance(recipe, Delayed):
        raise ValueError(
            "a Delayed operand keeps state per layer and tensor: use it through emulate() "
            "(EmulationRecipe.te_delayed()), not in a stateless GEMM (attention matmuls, "
            "a bare emulated GEMM)"
        )
    if isinstance(recipe, Block):
        return recipe(t, source=source)
    return recipe(t)


def uses_delayed(recipe: EmulationRecipe) -> bool:
    """Whether any operand of ``recipe`` is delayed-scaled."""
    return any(isinstance(r, Delayed) for r in recipe.operands().values())


class ScalingState:
    """The scaling state of one emulated model (``Coverage.scaling``): a
    :class:`~floatguard.emulation.DelayedScaler` per layer and role for the recipe's
    :class:`~floatguard.emulation.Delayed` operands, and the amax reduction group.

    ``scales()`` / ``histories()``: the current scales and amax histories by layer and
    role; ``state_dict()`` / ``load_state_dict()`` save and restore them with a
    checkpoint (TE keeps them in each module's extra state). ``group``: the process
    group tensor-wise amaxes are MAX-reduced over (None: none; with ``reduce_amax`` on
    the recipe and no group, the default group, as TE's autocast).
    """

    def __init__(self, recipe: EmulationRecipe, group: Any = None) -> None:
        self.recipe = recipe
        self.group = group
        self.layers: dict[str, LayerCasts] = {}
        self.updates = {"forward": 0, "backward": 0}
        self._queued = False

    def layer(self, name: str, device: torch.device) -> LayerCasts:
        """The casts of layer ``name`` (created on first request, state on ``device``)."""
        if name not in self.layers:
            self.layers[name] = LayerCasts(self, name, device)
        return self.layers[name]

    def reducing(self) -> bool:
        """Whether amaxes are all-reduced now (a group, or the recipe's ``reduce_amax``,
        with torch.distributed initialized and more than one rank in the group)."""
        if self.group is None and not self.recipe.reduce_amax:
            return False
        if not (dist.is_available() and dist.is_initialized()):
            return False
        return bool(dist.get_world_size(self.group) > 1)

    def reduce(self, amax: torch.Tensor) -> torch.Tensor:
        """``amax`` MAX-reduced over the group (itself when not reducing)."""
        if not self.reducing():
            return amax
        out = amax.detach().to(torch.float32).clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return out.to(amax.dtype)

    def _scalers(self, roles: tuple[Role, ...]) -> Iterator[DelayedScaler]:
        for casts in self.layers.values():
            for role in roles:
                s = casts.scalers.get(role)
                if s is not None:
                    yield s

    def update(self, which: Literal["forward", "backward"]) -> None:
        """Reduce and update the delayed scalers of the forward roles (input, weight) or
        of the backward role (grad), every layer at once."""
        scalers = list(self._scalers(FORWARD_ROLES if which == "forward" else ("grad",)))
        if not scalers:
            return
        pending = [s.pending if s.pending is not None else torch.zeros(()) for s in scalers]
        if self.reducing():
            flat = self.reduce(torch.stack([p.reshape(()).to(torch.float32) for p in pending]))
            for s, a in zip(scalers, flat.unbind(0), strict=True):
                s.update(a)
        else:
            for s in scalers:
                s.update()
        self.updates[which] += 1

    def after_forward(self, module: Any, args: Any, output: Any) -> None:
        """Root forward hook: the forward roles update, with grad enabled only."""
        if torch.is_grad_enabled():
            self.update("forward")

    def grad_cast(self) -> None:
        """A backward cast happened: update the grad role once this backward ends."""
        if self._queued:
            return
        self._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        self._queued = False
        self.update("backward")

    def scales(self) -> dict[str, dict[str, torch.Tensor]]:
        """The scale each delayed-scaled tensor will use next, by layer and role."""
        return {
            n: {r: s.scale.clone() for r, s in c.scalers.items() if s.scale is not None}
            for n, c in self.layers.items()
        }

    def histories(self) -> dict[str, dict[str, torch.Tensor]]:
        """The amax histories (most recent first), by layer and role."""
        return {
            n: {r: s.history.clone() for r, s in c.scalers.items() if s.history is not None}
            for n, c in self.layers.items()
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            n: {r: s.state_dict() for r, s in c.scalers.items()} for n, c in self.layers.items()
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a layer or role missing on either side is named."""
        mine = {(n, r) for n, c in self.layers.items() for r in c.scalers}
        theirs = {(n, r) for n, roles in sd.items() for r in roles}
        if mine != theirs:
            diff = sorted(mine ^ theirs)[:4]
            raise ValueError(
                f"ScalingState.load_state_dict: layers/roles differ from this model's: {diff}"
            )
        for n, roles in sd.items():
            for r, st in roles.items():
                scaler = self.layers[n].scalers[r]
                hist = st.get("history")
                if hist is not None and tuple(hist.shape) != (scaler.recipe.history_len,):
                    raise ValueError(
                        f"ScalingState.load_state_dict: {n} {r}: an amax history of "
                        f"{tuple(hist.shape)} into a recipe with history_len="
                        f"{scaler.recipe.history_len}; build the recipe with the checkpoint's"
                    )
        for n, roles in sd.items():
            for r, st in roles.items():
                self.layers[n].scalers[r].load_state_dict(st)


class LayerCasts:
    """One layer's casts under a recipe with state: a delayed scaler per delayed-scaled
    role, created eagerly on the layer's device (every rank registers the same scalers,
    in the same order, before the first reduction), and the amax reduction of
    tensor-wise current scaling."""

    def __init__(self, state: ScalingState, name: str, device: torch.device) -> None:
        self.state = state
        self.name = name
        self.scalers: dict[Role, DelayedScaler] = {}
        for op, r in state.recipe.operands().items():
            role = ROLE[op]
            if isinstance(r, Delayed) and role not in self.scalers:
                self.scalers[role] = r.scaler()
                self.scalers[role].init(device)

    def cast(
        self,
        op: Operand,
        recipe: TensorRecipe | Delayed | None,
        t: torch.Tensor,
        source: torch.dtype | None = None,
    ) -> QuantResult | None:
        """``t`` cast for operand ``op`` (None: not quantized)."""
        if recipe is None or t.numel() == 0:
            return None
        if isinstance(recipe, Delayed):
            role = ROLE[op]
            if role == "grad":
                self.state.grad_cast()
                return self.scalers[role].cast(t)
            # a forward cast while a backward runs: activation checkpointing's recompute
            recompute = torch._C._current_graph_task_id() >= 0
            return self.scalers[role].cast(t, recompute=recompute)
        if isinstance(recipe, Tensorwise) and self.state.reducing():
            amax, skipped = recipe.amax(t)
            return recipe.with_amax(t, self.state.reduce(amax), skipped)
        return plain_cast(recipe, t, source)
