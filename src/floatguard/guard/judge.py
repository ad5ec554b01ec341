"""The judge: a step's evidence (localization, spike replay, vetting), then the decision."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from floatguard.guard import policy
from floatguard.guard.channel import ReadChannel
from floatguard.guard.locate import Locator
from floatguard.guard.read import StepRead
from floatguard.guard.types import Closure, Watch
from floatguard.guard.vetting import StateTensor, Vetting
from floatguard.monitor.localize import Fault
from floatguard.scaling.loss_scale import DynamicLossScaler
from floatguard.stability.clipper import Clipper
from floatguard.stability.respond import ResponsePolicy
from floatguard.stability.snapshot_keeper import SnapshotKeeper
from floatguard.stability.spike_watch import SpikeWatch

__all__ = ["Judge", "StepVerdict"]

Magnitudes = tuple[list[StateTensor], list[float]]


@dataclass(frozen=True)
class StepVerdict:
    """A step's decision with what it was taken on."""

    decision: policy.Decision
    fault: Fault | None
    clip: tuple[float, tuple[float, bool] | None]  # coefficient, ZClip's update state
    amax: dict[str, float] | None = None  # a snapshot step's vetted magnitudes
    spike: str | None = None  # "loss_spike" | "grad_norm_spike"
    spike_value: float = math.nan
    spike_reproduced: bool | None = None
    # Under torch.distributed, the other ranks' distinct faults of the step (logged
    # too; the action answers ``fault``).
    also: tuple[Fault, ...] = ()


class Judge:
    """Turns a step's read into a :class:`StepVerdict`: the signal (clean, fp16 overflow,
    non-finite, spike), on a non-finite step the fault (parameters and optimizer state,
    then the replay, agreed over the ranks), on a spike whether its replay spikes
    too, on a snapshot step the vetting of the state; then :func:`policy.decide`."""

    def __init__(
        self,
        response: ResponsePolicy,
        watch: Watch,
        scaler: DynamicLossScaler,
        clipper: Clipper,
        spike_watch: SpikeWatch,
        locator: Locator,
        channel: ReadChannel,
        keeper: SnapshotKeeper,
    ) -> None:
        self.response = response
        self.watch = watch
        self.scaler = scaler
        self.clipper = clipper
        self.spike_watch = spike_watch
        self.locator = locator
        self.channel = channel
        self.keeper = keeper
        # This rank's own fault on the last judged step (before the ranks agreed on
        # one): a repro bundle is written for the fault born here.
        self.local: Fault | None = None

    def judge(
        self,
        step: int,
        read: StepRead,
        closures: Sequence[Closure],
        magnitudes: Magnitudes,
        ladder: policy.LadderState,
        after_update: bool,
    ) -> StepVerdict:
        """The evidence, then the decision; a step to be applied on a snapshot step has
        its state vetted first (``magnitudes`` came with the step's read)."""
        self.local = None
        clip = self.clipper.coefficient(read.grad_norm)
        finite_loss, overflow = read.finite_loss, read.gradient_overflow
        can_back_off = self.scaler.enabled and self.scaler.get_scale() > self.scaler.min_scale
        fault, spike, value, reproduced = None, None, math.nan, None
        if (not finite_loss or overflow) and not (finite_loss and can_back_off):
            fault = self.localize(step, read, closures, after_update)
        elif finite_loss and not overflow:
            spike = self.spike_watch.check(read.loss, read.grad_norm)
            if spike is not None:
                value = read.loss if spike == "loss_spike" else read.grad_norm
                reproduced = self._spike_reproduces(spike, closures)
        evidence = policy.Evidence(
            finite_loss=finite_loss,
            overflow=overflow,
            scale_can_back_off=can_back_off,
            fault=fault,
            spike=spike,
            spike_reproduced=reproduced,
            has_clean_snapshot=self.keeper.snapshot is not None,
        )
        decision = policy.decide(evidence, ladder, self.response)
        amax = None
        if decision.response == "apply" and self.keeper.due(ladder.good_steps):
            vetting = self.vet(step, after_update, magnitudes)
            amax = vetting.amax
            bad = self.channel.agree(vetting.bad, read.bad_ranks, "snapshot check", rare=True)
            self.local = vetting.bad
            if bad is not None:  # the state went bad without a bad step: roll back
                fault = bad
                decision = policy.decide(
                    dataclasses.replace(evidence, fault=fault), ladder, self.response
                )
        also = tuple(self.channel.others) if fault is not None else ()
        return StepVerdict(decision, fault, clip, amax, spike, value, reproduced, also)

    def localize(
        self, step: int, read: StepRead, closures: Sequence[Closure], after_update: bool
    ) -> Fault | None:
        """Where the non-finite value was born: a bad parameter or optimizer state, else a
        replay of the step (with a closure), else the hook monitor's records. The buffers
        are checked as the step found them: what its own forward wrote into them (a NaN
        batch through BatchNorm's running statistics) is the step's, not the state's."""
        self.locator.state.restore_buffers()
        vetted = self.vet(step, after_update).bad
        bad = self.channel.agree(vetted, read.bad_ranks, "parameter check")
        if bad is not None:
            self.local = vetted
            return bad  # (on every rank: no rank replays while another does not)
        if closures and self.watch != "off":
            found = self.locator.replay(step, closures, read)
            self.local = found
            return self.channel.agree(found, read.bad_ranks, "replay")
        self.local = read.monitor_fault
        return self.channel.agree(read.monitor_fault, read.bad_ranks, "hook records")

    def vet(self, step: int, after_update: bool, magnitudes: Magnitudes | None = None) -> Vetting:
        """The parameter and optimizer-state check (read here, or ``magnitudes`` read
        with the step), against the last snapshot's magnitudes."""
        return self.locator.check.vet(
            step,
            previous_amax=self.keeper.amax,
            after_update=after_update,
            read=magnitudes if magnitudes is not None and magnitudes[0] else None,
            checked_at=self.keeper.vouched_step,
        )

    def _spike_reproduces(self, spike: str, closures: Sequence[Closure]) -> bool | None:
        """Replay a spike's step (Megatron-LM's rerun does): None when it cannot be
        (no closure, watch="off", or under torch.distributed, where every rank must
        take the same decision); else whether the replay spikes too."""
        if not closures or self.watch == "off" or self.channel.distributed:
            return None
        loss, norm = self.locator.replay_values(closures)
        if spike == "loss_spike":
            assert self.spike_watch.loss is not None
            return self.spike_watch.loss.would_spike(loss)
        assert self.spike_watch.grad_norm is not None
        return self.spike_watch.grad_norm.would_spike(norm)
