"""What :class:`~lightning_pulse.StabilityGuard` does between its detector, policy and snapshots. No trainer.

* :class:`StabilityCore`: the guard's algorithm as one object, built from its arguments: the decision of an
  optimizer step, the rollback test, snapshots with their books and the return to one, its checkpointed state.
* :func:`state_tensors`: the tensors a snapshot returns to, by name (screened before each snapshot).
* :class:`StepRecord`: the current optimizer step's micro-batches, losses and action, between the guard's hooks.
* :class:`FlaggedStep`: a flagged step with what its checks read from the trainer
  (:func:`caches_activations`).
* :func:`loss_spiked`, :func:`spike_reproduced`, :func:`spike_hidden` and :func:`rollback_test`: the rollback
  test's rule (does the flagged batch spike at a snapshot's weights too?).
* :func:`guard_metrics`, :func:`guard_figure` and the ``*_message`` functions: the figures logged under
  ``stability/`` and read from the guard, and the texts the guard prints.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pulse.core.carried_state import carried_tensors, kept_carried_state, restore_carried_tensors
from lightning_pulse.core.fault_origin import (
    LossesOf,
    describe_bad_samples,
    finite_evidence,
    forward_state_tensors,
    newly_nonfinite,
    nonfinite_forward_state,
    trace_nonfinite,
)
from lightning_pulse.core.loss_direction import maximizes_loss  # the guard's reading, at train start
from lightning_pulse.core.schedule_replay import ScheduleReplay
from lightning_pulse.core.selection import containers_copied
from lightning_pulse.core.snapshots import (
    PreStepBuffers,
    SnapshotSchedule,
    StateCopyError,
    TrainingSnapshot,
    fingerprints,
    fitted_state,
    is_zero_redundancy,
    nonfinite_tensors,
    optimizer_parameter_ids,
    snapshot_from_state,
    snapshot_state,
    written_outside,
)
from lightning_pulse.core.spike_detection import POOLED, Clearing, SpikeDetector, Verdict
from lightning_pulse.core.stability_policy import (
    Action,
    EscalationPolicy,
    RecurringLevel,
    StabilityGuardConfig,
    StepChanges,
)
from lightning_pulse.errors import (
    PulseRefusal,
    StabilityGuardError,
    as_config,
    first_names,
    unwritable_dir_reason,
)
from lightning_pulse.phase import Phase, PhaseChange

NONFINITE = (Verdict.NONFINITE_LOSS, Verdict.NONFINITE_GRAD)

_CPU_GENERATOR = (
    torch.default_generator
)  # read at every micro-batch (StepRecord.entered): no lookup each time


#: why StabilityGuard refuses a sharded strategy (:func:`~lightning_pulse.errors.refuse_sharded_strategy`)
SHARDED_REASON = (
    "each rank holds a shard of the parameters and gradients, so its gradient norm, snapshots and rollbacks "
    "would be a shard's, not the model's"
)


def refuse_unconsolidated_optimizers(optimizers: Sequence[Any]) -> None:
    """Raise :class:`~lightning_pulse.errors.PulseRefusal` for an optimizer whose state each rank holds a
    shard of (torch's ``ZeroRedundancyOptimizer``): its ``state_dict()`` raises until a collective
    ``consolidate_state_dict`` gathered it on one rank, so there is no per-rank state to snapshot and
    restore."""
    for optimizer in optimizers:
        if is_zero_redundancy(optimizer):
            raise PulseRefusal(
                "StabilityGuard does not support torch's ZeroRedundancyOptimizer: each rank holds a shard "
                "of the optimizer state, whose `state_dict()` needs a collective consolidation onto one "
                "rank, so snapshots and rollbacks have no state of the rank to keep and restore. Use the "
                "optimizer it wraps (e.g. `torch.optim.Adam`) under strategy='ddp', or remove "
                "StabilityGuard from the callbacks."
            )


#: how the guard's messages name the value it judges, and what they say of it, where the optimizers maximize
#: the loss (:func:`maximizes_loss`)
MAXIMIZED_LOSS = "-loss"
MAXIMIZED_WHY = "the loss negated, since the optimizer runs with `maximize=True`"


ANOMALY_DETECTION_WARNING = (
    "StabilityGuard: `Trainer(detect_anomaly=True)` raises at the first NaN in backward, before the guard "
    "reads the step, so a non-finite step stops the run instead of being skipped (loss and gradient-norm "
    "spikes are still caught). Turn `detect_anomaly` off to let the guard skip non-finite steps."
)


def warn_of_anomaly_detection(warn: Callable[[str], Any]) -> None:
    """Say :data:`ANOMALY_DETECTION_WARNING` through ``warn`` where torch's anomaly detection is on (Lightning
    enables it around the fit loop, after ``setup``: read at train start)."""
    if torch.is_anomaly_enabled():
        warn(ANOMALY_DETECTION_WARNING)


def warn_of_converted_baselines(detector: SpikeDetector, warn: Callable[[str], Any]) -> None:
    """Say through ``warn`` how the baselines of a checkpoint saved with another ``loss_scale`` or
    ``per_phase_baselines`` were converted (:attr:`SpikeDetector.converted`); at train start, once a fit."""
    converted, detector.converted = detector.converted, {}
    if "loss_scale" in converted:
        saved, own = converted["loss_scale"]
        how = (
            "the exponential of each value"
            if own == "linear"
            else "the log of each value; a log scale leaves values <= 0 out"
        )
        warn(
            f"StabilityGuard: this fit's `config.loss_scale`={own!r} differs from the checkpoint's "
            f"{saved!r}; the restored loss baselines were converted to {own!r} ({how}) and judge from the "
            f"first step, as in a run on {own!r} throughout. Pass "
            f"`config=StabilityGuardConfig(loss_scale={saved!r})` to keep the checkpoint's scale."
        )
    if "samples_per_step" in converted:
        saved, own = converted["samples_per_step"]
        warn(
            f"StabilityGuard: this fit trains {own} samples per optimizer step (batch size x "
            f"accumulate_grad_batches x processes) and the checkpoint's baselines were measured at {saved}; the "
            "gradient norm's noise scales with it, so the restored gradient-norm baselines were dropped and fill "
            f"again over the next {detector.warmup} accepted steps, as in a fresh run (the loss baselines are "
            "kept; non-finite steps are caught meanwhile). Resume with the checkpoint's batch size, "
            "accumulation and number of processes to keep them."
        )
    if "samples_unread" in converted:
        saved, _ = converted["samples_unread"]
        warn(
            "StabilityGuard: the samples this fit trains per optimizer step could not be read (its "
            "training DataLoader states no `batch_size` and the first batch's size could not be read from "
            f"its tensors), so the checkpoint's gradient-norm baselines, measured at {saved} samples per "
            "step, were kept. If this fit trains fewer samples a step, healthy steps may be flagged until "
            "they adapt: give the DataLoader (or its batch sampler) a `batch_size` attribute, or resume with "
            "the checkpoint's batch size, accumulation and number of processes."
        )
    if "main_key" in converted:
        saved, own = (key == "burst" for key in converted["main_key"])
        how = (
            "one baseline now serves the burst phase (every step without a PulseCycle) and judges from the "
            "first step; other phases warm up against it, as in a fresh run"
            if own
            else "pooled window of every step (its pulse phases' baselines merged, where its run had a "
            "PulseCycle) now serves as the one baseline and judges from the first step"
        )
        warn(
            f"StabilityGuard: this fit's `config.per_phase_baselines`={own} differs from the checkpoint's "
            f"{saved}; the checkpoint's {how}. Pass "
            f"`config=StabilityGuardConfig(per_phase_baselines={saved})` to keep the checkpoint's baselines."
        )


def refuse_manual_optimization(module: Any) -> None:
    """Raise :class:`~lightning_pulse.errors.PulseRefusal` for a module that runs its own optimizer."""
    if not module.automatic_optimization:
        raise PulseRefusal(
            "StabilityGuard supports automatic optimization only; this module sets "
            "`automatic_optimization = False`. Let Lightning run the optimizer (return the loss from "
            "`training_step`), or remove StabilityGuard from the callbacks."
        )


def moved_in_step(
    model: nn.Module, snapshot: TrainingSnapshot | None, step: int, among: set[str] | None = None
) -> list[str] | None:
    """The names of ``model``'s parameters (``among`` them, where given) that differ from ``snapshot``'s,
    taken at the start of ``step`` (before its first forward); ``None`` where no snapshot of that moment is
    held. A device-to-host copy of each parameter compared: once a fit, where no gradient reached the
    optimizer (:func:`refuse_update_in_backward`)."""
    if snapshot is None or snapshot.step != step:
        return None
    moved = []
    for name, param in model.named_parameters():
        if among is not None and name not in among:
            continue
        saved = snapshot.model.get(name)
        if isinstance(saved, Tensor) and saved.shape == param.shape and saved.dtype == param.dtype:
            if not torch.equal(saved, param.detach().cpu()):
                moved.append(name)
    return moved


def hooked_parameters(model: nn.Module) -> dict[str, Tensor]:
    """``model``'s parameters that carry a ``register_post_accumulate_grad_hook`` hook, by name."""
    # torch keeps those hooks in this attribute (no public reader); where a version drops it, none is found
    return {
        name: p for name, p in model.named_parameters() if getattr(p, "_post_accumulate_grad_hooks", None)
    }


class BackwardMoves:
    """The parameters with a post-accumulate-grad hook that moved inside a backward, over the backwards of the
    fit's first optimizer step with one (:func:`refuse_update_in_backward`'s evidence): each such parameter
    copied to the host at a micro-batch's ``on_before_backward`` (:meth:`before`) and compared at its
    ``on_after_backward`` (:meth:`after`). After the forward, not from the step's start: a parameter the
    forward writes (``nn.Embedding(max_norm=...)``, a learnable fake quantizer's scale) or a batch-start hook
    does (a max-norm constraint) moves outside backward, as does one a later micro-batch's forward writes
    between two backwards (a regression sweep: fits with gradient-logging hooks on such parameters were
    refused). The guard calls it only until that step is checked; which parameters carry such a hook is read
    once, at the first backward (a model without any copies nothing)."""

    def __init__(self) -> None:
        self.hooked: dict[str, Tensor] | None = None  # by name; ``None``: not read yet
        self.copies: list[Tensor] = []  # the hooked parameters' values before the current backward
        self.moved: list[str] = []  # in the order found, each once

    def before(self, model: nn.Module) -> None:
        """At a micro-batch's ``on_before_backward``: copy the hooked parameters' values."""
        if self.hooked is None:
            self.hooked = hooked_parameters(model)
        self.copies = [param.detach().to("cpu", copy=True) for param in self.hooked.values()]

    def after(self) -> None:
        """At the micro-batch's ``on_after_backward``: keep the names of those that moved since :meth:`before`
        (the same shape and dtype)."""
        copies, self.copies = self.copies, []
        if not copies or self.hooked is None:
            return
        for (name, param), saved in zip(self.hooked.items(), copies):
            if name not in self.moved and saved.shape == param.shape and saved.dtype == param.dtype:
                if not torch.equal(saved, param.detach().cpu()):
                    self.moved.append(name)

    def take(self, model: nn.Module) -> tuple[list[str], list[str]]:
        """The names of ``model``'s hooked parameters (read now where no backward read them) and of those
        found moved; forgotten here (the check reads them once)."""
        hooked = hooked_parameters(model) if self.hooked is None else self.hooked
        moved, self.hooked, self.copies, self.moved = self.moved, None, [], []
        return list(hooked), moved


def refuse_update_in_backward(
    step: int,
    grad_norm: float | None,
    model: nn.Module,
    snapshot: TrainingSnapshot | None,
    all_reduce_sum: Callable[[Tensor], Tensor] | None = None,
    backward: BackwardMoves | None = None,
) -> None:
    """Raise :class:`~lightning_pulse.errors.PulseRefusal` where the fit's first optimizer step with a
    backward shows that its update was made in backward (torch's optimizer-in-backward: per-parameter
    optimizers stepped by ``register_post_accumulate_grad_hook``), before ``optimizer.step()``, which is where
    the guard's skip and rollback within the step act: it would report skips of updates already made.

    Evidence: ``grad_norm`` ``None`` (every ``.grad`` of the optimizer is ``None``: the gradients went
    elsewhere; the guard could read no gradient norm, and nothing tells an update made with them from none;
    the parameters that changed since ``snapshot``, taken at the step's start, are named:
    :func:`moved_in_step`); or parameters with a post-accumulate hook that changed inside one of the step's
    backwards (``backward``, what the guard's hooks saw; without it, none), whatever the gradients (zeroed
    in place by the hook, or, under DDP, the averaged ones the reducer writes back after the hooks). A
    parameter a forward or a batch-start hook writes (``nn.Embedding(max_norm=...)``, a max-norm
    constraint) moves outside backward: not evidence, with a hook or without. Once a fit; a comparison only
    where such a hook exists, so ordinary runs pay a pass over the parameters' hook dicts. Under DDP the
    gradients, hence the norm, are alike on every rank, and the moved parameters are summed over the ranks
    (``all_reduce_sum``), so every rank refuses or none."""
    hooked, moved_in_backward = (hooked_parameters(model), []) if backward is None else backward.take(model)
    if grad_norm is not None and not hooked:
        return
    if grad_norm is None:
        moved = moved_in_step(model, snapshot, step)
    else:  # the gradients reached the optimizer: refused only on evidence of an update in backward
        moved = moved_in_backward
        count = torch.tensor(float(len(moved)), device=next(model.parameters()).device)
        if (count.item() if all_reduce_sum is None else all_reduce_sum(count).item()) == 0:
            return
    seen = (
        "no parameter of its optimizer holds a gradient (every `.grad` is None; or the optimizer holds none "
        "of the parameters the loss reaches)"
        if grad_norm is None
        else "every gradient of its optimizer is zero"
        if grad_norm == 0.0
        else "parameters with a `register_post_accumulate_grad_hook` hook moved inside backward"
    )
    where = f"; {first_names(moved, 4)} changed before `optimizer.step()`" if moved else ""
    raise PulseRefusal(
        f"StabilityGuard cannot guard this fit: at its first optimizer step (step {step}) the loss was "
        f"backpropagated, but {seen}{where}. The update was made in backward: an optimizer stepped by "
        "`register_post_accumulate_grad_hook` (optimizer-in-backward), or a hook that consumes the "
        "gradients. The guard cannot read the norm of the gradients that made the update, and a skip or "
        "rollback within the step cannot undo an update made in backward: it would report skips that never "
        "happened. Step the optimizers in `optimizer.step()` "
        "(return them from `configure_optimizers` and let Lightning's automatic optimization run them), "
        "or remove StabilityGuard from the callbacks."
    )


#: non-finite steps in a row (no applied step between) presumed the data's fault without a check (their loss
#: could not be recomputed without the bad rows), after which each next one, until a step applies, is the
#: data's only if its batch is non-finite on the snapshot a rollback would return to as well (the rollback
#: test, one forward at the snapshot's weights), else the model's. With a quarter of the batches bad, 8 in a
#: row come once in 65,000 steps; with most bad (one corrupt sample in 40, batches of 64: 80%), every few
#: dozen steps, and the test keeps them skipped. Waiting costs a broken model only these skipped steps;
#: presuming for ever would leave a model whose data holds NaN on purpose unguarded.
UNCHECKED_DATA_FAULTS = 8

#: non-finite steps in a row past :data:`UNCHECKED_DATA_FAULTS` that a snapshot test may still call the
#: data's; the next is the model's (:attr:`StabilityCore.tests_data_at_snapshot`). Their batches were bad at
#: the snapshot too, so this only stops an unbroken row from going on for ever with no step applied.
RECURRING_DATA_FAULTS = 8


#: the verdicts whose loss spiked: the rollback test compares losses at the snapshot
LOSS_VERDICTS = frozenset({Verdict.LOSS_SPIKE, Verdict.NONFINITE_LOSS})


def _holds_the_weights(model: nn.Module, snapshots: Sequence[TrainingSnapshot]) -> bool:
    """Whether each of ``snapshots`` holds ``model``'s parameters as they are, bit for bit (a rare step only:
    each parameter copied to the CPU in turn, up to the first that differs)."""
    for name, param in model.named_parameters():
        value = param.detach().cpu()
        if not all(name in s.model and torch.equal(value, s.model[name]) for s in snapshots):
            return False
    return True


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


def spike_hidden(
    flagged_then: float, reference_then: float, reference_trained: float, flagged_now: float, min_ratio: float
) -> bool:
    """Whether a flagged batch does not stand out at an older snapshot only because every loss is high there,
    so that snapshot cannot tell whether a rollback helps: the ordinary batch's loss there is at least
    ``min_ratio`` times its loss ``reference_trained`` on a newer snapshot that reproduced the spike, and
    judged against that trained loss the batch spikes there as it spikes now (:func:`spike_reproduced`).
    The fit's untrained start: a shard of wrong labels gave 4.10 against an ordinary batch's 0.66 at the
    step-100 snapshot (reproduced) and 2.306 against 2.316 at step 0, where a rollback undid 203 applied
    steps. A healthy older snapshot, where the batch is ordinary and so is every loss, is not hidden: damage
    that began before the newest snapshot is still rolled back to it."""
    if not math.isfinite(reference_then) or reference_then < min_ratio * reference_trained:
        return False
    return spike_reproduced(flagged_then, reference_trained, flagged_now, min_ratio)


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
    flagged and the ordinary batch's losses at ``target``'s weights. Once a newer snapshot reproduced the
    spike, an older one where the batch does not stand out only because every loss is high there
    (:func:`spike_hidden`, against the lowest ordinary loss of those that reproduced it) tells nothing and is
    no target: with none other, the spike is the data's."""
    if not targets:
        return True, None
    trained: float | None = None  # the ordinary batch's lowest loss on a snapshot that reproduced the spike
    for target in targets:
        flagged, reference = losses_at(target)
        if spike_reproduced(flagged, reference, flagged_now, min_ratio):
            trained = reference if trained is None else min(trained, reference)
        elif trained is None or not spike_hidden(flagged, reference, trained, flagged_now, min_ratio):
            return True, target.step
    return False, None


