"""emulate() and restore(): swapping a model's GEMM modules for emulated ones, and
installing the hooks around its forward (:mod:`floatguard.emulation._model_hooks`:
the SDPA replacement, nn.MultiheadAttention's ``F.linear``; the grouped GEMMs of
:mod:`floatguard.emulation._grouped`; the scaling state's updates).

Moved out of :mod:`floatguard.emulation.fake_quant` (which re-exports ``emulate``,
``restore`` and ``Coverage``); the emulated modules themselves live there.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from floatguard.emulation._delayed import Delayed
from floatguard.emulation._emulated_layers import (
    EmulatedConv,
    EmulatedLinear,
    _Emulated,
)
from floatguard.emulation._grouped import GroupedHooks, expert_parameters
from floatguard.emulation._model_hooks import MHAHooks, RootHooks
from floatguard.emulation._scale_state import ScalingState, uses_delayed
from floatguard.emulation.emulation_recipe import EmulationRecipe
from floatguard.emulation.recipes import Tensorwise
from floatguard.errors import FloatguardError

__all__ = ["Coverage", "NothingToEmulate", "emulate", "is_emulated", "restore"]


class NothingToEmulate(FloatguardError, ValueError):
    """:func:`emulate` would swap nothing (no covered layer, every one skipped, or the model
    is itself a layer, which cannot be swapped in place); the message says why."""


_ROOT: weakref.WeakKeyDictionary[nn.Module, RootHooks] = weakref.WeakKeyDictionary()
_MHA: weakref.WeakKeyDictionary[nn.Module, MHAHooks] = weakref.WeakKeyDictionary()
_STATE: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
_GROUPED: weakref.WeakKeyDictionary[nn.Module, GroupedHooks] = weakref.WeakKeyDictionary()


class Coverage(list[str]):
    """What :func:`emulate` swapped (the list of names), what it left in high precision
    (``left`` maps a module type to the names of its GEMM-like modules that were skipped
    or cannot be emulated: RNNs, nn.Conv3d, ...), and, from what ran since, whether the
    attention matmuls were emulated.

    ``attention`` is live: True once the model's forwards called an emulated
    ``F.scaled_dot_product_attention`` (``attention_requested``: what emulate() was asked
    for). It cannot tell an attention written with ``torch.matmul`` in one layer among
    SDPA calls in others: :func:`floatguard.emulation.coverage` counts the FLOPs that ran."""

    def __init__(
        self,
        swapped: list[str],
        left: dict[str, list[str]],
        attention: bool = False,
        hooks: RootHooks | None = None,
        scaling: ScalingState | None = None,
    ) -> None:
        super().__init__(swapped)
        self.left = left
        self.attention_requested = attention
        self._hooks = hooks
        self.scaling = scaling
        """The model's scaling state (delayed scaling per layer and role, the amax
        reduction group): :class:`~floatguard.emulation._scale_state.ScalingState`;
        None for stateless recipes without an amax group."""

    @property
    def sdpa_calls(self) -> int:
        """Emulated SDPA calls since emulate() (0 when attention was not requested)."""
        return self._hooks.calls if self._hooks is not None and self.attention_requested else 0

    @property
    def forwards(self) -> int:
        """The model's forwards since emulate() (counted when attention was requested or an
        nn.MultiheadAttention hooked; else 0)."""
        return self._hooks.forwards if self._hooks is not None else 0

    @property
    def attention(self) -> bool:
        """Whether an emulated SDPA call ran: requested, and seen in a forward."""
        return self.sdpa_calls > 0

    def summary(self) -> str:
        parts = [f"emulated {len(self)} layer(s)"]
        if self.attention:
            parts[0] += (
                f" and the scaled_dot_product_attention matmuls ({self.sdpa_calls} SDPA "
                f"call(s) in {self.forwards} forward(s))"
            )
        elif self.attention_requested and self.forwards == 0:
            parts.append("attention requested, no SDPA call seen yet")
        elif self.attention_requested:
            parts.append(
                f"SDPA not called in {self.forwards} forward(s): attention matmuls ran in "
                "high precision"
            )
        parts += [f"left {len(v)} {k} in high precision" for k, v in sorted(self.left.items())]
        if not self.attention_requested:
            parts.append(
                "attention=False: the scaled_dot_product_attention matmuls (if the model "
                "calls it) stay in high precision"
            )
        return "; ".join(parts)


def _is_conv1d(m: nn.Module) -> bool:
    """transformers' Conv1D (matched by name and shape: transformers is not imported)."""
    w = getattr(m, "weight", None)
    return type(m).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.dim() == 2


