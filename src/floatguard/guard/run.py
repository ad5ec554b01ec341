"""The step runner: the closures' forward under autocast, their (scaled) backward, the losses."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from floatguard.guard.types import Closure, Precision
from floatguard.scaling.loss_scale import DynamicLossScaler

__all__ = ["StepRunner", "as_closures"]


def as_closures(closure: Closure | Sequence[Closure] | None) -> list[Closure]:
    """``step``'s argument as a list of closures (empty for None); a clear TypeError
    for anything else."""
    if closure is None:
        return []
    items = [closure] if callable(closure) else list(closure)
    bad = [type(c).__name__ for c in items if not callable(c)]
    if bad or not items:
        raise TypeError(
            f"Guard.step(closure) needs a callable returning the loss, or a non-empty "
            f"sequence of them; got {bad[0] if bad else 'an empty sequence'}"
        )
    return items


def _scalar(loss: object, who: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"{who} needs a scalar loss tensor, got {got}")
    return loss


class StepRunner:
    """Runs a step's forward and backward and keeps its micro-batches' losses (device
    float32 scalars, no sync). ``region``: the context in which this rank may block in
    collectives the guard does not own (the peer watchdog's); ``on_loss``: called with
    every loss before its backward (the hook monitor's loss check)."""

    def __init__(
        self,
        precision: Precision,
        device: torch.device,
        scaler: DynamicLossScaler,
        region: Callable[[], contextlib.AbstractContextManager[None]],
        on_loss: Callable[[torch.Tensor], object] | None = None,
        params: Sequence[torch.Tensor] = (),
    ) -> None:
        self.precision = precision
        self.device = device
        self.scaler = scaler
        self.region = region
        self.on_loss = on_loss
        self.losses: list[torch.Tensor] = []
        # A few trainable parameters spread over the model: whether a closure ran the
        # backward itself shows in their gradients (O(1) a step, not a walk of all).
        trainable = [p for p in params if p.requires_grad]
        n = len(trainable)
        self._probes = (
            [trainable[(k * (n - 1)) // 7] for k in range(8)] if n > 8 else list(trainable)
        )

    @contextlib.contextmanager
    def autocast(self, cache: bool = True) -> Iterator[None]:
        """``torch.autocast`` to the guard's precision (nothing for fp32); ``cache=False``
        for a step a CUDA graph captures (torch's rule: no cast cache under capture)."""
        if self.precision == "fp32":
            yield
            return
        dtype = torch.float16 if self.precision == "fp16" else torch.bfloat16
        with torch.autocast(device_type=self.device.type, dtype=dtype, cache_enabled=cache):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """Keep the loss, then run the backward of the (scaled, for fp16) loss."""
        loss = _scalar(loss, "Guard.backward")
        if not loss.requires_grad:  # (a property of the tensor: no sync)
            raise ValueError(
                "Guard.step: the loss has no gradient graph (requires_grad=False: computed "
                "under torch.no_grad(), detached, or a constant); return the loss the model's "
                "forward computed"
            )
        if self.on_loss is not None:
            self.on_loss(loss)
        self.losses.append(loss.detach().float().reshape(()))
        target = self.scaler.scale(loss) if self.scaler.enabled else loss
        with self.region():
            target.backward()  # type: ignore[no-untyped-call]

    def record(self, loss: torch.Tensor) -> None:
        """Keep a micro-batch's loss whose backward the caller runs itself."""
        loss = _scalar(loss, "Guard.record_loss")
        self.losses.append(loss.detach().float().reshape(()).to(self.device))

    def mean_loss(self, device: torch.device | None = None) -> torch.Tensor:
        """The mean of the kept losses (device, no sync); NaN when none was kept."""
        dev = device or self.device
        if not self.losses:
            return torch.full((), float("nan"), device=dev)
        return torch.stack(self.losses).mean().to(dev)

    def losses_finite(self) -> torch.Tensor:
        """Whether every kept loss is finite: a device bool, no sync."""
        if not self.losses:
            return torch.ones((), dtype=torch.bool, device=self.device)
        return torch.stack(self.losses).isfinite().all()

    def clear(self) -> None:
        self.losses = []

    def run(
        self,
        closures: Sequence[Closure],
        *,
        before_last_backward: Callable[[torch.Tensor], None] | None = None,
        cache: bool = True,
    ) -> None:
        """Every closure's forward (under autocast) and backward. ``before_last_backward``
        gets the mean loss of the step (the kept losses and the last one) before the
        last backward: under DDP the channel arms its comm hook with it, so the step's
        read rides on DDP's gradient all-reduce."""
        for i, closure in enumerate(closures):
            mark = self._mark()
            with self.autocast(cache), self.region():
                loss = closure()
            if not isinstance(loss, torch.Tensor):
                raise TypeError(
                    f"the closure must return the loss tensor, got {type(loss).__name__}"
                )
            if self._mark() != mark:  # the closure ran loss.backward() itself
                self._own_backward(loss, len(closures), before_last_backward is not None)
                continue
            if before_last_backward is not None and i == len(closures) - 1:
                kept = [*self.losses, loss.detach().float().reshape(())]
                before_last_backward(torch.stack(kept).mean().to(self.device))
            self.backward(loss)

    def _mark(self) -> list[tuple[int, int] | None]:
        """The probes' gradients (identity, version): a backward changes them."""
        return [None if (g := p.grad) is None else (id(g), g._version) for p in self._probes]

    def _own_backward(self, loss: torch.Tensor, n_closures: int, hooked: bool) -> None:
        """A PyTorch-style closure (``opt.zero_grad(); loss.backward(); return loss``):
        its gradients are the step's, its loss is kept, no second backward runs. Where
        the guard must run the backward itself, said at once with what to change."""
        why = None
        if self.scaler.enabled:
            why = "under precision='fp16' the guard scales the loss before its backward"
        elif n_closures > 1:
            why = "with a sequence of closures the guard accumulates their gradients"
        elif hooked:
            why = "under DDP the guard's read rides on the backward it runs"
        if why is not None:
            raise RuntimeError(
                f"Guard.step: the closure called loss.backward() itself; {why}: return "
                "the loss without calling backward() (and without zero_grad(): the guard "
                "zeroes the gradients after every step)"
            )
        loss = _scalar(loss, "Guard.step's closure")
        if self.on_loss is not None:
            self.on_loss(loss)
        self.losses.append(loss.detach().float().reshape(()).to(self.device))
