"""cross_entropy and chunked_cross_entropy against torch and float64."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from floatguard.ops import chunked_cross_entropy, cross_entropy


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_torch(reduction: str, smoothing: float, weighted: bool) -> None:
    logits = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([0, 4, 2, -100, 1, 3])
    w = torch.rand(5, dtype=torch.float64) + 0.5 if weighted else None
    kw = {"weight": w, "label_smoothing": smoothing, "reduction": reduction}
    ours = cross_entropy(logits, target, **kw)  # type: ignore[arg-type]
    ref = F.cross_entropy(logits, target, **kw)  # type: ignore[arg-type]
    torch.testing.assert_close(ours, ref)
    g1 = torch.autograd.grad(ours.sum(), logits)[0]
    g2 = torch.autograd.grad(ref.sum(), logits)[0]
    torch.testing.assert_close(g1, g2)


def test_spatial_and_1d_and_probability_targets() -> None:
    logits = torch.randn(2, 4, 3, 3, dtype=torch.float64)
    target = torch.randint(0, 4, (2, 3, 3))
    torch.testing.assert_close(cross_entropy(logits, target), F.cross_entropy(logits, target))
    one = torch.randn(7, dtype=torch.float64)
    torch.testing.assert_close(
        cross_entropy(one, torch.tensor(3)), F.cross_entropy(one, torch.tensor(3))
    )
    probs = torch.softmax(torch.randn(4, 6, dtype=torch.float64), -1)
    lg = torch.randn(4, 6, dtype=torch.float64)
    for sm in (0.0, 0.2):
        torch.testing.assert_close(
            cross_entropy(lg, probs, label_smoothing=sm),
            F.cross_entropy(lg, probs, label_smoothing=sm),
        )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_stable_at_1e4(dtype: torch.dtype) -> None:
    logits = torch.tensor([[1e4, -1e4, 0.0], [-1e4, 1e4, 5e3], [3.0, 3.0, 3.0]]).to(dtype)
    target = torch.tensor([1, 0, 2])
    ours = cross_entropy(logits, target, reduction="none")
    ref = F.cross_entropy(logits.double(), target, reduction="none")
    assert ours.dtype == dtype and bool(torch.isfinite(ours).all())
    torch.testing.assert_close(ours.double(), ref, rtol=2**-7, atol=1e-3)
    x = logits.clone().requires_grad_(True)
    cross_entropy(x, target).backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())


def test_lesson_number() -> None:
    assert float(cross_entropy(torch.tensor([-1000.0, 1000.0]), torch.tensor(0))) == 2000.0
    assert (
        float(cross_entropy(torch.tensor([[-1000.0, 1000.0]]).half(), torch.tensor([0]))) == 2000.0
    )


def test_all_ignored_mean_is_zero_not_nan() -> None:
    logits = torch.randn(3, 4, requires_grad=True)
    target = torch.full((3,), -100)
    assert math.isnan(float(F.cross_entropy(logits.detach(), target)))
    loss = cross_entropy(logits, target)
    loss.backward()
    assert float(loss.detach()) == 0.0 and logits.grad is not None and not bool(logits.grad.any())


def test_bad_input() -> None:
    with pytest.raises(TypeError, match=r"logits must be float16.*got torch.int64"):
        cross_entropy(torch.ones(2, 3, dtype=torch.long), torch.tensor([0, 1]))
    with pytest.raises(IndexError, match=r"target\[1\] = 7 is out of range for 3 classes"):
        cross_entropy(torch.randn(2, 3), torch.tensor([0, 7]))
    with pytest.raises(IndexError, match=r"target\[0\] = -1"):
        cross_entropy(torch.randn(2, 3), torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match=r"target has shape \(3,\); for logits of shape \(2, 3\)"):
        cross_entropy(torch.randn(2, 3), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="reduction='avg'"):
        cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]), reduction="avg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"label_smoothing=1.5"):
        cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]), label_smoothing=1.5)
    with pytest.raises(ValueError, match=r"weight has shape \(2,\); expected \(3,\)"):
        cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]), weight=torch.ones(2))
    with pytest.raises(TypeError, match="class targets must be an integer tensor"):
        cross_entropy(torch.randn(2, 3), torch.tensor([True, False]))


class TestChunked:
    @pytest.mark.parametrize("chunk", [1, 7, 16, 64])
    @pytest.mark.parametrize("smoothing", [0.0, 0.1])
    @pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
    def test_values_and_grads_match_full_logits(
        self, chunk: int, smoothing: float, reduction: str
    ) -> None:
        h = torch.randn(9, 8, dtype=torch.float64, requires_grad=True)
        w = torch.randn(50, 8, dtype=torch.float64, requires_grad=True)
        t = torch.randint(0, 50, (9,))
        t[3] = -100
        ours = chunked_cross_entropy(
            h,
            w,
            t,
            chunk_size=chunk,
            label_smoothing=smoothing,
            reduction=reduction,  # type: ignore[arg-type]
        )
        ref = F.cross_entropy(h @ w.T, t, label_smoothing=smoothing, reduction=reduction)  # type: ignore[arg-type]
        torch.testing.assert_close(ours, ref)
        gw = torch.randn_like(ours)
        g1 = torch.autograd.grad((ours * gw).sum(), (h, w))
        g2 = torch.autograd.grad((ref * gw).sum(), (h, w))
        torch.testing.assert_close(g1, g2)

    def test_gradcheck(self) -> None:
        h = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
        w = torch.randn(10, 3, dtype=torch.float64, requires_grad=True)
        t = torch.tensor([1, 9, -100, 4])
        fn = lambda a, b: chunked_cross_entropy(a, b, t, chunk_size=3, label_smoothing=0.05)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (h, w))

    def test_half_and_batched_hidden(self) -> None:
        h = (torch.randn(2, 5, 16) * 4).to(torch.bfloat16)
        w = torch.randn(100, 16).to(torch.bfloat16)
        t = torch.randint(0, 100, (2, 5))
        ours = chunked_cross_entropy(h, w, t, chunk_size=32)
        ref = F.cross_entropy((h.double() @ w.double().T).reshape(10, 100), t.reshape(-1))
        assert ours.dtype == torch.bfloat16
        torch.testing.assert_close(ours.double(), ref, rtol=1e-2, atol=1e-2)

    def test_bad_input(self) -> None:
        h, w = torch.randn(3, 4), torch.randn(10, 4)
        with pytest.raises(ValueError, match="chunk_size=0 must be a positive int"):
            chunked_cross_entropy(h, w, torch.tensor([0, 1, 2]), chunk_size=0)
        with pytest.raises(ValueError, match="do not fit"):
            chunked_cross_entropy(h, torch.randn(10, 5), torch.tensor([0, 1, 2]))
        with pytest.raises(IndexError, match=r"target\[2\] = 10 is out of range for 10 classes"):
            chunked_cross_entropy(h, w, torch.tensor([0, 1, 10]))
        with pytest.raises(ValueError, match=r"target has shape \(2,\); expected \(3,\)"):
            chunked_cross_entropy(h, w, torch.tensor([0, 1]))


def test_empty_batches() -> None:
    logits = torch.empty(0, 5, requires_grad=True)
    target = torch.empty(0, dtype=torch.long)
    assert float(cross_entropy(logits, target).detach()) == 0.0
    assert cross_entropy(logits, target, reduction="none").shape == (0,)
    h, w = torch.empty(0, 4), torch.randn(6, 4)
    assert float(chunked_cross_entropy(h, w, target)) == 0.0
