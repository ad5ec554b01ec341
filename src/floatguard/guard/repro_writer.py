"""The guard's side of repro bundles: on a bad step, record it and write the file.

Nothing happens on a healthy step. On a bad step (``ResponsePolicy(repro_dir=...)``),
after the judge localized the fault and before the actor rolls back, the step is
re-run once more from its starting state with a tape recorder on the replay's
dispatch mode (:mod:`floatguard.repro.tape`), the tape is checked by running it
here (the cone first, the whole recorded scope if the cone does not give the value
again), and one bundle per distinct fault (by the stop rule's fault key and kind) is
written atomically to the folder (:func:`floatguard.repro.bundle.save_bundle`),
``repro-step<step>[-rank<r>]-<key>.fgr``; the oldest of this rank's bundles beyond
``repro_keep`` are removed (only regular files named so, and only bundles: the header
is checked first). Under torch.distributed each rank writes the bundle of the fault
born on it (its own localization found it), none for a fault born elsewhere.

A write that fails (a full disk, an unwritable folder, a step that cannot be taped)
never touches training: it is a ``warning`` event (code ``repro_error``) and the step
goes on as decided.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from floatguard.guard.emit import GuardEvents
from floatguard.guard.judge import StepVerdict
from floatguard.guard.locate import Locator
from floatguard.guard.policy import fault_key
from floatguard.guard.repro_payload import (
    _cpu,
    _device_name,
    _encoded,
    _plain,
    _shared,
    _tree,
)
from floatguard.guard.types import Closure
from floatguard.guard.vetting import FLOOR, named_root
from floatguard.monitor.localize import Fault
from floatguard.repro.bundle import FORMAT, MAGIC, run_tape, save_bundle
from floatguard.repro.tape import Site, TapeRecorder
from floatguard.scaling.loss_scale import DynamicLossScaler
from floatguard.stability.spike_watch import SpikeWatch
from floatguard.stability.step_state import StepState

__all__ = ["ReproWriter"]

_NAME = re.compile(r"^repro-step(\d{9,})(-rank(\d+))?-([0-9a-f]{8})\.fgr$")


class ReproWriter:
    """Writes the repro bundles of a guarded run (see the module)."""

    def __init__(
        self,
        folder: str | os.PathLike[str],
        level: str,
        keep: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        locator: Locator,
        *,
        precision: str,
        device: torch.device,
        rank: int | None,
        world_size: int,
        scaler: DynamicLossScaler,
        step_state: StepState,
        spike_watch: SpikeWatch,
        events: GuardEvents,
    ) -> None:
        self.folder = Path(folder)
        self.level, self.keep = level, keep
        self.model, self.optimizer, self.locator = model, optimizer, locator
        self.precision, self.device = precision, device
        self.rank, self.world_size = rank, world_size
        self.scaler, self.step_state, self.spikes, self.events = (
            scaler, step_state, spike_watch, events
        )  # fmt: skip
        self.written: set[tuple[Any, ...]] = set()

    # ------------------------------------------------------------- the bad step
    def bad_step(
        self, step: int, verdict: StepVerdict, local: Fault | None, bad_ranks: Sequence[int],
        closures: Sequence[Closure], batch: list[tuple[Any, ...]],
    ) -> None:  # fmt: skip
        """Write the bundle of a bad step (a fault born on this rank, ``local`` being its
        own localization; or at the "step" level, its spike): a ``repro`` event, or a
        ``warning`` (``repro_error``) when it cannot be written; training goes on
        either way. Under torch.distributed, a fault born on another rank (not in
        ``bad_ranks``) is left to that rank's guard."""
        fault = local if verdict.fault is not None else None
        if verdict.fault is not None and fault is None:
            return
        if (
            self.rank is not None
            and self.rank not in bad_ranks
            and (fault is None or fault.phase != "param")
        ):
            return  # the fault was born on another rank: its bundle is written there
        spike = verdict.spike if fault is None else None
        if not self.wants(fault, spike):
            return
        self.mark(fault, spike)
        spike_info = None
        if spike is not None:
            detector = self.spikes.loss if spike == "loss_spike" else self.spikes.grad_norm
            spike_info = {
                "signal": spike.removesuffix("_spike"),
                "value": verdict.spike_value,
                "threshold": detector.bar() if detector is not None else None,
                "reproduced": verdict.spike_reproduced,
            }
        state = None
        if self.level == "step":
            state = {
                "model": named_root(self.model).state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(),
                "rng": self.step_state.rng,
            }
        try:
            path, size, seconds, summary = self.capture(
                step, fault, spike_info, closures, batch, self._context(), state
            )
        except Exception as e:  # never let a bundle break training
            self.events.warning(
                step, f"repro bundle not written: {type(e).__name__}: {e}", code="repro_error"
            )
            return
        self.events.repro(step, str(path), self.level, size, seconds, summary)

    def _context(self) -> dict[str, Any]:
        """What the step computed in: precision, loss scale, autocast, the parameters'
        dtypes, the emulation recipes of the model's emulated layers."""
        from floatguard.emulation.emulation_recipe import EmulationRecipe

        recipes = {
            name: repr(m.recipe)
            for name, m in named_root(self.model).named_modules()
            if isinstance(getattr(m, "recipe", None), EmulationRecipe)
        }
        return {
            "precision": self.precision,
            "loss_scale": self.scaler.get_scale() if self.scaler.enabled else None,
            "autocast": {"fp16": "float16", "bf16": "bfloat16"}.get(self.precision),
            "param_dtypes": sorted(
                {str(p.dtype).removeprefix("torch.") for p in self.model.parameters()}
            ),
            "emulation": recipes,
        }

    # ------------------------------------------------------------------ capture
    def capture(
        self,
        step: int,
        fault: Fault | None,
        spike: dict[str, Any] | None,
        closures: Sequence[Closure],
        batch: list[tuple[Any, ...]],
        context: dict[str, Any],
        state: dict[str, Any] | None,
    ) -> tuple[Path, int, float, dict[str, Any]]:
        """Record the step and write its bundle: (path, bytes, seconds, summary).
        ``fault``: this rank's own fault (or None with ``spike``: the spike's signal,
        value, bar and whether the guard's replay spiked). ``state``: the pre-step
        state, for the ``"step"`` level (taken by the caller before any rollback)."""
        t0 = time.perf_counter()
        payload: dict[str, Any] = {
            "kind": "floatguard-repro",
            "format": FORMAT,
            "level": self.level,
            "step": step,
            "created": time.time(),
            "floatguard": _version(),
            "torch": str(torch.__version__),
            "device": _device_name(self.device),
            "rank": self.rank,
            "world_size": self.world_size,
            "context": _plain(context),
        }
        site: Site | None = None
        if fault is not None:
            payload["fault"] = {
                "phase": fault.phase,
                "module": fault.module,
                "tensor": fault.tensor,
                "kind": fault.kind,
                "op": fault.op,
                "source": fault.source,
                "shape": list(fault.shape),
                "deterministic": fault.deterministic,
            }
            payload["reproduced_in_guard"] = fault.deterministic is not False
            site = self._site(fault)
            value = self._value(fault, site)
            if value is not None:
                payload["value"] = value
        if spike is not None:
            payload["spike"] = dict(spike)
        whole = self.level == "step"
        wants_tape = closures and (whole or (site is not None and site.seq is not None))
        if wants_tape:
            self._record(payload, site, closures, whole, spike)
        elif not closures:
            payload["why_no_tape"] = (
                "the step had no closure to re-run (use guard.step(closure), or pass "
                "replay= in the three-call loop)"
            )
        if whole:
            payload["batch"] = _encoded(batch)
            payload["state"] = state
        payload = _shared(_cpu(payload))
        path = self.folder / self._name(step, fault, spike)
        self.folder.mkdir(parents=True, exist_ok=True)
        _, size = save_bundle(payload, path)
        self._prune(path)
        summary = {
            "tape_ops": len(payload["tape"]["ops"]) if payload.get("tape") else 0,
            "reproduced_in_guard": payload.get("reproduced_in_guard"),
        }
        return path, size, time.perf_counter() - t0, summary

    def wants(self, fault: Fault | None, spike: str | None) -> bool:
        """Whether a bundle is due: a fault not written yet (one per distinct fault), or
        a spike at the ``"step"`` level (a spike has no birth to cut down to)."""
        key = self._key(fault, spike)
        if key is None or key in self.written:
            return False
        if fault is None and self.level != "step":
            return False
        return True

    def mark(self, fault: Fault | None, spike: str | None) -> None:
        key = self._key(fault, spike)
        if key is not None:
            self.written.add(key)

    @staticmethod
    def _key(fault: Fault | None, spike: str | None) -> tuple[Any, ...] | None:
        if fault is not None:
            return (*fault_key(fault), fault.kind, fault.deterministic is False)
        if spike is not None:
            return ("spike", spike)
        return None

    def _site(self, fault: Fault) -> Site | None:
        site = self.locator.last_site
        if site is None or fault is not self.locator.last_local:
            return None
        return site

    def _value(self, fault: Fault, site: Site | None) -> dict[str, Any] | None:
        """A bad value that was already there: a state tensor, or the replay's input."""
        tensor = None
        if fault.phase == "param" and site is None:
            tensor = self.locator.tensor_of(fault)
        elif site is not None and site.seq is None:
            tensor = site.tensor
        if tensor is None:
            return None
        name = f"{fault.module}.{fault.tensor}" if fault.module else fault.tensor
        out: dict[str, Any] = {"name": name, "tensor": tensor.detach().clone()}
        if fault.kind == "huge":
            # The smallest magnitude the guard ever calls implausible (its bound also
            # depends on the value's history, which a bundle does not hold).
            out["bound"] = FLOOR
        return out

    def _record(
        self,
        payload: dict[str, Any],
        site: Site | None,
        closures: Sequence[Closure],
        whole: bool,
        spike: dict[str, Any] | None,
    ) -> None:
        """The recording replay: the tape, the birth op alone, the birth module's call."""
        tape = TapeRecorder(site if site is not None and site.seq is not None else None,
                            whole=whole)  # fmt: skip
        root = named_root(self.model)
        module = None
        if site is not None and site.seq is not None and site.module:
            try:
                module = root.get_submodule(site.module)
            except AttributeError:
                module = None
        state: list[dict[str, torch.Tensor]] = []
        encoded: list[dict[str, Any] | None] = []

        def keep_call(m: nn.Module, args: Any, kwargs: Any) -> None:
            """The birth module's last call before the birth: its inputs and state as
            they were (copied with the replay's modes off: the copies are no step ops)."""
            if tape.done:
                return
            with _disable_current_modes():
                encoded[:] = [_encoded({"args": tuple(args), "kwargs": dict(kwargs)})]
                every = [*m.named_parameters(), *m.named_buffers()]  # (non-persistent too)
                state[:] = [{k: v.detach().clone() for k, v in every}]

        handle = (
            module.register_forward_pre_hook(keep_call, with_kwargs=True)
            if module is not None
            else None
        )
        found: dict[str, Any] = {}

        def during() -> None:
            losses = self.locator.runner.losses
            if losses:
                found["loss_slot"] = tape.slot(losses[-1])
            found["grad_slots"] = [
                s
                for p in root.parameters()
                if p.grad is not None and (s := tape.slot(p.grad)) is not None
            ]

        try:
            self.locator.record(closures, tape, during)
        finally:
            if handle is not None:
                handle.remove()
        if module is not None:
            payload["module"] = {
                "name": site.module if site is not None else None,
                "class": f"{type(module).__module__}.{type(module).__qualname__}",
                "tree": _tree(module),
                "inputs": encoded[0] if encoded else None,
                "state": state[0] if state else None,
            }
        if tape.single is not None:
            payload["single"] = tape.single
        if spike is not None:
            spike["loss_slot"] = found.get("loss_slot")
            spike["grad_slots"] = found.get("grad_slots", [])
            payload["spike"] = dict(spike)
        kind = (payload.get("fault") or {}).get("kind")
        chosen = None
        tries = [False] if whole else [True, False]
        for cone in tries:
            taped = tape.tape(cone=cone)
            if taped is None:
                break
            if tape.birth is None or self._gives(taped, kind):
                chosen = taped
                break
        if chosen is not None:
            payload["tape"] = chosen
        else:
            payload["why_no_tape"] = tape.failed or (
                "the recorded ops did not give the value again when run alone (an op "
                "whose result depends on more than its inputs)"
            )
        tape.release()

    def _gives(self, taped: dict[str, Any], kind: str | None) -> bool:
        """Whether running ``taped`` here gives its birth op's value again."""
        try:
            run = run_tape(taped, self.device)
        except (ValueError, RuntimeError, TypeError, IndexError):
            return False
        from floatguard.repro.bundle import kind_matches

        return kind_matches(run.birth_out, kind)

    # ------------------------------------------------------------------ files
    def _name(self, step: int, fault: Fault | None, spike: dict[str, Any] | None) -> str:
        key = repr(self._key(fault, None if spike is None else str(spike.get("signal"))))
        digest = hashlib.sha256(key.encode()).hexdigest()[:8]
        rank = f"-rank{self.rank}" if self.rank is not None else ""
        return f"repro-step{step:09d}{rank}-{digest}.fgr"

    def _prune(self, newest: Path) -> None:
        """Remove this rank's oldest bundles beyond ``keep`` (regular files named as a
        bundle whose header is a bundle's; anything else is left alone)."""
        mine: list[tuple[int, str, Path]] = []
        try:
            entries = list(os.scandir(self.folder))
        except OSError:
            return
        for e in entries:
            m = _NAME.match(e.name)
            if m is None:
                continue
            rank = int(m.group(3)) if m.group(3) is not None else None
            if rank != self.rank:
                continue
            try:
                st = os.lstat(e.path)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            mine.append((int(m.group(1)), e.name, Path(e.path)))
        mine.sort()
        for _, _, p in mine[: max(0, len(mine) - self.keep)]:
            if p == newest or not _is_bundle(p):
                continue
            try:
                p.unlink()
            except OSError:
                pass


def _is_bundle(p: Path) -> bool:
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        return os.read(fd, len(MAGIC)) == MAGIC
    finally:
        os.close(fd)


def _version() -> str:
    from floatguard._version import __version__

    return __version__
