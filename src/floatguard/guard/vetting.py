"""The state check: every parameter, optimizer-state tensor and floating buffer, read
as one stacked magnitude per tensor with the step's read (on snapshot steps, to vet
the snapshot) or on a bad step, and the first bad one named.

Words used here:

- *state tensors*: every parameter, every floating optimizer-state tensor (AdamW's
  ``exp_avg``, ``exp_avg_sq``; not its ``step`` counter) and every floating buffer a
  snapshot keeps (BatchNorm's running statistics: the persistent ones of
  ``state_dict``), named ``param:<name>``, ``optimizer:<name>.<key>`` and
  ``buffer:<name>`` after their owner module. A buffer is bad when it holds a NaN, or
  an inf it did not hold at the last check (``-inf`` masks registered as buffers are
  data: a buffer infinite at its first check is taken as intended).
- *vetting*: one stacked read of every state tensor's largest magnitude (NaN when it
  holds a NaN). A snapshot is taken only of vetted state, and the magnitudes are kept
  for the *magnitude rule*: a parameter whose largest magnitude grew more than
  ``JUMP`` times since the last snapshot, and past ``FLOOR``, or past ``IMPLAUSIBLE``
  at all, is as bad as a NaN (a flipped exponent bit leaves a weight finite, ~1e37 in
  bfloat16 or float32). Clean training never grows a weight 65536-fold within
  ``snapshot_every`` steps; the rule is checked on bad steps only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from floatguard import _native
from floatguard._values import local_part, values_of
from floatguard.guard.types import Precision
from floatguard.guard.update_check import UpdateCheck
from floatguard.monitor.localize import Fault

__all__ = [
    "FLOOR",
    "IMPLAUSIBLE",
    "JUMP",
    "StateCheck",
    "StateTensor",
    "Vetting",
    "all_clean",
    "named_root",
]

JUMP = 2.0**16  # 65536: growth since the last snapshot that no clean step makes
FLOOR = 2.0**10  # 1024: and at least this large (a zero-initialized bias may grow from 0)
IMPLAUSIBLE = 2.0**64  # ~1.8e19: no trained weight is this large
FP16_MAX = 65504.0


@dataclass(frozen=True)
class StateTensor:
    owner: str  # the owner module's qualified name
    role: str  # "param:<name>" or "optimizer:<name>.<key>"
    tensor: torch.Tensor

    @property
    def key(self) -> str:
        """``owner.role``: the name its magnitude is kept under."""
        return f"{self.owner}.{self.role}"

    @property
    def is_param(self) -> bool:
        return self.role.startswith("param:")

    @property
    def is_buffer(self) -> bool:
        return self.role.startswith("buffer:")


@dataclass(frozen=True)
class Vetting:
    """The largest magnitude of every state tensor (host floats, NaN for a NaN), in
    :meth:`StateCheck.state_tensors` order, and the first bad one (None: all clean)."""

    amax: dict[str, float]
    bad: Fault | None


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a strided real tensor (:func:`values_of`), skipping its calls
    for the common case: a plain strided real tensor is its own values."""
    if t.layout == torch.strided and not t.is_complex() and type(t) in (torch.Tensor, nn.Parameter):
        return t.detach()
    return values_of(t)


def _since(checked_at: int | None) -> str:
    if checked_at is None:
        return "non-finite since the guard began (no check found it good)"
    return f"non-finite since the last check at step {checked_at}"


def named_root(model: nn.Module) -> nn.Module:
    """The module whose names faults use: a compiled model (torch.compile's wrapper)
    and a DistributedDataParallel model are named by the module they wrap."""
    root = model
    if isinstance(root, nn.parallel.DistributedDataParallel):
        root = root.module
    inner = getattr(root, "_orig_mod", root)
    return inner if isinstance(inner, nn.Module) else root


