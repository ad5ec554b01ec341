"""EmulationRecipe: how each of the six GEMM operands of a linear layer is quantized.

Words. A linear layer runs three GEMMs, each ``A @ B^T`` with both operands laid out
so that the GEMM's reduction dim is their last dim (the layout every low-precision
kernel quantizes in: block scales run along the reduction):

- fprop ``Y = X W^T``: ``X [M, K]`` and ``W [N, K]``, reduces K (in features);
- dgrad ``dX = dY W``: ``dY [M, N]`` and ``W^T [K, N]``, reduces N (out features);
- wgrad ``dW = dY^T X``: ``dY^T [N, M]`` and ``X^T [K, M]``, reduces M (the tokens:
  batch x sequence for a ``[B, T, K]`` input).

So "1x128 blocks" means 128 elements along K for fprop's X, along N for dgrad's dY and
W (a column-wise copy of W), along M for wgrad's dY and X (the 128x1 tiles of
DeepSeek-V3, the column-wise copies of Transformer Engine). An :class:`EmulationRecipe`
names a :class:`~floatguard.emulation.recipes.TensorRecipe` for each of the six operand
quantizations (``operands()``); each is applied to its operand in that layout.

Reading order: :class:`EmulationRecipe` (fields), ``operands()``, the presets. The
GEMMs themselves are in :mod:`floatguard.emulation._gemm`; the table of what every
preset does, with references, is in ``docs/fp8.md`` ("Emulated training").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

from torch import nn

from floatguard.emulation._delayed import AmaxAlgo, Delayed
from floatguard.emulation.recipes import (
    MX,
    NVFP4,
    Block,
    BlockScale,
    MXScaleMode,
    Rowwise,
    TensorRecipe,
    Tensorwise,
)

__all__ = ["EmulationRecipe", "Operand", "OperandSource"]

Operand = Literal[
    "fprop_input", "fprop_weight", "dgrad_grad", "dgrad_weight", "wgrad_grad", "wgrad_input"
]
"""The six operand quantizations, named ``<gemm>_<tensor>``."""
OperandSource = Literal["high_precision", "fprop"]
"""What a backward copy of X or W is quantized from: the high-precision tensor
(Transformer Engine, torchao, DeepGEMM) or the forward's quantized tensor (DeepSeek-V3's
cached FP8 activations; with no backward recipe: the straight-through estimator)."""
Auto = Literal["auto"]
SkipRule = tuple[str, ...] | Callable[[str, nn.Module], bool]
OperandRecipe = TensorRecipe | Delayed
Resolved = OperandRecipe | None


def _check_recipe(name: str, value: object, auto_ok: bool) -> None:
    if value is None or callable(value) or isinstance(value, Delayed):
        return
    if auto_ok and value == "auto":
        return
    allowed = "a TensorRecipe, None (not quantized), a Delayed" + (" or 'auto'" if auto_ok else "")
    raise TypeError(f"EmulationRecipe.{name}={value!r} must be {allowed}")


@dataclass(frozen=True)
class EmulationRecipe:
    """What each GEMM operand of an emulated layer becomes (see the module docstring for
    the three GEMMs and their layouts). The first three fields keep their 0.1 meaning:
    ``EmulationRecipe(activation, weight, grad)`` quantizes X with ``activation``, W
    with ``weight`` and dY with ``grad`` in every GEMM, each along that GEMM's reduction
    dim and from the high-precision tensor (what Transformer Engine, torchao and
    DeepGEMM do). For Tensorwise scales, which do not depend on layout, that is exactly
    what 0.1 computed; for block scales 0.1 reused the forward's K-blocks in backward.
    """

    activation: OperandRecipe | None
    """fprop's X, along K (the layer input)."""
    weight: OperandRecipe | None
    """fprop's W, along K."""
    grad: OperandRecipe | None = None
    """dY (the output gradient); the default of ``dgrad_grad`` and ``wgrad_grad``.
    None: not quantized (straight-through)."""
    accumulate_bits: int | None = None
    """Accumulator emulation, in all three GEMMs: partial sums over ``accumulate_every``
    elements of the reduction rounded (to nearest even) to this many mantissa bits,
    then added in float32 (DeepSeek-V3's promotion to CUDA cores every 128 elements).
    None: float32 accumulation."""
    accumulate_every: int = 128
    """The promotion interval, in elements of the reduction dim."""
    dgrad_grad: OperandRecipe | Auto | None = "auto"
    """dgrad's dY, along N. ``"auto"``: ``grad``."""
    dgrad_weight: OperandRecipe | Auto | None = "auto"
    """dgrad's W (as ``W^T [K, N]``), along N. ``"auto"``: ``weight``."""
    wgrad_grad: OperandRecipe | Auto | None = "auto"
    """wgrad's dY (as ``dY^T [N, M]``), along the tokens M. ``"auto"``: ``grad``."""
    wgrad_input: OperandRecipe | Auto | None = "auto"
    """wgrad's X (as ``X^T [K, M]``), along the tokens M. ``"auto"``: ``activation``."""
    dgrad_weight_from: OperandSource = "high_precision"
    """What ``dgrad_weight`` quantizes: W, or fprop's quantized W."""
    wgrad_input_from: OperandSource = "high_precision"
    """What ``wgrad_input`` quantizes: X, or fprop's quantized X (DeepSeek-V3:
    "dequantized, transposed, re-quantized into 128x1 tiles")."""
    wgrad_rht: int | None = None
    """Random Hadamard transform of both wgrad operands along M before they are
    quantized, in blocks of this size (16: NVIDIA's NVFP4 recipe); None: off. M is
    zero-padded to a multiple of the size (TE requires one)."""
    rht_seed: int | None = None
    """The RHT's sign vector: None is Transformer Engine's fixed one (size 16 only),
    an int draws one from a seeded generator (:func:`~floatguard.emulation.hadamard.rht_signs`)."""
    skip: SkipRule | None = None
    """The layers this recipe keeps in high precision, used by ``emulate()`` when it is
    given no ``skip`` (name substrings or a predicate ``(name, module) -> bool``)."""
    reduce_amax: bool = False
    """Transformer Engine's ``reduce_amax``: tensor-wise amaxes (a
    :class:`~floatguard.emulation.Delayed` operand's at its update, a ``Tensorwise``
    operand's at each cast) are MAX-reduced over ``emulate(amax_group=)``, or the default
    process group when none is given, whenever torch.distributed is initialized with more
    than one rank. ``emulate(amax_group=g)`` reduces over ``g`` whatever this says."""

    def __post_init__(self) -> None:
        _check_recipe("activation", self.activation, False)
        _check_recipe("weight", self.weight, False)
        _check_recipe("grad", self.grad, False)
        for name in ("dgrad_grad", "dgrad_weight", "wgrad_grad", "wgrad_input"):
            _check_recipe(name, getattr(self, name), True)
        if self.accumulate_bits is not None and not 1 <= self.accumulate_bits <= 23:
            raise ValueError(f"accumulate_bits={self.accumulate_bits!r} must be in 1..23")
        if not isinstance(self.accumulate_every, int) or self.accumulate_every < 1:
            raise ValueError(f"accumulate_every={self.accumulate_every!r} must be a positive int")
        for name in ("dgrad_weight_from", "wgrad_input_from"):
            if getattr(self, name) not in get_args(OperandSource):
                raise ValueError(
                    f"EmulationRecipe.{name}={getattr(self, name)!r}; use one of "
                    f"{', '.join(map(repr, get_args(OperandSource)))}"
                )
        n = self.wgrad_rht
        bad_size = isinstance(n, bool) or not isinstance(n, int) or n < 2 or n & (n - 1)
        if n is not None and bad_size:
            raise ValueError(
                f"EmulationRecipe.wgrad_rht={n!r} must be None or a power of two (NVFP4: 16)"
            )
        if self.rht_seed is not None and not isinstance(self.rht_seed, int):
            raise ValueError(f"EmulationRecipe.rht_seed={self.rht_seed!r} must be None or an int")
        if n is not None and n != 16 and self.rht_seed is None:
            raise ValueError(
                f"EmulationRecipe.wgrad_rht={n}: Transformer Engine's sign vector has 16 "
                "entries; pass rht_seed= (an int) for another size"
            )
        if not isinstance(self.reduce_amax, bool):
            raise ValueError(f"EmulationRecipe.reduce_amax={self.reduce_amax!r} must be a bool")
        self._check_delayed()
        skip = self.skip
        if not (skip is None or callable(skip) or (
            isinstance(skip, tuple) and all(isinstance(s, str) for s in skip)
        )):  # fmt: skip
            raise TypeError(
                f"EmulationRecipe.skip={skip!r} must be None, a tuple of name substrings "
                "or a predicate (name, module) -> bool"
            )

    def _check_delayed(self) -> None:
        """A delayed-scaled tensor is cast once per step and its FP8 copy serves both
        GEMMs it enters (Transformer Engine): the backward uses of X, W and dY must name
        the same :class:`Delayed` as their first use."""
        ops = self.operands()
        for first, later in (("fprop_input", "wgrad_input"), ("fprop_weight", "dgrad_weight"),
                             ("dgrad_grad", "wgrad_grad")):  # fmt: skip
            a, b = ops[first], ops[later]  # type: ignore[index]
            if isinstance(b, Delayed) and b != a and not (first == "dgrad_grad" and a is None):
                raise ValueError(
                    f"EmulationRecipe.{later}={b!r}: a delayed-scaled tensor is cast once per "
                    f"step and reused (Transformer Engine); give {later} the same Delayed as "
                    f"{first} (or 'auto'), or a current-scaling recipe"
                )
        if self.wgrad_rht is not None and any(isinstance(r, Delayed) for r in ops.values()):
            raise ValueError(
                "EmulationRecipe: wgrad_rht with a Delayed operand; the Hadamard transform "
                "belongs to NVFP4's current scaling, not to delayed scaling"
            )

    def operands(self) -> dict[Operand, Resolved]:
        """The six operand recipes with ``"auto"`` resolved (None: not quantized)."""

        def pick(value: OperandRecipe | Auto | None, default: Resolved) -> Resolved:
            return default if isinstance(value, str) else value

        return {
            "fprop_input": self.activation,
            "fprop_weight": self.weight,
            "dgrad_grad": pick(self.dgrad_grad, self.grad),
            "dgrad_weight": pick(self.dgrad_weight, self.weight),
            "wgrad_grad": pick(self.wgrad_grad, self.grad),
            "wgrad_input": pick(self.wgrad_input, self.activation),
        }

    # Presets: every one sets all six operands to its reference's published choice
    # (docs/fp8.md has the table with the references).

    @classmethod
    def hybrid_tensorwise(cls) -> EmulationRecipe:
        """Transformer Engine's ``Float8CurrentScaling`` (HYBRID, its default): current
        tensor-wise scales, e4m3 X and W, e5m2 dY in both backward GEMMs. Axes do not
        matter for one scale per tensor (TE's column-wise copy is the transposed FP8
        data)."""
        return cls(Tensorwise("e4m3fn"), Tensorwise("e4m3fn"), Tensorwise("e5m2"))

    @classmethod
    def te_delayed(
        cls,
        margin: float = 0,
        fp8_format: Literal["HYBRID", "E4M3"] = "HYBRID",
        amax_history_len: int = 1024,
        amax_compute_algo: AmaxAlgo = "max",
        reduce_amax: bool = True,
    ) -> EmulationRecipe:
        """Transformer Engine's ``DelayedScaling`` (its defaults: ``margin=0``,
        ``Format.HYBRID``, ``amax_history_len=1024``, ``amax_compute_algo="max"``,
        ``reduce_amax=True``): one tensor-wise scale per layer and per tensor (X, W, dY),
        each from that tensor's own amax history (``fl(fp8_max * 2**-margin) / amax_h``),
        e4m3 X and W, e5m2 dY (``"E4M3"``: e4m3 too). Each tensor is cast once per step
        and its FP8 copy used in both GEMMs it enters; the forward scales update when the
        model's forward returns (with grad enabled), the gradient's when the backward
        ends, after a MAX all-reduce of every layer's amaxes over the amax group
        (``emulate(amax_group=)``, else the default group when distributed). Amaxes skip
        NaN elements as TE's cast kernels do. The state: ``emulate(...).scaling``
        (:mod:`floatguard.emulation._scale_state`)."""
        if fp8_format not in ("HYBRID", "E4M3"):
            raise ValueError(f"te_delayed: fp8_format={fp8_format!r}; use 'HYBRID' or 'E4M3'")

        def d(fmt: str) -> Delayed:
            return Delayed(fmt, history_len=amax_history_len, algo=amax_compute_algo,
                           margin=margin, nan_policy="skip_elements")  # fmt: skip

        fwd = "e4m3fn"
        return cls(
            d(fwd), d(fwd), d("e5m2" if fp8_format == "HYBRID" else "e4m3fn"),
            reduce_amax=reduce_amax,
        )  # fmt: skip

    @classmethod
    def hybrid_rowwise(cls) -> EmulationRecipe:
        """torchao's rowwise axes (one scale per row of each operand in its GEMM's layout:
        per token along K in fprop, per token along N and per input channel along N in
        dgrad, per output and per input channel along the tokens in wgrad) with the
        HYBRID formats (e4m3 X and W, e5m2 dY) and exact float32 scales. torchao's own
        recipe is :meth:`torchao_rowwise`."""
        return cls(Rowwise("e4m3fn"), Rowwise("e4m3fn"), Rowwise("e5m2"))

    @classmethod
    def torchao_rowwise(cls) -> EmulationRecipe:
        """torchao's ``Float8LinearConfig.from_recipe_name("rowwise")``
        (``torchao/float8/float8_linear.py``, ``matmul_with_hp_or_float8_args``): e4m3 for
        X, W and dY, axis-wise scales along each GEMM's reduction dim, each quantized
        from the high-precision tensor, scales rounded down to powers of two
        (``round_scales_to_power_of_2``), amax floored at 1e-12 (torchao's EPS)."""
        r = Rowwise("e4m3fn", power_of_two=True, eps=1e-12)
        return cls(r, r, r)

    @classmethod
    def torchao_rowwise_with_gw_hp(cls) -> EmulationRecipe:
        """torchao's ``Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp")``
        (``torchao/float8/config.py``): fprop as :meth:`torchao_rowwise` (e4m3 X and W,
        axis-wise along K); dgrad's dY e4m3 axis-wise along N and its W e4m3 with one
        tensor-wise scale; the weight-gradient GEMM in high precision (both operands
        unquantized). Scales rounded down to powers of two for every cast
        (``round_scales_to_power_of_2=True``), amax floored at 1e-12 (torchao's EPS)."""
        r = Rowwise("e4m3fn", power_of_two=True, eps=1e-12)
        return cls(
            r, r, r, dgrad_weight=Tensorwise("e4m3fn", power_of_two=True, eps=1e-12),
            wgrad_grad=None, wgrad_input=None,
        )  # fmt: skip

    @classmethod
    def te_block_scaling(cls, scale: BlockScale = "pow2") -> EmulationRecipe:
        """Transformer Engine's default ``Float8BlockScaling()`` (``fp8_format=Format.E4M3``:
        "both forward and backward pass run with E4M3 format by default", TE's blockwise
        scaling docs): the blocks of :meth:`hybrid_block` (1x128 for X and dY along each
        GEMM's reduction dim, 128x128 for W), e4m3 for the gradients too, scales rounded
        down to powers of two (TE's default; ``scale="fp32"`` is
        ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``)."""
        return cls(
            Block("e4m3fn", (1, 128), scale), Block("e4m3fn", (128, 128), scale),
            Block("e4m3fn", (1, 128), scale),
        )  # fmt: skip

    @classmethod
    def hybrid_block(cls, scale: BlockScale = "fp32") -> EmulationRecipe:
        """Transformer Engine's ``Float8BlockScaling(fp8_format=Format.HYBRID)``: 1x128
        tiles for X and dY along each GEMM's reduction dim (column-wise copies, 128
        along the tokens, for wgrad, from the high-precision tensor), 128x128 blocks for
        W (the same blocks in dgrad), e4m3 forward and e5m2 gradients. ``scale="fp32"``
        is TE with ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`` (and DeepSeek-V3's scales);
        ``"pow2"`` is TE's default (scales rounded down to powers of two)."""
        return cls(
            Block("e4m3fn", (1, 128), scale), Block("e4m3fn", (128, 128), scale),
            Block("e5m2", (1, 128), scale),
        )  # fmt: skip

    @classmethod
    def deepseek_v3(cls) -> EmulationRecipe:
        """DeepSeek-V3 as published (technical report, section 3.3 and appendix B.2): e4m3
        everywhere with fp32 scales; X and dY in 1x128 tiles along the reduction dim
        (128x1, along the tokens, for wgrad); W in 128x128 blocks; wgrad's X re-quantized
        from the forward's FP8 copy (section 3.5.2: "dequantized, transposed,
        re-quantized into 128x1 tiles"); partial sums of every GEMM (fprop, dgrad and
        wgrad all run on FP8 Tensor Cores) kept at ~14 bits and promoted to fp32 every
        128 elements."""
        act = Block("e4m3fn", (1, 128))
        return cls(
            act, Block("e4m3fn", (128, 128)), act, accumulate_bits=13, accumulate_every=128,
            wgrad_input_from="fprop",
        )  # fmt: skip

    @classmethod
    def mxfp8(
        cls, scale_mode: MXScaleMode = "rceil", grad_element: str = "e4m3fn"
    ) -> EmulationRecipe:
        """Transformer Engine's ``MXFP8BlockScaling`` (its default ``Format.E4M3``; NVIDIA's
        MXFP8 pre-training recipe, Mishra et al., 2025): e4m3 elements for X, W and dY,
        in 1x32 blocks along each GEMM's reduction dim, every column-wise copy quantized
        from the high-precision tensor. The E8M0 exponent rounds up (``"rceil"``: never
        saturates); ``scale_mode="floor"`` is OCP MX v1.0's rule, which can saturate the
        block maximum. ``grad_element="e5m2"`` is TE's ``Format.HYBRID``."""
        return cls(
            MX("e4m3fn", 32, scale_mode), MX("e4m3fn", 32, scale_mode),
            MX(grad_element, 32, scale_mode),
        )  # fmt: skip

    @classmethod
    def nvfp4(cls) -> EmulationRecipe:
        """NVFP4 X and W (1x16 blocks along K), gradients in high precision with the
        straight-through estimator of quantization-aware training: the backward GEMMs
        use the forward's quantized X and W as they are. Not a published training
        recipe (:meth:`nvfp4_training` is); the forward-only NVFP4 baseline."""
        return cls(
            NVFP4(), NVFP4(), None, dgrad_weight=None, wgrad_input=None,
            dgrad_weight_from="fprop", wgrad_input_from="fprop",
        )  # fmt: skip

    @classmethod
    def nvfp4_training(
        cls,
        *,
        rht: bool = True,
        stochastic: bool = True,
        two_d: bool = True,
        skip: SkipRule = ("head",),
    ) -> EmulationRecipe:
        """NVIDIA's NVFP4 training recipe (NVIDIA, "Pretraining Large Language Models with
        NVFP4", arXiv 2509.25149, section 4; Transformer Engine's ``NVFP4BlockScaling``):
        1x16 blocks for X and dY along each GEMM's reduction dim, 16x16 tiles for W (so
        W and W^T quantize alike), every copy from the high-precision tensor; a 16-point
        random Hadamard transform of both wgrad inputs along the tokens (TE's sign
        vector); stochastic rounding of dY in dgrad and wgrad (TE's gradient quantizer;
        X and W round to nearest); ``skip``: the layers kept in high precision when
        ``emulate()`` is given none (the paper keeps the output head, and about 15% of
        the linear layers, most at the end: name yours, e.g. ``("head", "blocks.11.")``).
        ``rht``, ``stochastic``, ``two_d``: ablations (TE's ``disable_rht``,
        ``disable_stochastic_rounding``, ``disable_2d_quantization``)."""
        g = NVFP4(rounding="stochastic" if stochastic else "nearest")
        return cls(
            NVFP4(), NVFP4(two_d=two_d), g, wgrad_rht=16 if rht else None, skip=skip,
        )  # fmt: skip

    @classmethod
    def deepgemm(cls, ue8m0: bool = False) -> EmulationRecipe:
        """DeepGEMM's casts (decode scales ``amax / 448``, amax floored at 1e-4,
        ``x * (1/sf)``, ``deep_gemm/utils/math.py``): ``per_token_cast_to_fp8`` 1x128
        tiles for X in fprop and dY in dgrad, ``per_block_cast_to_fp8`` 128x128 blocks
        for W, ``per_channel_cast_to_fp8`` 128x1 tiles (along the tokens) for both wgrad
        operands (its k-grouped wgrad GEMM's test data); ``ue8m0``: the scales are
        powers of two (rounded up), as on Blackwell."""
        act = Block.deepgemm_activation(ue8m0)
        return cls(act, Block.deepgemm_weight(ue8m0), act)
