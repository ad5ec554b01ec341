"""The dispatch-level GEMM coverage audit against FLOPs computed by hand from the models'
shapes (2 M N K per product; a backward GEMM per operand that needs a gradient), and
emulate()'s own report: RNNs left, a bare layer refused, attention from what ran."""

from __future__ import annotations

import json
import logging
import typing

import pytest
import torch
from torch import nn

from floatguard.emulation import (
    EmulationRecipe,
    GemmCoverage,
    coverage,
    emulate,
    is_emulated,
    restore,
)
from floatguard.emulation.coverage import OUTSIDE, Phase

PHASES = typing.get_args(Phase)

BLOCK = EmulationRecipe.hybrid_block()


def mm(m: int, k: int, n: int) -> int:
    """FLOPs of an [m, k] @ [k, n] product."""
    return 2 * m * k * n


def flops(cov: GemmCoverage, module: str | None = None, phase: str | None = None,
          emulated: bool | None = None) -> int:  # fmt: skip
    """The audit's FLOPs, filtered."""
    return sum(
        r.flops for r in cov.records
        if (module is None or r.module == module) and (phase is None or r.phase == phase)
        and (emulated is None or r.emulated == emulated)
    )  # fmt: skip


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


# ---------------------------------------------------------------- MLP, exact FLOPs

PRESETS = {
    "tensorwise": EmulationRecipe.hybrid_tensorwise(),
    "block": BLOCK,
    "deepseek_v3": EmulationRecipe.deepseek_v3(),  # the accumulator's chunked products
    "mxfp8": EmulationRecipe.mxfp8(),
    "nvfp4_training": EmulationRecipe.nvfp4_training(skip=()),  # RHT'd wgrad
}


@pytest.mark.parametrize("recipe", list(PRESETS.values()), ids=list(PRESETS))
@pytest.mark.parametrize("input_grad", [False, True], ids=["x", "x_requires_grad"])
def test_an_mlp_fully_emulated_counts_every_gemm_once(
    recipe: EmulationRecipe, input_grad: bool
) -> None:
    x = torch.randn(5, 8, requires_grad=input_grad)
    cov = coverage(mlp(), x, recipe)
    fc1, fc2 = mm(5, 8, 16), mm(5, 16, 4)
    # wgrad reduces over the tokens, which the 16-point Hadamard transform pads to 16
    tokens = 16 if recipe.wgrad_rht else 5
    w1, w2 = mm(16, tokens, 8), mm(4, tokens, 16)
    # backward: dW for both layers, dX for the second; the first's dX only if x needs it
    want = {("0", "forward"): fc1, ("2", "forward"): fc2, ("2", "backward"): fc2 + w2,
            ("0", "backward"): w1 + (fc1 if input_grad else 0)}  # fmt: skip
    got = {(m, p): flops(cov, m, p) for m, p in want}
    assert got == want
    assert cov.total_flops == sum(want.values()) == cov.emulated_flops
    assert cov.share == 1.0 and cov.backward and cov.left() == {}
    assert cov.summary().startswith("GEMM FLOPs emulated: 100.0%")


def test_a_plain_model_is_counted_and_nothing_is_emulated() -> None:
    cov = coverage(mlp(), torch.randn(5, 8))
    assert cov.total_flops == 3 * mm(5, 16, 4) + 2 * mm(5, 8, 16) and cov.emulated_flops == 0
    assert cov.share == 0.0 and cov.recipe is None
    assert {r.op for r in cov.records if r.phase == "forward"} == {"aten.addmm"}


def test_the_skipped_head_is_what_is_left() -> None:
    cov = coverage(mlp(), torch.randn(5, 8), BLOCK, skip=("2",))
    fc1, fc2 = mm(5, 8, 16), mm(5, 16, 4)
    assert cov.left() == {"2": 3 * fc2}
    assert cov.emulated_flops == 2 * fc1 and cov.total_flops == 2 * fc1 + 3 * fc2
    assert cov.share == pytest.approx(2 * fc1 / (2 * fc1 + 3 * fc2), abs=0)
    assert "'2' " in cov.summary() and "aten.addmm" in cov.summary()


def test_forward_only() -> None:
    cov = coverage(mlp(), torch.randn(5, 8), BLOCK, backward=False)
    assert not cov.backward and set(cov.by_phase()) == {"forward"}
    assert cov.total_flops == mm(5, 8, 16) + mm(5, 16, 4) == cov.emulated_flops
    assert "forward only" in cov.summary()


