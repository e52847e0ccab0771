"""ScheduledPrune: gradual pruning on the cubic schedule, in maintain windows, with real compute savings.

Lightning glue over :mod:`lightning_pulse.core.prune_schedule` (when, and to what sparsity),
:mod:`lightning_pulse.core.pruning` (the prune event, and fitting a fresh module to a pruned checkpoint),
:mod:`lightning_pulse.core.prune_setup` (options, setup checks, messages),
:mod:`lightning_pulse.core.prune_events` (the events, their records, checkpoints and rollbacks) and
:mod:`lightning_pulse.core.distillation` (optional recovery after each event).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BaseFinetuning, Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_pulse import _lightning_compat as compat
from lightning_pulse import errors
from lightning_pulse.callbacks.green_window import GreenWindow
from lightning_pulse.callbacks.pulse_cycle import phase_of, pulse_cycle_of
from lightning_pulse.core import prune_setup, pruning
from lightning_pulse.core.distillation import DistillConfig
from lightning_pulse.core.prune_events import PruneEvents, reusable_probe
from lightning_pulse.core.prune_schedule import PruneSchedule, check_int
from lightning_pulse.core.prune_setup import PRUNE_EVERY_DEFAULT, PruneOptions, check_options_apply
from lightning_pulse.loggers import log_to_loggers, refuse_logger_only_monitors
from lightning_pulse.phase import PhaseChange
from lightning_pulse.probe import PROBE_COLLECTIVES, HeldOutProbe
from lightning_pulse.protocols import step_undone, tell_weights_changed

__all__ = ["DistillConfig", "PruneOptions", "ScheduledPrune"]


class ScheduledPrune(compat.PulseStateKey, Callback):
    r"""Gradual magnitude pruning (Zhu & Gupta 2017) that runs in the maintain phases of a pulse cycle.

    Sparsity follows the cubic schedule ``s_t = s_f + (s_i - s_f)(1 - (t - t_start)/(t_end - t_start))^3``.
    With a :class:`~lightning_pulse.PulseCycle`, an event happens when a maintain phase starts; without one,
    every ``every`` optimizer steps. Targets are absolute (50% then 70% gives 70%), and what is pruned stays
    pruned. ``mode="unstructured"`` masks weights (``torch.nn.utils.prune``; no speedup on dense kernels);
    ``mode="structured"`` removes output channels with torch-pruning (coupled layers follow, output layers are
    never cut), cuts the optimizer's state in place, re-wraps DDP and tells every
    :class:`~lightning_pulse.protocols.ParametersReplacedListener`; every event, of either mode, tells every
    :class:`~lightning_pulse.protocols.WeightsChangedListener`. It traces ``forward`` on
    ``example_input_array`` (else on the first training batch, by ``forward``'s signature) and first prunes a
    copy to the schedule's levels: a model that cannot be cut safely is refused before the first step.

    Layers read without their forward (``nn.MultiheadAttention.out_proj``) and one side of a tied weight are
    never pruned; Hugging Face ``Conv1D`` layers are selected by default. The setup line names what was left
    out and why.

    Events are logged under ``prune/`` and kept in :attr:`events` and in checkpoints, which resume
    mid-schedule into a freshly built module (outside a Trainer: :meth:`load_pruned`). A
    :class:`~lightning_pulse.StabilityGuard` rollback restores this callback with the model; an undone event
    is redone at the next chance, one due in a step the guard flags at the next step it does not. Single
    device and DDP; under ``ddp_spawn``/``ddp_fork`` only unstructured mode with ``make_permanent=True``.

    Args:
        final_sparsity: share of weights (unstructured) or of channels of the chosen layers (structured)
            removed at the end of the schedule, in ``[0, 1)``.
        mode: ``"unstructured"`` or ``"structured"``.
        start: when the schedule starts: an ``int`` optimizer step, or a ``float`` share of the run.
        end: when the schedule reaches ``final_sparsity``, same forms; not before ``start``.
        every: optimizer steps between events on the step cadence (refused next to ``cadence='maintain'``).
        layer_types: layer classes (or ``torch.nn`` names, dotted paths, ``"HFConv1D"``) to prune; ``None`` for
            any layer with a ``weight``. In structured mode these are the layers whose output channels are
            removed (with ``None``, not a layer whose weight has fewer than two dimensions, a norm of any
            class or ``PReLU``: it is cut with the layer before it).
        exclude_pattern: never layers whose qualified name matches this regex (``re.search``).
        probe_batches: validation batches evaluated right after each event (and before it unless a PulseCycle
            probe of as many batches just ran); ``0`` turns the probes off.
        distill: a :class:`~lightning_pulse.core.distillation.DistillConfig` to distil the pre-event model
            into the pruned one after each event (a KL term on the logits, which ``forward`` must return).
        options: rarely turned knobs, a :class:`PruneOptions`.

    Raises:
        ValueError: at construction, naming the field, for a value out of range or of the wrong type, an
            unknown ``mode``/``cadence``/``ranking``, an invalid regex or layer type.
        PulseRefusal: at fit start, before the first step: no layer can be pruned, ``start`` after ``end``
            or after the run's last step, ``cadence="maintain"`` without a maintain phase, an unsupported
            strategy (FSDP, DeepSpeed), a model structured pruning cannot trace or cut safely (one under
            ``torch.compile``, or a trial cut over ``STRUCTURED_CHECK_SECONDS``), a lazy module whose weights
            no forward has created yet, a second run of this instance (unless a checkpoint was restored).
        ModuleNotFoundError: at construction, structured mode without torch-pruning installed.

    Example::

        from lightning import Trainer
        from lightning_pulse import PulseCycle, ScheduledPrune

        trainer = Trainer(max_epochs=30, callbacks=[
            PulseCycle(burst=20, replay=10, maintain=5),
            ScheduledPrune(final_sparsity=0.5, mode="structured"),
        ])
    """

    # a StabilityGuard rollback calls `load_rollback_state_dict` (so `load_state_dict`) during training
    restore_on_rollback = True

    @errors.names_itself
    def __init__(
        self,
        final_sparsity: float = 0.5,
        mode: str = "unstructured",
        start: int | float = 0.1,
        end: int | float = 0.7,
        every: int = PRUNE_EVERY_DEFAULT,
        layer_types: Sequence[str | type] | None = pruning.DEFAULT_LAYER_TYPES,
        exclude_pattern: str | None = None,
        probe_batches: int = 4,
        distill: DistillConfig | None = None,
        options: PruneOptions | None = None,
    ) -> None:
        super().__init__()
        self._one_run = errors.OneRunPerInstance("ScheduledPrune")
        self.options = options = errors.as_config(options, PruneOptions, "options") or PruneOptions()
        self.distill: DistillConfig | None = errors.as_config(distill, DistillConfig, "distill")
        check_int(probe_batches, "probe_batches", minimum=0)
        self.schedule = PruneSchedule(final_sparsity, options.initial_sparsity, start, end, every)
        self.pruner = pruning.Pruner(
            mode, layer_types, exclude_pattern, options.ranking, options.min_channels
        )
        check_options_apply(mode, every, options)
        self.final_sparsity, self.mode, self.probe_batches = float(final_sparsity), mode, probe_batches
        # stacklevel: the messages point at this callback's hook, as before the core held them
        warn, info = partial(rank_zero_warn, stacklevel=5), partial(rank_zero_info, stacklevel=5)
        self.core = PruneEvents(self.schedule, self.pruner, self.distill, warn, info)
        self.core.fixed_copies = options.fixed_copies
        self._window, self._masks = self.core.window, self.core.masks
        off = "probe_batches=0"  # the probe's off switch, named in its warnings
        self.probe = HeldOutProbe("ScheduledPrune", probe_batches, "accuracy at events is off", off)
        self._trainer_ref: Callable[[], pl.Trainer | None] = _no_trainer  # picklable, for ddp_spawn
        self._training = False  # between on_train_start and the end of fit: a state load is a rollback
        self._after_exception = compat.HookWatch(compat.after_exception_hooks)  # see on_exception

    @property
    def events(self) -> list[dict[str, Any]]:
        """The latest 1,000 records (:func:`~lightning_pulse.core.pruning.event_record`), oldest first."""
        return self.core.events

    @events.setter
    def events(self, value: list[dict[str, Any]]) -> None:
        self.core.events = value

    @property
    def sparsity(self) -> float:
        """The last event's target; the sparsity it reached where it left out layers (:attr:`events`)."""
        return self.core.sparsity

    @property
    def finished(self) -> bool:
        """Whether the schedule reached its end."""
        return self.schedule.finished

    #: loads a checkpoint of a ScheduledPrune run (a weights-only one too) into a freshly built module, made
    #: to fit first, read with torch's safe loader (:func:`~lightning_pulse.core.pruning.load_pruned`)
    load_pruned = staticmethod(pruning.load_pruned)

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._one_run.setup(trainer, self)  # in every stage: see FitRestores
        self._trainer_ref = weakref.ref(trainer)
        if stage == "fit":
            errors.refuse_sharded_strategy(trainer, "ScheduledPrune", prune_setup.SHARDED_REASON)
            strategy = trainer.strategy
            supported = isinstance(strategy, (SingleDeviceStrategy, DDPStrategy))
            spawns = isinstance(strategy, DDPStrategy) and compat.spawns_worker_processes(trainer)
            prune_setup.check_strategy(type(strategy).__name__, supported, spawns, self.mode, self.options)
            self.core.check_neighbours(trainer.callbacks, compat.averages_buffers)
            # the dtype the run's batches take, and whether under autocast (RunPrecision.of_plugin says why)
            plugin = trainer.precision_plugin
            mixed = isinstance(plugin, MixedPrecision)
            self.pruner.run_precision = pruning.RunPrecision.of_plugin(plugin, mixed)
        self.core.fit_loads(pl_module, self._checkpoint_structure)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        PROBE_COLLECTIVES.wait()  # the rank may exit right after this (see compat.CollectiveHold)
        self._training = False
        self._end_distillation(trainer)
        self.core.stop_fitting_loads(pl_module, fold=stage != "fit" and self.options.make_permanent)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._one_run.start(trainer)  # before anything is planned from a state of another run
        refuse_logger_only_monitors(trainer, "ScheduledPrune", "prune/")  # a monitor on `prune/sparsity`
        total = compat.total_steps(trainer)
        compat.note_run_shares(trainer, "ScheduledPrune", self.schedule.shares, in_steps=True)
        manual_optimizers = len(trainer.optimizers) if compat.steps_per_batch_unknown(trainer) else 0
        prune_setup.resolve_schedule(self.schedule, total, trainer.global_step, manual_optimizers)
        # here, not at setup: a validation sanity check (it runs after setup) creates a lazy module's weights
        errors.refuse_uninitialized_parameters(pl_module, "ScheduledPrune")
        # ZeRO's buckets; distillation: mixed `maximize` refused, the GradScaler's scale read at each backward
        self.core.check_optimizers(trainer.optimizers, compat.loss_scale(trainer))
        # read here, not at setup: layers built in configure_model, and a backbone BackboneFinetuning freezes at
        # fit start, exist (and are frozen) only now, and configure_model may compile a part
        # a resumed run keeps the set its start read (a GradientCache may have frozen layers meanwhile)
        compiled = compat.compiled_parts(pl_module) if self.mode == "structured" else []
        selection = self.core.select(pl_module, compiled=compiled)  # with the frozen set a resume restored
        clock = cycle.clock if (cycle := pulse_cycle_of(trainer)) is not None else None
        holder = prune_setup.pulse_cycle_holder(trainer.callbacks, GreenWindow)
        per_epoch = _steps_per_epoch(trainer)
        self.core.plan_cadence(self.options.cadence, clock, trainer.global_step, total, per_epoch, holder)
        self.core.start_training(pl_module, selection, trainer.global_step, trainer.accumulate_grad_batches)
        self._training = True

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == 0:  # an epoch's start: a DataLoader rebuilt at another length moves `start` and `end`
            compat.check_run_shares(trainer)
            # a GradientAccumulationScheduler's factor for the epoch is set only now (fit start read 1)
            self.core.accumulate(trainer.accumulate_grad_batches)
        if self.mode == "structured" and self.core.example is None and self.pruner.example_inputs is None:
            self.core.example_from(pl_module, batch)  # on the first batch, before its step
        self._masks.refresh(pl_module, grad=True)  # a read of `layer.weight` before its call is this step's

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._masks.refresh(pl_module, grad=False)  # a read before the call sees the weights of the last step

    on_test_start = on_predict_start = on_validation_start

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        core = self.core  # inline, not a core method: a hook of every batch
        steps = trainer.global_step - core.last_step
        if steps <= 0:  # inside an accumulation window
            return
        core.last_step = step = trainer.global_step
        core.leave_out_substituted(pl_module)  # after the first step's forwards (once; before any mask)
        if core.window is not None and core.window.step(steps):
            self._end_distillation(trainer)
        if core.event_due(step) and not core.waits(partial(step_undone, trainer, step)):
            self._prune_event(trainer, pl_module, step, maintain_entry=False)

    def on_pulse_phase_change(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, change: PhaseChange
    ) -> None:
        """Called by PulseCycle on every rank: prune when a maintain phase starts."""
        undone = partial(step_undone, trainer, trainer.global_step)  # asked only when an event is due
        window_ends, due = self.core.after_phase_change(change, undone)
        if window_ends:
            self._end_distillation(trainer)
        if due:
            self._prune_event(trainer, pl_module, change.step, maintain_entry=True)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._one_run.end()
        started, self._training = self._training, False
        self._end_distillation(trainer)
        fold = self.mode == "unstructured" and self.options.make_permanent
        if not started:  # a resume with no step left trains nothing: the checkpoint's masks fold all the same
            return self.core.stop_fitting_loads(pl_module, fold=fold)
        self.core.end_fit(pl_module, trainer.global_step, fold)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, error: BaseException) -> None:
        started, self._training = self._training, False  # a resume of this instance then loads no rollback
        # no teardown follows: fold once every on_exception ran, so that a checkpoint saved in one keeps masks
        end = partial(self.core.end_after_exception, pl_module, trainer.global_step, started=started)
        self._after_exception.once(trainer, lambda _: end(fold=self.options.make_permanent))

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # after the module is restored, before any callback reads its state (see rename_in_finetuning_states)
        keys = [callback.state_key for callback in trainer.callbacks if isinstance(callback, BaseFinetuning)]
        pruning.rename_in_finetuning_states(checkpoint.get("callbacks") or {}, keys, pl_module)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.core.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._one_run.restored():  # loaded by validate, test or predict: no resume
            return
        # while training, a StabilityGuard rollback: the teacher returns to the snapshot with the model
        trainer = self._trainer_ref() if self._training else None
        student = trainer.lightning_module if trainer is not None else None
        accumulation = trainer.accumulate_grad_batches if trainer is not None else 1
        self.core.load_state_dict(state_dict, self._training, student, accumulation)

    def rollback_state_dict(self) -> dict[str, Any]:
        """What a :class:`~lightning_pulse.StabilityGuard` snapshot keeps: the whole state, and which layers
        of the model had a mask then (a rollback keeps the mask a layer has now where the snapshot had none:
        see :meth:`load_rollback_state_dict`). A pass over the modules, at a snapshot only."""
        trainer = self._trainer_ref()
        return self.core.rollback_state_dict(trainer.lightning_module if trainer is not None else None)

    def load_rollback_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A rollback: :meth:`load_state_dict`, then the masks of this callback's layers made to say what the
        restored record says (:meth:`PruneEvents.masks_after_rollback
        <lightning_pulse.core.prune_events.PruneEvents.masks_after_rollback>`)."""
        self.load_state_dict(state_dict)
        if (trainer := self._trainer_ref()) is not None and trainer.lightning_module is not None:
            self.core.masks_after_rollback(trainer.lightning_module, state_dict.get("masked_layers"))

    def __getstate__(self) -> dict[str, Any]:  # pickled by ``ddp_spawn`` after a fit too: no weak reference
        return {**self.__dict__, "_trainer_ref": _no_trainer}

    # ------------------------------------------------------------------ the event
    def _prune_event(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, maintain_entry: bool
    ) -> None:
        if (target := self.core.advance(step)) is None:  # none at or after the run's end
            return
        self._end_distillation(trainer)
        self._masks.refresh(pl_module, grad=False)  # the probe reads this step's weights
        # PulseCycle has just evaluated the model here: reuse it where it read the batches ours reads
        reused = reusable_probe(cycle := pulse_cycle_of(trainer), maintain_entry, self.probe)
        probe_before = reused if reused is not None else self.probe.evaluated(trainer, pl_module)
        outcome, teacher = self.core.cut(pl_module, target, trainer.optimizers, self.distill is not None)
        tell_weights_changed(trainer, pl_module, outcome.remap, exclude=self)  # both modes change weights
        if len(outcome.remap):
            compat.rewrap_ddp(trainer)
        probes = (probe_before, self.probe.evaluated(trainer, pl_module))  # a schedule-free optimizer's x
        event = self.core.record(step, target, outcome, pl_module, probes, cycle and phase_of(trainer).value)
        unlogged = self.probe.unlogged | (cycle.probe.unlogged if reused else set())  # logger=False: not sent
        log_to_loggers(trainer, pruning.event_metrics(event, unlogged))
        rank_zero_info(f"ScheduledPrune: {pruning.event_summary(event)}")
        self.core.open_window(pl_module, teacher, trainer.accumulate_grad_batches)

    # ------------------------------------------------------------------ helpers
    def _checkpoint_structure(self) -> Mapping[str, Any] | None:
        # Lightning restores a module's weights before it hands callbacks their state: read it from the checkpoint
        trainer = self._trainer_ref()
        checkpoint = compat.loaded_checkpoint(trainer) if trainer is not None else None
        return compat.saved_state((checkpoint or {}).get("callbacks") or {}, self)

    def _end_distillation(self, trainer: pl.Trainer | None) -> None:
        if (metrics := self.core.end_distillation()) and trainer is not None:
            log_to_loggers(trainer, metrics)


def _no_trainer() -> None:
    return None


def _steps_per_epoch(trainer: pl.Trainer) -> int | None:
    """Optimizer steps in an epoch of the run (:func:`~lightning_pulse.core.prune_setup.steps_per_epoch`)."""
    scheduler = compat.accumulation_schedule(trainer)
    epoch = (trainer.num_training_batches, trainer.accumulate_grad_batches, trainer.current_epoch)
    return prune_setup.steps_per_epoch(*epoch, scheduler.scheduling if scheduler is not None else None)
