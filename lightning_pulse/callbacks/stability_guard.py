"""StabilityGuard: notice divergence, skip or roll back, and keep training instead of restarting the run."""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_pulse import _lightning_compat as compat
from lightning_pulse.callbacks._snapshot_moments import SnapshotMoments
from lightning_pulse.callbacks.hard_sample_replay import HardSampleReplay
from lightning_pulse.callbacks.pulse_cycle import PulseCycle, pulse_cycle_of
from lightning_pulse.core import stability_steps as steps
from lightning_pulse.core.grad_norm import step_loss_and_grad_norm
from lightning_pulse.core.stability_policy import Action, StabilityGuardConfig, StepChanges, StepEnergy
from lightning_pulse.errors import (
    OneRunPerInstance,
    StabilityGuardError,
    names_itself,
    refuse_sharded_strategy,
    refuse_uninitialized_parameters,
)
from lightning_pulse.loggers import log_to_loggers, refuse_logger_only_monitors
from lightning_pulse.phase import PhaseChange
from lightning_pulse.probe import rerun_losses
from lightning_pulse.protocols import rollback_states, tell_restored_phase

__all__ = ["StabilityGuard", "StabilityGuardConfig", "StabilityGuardError"]


def _warn_here(message: str) -> None:
    """``rank_zero_warn`` from this module: a warning the core gives on the guard's behalf points here."""
    rank_zero_warn(message)


