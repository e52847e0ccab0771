"""ScheduledPrune: gradual pruning on the cubic schedule, in maintain windows, with real compute savings.

Lightning glue over :mod:`lightning_pulse.core.prune_schedule` (when, and to what sparsity),
:mod:`lightning_pulse.core.pruning` (the prune event, and fitting a fresh module to a pruned checkpoint),
:mod:`lightning_pulse.core.prune_setup` (options, setup checks, messages) and
:mod:`lightning_pulse.core.distillation` (optional recovery after each event).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    Callback,
    StochasticWeightAveraging,
)
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_pulse import _lightning_compat as compat
from lightning_pulse.callbacks.green_window import GreenWindow
from lightning_pulse.callbacks.pulse_cycle import phase_of, pulse_cycle_of
from lightning_pulse.core import prune_setup, prune_targets, pruning
from lightning_pulse.core.distillation import DistillConfig, DistillWindow
from lightning_pulse.core.prune_schedule import PruneSchedule, check_int
from lightning_pulse.core.prune_setup import PRUNE_EVERY_DEFAULT, PruneOptions, check_options_apply
from lightning_pulse.core.step_plan import epoch_steps
from lightning_pulse.errors import (
    OneRunPerInstance,
    as_config,
    names_itself,
    refuse_sharded_strategy,
    refuse_uninitialized_parameters,
)
from lightning_pulse.loggers import log_to_loggers
from lightning_pulse.phase import Phase, PhaseChange
from lightning_pulse.probe import PROBE_COLLECTIVES, HeldOutProbe
from lightning_pulse.protocols import ParametersReplacedListener, listeners

__all__ = ["DistillConfig", "PruneOptions", "ScheduledPrune"]


class ScheduledPrune(Callback):
    r"""Gradual magnitude pruning (Zhu & Gupta 2017) that runs in the maintain phases of a pulse cycle.

    Sparsity follows the cubic schedule ``s_t = s_f + (s_i - s_f)(1 - (t - t_start)/(t_end - t_start))^3``.
    With a :class:`~lightning_pulse.PulseCycle`, an event happens when a maintain phase starts; without one,
    every ``every`` optimizer steps. Targets are absolute (50% then 70% gives 70%), and what is pruned stays
    pruned. ``mode="unstructured"`` masks weights (``torch.nn.utils.prune``; no speedup on dense kernels);
    ``mode="structured"`` removes output channels with torch-pruning (coupled layers follow, output layers are
    never cut), cuts the optimizer's state in place, re-wraps DDP and tells every
    :class:`~lightning_pulse.protocols.ParametersReplacedListener`. It traces ``forward`` on
    ``example_input_array`` (else on the first training batch, by ``forward``'s signature) and first prunes a
    copy to the schedule's levels: a model that cannot be cut safely is refused before the first step.

    Layers read without their forward (``nn.MultiheadAttention.out_proj``) and one side of a tied weight are
    never pruned; Hugging Face ``Conv1D`` layers are selected by default. The setup line names what was left
    out and why.

    Events are logged under ``prune/`` and kept in :attr:`events` and in checkpoints, which resume
    mid-schedule into a freshly built module (outside a Trainer: :meth:`load_pruned`). A
    :class:`~lightning_pulse.StabilityGuard` rollback restores this callback with the model; an undone event
    is redone at the next chance. Single-device and DDP; under ``ddp_spawn``/``ddp_fork`` only unstructured
    mode with ``make_permanent=True`` (Lightning copies rank 0's weights back into the unpruned module).

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
        probe_batches: validation batches evaluated right after each event (and before it when no PulseCycle
            probe just ran); ``0`` turns the probes off.
        distill: a :class:`~lightning_pulse.core.distillation.DistillConfig` to distil the pre-event model
            into the pruned one after each event (a KL term on the logits added through a forward hook; the
            module's ``forward`` must return the logits); ``None`` (default) for none.
        options: rarely turned knobs, a :class:`PruneOptions`.

    Raises:
        ValueError: at construction, naming the field, for a value out of range or of the wrong type, an
            unknown ``mode``/``cadence``/``ranking``, an invalid regex or layer type.
        PulseRefusal: at fit start, before the first step: no layer can be pruned, ``start`` after ``end``
            or after the run's last step, ``cadence="maintain"`` without a maintain phase, FSDP/DeepSpeed or
            another unsupported strategy, a model structured pruning cannot trace or cut safely (one under
            ``torch.compile``, or one whose trial cut does not finish within ``STRUCTURED_CHECK_SECONDS``), a
            lazy module (``nn.LazyLinear``) whose weights no forward has created yet, a second run of this
            instance unless a checkpoint was restored into it.
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

    @names_itself
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
        self._one_run = OneRunPerInstance("ScheduledPrune")
        options = as_config(options, PruneOptions, "options") or PruneOptions()
        self.distill: DistillConfig | None = as_config(distill, DistillConfig, "distill")
        check_int(probe_batches, "probe_batches", minimum=0)
        self.schedule = PruneSchedule(final_sparsity, options.initial_sparsity, start, end, every)
        self.pruner = pruning.Pruner(
            mode, layer_types, exclude_pattern, options.ranking, options.min_channels
        )
        check_options_apply(mode, every, options)
        self.final_sparsity, self.mode, self.probe_batches = float(final_sparsity), mode, probe_batches
        self.options = options
        self.events: list[dict[str, Any]] = []

        self._uses_maintain: bool | None = None  # decided at the first fit start, kept by a checkpoint
        self._last_global_step = 0
        self._example: Any = None  # structured: the trace input, checked on the first batch
        self.probe = HeldOutProbe("ScheduledPrune", probe_batches, "accuracy at events is off")
        self._fitter_handle: Any = None
        self._trainer_ref: Callable[[], pl.Trainer | None] = _no_trainer  # picklable, for ddp_spawn
        self._window = DistillWindow(self.distill) if self.distill is not None else None
        self._pending_teacher: dict[str, Any] | None = None
        self._restored_frozen: frozenset[str] | None = None  # the frozen set a restored checkpoint read
        self._training = False  # between on_train_start and the end of fit: a state load is a rollback
        self._masks = pruning.MaskedWeightRefresh(enabled=mode == "unstructured")

    @property
    def sparsity(self) -> float:
        """The target reached by the last event."""
        return self.schedule.sparsity

    @property
    def finished(self) -> bool:
        """Whether the schedule reached its end."""
        return self.schedule.finished

    @staticmethod
    def load_pruned(module: torch.nn.Module, checkpoint: str | Path | Mapping[str, Any]) -> torch.nn.Module:
        """Load a checkpoint written during a ScheduledPrune run into a freshly built ``module``.

        Replays the recorded channel removals (structured) and adds masks (unstructured) so the pruned
        state dict fits, then loads it. Returns ``module``.
        """
        return pruning.load_pruned(module, checkpoint)

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer_ref = weakref.ref(trainer)
        if stage == "fit":
            refuse_sharded_strategy(trainer, "ScheduledPrune", prune_setup.SHARDED_REASON)
            self._check_strategy(trainer)
            swa = [type(cb).__name__ for cb in trainer.callbacks if isinstance(cb, StochasticWeightAveraging)]
            prune_setup.check_weight_averaging(self.mode, swa[0] if swa else None)
            # the trace input takes the dtype the run's batches take, which the module's dtypes do not tell (a
            # float32 stem before a bfloat16 body under 32-true takes float32 batches); a mixed plugin's
            # autocast, which the trace runs outside of, is why half tensors go up to float32 there, and only
            # there
            plugin = trainer.precision_plugin
            self.pruner.run_precision = pruning.RunPrecision(
                plugin.convert_input(torch.zeros(())).dtype, autocast=isinstance(plugin, MixedPrecision)
            )
        if self._fitter_handle is None:
            fitter = pruning.StateDictFitter(self._checkpoint_structure, self._run_precision)
            self._fitter_handle = pl_module.register_load_state_dict_pre_hook(fitter)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        PROBE_COLLECTIVES.wait()  # the rank may exit right after this (see compat.CollectiveHold)
        self._training = False
        self._end_distillation(trainer)
        if self._fitter_handle is not None:
            self._fitter_handle.remove()
            self._fitter_handle = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._one_run.start(trainer)  # before anything is planned from a state of another run
        total = compat.total_steps(trainer)
        manual_optimizers = len(trainer.optimizers) if compat.steps_per_batch_unknown(trainer) else 0
        prune_setup.resolve_schedule(self.schedule, total, trainer.global_step, manual_optimizers)
        # here, not at setup: a validation sanity check (it runs after setup) creates a lazy module's weights
        refuse_uninitialized_parameters(pl_module, "ScheduledPrune")
        # read here, not at setup: layers built in configure_model, and a backbone BackboneFinetuning freezes at
        # fit start, exist (and are frozen) only now
        # a resumed run keeps the set its start read (a GradientCache may have frozen layers meanwhile)
        restored, self._restored_frozen = self._restored_frozen, None
        self.pruner.user_frozen = prune_targets.frozen_layers(pl_module) if restored is None else restored
        selection = prune_setup.checked_selection(self.pruner, pl_module)
        if masked := pruning.mask_folded_zeros(selection.layers, self.mode, self.schedule.sparsity):
            rank_zero_info(f"ScheduledPrune: resumed after a fit's end; pruned zeros masked again: {masked}")
        if self.mode == "structured":  # here: configure_model (after setup) may compile a part
            prune_setup.refuse_compiled_structured(
                self.mode, compat.compiled_parts(pl_module), selection.layers
            )
            prune_setup.refuse_structured(pruning.structured_blocker(pl_module, selection))
            prune_setup.refuse_frozen_twins(pl_module, selection.layers)
            if getattr(pl_module, "example_input_array", None) is not None:
                self._example = prune_setup.structured_example(pl_module, self.pruner, self.schedule, None)
        clock = cycle.clock if (cycle := pulse_cycle_of(trainer)) is not None else None
        holder = next((type(c).__name__ for c in trainer.callbacks if _holds_pulse_cycle(c)), None)
        per_epoch = _steps_per_epoch(trainer)
        self._uses_maintain, warnings = prune_setup.event_cadence(
            self.options.cadence, clock, self.schedule, trainer.global_step, total, per_epoch,
            decided=self._uses_maintain, pruned=bool(self.events), holder=holder,
        )  # fmt: skip
        for warning in warnings:
            rank_zero_warn(warning)
        self._last_global_step = trainer.global_step
        self._restore_teacher(trainer, pl_module)
        self._training = True
        self._masks.forget()  # masks a resume added
        rank_zero_info(
            prune_setup.setup_summary(self.mode, pl_module, selection, self.schedule, self._uses_maintain)
        )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.mode == "structured" and self._example is None and self.pruner.example_inputs is None:
            # on the first batch, before its step
            self._example = prune_setup.structured_example(pl_module, self.pruner, self.schedule, batch)
        self._masks.refresh(pl_module, grad=True)  # a read of `layer.weight` before its call is this step's

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._masks.refresh(pl_module, grad=False)  # a read before the call sees the weights of the last step

    on_test_start = on_predict_start = on_validation_start

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        steps = trainer.global_step - self._last_global_step
        if steps <= 0:  # inside an accumulation window
            return
        self._last_global_step = trainer.global_step
        if self._window is not None and self._window.step(steps):
            self._end_distillation(trainer)
        if not self._uses_maintain and self.schedule.due(trainer.global_step):
            self._prune_event(trainer, pl_module, trainer.global_step, maintain_entry=False)

    def on_pulse_phase_change(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, change: PhaseChange
    ) -> None:
        """Called by PulseCycle on every rank: prune when a maintain phase starts."""
        if self._window is not None and self._window.ends_with(change):
            self._end_distillation(trainer)
        if self._uses_maintain and change.current is Phase.MAINTAIN and change.reason != "resume":
            self._prune_event(trainer, pl_module, change.step, maintain_entry=True)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._one_run.end()
        self._training = False
        self._end_distillation(trainer)
        warning = prune_setup.unfinished_warning(self.schedule, trainer.global_step, self.events)
        if warning is not None:
            rank_zero_warn(warning)
        self._masks.refresh(pl_module, grad=False)  # the last optimizer step came after the last forward
        if self.mode == "unstructured" and self.options.make_permanent:
            pruning.make_masks_permanent(pl_module)
        self._masks.forget()
        if self.events:
            rank_zero_info(f"ScheduledPrune: at fit end, {pruning.event_summary(self.events[-1])}.")

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # runs after the module is restored and before any callback reads its state: BaseFinetuning
        # (BackboneFinetuning) keeps the optimizer's groups by parameter name, stored when it set them up, and
        # a mask renamed `X.weight` to `X.weight_orig` since (folding it renames it back): its on_fit_start
        # then failed on the old name (KeyError), so no checkpoint after the first event could be resumed
        names = {name for name, _ in pl_module.named_parameters()}
        states = checkpoint.get("callbacks") or {}
        for callback in trainer.callbacks:
            state = states.get(callback.state_key)
            if isinstance(callback, BaseFinetuning) and isinstance(state, dict):
                states[callback.state_key] = _finetuning_state_renamed(state, names)

    @override
    def state_dict(self) -> dict[str, Any]:
        state = {**self.schedule.state_dict(), **self.pruner.state_dict()}
        state["events"] = [dict(event) for event in self.events]
        state["user_frozen"], state["uses_maintain"] = sorted(self.pruner.user_frozen), self._uses_maintain
        teacher = self._window.state_dict() if self._window is not None else None
        if teacher is not None:
            state["teacher"] = teacher
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._one_run.restored()
        self.schedule.load_state_dict(state_dict)
        self.pruner.load_state_dict(state_dict)
        self.events = [dict(event) for event in state_dict["events"]]
        self._uses_maintain = state_dict.get("uses_maintain", self._uses_maintain)
        if not self._training and "user_frozen" in state_dict:  # a resume: the run's own frozen set
            self._restored_frozen = frozenset(state_dict["user_frozen"])
        self._pending_teacher = state_dict.get("teacher")
        self._masks.forget()
        trainer = self._trainer_ref()
        if self._training and trainer is not None and trainer.lightning_module is not None:
            # a StabilityGuard rollback: the model has just returned to the snapshot too, so the teacher of an
            # undone event goes and one saved in the snapshot comes back (on a checkpoint restore: on_train_start)
            self._restore_teacher(trainer, trainer.lightning_module)

    def rollback_state_dict(self) -> dict[str, Any]:
        """What a :class:`~lightning_pulse.StabilityGuard` snapshot keeps: the whole state, and which layers
        of the model had a mask then (a rollback keeps the mask a layer has now where the snapshot had none:
        see :meth:`load_rollback_state_dict`). A pass over the modules, at a snapshot only."""
        state = self.state_dict()
        trainer = self._trainer_ref()
        module = trainer.lightning_module if trainer is not None else None
        state["masked_layers"] = pruning.masked_layer_names(module) if module is not None else None
        return state

    def load_rollback_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A rollback: :meth:`load_state_dict`, then the masks of this callback's layers made to say what the
        restored record says (:meth:`_masks_after_rollback`)."""
        self.load_state_dict(state_dict)
        trainer = self._trainer_ref()
        if trainer is not None and trainer.lightning_module is not None:
            self._masks_after_rollback(trainer.lightning_module, state_dict.get("masked_layers"))

    # ------------------------------------------------------------------ the event
    def _prune_event(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, maintain_entry: bool
    ) -> None:
        target = self.schedule.advance(step)
        if target is None:
            return
        self._end_distillation(trainer)
        self._masks.refresh(pl_module, grad=False)  # the probe reads this step's weights
        probe_before = self._probe(trainer, pl_module, maintain_entry)
        teacher = pruning.copy_without_hooks(pl_module) if self.distill is not None else None
        outcome = self.pruner.prune(pl_module, target, trainer.optimizers, self._example)
        self._masks.forget()
        for problem in outcome.problems:
            rank_zero_warn(f"ScheduledPrune: {problem}")
        if len(outcome.remap):
            for callback in listeners(trainer, ParametersReplacedListener, exclude=self):
                callback.on_pulse_parameters_replaced(trainer, pl_module, outcome.remap)
            compat.rewrap_ddp(trainer)
        probe_after = self._probe(trainer, pl_module)
        event = pruning.event_record(step, target, outcome, pl_module, probe_before, probe_after)
        event["phase"] = phase_of(trainer).value if pulse_cycle_of(trainer) is not None else None
        self.events.append(event)
        log_to_loggers(trainer, pruning.event_metrics(event))
        rank_zero_info(f"ScheduledPrune: {pruning.event_summary(event)}")
        if self._window is not None and teacher is not None:
            self._window.open(pl_module, teacher, len(self.events) - 1, trainer.accumulate_grad_batches)

    # ------------------------------------------------------------------ helpers
    def _masks_after_rollback(
        self, pl_module: pl.LightningModule, masked_then: Collection[str] | None
    ) -> None:
        """After a rollback (unstructured), make the masks of this callback's layers say what the restored
        record says, and ``layer.weight`` show the restored weights at once (a callback reading it later in
        this step). ``masked_then``: the layers that had a mask at the snapshot (``None``: unknown).

        A layer with a mask now and none at the snapshot kept its mask in the restore
        (``core/snapshots.py:fitted_state``: another pruner's masks stay, as it does not prune again). Here
        it was this callback's own event, undone: with no event in the restored record, the layer comes back
        unpruned (a mask of ones) and the schedule redoes the event. With events, the snapshot is the start of
        a fit resumed after a fit's end, taken (StabilityGuard listed before this callback) before
        ``on_train_start`` masked the zeros folded into the weights again: those zeros are masked again, as at
        that start. A layer masked at the snapshot got its saved mask back. A pass over the layers, at a
        rollback only.
        """
        if self.mode != "unstructured":
            return
        if masked_then is not None:
            masked_then = set(masked_then)
            for name, layer in self.pruner.layers(pl_module).items():
                mask = pruning.current_mask(layer)
                if mask is None or name in masked_then:
                    continue
                if self.schedule.sparsity > 0:
                    pruning.mask_zeros(layer)
                else:
                    mask.fill_(1)
        self._masks.refresh(pl_module, grad=False)

    def _checkpoint_structure(self) -> Mapping[str, Any] | None:
        # Lightning restores a module's weights before it hands callbacks their state: read it from the checkpoint
        trainer = self._trainer_ref()
        checkpoint = compat.loaded_checkpoint(trainer) if trainer is not None else None
        return ((checkpoint or {}).get("callbacks") or {}).get(self.state_key)

    def _run_precision(self) -> pruning.RunPrecision | None:
        return self.pruner.run_precision

    def _check_strategy(self, trainer: pl.Trainer) -> None:
        from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

        strategy = trainer.strategy
        supported = isinstance(strategy, (SingleDeviceStrategy, DDPStrategy))
        spawns = isinstance(strategy, DDPStrategy) and compat.spawns_worker_processes(trainer)
        prune_setup.check_strategy(type(strategy).__name__, supported, spawns, self.mode, self.options)

    def _probe(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, maintain_entry: bool = False
    ) -> dict[str, float] | None:
        cycle = pulse_cycle_of(trainer)
        # PulseCycle has just evaluated the model at this maintain entry: reuse it rather than evaluate twice
        if maintain_entry and cycle is not None and cycle.maintain_eval == "probe" and cycle.last_probe:
            return dict(cycle.last_probe)
        return self.probe.run(trainer, pl_module)

    def _restore_teacher(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        saved, self._pending_teacher = self._pending_teacher, None
        if self._window is not None:
            self._window.restore(pl_module, saved, trainer.accumulate_grad_batches, pl_module.device)

    def _end_distillation(self, trainer: pl.Trainer | None) -> None:
        closed = self._window.close(self.events) if self._window is not None else None
        if closed is None:
            return
        calls, loss = closed
        if calls == 0:
            rank_zero_warn(prune_setup.DISTILL_NO_EFFECT)
        elif trainer is not None:
            log_to_loggers(trainer, {"prune/distill_loss": loss})


def _no_trainer() -> None:
    return None


def _holds_pulse_cycle(callback: Callback) -> bool:
    """Whether ``callback`` can hold the PulseCycle in its light phases (:meth:`PulseCycle.hold_light`)."""
    return isinstance(callback, GreenWindow) and callback.when_dirty == "light"


def _steps_per_epoch(trainer: pl.Trainer) -> int | None:
    """Optimizer steps in an epoch, for phases counted in epochs; ``None`` when a
    GradientAccumulationScheduler changes them from one epoch to another from the current epoch on (no one
    figure plans such phases; a resumed run past the last change has one)."""
    schedule = compat.accumulation_schedule(trainer)
    if schedule is None:
        factors = {trainer.accumulate_grad_batches}
    else:
        # the factor in force now (Lightning adds one for epoch 0 when none is given) and those set later
        in_force = max(start for start in schedule.scheduling if start <= trainer.current_epoch)
        factors = {factor for start, factor in schedule.scheduling.items() if start >= in_force}
    return epoch_steps(trainer.num_training_batches, factors.pop()) if len(factors) == 1 else None


def _finetuning_state_renamed(state: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """A BaseFinetuning state whose optimizer groups name each parameter as the module names it now
    (:func:`~lightning_pulse.core.pruning.current_parameter_name`)."""
    metadata = state.get("internal_optimizer_metadata")
    if not isinstance(metadata, dict):  # an older layout (before Lightning PR #11887): left as it is
        return state
    renamed = {
        index: [
            {**group, "params": [pruning.current_parameter_name(name, names) for name in group["params"]]}
            for group in groups
        ]
        for index, groups in metadata.items()
    }
    return {**state, "internal_optimizer_metadata": renamed}
