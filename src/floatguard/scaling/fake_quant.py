"""Fake-quant training: GEMMs computed as an FP8/MX/NVFP4 GEMM would, on a CPU.

``emulate(model, EmulationRecipe.hybrid_block())`` swaps, in place, every
``nn.Linear`` (and transformers' ``Conv1D``) for an :class:`EmulatedLinear` and
every ``nn.Conv1d``/``nn.Conv2d`` for an :class:`EmulatedConv`, each sharing the
original's parameters (the optimizer keeps working). Each of the layer's three GEMMs
(forward, dgrad, wgrad) quantizes its two operands along its own reduction dim with
the recipe's choice for that operand (:class:`EmulationRecipe`, six operand recipes;
the GEMM itself is :mod:`floatguard.scaling._gemm`) and multiplies in float32. A
convolution is computed as the implicit
GEMM it is (im2col: the reduction runs over ``in_channels / groups * kernel``), so
block scales run along the same dim as a GEMM kernel's. With ``attention=True``
the two matmuls inside ``F.scaled_dot_product_attention`` (``q k^T`` and ``p v``)
are emulated too, as FP8 attention kernels compute them. ``restore(model)`` undoes
all of it.

Optional accumulation emulation, in all three GEMMs: round the partial sums to
``accumulate_bits`` mantissa bits every ``accumulate_every`` elements of the reduction
(DeepSeek-V3 promotes Tensor Core partial sums to fp32 every 128 elements because the
FP8 GEMM accumulator keeps about 14 bits).
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from floatguard.scaling._gemm import _accumulated_matmul, _emulated_gemm  # noqa: F401 (re-exported)
from floatguard.scaling.emulation_recipe import EmulationRecipe
from floatguard.scaling.recipes import TensorRecipe

__all__ = [
    "Coverage", "EmulatedConv", "EmulatedLinear", "EmulationRecipe", "FakeQuant", "emulate",
    "emulated_sdpa", "fake_quant", "restore",
]  # fmt: skip


class FakeQuant(torch.autograd.Function):
    """Forward: quantize with a recipe. Backward: straight-through, or quantize the
    incoming gradient with ``grad_recipe``."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, recipe: TensorRecipe | None, grad_recipe: TensorRecipe | None
    ) -> torch.Tensor:
        ctx.grad_recipe = grad_recipe
        return x if recipe is None else recipe(x).values

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        gr: TensorRecipe | None = ctx.grad_recipe
        return (g if gr is None else gr(g).values), None, None


def fake_quant(
    x: torch.Tensor, recipe: TensorRecipe | None, grad_recipe: TensorRecipe | None = None
) -> torch.Tensor:
    """Differentiable fake quantization (see :class:`FakeQuant`)."""
    out: torch.Tensor = FakeQuant.apply(x, recipe, grad_recipe)  # type: ignore[no-untyped-call]
    return out


class _Emulated(nn.Module):
    """Common part of the emulated modules: the original (outside the module tree) and
    its parameters, shared."""

    def __init__(self, original: nn.Module, recipe: EmulationRecipe) -> None:
        super().__init__()
        self.original = [original]  # a list keeps it out of the module tree
        weight = getattr(original, "weight", None)
        if not isinstance(weight, nn.Parameter):
            raise TypeError(f"cannot emulate {type(original).__name__}: no weight parameter")
        self.weight = weight
        self.bias = getattr(original, "bias", None)
        self.recipe = recipe

    def original_module(self) -> nn.Module:
        """The module this one replaced (what :func:`restore` puts back)."""
        return self.original[0]


