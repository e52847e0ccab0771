"""What :class:`~lightning_pulse.StabilityGuard` does between its detector, policy and snapshots. No trainer.

* :func:`make_detector` and :func:`make_policy`: the guard's arguments and config, validated by the objects.
* :func:`judge_step`: the one decision of an optimizer step, from the detector's verdict to the policy's
  action (with the cause of a non-finite step).
* :func:`loss_spiked`, :func:`spike_reproduced` and :func:`rollback_test`: the rollback test's rule (does the
  flagged batch spike at a snapshot's weights too?).
* :func:`snapshot_extra` and :func:`restore_books`: the bookkeeping a snapshot carries and a rollback
  returns to (the detector's windows, the policy's lineage, the module's carried tensors).
* :func:`guard_metrics` and the ``*_message`` functions: the figures logged under ``stability/`` and the
  texts the guard prints.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from lightning_pulse.core.carried_state import carried_tensors, restore_carried_tensors
from lightning_pulse.core.fault_origin import describe_bad_samples
from lightning_pulse.core.snapshots import SnapshotSchedule, TrainingSnapshot
from lightning_pulse.core.spike_detection import SpikeDetector, Verdict
from lightning_pulse.core.stability_policy import Action, EscalationPolicy, StabilityGuardConfig
from lightning_pulse.errors import PulseRefusal
from lightning_pulse.phase import Phase, PhaseChange

NONFINITE = (Verdict.NONFINITE_LOSS, Verdict.NONFINITE_GRAD)


def make_detector(
    config: StabilityGuardConfig,
    loss_zscore: float | None,
    grad_norm_zscore: float | None,
    window: int,
    warmup: int,
) -> SpikeDetector:
    return SpikeDetector(loss_zscore, grad_norm_zscore, window, warmup, config.min_ratio, config.loss_scale)


def make_policy(
    config: StabilityGuardConfig, rollback_after: int, skip_after_rollback: int, max_rollbacks: int
) -> EscalationPolicy:
    return EscalationPolicy(
        rollback_after,
        config.spike_memory,
        skip_after_rollback,
        max_rollbacks,
        config.rollback_memory,
        config.lr_cooldown_steps,
    )


def refuse_manual_optimization(module: Any) -> None:
    """Raise :class:`~lightning_pulse.errors.PulseRefusal` for a module that runs its own optimizer."""
    if not module.automatic_optimization:
        raise PulseRefusal(
            "StabilityGuard supports automatic optimization only; this module sets "
            "`automatic_optimization = False`. Let Lightning run the optimizer (return the loss from "
            "`training_step`), or remove StabilityGuard from the callbacks."
        )


def judge_step(
    detector: SpikeDetector,
    policy: EscalationPolicy,
    step: int,
    loss: float | None,
    grad_norm: float | None,
    key: str,
    trace_cause: Callable[[], str | None],
    rollback_helps: Callable[[Verdict], bool] | None = None,
) -> tuple[Verdict, Action, str | None, bool]:
    """Judge one optimizer step and decide its action.

    ``trace_cause`` is called only for a non-finite step (where it came from, see
    :func:`~lightning_pulse.core.fault_origin.trace_nonfinite`); ``rollback_helps(verdict)`` only when the step
    would roll back or stop (see :meth:`EscalationPolicy.decide`). Returns ``(verdict, action, cause,
    newly_unjudged)``; ``newly_unjudged`` is true at the first loss a log scale cannot judge (warn once).
    """
    unjudged_before = detector.unjudged_losses
    verdict = detector.assess(loss, grad_norm, key, accept=True).verdict
    cause = trace_cause() if verdict in NONFINITE else None
    newly_unjudged = not unjudged_before and detector.unjudged_losses > 0
    helps = None if rollback_helps is None else lambda: rollback_helps(verdict)
    return verdict, policy.decide(step, verdict, cause, helps), cause, newly_unjudged


#: the verdicts whose loss spiked: the rollback test compares losses at the snapshot
LOSS_VERDICTS = frozenset({Verdict.LOSS_SPIKE, Verdict.NONFINITE_LOSS})


def loss_spiked(verdict: Verdict, loss: float | None, median: float | None, min_ratio: float) -> bool:
    """Whether a flagged step's loss is abnormal, so that losses at a snapshot can tell whether a rollback helps:
    a loss verdict, or a gradient-norm spike whose loss is at least ``min_ratio`` squared times the baseline
    median (a data spike flagged for its gradient first). A gradient spike with an ordinary loss is not."""
    if verdict in LOSS_VERDICTS:
        return True
    return loss is not None and median is not None and loss >= min_ratio**2 * median


#: how far below its loss now a flagged batch's loss at the snapshot may be and still count as the same spike
SAME_SPIKE_FACTOR = 4.0


def spike_reproduced(
    flagged_then: float, reference_then: float, flagged_now: float, min_ratio: float
) -> bool:
    """Whether a flagged batch spikes on an earlier state (the snapshot a rollback would return to) as it
    spikes now: then a rollback cannot help.

    ``flagged_then`` and ``reference_then`` are the losses of the flagged batch and of an ordinary recent batch
    at that state, ``flagged_now`` the flagged loss now. Reproduced: the batch's loss there is within
    :data:`SAME_SPIKE_FACTOR` of its loss now, and above the ordinary batch's by ``min_ratio`` squared (so an
    untrained snapshot, on which every loss is high, does not count). A merely harder batch (a rare class on a
    well-trained model) is not: damage since the snapshot shows as a loss now many times the loss there. A
    non-finite loss there, next to a finite ordinary one, is reproduced; a non-finite loss now with a finite
    one there is not. Anything that cannot be compared (a non-positive or non-finite reference) is not.
    """
    if not math.isfinite(reference_then) or reference_then <= 0:
        return False
    if not math.isfinite(flagged_then):
        return True
    if not math.isfinite(flagged_now) or flagged_then <= 0:
        return False
    return flagged_then * SAME_SPIKE_FACTOR >= flagged_now and flagged_then >= min_ratio**2 * reference_then


def rollback_test(
    targets: Sequence[TrainingSnapshot],
    losses_at: Callable[[TrainingSnapshot], tuple[float, float]],
    flagged_now: float,
    min_ratio: float,
) -> tuple[bool, int | None]:
    """The rollback test over the snapshots a rollback could return to, newest first: ``(True, its step)`` for
    the first one on which the flagged batch does not spike (:func:`spike_reproduced` is false), so the rollback
    goes there; ``(False, None)`` when it spikes on every one (the data's fault: skip, do not roll back);
    ``(True, None)`` with no snapshot (nothing to test: escalate as before). ``losses_at(target)`` gives the
    flagged and the ordinary batch's losses at ``target``'s weights."""
    if not targets:
        return True, None
    for target in targets:
        flagged, reference = losses_at(target)
        if not spike_reproduced(flagged, reference, flagged_now, min_ratio):
            return True, target.step
    return False, None


def rollback_testable(
    detector: SpikeDetector, key: str, verdict: Verdict, loss: float | None, has_reference: bool, caches: bool
) -> bool:
    """Whether the rollback test can tell anything: a loss that spiked (:func:`loss_spiked`), an ordinary
    applied batch to compare with (``has_reference``), a log loss scale, and no activation cache that a
    forward would fill (``caches``: GradientCache's). A gradient-norm spike with an ordinary loss is not."""
    median = detector.baseline(key)["loss"]
    return (
        loss is not None
        and loss_spiked(verdict, loss, median, detector.min_ratio)
        and has_reference
        and detector.loss_scale == "log"
        and not caches
    )


def snapshot_extra(detector: SpikeDetector, policy: EscalationPolicy, module: nn.Module) -> dict[str, Any]:
    """The bookkeeping a snapshot holds besides the training state, for :func:`restore_books`."""
    return {"detector": detector.state_dict(), "carried": carried_tensors(module), **policy.lineage()}


def restore_books(
    target: TrainingSnapshot | None,
    predates: bool,
    incident_start: int | None,
    detector: SpikeDetector,
    policy: EscalationPolicy,
    module: nn.Module,
    warn: Callable[[str], Any],
) -> int:
    """After :meth:`~lightning_pulse.core.snapshots.SnapshotSchedule.roll_back` restored ``target`` (``None``:
    none fitted), return the detector, the carried tensors and the policy's books to it; the steps undone."""
    if target is None:
        warn("StabilityGuard: no snapshot fits the model any more; the parameters stay as they are.")
        return 0
    if not predates:
        warn(f"StabilityGuard: no snapshot predates step {incident_start} enough; using the oldest one.")
    detector.load_state_dict(target.extra["detector"])
    restore_carried_tensors(module, target.extra.get("carried", {}))
    return policy.rewind(target.extra)


def guard_metrics(policy: EscalationPolicy, with_energy: bool) -> dict[str, float]:
    """The stability figures logged under ``stability/`` (wasted energy only ``with_energy``)."""
    spikes = policy.spikes_by_kind
    out = {
        "stability/spikes": float(sum(spikes.values())),
        "stability/steps_skipped": float(policy.steps_skipped),
        "stability/bad_batches": float(policy.bad_batches),
        "stability/recurring_spikes": float(policy.recurring_spikes),
        "stability/rollbacks": float(policy.rollbacks),
        "stability/steps_lost": float(policy.steps_skipped + policy.steps_undone),
        **{f"stability/spikes_{kind}": float(n) for kind, n in spikes.items()},
    }
    if with_energy:
        out["stability/energy_wasted_kwh"] = policy.energy_wasted_kwh
    return out


def return_to_snapshot(
    schedule: SnapshotSchedule,
    detector: SpikeDetector,
    policy: EscalationPolicy,
    config: StabilityGuardConfig,
    module: nn.Module,
    state: tuple[Sequence[Any], Sequence[Any], Mapping[str, Any]],
    step: int,
    tested_to: int | None,
    warn: Callable[[str], Any],
) -> tuple[TrainingSnapshot | None, int]:
    """Restore the newest snapshot taken ``rollback_margin`` steps before the incident (before the first
    flagged step, or ``step``; when the rollback test found that snapshot damaged too, before the one it chose,
    ``tested_to``), with ``state`` (optimizers, LR schedulers, rollback-aware callbacks) and the books
    (:func:`restore_books`). Returns the snapshot (``None``: none fits) and the applied steps undone."""
    start = policy.incident_start
    if tested_to is not None:
        start = tested_to + schedule.margin
    target, predates = schedule.roll_back(
        step if start is None else start, module, *state, config.rewind_lr_schedule
    )
    return target, restore_books(target, predates, start, detector, policy, module, warn)


def maintain_snapshot_wanted(
    config: StabilityGuardConfig, change: PhaseChange, probe: Mapping[str, float], healthy: bool
) -> bool:
    """Whether a phase change asks for a snapshot: a maintain phase begins (not a resume) in a healthy state
    with a finite probe, and ``config.snapshot_at_maintain``."""
    if not config.snapshot_at_maintain or change.current is not Phase.MAINTAIN or change.reason == "resume":
        return False
    return healthy and all(math.isfinite(value) for value in probe.values())


def stop_checkpoint_path(config: StabilityGuardConfig, root_dir: str, step: int) -> str:
    return config.stop_checkpoint_path or os.path.join(
        root_dir, "stability_guard", f"stopped-step={step}.ckpt"
    )


def guard_state_dict(
    detector: SpikeDetector, policy: EscalationPolicy, last_snapshot_step: int | None, bad_samples: list
) -> dict[str, Any]:
    return {
        "detector": detector.state_dict(),
        "policy": policy.state_dict(),
        "last_snapshot_step": last_snapshot_step,
        "bad_samples": bad_samples,
    }


def load_guard_state(
    state_dict: Mapping[str, Any], detector: SpikeDetector, policy: EscalationPolicy
) -> tuple[int | None, list[dict[str, Any]]]:
    """Load :func:`guard_state_dict`'s detector and policy; returns ``(last_snapshot_step, bad_samples)``."""
    detector.load_state_dict(state_dict["detector"])
    # checkpoints of earlier versions kept the counters next to the policy's state
    policy.load_state_dict({**state_dict, **state_dict["policy"]})
    last = state_dict["last_snapshot_step"]
    samples = [dict(sample) for sample in state_dict.get("bad_samples", [])]
    return (None if last is None else int(last)), samples


def fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def unjudged_loss_message(loss: float | None) -> str:
    return (
        f"StabilityGuard: the loss is {fmt(loss)} <= 0, which a log scale cannot judge; loss spikes go "
        "unnoticed. Pass `config=StabilityGuardConfig(loss_scale='linear')` for such losses."
    )


def flag_message(
    step: int,
    verdict: Verdict,
    action: Action,
    loss: float | None,
    grad_norm: float | None,
    key: str,
    detector: SpikeDetector,
) -> str:
    baseline = detector.baseline(key)
    return (
        f"StabilityGuard: step {step} flagged as {verdict} (loss={fmt(loss)}, grad_norm={fmt(grad_norm)}; "
        f"{key} medians loss={fmt(baseline['loss'])}, grad_norm={fmt(baseline['grad_norm'])}); "
        f"action: {action}."
    )


def data_fault_message(step: int, samples: list[dict[str, Any]]) -> str:
    return (
        f"StabilityGuard: step {step} has non-finite values in its data ({describe_bad_samples(samples)}); "
        "the model is healthy, so the step is skipped and training goes on. Later such steps are skipped "
        "silently: see `StabilityGuard.bad_samples` and the `stability/bad_batches` counter."
    )


def rollback_message(policy: EscalationPolicy, step: int, to_step: int | None, undone: int) -> str:
    return (
        f"StabilityGuard: rollback {policy.rollbacks} at step {step} to the snapshot of step {to_step} "
        f"({undone} applied step(s) undone); skipping the next {policy.skip_remaining} batch(es)."
    )


def stop_message(
    policy: EscalationPolicy, step: int, to_step: int | None, recent_rollbacks: int, path: str
) -> str:
    flagged = [str(e["step"]) for e in policy.events if e["event"] not in ("rollback", "stop")][-8:]
    holds = (
        f"the snapshot of step {to_step}" if to_step is not None else "the current state (no snapshot fitted)"
    )
    return (
        f"StabilityGuard stopped training at step {step}: spikes kept coming after {recent_rollbacks} "
        f"rollback(s) within {policy.rollback_memory} steps "
        f"(`max_rollbacks`={policy.max_rollbacks}). The checkpoint {path!r} holds {holds}. Inspect the data "
        f"around the flagged steps (last: {', '.join(flagged)}): spikes whose batch the snapshot reproduced were "
        "skipped as the data's, so these came from the model, or were gradient-norm spikes with an ordinary loss, "
        "which are not tested that way; data with many bad samples can do it too (then clean it, or raise `rollback_after`). To "
        "train on with a lower learning rate, load the weights into a new run (YourModule.load_from_checkpoint("
        "path), then trainer.fit): resuming with ckpt_path restores the optimizer's learning rate and the "
        "guard's rollback count too."
    )


def summary_message(policy: EscalationPolicy) -> str | None:
    """The end-of-training line, or ``None`` for a run without spikes or rollbacks."""
    spikes = sum(policy.spikes_by_kind.values())
    if not spikes and not policy.rollbacks:
        return None
    lost = policy.steps_skipped + policy.steps_undone
    recurring = (
        f" ({policy.recurring_spikes} recurring: their batches spiked on the rollback's snapshot too, so they "
        "were skipped, not rolled back)"
        if policy.recurring_spikes
        else ""
    )
    return (
        f"StabilityGuard: {spikes} spike(s){recurring}, {policy.steps_skipped} step(s) skipped, "
        f"{policy.rollbacks} rollback(s), {lost} step(s) of work lost."
    )