def _negated(
    losses_at: Callable[[TrainingSnapshot], tuple[float, float]],
) -> Callable[[TrainingSnapshot], tuple[float, float]]:
    """``losses_at`` giving the negated losses: judged as the step's loss of a maximizing optimizer is."""

    def negated(target: TrainingSnapshot) -> tuple[float, float]:
        flagged, reference = losses_at(target)
        return -flagged, -reference

    return negated


def state_tensors(
    model: nn.Module, optimizers: Sequence[Any], carried: Mapping[str, Any]
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The tensors a snapshot returns to, by name, in two parts: what training writes (the parameters, and
    each optimizer-state tensor as ``"exp_avg of layer.weight"``, or ``"exp_avg of parameter 3 of optimizer 0
    (outside the model)"``), and what a forward writes (the buffers, and the ``carried`` tensors of
    :func:`~lightning_pulse.core.carried_state.carried_tensors`)."""
    trained: dict[str, Tensor] = dict(model.named_parameters())
    names = {id(param): name for name, param in trained.items()}
    for index, optimizer in enumerate(optimizers):
        which = f" in optimizer {index}" if index else ""
        grouped = (param for group in optimizer.param_groups for param in group["params"])
        for position, param in enumerate(grouped):
            owner = (
                names[id(param)] + which
                if id(param) in names
                else f"parameter {position} of optimizer {index} (outside the model)"
            )
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, Tensor):
                    trained[f"{key} of {owner}"] = value
    return trained, current_forward_state(model, carried)


def updated_to_nan(model: nn.Module, optimizers: Sequence[Any]) -> list[str]:
    """The parameters ``optimizers`` update, and their optimizer-state tensors, that hold a NaN (named as
    :func:`state_tensors` names them): what only an optimizer step writes. Parameters outside the optimizers
    (an EMA codebook a forward writes) are left out. Read at a flagged step only."""
    trained, _ = state_tensors(model, optimizers, {})
    held = {
        id(param) for optimizer in optimizers for group in optimizer.param_groups for param in group["params"]
    }
    updated = {name: t for name, t in trained.items() if not isinstance(t, nn.Parameter) or id(t) in held}
    return nonfinite_tensors({}, nan_only=updated)


def current_forward_state(model: nn.Module, carried: Mapping[str, Any] | None = None) -> dict[str, Tensor]:
    """``model``'s buffers and carried tensors (``carried``, when already read) as
    :func:`~lightning_pulse.core.fault_origin.forward_state_tensors` names them."""
    return forward_state_tensors(
        dict(model.named_buffers()), carried_tensors(model) if carried is None else carried
    )


def _saved_forward_state(snapshot: TrainingSnapshot, model: nn.Module) -> dict[str, Tensor]:
    """``snapshot``'s copies of ``model``'s buffers and carried tensors, named by
    :func:`~lightning_pulse.core.fault_origin.forward_state_tensors`."""
    saved = {**snapshot.model, **snapshot.buffers}
    buffers = {name: saved[name] for name, _ in model.named_buffers() if name in saved}
    return forward_state_tensors(buffers, snapshot.extra.get("carried", {}))


def _saved_under_current_names(snapshot: TrainingSnapshot, model: nn.Module) -> dict[str, Any]:
    """``snapshot``'s parameters and buffers under the names ``model`` holds them by now (the snapshot fits
    it): a layer unstructured-pruned since holds the saved ``weight`` as ``weight_orig``, as a rollback loads
    it (:func:`~lightning_pulse.core.snapshots.fitted_state`). Its ``weight`` is then a plain attribute the
    pruning hook recomputes, no parameter to copy into (a mend after a rollback to a snapshot from before the
    first prune raised ``KeyError: 'weight'``)."""
    return {**(fitted_state(snapshot.model, model.state_dict()) or {}), **snapshot.buffers}


def _made_bad(model: nn.Module, evidence: Mapping[str, Tensor]) -> list[str]:
    """What a forward made bad (:func:`~lightning_pulse.core.fault_origin.nonfinite_forward_state`), and the
    parameters holding a NaN or an infinity: asked after a data fault's verdict, which the model's own
    weights would have made the state's, only those a forward writes (an EMA codebook) can."""
    return nonfinite_forward_state(model, evidence) + nonfinite_tensors(dict(model.named_parameters()))


def _parameter_or_buffer(model: nn.Module, name: str) -> Tensor:
    owner, _, key = name.rpartition(".")
    module = model.get_submodule(owner)
    return module._parameters[key] if key in module._parameters else module._buffers[key]


#: the newest snapshot that fits the model (or ``None``) and its forward state as evidence about infinities
#: (:meth:`StabilityCore.saved_forward_state`)
SavedForwardState = tuple[TrainingSnapshot | None, dict[str, Tensor]]


#: the random generator states a micro-batch's ``training_step`` drew from: ``(generator, state)`` pairs, the
#: CPU's default generator and, for a module on a GPU, that device's (:meth:`StepRecord.entered`)
DrawnState = tuple[tuple[torch.Generator, Tensor], ...]


def cuda_generator_of(device: torch.device | str | None) -> torch.Generator | None:
    """The default CUDA generator of ``device`` (a module's), which its ``training_step`` draws from on the
    GPU (dropout, ``torch.randn(..., device=...)``); ``None`` off CUDA."""
    if device is None or torch.device(device).type != "cuda":
        return None
    torch.cuda.init()  # fills torch.cuda.default_generators; a no-op once CUDA is up (a module on it)
    index = torch.device(device).index
    return torch.cuda.default_generators[torch.cuda.current_device() if index is None else index]


class StepRecord:
    """What the guard keeps of the current optimizer step from its first micro-batch to its batch end: the
    micro-batches (as their ``training_step`` got them: :meth:`entered`),
    the random generator states each one's ``training_step`` drew from, their losses, the step's loss and
    baseline key while it is judged, and its action once decided; and the last applied step's micro-batches
    and states, the ordinary batch of the rollback test. ``cut``: a callback that cuts batches in place
    (``HardSampleReplay``), which tells the dataset indices of the rows it kept (``trained_indices``).
    ``device``: the module's, whose CUDA generator is recorded too. ``logs``: what the step logs into the
    epoch's figures (``compat.SkippedStepLogs``): held at its first micro-batch, taken out at the batch end of
    a step whose update is dropped. ``buffers``: the tensors forwards write (:class:`PreStepBuffers`), copied
    before the step's first forward (:meth:`add`)."""

    def __init__(
        self,
        cut: Any = None,
        device: torch.device | str | None = None,
        logs: Any = None,
        buffers: PreStepBuffers | None = None,
    ) -> None:
        self.losses: list[Any] = []  # the micro-batch losses of the current optimizer step
        # those the last closure evaluation read (:meth:`take_losses`), kept by reference: a flagged step's
        # rollback test reads each micro-batch's (FlaggedStep.highest_micro_batch)
        self.taken: list[Any] = []
        # and its micro-batches: by reference from the guard's batch start, their containers copied once
        # training_step is entered (what it received, before it pops entries: :meth:`entered`)
        self.batches: list[tuple[int, Any]] = []
        self.reference: list[tuple[int, Any]] = []  # the last applied step's micro-batches
        # batch_idx -> the generator states its training_step drew from (unique within an optimizer step),
        # for this step and the reference: a re-run of the batch draws what the step drew (the rollback test)
        self.drawn: dict[int, DrawnState] = {}
        self.reference_drawn: dict[int, DrawnState] = {}
        self.uncopied: set[type] = set()  # the batch classes a re-run found not to copy (probe.batch_copy)
        self._cuda = cuda_generator_of(device)
        # batch_idx -> the dataset indices of the samples it trained, where a callback cut it in place
        self.trained: dict[int, Tensor] = {}
        self.decided: Action | None = None  # the current optimizer step's action, until its batch end
        self.ended: tuple[int, Action] | None = None  # the last decided step's counter and action, once ended
        self.step_after = -1  # the counter the step in flight leaves (told with its losses)
        self.forced = False  # whether the last decided step was a forced skip (after a rollback)
        self.cut = cut
        # the loss of the step being judged (mean over the window and ranks) and its baseline key: what the
        # checks of a flagged step (FlaggedStep) read, while the step is judged
        self.loss: float | None = None
        self.key = ""
        self.evaluations = 0  # the closure evaluations of the current optimizer step so far
        # whether the optimizer evaluates the closure more than once a step (SAM, LBFGS), which applied steps
        # tell (``None`` before the first): then a later evaluation may still skip the step
        self.repeats: bool | None = None
        self.logs = logs
        self.buffers = buffers
        # the micro-batches so far that are a window which ended without an optimizer step, held until the
        # next micro-batch shows whether its gradients go on into this step (:meth:`settle`); 0: none
        self.ended_window = 0
        self._window_logs: Any = None  # the logged figures at that window's start (``logs.step_starts``)

    @classmethod
    def of_callbacks(
        cls,
        callbacks: Sequence[Any],
        cut_type: type,
        device: torch.device | str | None = None,
        logs: Any = None,
        buffers: PreStepBuffers | None = None,
    ) -> StepRecord:
        """The record of a fit with ``callbacks``: the first that is a ``cut_type`` (``HardSampleReplay``) is
        its ``cut``."""
        cut = next((callback for callback in callbacks if isinstance(callback, cut_type)), None)
        return cls(cut, device, logs, buffers)

    def add(self, batch_idx: int, batch: Any) -> None:
        """Keep a micro-batch at its batch start, by reference (until :meth:`entered`). An epoch's first batch
        opens a window: what a window left behind goes (a module's ``on_train_batch_start`` that returns -1
        ends the epoch inside a window, with no step), so the step is judged and re-run on its own batches.
        A window's first micro-batch copies what forwards write (``buffers``) and holds what was logged so far
        (``logs``); so does one after a window that ended without a step, that window's kept until
        :meth:`settle`."""
        if batch_idx == 0 and self.batches:
            self._let_go()
        if self.buffers is not None:
            self.buffers.before_step(self.batches, self.ended_window)
        self.batches.append((batch_idx, batch))
        # the step's first micro-batch, or the first after a window held (which may go on into the step)
        if len(self.batches) == self.ended_window + 1 and self.logs is not None:
            held = self.logs.step_starts()
            self._window_logs = held if self.ended_window else None

    def entered(self, batch: Any) -> None:
        """At ``training_step``'s entry, the batch it gets: after every batch-start hook (the guard's or not,
        the module's) and a cut in place, whatever they rebound, added or deleted. Kept with its containers
        copied (:func:`containers_copied`; its tensors shared), so entries the step pops or rebinds
        (``batch.pop("labels")``) stay as it got them. A container of the user's own that does not copy is
        kept by reference (measurement never kills a run).

        With it, at the first entry (a closure evaluated again draws on), the generator states its
        ``training_step`` draws from: here, not at the batch start, so a later hook's draw (a mixup callback's
        weight) is not replayed into the step's. Torch's own generators only: a state is a copy of ~5 KB (the
        CPU's Mersenne Twister) or 16 bytes (a GPU's Philox seed and offset), about a microsecond; numpy's and
        Python's cost 10-35 each, too much for every step, so a re-run draws new numbers from those."""
        if self.batches:
            batch_idx = self.batches[-1][0]
            try:  # not contextlib.suppress: a context manager a micro-batch costs more than the copy
                copied = containers_copied(batch)
            except Exception:
                copied = batch
            self.batches[-1] = (batch_idx, copied)
            if batch_idx not in self.drawn:
                cuda, cpu = self._cuda, (_CPU_GENERATOR, _CPU_GENERATOR.get_state())
                self.drawn[batch_idx] = (cpu,) if cuda is None else (cpu, (cuda, cuda.get_state()))

    def note_cut(self) -> None:
        """At the backward of the last micro-batch: the dataset indices of the samples it trained, where the
        cut callback chose them."""
        trained = self.cut.trained_indices  # a reference, no copy
        if trained is not None:
            self.trained[self.batches[-1][0]] = trained

    @property
    def drawn_states(self) -> tuple[dict[int, DrawnState], dict[int, DrawnState]]:
        """The generator states of this step's micro-batches and of the reference's, by ``batch_idx``."""
        return self.drawn, self.reference_drawn

    def take_losses(self, step_after: int = -1, optimizers: Sequence[Any] = ()) -> list[Any]:
        """The losses recorded since the last call (read at each closure evaluation, with the grad norm), for
        the step that leaves the counter at ``step_after`` (what :meth:`end` records). A window that ended
        without a step and is not settled yet (no backward since) is settled first, on ``optimizers``."""
        if self.ended_window:
            self.settle(optimizers)
        self.step_after = step_after
        losses, self.losses = self.losses, []
        self.taken = losses
        self.evaluations += 1
        return losses

    def end(self) -> Action | None:
        """At a batch end: the step's action, its micro-batches let go (an applied step's kept as the
        reference; a dropped step's logged values taken out of the epoch's figures, ``logs``); ``None`` inside
        an accumulation window (nothing decided yet)."""
        action, self.decided = self.decided, None
        if action is None:
            return None
        self.ended = (self.step_after, action)
        if action is Action.APPLY:
            self.reference = self.batches  # an ordinary batch, for the rollback test
            self.reference_drawn = self.drawn
            self.repeats = self.repeats or self.evaluations > 1
        elif self.logs is not None:  # dropped: what it logged leaves the epoch's figures
            self.logs.take_out()
        self.batches, self.drawn, self.trained, self.evaluations, self.ended_window = [], {}, {}, 0, 0
        return action

    def undoes(self, step: int, forced_skips: bool = True) -> bool:
        """Whether the update of the optimizer step that leaves the counter at ``step`` is dropped (skipped,
        undone by a rollback, or the run stops): the step in flight, decided with its batch end to come, or
        the one that ended at ``step`` (:class:`~lightning_pulse.protocols.StepUndoer`). Without
        ``forced_skips``, a skip after a rollback does not count: it drops a batch, not a diverged update (the
        weights are the rollback's snapshot's)."""
        if self.decided is not None and self.step_after == step:
            action = self.decided
        elif self.ended is not None and self.ended[0] == step:
            action = self.ended[1]
        else:
            return False
        return action is not Action.APPLY and (forced_skips or not self.forced)

    def applied(self, step: int) -> bool:
        """Whether the optimizer step that leaves the counter at ``step`` has ended, applied (its batch end
        is over: a change made now comes after the guard's snapshot of the step, if any)."""
        return self.decided is None and self.ended == (step, Action.APPLY)

    def drop_window(self, ended: bool, optimizers: Sequence[Any] | None = None) -> None:
        """At the end of a batch with nothing decided: where its accumulation window ``ended`` all the same (a
        module's ``optimizer_step`` ran the closure without ``optimizer.step``), its losses and micro-batches
        are let go, so that the next step is judged on its own window's losses only; with the ``optimizers``,
        only where the next micro-batch finds their gradients zeroed (:meth:`settle`). A window held so far
        that this batch did not settle (no backward) is settled now."""
        if self.ended_window and optimizers is not None:
            self.settle(optimizers)
        if ended and optimizers is None:
            self._let_go()
        elif ended:
            self.ended_window = len(self.batches)

    def settle(self, optimizers: Sequence[Any]) -> None:
        """At the first hook after the ``optimizer_zero_grad`` of the micro-batch after a window that ended
        without an optimizer step (its ``on_before_backward``; or its step, or batch end, without a backward):
        where the ``optimizers``' gradients still hold values (:func:`gradients_held`), that window's are in
        this step's update (gradient accumulation by hand: ``optimizer_zero_grad`` zeroing every Nth batch),
        and its losses, micro-batches, buffer copy and logged figures go on into this step, so the step is
        judged on the whole window and a check re-runs all its batches (a NaN in its first batch is the data's
        fault: it was kept in ``.grad`` while its loss and batch were let go, and the next step was blamed on
        the model). Else they are let go. The window's losses are all the record holds here."""
        ended, self.ended_window = self.ended_window, 0
        carried = gradients_held(optimizers)
        if self.buffers is not None:
            self.buffers.settle(carried)
        logs, self._window_logs = self._window_logs, None
        if carried:
            if logs is not None and self.logs is not None:
                self.logs.hold(logs)
            return
        for batch_idx, _ in self.batches[:ended]:
            self.drawn.pop(batch_idx, None)
            self.trained.pop(batch_idx, None)
        del self.batches[:ended]
        self.losses, self.evaluations = [], 0

    def _let_go(self) -> None:
        self.losses, self.batches, self.drawn, self.trained, self.evaluations = [], [], {}, {}, 0
        self.ended_window, self._window_logs = 0, None

    def decided_before_judging(self, policy: EscalationPolicy) -> Action | None:
        """The step's action where it needs no judging: a forced skip (one of the steps skipped after a
        rollback, :meth:`EscalationPolicy.forced_skip`), or the action decided already (LBFGS's later closure
        evaluations, trial points, are judged on the first); else ``None``. :attr:`forced` tells a forced
        skip at its batch end, whose forwards' writes the guard then sets back."""
        if self.decided is None:
            self.forced = policy.forced_skip()
            self.decided = Action.SKIP if self.forced else None
        return self.decided


def gradients_held(optimizers: Sequence[Any], most: int = 4) -> bool:
    """Whether the ``optimizers``' gradients hold values: a ``.grad`` not ``None`` and, among the first
    ``most`` such, one not all zero (``zero_grad(set_to_none=False)`` leaves zeros). Read only after a window
    that ended without an optimizer step (:meth:`StepRecord.settle`): a pass over the parameters and a
    device-to-host read per gradient read."""
    read = 0
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if (grad := param.grad) is None:
                    continue
                if bool((grad.coalesce().values() if grad.is_sparse else grad).any()):
                    return True
                read += 1
                if read >= most:
                    return False
    return False