class EmulatedLinear(_Emulated):
    """``nn.Linear`` (or transformers' ``Conv1D``) computed under an :class:`EmulationRecipe`;
    shares ``weight`` and ``bias`` with the module it replaces (``original``)."""

    def __init__(self, original: nn.Module, recipe: EmulationRecipe) -> None:
        super().__init__(original, recipe)
        if self.weight.dim() != 2:
            raise TypeError(f"cannot emulate {type(original).__name__}: no 2-D weight")
        # transformers' Conv1D (GPT-2) stores the weight as (in, out): y = x @ W + b
        self.transposed = not isinstance(original, nn.Linear)
        shape = self.weight.shape
        out_f, in_f = (shape[1], shape[0]) if self.transposed else shape
        self.in_features, self.out_features = int(in_f), int(out_f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Blocks of the weight run along the reduction dim, as for nn.Linear's (out, in).
        w = self.weight.float().t() if self.transposed else self.weight.float()
        y = _emulated_gemm(x.float(), w, self.recipe)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, recipe={self.recipe}"


def _pair(v: Any, n: int) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


class EmulatedConv(_Emulated):
    """``nn.Conv1d`` / ``nn.Conv2d`` computed as the implicit GEMM a low-precision conv
    kernel runs: the input unfolded (im2col) into ``[N, L, C/groups * k]`` rows, the weight
    as ``[out/groups, C/groups * k]``, both quantized along that reduction dim, multiplied
    per group in float32. Any padding mode, stride, dilation, groups, ``padding="same"``
    and unbatched inputs. Memory: the unfolded input is ``k`` times the input (this is an
    emulator, not a fast conv)."""

    def __init__(self, original: nn.Module, recipe: EmulationRecipe) -> None:
        super().__init__(original, recipe)
        if not isinstance(original, (nn.Conv1d, nn.Conv2d)):
            raise TypeError(
                f"EmulatedConv emulates nn.Conv1d/nn.Conv2d, not {type(original).__name__}"
            )
        self.conv: nn.Conv1d | nn.Conv2d = original
        self.spatial = 1 if isinstance(original, nn.Conv1d) else 2

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        """x with the conv's padding applied (the GEMM then runs with padding 0)."""
        c, n = self.conv, self.spatial
        k, d = _pair(c.kernel_size, n), _pair(c.dilation, n)
        if c.padding == "valid":
            return x
        if c.padding == "same":  # total d*(k-1), the extra one on the right (as torch does)
            total = [di * (ki - 1) for di, ki in zip(d, k, strict=True)]
            pads: list[int] = []
            for t in reversed(total):
                pads += [t // 2, t - t // 2]
        else:
            pads = []
            for p in reversed(_pair(c.padding, n)):
                pads += [int(p), int(p)]
        if not any(pads):
            return x
        mode = "constant" if c.padding_mode == "zeros" else c.padding_mode
        return F.pad(x, pads, mode=mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, n = self.conv, self.spatial
        unbatched = x.dim() == n + 1
        xb = x.unsqueeze(0) if unbatched else x
        xp = self._padded(xb.float())
        k, s, d = _pair(c.kernel_size, n), _pair(c.stride, n), _pair(c.dilation, n)
        if n == 1:  # a 1-D conv is a 2-D one over a height of 1
            xp, k, s, d = xp.unsqueeze(2), (1, *k), (1, *s), (1, *d)
        batch, _, h, w_in = xp.shape
        h_out = (h - d[0] * (k[0] - 1) - 1) // s[0] + 1
        w_out = (w_in - d[1] * (k[1] - 1) - 1) // s[1] + 1
        cols = F.unfold(xp, k, dilation=d, stride=s)  # [N, C*kh*kw, L], C-major like weight
        g = c.groups
        cols = cols.reshape(batch, g, -1, h_out * w_out).transpose(-1, -2)  # [N, g, L, K]
        wg = self.weight.float().reshape(g, c.out_channels // g, -1)  # [g, out/g, K]
        ys = [_emulated_gemm(cols[:, i], wg[i], self.recipe) for i in range(g)]
        y = torch.cat(ys, dim=-1).transpose(1, 2)  # [N, out, L]
        y = y.reshape(batch, c.out_channels, h_out, w_out)
        if n == 1:
            y = y.squeeze(2)
        if self.bias is not None:
            y = y + self.bias.float().reshape(-1, *([1] * n))
        if unbatched:
            y = y.squeeze(0)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.conv.extra_repr()}, recipe={self.recipe}"  # type: ignore[no-untyped-call]


def emulated_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    recipe: EmulationRecipe,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with its two matmuls emulated, as FP8 attention
    kernels compute them, forward and backward: ``S = q k^T`` (q and k along the head
    dim E) and ``O = P v`` (P and v along the keys), each the emulated GEMM of
    :mod:`floatguard.scaling._gemm`, so their four backward matmuls quantize their
    operands along their own reduction dims too (``dq = dS k``: dS and k along the keys;
    ``dk = dS^T q``: dS and q along the queries; ``dP = dO v^T``: along E; ``dv = P^T
    dO``: along the queries). Every non-gradient operand (q, k, P, v) uses the recipe's
    ``activation``, dS and dO its ``dgrad_grad`` / ``wgrad_grad``; no Hadamard
    transform, no accumulator emulation. The scale ``1/sqrt(E)``, the mask and the
    softmax run in float32; a row with every key masked gives 0 (torch's math
    backend's safe softmax). Batch dims broadcast as in SDPA; a 2-D (16x16 / 128x128)
    recipe would tile across heads (the batch is flattened), use 1-D ones here."""
    r = _attention_recipe(recipe)
    q, k, v = query.float(), key.float(), value.float()
    if enable_gqa and k.size(-3) != q.size(-3):
        rep = q.size(-3) // k.size(-3)
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])  # type: ignore[no-untyped-call]
    q, k, v = (t.expand(*batch, *t.shape[-2:]) for t in (q, k, v))
    n_q, n_k = q.size(-2), k.size(-2)
    sc = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    s = _emulated_gemm(q, k, r) * sc
    if is_causal:
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, -math.inf)
        else:
            s = s + attn_mask.float()
    dead = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.softmax(s, dim=-1).masked_fill(dead, 0.0)
    if dropout_p > 0.0:
        p = F.dropout(p, dropout_p, training=True)
    out = _emulated_gemm(p, v.transpose(-2, -1), r)  # P [.., n_q, n_k] @ (v^T) [.., E, n_k]^T
    return out.to(query.dtype)


def _attention_recipe(r: EmulationRecipe) -> EmulationRecipe:
    """The attention matmuls' operand recipes: ``activation`` for q, k, P and v in
    every GEMM, the layer recipe's gradient recipes for dS and dO."""
    ops = r.operands()
    return EmulationRecipe(
        r.activation, r.activation, r.grad, dgrad_grad=ops["dgrad_grad"],
        wgrad_grad=ops["wgrad_grad"],
    )  # fmt: skip


class _RootHooks:
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
    emulated projections are the ones that run. Not thread-safe: two threads running
    forwards at once would share the replacements."""

    def __init__(self, model: nn.Module, recipe: EmulationRecipe, *, attention: bool,
                 mha: bool) -> None:  # fmt: skip
        self.recipe = recipe
        self.attention = attention
        self.mha = mha
        self.depth = 0
        self.calls = 0
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


class _MHAHooks:
    """nn.MultiheadAttention's in- and out-projections emulated: it applies its own
    parameters with ``F.linear`` inside ``F.multi_head_attention_forward`` (its out_proj
    module is never called), so ``F.linear`` is the emulated GEMM during its forward."""

    def __init__(self, module: nn.Module, recipe: EmulationRecipe) -> None:
        self.recipe = recipe
        self.saved: Any = None
        self.handles = [
            module.register_forward_pre_hook(self._enter),
            module.register_forward_hook(self._exit, always_call=True),
        ]

    def _linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        y = _emulated_gemm(x.float(), weight.float(), self.recipe)
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


_ROOT: weakref.WeakKeyDictionary[nn.Module, _RootHooks] = weakref.WeakKeyDictionary()
_MHA: weakref.WeakKeyDictionary[nn.Module, _MHAHooks] = weakref.WeakKeyDictionary()


class Coverage(list[str]):
    """What :func:`emulate` swapped (the list of names), what it left in high precision
    (``left`` maps a module type to the names of its GEMM-like modules that were skipped
    or cannot be emulated), and whether the attention matmuls are emulated."""

    def __init__(
        self, swapped: list[str], left: dict[str, list[str]], attention: bool = False
    ) -> None:
        super().__init__(swapped)
        self.left = left
        self.attention = attention

    def summary(self) -> str:
        parts = [f"emulated {len(self)} layer(s)"]
        if self.attention:
            parts[0] += " and the scaled_dot_product_attention matmuls"
        parts += [f"left {len(v)} {k} in high precision" for k, v in sorted(self.left.items())]
        return "; ".join(parts)


def _is_conv1d(m: nn.Module) -> bool:
    """transformers' Conv1D (matched by name and shape: transformers is not imported)."""
    w = getattr(m, "weight", None)
    return type(m).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.dim() == 2


# GEMM-like modules emulate() cannot cover: reported as left in high precision.
_OTHER_GEMMS = (nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
                nn.Bilinear)  # fmt: skip
_EMULATABLE = (nn.Linear, nn.Conv1d, nn.Conv2d)


def _emulated_for(module: nn.Module, recipe: EmulationRecipe) -> _Emulated:
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        return EmulatedConv(module, recipe)
    return EmulatedLinear(module, recipe)


def emulate(
    model: nn.Module,
    recipe: EmulationRecipe,
    *,
    modules: tuple[type[nn.Module], ...] | None = None,
    skip: tuple[str, ...] | Callable[[str, nn.Module], bool] | None = None,
    attention: bool = False,
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
    nn.Conv3d, transposed convs, nn.Bilinear); it is also logged (logger "floatguard").
    Covering nothing raises ValueError saying why: the model would train in full
    precision while you believe it is emulated.
    """
    if not isinstance(recipe, EmulationRecipe):
        raise TypeError(f"recipe must be an EmulationRecipe, got {type(recipe).__name__}")
    for m in modules or ():
        if not (isinstance(m, type) and issubclass(m, (*_EMULATABLE, nn.MultiheadAttention))):
            raise ValueError(
                "only subclasses of nn.Linear, nn.Conv1d, nn.Conv2d or nn.MultiheadAttention "
                f"can be emulated, got {m!r}"
            )
    if model in _ROOT:
        raise ValueError("emulate() was already applied to this model; restore() first")
    skip = (recipe.skip or ()) if skip is None else skip  # the preset's high-precision layers
    swapped: list[str] = []
    left: dict[str, list[str]] = {}
    n_skipped = 0
    inside_mha: list[str] = []
    mha_hooked = False
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
                _MHA[module] = _MHAHooks(module, recipe)
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
        setattr(parent, child, _emulated_for(module, recipe))
        swapped.append(name)
    coverage = Coverage(swapped, left, attention)
    if not swapped and not attention:
        found = sorted(
            {type(m).__name__ for _, m in model.named_modules()} - {type(model).__name__}
        )
        why = (
            f"every candidate was skipped ({coverage.summary()})"
            if n_skipped
            else "the model has no nn.Linear, Conv1D, nn.Conv1d or nn.Conv2d (it has: "
            f"{', '.join(found[:8]) or 'no submodule'})"
        )
        raise ValueError(f"emulate covered no layer: {why}")
    if attention or mha_hooked:
        _ROOT[model] = _RootHooks(model, recipe, attention=attention, mha=mha_hooked)
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
    return names
