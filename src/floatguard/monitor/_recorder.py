"""What the hooks do: one step's module calls and gradients, written into its record book."""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from floatguard.monitor._forwards import Forward, drop_dead
from floatguard.monitor._proofs import Frame, RuleCache, build_frame
from floatguard.monitor._records import RecordBook, Roles
from floatguard.monitor._tree import floats, has_leaf, map_watched, version_of, watched
from floatguard.monitor.bounds import PROVABLE_DTYPES, Rule, rule_params
from floatguard.monitor.localize import Fault, Record, RecordKind

__all__ = ["Callee", "Recorder"]

ProofMode = Literal["all", "forward", "off"]


def _nth_grad(
    nr: int, fn: Callable[[torch.Tensor], None], grad_outputs: tuple[torch.Tensor | None, ...]
) -> None:
    """Node pre-hook: pass the gradient of output ``nr`` (if any) to ``fn``."""
    g = grad_outputs[nr] if nr < len(grad_outputs) else None
    if g is not None:
        fn(g)


class _Pending(NamedTuple):
    """A tensor whose gradient is awaited: a weak reference to it (an id alone may be
    reused), the (call path, role) of every module that returned it, and the frames
    of those calls (the gradient's slot is what their backward proofs start from)."""

    ref: weakref.ref[torch.Tensor]
    roles: Roles
    frames: list[Frame]


class Callee(NamedTuple):
    """What a module's calls are recorded with, fixed at attach: its own parameters
    (by role), the parameters its proof rule reads, whether it may be proved."""

    params: list[tuple[str, nn.Parameter]]
    rule_pnames: list[str]
    provable: bool
    is_embedding: bool

    @classmethod
    def of(cls, module: nn.Module, provable_type: bool) -> Callee:
        """``module``'s callee; ``provable_type``: whether its type has a rule (see
        :func:`~floatguard.monitor.bounds.provable_type`)."""
        own = dict(module.named_parameters(recurse=False))
        rule_pnames = rule_params(module)
        # A rule reads the module's own parameters; one computed by a pre-hook
        # (old-style weight_norm, pruning) is not a parameter: no proof.
        provable = provable_type and all(n in own for n in rule_pnames)
        params = [(f"param:{n}", p) for n, p in own.items()]
        return cls(params, rule_pnames, provable, type(module) is nn.Embedding)