class Parent(nn.Module):
    """Its own products before and after a child's: backward attribution must walk
    through the child's autograd nodes to the parent's first product."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 16))
        self.child = nn.Linear(16, 16)
        self.w2 = nn.Parameter(torch.randn(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(x @ self.w1) @ self.w2


def test_backward_gemms_are_attributed_to_the_module_that_made_them() -> None:
    w = torch.randn(4, 3)
    cov = coverage(Parent(), torch.randn(5, 8), loss_fn=lambda m, x: (m(x) @ w).sum())
    a, b, c, d = mm(5, 8, 16), mm(5, 16, 16), mm(5, 16, 4), mm(5, 4, 3)
    got = {(m, p): flops(cov, m, p) for m in ("", "child", OUTSIDE) for p in PHASES}
    # root: x @ w1 (dW only: x needs no grad) and h @ w2 (dX, dW); outside: the loss's
    # product and its dX (w needs no grad)
    assert got == {("", "forward"): a + c, ("", "backward"): a + 2 * c,
                   ("child", "forward"): b, ("child", "backward"): 2 * b,
                   (OUTSIDE, "forward"): d, (OUTSIDE, "backward"): d}  # fmt: skip


# ---------------------------------------------------------------- what emulate() cannot cover


class RNNHead(nn.Module):
    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


@pytest.mark.parametrize(("kind", "gates"), [("LSTM", 4), ("GRU", 3), ("RNN", 1)])
def test_rnn_gemms_are_listed_and_counted_as_not_emulated(kind: str, gates: int) -> None:
    model = RNNHead(getattr(nn, kind)(8, 16, batch_first=True))
    x = torch.randn(2, 5, 8)
    cov = coverage(model, x, BLOCK)
    tokens, gh = 2 * 5, gates * 16
    rnn_fwd = 2 * tokens * gh * (8 + 16)  # input and hidden GEMMs of every step
    assert flops(cov, "rnn", "forward") == rnn_fwd
    assert flops(cov, "rnn", emulated=True) == 0 and flops(cov, "rnn", "backward") > 0
    if kind == "LSTM" and any(r.op == "aten.mkldnn_rnn_layer" for r in cov.records):
        # mkldnn's backward computes every gradient: dgrad and wgrad, 2x the forward
        assert flops(cov, "rnn", "backward") == 2 * rnn_fwd
    head = mm(tokens, 16, 4)
    assert flops(cov, "head") == flops(cov, emulated=True) == 3 * head
    assert set(cov.left()) == {"rnn"} and cov.share < 0.2
    covered = emulate(model, BLOCK)
    assert list(covered) == ["head"] and covered.left == {kind: ["rnn"]}
    assert covered.summary() == (
        f"emulated 1 layer(s); left 1 {kind} in high precision; attention=False: the "
        "scaled_dot_product_attention matmuls (if the model calls it) stay in high precision"
    )


UNCOVERABLE = [
    nn.LSTMCell(4, 4), nn.GRUCell(4, 4), nn.RNNCell(4, 4), nn.Bilinear(4, 4, 4),
    nn.Conv3d(1, 1, 1), nn.ConvTranspose1d(1, 1, 1), nn.ConvTranspose2d(1, 1, 1),
    nn.ConvTranspose3d(1, 1, 1),
]  # fmt: skip


@pytest.mark.parametrize("layer", UNCOVERABLE, ids=lambda m: type(m).__name__)
def test_every_gemm_module_emulate_cannot_cover_is_listed(layer: nn.Module) -> None:
    model = nn.Sequential(nn.Embedding(10, 4), layer, nn.Linear(4, 4))
    cov = emulate(model, BLOCK)
    assert list(cov) == ["2"] and cov.left == {type(layer).__name__: ["1"]}  # no Embedding


def test_bilinear_and_transposed_conv_flops() -> None:
    bil = nn.Sequential(nn.Bilinear(4, 6, 3))
    cov = coverage(bil, torch.randn(5, 4), loss_fn=lambda m, x: m[0](x, torch.randn(5, 6)).sum())
    one = 2 * 5 * 3 * 4 * 6  # N x out x in1 x in2 multiply-adds
    assert flops(cov, "0", "forward") == one and flops(cov, "0", "backward") == one  # dW
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.ConvTranspose2d(8, 4, 3),
                        nn.Flatten(), nn.Linear(4 * 8 * 8, 10))  # fmt: skip
    cov = coverage(net, torch.randn(2, 3, 8, 8), BLOCK)
    conv = 2 * 2 * (6 * 6) * 8 * (3 * 3 * 3)  # N x output pixels x C_out x (C_in k k)
    conv_t = 2 * 2 * (6 * 6) * 8 * 4 * 9  # N x input pixels x C_in x C_out x k k
    lin = mm(2, 256, 10)
    assert flops(cov, "0") == flops(cov, "0", emulated=True) == 2 * conv  # fprop, wgrad
    assert flops(cov, "2") == flops(cov, "2", emulated=False) == 3 * conv_t
    assert flops(cov, "4", emulated=True) == 3 * lin
    assert cov.left() == {"2": 3 * conv_t}


def test_a_bare_layer_is_refused_with_the_fix() -> None:
    for layer in (nn.Linear(4, 4), nn.Conv2d(1, 1, 1), nn.MultiheadAttention(4, 1)):
        with pytest.raises(ValueError, match=r"itself an .*: wrap it, e\.g\. model = nn\.Seq"):
            emulate(layer, BLOCK)
    wrapped = nn.Sequential(nn.Linear(4, 4))
    assert list(emulate(wrapped, BLOCK)) == ["0"]
    with pytest.raises(ValueError, match=r"no nn\.Linear.*\(it has: LSTM\)"):
        emulate(nn.LSTM(4, 4), BLOCK)


# ---------------------------------------------------------------- attention from what ran


class Attn(nn.Module):
    def __init__(self, need_weights: bool) -> None:
        super().__init__()
        self.need_weights = need_weights
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x, need_weights=self.need_weights)[0])


@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_with_weights_calls_no_sdpa(
    need_weights: bool, caplog: pytest.LogCaptureFixture
) -> None:
    x = torch.randn(2, 5, 16)
    b, heads, n, e = 2, 2, 5, 16
    qk = 2 * (b * heads) * n * n * (e // heads)  # S = q k^T; P v is the same size
    cov = coverage(Attn(need_weights), x, BLOCK, attention=True)
    # attention: 2 products forward, 4 backward (dq, dk, dP, dv); each as large
    attn_flops = 6 * qk
    # projections, emulated either way: packed in-proj (dW only: x needs no grad), out-proj
    proj = 2 * mm(b * n, e, 3 * e) + 3 * mm(b * n, e, e)
    assert flops(cov, "attn", emulated=True) == proj + (0 if need_weights else attn_flops)
    assert flops(cov, "attn", emulated=False) == (attn_flops if need_weights else 0)
    if need_weights:  # MHA's own bmm's (no SDPA): in high precision
        assert {r.op for r in cov.records if not r.emulated} == {"aten.bmm"}
    model = Attn(need_weights)
    covered = emulate(model, BLOCK, attention=True)
    assert not covered.attention and "no SDPA call seen yet" in covered.summary()
    with caplog.at_level(logging.WARNING, logger="floatguard"):
        model(x)
    assert covered.attention == (not need_weights) and covered.forwards == 1
    if need_weights:
        assert "SDPA not called in 1 forward(s): attention matmuls ran in high precision" in (
            covered.summary()
        )
    restore(model)


def test_a_model_without_attention_never_claims_it() -> None:
    model = mlp()
    covered = emulate(model, BLOCK, attention=True)
    assert "attention requested, no SDPA call seen yet" in covered.summary()
    model(torch.randn(2, 8))
    assert not covered.attention and covered.sdpa_calls == 0
    assert "SDPA not called" in covered.summary() and "matmuls (" not in covered.summary()
    restore(model)


def test_nn_transformer_is_emulated_whole() -> None:
    """nn.Transformer (MHA with need_weights=False inside its layers: SDPA), by hand."""
    d, ff, s, t, b = 32, 64, 7, 5, 2
    model = nn.Transformer(d_model=d, nhead=4, num_encoder_layers=1, num_decoder_layers=1,
                           dim_feedforward=ff, dropout=0.0, batch_first=True)  # fmt: skip
    batch = (torch.randn(b, s, d), torch.randn(b, t, d))
    cov = coverage(model, batch, BLOCK, attention=True, loss_fn=lambda m, x: m(*x).sum())
    ns, nt = b * s, b * t
    enc_in, dec_in = mm(ns, d, 3 * d), mm(nt, d, 3 * d)  # packed self-attention in-proj
    forward = (
        enc_in + 4 * b * s * s * d + mm(ns, d, d) + 2 * mm(ns, d, ff)  # encoder layer
        + dec_in + 4 * b * t * t * d + mm(nt, d, d)  # decoder self-attention
        + mm(nt, d, d) + mm(ns, d, 2 * d) + 4 * b * t * s * d + mm(nt, d, d)  # cross
        + 2 * mm(nt, d, ff)
    )  # fmt: skip
    # backward: 2x everything, less the dX of the two in-projections fed by the batch
    assert cov.total_flops == 3 * forward - enc_in - dec_in
    assert cov.share == 1.0
    plain = coverage(model.eval(), batch, loss_fn=lambda m, x: m(*x).sum(), backward=False)
    assert plain.total_flops == forward and plain.emulated_flops == 0  # fast path off


# ---------------------------------------------------------------- Hugging Face, from configs


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hugging_face_eager_attention_is_left_sdpa_is_emulated(arch: str, impl: str) -> None:
    transformers = pytest.importorskip("transformers")
    d, layers, heads, vocab, b, t = 64, 2, 4, 128, 2, 16
    if arch == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=layers, n_embd=d, n_head=heads, vocab_size=vocab, n_positions=32,
            bos_token_id=0, eos_token_id=0, attn_implementation=impl,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(cfg)
        attn = "transformer.h.{}.attn"
        per_layer = mm(b * t, d, 3 * d) + mm(b * t, d, d) + 2 * mm(b * t, d, 4 * d)
    else:
        cfg = transformers.LlamaConfig(
            num_hidden_layers=layers, hidden_size=d, intermediate_size=128,
            num_attention_heads=heads, num_key_value_heads=2, vocab_size=vocab,
            max_position_embeddings=64, attn_implementation=impl,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg)
        attn = "model.layers.{}.self_attn"
        kv = d // heads * 2
        per_layer = 2 * mm(b * t, d, d) + 2 * mm(b * t, d, kv) + 3 * mm(b * t, d, 128)
    ids = torch.randint(0, vocab, (b, t))
    cov = coverage(model, {"input_ids": ids, "labels": ids}, BLOCK, skip=("lm_head",),
                   attention=True)  # fmt: skip
    attention = 3 * 4 * b * t * t * d  # q k^T and P v over all heads, x3 with the backward
    head = 3 * mm(b * t, d, vocab)
    assert cov.total_flops == layers * (3 * per_layer + attention) + head
    for i in range(layers):
        assert flops(cov, attn.format(i)) == attention
        assert flops(cov, attn.format(i), emulated=True) == (attention if impl == "sdpa" else 0)
    assert cov.left() == {"lm_head": head, **({} if impl == "sdpa" else
                          {attn.format(i): attention for i in range(layers)})}  # fmt: skip
    assert not is_emulated(model)  # the audit emulated a copy


# ---------------------------------------------------------------- the audit changes nothing


class Stateful(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(self.bn(self.fc(x))))


@pytest.mark.parametrize("how", ["copy", "inplace", "as_is_emulated", "as_is_plain"])
def test_the_audit_leaves_parameters_grads_buffers_and_rng_as_they_were(how: str) -> None:
    model = Stateful().train()
    x = torch.randn(6, 8, requires_grad=True)
    model(x).sum().backward()  # grads the user has
    if how == "as_is_emulated":
        emulate(model, BLOCK)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: (p.grad, p.grad.clone()) for n, p in model.named_parameters()}  # type: ignore[union-attr]
    x_grad = (x.grad, x.grad.clone())  # type: ignore[union-attr]
    types = [type(m) for m in model.modules()]
    rng = torch.get_rng_state()
    if how in ("copy", "inplace"):
        cov = coverage(model, x, BLOCK, inplace=how == "inplace")
        assert cov.share == 1.0  # fc and out, emulated for the run
    else:
        cov = coverage(model, x)
        assert cov.share == (1.0 if how == "as_is_emulated" else 0.0)
    assert cov.total_flops == 3 * mm(6, 8, 8) + 3 * mm(6, 8, 2) and cov.backward
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in model.state_dict().items():  # parameters and BatchNorm's running stats
        assert torch.equal(v, state[k]), k
    for n, p in model.named_parameters():
        assert p.grad is grads[n][0] and torch.equal(p.grad, grads[n][1]), n
    assert x.grad is x_grad[0] and torch.equal(x.grad, x_grad[1])
    assert [type(m) for m in model.modules()] == types
    assert is_emulated(model) == (how == "as_is_emulated")


def test_errors_name_the_fix() -> None:
    model = mlp()
    with pytest.raises(ValueError, match="go with recipe="):
        coverage(model, torch.randn(2, 8), skip=("2",))
    with pytest.raises(TypeError, match="EmulationRecipe"):
        coverage(model, torch.randn(2, 8), "block")  # type: ignore[arg-type]
    emulate(model, BLOCK)
    with pytest.raises(ValueError, match="emulated already; pass recipe=None"):
        coverage(model, torch.randn(2, 8), BLOCK)
    with pytest.raises(TypeError, match=r"criterion\(output, target\)"):
        coverage(model, torch.randn(2, 8), loss_fn=nn.MSELoss())  # type: ignore[arg-type]


def test_an_op_without_a_formula_is_reported_not_dropped() -> None:
    class TBC(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 4, 5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.conv_tbc(x, self.w, torch.zeros(5), 1)

    cov = coverage(nn.Sequential(TBC(), nn.Linear(5, 2)), torch.randn(6, 2, 4), BLOCK)
    assert dict(cov.unmeasured)["aten.conv_tbc"] >= 1
    assert "not counted (no FLOP formula): aten.conv_tbc" in cov.summary()


def test_to_dict_is_json_ready() -> None:
    cov = coverage(mlp(), torch.randn(5, 8), BLOCK, skip=("2",))
    d = json.loads(json.dumps(cov.to_dict()))
    assert d["total"] == cov.total_flops and d["emulated"] == cov.emulated_flops
    assert d["by_module"]["2"] == {"emulated": 0, "total": 3 * mm(5, 16, 4), "share": 0.0}
    assert d["recipe"] == repr(BLOCK) and len(d["records"]) == len(cov.records)
    empty = coverage(nn.Sequential(nn.ReLU()), torch.randn(2, 3, requires_grad=True))
    assert empty.to_dict()["share"] is None and "no GEMM FLOPs counted" in empty.summary()


# ---------------------------------------------------------------- floatguard.audit's figure


def test_the_precision_audit_reports_the_measured_coverage() -> None:
    from floatguard import audit

    def batches() -> typing.Iterator[torch.Tensor]:  # an iterator: read once
        g = torch.Generator().manual_seed(0)
        yield from (torch.randn(5, 8, generator=g) for _ in range(2))

    torch.manual_seed(0)
    model = RNNHead(nn.LSTM(8, 16, batch_first=True))
    x = torch.randn(2, 5, 8)
    calls: list[int] = []

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return m(b).float().mean()

    plain = audit(model, [x, x], loss_fn=loss_fn)
    calls.clear()
    report = audit(model, [x, x], loss_fn=loss_fn, emulation=BLOCK)
    assert len(calls) == 3 and plain.coverage is None  # the coverage run: once more
    assert report.to_dict()["layers"] == plain.to_dict()["layers"]  # the audit unchanged
    cov = report.coverage
    assert cov is not None and not is_emulated(model)
    head, rnn_fwd = mm(10, 16, 4), 2 * 10 * 64 * (8 + 16)
    assert cov.emulated_flops == 3 * head and flops(cov, "rnn", "forward") == rnn_fwd
    d = json.loads(json.dumps(report.to_dict()))
    assert d["gemm_coverage"]["emulated"] == 3 * head
    assert "emulate() coverage: GEMM FLOPs emulated: " in str(report)
    # a generator of batches: the first is audited too; a bare layer: nothing emulated
    bare = audit(nn.Linear(8, 4), batches(), emulation=BLOCK)
    assert bare.coverage is not None and bare.coverage.share == 0.0
    assert bare.coverage.total_flops == 2 * mm(5, 8, 4)  # forward and dW
    assert bare.layers[0].results["activation"]["numel"] == 2 * 5 * 8