# GEMM-like modules emulate() cannot cover: reported as left in high precision. RNNs
# (nn.RNN/LSTM/GRU and their cells) run their gate GEMMs inside torch's RNN ops.
# nn.Embedding is a gather, not a GEMM.
_OTHER_GEMMS = (nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
                nn.Bilinear, nn.RNNBase, nn.RNNCellBase)  # fmt: skip
_EMULATABLE = (nn.Linear, nn.Conv1d, nn.Conv2d)


def is_emulated(model: nn.Module) -> bool:
    """Whether :func:`emulate` was applied to ``model`` or to one of its submodules (and
    not undone by :func:`restore`)."""

    return any(
        isinstance(m, _Emulated) or m in _MHA or m in _ROOT or m in _GROUPED
        for m in model.modules()
    )


def _emulated_for(
    module: nn.Module, recipe: EmulationRecipe, name: str, state: ScalingState | None
) -> _Emulated:
    w = getattr(module, "weight", None)
    device = w.device if isinstance(w, torch.Tensor) else torch.device("cpu")
    casts = state.layer(name, device) if state is not None else None
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        return EmulatedConv(module, recipe, casts)
    return EmulatedLinear(module, recipe, casts)


def check_skip(skip: object, who: str) -> None:
    """TypeError unless ``skip`` is None, a tuple or list of name substrings, or a
    predicate; a string alone is named (each of its characters would be a substring)."""
    if isinstance(skip, str):
        raise TypeError(
            f"{who}: skip={skip!r} is a string; give a tuple of name substrings, skip=({skip!r},)"
        )
    if not (skip is None or callable(skip) or (
        isinstance(skip, (tuple, list)) and all(isinstance(s, str) for s in skip)
    )):  # fmt: skip
        raise TypeError(
            f"{who}: skip={skip!r} must be None, a tuple of name substrings or a predicate "
            "(name, module) -> bool"
        )