class Recorder:
    """One step's records and what the hooks need to make them: the calls in progress
    (``stack``, ``frames``), the step's top-level calls (``forwards``: the dead ones
    are dropped when the next begins), the tensors whose gradients are awaited
    (``hooked``), the last gradient checked; and the step's reading (``status``,
    ``analysis``: cached until a record is added). ``stats_on`` says whether records
    keep statistics."""

    def __init__(self, stats_on: Callable[[], bool], proofs: ProofMode) -> None:
        self.book = RecordBook()
        self.rules = RuleCache()
        self.proofs: ProofMode = proofs
        self._stats_on = stats_on
        self.hooked: dict[int, _Pending] = {}  # id of a returned tensor -> its pending entry
        self.stack: list[str] = []  # names of the modules being called
        self.frames: list[Frame | None] = []  # their frames (None: not provable)
        self.step_handles: list[RemovableHandle] = []  # hooks on leaves, for one step
        self.backward_seen = False
        self.last_grad: tuple[torch.Tensor, tuple[Any, ...], int] | None = None
        self.status: list[str] = []
        self.analysis: list[Fault] | None = None
        self.forwards: list[Forward] = []  # this step's top-level calls, in order
        self._forward: Forward | None = None  # the one running
        # The key of the running forward's token in its nodes' metadata: one per
        # recorder (two monitors may watch one model), so a node shared by several
        # forwards (a tensor returned again) holds one token, the latest forward's.
        self._key = f"floatguard.monitor.{id(self)}"

    def clear(self) -> None:
        """Forget the step's records (the calls in progress stay)."""
        self.book.clear()
        self.hooked.clear()
        self.forwards.clear()
        self._forward = None
        self.backward_seen = False
        self.analysis = None
        self.last_grad = None
        self.rules.new_step()
        for h in self.step_handles:
            h.remove()
        self.step_handles.clear()

    # --------------------------------------------------------------- records
    def add(
        self,
        kind: RecordKind,
        path: tuple[str, ...],
        role: str,
        t: torch.Tensor,
        proof: tuple[Rule, list[int]] | None = None,
    ) -> Record:
        """A record with a slot of its own (see :meth:`RecordBook.add`)."""
        rec = self.book.add(kind, path, role, t, proof, stats_on=self._stats_on())
        self.analysis = None
        return rec

    def add_forward(
        self,
        kind: RecordKind,
        path: tuple[str, ...],
        role: str,
        t: torch.Tensor,
        proof: tuple[Rule, list[int]] | None = None,
    ) -> int:
        """Record a forward tensor (an alias when already recorded); returns its slot."""
        version = version_of(t)
        if version is None:  # an inference tensor (no version): read it wherever seen
            return self.add(kind, path, role, t).slot
        slot = self.book.seen_slot(t, version)
        if slot is not None:
            # Already checked this step (e.g. the previous module's output): alias it.
            self.book.alias(kind, [(path, role)], slot, tuple(t.shape))
            return slot
        if proof is not None and (t.layout != torch.strided or t.is_complex()):
            proof = None
        rec = self.add(kind, path, role, t, proof)
        self.book.remember(t, version, rec.slot)
        return rec.slot

    # --------------------------------------------------- top-level calls
    def _begin_forward(self) -> None:
        """A top-level call begins: drop the earlier forwards that are dead (see
        :attr:`Forward.dead`), then open this one."""
        if any(f.dead for f in self.forwards):
            self._drop_dead()
        self._forward = Forward.open(len(self.book.records))
        self.forwards.append(self._forward)

    def _drop_dead(self) -> None:
        """Drop the dead forwards (:func:`drop_dead`), the awaited entries and leaf hooks
        they made, and the entries of tensors that are gone; renumber the last gradient."""
        self.forwards, dead, remap = drop_dead(self.forwards, self.book)
        for f in dead:
            for key, pending in f.hooked:
                if self.hooked.get(key) is pending:
                    del self.hooked[key]
            for h in f.handles:
                h.remove()
            if f.handles:
                gone = {id(h) for h in f.handles}
                self.step_handles = [h for h in self.step_handles if id(h) not in gone]
        # An entry whose tensor is gone matched by identity only: it matches nothing now.
        self.hooked = {k: p for k, p in self.hooked.items() if p.ref() is not None}
        last = self.last_grad
        if last is not None:
            slot = remap.get(last[2])
            self.last_grad = None if slot is None else (last[0], last[1], slot)
        self.analysis = None

    # ------------------------------------------------------------ the forward
    def enter(
        self,
        name: str,
        callee: Callee,
        mod: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """A module call begins (its forward pre-hook): record its inputs and parameters,
        make its frame, and (with grad) hand it watched views of its inputs."""
        if not self.stack:
            self._begin_forward()
        self.stack.append(name)
        path = tuple(self.stack)
        inputs = floats(args, "input")
        if kwargs:
            inputs += floats(kwargs, "input")
        slots = [self.add_forward("fwd_input", path, role, t) for role, t in inputs]
        params = callee.params
        pslots = {role: self.add_forward("fwd_param", path, role, p) for role, p in params}
        frame: Frame | None = None
        if callee.provable and self.proofs != "off":
            frame = build_frame(
                mod, inputs, params, slots, pslots, callee.rule_pnames, callee.is_embedding
            )
            if frame is not None and self._forward is not None:
                self._forward.frames.append(frame)
        if mod.__dict__.get("inplace") is True:
            # It will overwrite its input: a proof of that input must read it now.
            for slot in slots:
                self.book.sentinel.materialize(slot)
        self.frames.append(frame)
        if not torch.is_grad_enabled():
            return None
        x = inputs[0][1] if frame is not None and inputs else None
        return self._watch_inputs(path, args, kwargs, frame, x)

    def _watch_inputs(
        self,
        path: tuple[str, ...],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        frame: Frame | None,
        x: torch.Tensor | None,
    ) -> tuple[Any, dict[str, Any]]:
        """The module's arguments, each floating tensor that requires grad replaced by
        a view watched for the gradient this module sends back (``grad_input[i]``, ``i``
        counting the floating tensors of args then kwargs). ``x``: the input ``frame``
        proves that gradient from."""
        index = itertools.count()

        def watch(t: torch.Tensor) -> torch.Tensor:
            i = next(index)
            if not t.requires_grad:
                return t
            return self._input_view(t, path, f"grad_input[{i}]", frame if t is x else None)

        return map_watched(args, watch), (map_watched(kwargs, watch) if kwargs else kwargs)

    def _input_view(
        self, t: torch.Tensor, path: tuple[str, ...], role: str, frame: Frame | None
    ) -> torch.Tensor:
        """A view of input ``t`` with a gradient hook: the view gives this module its own
        autograd edge, so the hook sees exactly the gradient this module sends back."""
        v = t.view_as(t)
        slot = self.book.seen_slot(t, t._version)
        if slot is not None:
            # Same memory, same version counter: what the module's children see
            # through the view was checked as the module's input.
            self.book.remember(v, v._version, slot)
        # A module may return this very view (an identity, dropout with p=0): then its
        # gradient arrives here before any node hook could see it as the module's
        # grad_output. The post-hook files those roles in the view's pending entry,
        # recorded ahead of the grad_input.
        before = _Pending(weakref.ref(v), [], [])
        self.hooked[id(v)] = before
        fwd = self._forward
        if fwd is not None:
            fwd.hooked.append((id(v), before))
        hook = functools.partial(
            self.on_grad,
            kind="bwd_grad_input",
            roles=[(path, role)],
            frame=frame,
            before=before,
            forward=fwd,
        )
        v.register_hook(hook)  # type: ignore[no-untyped-call]
        return v

    def exit(self, name: str, output: Any) -> Any:
        """A module call ends (its forward hook): record its outputs (proved when its
        frame's rule allows) and await their gradients. Returns a replacement output
        (views of leaves it returned) or None."""
        on_top = bool(self.stack) and self.stack[-1] == name
        path = tuple(self.stack) if on_top else (name,)
        frame = self.frames[-1] if on_top and self.frames else None
        grad = torch.is_grad_enabled()
        proof: tuple[Rule, list[int]] | None = None
        if frame is not None and isinstance(output, torch.Tensor):
            if output.dtype in PROVABLE_DTYPES:
                width = output.shape[-1] if output.dim() else 1
                rule = self.rules.rule(frame, "forward", width, output)
                if rule is not None:
                    proof = (rule, frame.deps)
        # A lone tensor is output[0], like the first element of a tuple.
        outs = floats((output,) if isinstance(output, torch.Tensor) else output, "output")
        replaced = None
        if grad and has_leaf(outs):
            # A leaf returned as output (the module's own parameter, say) has no node
            # for the hook, and its own hooks (the parameter's gradient) would run
            # first: the module returns a view of it instead, whose node is its own.
            replaced = map_watched(output, self._view_of_leaf)
            outs = floats((replaced,) if isinstance(replaced, torch.Tensor) else replaced, "output")
        for role, t in outs:
            self.add_forward("fwd_output", path, role, t, proof)
            if grad and t.requires_grad:
                self._watch_output(t, path, "grad_" + role, frame)
        if on_top:
            self.stack.pop()
            self.frames.pop()
            if not self.stack and self._forward is not None:
                self._forward.close(len(self.book.records))
                self._forward = None
        return replaced

    def _watch_output(
        self, t: torch.Tensor, path: tuple[str, ...], role: str, frame: Frame | None
    ) -> None:
        """Await the gradient of output ``t`` (its ``grad_output`` role ``role``)."""
        node = t.grad_fn
        fwd = self._forward
        if node is not None and fwd is not None:
            # this forward lives as long as its graph
            node.metadata[self._key] = fwd.token  # type: ignore[index]
        pending = self.hooked.get(id(t))
        if pending is not None and pending.ref() is t:
            pending.roles.append((path, role))  # a parent returning its child's output
            if frame is not None:
                pending.frames.append(frame)
            return
        roles = [(path, role)]
        frames = [frame] if frame is not None else []
        on_grad = functools.partial(
            self.on_grad, kind="bwd_grad_output", roles=roles, out_frames=frames, forward=fwd
        )
        if node is not None:
            # A pre-hook on the node that made t runs after every tensor hook on t (a
            # user's may rescale or replace the gradient): it sees the gradient this
            # module's backward consumes.
            node.register_prehook(functools.partial(_nth_grad, t.output_nr, on_grad))
        else:  # a leaf nested where it could not be replaced
            h = t.register_hook(on_grad)  # type: ignore[no-untyped-call]
            self.step_handles.append(h)
            if fwd is not None:
                fwd.handles.append(h)
        pending = _Pending(weakref.ref(t), roles, frames)
        self.hooked[id(t)] = pending
        if fwd is not None:
            fwd.hooked.append((id(t), pending))

    def _view_of_leaf(self, t: torch.Tensor) -> torch.Tensor:
        if not (t.requires_grad and t.grad_fn is None):
            return t
        v = t.view_as(t)
        slot = self.book.seen_slot(t, version_of(t))
        if slot is not None:
            self.book.remember(v, v._version, slot)  # same values
        return v

    # ----------------------------------------------------------- the backward
    def saw_backward(self, grad_outputs: Any) -> None:
        """Node pre-hook of an unsampled step: its backward ran."""
        self.backward_seen = True

    def on_grad(
        self,
        grad: torch.Tensor,
        *,
        kind: RecordKind,
        roles: Roles,
        frame: Frame | None = None,
        out_frames: list[Frame] | None = None,
        before: _Pending | None = None,
        forward: Forward | None = None,
    ) -> None:
        """Record a gradient as it arrives. ``roles``: its (call path, role)s; ``frame``:
        the call whose backward proof may prove it (a grad_input); ``out_frames``: calls
        whose output it is the gradient of (their proofs start from its slot);
        ``before``: the pending entry of an input view a module may have returned;
        ``forward``: the top-level call whose hook this is (its backward has come)."""
        self.backward_seen = True
        if forward is not None:
            forward.reached = True
        if grad is None or not watched(grad):
            return
        if before is not None and before.roles:
            # The module returned its input view: this gradient is its grad_output too.
            self.on_grad(
                grad,
                kind="bwd_grad_output",
                roles=before.roles,
                out_frames=before.frames,
                forward=forward,
            )
        # The gradient a module sends to its input view usually arrives, as a view of
        # the same memory, at the previous module's output right after: check it once.
        # The last checked gradient is held (one buffer at most), so its memory cannot
        # have been reused: equal (address, layout, version) means equal values.
        strided = grad.layout == torch.strided
        key = (
            (grad.data_ptr(), grad.shape, grad.stride(), grad.dtype, grad._version)
            if strided
            else None
        )
        last = self.last_grad
        if key is not None and last is not None and last[1] == key:
            slot = last[2]
            self.book.alias(kind, roles, slot, tuple(grad.shape))
            self.analysis = None
        else:
            proof: tuple[Rule, list[int]] | None = None
            if (
                frame is not None
                and frame.g_slot is not None
                and frame.x is not None
                and not frame.dropped
                and grad.dtype in PROVABLE_DTYPES
                and strided
                and self.proofs == "all"
            ):
                rule = self.rules.rule(frame, "backward", frame.width, None)
                if rule is not None:
                    proof = (rule, [frame.g_slot, *frame.deps])
            rec = self.add(kind, roles[0][0], roles[0][1], grad, proof)
            rec.paths = roles
            slot = rec.slot
            if key is not None:
                self.last_grad = (grad, key, slot)
        if out_frames:
            for f in out_frames:
                f.g_slot = slot