def caches_activations(callbacks: Sequence[Any]) -> bool:
    """Whether a callback caches activations that a forward outside the loop would fill
    (``GradientCache``): the guard then runs no forward of its own."""
    return any(getattr(callback, "activations", None) is not None for callback in callbacks)


@dataclass
class FlaggedStep:
    """A flagged optimizer step with what its checks read from the trainer (read when a step is flagged, never
    on an ordinary one): where a non-finite step came from (:meth:`StabilityCore.nonfinite_cause`) and the
    rollback test (:meth:`StabilityCore.flagged_rollback_helps`). The step's micro-batches (what it trained,
    where a callback cut them), its loss (the same on every rank) and baseline key, and the last applied
    step's batches are its ``record``'s."""

    model: nn.Module
    step: int
    record: StepRecord
    optimizers: Sequence[Any]
    schedulers: Sequence[Any]
    loader: Any  # the train dataloader: the dataset indices of bad samples
    all_reduce_sum: Callable[[Tensor], Tensor] | None  # under DDP, else ``None``
    caches_activations: bool  # a forward outside the loop would fill a cache (:func:`caches_activations`)
    # the training losses of ``(batch_idx, batch)`` pairs at the current weights, autograd off (no graph is
    # built beside the step's held gradients); it may raise for a batch (StabilityCore.losses_for_a_check).
    # Each pair draws from the generator states its batch_idx drew from in this step (``record.drawn``)
    losses_of: LossesOf
    # the mean losses of two lists of ``(batch_idx, batch)`` pairs at a snapshot's weights
    # (:meth:`losses_at_snapshot`: the flagged and the ordinary batches), each pair drawing from the states it
    # drew from when it trained (``record.drawn_states``): a spike the step's own draws made (a diffusion
    # timestep, dropout) comes again, as the data's
    losses_at: Callable[[TrainingSnapshot, list[tuple[int, Any]], list[tuple[int, Any]]], tuple[float, float]]

    def losses_at_snapshot(
        self, target: TrainingSnapshot, batches: list[tuple[int, Any]] | None = None
    ) -> tuple[float, float]:
        """The mean losses of the step's micro-batches (or of ``batches``, some of them) and of the last
        applied step's (the ordinary batch) at ``target``'s weights."""
        return self.losses_at(
            target, self.record.batches if batches is None else batches, self.record.reference
        )

    @property
    def comparable(self) -> bool:
        """Whether the rollback test can compare: an ordinary applied batch, and no activation cache."""
        return bool(self.record.reference) and not self.caches_activations

    def highest_micro_batch(self, maximized: bool = False) -> tuple[float, tuple[int, Any]] | None:
        """Under gradient accumulation, the micro-batch with the highest loss and that loss, its own (the
        recorded value, which Lightning divides by the window's length, times that length; judged negated
        where ``maximized``): read from the losses the step recorded (``record.taken``), at a flagged step
        only. ``None`` with one micro-batch, losses that do not pair with the micro-batches (a
        ``training_step`` that returned ``None``), or under DDP, where each rank's micro-batches differ."""
        batches, losses = self.record.batches, self.record.taken
        if len(batches) < 2 or len(losses) != len(batches) or self.all_reduce_sum is not None:
            return None
        sign = -1.0 if maximized else 1.0
        own = [sign * float(loss) * len(losses) for loss in losses]
        highest = max(range(len(own)), key=own.__getitem__)
        return own[highest], batches[highest]