def emulate(
    model: nn.Module,
    recipe: EmulationRecipe,
    *,
    modules: tuple[type[nn.Module], ...] | None = None,
    skip: tuple[str, ...] | Callable[[str, nn.Module], bool] | None = None,
    attention: bool = False,
    amax_group: Any = None,
) -> Coverage:
    """Swap matching modules in place for emulated ones; returns what was covered.

    Covered: ``nn.Linear`` (and subclasses), transformers' ``Conv1D`` (GPT-2's linear
    layers, weight stored (in, out)), ``nn.Conv1d`` and ``nn.Conv2d`` (as implicit GEMMs,
    :class:`EmulatedConv`), nn.MultiheadAttention's in- and out-projections (its
    ``F.linear`` calls, through hooks; torch's fused fast paths are turned off while the
    model runs), or only the ``modules`` given (subclasses of those).
    ``skip`` is a tuple of name substrings (e.g. ``("head",)`` to keep the LM head in
    high precision, as DeepSeek-V3 does) or a predicate ``(name, module) -> bool``;
    None (the default): the recipe's own ``skip`` (``EmulationRecipe.skip``), else none.
    ``attention=True`` also emulates the two matmuls of every
    ``F.scaled_dot_product_attention`` the model calls (:func:`emulated_sdpa`; eager
    attention written with ``torch.matmul`` is not seen, and a forward that calls no SDPA
    logs a warning once). The result lists the swapped names and, in ``.left``, by module
    type, the GEMM-like modules left in high precision (skipped, or not emulated:
    nn.Conv3d, transposed convs, nn.Bilinear, nn.RNN/LSTM/GRU and their cells); its
    ``attention`` says whether an emulated SDPA call ran (:class:`Coverage`); it is also
    logged (logger "floatguard"). What ran, FLOP by FLOP:
    :func:`floatguard.emulation.coverage`.
    Covering nothing raises :class:`NothingToEmulate` (a ValueError) saying why: the model
    would train in full precision while you believe it is emulated. So does a model that
    is itself one of the covered layers (``emulate(nn.Linear(4, 4), ...)``): modules are
    swapped in their parent, and the object you hold cannot be replaced; wrap it in an
    ``nn.Sequential``.

    Mixture-of-experts layers: the model's 3-D parameters (expert weights) are emulated
    expert by expert wherever the forward multiplies them with ``torch._grouped_mm`` /
    ``F.grouped_mm`` or with ``F.linear`` on one expert's slice (transformers' eager
    experts): each expert's GEMMs get the recipe's scales on that expert's tokens
    (:mod:`floatguard.emulation._grouped`); listed in the result as ``module.param``;
    not with ``modules=`` given, nor with a Delayed recipe (left in high precision).

    Scaling state. A recipe with :class:`~floatguard.emulation.Delayed` operands
    (:meth:`EmulationRecipe.te_delayed`) gets an amax history and scale per layer and per
    tensor (X, W, dY), updated as Transformer Engine does (the forward's when the model's
    forward returns with grad enabled, the gradient's when the backward ends); they are in
    ``Coverage.scaling``. ``amax_group`` (a process group): tensor-wise amaxes (Delayed
    at their update, ``Tensorwise`` at each cast) are MAX-reduced over it, so shards of a
    tensor-parallel layer get the whole tensor's scale (TE's ``amax_reduction_group``);
    the recipe's ``reduce_amax`` reduces over the default group when none is given.
    Without it a shard's scale comes from the shard's own amax.
    """

    if not isinstance(recipe, EmulationRecipe):
        raise TypeError(f"recipe must be an EmulationRecipe, got {type(recipe).__name__}")
    for m in modules or ():
        if not (isinstance(m, type) and issubclass(m, (*_EMULATABLE, nn.MultiheadAttention))):
            raise ValueError(
                "only subclasses of nn.Linear, nn.Conv1d, nn.Conv2d or nn.MultiheadAttention "
                f"can be emulated, got {m!r}"
            )
    if model in _ROOT or is_emulated(model):
        raise ValueError(
            "emulate() was already applied to this model (or to one of its submodules); "
            "restore() it first"
        )
    if isinstance(model, (*_EMULATABLE, nn.MultiheadAttention)) or _is_conv1d(model):
        raise NothingToEmulate(
            f"emulate: the model is itself an {type(model).__name__}; emulate() swaps "
            "submodules in their parent and cannot replace the object you hold: wrap it, "
            "e.g. model = nn.Sequential(model), then emulate(model, recipe)"
        )
    check_skip(skip, "emulate")
    if amax_group is not None and type(amax_group).__name__ != "ProcessGroup":
        raise TypeError(
            f"emulate: amax_group={amax_group!r} must be a torch.distributed ProcessGroup "
            "(e.g. mesh.get_group() or dist.new_group(...)) or None"
        )
    delayed = uses_delayed(recipe)
    if delayed and attention:
        raise ValueError(
            "emulate(attention=True) with a Delayed recipe: delayed scaling of the attention "
            "matmuls (TE's fp8_dpa) is not emulated; use attention=False or a current-scaling "
            "recipe"
        )
    state = (
        ScalingState(recipe, amax_group)
        if delayed or amax_group is not None or recipe.reduce_amax
        else None
    )
    skip = (recipe.skip or ()) if skip is None else skip  # the preset's high-precision layers
    swapped: list[str] = []
    left: dict[str, list[str]] = {}
    n_skipped = 0
    inside_mha: list[str] = []
    mha_hooked = False
    sharded = 0
    if isinstance(model, _OTHER_GEMMS):  # a bare nn.LSTM, nn.Conv3d, ...: "" is its path
        left.setdefault(type(model).__name__, []).append("")
    for name, module in list(model.named_modules()):
        if isinstance(module, _Emulated) or not name:
            continue
        if any(name.startswith(p + ".") for p in inside_mha):
            # MultiheadAttention applies its out_proj's parameters itself: the module is
            # covered (or left) with its parent, never swapped.
            if name not in swapped and not any(name.startswith(p + ".") for p in swapped):
                left.setdefault("MultiheadAttention", []).append(name)
            continue
        if isinstance(module, nn.MultiheadAttention):
            inside_mha.append(name)
            wanted = not modules or isinstance(module, modules)
            skipped = skip(name, module) if callable(skip) else any(s in name for s in skip)
            if wanted and not skipped and module not in _MHA:
                _MHA[module] = MHAHooks(module, recipe, name, state)
                mha_hooked = True
                swapped.append(name)
            else:
                left.setdefault("MultiheadAttention", []).append(name)
                n_skipped += bool(skipped)
            continue
        covered = isinstance(module, modules) if modules else (
            isinstance(module, _EMULATABLE) or _is_conv1d(module)
        )  # fmt: skip
        if not covered:
            if isinstance(module, _OTHER_GEMMS) or (modules and isinstance(module, _EMULATABLE)):
                left.setdefault(type(module).__name__, []).append(name)
            continue
        skipped = skip(name, module) if callable(skip) else any(s in name for s in skip)
        if skipped:
            left.setdefault(type(module).__name__, []).append(name)
            n_skipped += 1
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, _emulated_for(module, recipe, name, state))
        swapped.append(name)
        sharded += type(getattr(module, "weight", None)).__name__ == "DTensor"
    experts: dict[int, str] = {}
    if not modules:  # MoE experts: 3-D parameters multiplied by grouped GEMMs

        def skipped_expert(name: str, module: nn.Module) -> bool:
            return bool(skip(name, module) if callable(skip) else any(s in name for s in skip))

        experts, left_experts = expert_parameters(model, skipped_expert)
        if delayed and experts:  # per-expert delayed scaling state is not emulated
            left_experts += list(experts.values())
            experts = {}
        if left_experts:
            left.setdefault("grouped GEMM", []).extend(left_experts)
        swapped += list(experts.values())
    coverage = Coverage(swapped, left, attention, scaling=state)
    if not swapped and not attention:
        found = sorted({type(m).__name__ for n, m in model.named_modules()
                        if n or isinstance(m, _OTHER_GEMMS)})  # fmt: skip
        why = (
            f"every candidate was skipped ({coverage.summary()})"
            if n_skipped
            else "the model has no nn.Linear, Conv1D, nn.Conv1d or nn.Conv2d (it has: "
            f"{', '.join(found[:8]) or 'no submodule'})"
        )
        raise NothingToEmulate(f"emulate covered no layer: {why}")
    tensorwise = any(isinstance(r, (Tensorwise, Delayed)) for r in recipe.operands().values())
    if sharded and tensorwise and state is None:
        logging.getLogger("floatguard").warning(
            "emulate: %d tensor-parallel layer(s) (DTensor weights) with tensor-wise scales and "
            "no amax_group: each shard is scaled from its own amax, not the whole tensor's; "
            "pass emulate(..., amax_group=mesh.get_group()) for TE's amax reduction",
            sharded,
        )
    if attention or mha_hooked:
        _ROOT[model] = RootHooks(model, recipe, attention=attention, mha=mha_hooked)
        coverage = Coverage(swapped, left, attention, _ROOT[model], state)
    if state is not None and delayed:
        _STATE[model] = model.register_forward_hook(state.after_forward, always_call=True)
    if experts:
        _GROUPED[model] = GroupedHooks(model, recipe, experts)
    logging.getLogger("floatguard").info("emulate: %s", coverage.summary())
    return coverage


def restore(model: nn.Module) -> list[str]:
    """Undo :func:`emulate`: put every original module back and stop emulating the
    attention matmuls; returns the names of the modules put back."""

    names = []
    for name, module in list(model.named_modules()):
        if isinstance(module, _Emulated):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.original_module())
            names.append(name)
        elif module in _MHA:
            _MHA.pop(module).remove()
            names.append(name)
    hooks = _ROOT.pop(model, None)
    if hooks is not None:
        hooks.remove()
    handle = _STATE.pop(model, None)
    if handle is not None:
        handle.remove()
    grouped = _GROUPED.pop(model, None)
    if grouped is not None:
        grouped.remove()
        names += list(grouped.experts.values())
    return names