def all_clean(
    values: list[float],
    params: list[int],
    keys: list[str],
    before: dict[str, float],
    limit: float,
) -> bool:
    """True when :meth:`StateCheck.vet` would find nothing bad, decided in one pass for the
    common case: every value finite (their sum is; a NaN or an inf propagates, and a
    float64 sum that overflows only sends the check to the full pass) and every
    parameter (``values[i]`` for ``i`` in ``params``, named ``keys[i]``) at most
    ``limit`` and within the magnitude rule against ``before``. False means "look
    closer", not "bad": the full pass decides."""
    if not math.isfinite(sum(values)):
        return False
    for i in params:
        v = values[i]
        if v > limit or v > IMPLAUSIBLE:
            return False
        if v > FLOOR:
            b = before.get(keys[i])
            if b is not None and v > JUMP * b:
                return False
    return True


class StateCheck:
    """The state tensors of ``model`` and ``optimizer`` (see the module): listed, read,
    vetted. ``updates``: what tells whether the last update wrote a bad parameter."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        precision: Precision,
        device: torch.device,
        updates: UpdateCheck,
    ) -> None:
        self.model, self.optimizer, self.precision = model, optimizer, precision
        self.device, self.updates = device, updates
        self._named: list[tuple[str, str, torch.Tensor]] | None = None
        # state_tensors' list, and what it was built from (to see a change cheaply)
        self._listed: (
            tuple[
                list[StateTensor],
                list[tuple[torch.Tensor, object, int, list[tuple[object, object]]]],
            ]
            | None
        ) = None
        self._listed_buffers: list[torch.Tensor] | None = None
        self._buffer_names: list[tuple[str, str, torch.Tensor]] | None = None
        self._plan: _native.AmaxPlan | None = None
        self._keys_of: tuple[list[StateTensor], list[str], list[int]] | None = None

    def state_tensors(self) -> list[StateTensor]:
        """Every parameter and floating optimizer-state tensor, each parameter after its
        state, in model order (the list is rebuilt only when the optimizer's state
        changed: an entry added, removed or replaced)."""
        if self._named is None:  # the model's parameter names, found once
            self._named = []
            for name, param in named_root(self.model).named_parameters():
                owner, _, pname = name.rpartition(".")
                self._named.append((owner, pname, param))
        state = self.optimizer.state
        buffers = self._buffers()
        if (
            self._listed is not None
            and self._unchanged(state)
            and self._listed_buffers is not None
            and len(buffers) == len(self._listed_buffers)
            and all(a is b for a, b in zip(buffers, self._listed_buffers, strict=True))
        ):
            return self._listed[0]
        out: list[StateTensor] = []
        seen: list[tuple[torch.Tensor, object, int, list[tuple[object, object]]]] = []
        for owner, pname, p in self._named:
            entry = state.get(p, {})
            keyed: list[tuple[object, object]] = []
            for key, v in entry.items():
                if (
                    key != "step"
                    and isinstance(v, torch.Tensor)
                    and v.is_floating_point()
                    and v.numel() > 0
                ):
                    out.append(StateTensor(owner, f"optimizer:{pname}.{key}", local_part(v)))
                keyed.append((key, v))
            seen.append((p, entry, len(entry), keyed))
            out.append(StateTensor(owner, f"param:{pname}", local_part(p)))
        for owner, bname, b in self._buffer_names or []:
            out.append(StateTensor(owner, f"buffer:{bname}", local_part(b)))
        self._listed = (out, seen)
        self._listed_buffers = buffers
        self._plan = None
        return out

    def _buffers(self) -> list[torch.Tensor]:
        """The floating buffers a snapshot keeps (persistent, strided, non-empty), read
        anew each time (a module may replace a buffer tensor): their owners and names
        in ``_buffer_names``."""
        names: list[tuple[str, str, torch.Tensor]] = []
        for mname, module in named_root(self.model).named_modules():
            skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
            for bname, b in module.named_buffers(recurse=False):
                if (
                    b is not None
                    and bname not in skip
                    and b.is_floating_point()
                    and b.layout == torch.strided
                    and b.numel() > 0
                ):
                    names.append((mname, bname, b))
        self._buffer_names = names
        return [b for _, _, b in names]

    def _unchanged(self, state: dict[torch.Tensor, dict[object, object]]) -> bool:
        assert self._listed is not None
        for p, entry, size, keyed in self._listed[1]:
            now = state.get(p)
            if now is None:  # no state (still, or removed: then it had none to vet)
                if size:
                    return False
                continue
            if now is not entry or len(now) != size:
                return False
            for k, v in keyed:
                if now.get(k) is not v:
                    return False
        return True

    def magnitudes(self) -> tuple[list[StateTensor], torch.Tensor | None]:
        """Every state tensor and its largest magnitude, stacked on device (float64, NaN
        for a tensor holding a NaN: the inf-norm propagates it; no sync): for the reader
        to read with the step. One foreach op over all of them, or on CPU one native
        call (:func:`floatguard._native.amax_many`: per-tensor dispatch dominates a
        small model's vetting there)."""
        tensors = self.state_tensors()
        if not tensors:
            return tensors, None
        if self.device.type == "cpu":
            if self._plan is None or not self._plan.valid():
                self._plan = _native.AmaxPlan.build([t.tensor for t in tensors])
            if self._plan is not None:
                return tensors, self._plan.run()
        values = [_plain(t.tensor) for t in tensors]
        if all(v.numel() for v in values):
            norms = torch._foreach_norm(values, math.inf)
            if len({(n.dtype, n.device) for n in norms}) == 1:  # the common case: one op
                return tensors, torch.stack(norms).to(self.device, torch.float64)
            return tensors, torch.stack([n.to(self.device, torch.float64) for n in norms])
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        nonempty = [v for v in values if v.numel()]
        it = iter(torch._foreach_norm(nonempty, math.inf) if nonempty else [])
        amaxes = [next(it).to(self.device, torch.float64) if v.numel() else zero for v in values]
        return tensors, torch.stack(amaxes)

    def vet(
        self,
        step: int,
        *,
        previous_amax: dict[str, float] | None = None,
        after_update: bool = False,
        read: tuple[list[StateTensor], list[float]] | None = None,
        checked_at: int | None = None,
    ) -> Vetting:
        """Every state tensor's largest magnitude (read once here, or given: ``read``,
        the tensors and the values the step's read carried); the first bad one as a
        :class:`Fault` (phase "param"): a non-finite optimizer state first (it went bad
        before the parameter it updates), then a non-finite parameter (under fp16
        autocast, one past fp16's range: it becomes inf when cast), then one that
        breaks the magnitude rule against ``previous_amax``. ``after_update``: the step
        before was applied, so a parameter bad now may have been made by that update:
        the fault's op is "optimizer.step" only when verified (:class:`UpdateCheck`),
        "outside" when the update verifiably could not have made it, else
        "update_or_outside". ``checked_at``: the step whose check last found the state
        good (the last snapshot's), named in the fault's source. A bad floating buffer
        is a fault with op "buffer" (tensor ``buffer:<name>``)."""
        if read is None:
            tensors, stacked = self.magnitudes()
            values = stacked.tolist() if stacked is not None else []  # bad steps only
        else:
            tensors, values = read
        keys, params = self._keys(tensors)
        amax = dict(zip(keys, values, strict=True))
        limit = FP16_MAX if self.precision == "fp16" else math.inf
        if all_clean(values, params, keys, previous_amax or {}, limit):
            return Vetting(amax, None)
        previous = previous_amax or {}
        ranked: list[tuple[int, StateTensor, float, str | None]] = []
        for t, v in zip(tensors, values, strict=True):
            if t.is_buffer:
                before = previous.get(t.key)
                if math.isnan(v) or (
                    math.isinf(v) and before is not None and math.isfinite(before)
                ):
                    ranked.append((1, t, v, None))
                continue
            is_param = t.is_param
            if not math.isfinite(v) or (is_param and v > limit):
                ranked.append((0 if not is_param else 1, t, v, None))
            elif is_param:
                why = self._implausible(v, previous.get(t.key))
                if why is not None:
                    ranked.append((2, t, v, why))
        if not ranked:
            return Vetting(amax, None)
        rank, t, v, why = min(ranked, key=lambda r: r[0])
        kind: Literal["nan", "inf", "huge"] = (
            "nan" if math.isnan(v) else "huge" if why is not None and math.isfinite(v) else "inf"
        )
        if t.is_buffer:
            op, source = "buffer", _since(checked_at)
        elif rank == 0:
            op, source = "parameter", None
        elif after_update:
            # Who wrote it: the last update, verified from the optimizer's own state where
            # its rule is known, or "by the update or outside it" (never guessed).
            before = previous.get(t.key)
            bound = IMPLAUSIBLE if before is None else min(IMPLAUSIBLE, max(FLOOR, JUMP * before))
            if math.isfinite(v) and why is None:  # finite, past fp16's range (fp16 autocast)
                made = self.updates.made(t.tensor, "huge", min(bound, limit))
            else:
                made = self.updates.made(t.tensor, kind, bound)
            if made is True:
                op, source = "optimizer.step", why
            elif made is False:
                not_update = (
                    "the last update could not have made it (its step there, recomputed "
                    "from the optimizer's state, is finite and small): written outside "
                    "the optimizer (between steps: a callback, a resize, a checkpoint "
                    "load) or flipped in memory"
                )
                if why is not None:
                    op, source = "magnitude", f"{why}; {not_update}"
                else:
                    op, source = "outside", f"{_since(checked_at)}: {not_update}"
            else:
                op = "update_or_outside"
                source = f"{_since(checked_at)}: written by the update or outside it"
                if why is not None:
                    source += f" ({why})"
        elif why is not None:
            op, source = "magnitude", why
        else:
            op, source = "parameter", None
        fault = Fault(
            step=step,
            phase="param",
            module=t.owner,
            tensor=t.role,
            kind=kind,
            shape=tuple(t.tensor.shape),
            op=op,
            source=source,
            deterministic=True,
        )
        return Vetting(amax, fault)

    def nonfinite_now(self, previous_amax: dict[str, float]) -> list[str]:
        """The state tensors non-finite now (one read): parameters and optimizer state
        holding a NaN or an inf, buffers by the buffer rule; named ``param:<owner>.<name>``,
        ``optimizer:<owner>.<name>.<key>``, ``buffer:<owner>.<name>``."""
        tensors, stacked = self.magnitudes()
        values = stacked.tolist() if stacked is not None else []
        out = []
        for t, v in zip(tensors, values, strict=True):
            if math.isfinite(v):
                continue
            if t.is_buffer and not math.isnan(v):
                before = previous_amax.get(t.key)
                if before is None or not math.isfinite(before):
                    continue  # an inf it held when checked: a mask
            kind, _, name = t.role.partition(":")
            out.append(f"{kind}:{t.owner + '.' if t.owner else ''}{name}")
        return out

    def _keys(self, tensors: list[StateTensor]) -> tuple[list[str], list[int]]:
        """The tensors' magnitude keys and the positions of the parameters among them
        (kept with the listing they were made for)."""
        cached = self._keys_of
        if cached is not None and cached[0] is tensors:
            return cached[1], cached[2]
        keys = [t.key for t in tensors]
        params = [i for i, t in enumerate(tensors) if t.is_param]
        self._keys_of = (tensors, keys, params)
        return keys, params

    @staticmethod
    def _implausible(amax: float, before: float | None) -> str | None:
        if amax > IMPLAUSIBLE:
            return f"largest magnitude {amax:.3g}: beyond any trained weight"
        if before is not None and amax > FLOOR and amax > JUMP * before:
            return f"largest magnitude {amax:.3g}, {before:.3g} at the last snapshot"
        return None

    def tensor_of(self, fault: Fault) -> torch.Tensor | None:
        """The state tensor a state fault (phase "param": a parameter, an optimizer
        state, a buffer) names, or None."""
        for t in self.state_tensors():
            if t.owner == fault.module and t.role == fault.tensor:
                return t.tensor
        return None