class StabilityCore:
    """The guard's algorithm without a trainer: a spike detector, an escalation policy and a snapshot schedule,
    built from :class:`~lightning_pulse.StabilityGuard`'s arguments (validated by each object), and what one
    optimizer step, a rollback test and a return to a snapshot do between them.

    The caller hands in what needs a trainer as callables: the cause of a non-finite step and the flagged and
    ordinary batches' losses at a snapshot's weights.
    """

    def __init__(
        self,
        config: StabilityGuardConfig | Mapping[str, Any] | None,
        loss_zscore: float | None,
        grad_norm_zscore: float | None,
        window: int,
        warmup: int,
        rollback_after: int,
        skip_after_rollback: int,
        snapshot_every: int,
        max_snapshots: int,
        rollback_margin: int,
        max_rollbacks: int,
    ) -> None:
        self.config = config = as_config(config, StabilityGuardConfig, "config") or StabilityGuardConfig()
        detection = (loss_zscore, grad_norm_zscore, window, warmup, config.min_ratio, config.loss_scale)
        # the key of a step without a pulse phase
        self.detector = SpikeDetector(*detection, main_key="burst" if config.per_phase_baselines else "all")
        self.policy = EscalationPolicy(
            rollback_after,
            config.spike_memory,
            skip_after_rollback,
            max_rollbacks,
            config.rollback_memory,
            config.lr_cooldown_steps,
        )
        self.schedule = SnapshotSchedule(snapshot_every, max_snapshots, rollback_margin)
        self.lr_replay = ScheduleReplay()  # a spike the rewound LR schedule brings back (return_to_snapshot)
        self.lr_replay_resumed = False  # loaded from a checkpoint: its scheduler positions are this fit's
        self.bad_samples: list[dict[str, Any]] = []  # {"step", "batch_idx", "rows", "indices"}, newest last
        self.rollback_to: int | None = None  # the snapshot step the last rollback test chose
        # since the newest snapshot: the first step whose snapshot was left out, and what was non-finite then
        self.left_out: tuple[int, list[str]] | None = None
        # the newest snapshot that a rollback found fitting the model but not its optimizers or schedulers
        self.unfit_optimizers_after: int | None = None
        # the step of the last structured cut a ParametersReplacedListener heard of that no snapshot (taken or
        # left out) has followed yet, and the one a rollback found so (no_snapshot_message names it)
        self.replaced_at: int | None = None
        self.cut_unsnapshotted: int | None = None
        # a cut came after an applied step's batch end, or a fit starts: snapshot before the next step
        self.snapshot_owed = False
        # the step this fit started at: its snapshot predates the fit's first forward
        self.fit_start: int | None = None
        # the step after the fit's first applied step (the fit's start, where that step overflowed a value)
        # and masks of the forward state's elements finite then (finite_evidence): the evidence about
        # infinities until a snapshot after the fit start exists
        self.first_forward: tuple[int, dict[str, Tensor]] | None = None
        # the steps the detector had judged, and the losses it could not, when this fit started (a
        # checkpoint's): the end-of-training line counts on
        self.fit_start_accepted = self.fit_start_unjudged = self.fit_start_negative = 0
        self.overflow_warned = False  # a forward state that turned infinite between snapshots was said (once)
        # unchecked data faults in a row (UNCHECKED_DATA_FAULTS); whether this fit said it stopped presuming
        self.unchecked_data_faults = 0
        self.presumption_warned = False
        self.check_oom_warned = False  # the data check ran out of memory (said once a fit)
        self.rerun_failed_warned = False  # a snapshot test's re-run failed (said once a fit)
        self.flag_lines = 0  # flagged steps this fit (:meth:`say_flagged`)
        # the buffers training forwards write, copied before each step: what a data fault's mend sets back
        self.pre_step = PreStepBuffers()
        self.mended_from_copy: list[str] = []  # the names the last mend set back from that copy
        # the step counter after the last applied step of the run's current timeline (the fit's start, a
        # rollback's snapshot): a snapshot taken at it or later holds the state before the current step's
        # first forward, where no pre-step copy exists yet (mend_forward_state)
        self.applied_through: int | None = None
        self.forward_state_mended = False  # the current step's forward writes were set back (a skip's)
        self.resumed_written: list[str] = []  # what forwards write, learned by the run a checkpoint resumes
        # from a checkpoint saved mid-incident: the snapshots its rollback may return to, for this fit's ring
        self.resumed_snapshots: list[TrainingSnapshot] = []
        self.resumed_mid_incident = False  # this fit's ring holds them: no snapshot of the state resumed at
        self.resumed_snapshot_due = False  # the checkpoint was saved before its step's snapshot
        # recurring spikes that make a level of the data, the steps applied at it, the open incident's losses
        self.level = RecurringLevel(window, SAME_SPIKE_FACTOR, self.config.learn_recurring_level)
        self.level_steps = 0
        self.flagged_losses: dict[int, tuple[float, float | None]] = {}
        self.flagged_scores: dict[int, Clearing] = {}  # the open incident's (SpikeDetector.clearing_scores)
        # a checkpoint's (flagged_losses, flagged_scores): its open incident, for this fit's start
        self.resumed_flagged: tuple[dict[int, tuple[float, float | None]], dict[int, Clearing]] = ({}, {})
        # whether a restored checkpoint's loss windows hold the negated loss (None: nothing restored)
        self.resumed_maximized: bool | None = None
        # the samples one optimizer step trains (batch size x accumulation x processes; None: not known), this
        # fit's and a restored checkpoint's: the gradient norm's noise scales with it (see start)
        self.samples_per_step: int | None = None
        self.resumed_samples_per_step: int | None = None
        # where the data states no batch size: what reads it from the fit's first micro-batch (start), once
        self.samples_reader: Callable[[Any], int | None] | None = None
        # the fit's first step with a backward is yet to show its gradients (refuse_update_in_backward), and
        # what its backwards moved of the parameters with a post-accumulate-grad hook, until then
        self.gradients_unchecked = True
        self.backward_moves = BackwardMoves()
        # the optimizers ascend the loss (maximizes_loss, read at train start): every loss is judged negated
        self.maximized = False
        # (step, state, its loss counts taken back) of a flagged step in flight, as before it (_keep_before_step)
        self.before_step: tuple[int, dict[str, Any], bool] | None = None
        # a step whose state an applied update right before it made NaN, with those tensors (nonfinite_cause)
        self.nan_update: tuple[int, list[str]] | None = None

    def _follow_samples_per_step(self, samples_per_step: int | None) -> None:
        """Drop a checkpoint's gradient-norm baselines measured at another number of samples per optimizer step
        (its resumed incident snapshots' too, which a rollback restores): the gradient norm's noise scales
        about as 1/sqrt of it (medians 0.47 at 32 samples, 1.3 at 4), so a run resumed at a batch of 4 from
        one at 32 was judged against a baseline 2.8x too low and flagged healthy steps, skipped and rolled
        back. They warm up again as in a fresh run, said at train start (:func:`warn_of_converted_baselines`).
        The loss baselines stay: a mean loss's level does not depend on it, and re-warmed from a few steps of
        a trained model's small-batch losses they flagged healthy ones (0.56 against a median of 0.055 of 3)
        that the kept windows judged fine. A checkpoint that recorded no number keeps them all, as before; one
        that did, in a fit that cannot read its own, keeps them too and says so."""
        saved, self.resumed_samples_per_step = self.resumed_samples_per_step, None
        self.samples_per_step = samples_per_step
        if samples_per_step is None and saved is not None and self.detector.has_grad_norms():
            self.detector.converted["samples_unread"] = (saved, None)
        if saved is None or samples_per_step is None or saved == samples_per_step:
            return
        for snapshot in (*self.resumed_snapshots, *self.schedule.ring):  # the ring's: a first-batch read
            if isinstance(detector := snapshot.extra.get("detector"), dict):
                snapshot.extra["detector"] = {**detector, "grad_norm": {}}
        if self.detector.forget_grad_norms():
            self.detector.converted["samples_per_step"] = (saved, samples_per_step)

    @property
    def presumes_data(self) -> bool:
        """Whether a non-finite step whose bad data could not be checked is still taken as the data's
        (:data:`UNCHECKED_DATA_FAULTS`)."""
        return self.unchecked_data_faults < UNCHECKED_DATA_FAULTS

    def judge(
        self,
        step: int,
        loss: float | None,
        grad_norm: float | None,
        key: str,
        trace_cause: Callable[[], str | None],
        rollback_helps: Callable[[Verdict], bool] | None = None,
        accept_at_end: bool = False,
    ) -> tuple[Verdict, Action, str | None, bool]:
        """Judge one optimizer step and decide its action.

        ``trace_cause`` is called only for a non-finite step (where it came from, see
        :func:`~lightning_pulse.core.fault_origin.trace_nonfinite`); ``rollback_helps(verdict)`` only when the
        step would roll back or stop (see :meth:`EscalationPolicy.decide`). Returns ``(verdict, action, cause,
        note)``; ``note`` is a warning to say (once): the first loss a log scale cannot judge (and the first
        below 0 after 0s), or recurring spikes that make a large share of recent steps
        (:class:`RecurringLevel`). A flagged step at the level such spikes turned out to be is applied and
        accepted into the baselines (verdict OK, ``level_steps``). ``accept_at_end``: a healthy step's values
        enter the baselines at :meth:`finish_step` (:meth:`SpikeDetector.accept_held`), once its update ran
        (a checkpoint saved before holds them out); a flagged step keeps the state before it
        (:meth:`_keep_before_step`).
        """
        detector, policy = self.detector, self.policy
        unjudged_before, negative_before = detector.unjudged_losses, detector.negative_losses
        # accepted now, or held until finish_step (positional: the call of every step)
        verdict = detector.assess(loss, grad_norm, key, not accept_at_end, accept_at_end).verdict
        # said at the first loss <= 0, and again at the first < 0 after 0s (only that needs a linear scale)
        first = (not unjudged_before and detector.unjudged_losses) or (
            not negative_before and detector.negative_losses
        )
        note = unjudged_loss_message(loss, self.maximized) if first else None
        if accept_at_end and verdict is not Verdict.OK:
            self._keep_before_step(step, (unjudged_before, negative_before))
        if verdict.is_spike and verdict not in NONFINITE and self.level.holds(loss, grad_norm):
            # a step at the level of the data that recurring spikes turned out to be: trained, and its values
            # teach the windows that level (no rollback test: it would find the batch spiking again)
            detector.accept(loss, grad_norm, key)
            self.level_steps += 1
            return Verdict.OK, Action.APPLY, None, note
        cause = trace_cause() if verdict in NONFINITE else None
        helps = None if rollback_helps is None else lambda: rollback_helps(verdict)
        if verdict is Verdict.OK:  # the usual step: no incident, nothing for the level's books
            return verdict, policy.decide(step, verdict, cause, helps), cause, note
        incident, recurring_before = [*policy.spike_steps, step], policy.recurring_spikes
        scores = self.flagged_scores
        for old in [s for s in scores if step - s >= policy.spike_memory]:
            del scores[old]
        if verdict not in NONFINITE:  # how far the thresholds must rise to let it through (a stop says)
            scores[step] = detector.clearing_scores(loss, grad_norm, key)
        action = policy.decide(step, verdict, cause, helps)
        if action in (Action.ROLLBACK, Action.STOP):
            policy.book_scores(step, [scores.get(s) for s in incident if step - s < policy.spike_memory])
        flagged = self.flagged_losses
        for old in [s for s in flagged if step - s >= policy.spike_memory]:
            del flagged[old]
        if verdict.is_spike and verdict not in NONFINITE and cause is None and loss is not None:
            flagged[step] = (loss, grad_norm)  # a non-finite step never counts towards a level
        if (resolved := policy.recurring_spikes - recurring_before) > 0:
            steps = [s for s in incident[-resolved:] if s in flagged]
            losses, grads = [flagged[s][0] for s in steps], [flagged[s][1] for s in steps]
            note = self.level.record(step, steps, losses, grads) or note
        return verdict, action, cause, note

    def judge_later_evaluation(self, step: int, loss: float | None, grad_norm: float | None) -> Action:
        """The action for a later closure evaluation of a step applied on its first (SAM applies the gradient
        of its second; LBFGS's trial points): a non-finite loss or gradient norm flags the step as a
        non-finite first evaluation would, the model's (its weights moved within the step: no data check);
        spikes are judged on the first evaluation only, so the baselines hold one kind of value."""
        if loss is not None and not math.isfinite(loss):
            verdict = Verdict.NONFINITE_LOSS
        elif grad_norm is not None and not math.isfinite(grad_norm):
            verdict = Verdict.NONFINITE_GRAD
        else:
            return Action.APPLY
        if self.before_step is None or self.before_step[0] != step:
            self._keep_before_step(step)
        return self.policy.decide(step, verdict)

    def check_first_gradients(
        self,
        step: int,
        loss: float | None,
        grad_norm: float | None,
        model: nn.Module,
        all_reduce_sum: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        """At the fit's first optimizer step with a backward (``loss`` read), once: refuse a fit whose updates
        are made in backward (:func:`refuse_update_in_backward`, on what :attr:`backward_moves` saw of the
        step's backwards, and against the newest snapshot). Before the step is judged; on every other step a
        call that returns at once."""
        if self.gradients_unchecked and loss is not None:
            self.gradients_unchecked = False
            newest = self.schedule.ring.newest()
            refuse_update_in_backward(step, grad_norm, model, newest, all_reduce_sum, self.backward_moves)

    def judge_step(
        self,
        record: StepRecord,
        step: int,
        loss: float | None,
        grad_norm: float | None,
        key: str,
        flagged: Callable[[], FlaggedStep],
        warn: Callable[[str], Any],
    ) -> tuple[Verdict, Action, str | None]:
        """:meth:`judge` the optimizer step in flight, ``record``'s: its loss and baseline key are kept there
        for the checks of a flagged step (with its batches), and so is the action decided. ``flagged()``: what
        those checks read from the trainer, called only when the step is flagged: where a non-finite step
        came from (:meth:`nonfinite_cause`) and the rollback test (:meth:`flagged_rollback_helps`). Their
        warnings are said through ``warn``, and so is the judgement's note (once: a loss a log scale cannot
        judge, recurring spikes as a level). Returns ``(verdict, action, cause)``. ``loss`` is the step's as
        the module returned it: judged, and kept, negated where the optimizers maximize it
        (:attr:`maximized`)."""
        if self.samples_reader is not None:  # the fit's first step, where the data states no batch size
            reader, self.samples_reader = self.samples_reader, None
            self._follow_samples_per_step(reader(record.batches[0][1]) if record.batches else None)
            warn_of_converted_baselines(self.detector, warn)
        if self.maximized and loss is not None:
            loss = -loss
        record.loss, record.key = loss, key
        verdict, action, cause, note = self.judge(
            step,
            loss,
            grad_norm,
            key,
            lambda: self.nonfinite_cause(flagged(), warn),
            lambda verdict: self.flagged_rollback_helps(flagged(), verdict, warn),
            True,  # accept_at_end
        )
        nan_update, self.nan_update = self.nan_update, None
        if action in (Action.ROLLBACK, Action.STOP) and nan_update is not None and nan_update[0] == step:
            self.policy.book_nan_update(step, nan_update[1])  # the stop's message names the update
        record.decided = action
        if action is not Action.APPLY and step in self.policy.spike_steps:  # its rates: flagged steps only
            found = flagged()
            self.lr_replay.note(step, found.optimizers, found.schedulers, self.policy.spike_memory)
        if note is not None:
            warn(note)
        return verdict, action, cause

    def judge_later_step(
        self,
        record: StepRecord,
        step: int,
        loss: float | None,
        grad_norm: float | None,
        changes: StepChanges,
        optimizer: torch.optim.Optimizer,
        keep_gradients: bool = False,
    ) -> None:
        """A later closure evaluation of the step in ``record``, applied on its first
        (:meth:`judge_later_evaluation`): where ``changes`` can still undo the step within it
        (:meth:`StepChanges.can_undo_within_step`), a non-finite one skips it; else the step stays applied."""
        if changes.can_undo_within_step(optimizer, keep_gradients):
            record.decided = self.judge_later_evaluation(step, loss, grad_norm)
            if record.decided is not Action.APPLY:
                changes.skip(optimizer, keep_gradients)

    def carry_out(
        self,
        action: Action,
        record: StepRecord,
        changes: StepChanges,
        optimizer: torch.optim.Optimizer,
        keep_gradients: bool = False,
    ) -> None:
        """Make the coming ``optimizer.step()`` do what :meth:`judge_step` decided, through ``changes``: an
        applied step is held (a later closure evaluation may still skip it, where ``record.repeats``), and
        taken at ``config.lr_factor_after_rollback`` times the learning rates in the cooldown after a
        rollback; any other is skipped."""
        if action is Action.APPLY:
            changes.hold(optimizer, record.repeats)
            if self.policy.cooldown_remaining and self.config.lr_factor_after_rollback < 1:
                changes.scale_lr(optimizer, self.config.lr_factor_after_rollback)
            return
        changes.skip(optimizer, keep_gradients)

    def mend_at_decision(
        self,
        action: Action,
        record: StepRecord,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        optimizers: Sequence[Any] | None = None,
    ) -> None:
        """Where the step in flight (``record``'s) is skipped (a loss spike, a non-finite step, a forced skip
        after a rollback), set back what its forwards wrote (:meth:`mend_forward_state`, with ``optimizers``)
        as soon as that is decided, in ``on_before_optimizer_step``, after its forwards: not at its batch end
        (:meth:`finish_step`), where a callback listed before the guard that averages the model then
        (Lightning's ``EMAWeightAveraging``) had folded them into its average first (a regression sweep). Only
        where no forward of the step can follow: ``optimizer`` evaluates the closure once a step (its applied
        steps told so, :attr:`StepRecord.repeats`; before the first, one of torch's own), not LBFGS; else
        (SAM, LBFGS: a later closure evaluation runs the forward again) at the batch end, as before. Call it
        before :meth:`carry_out`, whose backup of the parameters the step holds is put back after it."""
        if action is not Action.SKIP or self.forward_state_mended or type(optimizer) is torch.optim.LBFGS:
            return
        torch_own = type(optimizer).__module__.startswith("torch.optim.")
        if record.repeats is False or (record.repeats is None and torch_own):
            self.mend_forward_state(model, optimizers=optimizers)

    def start(
        self,
        step: int | None = None,
        optimizers: Sequence[Any] = (),
        model: nn.Module | None = None,
        samples_per_step: int | Callable[[Any], int | None] | None = None,
    ) -> None:
        """At fit start, refuse optimizers no snapshot can hold (:func:`refuse_unconsolidated_optimizers`) or
        that both ascend and descend the loss, and learn whether they maximize it (:func:`maximizes_loss`);
        then forget what an earlier fit left: a requested snapshot, the rollback test's choice, the warnings
        said once a fit and the snapshots (the caller then snapshots the state training starts from, or
        resumes at: ``step``, whose snapshot :meth:`saved_forward_state` does not take as evidence about
        infinities). A resumed ``model`` copies the tensors its forwards write before its first step (the
        names the checkpoint holds): a skip in its first steps sets back to the values before it, as in the
        run it resumes (to the resumed snapshot instead, it undid a skipped spike's statistics kept since).
        ``samples_per_step``: what one optimizer step trains in this fit (``None``: not known), or what reads
        it given the fit's first micro-batch (``None`` for the batch: as set up); a checkpoint's baselines
        measured at another number are dropped (:meth:`_follow_samples_per_step`). Where the reader cannot
        tell at train start, it is read at the fit's first judged step (:meth:`judge_step`), once."""
        refuse_unconsolidated_optimizers(optimizers)
        self.gradients_unchecked, self.backward_moves = True, BackwardMoves()
        self.samples_reader = samples_per_step if callable(samples_per_step) else None
        if self.samples_reader is None or (samples_per_step := self.samples_reader(None)) is not None:
            self.samples_reader = None
            self._follow_samples_per_step(samples_per_step)  # else: at the first judged step
        self.maximized = maximizes_loss(optimizers)
        saved, self.resumed_maximized = self.resumed_maximized, None
        if saved is not None and saved != self.maximized and self.detector.forget_losses():
            # the windows hold the loss of the other sign (a checkpoint from before the direction was read, or
            # of a run whose optimizers turned): judged against them, every step was flagged (a review)
            warnings.warn(maximize_changed_message(saved, self.maximized), stacklevel=2)
        self.schedule.pending, self.rollback_to, self.left_out = False, None, None
        self.unfit_optimizers_after = self.replaced_at = self.cut_unsnapshotted = None
        self.snapshot_owed = False
        self.fit_start, self.first_forward, self.overflow_warned = step, None, False
        self.applied_through = step
        self.unchecked_data_faults, self.presumption_warned = 0, False
        self.check_oom_warned = False
        self.rerun_failed_warned = False
        self.flag_lines = 0  # flagged steps this fit (:meth:`say_flagged`)
        if not self.lr_replay_resumed:  # a new fit's schedulers start anew: an earlier fit's positions go
            self.lr_replay = ScheduleReplay()
        self.lr_replay_resumed = False
        self.level.start()
        (self.flagged_losses, self.flagged_scores), self.resumed_flagged = self.resumed_flagged, ({}, {})
        self.detector.held, self.before_step = None, None
        self.fit_start_accepted = self.detector.accepted_steps
        self.fit_start_unjudged = self.detector.unjudged_losses
        self.fit_start_negative = self.detector.negative_losses
        self.schedule.ring.clear()
        for snapshot in self.resumed_snapshots:
            # a checkpoint keeps no ids; they are of the parameters the resumed optimizers hold
            snapshot.parameter_ids = optimizer_parameter_ids(optimizers)
            self.schedule.ring.add(snapshot)
        self.resumed_mid_incident, self.resumed_snapshots = bool(self.resumed_snapshots), []
        self.pre_step.clear(learn_after=-1 if step is None else step)  # learned at the first applied step
        if model is not None and self.resumed_written:
            self.pre_step.clear(learn_after=step, keep=model, names=self.resumed_written)
        self.resumed_written = []

    def finish_step(
        self,
        action: Action,
        step: int,
        energy_kwh: float | None = 0.0,
        optimizers: Sequence[Any] | None = None,
        model: nn.Module | None = None,
        schedulers: Sequence[Any] | None = None,
    ) -> bool:
        """Book an optimizer step once its update was applied or dropped (with the energy it used). A skipped
        one (a loss spike, a non-finite step, a forced skip after a rollback) first sets back what its
        forwards wrote (:meth:`mend_forward_state`, with ``optimizers``; a data fault's was already):
        BatchNorm's running statistics, fake-quant observers, as a run that skipped the step by hand (a
        rollback returns them to its snapshot; a stop saves the state as it is). Whether a snapshot is due at
        its end (``step``: the counter after it), also because ``optimizers`` gained or changed a parameter
        group or were swapped for another class, or ``schedulers`` changed, since the newest snapshot
        (:meth:`SnapshotSchedule.due`). Only an applied step takes one. The fit's first applied step keeps
        ``model``'s forward state (:meth:`keep_first_forward`), and asks for a snapshot when the fit-start one
        no longer fits (:meth:`retake_lazily_shaped_start`). The first two applied steps after the fit's start
        or a prune learn which buffers and parameters forwards write, against the newest snapshot
        (:class:`~lightning_pulse.core.snapshots.PreStepBuffers`; the second: a momentum encoder or an
        ``AveragedModel`` copied from the model keeps its values at its first update)."""
        if action is Action.SKIP and model is not None and not self.forward_state_mended:
            # the skipped step's forwards already fed the running statistics and observers: a x1000 batch
            # skipped as a loss spike left a QAT input scale 10x too coarse for the rest of the run
            self.mend_forward_state(model, optimizers=optimizers)
        self.detector.accept_held()
        self.policy.finish(action, energy_kwh)
        pre_step = self.pre_step
        if action is Action.APPLY and model is not None and pre_step.learn_after is not None:
            if pre_step.learn_after < step and (newest := self.schedule.ring.newest()) is not None:
                pre_step.learn(model, newest, optimizers)  # with no snapshot yet: at the next applied step
                pre_step.early_learns -= 1
                pre_step.learn_after = step if pre_step.early_learns else None
        mended, self.forward_state_mended = self.forward_state_mended, False
        if action is not Action.APPLY and not mended:
            # its forward's writes stay (a rollback's or stop's flagged step, or no model): the state moved on
            self.applied_through = step
        if action is Action.APPLY:
            self.unchecked_data_faults, self.applied_through = 0, step
            if self.first_forward is None and model is not None:  # once a fit
                self.retake_lazily_shaped_start(model)
                self.keep_first_forward(step, model)
            return self.schedule.due(step, self.policy.healthy, optimizers, schedulers)
        # the maintain entry came with a dropped step: no snapshot asked; a cut no snapshot followed yet keeps
        # asking (older snapshots no longer fit the model): at the next applied step, if healthy
        self.schedule.pending = self.replaced_at is not None
        return False

    def data_fault(
        self,
        model: nn.Module,
        step: int,
        samples: list[dict[str, Any]],
        saved: SavedForwardState | None = None,
        unchecked: bool = False,
    ) -> str | None:
        """After a non-finite step that was the data's fault (``samples``, see
        :func:`~lightning_pulse.core.fault_origin.trace_nonfinite`; ``unchecked``: presumed, its loss could
        not be recomputed without the bad rows, counted towards :data:`UNCHECKED_DATA_FAULTS`): mend the
        forward state (:meth:`mend_forward_state`, with ``saved``, the trace's :meth:`saved_forward_state`)
        and keep the samples. Returns the warning for the run's first bad batch (:func:`data_fault_message`),
        else ``None`` (later ones are skipped silently)."""
        self.unchecked_data_faults = self.unchecked_data_faults + 1 if unchecked else 0
        saved = self.saved_forward_state(model) if saved is None else saved
        mended = self.mend_forward_state(model, saved)  # before the next forward reads it
        if self.remember_bad_samples(samples):
            before_step = set(mended) <= set(self.mended_from_copy)  # else named with the snapshot's step
            snapshot_step = None if saved[0] is None else saved[0].step
            return data_fault_message(step, samples, mended, snapshot_step, before_step)
        return None

    def nonfinite_cause(self, flagged: FlaggedStep, warn: Callable[[str], Any]) -> str | None:
        """Where a non-finite step came from (:func:`~lightning_pulse.core.fault_origin.trace_nonfinite`); a
        data fault's samples are remembered (:meth:`data_fault`), and its warnings said through ``warn``.

        With a non-finite loss (the same on every rank), bad data is checked by recomputing the loss without
        the bad rows, or where they cannot be cut out with its NaN and ``+inf`` values set to 0
        (:meth:`losses_for_a_check`): only one that then comes out finite is the data's fault. Where neither
        can be checked and the data is no longer presumed at fault, the batch is tested at once on the
        snapshots a rollback would return to (:meth:`recurs_at_snapshot`): the data's if non-finite there too,
        for :data:`RECURRING_DATA_FAULTS` steps in a row at most. No check runs a forward under an activation
        cache (``flagged.caches_activations``).
        """
        model, step, loss = flagged.model, flagged.step, flagged.record.loss
        newest, saved = self.saved_forward_state(model)  # saved: tells a -inf mask from an overflow
        check = loss is not None and not math.isfinite(loss) and not flagged.caches_activations
        losses_of = (
            partial(
                self.losses_for_a_check,
                model,
                (newest, saved),
                flagged.losses_of,
                warn,
                optimizers=flagged.optimizers,
            )
            if check
            else None
        )
        cause, samples, unchecked = trace_nonfinite(
            model,
            flagged.optimizers,
            flagged.record.batches,
            step,
            flagged.loader,
            flagged.all_reduce_sum,
            saved,
            flagged.record.trained,
            losses_of,
            self.presumes_data,
        )
        if cause is None and unchecked:  # bad data no longer presumed at fault: tested at a snapshot
            if (warning := self.presumption_ended(model, step, (newest, saved))) is not None:
                warn(warning)
            tested = check and self.tests_data_at_snapshot  # an unbroken row of them escalates
            comparable = bool(flagged.record.reference)  # no activation cache: the check ran
            if tested and self.recurs_at_snapshot(
                model,
                step,
                comparable,
                flagged.losses_at_snapshot,
                flagged.optimizers,
                flagged.schedulers,
                warn,
            ):
                cause = "data"
        if cause == "data" and (warning := self.data_fault(model, step, samples, (newest, saved), unchecked)):
            warn(warning)
        if cause == "state" and flagged.record.applied(step):
            # the step before was applied, on a finite loss and gradient norm: a NaN in what only an optimizer
            # step writes came from its update (Adam with eps=0: 0 / (sqrt(0) + 0) for a gradient of 0)
            self.nan_update = (step, updated_to_nan(model, flagged.optimizers))
        return cause

    def losses_for_a_check(
        self,
        model: nn.Module,
        saved: SavedForwardState,
        losses_of: LossesOf,
        warn: Callable[[str], Any],
        batches: list[tuple[int, Any]],
        optimizers: Sequence[Any] = (),
    ) -> list[float | None]:
        """The training losses of ``(batch_idx, batch)`` pairs at the current weights (``losses_of``, one pair
        at a time, autograd off: no graph is built beside the step's held gradients), with the forward state a
        bad batch wrote set back (:meth:`forward_state_for_a_check`, with the parameters written outside
        ``optimizers`` given back too); ``None`` for a batch whose
        ``training_step`` returns no loss, or fails on the batch checked (a shape fixed in the module, a loss
        that needs autograd). Running out of memory is such a failure too, not the run's end: the allocator's
        cache is freed, a warning said through ``warn`` once a fit, and the batch counts unchecked."""
        losses: list[float | None] = []
        with self.forward_state_for_a_check(model, saved, optimizers):
            for pair in batches:
                try:
                    found = losses_of([pair])
                except torch.OutOfMemoryError:  # the step's gradients are still held: the check is extra
                    found = []
                    self._out_of_memory_in_check(model, warn)
                except Exception:  # a diagnostic: its failure must not end the run
                    found = []
                losses.append(found[0] if found else None)
        return losses

    def _out_of_memory_in_check(self, model: nn.Module, warn: Callable[[str], Any]) -> None:
        _release_cuda_cache(model)
        if not self.check_oom_warned:
            self.check_oom_warned = True
            warn(CHECK_OUT_OF_MEMORY)

    def presumption_ended(
        self, model: nn.Module, step: int, saved: SavedForwardState | None = None
    ) -> str | None:
        """After a non-finite step with bad data that :attr:`presumes_data` no longer lets be the data's
        without a test: mend the forward state as :meth:`data_fault` does (the bad batch's own forward may
        have written it; left so, it makes every later step non-finite), before the caller tests the batch at
        a snapshot (:meth:`recurs_at_snapshot`). Returns the warning, once a fit
        (:func:`presumption_ended_message`), else ``None``."""
        self.mend_forward_state(model, saved)
        if self.presumption_warned:
            return None
        self.presumption_warned = True
        return presumption_ended_message(step)

    @contextmanager
    def forward_state_for_a_check(
        self, model: nn.Module, saved: SavedForwardState | None, optimizers: Sequence[Any] = ()
    ) -> Iterator[None]:
        """Run the block with the forward state the flagged step's forward made bad set back as a data fault
        mends it (:meth:`mend_forward_state`), then give back every buffer and carried tensor, and every
        parameter no step of ``optimizers`` writes (:func:`~lightning_pulse.core.snapshots.written_outside`:
        the same object, in its values), as it was on entry (the mend proper comes with the verdict; a
        training forward in the block writes BatchNorm's running statistics, a ``training_step`` a momentum
        encoder or an ``AveragedModel``). For recomputing the step's loss without its bad rows: an RNN's
        hidden state made NaN by a bad row would make that loss NaN too, and blame the data's fault on the
        model. A copy of the buffers, on their device, and of those parameters on the CPU (a frozen backbone
        may not fit twice on the device): a rare step only."""
        buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
        outside = written_outside(model, optimizers)
        unwritten = self._unwritten_since_snapshot(outside, None if saved is None else saved[0])
        parameters = [
            (model.get_submodule(name.rpartition(".")[0])._parameters, name.rpartition(".")[2], param)
            for name, param in outside.items()
        ]
        values = [  # a frozen backbone is summed, not copied
            None if name in unwritten else param.detach().to("cpu", copy=True)
            for name, param in outside.items()
        ]
        # the check gives everything back: the step's writes are not mended
        mended = self.forward_state_mended
        with kept_carried_state(model):
            try:
                self.mend_forward_state(model, saved)
                yield
            finally:
                self.forward_state_mended = mended
                with torch.no_grad():
                    for name, buffer in model.named_buffers():
                        if name in buffers:
                            buffer.copy_(buffers[name])
                    for (owner, key, param), value in zip(parameters, values):
                        owner[key] = param  # the object a forward in the block re-created goes
                        if value is not None:
                            param.copy_(value)
                    after = fingerprints({name: outside[name] for name in unwritten})
                    for name, value in after.items():  # written by the re-run: the snapshot holds its values
                        if value != self.pre_step.fingerprints[name]:
                            outside[name].copy_(unwritten[name])

    def _unwritten_since_snapshot(
        self, outside: Mapping[str, Tensor], snapshot: TrainingSnapshot | None
    ) -> dict[str, Tensor]:
        """The parameters of ``outside`` learned as written by nobody (a frozen backbone: their sum the same
        at every look, the newest snapshot's included) and still at that sum, with the snapshot's copy of
        each: a check sums them before and after its re-run instead of copying them to the CPU."""
        pre_step = self.pre_step
        learned = {name for name in pre_step.fingerprints if name not in pre_step.names and name in outside}
        if snapshot is None or not learned:
            return {}
        candidates = {name: outside[name] for name in learned if name in outside and name in snapshot.model}
        now = fingerprints(candidates)  # one written since (an EMA that starts late) is copied
        return {
            name: snapshot.model[name] for name, value in now.items() if value == pre_step.fingerprints[name]
        }

    def remember_bad_samples(self, samples: list[dict[str, Any]]) -> bool:
        """Keep a data fault's samples (the newest 1000); ``True`` for the run's first bad batch (warn once)."""
        self.bad_samples = [*self.bad_samples, *samples][-1000:]
        return self.policy.bad_batches == 0

    def retake_lazily_shaped_start(self, model: nn.Module) -> None:
        """After the fit's first applied step: when the fit-start snapshot no longer fits ``model``, because
        its first forward gave a buffer its shape (a lazily initialised one: eager QAT's per-channel observers
        hold ``min_val`` of shape ``(0,)`` until then), drop it and ask for a snapshot at the end of this
        step.
        Without it, no snapshot fits until the first periodic one, and a data fault or a rollback meanwhile
        would find none. One ``state_dict`` comparison, once a fit."""
        start = self.schedule.ring.newest()
        if start is not None and self.fit_start is not None and start.step <= self.fit_start:
            if not start.fits(model):
                self.schedule.ring.discard(start)
                self.schedule.pending = True

    def keep_first_forward(self, step: int, model: nn.Module) -> None:
        """Keep which elements of ``model``'s buffers and carried tensors were finite after the fit's first
        applied step (``step``: the counter after it): the evidence about infinities until a snapshot taken
        after the fit's start exists (:meth:`forward_evidence`). An infinity that step (or a bad batch before
        it) wrote where the fit-start snapshot held a finite value is kept as finite, unless it is a ``-inf``
        (:func:`~lightning_pulse.core.fault_origin.finite_evidence`): then the next snapshot says it turned
        infinite since the fit's start (and a data fault mends it), as a ``-inf`` mask filled by the first
        forward is not. Boolean masks only for tensors holding a non-finite value (nothing for the others),
        once a fit; nothing per step."""
        current = current_forward_state(model)
        fit_start = self._fit_start_snapshot(model)
        before = {} if fit_start is None else _saved_forward_state(fit_start, model)
        evidence, overflowed = finite_evidence(current, before)
        self.first_forward = (fit_start.step if overflowed and fit_start is not None else step, evidence)

    def _newest_fitting(self, model: nn.Module) -> TrainingSnapshot | None:
        return next((s for s in reversed(list(self.schedule.ring)) if s.fits(model)), None)

    def _fit_start_snapshot(self, model: nn.Module) -> TrainingSnapshot | None:
        """The newest snapshot that fits ``model`` if it is the one of the fit's start (taken before the fit's
        first forward), else ``None``."""
        snapshot = self._newest_fitting(model)
        if snapshot is None or self.fit_start is None or snapshot.step > self.fit_start:
            return None
        return snapshot

    def forward_evidence(
        self, model: nn.Module
    ) -> tuple[TrainingSnapshot | None, int | None, dict[str, Tensor]]:
        """The newest snapshot that fits ``model`` (``None``: none does), and the step and copy of the forward
        state (named by :func:`~lightning_pulse.core.fault_origin.forward_state_tensors`; a copy, or masks of
        the elements that were finite) that tell an infinity a forward wrote from one held by design: the
        snapshot's, when taken after the fit's start; else the masks kept after the fit's first applied step
        (:meth:`keep_first_forward`); before that step, the fit-start snapshot's, where a ``-inf`` it held
        finite is by design (:func:`~lightning_pulse.core.fault_origin.finite_evidence`): it predates the
        fit's first forward, and a mask buffer registered as zeros and filled with ``-inf`` by that forward
        had counted as an infinity a later step wrote; else no step and ``{}`` (only a NaN counts)."""
        snapshot = self._newest_fitting(model)
        if snapshot is not None and (self.fit_start is None or snapshot.step > self.fit_start):
            return snapshot, snapshot.step, _saved_forward_state(snapshot, model)
        if self.first_forward is not None:
            return snapshot, *self.first_forward
        if snapshot is None:
            return None, None, {}
        current = current_forward_state(model)
        evidence, _ = finite_evidence(current, _saved_forward_state(snapshot, model))
        return snapshot, snapshot.step, evidence

    def saved_forward_state(self, model: nn.Module) -> SavedForwardState:
        """The newest snapshot that fits ``model`` (``None``: none does), which a data fault's forward state
        is mended from, and the forward state that tells an infinity a forward wrote from one held by design
        (:func:`~lightning_pulse.core.fault_origin.nonfinite_forward_state`; :meth:`forward_evidence`).
        Before the first periodic snapshot, the masks kept after the fit's first applied step, or before that
        step the fit-start snapshot's: with no evidence, an infinity a bad batch's forward wrote (BatchNorm's
        running mean after a ``+inf`` row) was left unmended."""
        snapshot, _, evidence = self.forward_evidence(model)
        return snapshot, evidence

    def mend_forward_state(
        self,
        model: nn.Module,
        saved: SavedForwardState | None = None,
        optimizers: Sequence[Any] | None = None,
    ) -> list[str]:
        """After a data fault, and after every other skipped step (a loss spike, a non-finite step, a forced
        skip after a rollback, never judged: its batch may hold NaN rows all the same; :meth:`finish_step`):
        set back what the skipped step's forwards wrote. The step is skipped, but its forward already wrote
        BatchNorm's running statistics and fake-quant observers: left so, a bad batch's NaN would make every
        later step non-finite, and a x1000 batch skipped as a spike would set an observer's scale for the rest
        of the run. The buffers training forwards write go back to their
        values before the step's first forward (all of them, finite or not: the run goes on as if the step had
        been skipped;
        :class:`~lightning_pulse.core.snapshots.PreStepBuffers`), and so do the parameters forwards write (an
        EMA codebook; :func:`_made_bad`: frozen, or held by no optimizer). Where no such copy exists (a
        resume, the fit's first steps, a structured prune) and no step was applied since the newest snapshot
        that fits the model (not one of step 0), that snapshot holds those values: what the step's forwards
        wrote is learned against it (with ``optimizers``: parameters written outside them too) and set back
        to it (:meth:`_set_back_to_snapshot`; a run resumed inside the skip window left the running statistics
        of the rest of the window in place, unlike the run it resumed). For carried tensors, non-persistent
        buffers, tensors not learned yet, and where a step was applied since that snapshot, those the bad
        forward made
        bad (:func:`~lightning_pulse.core.fault_origin.nonfinite_forward_state`, against ``saved``, else
        :meth:`saved_forward_state`) go back to the newest snapshot that fits the model (which threw away
        up to ``snapshot_every`` steps of running statistics at each bad batch where it was the only
        source). A ``-inf`` mask buffer the snapshot holds too is left alone (it used to be named as written
        by the bad batch). Returns the names of those made bad that were set back; ``[]`` when none was bad
        or nothing held their values. What has no saved value is left as it is: snapshots are left out while
        it holds a NaN (:meth:`take_snapshot` says so), and a step it makes non-finite is the state's fault
        (rolled back)."""
        snapshot, evidence = self.saved_forward_state(model) if saved is None else saved
        self.forward_state_mended = True
        bad = _made_bad(model, evidence)  # read before the copy sets them back
        if self.pre_step.copied:
            before_step = set(self.pre_step.restore())
        else:
            before_step = set(self._set_back_to_snapshot(model, snapshot, optimizers))
        if before_step:  # a copy taken after a forward on the bad batch (a callback's, listed first) holds it
            before_step -= set(_made_bad(model, evidence))
        saved_tensors = {} if snapshot is None else _saved_under_current_names(snapshot, model)
        carried = {} if snapshot is None else snapshot.extra.get("carried", {})
        mended, self.mended_from_copy = [], [name for name in bad if name in before_step]
        for name in bad:
            if name in before_step:  # set back to its values before the step already
                pass
            elif name in saved_tensors:
                with torch.no_grad():  # a parameter may require grad
                    _parameter_or_buffer(model, name).copy_(saved_tensors[name])
            elif name in carried:
                restore_carried_tensors(model, {name: carried[name]})
            else:  # registered since the snapshot: nothing to set it back to (see the docstring)
                continue
            mended.append(name)
        return mended

    def _set_back_to_snapshot(
        self, model: nn.Module, snapshot: TrainingSnapshot | None, optimizers: Sequence[Any] | None
    ) -> list[str]:
        """With no pre-step copy: when no step was applied since ``snapshot`` (the newest that fits the model;
        the steps since were skipped and set back alike), it holds the state before the current step's first
        forward; learn what differs from it (:meth:`PreStepBuffers.learn`: from the next step on, a copy is
        taken) and set every learned buffer and parameter of its ``state_dict`` back to it: a checkpoint holds
        those, so a resumed fit (whose start the snapshot is) gets the uninterrupted run's values. Not a
        non-persistent buffer (a checkpoint does not hold it: the snapshot has its values from ``__init__``),
        nor at a snapshot of step 0, taken before the model's first forward: a mask a first forward fills
        once (registered as zeros) would stay zeros. The names set back; ``[]`` where a step was applied since
        or none fits. Skipped steps only."""
        if snapshot is None or snapshot.step == 0 or self.applied_through is None:
            return []
        if snapshot.step < self.applied_through:
            return []
        self.pre_step.learn(model, snapshot, optimizers)
        current = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        set_back = []
        with torch.no_grad():  # a parameter may require grad
            for name in self.pre_step.names:
                value, tensor = snapshot.model.get(name), current.get(name)
                if not isinstance(value, Tensor) or not isinstance(tensor, Tensor):
                    continue
                if value.shape == tensor.shape and value.dtype == tensor.dtype:  # the snapshot's: on the CPU
                    tensor.copy_(value)
                    set_back.append(name)
        return set_back

    def rollback_helps(
        self,
        model: nn.Module,
        step: int,
        key: str,
        verdict: Verdict,
        loss: float | None,
        comparable: bool,
        losses_at: Callable[[TrainingSnapshot], tuple[float, float]],
        optimizers: Sequence[Any] | None = None,
        schedulers: Sequence[Any] | None = None,
        warn: Callable[[str], Any] | None = None,
    ) -> bool:
        """The rollback test (:func:`rollback_test`) on the snapshot the rollback would return to (one that
        fits ``model``, ``optimizers`` and, rewinding the schedule, ``schedulers``), then on the oldest held;
        ``True`` where it cannot tell anything. It can with a loss that spiked (:func:`loss_spiked`), a log
        loss scale and ``comparable``: an ordinary applied batch to compare with, and no activation cache that
        a forward would fill. A gradient-norm spike with an ordinary loss cannot. Without those, a non-finite
        loss on weights every rollback target holds bit for bit is ``False``, with no re-run. A re-run of
        ``training_step`` that fails leaves the test inconclusive (``True``; said through ``warn`` once a
        fit)."""
        detector = self.detector
        median = detector.baseline(key)["loss"]
        if loss is None or not loss_spiked(verdict, loss, median, detector.min_ratio):
            return True
        candidates = self._rollback_candidates(model, step, optimizers, schedulers)
        if not comparable or detector.loss_scale != "log":
            # nothing to compare a re-run with (no step applied in this fit yet); but a non-finite loss on the
            # very weights every rollback target holds cannot be helped by returning there: the fit's first 3
            # batches each with a CTC target longer than its input were rolled back to the start, 0 steps
            # undone, and the next 20 batches skipped
            return math.isfinite(loss) or not candidates or not _holds_the_weights(model, candidates)
        try:
            losses_at = self._rerun_or_inconclusive(model, losses_at, warn)
            helps, self.rollback_to = rollback_test(candidates, losses_at, loss, self.config.min_ratio)
        except InconclusiveCheck:  # a re-run failed: the test tells nothing
            return True
        return helps

    def _rerun_or_inconclusive(
        self,
        model: nn.Module,
        losses_at: Callable[[TrainingSnapshot], tuple[float, float]],
        warn: Callable[[str], Any] | None,
    ) -> Callable[[TrainingSnapshot], tuple[float, float]]:
        """``losses_at`` raising :class:`InconclusiveCheck` where a re-run of ``training_step`` fails (out of
        memory, or an error on the batch as it is re-run): the check is extra and must not end the run;
        said through ``warn`` once a fit."""

        def losses(target: TrainingSnapshot) -> tuple[float, float]:
            try:
                return losses_at(target)
            except torch.OutOfMemoryError:  # the step's gradients are still held
                _release_cuda_cache(model)
                failure = "ran out of memory"
            except Exception as error:
                failure = f"raised {type(error).__name__}: {error}"
            if warn is not None and not self.rerun_failed_warned:
                self.rerun_failed_warned = True
                warn(RERUN_FAILED.format(failure=failure))
            raise InconclusiveCheck

        return losses

    def _rollback_candidates(
        self, model: nn.Module, step: int, optimizers: Sequence[Any] | None, schedulers: Sequence[Any] | None
    ) -> list[TrainingSnapshot]:
        """The snapshots a rollback from ``step`` would try, as the rollback test takes them: the one it
        returns to (the margin before the incident's start), then the oldest held."""
        start = self.policy.incident_start
        before = (step if start is None else start) - self.schedule.margin
        rewound = schedulers if self.config.rewind_lr_schedule else None  # else the current ones are kept
        return self.schedule.ring.rollback_candidates(model, before, optimizers, rewound)

    def flagged_rollback_helps(
        self, flagged: FlaggedStep, verdict: Verdict, warn: Callable[[str], Any] | None = None
    ) -> bool:
        """The rollback test (:meth:`rollback_helps`) of a flagged step with its ``verdict``: the flagged and
        the last ordinary batches' losses at a snapshot's weights (:meth:`FlaggedStep.losses_at_snapshot`),
        negated as the step's loss is where the optimizers maximize it (:attr:`maximized`). Where the window's
        loss did not spike (:func:`loss_spiked`) but its highest micro-batch's own loss does
        (:meth:`FlaggedStep.highest_micro_batch`), that micro-batch alone is tested, with that loss."""
        losses_at, loss, min_ratio = flagged.losses_at_snapshot, flagged.record.loss, self.detector.min_ratio
        median = self.detector.baseline(flagged.record.key)["loss"]
        if loss is not None and not loss_spiked(verdict, loss, median, min_ratio):
            micro = flagged.highest_micro_batch(self.maximized)
            if micro is not None and loss_spiked(verdict, micro[0], median, min_ratio):
                # a micro-batch's spike averaged away in its window (x1000 samples beside a clean batch: 2.32
                # against a median of 1.41) is tested on that micro-batch alone, as without accumulation
                loss, batch = micro
                losses_at = partial(flagged.losses_at_snapshot, batches=[batch])
        if self.maximized:
            losses_at = _negated(losses_at)
        return self.rollback_helps(
            flagged.model,
            flagged.step,
            flagged.record.key,
            verdict,
            loss,
            flagged.comparable,
            losses_at,
            flagged.optimizers,
            flagged.schedulers,
            warn,
        )

    def recurs_at_snapshot(
        self,
        model: nn.Module,
        step: int,
        comparable: bool,
        losses_at: Callable[[TrainingSnapshot], tuple[float, float]],
        optimizers: Sequence[Any] | None = None,
        schedulers: Sequence[Any] | None = None,
        warn: Callable[[str], Any] | None = None,
    ) -> bool:
        """Whether a non-finite step's batch is non-finite on each snapshot a rollback could return to (as the
        rollback test picks them: that one, then the oldest held) while the ordinary batch is finite there.
        Asked at once for a step whose bad data is no longer presumed at fault (:attr:`presumes_data`): then
        the data's. ``False`` where it cannot tell (no snapshot, nothing ``comparable``). Unlike
        :meth:`rollback_helps` it needs no log loss scale and no positive loss: a non-finite loss is no matter
        of scale, and a loss that may go negative (a density's NLL) had sent bad data to a rollback. A re-run
        of ``training_step`` that fails cannot tell either (said through ``warn`` once a fit)."""
        if not comparable:
            return False
        candidates = self._rollback_candidates(model, step, optimizers, schedulers)
        losses_at = self._rerun_or_inconclusive(model, losses_at, warn)
        for target in candidates:
            try:
                flagged, reference = losses_at(target)
            except InconclusiveCheck:
                return False
            if math.isfinite(flagged) or not math.isfinite(reference):
                return False
        return bool(candidates)

    @property
    def tests_data_at_snapshot(self) -> bool:
        """Whether a step past the presumption (:attr:`presumes_data`) may still be the data's by the snapshot
        test (:meth:`recurs_at_snapshot`): for :data:`RECURRING_DATA_FAULTS` steps in a row, then the model's,
        so that a data stream gone bad for good escalates (as ``EscalationPolicy`` does with recurring
        spikes and no healthy step between)."""
        return self.unchecked_data_faults < UNCHECKED_DATA_FAULTS + RECURRING_DATA_FAULTS

    def take_snapshot(
        self,
        step: int,
        model: nn.Module,
        optimizers: Sequence[Any],
        schedulers: Sequence[Any],
        states: Any,
        warn: Callable[[str], Any] | None = None,
        all_reduce_sum: Callable[[Tensor], Tensor] | None = None,
    ) -> bool:
        """Snapshot the training state with the books a rollback returns to (detector, lineage, carried),
        unless it holds non-finite values (:meth:`nonfinite_state`, on any rank: ``all_reduce_sum`` sums the
        finding). A branch the loss does not use (a task head, a rarely routed expert) can go NaN with the
        loss finite: a rollback must not return there, and such a snapshot would evict a finite one. It is
        left out (the first of a stretch said through ``warn``) and the next is due a period later. Whether
        it was taken.

        A buffer or carried tensor infinite in an element the previous snapshot held finite (BatchNorm's
        running variance overflowed on a finite step) is said through ``warn``, once a fit
        (:func:`turned_infinite_message`): the snapshot keeps it, and from then on it counts as by design.
        The previous snapshot is the fit-start one only until the next: compared with the copy of the forward
        state kept after the fit's first step instead (:meth:`forward_evidence`), a mask filled at the
        first forward is not said. A screen of the forward state, and an element-wise comparison of what is
        infinite, per snapshot. Each snapshot also learns which buffers forwards write
        (:class:`~lightning_pulse.core.snapshots.PreStepBuffers`: those that start being written later).

        A fit resumed mid-incident takes none at its start (:meth:`start`): the state it resumes at went bad,
        and its ring holds what the uninterrupted run's held, which took none during the incident either."""
        if self.resumed_mid_incident and step == self.fit_start:
            self.resumed_mid_incident = self.snapshot_owed = False  # owed at train start: taken by none
            last = self.schedule.last_step  # the next periodic one is due when the uninterrupted run's is
            self.schedule.settle(step, optimizers, schedulers)
            self.schedule.last_step = last
            return False
        self.pre_step.learn(model, self.schedule.ring.newest(), optimizers)
        # this snapshot (or one left out) follows the cut, and holds what a request asked for
        self.replaced_at, self.snapshot_owed, self.schedule.pending = None, False, False
        carried = carried_tensors(model)
        bad = self.nonfinite_state(model, optimizers, carried)
        nonfinite = bool(bad)
        if all_reduce_sum is not None:  # every rank takes the snapshot, or none (their rings stay alike)
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
            nonfinite = bool(all_reduce_sum(torch.tensor([float(nonfinite)], device=device)).item())
        if nonfinite:
            if self.left_out is None:
                self.left_out = (step, bad)
                if warn is not None:
                    warn(left_out_message(step, bad))
            self.schedule.settle(step, optimizers, schedulers)
            return False
        self.left_out = None
        if warn is not None and not self.overflow_warned:
            # compared before the new snapshot may refill the buffers of the previous one
            _, since, previous = self.forward_evidence(model)
            current = current_forward_state(model, carried)
            # no NaN here (screened above): each non-finite one is infinite, compared with the previous copy
            infinite = newly_nonfinite(current, previous, nonfinite_tensors(current)) if previous else []
            if infinite:
                self.overflow_warned = True
                warn(turned_infinite_message(infinite, since, step))
        extra = {"detector": self.detector.state_dict(), "carried": carried}
        # a resumed fit's snapshot of the state it resumes at keeps the checkpoint's last periodic step, so
        # the next is due when the uninterrupted run's is (counted from the resume, later rollbacks returned
        # elsewhere); unless one was due at the resume step, periodic or asked for (a maintain entry, a
        # cut), and came after the save: this one is it
        last, every = self.schedule.last_step, self.schedule.every
        due, self.resumed_snapshot_due = self.resumed_snapshot_due, False
        resumed = step == self.fit_start and step and not due and last is not None and every
        resumed = resumed and step - last < every
        try:
            self.schedule.take(
                step, model, optimizers, schedulers, states, extra={**extra, **self.policy.lineage()}
            )
        except StateCopyError as error:  # a user's opted-in state: at the fit-start snapshot, its first
            raise PulseRefusal(uncopyable_state_message(error)) from error
        if resumed:
            self.schedule.last_step = last
        return True

    @staticmethod
    def nonfinite_state(model: nn.Module, optimizers: Sequence[Any], carried: Mapping[str, Any]) -> list[str]:
        """The tensors of the training state (:func:`state_tensors`) holding values a rollback must not return
        to: a NaN or an infinity in a parameter or an optimizer-state tensor; a NaN in a buffer or a carried
        tensor, where an infinity can be by design (an attention mask of ``-inf``, an observer's starting
        ``inf``) and a NaN never is. One pass over the state, on its devices, and one transfer per device."""
        trained, forward = state_tensors(model, optimizers, carried)
        return nonfinite_tensors(trained, nan_only=forward)

    def return_to_snapshot(
        self,
        model: nn.Module,
        state: tuple[Sequence[Any], Sequence[Any], Mapping[str, Any]],
        step: int,
        warn: Callable[[str], Any],
    ) -> tuple[TrainingSnapshot | None, int]:
        """Restore the newest snapshot taken ``rollback_margin`` steps before the incident (before its first
        flagged step, or ``step``; when the rollback test found that snapshot damaged too, before the one it
        chose), with ``state`` (optimizers, LR schedulers, rollback-aware callbacks), the detector's windows,
        the carried tensors and the policy's books. Returns the snapshot (``None``: none fits) and the applied
        steps undone."""
        start = first_flagged = self.policy.incident_start
        if self.rollback_to is not None:
            start, self.rollback_to = self.rollback_to + self.schedule.margin, None
        held = list(self.schedule.ring)  # the ones that do not fit go now
        # a schedule that led the run back into this incident stays where it is (ScheduleReplay.decide)
        incident, ring = list(self.policy.spike_steps), self.schedule.ring
        guess = ring.newest_at_or_before((step if start is None else start) - self.schedule.margin)
        rewind = self.config.rewind_lr_schedule
        rewind = self.lr_replay.decide(incident, guess or ring.oldest(), rewind, self.schedule.margin)
        target, predates = self.schedule.roll_back(step if start is None else start, model, *state, rewind)
        self.lr_replay.rolled_back(incident, rewind, target is not None)
        if target is None:
            # the model still fits one: the optimizers or LR schedulers changed since, with no healthy step
            # after the change to snapshot (no_snapshot_message says what helps then)
            fitting = [snapshot.step for snapshot in held if snapshot.fits(model)]
            self.unfit_optimizers_after = max(fitting) if fitting else None
            self.cut_unsnapshotted = self.replaced_at
            optimizers = "its optimizers' classes, parameter groups or parameters"
            why = f"fits the model any more (or {optimizers}, or its LR schedulers)"
            if self.left_out is not None:
                left_out = f"none was taken since step {self.left_out[0]} (a non-finite state)"
                why = f"{why}, and {left_out}" if held else f"with a finite state is held: {left_out}"
            warn(f"StabilityGuard: no snapshot {why}; the parameters stay as they are.")
            return None, 0
        self.left_out = None  # the state is the snapshot's now, and finite
        self.applied_through = target.step  # the steps applied since are undone
        # a healthy checkpoint carries no ring: the snapshot of the state resumed at stands in for the older
        # ones the uninterrupted run holds, also where the rollback test chose it (it then "predates")
        resumed = (
            f" (this fit resumed at step {target.step} from a checkpoint saved with no incident open, which "
            "carries no snapshots: the uninterrupted run would return to an older one)"
            if self.fit_start and target.step == self.fit_start
            else ""
        )
        if not predates:
            warn(f"StabilityGuard: no snapshot predates step {start} enough; using the oldest one{resumed}.")
        elif (
            resumed
            and target.step > (step if first_flagged is None else first_flagged) - self.schedule.margin
        ):
            warn(
                f"StabilityGuard: the rollback returns to step {target.step}, less than `rollback_margin`="
                f"{self.schedule.margin} steps before the incident{resumed}."
            )
        self.detector.load_state_dict(target.extra["detector"])
        restore_carried_tensors(model, target.extra.get("carried", {}))
        return target, self.policy.rewind(target.extra)

    def conclude_rollback(
        self, action: Action, step: int, target: TrainingSnapshot | None, undone: int, root_dir: str
    ) -> tuple[str, str | None]:
        """Book what :meth:`return_to_snapshot` did for ``action`` at the flagged ``step``: a rollback to
        ``target`` (``undone`` applied steps undone) returns its warning and ``None``; a stop, or a rollback that
        found no snapshot, returns the error's message and the checkpoint path (:func:`stop_checkpoint_path`
        under ``root_dir``) the caller saves before raising it."""
        to_step = None if target is None else target.step
        if action is Action.ROLLBACK and target is not None:
            self.policy.rolled_back(step, to_step, undone)
            self.lr_replay.mark(self.policy.events[-1])
            return rollback_message(self.policy, step, to_step, undone) + self.lr_replay.rollback_note(), None
        # a rollback with no snapshot to return to cannot help: training on would report a run on a bad state
        recent_rollbacks = len(self.policy.rollback_steps)
        self.policy.stop(step, to_step, undone)
        self.lr_replay.mark(self.policy.events[-1])
        path = stop_checkpoint_path(self.config, root_dir, step)
        if action is Action.ROLLBACK:
            unfit = (self.left_out, self.unfit_optimizers_after, self.cut_unsnapshotted)
            return no_snapshot_message(step, path, *unfit), path
        resumed_at = self.fit_start if self.fit_start else None  # a fit started at step 0 resumed nothing
        thresholds = (self.detector.loss_zscore, self.detector.grad_norm_zscore)
        stopped = (self.policy, step, to_step, recent_rollbacks, path, resumed_at, thresholds, self.maximized)
        return stop_message(*stopped) + self.lr_replay.stop_note(), path

    def parameters_replaced(
        self, step: int, model: nn.Module | None = None, record: StepRecord | None = None
    ) -> None:
        """A structured prune replaced parameters (and buffers: a BatchNorm's of the channels cut) at the step
        that leaves the counter at ``step``: older snapshots no longer fit, so one follows the cut, in a
        healthy state. Where the step has ended applied (:meth:`StepRecord.applied` of ``record``: the cut
        came after the guard's batch end, StabilityGuard listed first), before the next step's first forward
        (:attr:`snapshot_owed`): the weights just judged healthy, with the cutter's books complete, as the
        guard listed last snapshots them (once per cut; every DDP rank is told of the cut and decides alike,
        on all-reduced numbers). Else at the end of the step if applied, or of the first applied step after
        it (:meth:`finish_step`); before, a flagged step right after a cut left no snapshot that fit.

        The cut starts a new incident: a rollback cannot go back past it, so the flagged steps before it are
        forgotten (an incident they opened kept every snapshot away, and a flagged step after the cut
        stopped the run). The pre-step copy is dropped (its shapes and modules may be gone), the buffers
        forwards write learned anew from ``step``; those ``model`` still holds stay learned, copied again from
        the next step on (``keep`` of :meth:`PreStepBuffers.clear`: a step skipped before the next applied one
        set back only what was non-finite where no snapshot followed the prune)."""
        self.policy.spike_steps = []
        self.replaced_at = step
        self.pre_step.clear(learn_after=step, keep=model)
        if record is not None and (record.applied(step) or record.forced):
            # a skip after a rollback drops a batch, on the snapshot's weights: snapshotted as healthy
            self.snapshot_owed = self.policy.healthy or record.forced
        else:
            self.schedule.pending = self.schedule.pending or self.policy.healthy

    def request_maintain_snapshot(
        self,
        change: PhaseChange,
        probe: Mapping[str, float],
        record: StepRecord | None = None,
        step: int = -1,
    ) -> bool:
        """Ask for a snapshot at the end of this step (the one that leaves the counter at ``step``) when
        ``change`` starts a maintain phase (:func:`maintain_snapshot_wanted`, in the policy's health). Told
        after the step's batch end in ``record`` (a callback listed after the guard announced it): dropped if
        the step was not applied, as :meth:`finish_step` drops it; else ``True``, the caller snapshots once
        every callback's batch end closed the step (:attr:`SnapshotSchedule.pending` stays set until then)."""
        if not maintain_snapshot_wanted(self.config, change, probe, self.policy.healthy):
            return False
        ended = record is not None and record.decided is None and record.ended is not None
        ended = ended and record.ended[0] == step
        self.schedule.pending = not ended or record.applied(step)
        return ended and self.schedule.pending

    def summary(self) -> str | None:
        """The end-of-training line of this fit (:func:`summary_message`), or ``None``."""
        return summary_message(
            self.policy,
            self.detector,
            self.fit_start_accepted,
            self.fit_start_unjudged,
            self.fit_start_negative,
            self.maximized,
        )

    def flag_message(
        self,
        step: int,
        verdict: Verdict,
        action: Action,
        loss: float | None,
        grad_norm: float | None,
        key: str,
    ) -> str:
        """The line of a flagged step (:func:`flag_message`), ``loss`` as the module returned it (shown as
        judged: negated where the optimizers maximize it)."""
        if self.maximized and loss is not None:
            loss = -loss
        return flag_message(step, verdict, action, loss, grad_norm, key, self.detector, self.maximized)

    def say_flagged(
        self,
        say: Callable[[str], Any],
        step: int,
        verdict: Verdict,
        action: Action,
        loss: float | None,
        grad_norm: float | None,
        key: str,
    ) -> None:
        """``say`` the line of a flagged step (:meth:`flag_message`) for the first :data:`FLAG_LINES_PER_FIT`
        of a fit, then :data:`FLAG_LINES_CAPPED` once, then only a rollback's or a stop's (a recurring fault
        over a long run printed a line per flagged step)."""
        self.flag_lines += 1
        if self.flag_lines <= FLAG_LINES_PER_FIT or action in (Action.ROLLBACK, Action.STOP):
            say(self.flag_message(step, verdict, action, loss, grad_norm, key))
        elif self.flag_lines == FLAG_LINES_PER_FIT + 1:
            say(FLAG_LINES_CAPPED)

    def _keep_before_step(self, step: int, counts: tuple[int, int] | None = None) -> None:
        """Keep what flagging optimizer step ``step`` changes in a checkpoint, as it was before (the detector's
        ``counts`` of losses it cannot judge, before the step's judgement; else they are taken back from the
        step's loss): where a checkpoint is saved inside the step, which a resume trains again
        (:meth:`_state_before`). Flagged steps only: a healthy one changes the baselines at its end."""
        detector = self.detector.state_dict()
        if counts is not None:
            detector["unjudged_losses"], detector["negative_losses"] = counts
        kept = {
            "detector": detector,
            "policy": self.policy.state_dict(),
            "bad_samples": [dict(sample) for sample in self.bad_samples],
            "level": {**self.level.state_dict(), "applied": self.level_steps},
            "incident_snapshots": self.incident_snapshots(),
        }
        self.before_step = (step, kept, counts is not None)

    def _state_before(self, state: dict[str, Any], record: StepRecord) -> dict[str, Any]:
        """``state`` (:meth:`state_dict`'s) as before the step in flight in ``record`` (decided, its update not
        run): a resume trains it again and judges it once more. A healthy step's values have not entered the
        baselines (:meth:`SpikeDetector.accept_held`); a flagged step's changes are taken back
        (:meth:`_keep_before_step`), a forced skip's count too, and the losses its judgement could not judge."""
        step, counted_back = record.step_after - 1, False
        if self.before_step is not None and self.before_step[0] == step:
            kept, counted_back = dict(self.before_step[1]), self.before_step[2]
            if snapshots := kept.pop("incident_snapshots"):
                kept["incident_snapshots"] = [snapshot_state(snapshot) for snapshot in snapshots]
            else:
                state.pop("incident_snapshots", None)
            state = {**state, **kept}
        if record.forced:  # not judged: one fewer skip left
            state["policy"] = {**state["policy"], "skip_remaining": state["policy"]["skip_remaining"] + 1}
        elif not counted_back:  # judged healthy (finite values), or flagged at a later closure evaluation
            detector = state["detector"] = dict(state["detector"])
            unjudged, negative = self.detector.counted_unjudged(record.loss)
            detector["unjudged_losses"] -= unjudged
            detector["negative_losses"] -= negative
        return state

    def state_dict(
        self, snapshot_due: bool = False, record: StepRecord | None = None, in_unfinished_step: bool = False
    ) -> dict[str, Any]:
        """The guard's state for a checkpoint. ``snapshot_due``: a snapshot of this step comes after the save
        (once every callback's batch end ran); so does one owed or requested here. A fit resumed from it
        takes that one at its start (:meth:`take_snapshot`). ``in_unfinished_step``: saved inside the
        training step in ``record`` before its update, which a resume trains again
        (``compat.in_unfinished_step``): where it was decided, the state before it (:meth:`_state_before`),
        so that the resume judges and counts it once; after its update, its values are in the baselines."""
        if not in_unfinished_step:  # after the update, before the guard's batch end: its values are in
            self.detector.accept_held()
        state = {
            "detector": self.detector.state_dict(),
            "policy": self.policy.state_dict(),
            "last_snapshot_step": self.schedule.last_step,
            "snapshot_due": bool(snapshot_due or self.snapshot_owed or self.schedule.pending),
            "bad_samples": self.bad_samples,
            "level": {**self.level.state_dict(), "applied": self.level_steps},
            "written_by_forwards": list(self.pre_step.names),
            "maximized": self.maximized,  # the sign of the loss windows' values
            "lr_replay": self.lr_replay.state_dict(),
            # the open incident's flagged steps: a rollback or stop after the resume books their scores
            "flagged": {
                "losses": {step: list(values) for step, values in self.flagged_losses.items()},
                "scores": {step: list(clearing) for step, clearing in self.flagged_scores.items()},
            },
        }
        # (a checkpoint saved before this fit's start keeps the restored one)
        if (samples := self.samples_per_step or self.resumed_samples_per_step) is not None:
            state["samples_per_step"] = samples  # what the windows were measured at
        if snapshots := self.incident_snapshots():
            state["incident_snapshots"] = [snapshot_state(snapshot) for snapshot in snapshots]
        if in_unfinished_step and record is not None and record.decided is not None:
            return self._state_before(state, record)
        return state

    def incident_snapshots(self) -> list[TrainingSnapshot]:
        """While an incident is open (steps flagged, no rollback or stop yet), the snapshots its rollback may
        return to (the one taken ``rollback_margin`` steps before it, and the oldest, which the rollback test
        tries next): the state a checkpoint holds may have gone bad since them, so a fit resumed from it
        needs them to roll back as the uninterrupted run does. Else none: a checkpoint of a healthy state (or
        of one a rollback just restored) holds what a snapshot would."""
        start, ring = self.policy.incident_start, self.schedule.ring
        if start is None or self.policy.stopped:
            return []
        if self.resumed_snapshots:  # loaded, the fit not started yet: a checkpoint now saves them again
            return self.resumed_snapshots
        wanted = [ring.newest_at_or_before(start - self.schedule.margin), ring.oldest()]
        held = {snapshot.step: snapshot for snapshot in wanted if snapshot is not None}
        return [held[step] for step in sorted(held)]  # in the ring's order, oldest first

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.detector.load_state_dict(state_dict["detector"])
        # checkpoints of earlier versions kept the counters next to the policy's state
        self.policy.load_state_dict({**state_dict, **state_dict["policy"]})
        last = state_dict["last_snapshot_step"]
        self.schedule.last_step = None if last is None else int(last)
        self.resumed_snapshot_due = bool(state_dict.get("snapshot_due", False))
        self.bad_samples = [dict(sample) for sample in state_dict.get("bad_samples", [])]
        self.level.load_state_dict(state_dict.get("level", {}))
        self.level_steps = int(state_dict.get("level", {}).get("applied", 0))
        self.lr_replay.load_state_dict(state_dict.get("lr_replay", {}))  # absent before: nothing kept
        self.lr_replay_resumed = True
        self.resumed_written = [str(name) for name in state_dict.get("written_by_forwards", [])]
        self.resumed_snapshots = [snapshot_from_state(s) for s in state_dict.get("incident_snapshots", [])]
        # a checkpoint from before the direction was read judged the loss as returned
        self.resumed_maximized = bool(state_dict.get("maximized", False))
        samples = state_dict.get("samples_per_step")  # absent before this version: taken as this fit's
        self.resumed_samples_per_step = None if samples is None else int(samples)
        flagged = state_dict.get("flagged", {})  # absent before this version: the incident's steps unknown
        self.resumed_flagged = (
            {
                int(step): (float(loss), None if grad is None else float(grad))
                for step, (loss, grad) in flagged.get("losses", {}).items()
            },
            {int(step): Clearing(*map(float, scores)) for step, scores in flagged.get("scores", {}).items()},
        )
        # what it holds until the fit starts (and a save before then saves again)
        self.flagged_losses, self.flagged_scores = (
            dict(self.resumed_flagged[0]),
            dict(self.resumed_flagged[1]),
        )


def maximize_changed_message(saved: bool, own: bool) -> str:
    """Why a resumed fit's loss baselines were dropped: the checkpoint judged the loss with the other sign."""
    judged = {True: "the negated loss (`maximize=True`)", False: "the loss as returned"}
    return (
        f"StabilityGuard: the checkpoint's loss baselines hold {judged[saved]}, this fit judges {judged[own]} "
        "(a checkpoint saved before the guard read `maximize`, or optimizers whose `maximize` changed); they "
        "were dropped and fill again over the next `warmup` steps (the gradient-norm baselines are kept)."
    )


def guard_figure(name: str) -> property:
    """A read-only property that reads ``self.policy``'s ``name``: how
    :class:`~lightning_pulse.StabilityGuard` shows its policy's figures."""
    return property(lambda self: getattr(self.policy, name), doc=f"The policy's ``{name}`` (checkpointed).")


def guard_metrics(policy: EscalationPolicy, with_energy: bool) -> dict[str, float]:
    """The stability figures logged under ``stability/`` (wasted energy only ``with_energy``, and beside it
    ``steps_lost_unmetered`` once a lost step's energy was unknown)."""
    spikes = policy.spikes_by_kind
    out = {
        "stability/spikes": float(policy.spikes_detected),
        "stability/steps_skipped": float(policy.steps_skipped),
        "stability/bad_batches": float(policy.bad_batches),
        "stability/recurring_spikes": float(policy.recurring_spikes),
        "stability/rollbacks": float(policy.rollbacks),
        "stability/steps_lost": float(policy.steps_lost),
        **{f"stability/spikes_{kind}": float(n) for kind, n in spikes.items()},
    }
    if with_energy:
        out["stability/energy_wasted_kwh"] = policy.energy_wasted_kwh
        # lost steps of unknown energy, not in the figure above: said beside it
        if policy.steps_lost_unmetered:
            out["stability/steps_lost_unmetered"] = float(policy.steps_lost_unmetered)
    return out


def maintain_snapshot_wanted(
    config: StabilityGuardConfig, change: PhaseChange, probe: Mapping[str, float], healthy: bool
) -> bool:
    """Whether a phase change asks for a snapshot: a maintain phase begins (not a resume) in a healthy state
    with a finite probe, and ``config.snapshot_at_maintain``."""
    if not config.snapshot_at_maintain or change.current is not Phase.MAINTAIN or change.reason == "resume":
        return False
    return healthy and all(math.isfinite(value) for value in probe.values())


def uncopyable_state_message(error: StateCopyError) -> str:
    """The refusal of a snapshot that cannot copy a callback's rollback state (:class:`StateCopyError`)."""
    owner = getattr(error.stateful, "callback", error.stateful)
    name, own = type(owner).__name__, callable(getattr(owner, "rollback_state_dict", None))
    method = "rollback_state_dict()" if own else "state_dict()"
    where = f"{method}{error.part[0]} is a {error.part[1]} and" if error.part else f"{method}"
    return (
        f"StabilityGuard: {name} sets `restore_on_rollback = True`, so every snapshot copies its state, but "
        f"its {where} cannot be copied ({error}). Give {name} a `rollback_state_dict()` that returns only "
        "tensors and values `copy.deepcopy` can copy (and a `load_rollback_state_dict(state)` that restores "
        "them), or set `restore_on_rollback = False` to keep its state out of rollbacks."
    )


def stop_checkpoint_path(config: StabilityGuardConfig, root_dir: str, step: int) -> str:
    return config.stop_checkpoint_path or os.path.join(
        root_dir, "stability_guard", f"stopped-step={step}.ckpt"
    )


def refuse_unwritable_stop_path(
    path: str | None, decides: bool, from_rank_zero: Callable[[list[Any]], list[Any]] | None
) -> None:
    """Raise :class:`PulseRefusal` at fit start where ``config.stop_checkpoint_path`` cannot be written: found
    at the stop, the save's error would come instead of the guard's, and the checkpoint would be lost. Rank 0
    writes it, so it ``decides``; under DDP ``from_rank_zero`` hands every rank its finding (they refuse
    together). A remote path (``s3://...``) is left to the checkpoint IO's file system."""
    reason = None
    if decides and path is not None and "://" not in path:
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            reason = "it is a folder"
        elif os.path.exists(path) and not os.access(path, os.W_OK):
            reason = "it exists and is not writable"
        elif (why := unwritable_dir_reason(folder)) is not None:
            reason = f"its folder {folder!r} {why.removeprefix('it ')}"
    if from_rank_zero is not None:
        reason = from_rank_zero([reason])[0]
    if reason is not None:
        raise PulseRefusal(
            f"StabilityGuard: `config.stop_checkpoint_path`={path!r} cannot hold the checkpoint the guard "
            f"saves when it stops a run ({reason}); give a file path in a writable folder, or None for "
            "<default_root_dir>/stability_guard/stopped-step=<step>.ckpt."
        )


def stop_error(
    message: str,
    path: str,
    save: Callable[[], None],
    barrier: Callable[[], None],
    from_rank_zero: Callable[[list[Any]], list[Any]] | None,
) -> StabilityGuardError:
    """The :class:`StabilityGuardError` of a stop with ``message``, after ``save`` wrote its checkpoint to
    ``path``. A save that fails (a full disk, a folder removed since fit start) must not hide the error: its
    reason is added and the error chained to it. Rank 0 writes: after its failure ``barrier`` meets the
    ranks waiting in the save's own barrier, and under DDP ``from_rank_zero`` gives each rank the reason."""
    failure: Exception | None = None
    try:
        save()
    except Exception as error:
        failure = error
        barrier()
    reason = None if failure is None else f"{type(failure).__name__}: {failure}"
    if from_rank_zero is not None:
        reason = from_rank_zero([reason])[0]
    if reason is None:
        return StabilityGuardError(message, checkpoint_path=path)
    stopped = StabilityGuardError(
        f"{message} But that checkpoint could not be written ({reason}): no file holds the state, the model "
        "and optimizers in memory do; save them now with trainer.save_checkpoint(<a path in a writable "
        "folder>).",
        checkpoint_path=None,
    )
    stopped.__cause__ = failure
    return stopped


def fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def unjudged_loss_message(loss: float | None, maximized: bool = False) -> str:
    """The warning at the first judged loss <= 0; ``maximized``: the loss is judged negated (as ``-loss``),
    the optimizers maximize it."""
    if maximized:  # a reward >= 0: judged as -loss <= 0
        told = "0" if loss is not None and loss == 0 else f"{fmt(loss)} <= 0"
        return (
            f"StabilityGuard: -loss is {told} ({MAXIMIZED_WHY}), which a log scale cannot judge; spikes of "
            "-loss (drops of the loss) go unnoticed. Pass `config=StabilityGuardConfig(loss_scale='linear')` "
            "for such losses."
        )
    if loss is not None and loss == 0:  # a hinge, triplet or margin loss: nothing to change
        return (
            "StabilityGuard: the loss is 0, which a log scale cannot judge: such losses are left out of the "
            "loss baselines and the positive losses are judged against the positive ones, once `warmup` of "
            "them fall within the last `window` steps (before, only a loss 10x their median is a spike). "
            "Only a loss that goes below 0 needs `config=StabilityGuardConfig(loss_scale='linear')`; a "
            "linear scale flags every positive loss of a window mostly at 0."
        )
    return (
        f"StabilityGuard: the loss is {fmt(loss)} <= 0, which a log scale cannot judge; loss spikes go "
        "unnoticed. Pass `config=StabilityGuardConfig(loss_scale='linear')` for such losses."
    )


#: flagged-step lines printed in a fit before :data:`FLAG_LINES_CAPPED` (rollbacks and stops: always)
FLAG_LINES_PER_FIT = 10
FLAG_LINES_CAPPED = (
    f"StabilityGuard: {FLAG_LINES_PER_FIT} flagged steps printed in this fit; further flagged steps are counted "
    "in the logged stability/* metrics and the end-of-training line, and only rollbacks and stops are printed."
)


def flag_message(
    step: int,
    verdict: Verdict,
    action: Action,
    loss: float | None,
    grad_norm: float | None,
    key: str,
    detector: SpikeDetector,
    maximized: bool = False,
) -> str:
    """The line of a flagged step; ``maximized``: ``loss`` and its median are of the negated loss (the
    optimizers maximize it), named ``-loss``."""
    baseline = detector.baseline(key)
    # a log scale's loss window holds the positive losses only: with a loss <= 0 seen, not the run's median
    positive = " of the positive losses" if detector.loss_scale == "log" and detector.unjudged_losses else ""
    name, note = (MAXIMIZED_LOSS, f"; {MAXIMIZED_LOSS}: {MAXIMIZED_WHY}") if maximized else ("loss", "")
    positive = positive.replace("losses", "values") if maximized else positive
    return (
        f"StabilityGuard: step {step} flagged as {verdict} ({name}={fmt(loss)}, grad_norm={fmt(grad_norm)}; "
        f"{key} medians {name}={fmt(baseline['loss'])}{positive}, grad_norm={fmt(baseline['grad_norm'])}"
        f"{note}); action: {action}."
    )


def data_fault_message(
    step: int,
    samples: list[dict[str, Any]],
    mended: Sequence[str] = (),
    snapshot_step: int | None = None,
    before_step: bool = False,
) -> str:
    # the step says how old the values are: carried state (an RNN's hidden state) restarts from there
    at = "the newest snapshot's values" if snapshot_step is None else f"their values at step {snapshot_step}"
    at = "their values before this step" if before_step else at
    wrote = f" Its forward had written them into {', '.join(mended)}: set back to {at}." if mended else ""
    return (
        f"StabilityGuard: step {step} has non-finite values in its data ({describe_bad_samples(samples)}); "
        f"the model is healthy, so the step is skipped and training goes on.{wrote} Later such steps are "
        "skipped silently: see `StabilityGuard.bad_samples` and the `stability/bad_batches` counter."
    )


#: what makes a loss non-finite on finite inputs at the snapshot's weights too, and the way out (the end line)
NONFINITE_LOSS_CAUSES = (
    "samples whose loss is non-finite at any weights, on finite inputs: a CTC target longer than its input "
    "(the way out: Hugging Face `ctc_zero_infinity=True`, `nn.CTCLoss(zero_infinity=True)`), a log of 0, "
    "inputs so large that the forward overflows; fix those samples or make the loss finite for them"
)


def presumption_ended_message(step: int) -> str:
    return (
        f"StabilityGuard: step {step} is non-finite with NaN or +inf values in its data, like the "
        f"{UNCHECKED_DATA_FAULTS} non-finite steps before it with no applied step between, and whether the "
        "data made them non-finite could not be checked (the loss could be recomputed neither without the bad "
        "rows nor with them set to 0: the module failed on or skipped those batches, or the loss was finite "
        "and the gradient not). Data that holds NaN on purpose (missing labels a loss masks out) would hide "
        "a fault of the model for ever, so until a step applies such a step is the data's only if its batch "
        "is non-finite on the snapshots a rollback would return to as well, and for "
        f"{RECURRING_DATA_FAULTS} steps in a row at most; otherwise it escalates as the model's. Said once "
        "per fit."
    )


#: the warning when recomputing a non-finite step's loss runs out of memory (said once a fit)
RERUN_FAILED = (
    "StabilityGuard: re-running training_step on a flagged step's batch to test it on a snapshot {failure}; "
    "that test counts as inconclusive (a spike is rolled back as untested, a non-finite step is not blamed "
    "on the data by it). Said once per fit."
)


def _release_cuda_cache(model: nn.Module) -> None:
    """After a check ran out of memory: give the cached blocks back on a GPU module (a LightningModule's
    ``device``), where the step's gradients are still held."""
    if getattr(model, "device", torch.device("cpu")).type == "cuda":
        torch.cuda.empty_cache()


class InconclusiveCheck(Exception):
    """A check of a flagged step could not run (a re-run of ``training_step`` failed)."""


CHECK_OUT_OF_MEMORY = (
    "StabilityGuard: recomputing a non-finite step's loss to tell bad data from a bad model "
    "ran out of memory (the step's gradients are held meanwhile); that batch counts as "
    "unchecked: its data is presumed at fault for a few steps in a row, then tested on a "
    "snapshot. Said once per fit."
)


def rollback_message(policy: EscalationPolicy, step: int, to_step: int | None, undone: int) -> str:
    return (
        f"StabilityGuard: rollback {policy.rollbacks} at step {step} to the snapshot of step {to_step} "
        f"({undone} applied step(s) undone); skipping the next {policy.skip_remaining} batch(es)."
    )


def stop_message(
    policy: EscalationPolicy,
    step: int,
    to_step: int | None,
    recent_rollbacks: int,
    path: str,
    resumed_at: int | None = None,
    thresholds: tuple[float | None, float | None] | None = None,
    maximized: bool = False,
) -> str:
    """The stop's message; ``resumed_at``: the step this fit resumed a checkpoint at (``None``: not resumed);
    ``thresholds``: the guard's ``(loss_zscore, grad_norm_zscore)``, for :func:`threshold_way_out`;
    ``maximized``: the loss was judged negated (the optimizers maximize it), which the message ends with.
    A stop back at that step's snapshot names the checkpoint first: it may hold a model gone bad before the
    guard flagged a step (a checkpoint saved mid-incident carries the snapshots a rollback needs). A stop
    whose rollbacks went untested or undid nothing says so (:func:`untested_stop_facts`) rather than blame
    the model."""
    if maximized:
        said = stop_message(policy, step, to_step, recent_rollbacks, path, resumed_at, thresholds)
        return (
            f"{said} The guard judged -loss ({MAXIMIZED_WHY}): the spikes and scores above are of -loss, a "
            "sudden drop of the loss being a spike."
        )
    flagged = [str(e["step"]) for e in policy.events if e["event"] not in ("rollback", "stop")][-8:]
    holds = (
        f"the snapshot of step {to_step}" if to_step is not None else "the current state (no snapshot fitted)"
    )
    stopped = (
        f"StabilityGuard stopped training at step {step}: spikes kept coming after {recent_rollbacks} "
        f"rollback(s) within {policy.rollback_memory} steps (`max_rollbacks`={policy.max_rollbacks})"
    )
    if resumed_at is not None and to_step == resumed_at:
        return (
            f"{stopped}. Every rollback returned to the state this fit resumed at (step {resumed_at}), its "
            f"only snapshot, and the spikes came back each time (last flagged: {', '.join(flagged)}); the "
            f"checkpoint {path!r} holds that state. If they began soon after the resume, the checkpoint it "
            "resumed from was most likely saved after the model went bad and before the guard flagged a "
            "step (one saved while steps were flagged carries older snapshots): resume from an earlier "
            "checkpoint. Otherwise inspect the data and learning rate around the flagged steps."
        )
    train_on = (
        "load the weights into a new run (YourModule.load_from_checkpoint(path), then trainer.fit): resuming "
        "with ckpt_path restores the optimizer's learning rate and the guard's rollback count too."
    )
    if (updated := nan_update_facts(policy, flagged)) is not None:
        changed = "Then, to train on with the optimizer's arguments changed,"
        return f"{stopped}. The checkpoint {path!r} holds {holds}. {updated} {changed} {train_on}"
    facts = untested_stop_facts(policy)
    if facts is None:
        return (
            f"{stopped}. The checkpoint {path!r} holds {holds}. Inspect the data around the flagged steps "
            f"(last: {', '.join(flagged)}): spikes whose batch the snapshot reproduced were skipped as the "
            "data's, so these came from the model, or were gradient-norm spikes with an ordinary loss, which "
            "are not tested that way; data with many bad samples can do it too (then clean it, or raise "
            f"`rollback_after`). To train on with a lower learning rate, {train_on}"
        )
    facts, model_ruled_out = facts
    model = (
        ""
        if model_ruled_out
        else "; or the model went bad, every batch spiking once it had: train on with a lower learning rate"
    )
    way_out, raise_both = threshold_way_out(policy, thresholds)
    return (
        f"{stopped}, and nothing shows that rolling back helps; if the loss level changed on purpose, "
        f"{way_out}. The checkpoint {path!r} holds {holds}. {facts} Readings "
        "that fit: a lasting change of the loss level made on purpose (a loss weight raised, a curriculum "
        "stage, a KL term or an auxiliary loss switched on), which looks like a run of spikes: "
        f"{raise_both}; or leave the guard out of a fit that makes such a change; "
        f"or a data stream gone bad: inspect the data around the flagged steps (last: {', '.join(flagged)})"
        f"{model}. To train on, {train_on}"
    )


def threshold_way_out(
    policy: EscalationPolicy, thresholds: tuple[float | None, float | None] | None = None
) -> tuple[str, str]:
    """The way out of a stop after a lasting change of the loss level, with the values the flagged steps
    behind its rollbacks demand (:meth:`EscalationPolicy.thresholds_passed`), against the guard's current
    ``(loss_zscore, grad_norm_zscore)``: the clause for the message's first sentence and the one for its
    readings (``thresholds`` ``None``: not known, every score counts). A threshold is named at the next
    whole number above the highest score, where that is above the current one; ``None`` where no threshold
    lets a step through (a loss judged before its window was warm, a window without spread). Both go to
    ``None`` where the steps went unscored (a non-finite one, an earlier checkpoint) or no score is above
    its threshold (booked under other thresholds, before a resume). The loss weight x10 at step 60 of
    ``tests/test_stability_guard_stop_message.py``: scores up to 100.3 (loss) and 20.9 (gradient norm)
    against 6 and 8, so 101 and 21, which train through; 30 and 30 stop."""
    passed = policy.thresholds_passed()
    current = thresholds or (0.0, 0.0)  # unknown: name every score
    named, scored = [], []
    for name, score, now in zip(("loss_zscore", "grad_norm_zscore"), passed or (0.0, 0.0), current):
        if now is None or score <= now:
            continue  # the current threshold (or None) lets those steps through already
        if math.isinf(score):
            named.append(f"`{name}` to None (no threshold lets its flagged steps through)")
            continue
        named.append(f"`{name}` to {math.floor(score) + 1} or more")
        scored.append(f"z={score:.4g} on the {'loss' if name == 'loss_zscore' else 'gradient norm'}")
    if not named:
        return (
            "set both `loss_zscore` and `grad_norm_zscore` to None to stop judging a lasting change (no "
            "threshold can be named from the flagged steps' scores; non-finite steps are still caught)",
            "set both thresholds to None",
        )
    scores = (
        f" (the flagged steps behind these escalations scored up to {' and '.join(scored)})" if scored else ""
    )
    way_out = (
        f"set {' and '.join(named)}{scores}, or both to None to stop judging a lasting change (non-finite "
        "steps are still caught)"
    )
    both = len(named) == 2
    readings = (
        "raise both thresholds to the values named above, or set both to None: the gradient norm jumps with "
        "the loss, so raising `loss_zscore` alone still stops"
        if both
        else "raise the threshold named above, or set both to None"
    )
    return way_out, readings


def nan_update_facts(policy: EscalationPolicy, flagged: Sequence[str]) -> str | None:
    """What the guard knows of a stop whose every rollback and the stop itself (``policy.escalations``) found
    the parameters or optimizer state NaN right after an applied optimizer update whose loss and gradient
    norm were finite (:meth:`EscalationPolicy.book_nan_update`): the update's own arithmetic made them NaN,
    which no learning rate changes; ``None`` otherwise. A digits MLP with ``Adam(eps=0.0)``: pixels that are
    0 in every image give their weights a gradient of 0, and the first update is 0 / (sqrt(0) + 0); the
    message used to say the spikes came from the model and advise a lower learning rate."""
    escalations = policy.escalations
    if not escalations or not all(escalation.get("nan_update") for escalation in escalations):
        return None
    names = list(dict.fromkeys(name for escalation in escalations for name in escalation["nan_update"]))
    return (
        f"Each rollback and this stop found {first_names(names, 4)} NaN right after an optimizer update "
        f"applied on a finite loss and gradient norm (flagged steps: {', '.join(flagged)}): the update "
        "itself made the NaN, and a smaller learning rate scales a NaN but does not remove it. Look at the "
        "optimizer's arguments: a division by 0 in its update (Adam, AdamW, RMSprop or Adagrad with `eps`=0 "
        "divide a gradient of 0 by a second moment of 0: 0/0; give `eps` a value above 0, as its default: "
        "1e-8 for Adam), or a learning rate, momentum or weight decay that is NaN (a schedule's 0/0)."
    )


def untested_stop_facts(policy: EscalationPolicy) -> tuple[str, bool] | None:
    """What the guard knows of a stop whose rollbacks (``policy.escalations``, within ``rollback_memory``)
    escalated unbroken rows of flagged steps without the rollback test, or undid 0 applied steps (back to the
    very weights the flagged batches were computed on): the sentence that says so and whether that rules out
    a model gone bad since the snapshot; ``None`` where every escalation was tested and undid steps. A
    lasting change of the loss level does both: a loss weight raised x10 at step 150 of a digits MLP stopped
    at step 221 after rollbacks that undid 50, 0 and 0 steps, with no test run."""
    escalations = policy.escalations
    untested = sum(bool(e["untested"]) for e in escalations)
    nothing_undone = [str(e["step"]) for e in escalations if e["undone"] == 0]
    if not untested and not nothing_undone:
        return None
    said = []
    if untested:
        which = (
            "each rollback and this stop"
            if untested == len(escalations)
            else f"{untested} of these {len(escalations)} escalations (the rollbacks and this stop)"
        )
        said.append(
            f"The flagged steps behind {which} within the last {policy.rollback_memory} steps came in an "
            "unbroken row, no ordinary step between them, which escalates without the snapshot test: nothing "
            "ruled out the data."
        )
    if nothing_undone:
        said.append(
            f"The rollback(s) or stop at step(s) {', '.join(nothing_undone)} undid 0 applied steps: the "
            "weights they returned to are the very ones the flagged batches were computed on, and they gave "
            "the same spikes, so the model did not break after that snapshot and a rollback cannot help."
        )
    return " ".join(said), bool(nothing_undone)


def named_list(names: Sequence[str], most: int = 4) -> str:
    """``"a, b, c, d and 5 more"``; ``"tensors (on another rank)"`` for none (another rank's finding)."""
    return first_names(names, most) if names else "tensors (on another rank)"


def turned_infinite_message(names: Sequence[str], since: int | None, step: int) -> str:
    verb, pronoun = ("is", "it") if len(names) == 1 else ("are", "they")
    return (
        f"StabilityGuard: {named_list(names)} {verb} infinite at step {step} where {pronoun} held finite "
        f"values at step {since}. Either a forward overflowed it (BatchNorm's running variance after "
        "a batch of huge finite values; in eval mode the layer then divides by it), or it is infinite by "
        "design (a mask a forward fills). Snapshots keep it, so a rollback no longer undoes it "
        "and later infinities there count as by design. If it overflowed, find the batch between those "
        f"steps that did it and resume from a checkpoint saved at step {since} or before. Said once per fit."
    )


def left_out_message(step: int, names: Sequence[str]) -> str:
    verb = "holds" if len(names) == 1 else "hold"
    return (
        f"StabilityGuard: no snapshot at step {step}: {named_list(names)} {verb} non-finite values. A "
        "rollback must never return to such a state, so snapshots are left out until it is finite again; a "
        "rollback returns to an older one, and with none held the run stops. With a finite loss, a branch "
        "the loss does not use (a task head, a rarely routed expert) went NaN: find what writes these values "
        "(a division by a zero norm, a hook or callback that edits the weights). A parameter infinite by "
        "design (a mask held as an `nn.Parameter`) belongs in a buffer (`register_buffer`): buffers may hold "
        "infinities."
    )


def no_snapshot_message(
    step: int,
    path: str,
    left_out: tuple[int, Sequence[str]] | None = None,
    unfit_optimizers_after: int | None = None,
    cut_at: int | None = None,
) -> str:
    """Why a rollback found no snapshot to return to, and what helps: ``left_out``, the step since which
    snapshots were left out and what was non-finite; ``unfit_optimizers_after``, the newest snapshot that
    still fits the model, not its optimizers or LR schedulers (they changed after it); ``cut_at``, the step
    of a structured pruning event no snapshot followed (the model's structure changed there)."""
    if left_out is not None:
        since, names = left_out
        return (
            f"StabilityGuard stopped training at step {step}: it had to roll back, but it holds no snapshot "
            f"with a finite state that fits the model: the snapshots since step {since} were left out "
            f"because {named_list(names)} held non-finite values, and training on would go on from the bad "
            f"state. The checkpoint {path!r} holds the current state. Find what writes non-finite values "
            f"into them, and resume from a checkpoint saved before step {since}."
        )
    if unfit_optimizers_after is not None:
        # the first healthy step after such a change is snapshotted whatever `snapshot_every`: more frequent
        # snapshots cannot help, a change the run can snapshot (at a fit's start) can
        return (
            f"StabilityGuard stopped training at step {step}: it had to roll back, but no snapshot fits its "
            f"optimizers or LR schedulers: they changed after the newest snapshot (step "
            f"{unfit_optimizers_after}) (an optimizer swapped for another class: `trainer.optimizers = "
            "[...]`; a group added to an optimizer's parameter groups: BackboneFinetuning, "
            "`optimizer.add_param_group`; parameters replaced by new ones: a submodule assigned anew, "
            "`self.head = nn.Linear(...)`, with a new optimizer; StochasticWeightAveraging swapping in "
            "SWALR), and no healthy step followed the change. The first one after it would have been "
            "snapshotted whatever `snapshot_every`, so more frequent snapshots would not help; a rollback "
            "would load the old state into the new ones (undoing a replacement), and training on would go "
            f"on from the bad state. The checkpoint "
            f"{path!r} holds the current state. If the change made these steps diverge (a learning rate too "
            "high for the new optimizer), change that. To train on with the change, make it at a fit's "
            "start, which the guard snapshots: load the weights of a checkpoint saved before the change (or "
            "this one's) into a new run (YourModule.load_from_checkpoint(path), then trainer.fit) whose "
            "`configure_optimizers` returns the new optimizer and schedulers."
        )
    if cut_at is not None:
        # the guard snapshots a cut in its own step when applied, else at the first applied healthy step after
        # it, whatever `snapshot_every` or the callbacks' order: here the cut came in a step the guard
        # dropped, and the steps after it were flagged before one was applied
        return (
            f"StabilityGuard stopped training at step {step}: it had to roll back, but no snapshot fits the "
            f"model any more: channels were cut at step {cut_at} (ScheduledPrune, or another callback "
            "replacing parameters) in a step whose update the guard dropped, and this incident began before "
            "an applied step after the cut could be snapshotted, so a rollback would load the uncut state "
            f"into the cut model. More frequent snapshots would not help. The checkpoint {path!r} holds the "
            "current state. Inspect the data and learning rate around the flagged steps, and resume from "
            f"a checkpoint saved before step {cut_at} (`ckpt_path`)."
        )
    return (
        f"StabilityGuard stopped training at step {step}: it had to roll back, but no snapshot fits the "
        "model any more: its structure changed after the last one (a layer or buffer added, channels cut "
        "outside ScheduledPrune) before a healthy step could be snapshotted, and training on would go on "
        f"from the bad state. The checkpoint {path!r} holds the current state. Take snapshots more often "
        "(`snapshot_every`), so that one follows such a change."
    )


def summary_message(
    policy: EscalationPolicy,
    detector: SpikeDetector | None = None,
    fit_start_accepted: int = 0,
    fit_start_unjudged: int = 0,
    fit_start_negative: int = 0,
    maximized: bool = False,
) -> str | None:
    """The end-of-training line. A run without spikes or rollbacks says what the guard watched (the optimizer
    steps it judged in this fit, since the detector had judged ``fit_start_accepted``, and the baselines it
    judged them against), when ``detector`` is given and judged a step in this fit; else ``None``. The spike
    figures are the run's (checkpointed): "no spike" holds for this fit and, after a resume, for the steps
    before it that the guard watched. Losses a log scale could not judge in this fit (the detector's count
    beyond ``fit_start_unjudged``) are said, and then no loss median is given: it would be of the positive
    losses only. ``maximized``: the loss was judged negated (the optimizers maximize it), which the line
    names ``-loss`` and ends saying."""
    sign = (
        f" The guard judged -loss ({MAXIMIZED_WHY}): a sudden drop of the loss was a spike."
        if maximized
        else ""
    )
    unjudged = 0 if detector is None else detector.unjudged_losses - fit_start_unjudged
    negative = 0 if detector is None else detector.negative_losses - fit_start_negative
    spikes = policy.spikes_detected
    if not spikes and not policy.rollbacks:
        judged = 0 if detector is None else detector.accepted_steps - fit_start_accepted
        if detector is None or judged <= 0:
            return None
        baseline = detector.baseline(POOLED)
        if unjudged:
            baseline.pop("loss")
        if maximized and "loss" in baseline:
            baseline = {MAXIMIZED_LOSS: baseline.pop("loss"), **baseline}
        medians = ", ".join(
            f"{name.replace('_', ' ')} {value:.4g}" for name, value in baseline.items() if value is not None
        )
        clean = f"StabilityGuard: no spike or non-finite value in this fit's {judged} optimizer step(s)"
        if not unjudged:
            return (
                clean
                + (f" (medians of the last {detector.window} at most: {medians})." if medians else ".")
                + sign
            )
        medians = f"medians of the last {detector.window} at most: {medians}; " if medians else ""
        note = unjudged_losses_note(unjudged, "their", negative, maximized)
        return (
            f"{clean}, but {note} ({medians}no loss median: on a log scale it would be of the positive "
            f"losses only).{sign}"
        )
    recurring = (
        f" ({policy.recurring_spikes} recurring: their batches spiked on the rollback's snapshot too, so they "
        "were skipped, not rolled back)"
        if policy.recurring_spikes
        else ""
    )
    unjudged_note = (
        " Also, " + unjudged_losses_note(unjudged, "this fit's", negative, maximized) + "."
        if unjudged
        else ""
    )
    nonfinite_note = (
        f" {policy.recurring_nonfinite} recurring incident(s) ended on a loss non-finite at the "
        f"snapshot's weights too, on a finite model: likely {NONFINITE_LOSS_CAUSES}; their batches were "
        "skipped."
        # not after a stop: every batch failing to the end is the model's (the stop's message says so)
        if policy.recurring_nonfinite and not policy.stopped
        else ""
    )
    return (
        f"StabilityGuard: {spikes} spike(s){recurring}, {policy.steps_skipped} step(s) skipped, "
        f"{policy.rollbacks} rollback(s), {policy.steps_lost} step(s) of work lost.{nonfinite_note}"
        f"{unjudged_note}{sign}"
    )


def unjudged_losses_note(count: int, whose: str, negative: int, maximized: bool = False) -> str:
    """What ``count`` of ``whose`` losses a log scale could not judge mean, ``negative`` of them < 0, and the
    way out (the end-of-training line): a linear scale only for losses below 0. Losses exactly 0 (a hinge,
    triplet or margin loss) are left out of the baselines harmlessly (a 0 is no spike). ``maximized``: the
    values judged were the negated losses, named ``-loss`` (the line ends saying why)."""
    losses = f"{MAXIMIZED_LOSS} values" if maximized else "losses"
    if not negative:
        return (
            f"{count} of {whose} {losses} {'was' if count == 1 else 'were'} 0, which a log scale leaves out "
            "of its loss baselines: the positive losses were judged against the positive ones (once `warmup` "
            "of them fell within the last `window` steps; before, only a loss 10x their median was a spike)"
        )
    return (
        f"{count} of {whose} {losses} {'was' if count == 1 else 'were'} <= 0, which a log scale cannot "
        "judge, so a loss spike there would have gone unnoticed: pass "
        "`config=StabilityGuardConfig(loss_scale='linear')` for such losses"
    )