class StabilityGuard(compat.PulseStateKey, Callback):
    r"""Detects non-finite values and loss or gradient-norm spikes, and answers them, escalating.

    Every optimizer step it reads the loss (mean over accumulation window and DDP ranks, negated if maximized)
    and the gradient norm before clipping. A :class:`~lightning_pulse.core.spike_detection.SpikeDetector`
    flags non-finite values and robust z-score spikes (median and MAD, log scale, one window per pulse phase);
    an :class:`~lightning_pulse.core.stability_policy.EscalationPolicy` answers (docs/stability-guard.md):

    1. **Skip** the update. A non-finite step whose batch holds non-finite values, and whose loss is finite
       without those rows (or, where they cannot be cut out, with them set to 0), is the data's fault:
       skipped, never escalated, its samples kept in ``bad_samples`` (where no such check can be made,
       presumed so for 8 steps in a row, then for 8 more only if the batch is non-finite on the rollback's
       snapshot too). A non-finite model state rolls back at once.
    2. **Roll back**, after ``rollback_after`` flagged steps, the model, optimizers, LR schedulers and the
       :class:`~lightning_pulse.protocols.RollbackAware` callbacks to the newest CPU snapshot taken at least
       ``rollback_margin`` steps before the trouble; the next ``skip_after_rollback`` batches are skipped. Unless
       the flagged batch spikes at that snapshot's weights too (the rollback test, each batch re-run from the
       torch generator states its step drew from): the data spikes; skipped, counted in ``recurring_spikes``.
    3. **Stop** when a rollback is needed after ``max_rollbacks`` recent ones: back to the last good snapshot,
       a checkpoint saved, :class:`StabilityGuardError` raised.

    Snapshots: every ``snapshot_every`` steps, at maintain phases and after structured pruning events, never
    during an incident, nor of a state with a non-finite parameter or optimizer state or a NaN in a buffer
    (where an infinity can be by design): a NaN in a branch the loss does not use is said once, and a rollback
    returns to an older, finite snapshot, or stops when none is held. Counters are logged under
    ``stability/``. DDP ranks decide on all-reduced numbers, so they act alike. Put the guard after callbacks
    that change gradients (``GradientCache``).

    Args:
        loss_zscore: robust z-score above which a loss is a spike; ``None`` turns loss spikes off.
        grad_norm_zscore: the same for the gradient norm; ``None`` turns it off.
        window: optimizer steps in each running baseline window.
        warmup: healthy steps a window needs before it judges spikes (non-finite values are always caught).
        rollback_after: flagged steps within ``config.spike_memory`` steps that trigger a rollback; a value
            above ``config.spike_memory`` never rolls back (flagged steps are only skipped).
        skip_after_rollback: optimizer steps (batches, or accumulation windows) skipped after a rollback.
        snapshot_every: take a snapshot every this many optimizer steps; ``0``: only at maintain phases, after
            structured pruning events and at the start of training.
        max_snapshots: snapshots kept in CPU memory.
        rollback_margin: a snapshot counts as good only if taken at least this many steps before the first
            flagged step of the incident (damage can precede its detection).
        max_rollbacks: rollbacks allowed within ``config.rollback_memory`` steps; the next needed one stops.
        config: the rarely turned knobs (:class:`~lightning_pulse.core.stability_policy.StabilityGuardConfig`).

    Raises:
        ValueError: at construction, naming the argument, for a value out of range.
        PulseRefusal: at fit start, for a module using manual optimization, or under FSDP, DeepSpeed or model
            parallelism (a rank holds a shard of the parameters), for a ``config.stop_checkpoint_path`` that
            cannot be written, and for a second run of this instance (another ``trainer.fit``) unless a
            checkpoint was restored into it; at train start, for lazy parameters, ZeroRedundancyOptimizer and
            groups mixing ``maximize``; at the first step, for optimizer-in-backward.
        StabilityGuardError: during training, when the guard stops the run (after saving a checkpoint, or
            saying why that save failed).

    Example::

        from lightning import Trainer
        from lightning_pulse import StabilityGuard

        trainer = Trainer(max_epochs=20, callbacks=[StabilityGuard(snapshot_every=200, skip_after_rollback=50)])
    """

    spikes_by_kind = steps.guard_figure("spikes_by_kind")
    steps_skipped = steps.guard_figure("steps_skipped")
    bad_batches = steps.guard_figure("bad_batches")
    recurring_spikes = steps.guard_figure("recurring_spikes")
    rollbacks = steps.guard_figure("rollbacks")
    steps_undone = steps.guard_figure("steps_undone")
    energy_wasted_kwh = steps.guard_figure("energy_wasted_kwh")
    lineage_steps = steps.guard_figure("lineage_steps")
    stopped = steps.guard_figure("stopped")
    events = steps.guard_figure("events")
    spikes_detected = steps.guard_figure("spikes_detected")
    last_snapshot_step = property(
        lambda self: self.schedule.last_step,
        doc="The step of the newest snapshot, or of a newer one left out (its state held non-finite values).",
    )
    snapshots_taken = property(lambda self: self.schedule.taken, doc="Snapshots taken in this fit.")
    undoes_step = property(lambda self: self._record.undoes, doc=steps.StepRecord.undoes.__doc__)
    on_pulse_pause = property(lambda self: self._energy.on_pulse_pause, doc=StepEnergy.on_pulse_pause.__doc__)
    bad_samples = property(
        lambda self: self.core.bad_samples,
        doc='Data faults\' samples ``{"step", "batch_idx", "rows", "indices"}``, newest last (checkpointed).',
    )
    steps_lost = property(lambda self: self.policy.steps_lost, doc=steps.EscalationPolicy.steps_lost.__doc__)

    @names_itself
    def __init__(
        self,
        loss_zscore: float | None = 6.0,
        grad_norm_zscore: float | None = 8.0,
        window: int = 100,
        warmup: int = 50,
        rollback_after: int = 3,
        skip_after_rollback: int = 20,
        snapshot_every: int = 100,
        max_snapshots: int = 2,
        rollback_margin: int = 10,
        max_rollbacks: int = 3,
        config: StabilityGuardConfig | None = None,
    ) -> None:
        super().__init__()
        self._one_run = OneRunPerInstance("StabilityGuard")
        detection = (loss_zscore, grad_norm_zscore, window, warmup)
        escalation = (rollback_after, skip_after_rollback, snapshot_every, max_snapshots, rollback_margin)
        self.core = steps.StabilityCore(config, *detection, *escalation, max_rollbacks)
        self.config, self.detector, self.policy = self.core.config, self.core.detector, self.core.policy
        self.schedule, self.snapshots = self.core.schedule, self.core.schedule.ring
        self._changes, self._energy = StepChanges(), StepEnergy()  # the energy meter: at train start
        self._keep_gradients = False  # skip by zeroing gradients and undoing the step (clipping by value)
        self._held = compat.CollectiveHold()  # tensors handed to collectives, until the backend lets go
        self._record = steps.StepRecord()  # the current optimizer step's micro-batches, losses and action
        self._entry_watch = compat.HookWatch(compat.on_training_step_input)
        self._moments = SnapshotMoments()  # snapshots after the other callbacks' part of a hook, where needed
        self._cycle: PulseCycle | None = None  # the cycle whose phase keys the baselines
        self._fixed_key = self.detector.main_key  # the key without one: "burst", or "all" without phases

    def metrics(self) -> dict[str, float]:
        """The stability figures of the run so far, as logged under ``stability/``."""
        return steps.guard_metrics(self.policy, with_energy=self._energy.counted)

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._one_run.setup(trainer, self)  # in every stage: see FitRestores
        if stage != "fit":
            return
        steps.refuse_manual_optimization(pl_module)
        refuse_sharded_strategy(trainer, "StabilityGuard", steps.SHARDED_REASON)
        path, decides = self.config.stop_checkpoint_path, trainer.is_global_zero
        steps.refuse_unwritable_stop_path(path, decides, compat.from_rank_zero(trainer))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._one_run.start(trainer)  # before anything is planned from a state of another run
        refuse_logger_only_monitors(trainer, "StabilityGuard", "stability/")
        refuse_uninitialized_parameters(pl_module, "StabilityGuard")  # after a sanity check's forward
        steps.warn_of_anomaly_detection(_warn_here)  # Lightning enables it around the fit loop, after setup
        self._changes.attach(trainer.optimizers)
        self._keep_gradients = compat.gradients_read_before_step(trainer, pl_module, self)
        self._cycle = pulse_cycle_of(trainer) if self.config.per_phase_baselines else None
        self._energy = StepEnergy.of_callbacks(trainer.callbacks, warn=rank_zero_warn)
        held = (pl_module.device, compat.SkippedStepLogs(trainer), self.core.pre_step)  # logs: a skip's go
        self._record = steps.StepRecord.of_callbacks(trainer.callbacks, HardSampleReplay, *held)  # cuts rows
        self._entry_watch.watch(trainer, self._entered)  # after every batch-start hook and a cut
        self.core.start(trainer.global_step, trainer.optimizers, pl_module, compat.samples_reader(trainer))
        steps.warn_of_converted_baselines(self.detector, _warn_here)  # another scale, key or samples a step
        self.core.snapshot_owed = True  # the start is good: snapshot after all on_train_start (or at batch 0)
        self._moments.fit_starts(trainer, self, partial(self._take_snapshot, trainer, pl_module))

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._energy.begin()  # at the first batch of an optimizer step
        if self.core.snapshot_owed:  # a cut after the last step's batch end (or the fit's start): hooks done
            self._take_snapshot(trainer, pl_module)
        self._record.add(batch_idx, batch)  # at the first: copies what forwards write; generator states later

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        record = self._record  # inline, not a record method: a hook of every micro-batch
        if record.ended_window:  # after a window without a step: are its gradients zeroed (or carried on)?
            record.settle(trainer.optimizers)
        record.losses.append(loss.detach())  # read once per optimizer step, with the gradient norm
        if record.cut is not None and record.batches:  # after every batch-start hook: the cut is made
            record.note_cut()
        if self.core.gradients_unchecked:  # the fit's first step with a backward: after its forward
            self.core.backward_moves.before(pl_module)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.core.gradients_unchecked:  # what moved inside this backward (refuse_update_in_backward)
            self.core.backward_moves.after()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # after the accumulation window, DDP's all-reduce and the AMP unscale; before clipping
        record, step = self._record, trainer.global_step
        losses = record.take_losses(step + 1, trainer.optimizers)  # the counter it leaves, for its batch end
        decided = record.decided_before_judging(self.policy)  # a forced skip, or a later closure evaluation
        if decided is not None and decided is not Action.APPLY:  # its forwards' writes: set back now
            self.core.mend_at_decision(decided, record, pl_module, optimizer, trainer.optimizers)
            return self._changes.skip(optimizer, self._keep_gradients)
        sums = self._sum_over_ranks(trainer)
        loss, grad_norm = step_loss_and_grad_norm(optimizer.param_groups, losses, sums, trainer.world_size)
        self.core.check_first_gradients(step, loss, grad_norm, pl_module, sums)  # updates made in backward
        if decided is Action.APPLY:  # SAM applies its second's gradient; spikes are judged on the first
            changes, keep = self._changes, self._keep_gradients  # a non-finite one: a skip
            return self.core.judge_later_step(record, step, loss, grad_norm, changes, optimizer, keep)
        key = self._fixed_key if self._cycle is None else self._cycle.phase.value  # baseline: phase or fixed
        # a flagged step's checks read the trainer; a note (said once) and their warnings point here
        verdict, action, cause = self.core.judge_step(
            record, step, loss, grad_norm, key, partial(self._flagged_step, trainer, pl_module), _warn_here
        )
        self.core.mend_at_decision(action, record, pl_module, optimizer, trainer.optimizers)  # a skip's
        self.core.carry_out(action, record, self._changes, optimizer, self._keep_gradients)  # hold or skip
        if action is not Action.APPLY and cause != "data":  # the first of a fit, then rollbacks and stops
            self.core.say_flagged(rank_zero_info, step, verdict, action, loss, grad_norm, key)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if (action := self._record.end()) is None:  # inside an accumulation window, or one without a step
            return self._record.drop_window(compat.window_ended(trainer), trainer.optimizers)
        self._changes.restore()  # normally done right after the step; not if a GradScaler skipped it
        energy, optimizers, schedulers = self._energy.end(), trainer.optimizers, self._schedulers(trainer)
        if self.core.finish_step(action, trainer.global_step, energy, optimizers, pl_module, schedulers):
            self._moments.step_ends(trainer, partial(self._take_snapshot, trainer, pl_module))
        if action in (Action.ROLLBACK, Action.STOP):
            self._roll_back(trainer, pl_module, action)
        if action is not Action.APPLY:
            compat.forget_comm_hook_memory(trainer)  # an undone step's compression error (PowerSGD): dropped
            log_to_loggers(trainer, self.metrics())

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record.logs.epoch_ends(trainer, _warn_here)  # before the monitors read the epoch's figures

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._one_run.end()
        self._changes.detach()
        log_to_loggers(trainer, self.metrics())
        if (summary := self.core.summary()) is not None:
            rank_zero_info(summary)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, error: BaseException) -> None:
        self._changes.detach()  # no train-end hook runs after an exception (the guard's own stop too)
        self._entry_watch.stop()
        self._moments.stop()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._changes.detach()
        self._entry_watch.stop()
        self._moments.stop()
        self._energy.release()  # an EnergyLogger's meter: not kept (nor pickled) with the guard after the fit
        self._held.wait()  # the rank may exit right after this (see compat.CollectiveHold)

    def on_pulse_phase_change(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, change: PhaseChange
    ) -> None:
        """Snapshot at the end of this step when a maintain phase starts, if healthy and the probe is finite
        (after every listener handled the change: a pruning event at maintain entry is inside the snapshot;
        told after the guard's batch end, at the end of every callback's)."""
        probe = cycle.last_probe if (cycle := pulse_cycle_of(trainer)) is not None else {}
        if self.core.request_maintain_snapshot(change, probe, self._record, trainer.global_step):
            self._moments.step_ends(trainer, partial(self._take_snapshot, trainer, pl_module), told_late=True)

    def on_pulse_parameters_replaced(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, remap: Any
    ) -> None:
        """Snapshot the cut (older snapshots no longer fit; ``StabilityCore.parameters_replaced``)."""
        self.core.parameters_replaced(trainer.global_step, pl_module, self._record)

    @override
    def state_dict(self) -> dict[str, Any]:  # a snapshot taken after the save; inside a step: as before it
        moments = self._moments
        return self.core.state_dict(moments.due_step is not None, self._record, moments.unfinished_step())

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._one_run.restored():  # loaded by validate, test or predict: no resume
            return
        self.core.load_state_dict(state_dict)

    # ------------------------------------------------------------------ flagged steps
    def _flagged_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> steps.FlaggedStep:
        """What the judged step's checks read from the trainer (``steps.FlaggedStep``), losses via ``probe``."""
        state = (trainer.global_step, self._record, trainer.optimizers, self._schedulers(trainer))
        data, sums, caches = trainer.train_dataloader, self._sum_over_ranks(trainer), trainer.callbacks
        losses = rerun_losses(trainer, pl_module, self._record, self._held)
        return steps.FlaggedStep(pl_module, *state, data, sums, steps.caches_activations(caches), *losses)

    # ------------------------------------------------------------------ snapshots and rollbacks
    def _entered(self, batch: Any) -> None:  # a method of its own: benchmarks/harness.py times it
        self._record.entered(batch)

    def _sum_over_ranks(self, trainer: pl.Trainer) -> Any:
        """The strategy's sum all-reduce under DDP (its tensors held until the backend lets go), else ``None``."""
        if trainer.world_size == 1:
            return None
        return partial(compat.reduce_held, trainer.strategy, reduce_op="sum", hold=self._held)

    def _training_state(self, trainer: pl.Trainer) -> tuple[list, list, dict[str, Any]]:
        """What a snapshot holds besides the module: optimizers, LR schedulers, opted-in callbacks, EMAs."""
        states = rollback_states(trainer, exclude=self) | compat.averaged_weights(trainer.callbacks)
        return trainer.optimizers, self._schedulers(trainer), states

    @staticmethod
    def _schedulers(trainer: pl.Trainer) -> list:  # read each step: StochasticWeightAveraging swaps one in
        return [config.scheduler for config in trainer.lr_scheduler_configs]

    def _take_snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Snapshot the state unless a rank holds values a rollback must not return to (said once)."""
        state, sums = self._training_state(trainer), self._sum_over_ranks(trainer)
        if self.core.take_snapshot(trainer.global_step, pl_module, *state, rank_zero_warn, sums):
            self._moments.plateau_readings(trainer, self.snapshots.newest().take_plateau_readings)

    def _roll_back(self, trainer: pl.Trainer, pl_module: pl.LightningModule, action: Action) -> None:
        """Back to the newest snapshot ``rollback_margin`` steps before the incident; go on, or save and raise."""
        step, state = trainer.global_step - 1, self._training_state(trainer)  # step: the flagged one (taken)
        target, undone = self.core.return_to_snapshot(pl_module, state, step, rank_zero_warn)
        if target is not None and (cycle := pulse_cycle_of(trainer)) is not None:
            tell_restored_phase(trainer, pl_module, cycle, exclude=self)  # every listener: its phase
        message, path = self.core.conclude_rollback(action, step, target, undone, trainer.default_root_dir)
        if path is None:  # rolled back: training goes on
            return rank_zero_warn(message)
        save, barrier = partial(trainer.save_checkpoint, path), partial(trainer.strategy.barrier, "stop")
        stopped = steps.stop_error(message, path, save, barrier, compat.from_rank_zero(trainer))
        log_to_loggers(trainer, self.metrics())  # after the save: no logger may cost the stop its file
        raise stopped
