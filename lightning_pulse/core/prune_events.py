"""What a :class:`~lightning_pulse.ScheduledPrune` run keeps of its events, without a Trainer.

:class:`PruneEvents` holds the schedule (when, and to what sparsity), the pruner (what, and how), the record
of each event, the distillation window after an event and the refresh of masked weights, and what they do
when training starts, after an optimizer step or a phase change, at an event, a checkpoint, a resume, a
:class:`~lightning_pulse.StabilityGuard` rollback and the fit's end. The callback hands in the model and what
it reads from the trainer; the messages go through the ``warn`` and ``info`` it hands in.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_pulse.core import pruning
from lightning_pulse.core.distillation import DistillConfig, DistillWindow
from lightning_pulse.core.per_sample_loss import losses_not_captured
from lightning_pulse.core.prune_schedule import PruneSchedule
from lightning_pulse.core.prune_setup import (
    DISTILL_NO_EFFECT,
    check_optimizers,
    check_weight_averaging,
    event_cadence,
    exact_names_pattern,
    fit_start_selection,
    folded_elsewhere_note,
    kept_above_target,
    kept_masks_note,
    lowered_target_warning,
    refuse_averaged_masks,
    refuse_mode_change,
    refuse_replaced_weights,
    refuse_structured_next_to_pruning,
    renamed_weight_warning,
    saved_mode,
    setup_summary,
    structured_example,
    unfinished_warning,
    unreached_warning,
)
from lightning_pulse.core.prune_targets import NOT_OWN_WEIGHT, LayerSelection, OwnWeightWatch
from lightning_pulse.errors import PulseRefusal, first_names
from lightning_pulse.phase import Phase, PhaseChange, PhaseClock
from lightning_pulse.records import RECENT_RECORDS, append_recent

_log = logging.getLogger(__name__)


class PruneEvents:
    """The events of a ScheduledPrune run and their state, over the callback's validated parts.

    Args:
        schedule: when events happen, and to what sparsity.
        pruner: what an event prunes, and how.
        distill: the distillation after each event; ``None`` for none.
        warn: gives a warning (the callback hands in Lightning's ``rank_zero_warn``).
        info: gives an informative line (the callback hands in Lightning's ``rank_zero_info``).

    Attributes:
        events: the record of each event (:func:`~lightning_pulse.core.pruning.event_record`), oldest first:
            the latest :data:`~lightning_pulse.records.RECENT_RECORDS` (a long run's checkpoint stays small).
        window: the distillation window after an event (``None`` without ``distill``).
        masks: keeps the masked weights current outside their layers' calls (unstructured only).
        uses_maintain: whether events happen at maintain-phase starts (:meth:`plan_cadence`).
        pending_teacher: the distillation state a load brought, until :meth:`restore_teacher` reopens it.
        restored_frozen: the layers the user froze, as a resumed checkpoint recorded them, until
            :meth:`select` takes them (a resumed run keeps the set its start read).
        last_step: the optimizer step the callback's batch-end hook last counted.
        deferred: a due event waits for a step StabilityGuard does not flag (:meth:`waits`).
        example: structured: the trace input, checked on the first batch (:meth:`select`,
            :meth:`example_from`).
    """

    def __init__(
        self,
        schedule: PruneSchedule,
        pruner: pruning.Pruner,
        distill: DistillConfig | None,
        warn: Callable[[str], Any] = warnings.warn,
        info: Callable[[str], Any] = _log.info,
    ) -> None:
        self.schedule, self.pruner, self.warn, self.info = schedule, pruner, warn, info
        self.events: list[dict[str, Any]] = []
        #: unstructured: the layers this callback has masked in this fit (:meth:`start_training`,
        #: :meth:`cut`): only their masks are folded at the fit's end (:meth:`end_fit`)
        self.own_masked: set[str] = set()
        self.window = DistillWindow(distill) if distill is not None else None
        self.masks = pruning.MaskedWeightRefresh(enabled=pruner.mode == "unstructured")
        self.uses_maintain: bool | None = None  # decided at the first fit start, kept by a checkpoint
        self.pending_teacher: dict[str, Any] | None = None
        #: structured: the model as built, with the cuts before a restored teacher's event redone
        #: (:meth:`_teacher_template`), until :meth:`restore_teacher` loads the teacher into it
        self.teacher_template: nn.Module | None = None
        #: the cuts recorded (the pruner's ``history``) before the open window's event: its teacher's
        self.teacher_history: int | None = None
        self.restored_frozen: frozenset[str] | None = None
        self.last_step = 0
        self.deferred = False
        self.example: Any = None
        self._fitter_handle: Any = None
        self._masked_at_setup: list[str] = []  # the layers masked when a stage set up (fit_loads)
        #: unstructured: a Lightning WeightAveraging of the run, its class name and use_buffers (set at setup)
        self.averaging: tuple[str, bool] | None = None
        #: unstructured: the frozen copies of the parts to prune are never updated (PruneOptions.fixed_copies)
        self.fixed_copies = False
        #: unstructured: whether the layers' forwards read their own weights, over the fit's first step
        self.own_weights = OwnWeightWatch()
        self._watching = False
        #: the mode of the run whose state was loaded (a resume), until :meth:`select` checks it
        self.restored_mode: str | None = None
        #: the run's optimizer steps (:meth:`plan_cadence`): no event at or after it (:meth:`advance`)
        self.run_end = math.inf
        #: the layers the fit start chose (:meth:`start_training`), and those an event found it could no
        #: longer prune and warned of (:meth:`cut`, :meth:`record`)
        self.chosen: list[str] = []
        self.warned_left_out: set[str] = set()

    @property
    def sparsity(self) -> float:
        """The target the last event reached (the schedule's), or, where that event could no longer prune
        layers chosen before (its record's ``left_out_layers``), the sparsity it really reached."""
        last = self.events[-1] if self.events else {}
        return float(last["sparsity"]) if last.get("left_out_layers") else self.schedule.sparsity

    # ------------------------------------------------------------------ loading a pruned state dict
    def fit_loads(self, module: nn.Module, structure: Callable[[], Mapping[str, Any] | None]) -> None:
        """From now on, fit ``module`` to the pruned state dict loaded into it (a
        :class:`~lightning_pulse.core.pruning.StateDictFitter` pre-hook with the structure ``structure()``
        returns and the pruner's run precision), once until :meth:`stop_fitting_loads`."""
        if self._fitter_handle is None:
            fitter = pruning.StateDictFitter(structure, self._run_precision, self._teacher_template)
            self._fitter_handle = module.register_load_state_dict_pre_hook(fitter)
            self._masked_at_setup = pruning.masked_layer_names(module)

    def stop_fitting_loads(self, module: nn.Module | None = None, fold: bool = False) -> None:
        """Remove the pre-hook :meth:`fit_loads` added, if any. With ``fold`` (unstructured, at the end of a
        stage other than fit, when the fit folds its masks at its end), fold the masks ``module`` gained since
        :meth:`fit_loads`: ``trainer.test(ckpt_path="last")`` after a fit restores a checkpoint saved before
        the fit's end folded, and the masks it put back made a later ``state_dict()`` unloadable into a plain
        module. The stage computed with the masked weights; folding keeps them. Masks there before stay."""
        if self._fitter_handle is not None:
            self._fitter_handle.remove()
            self._fitter_handle = None
        self.teacher_template = None  # a restore that trains no more (validate, test) leaves no copy held
        if fold and module is not None and self.pruner.mode == "unstructured":
            self.masks.refresh(module, grad=False)  # the weights of the stage, then folded as they are
            pruning.make_masks_permanent(module, keep=set(self._masked_at_setup))
            self.masks.forget()

    def _run_precision(self) -> pruning.RunPrecision | None:
        return self.pruner.run_precision

    def _teacher_template(
        self,
        module: nn.Module,
        state_dict: Mapping[str, Any],
        prefix: str,
        structure: Mapping[str, Any] | Callable[[], Mapping[str, Any] | None],
        precision: pruning.RunPrecision | None,
    ) -> None:
        """Structured, as a resume restores the freshly built ``module`` (before its cuts are replayed): where
        the checkpoint (``structure``, its state of this callback) holds a distillation teacher from before
        later cuts, a hook-free copy of ``module`` with the cuts before the teacher's event replayed
        (:func:`~lightning_pulse.core.pruning.fit_to_state_dict`), for :meth:`restore_teacher` to load the
        teacher's tensors into. The cut student cannot be given its channels back, and a layer's widths read
        from its shapes alone miss those held elsewhere (a depthwise convolution's ``groups``)."""
        if self.window is None or prefix:
            return
        recorded = structure() if callable(structure) else structure  # read from the checkpoint when asked
        teacher = recorded.get("teacher") if isinstance(recorded, Mapping) else None
        if not isinstance(teacher, Mapping):
            return
        history = recorded.get("history") or []
        before = teacher.get("history_length")
        if "teacher_state" not in teacher or before is None or int(before) >= len(history):
            return  # no cut since the teacher's: the student's copy has its shapes
        template = pruning.copy_without_hooks(module)
        earlier = {**recorded, "history": history[: int(before)]}
        pruning.fit_to_state_dict(template, teacher["teacher_state"], "", earlier, precision)
        self.teacher_template = template

    # ------------------------------------------------------------------ the run
    def check_neighbours(self, callbacks: Iterable[Any], averages_buffers: Callable[[Any], bool]) -> None:
        """At setup of a fit, the checks of the ``callbacks`` next to this one
        (:func:`~lightning_pulse.core.prune_setup.refuse_structured_next_to_pruning`, then
        :func:`~lightning_pulse.core.prune_setup.check_weight_averaging`, which sets :attr:`averaging`;
        ``averages_buffers``: the compat module's reader of ``use_buffers``)."""
        refuse_structured_next_to_pruning(self.pruner.mode, callbacks)
        self.averaging = check_weight_averaging(self.pruner.mode, callbacks, averages_buffers)

    def select(
        self, model: nn.Module, frozen: frozenset[str] | None = None, compiled: Sequence[str] = ()
    ) -> LayerSelection:
        """At fit start, the layers to prune in ``model``, with the checks that refuse them
        (:func:`~lightning_pulse.core.prune_setup.fit_start_selection`; ``frozen``: the set a restored
        checkpoint read, by default :attr:`restored_frozen`, taken here; ``compiled``: the parts under
        torch.compile), and :attr:`example` from ``example_input_array``. Says which layers' folded zeros
        were masked again, and warns of buffers shaped like a weight to mask
        (:func:`~lightning_pulse.core.prune_setup.renamed_weight_warning`) and of large trainable parameters
        out of reach (:func:`~lightning_pulse.core.prune_setup.unreached_warning`). First, a resume with
        another ``mode`` than the checkpoint's is refused
        (:func:`~lightning_pulse.core.prune_setup.refuse_mode_change`)."""
        restored, self.restored_mode = self.restored_mode, None
        restored_frozen, self.restored_frozen = self.restored_frozen, None
        frozen = restored_frozen if frozen is None else frozen
        refuse_mode_change(restored, self.pruner.mode)
        selection, masked, self.example = fit_start_selection(
            self.pruner, model, self.schedule, frozen, compiled, self.example, self.fixed_copies
        )
        if self.pruner.mode == "unstructured":
            refuse_averaged_masks(self.averaging, model, selection.layers, self._masked_at_setup)
        if masked:  # unstructured only, so no structured refusal follows it
            self.info(f"ScheduledPrune: resumed after a fit's end; pruned zeros masked again: {masked}")
        elif (kept := kept_masks_note(self.pruner.mode, selection.layers, bool(self.events))) is not None:
            self.info(kept)  # a resume (events recorded) finds this run's own masks
        if (renamed := renamed_weight_warning(self.pruner.mode, model, selection.layers)) is not None:
            self.warn(renamed)
        exclude, final = self.pruner.exclude_pattern, self.schedule.final_sparsity
        # layer types the user named are a choice already made, as exclude_pattern is: not warned of
        default_types = ((), pruning.resolve_layer_types(pruning.DEFAULT_LAYER_TYPES))
        chosen, structured = self.pruner.layer_types not in default_types, self.pruner.mode == "structured"
        if (unreached := unreached_warning(model, selection, exclude, final, chosen, structured)) is not None:
            self.warn(unreached)
        return selection

    def example_from(self, model: nn.Module, batch: Any) -> None:
        """Structured: :attr:`example` from ``batch``
        (:func:`~lightning_pulse.core.prune_setup.structured_example`) when neither ``example_input_array``
        nor a checkpoint gave one."""
        if self.pruner.mode == "structured" and self.example is None and self.pruner.example_inputs is None:
            # inside HardSampleReplay's capture of the step when it is listed first
            with losses_not_captured():
                self.example = structured_example(model, self.pruner, self.schedule, batch)

    def plan_cadence(
        self,
        cadence: str,
        clock: PhaseClock | None,
        step: int,
        total_steps: float = math.inf,
        steps_per_epoch: float | None = None,
        holder: str | None = None,
    ) -> None:
        """At fit start, decide :attr:`uses_maintain`
        (:func:`~lightning_pulse.core.prune_setup.event_cadence`; a resumed run keeps what its first fit
        decided) and give its warnings. Raises :class:`~lightning_pulse.errors.PulseRefusal` as that does.
        Keeps ``total_steps`` as :attr:`run_end`. First, a finished schedule resumed with a higher
        ``final_sparsity`` is opened again (:meth:`PruneSchedule.reopen
        <lightning_pulse.core.prune_schedule.PruneSchedule.reopen>`), with a warning
        (:func:`reopened_warning`): the plan and its warnings then count the cuts still to come."""
        self.run_end = total_steps
        reached = self.schedule.sparsity
        reopened = self.schedule.reopen(step)
        self.uses_maintain, texts = event_cadence(
            cadence, clock, self.schedule, step, total_steps, steps_per_epoch,
            decided=self.uses_maintain, pruned=bool(self.events), holder=holder,
        )  # fmt: skip
        if reopened:
            texts.insert(0, reopened_warning(self.schedule, reached, bool(self.uses_maintain), total_steps))
        for text in texts:
            self.warn(text)

    def check_optimizers(
        self, optimizers: Sequence[torch.optim.Optimizer], loss_scale: Callable[[], Any] | None = None
    ) -> None:
        """At train start: refuse optimizers the mode cannot run next to
        (:func:`~lightning_pulse.core.prune_setup.check_optimizers`) and, with distillation, read which way
        they move the loss (:meth:`DistillWindow.read_direction
        <lightning_pulse.core.distillation.DistillWindow.read_direction>`; mixed ``maximize`` refused) and
        keep the run's ``loss_scale`` reader (:attr:`LogitDistiller.loss_scale
        <lightning_pulse.core.distillation.LogitDistiller.loss_scale>`)."""
        check_optimizers(self.pruner.mode, optimizers)
        if self.window is not None:
            self.window.read_direction(optimizers)
            self.window.loss_scale = loss_scale

    def start_training(
        self, model: nn.Module, selection: LayerSelection, step: int, accumulation: int
    ) -> None:
        """Once the fit-start checks passed, at optimizer ``step``: reopen a restored distillation window
        (:meth:`restore_teacher`), find the masked layers again (a resume added masks), and say what is
        pruned, how far, between which steps and when
        (:func:`~lightning_pulse.core.prune_setup.setup_summary`), warning of a resumed sparsity above this
        run's ``final_sparsity`` (:func:`~lightning_pulse.core.prune_setup.lowered_target_warning`).
        Unstructured: watch the layers' forwards over the first optimizer step
        (:meth:`leave_out_substituted`)."""
        self.last_step = step
        self.chosen = list(selection.layers)
        self.restore_teacher(model, accumulation)
        self.masks.forget()
        if (lowered := lowered_target_warning(self.schedule)) is not None:
            self.warn(lowered)
        self._watching = self.pruner.mode == "unstructured"
        if self._watching:
            self.own_weights.start(selection.layers)
        # masks on the layers to prune now: a resume's, folded zeros masked
        # again, or adopted by the next event
        layers = selection.layers.items() if self._watching else ()
        self.own_masked = {name for name, layer in layers if pruning.current_mask(layer) is not None}
        self.info(setup_summary(self.pruner.mode, model, selection, self.schedule, bool(self.uses_maintain)))

    def after_phase_change(
        self, change: PhaseChange, undone: bool | Callable[[bool], bool] = False
    ) -> tuple[bool, bool]:
        """At a PulseCycle phase ``change``: whether it ends the distillation window (the caller closes it)
        and whether it is an event's chance (a maintain phase starts, not at a resume, on the maintain
        cadence). In a step whose update is ``undone`` (:meth:`waits`), the chance waits for the next applied
        step (:attr:`deferred`, :meth:`event_due`): a cut there is chosen from magnitudes about to be
        dropped, and a structured one left the guard no snapshot that fits the model, so a held-out sweep's
        recoverable NaN burst stopped the fit where PulseCycle was listed first."""
        window_ends = self.window is not None and self.window.ends_with(change)
        maintain_entry = change.current is Phase.MAINTAIN and change.reason != "resume"
        due = bool(self.uses_maintain) and maintain_entry
        return window_ends, due and not self.waits(undone)

    def waits(self, undone: bool | Callable[[bool], bool]) -> bool:
        """Whether a due chance waits (:attr:`deferred`, until :meth:`advance`) because StabilityGuard drops
        its step's update as flagged: ``undone``, or ``undone(forced_skips=False)``
        (:func:`~lightning_pulse.protocols.step_undone`). The skips that follow a rollback
        (``skip_after_rollback``) do not count: the weights then are the rollback's snapshot's, healthy; a
        mask fits any snapshot, and the guard snapshots a structured cut made there before the next step.
        Waiting through them (20 by default) made a run whose skips reached its end miss its last events
        (0.492 of 0.5)."""
        waits = undone(False) if callable(undone) else undone
        self.deferred = self.deferred or waits
        return waits

    def event_due(self, step: int) -> bool:
        """At the batch end of the optimizer step that leaves the counter at ``step``: whether an event's
        chance is due, a deferred one (:meth:`after_phase_change`) or the step cadence's. The caller asks
        whether it :meth:`waits` before taking it (:meth:`advance`); if so it stays due."""
        return self.deferred or (not self.uses_maintain and self.schedule.due(step))

    def advance(self, step: int) -> float | None:
        """Take the chance to prune at optimizer ``step`` (:meth:`PruneSchedule.advance
        <lightning_pulse.core.prune_schedule.PruneSchedule.advance>`): the sparsity to prune to, or ``None``,
        always at or after :attr:`run_end`. A chance there comes after the run's last batch (a maintain phase
        starting at ``max_steps``, a step cadence landing on it): a cut then reaches the delivered model with
        no step to recover, as a held-out sweep's digits MLP did (0.46 to 0.50, probe val_loss 0.564 to
        0.593), while the fit-start plan, which counts chances before the run's end only, said 0.46. Takes
        a deferred chance too (:attr:`deferred`); one reaching :attr:`run_end` still waits, for the fit-end
        warning to say so: cleared first, a final cut a guard skip pushed onto the last step was dropped with
        no word of the wait (0.492 of 0.5)."""
        if step >= self.run_end:
            return None
        self.deferred = False
        return self.schedule.advance(step)

    def end_fit(self, model: nn.Module, step: int, fold: bool) -> None:
        """At the fit's end, at optimizer ``step``: the warning for a schedule left unfinished
        (:func:`~lightning_pulse.core.prune_setup.unfinished_warning`), the masked weights brought up to date
        (the last optimizer step came after the last forward) and, with ``fold``, the ``weight`` masks of the
        layers this callback masked (:attr:`own_masked`) folded, then the line on the last event.

        Another pruner's masks stay: Lightning's ``ModelPruning(make_pruning_permanent=False)`` was told to
        keep them, and folding every mask in the model took its reparametrisation away (so did folding every
        mask of a layer both prune: its ``bias_mask``). A layer of this
        callback's whose mask another callback has already folded is left as it is, its pruned zeros in its
        weight, and the line says so (:func:`~lightning_pulse.core.prune_setup.folded_elsewhere_note`):
        ``ModelPruning.on_train_end`` folds every prune hook in the model, ours included, before this runs,
        and the refresh of the hooks found before then crashed a finished fit
        (``no attribute 'weight_mask'``)."""
        warning = unfinished_warning(self.schedule, step, self.events)
        if warning is not None:
            waited = WAITED_NOTE.format(target=self.schedule.target(step)) if self.deferred else ""
            self.warn(warning + waited)
        self._fold_own_masks(model, fold)
        if self.events:
            self.info(fit_end_line(self.events[-1], step, kept_above_target(self.schedule)))
            if (short := short_warning(self.events[-1], self.schedule.final_sparsity)) is not None:
                self.warn(short)

    def _fold_own_masks(self, model: nn.Module, fold: bool) -> list[str]:
        """:meth:`end_fit`'s refresh of the masked weights and, with ``fold``, fold of the ``weight`` masks of
        :attr:`own_masked`; returns the layers folded."""
        self.masks.forget()  # the hooks there now, not those found before another callback folded some
        self.masks.refresh(model, grad=False)
        modules = dict(model.named_modules()) if self.own_masked else {}
        masked = [name for name in sorted(self.own_masked) if name in modules]
        gone = [name for name in masked if pruning.current_mask(modules[name]) is None]
        if gone:
            (self.info if fold else self.warn)(folded_elsewhere_note(gone, fold))
        folded = []
        if fold:
            folded = pruning.make_masks_permanent(model, only=set(masked) - set(gone), tensors={"weight"})
        self.masks.forget()
        return folded

    def end_after_exception(self, model: nn.Module, step: int, started: bool, fold: bool) -> None:
        """After an exception ended a stage at optimizer ``step``, once every ``on_exception`` hook ran
        (Lightning calls no fit-end or teardown hook then): what the stage's end does, so that the model is
        the same whichever way a fit ended. The distillation hook comes off the model; with ``fold``
        (``make_permanent``; unstructured only), a fit that ``started`` training folds :attr:`own_masked` as
        :meth:`end_fit` does, else the masks gained since the stage's setup (a restored checkpoint's) are
        folded as :meth:`stop_fitting_loads` does.
        Before, the masks and prune hooks stayed: the model's ``state_dict()`` did not load into its plain
        class, a plain Trainer went on training it under the masks, and a later ``trainer.validate`` folded
        them. A checkpoint saved in an ``on_exception`` hook (``OnExceptionCheckpoint``) ran before this and
        holds the masks, as any mid-run checkpoint does. A failure here is a warning: the stage's exception
        is the one to raise."""
        if self.window is not None:  # not logged, and no "had no effect" warning: the fit was cut short
            self.window.close(self.events)
        fold = fold and self.pruner.mode == "unstructured"
        try:  # own_masked is a past fit's (folded then) unless this stage trained
            folded = self._fold_own_masks(model, fold) if started else []
            self.stop_fitting_loads(model, fold=fold and not started)
        except Exception as error:  # raised here, it would hide the stage's exception
            self.stop_fitting_loads()  # the load hook comes off all the same
            self.warn(
                f"ScheduledPrune: after the exception, its masks could not be folded ({error!r}); fold them "
                "with `lightning_pulse.core.pruning.make_masks_permanent(model)`."
            )
            return
        if folded:
            sparsity = f"{self.sparsity:.3f}"
            self.info(
                f"ScheduledPrune: the fit stopped on an exception or interrupt at step {step}; the masks of "
                f"{len(folded)} layers were folded into their weights (sparsity {sparsity}), as at fit end: "
                "the model loads into its plain class. A checkpoint of the run resumes with ScheduledPrune."
            )

    # ------------------------------------------------------------------ an event
    def cut(
        self, model: nn.Module, target: float, optimizers: Sequence[torch.optim.Optimizer], teacher: bool
    ) -> tuple[pruning.PruneOutcome, nn.Module | None]:
        """Prune ``model`` to ``target`` on :attr:`example` (:meth:`Pruner.prune
        <lightning_pulse.core.pruning.Pruner.prune>`; the masked layers are found again at the next refresh)
        and warn of each optimizer state that could not be cut and was reset. Returns the outcome and, with
        ``teacher``, a copy of the model taken before the cut
        (:func:`~lightning_pulse.core.pruning.copy_without_hooks`)."""
        self.leave_out_substituted(model)
        copied = pruning.copy_without_hooks(model) if teacher else None
        if teacher:
            self.teacher_history = len(self.pruner.history)  # the teacher's shapes: the cuts before this one
        outcome = self.pruner.prune(model, target, optimizers, self.example)
        self._left_out_since(model, outcome)
        if self.pruner.mode == "unstructured":  # every chosen layer is masked now
            self.own_masked.update(outcome.layer_sparsity)
        self.masks.forget()
        for problem in outcome.problems:
            self.warn(f"ScheduledPrune: {problem}")
        return outcome, copied

    def _left_out_since(self, model: nn.Module, outcome: pruning.PruneOutcome) -> None:
        """Add to ``outcome``'s ``left_out`` (and ``uncut``) the layers the fit start chose that the selection
        leaves out now (a parametrization registered on one since: the fit-start check, made again), but
        those an earlier event left uncut already. The pruner adds the structured roots it cut
        before and cannot cut now."""
        selection = self.pruner.selection(model)
        # a layer an earlier event left uncut for another reason (an output layer) loses nothing now
        before = {
            name
            for e in self.events
            for name in set(e.get("uncut_layers") or ()) - set(e.get("left_out_layers") or ())
        }
        before |= set(self.pruner.not_trained)  # said by leave_out_substituted, not a change to the model
        for name in self.chosen:
            if name in selection.left_out and name not in before and name not in outcome.left_out:
                outcome.left_out[name] = pruning.why_left_out(name, selection, model)
                outcome.uncut.append(name)

    def leave_out_substituted(self, model: nn.Module) -> None:
        """After the fit's first optimizer step (or at an event before it), before any mask: stop watching
        the layers' forwards (nothing when not watching: a cheap call every step), raise
        :class:`~lightning_pulse.errors.PulseRefusal` for layers whose weight parameter was replaced meanwhile
        (:func:`~lightning_pulse.core.prune_setup.refuse_replaced_weights`), leave out for good
        those seen reading a ``weight`` passed in for them rather than their own
        (:class:`~lightning_pulse.core.prune_targets.OwnWeightWatch`) and say which; raise
        :class:`~lightning_pulse.errors.PulseRefusal` when that leaves no layer to prune."""
        if not self._watching:
            return
        self._watching = False
        found = self.own_weights.stop()
        refuse_replaced_weights(self.own_weights.replaced)
        if not found:
            return
        self.pruner.not_trained.update(found)
        names = ", ".join(list(found)[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
        if not self.pruner.selection(model).layers:
            pattern = exact_names_pattern(found)
            raise PulseRefusal(
                f"ScheduledPrune: no layer can be pruned: the forwards of {names} read a `weight` passed in "
                "for them (torch.func.functional_call: a hypernetwork, fast weights), not their own "
                "parameter, and a mask sets a layer's weight from its own parameter before every call, so it "
                "would overwrite the weights the model uses and they would stop training. Prune the module "
                f"that makes those weights instead (leave these layers out with `exclude_pattern`={pattern!r}), "
                "or remove ScheduledPrune."
            )
        self.info(f"ScheduledPrune: left out from the first event on: {names} ({NOT_OWN_WEIGHT}).")

    def record(
        self,
        step: int,
        target: float,
        outcome: pruning.PruneOutcome,
        model: nn.Module,
        probes: tuple[Mapping[str, float] | None, Mapping[str, float] | None],
        phase: str | None,
    ) -> dict[str, Any]:
        """Add the record of the event at ``step`` (:func:`~lightning_pulse.core.pruning.event_record`, with
        the pulse ``phase`` it happened in, ``None`` without a PulseCycle) to :attr:`events`, dropping the
        oldest beyond :data:`~lightning_pulse.records.RECENT_RECORDS`, and return it. ``probes``: the probe
        metrics before and after the event. Nothing reads a total off the records: the schedule keeps the
        sparsity reached, and the messages read the latest record."""
        event = pruning.event_record(step, target, outcome, model, *probes)
        event["phase"] = phase
        # each record holds a per-layer dict: a million-step run of a deep model held MBs of them
        append_recent(self.events, event, RECENT_RECORDS)
        new = {name: why for name, why in outcome.left_out.items() if name not in self.warned_left_out}
        if new:  # once per layer: every later event names it in its line and record
            self.warned_left_out.update(new)
            self.warn(
                left_out_warning(event, new, self.schedule.final_sparsity, self.pruner.mode == "structured")
            )
        return event

    def open_window(self, student: nn.Module, teacher: nn.Module | None, accumulation: int) -> None:
        """Start distilling ``teacher`` (:meth:`cut`'s copy) into ``student`` after the last event, if
        distillation is on (the term divided by ``accumulation``, the gradient-accumulation factor)."""
        if self.window is not None and teacher is not None:
            step = self.events[-1]["step"] if self.events else None
            self.window.open(student, teacher, step, accumulation)

    def accumulate(self, accumulation: int) -> None:
        """An open distillation window's term is divided by ``accumulation`` from now on
        (:meth:`DistillWindow.accumulate <lightning_pulse.core.distillation.DistillWindow.accumulate>`)."""
        if self.window is not None:
            self.window.accumulate(accumulation)

    def end_distillation(self) -> dict[str, float]:
        """Close the open distillation window, if any (its event's record gets its calls and loss), and return
        the metrics to log: none without a window, and a warning instead when its term never reached the
        student."""
        closed = self.window.close(self.events) if self.window is not None else None
        if closed is None:
            return {}
        calls, loss = closed
        if calls == 0:
            self.warn(DISTILL_NO_EFFECT)
            return {}
        return {"prune/distill_loss": loss}

    def restore_teacher(self, student: nn.Module, accumulation: int) -> None:
        """Close the open distillation window and reopen the one :attr:`pending_teacher` holds, if any, its
        teacher rebuilt from ``student`` (:func:`~lightning_pulse.core.distillation.teacher_from_state`; the
        term divided by ``accumulation``, the gradient-accumulation factor)."""
        saved, self.pending_teacher = self.pending_teacher, None
        if saved is not None and "event_step" not in saved and "event" in saved:
            # a checkpoint of an earlier version: the index of the window's event in its records
            index = int(saved["event"])
            step = self.events[index]["step"] if 0 <= index < len(self.events) else None
            saved = {**saved, "event_step": step}
        template, self.teacher_template = self.teacher_template, None
        if saved is not None and saved.get("history_length") is not None:
            self.teacher_history = int(saved["history_length"])
        if self.window is not None:
            self.window.restore(student, saved, accumulation, template)

    # ------------------------------------------------------------------ checkpoints and rollbacks
    def state_dict(self) -> dict[str, Any]:
        """The schedule's and the pruner's state, the event records, the layers the user froze, the cadence
        decided, a deferred chance (kept in a StabilityGuard stop checkpoint too: its maintain phase began,
        and a resume from it takes the event at its first step) and, while a distillation window is open, its
        teacher."""
        state = {**self.schedule.state_dict(), **self.pruner.state_dict(), "deferred_event": self.deferred}
        state["events"] = [dict(event) for event in self.events]
        state["user_frozen"], state["uses_maintain"] = sorted(self.pruner.user_frozen), self.uses_maintain
        state["mode"] = self.pruner.mode
        teacher = self.window.state_dict() if self.window is not None else None
        if teacher is not None:
            state["teacher"] = {**teacher, "history_length": self.teacher_history}
        return state

    def load_state_dict(
        self,
        state: Mapping[str, Any],
        rollback: bool = False,
        student: nn.Module | None = None,
        accumulation: int = 1,
    ) -> None:
        """Load a :meth:`state_dict`; its teacher waits in :attr:`pending_teacher` (see
        :meth:`restore_teacher`) and the masked layers are found again at the next refresh. A ``rollback``
        keeps a deferred chance: the maintain phase it waits for began (the clock does not go back), and an
        event taken since the snapshot held a deferred one is undone and redone at the next applied step.
        A resume (not a ``rollback``) keeps the run's own frozen set in :attr:`restored_frozen`.

        A ``rollback`` with the ``student`` (the model, just returned to the snapshot too) restores the
        teacher at once (:meth:`restore_teacher`, ``accumulation`` the gradient-accumulation factor): the
        teacher of an undone event goes and one saved in the snapshot comes back (on a checkpoint restore,
        :meth:`start_training` does)."""
        self.deferred = bool(state.get("deferred_event", False)) or (rollback and self.deferred)
        self.schedule.load_state_dict(state)
        # a snapshot from before this fit's start: its finished schedule is opened again, as plan_cadence did
        if rollback:
            self.schedule.reopen(self.last_step)
        self.pruner.load_state_dict(state)
        self.events = [dict(event) for event in state["events"]]
        self.uses_maintain = state.get("uses_maintain", self.uses_maintain)
        self.pending_teacher = state.get("teacher")
        self.restored_mode = saved_mode(state)
        self.masks.forget()
        if not rollback and "user_frozen" in state:
            self.restored_frozen = frozenset(state["user_frozen"])
        if rollback and student is not None:
            self.restore_teacher(student, accumulation)

    def rollback_state_dict(self, model: nn.Module | None) -> dict[str, Any]:
        """What a StabilityGuard snapshot keeps: the :meth:`state_dict`, and which layers of ``model`` had a
        mask then (``None`` without a model), for :meth:`masks_after_rollback`. A pass over the modules."""
        state = self.state_dict()
        state["masked_layers"] = pruning.masked_layer_names(model) if model is not None else None
        return state

    def masks_after_rollback(self, model: nn.Module, masked_then: Collection[str] | None) -> None:
        """After a rollback (unstructured), make the masks of the pruned layers say what the restored record
        says, and ``layer.weight`` show the restored weights at once (a callback reading it later in this
        step). ``masked_then``: the layers that had a mask at the snapshot (``None``: unknown).

        A layer with a mask now and none at the snapshot kept its mask in the restore
        (``core/snapshots.py:fitted_state``: another pruner's masks stay, as it does not prune again). Here
        it was this callback's own event, undone: with no event in the restored record, the layer comes back
        unpruned (a mask of ones) and the schedule redoes the event. With events, a fit resumed after a fit's
        end masks the zeros folded into the weights again in its ``on_train_start``, and StabilityGuard's
        fit-start snapshot, taken after every train start, holds those masks: the zeros are masked again, as at
        that start. A layer masked at the snapshot got its saved mask back. A pass over the layers, at a
        rollback only.
        """
        if self.pruner.mode != "unstructured":
            return
        if masked_then is not None:
            masked_then = set(masked_then)
            for name, layer in self.pruner.layers(model).items():
                mask = pruning.current_mask(layer)
                if mask is None or name in masked_then:
                    continue
                if self.schedule.sparsity > 0:
                    pruning.mask_zeros(layer)
                else:
                    mask.fill_(1)
        # a write to a computed weight before the rollback is undone too
        pruning.discard_written_weights(model)
        self.masks.refresh(model, grad=False)


def reopened_warning(schedule: PruneSchedule, reached: float, on_maintain: bool, run_end: float) -> str:
    """The fit-start warning for a finished ``schedule`` opened again (:meth:`PruneSchedule.reopen
    <lightning_pulse.core.prune_schedule.PruneSchedule.reopen>`) at ``reached`` sparsity: this run's raised
    ``final_sparsity`` is honoured, as in a resume of an unfinished schedule, from the next chance on (a
    maintain-phase start with ``on_maintain``) before ``run_end``. Before, the restored ``finished`` kept the
    model at 0.5 under ``final_sparsity=0.8`` with nothing said."""
    first = schedule.next_step if schedule.next_step is not None else schedule.start_step
    final, start, end, value = (
        schedule.final_sparsity,
        schedule.start_step,
        schedule.end_step,
        schedule.target(first),
    )
    # the schedule only grows: a maintain phase starting at or after `first` cuts to at least its value there
    first_cut = (
        f"at the next maintain-phase start, cuts to at least {value:.3f}"
        if on_maintain
        else f"at step {first}, cuts to {value:.3f}"
    )
    finished = (
        f"ScheduledPrune: the resumed schedule had finished at sparsity {reached:.3f}, below this run's "
        f"`final_sparsity`={final:g}"
    )
    if first >= run_end:  # nothing to say of cuts that will not come, nor a way to avoid them
        return f"{finished}, but no step of this run is left for a cut: the sparsity stays at {reached:.3f}."
    text = (
        f"{finished}: pruning goes on, each event to the schedule's value at its step on this run's span "
        f"(steps {start} to {end}); the first, {first_cut}."
    )
    if first >= end:
        text += (
            f" The span has ended, so that one cut goes to {final:g} at once; resume with a later `end` to "
            "spread it."
        )
    return text + f" To keep {reached:.3f}, resume with the `final_sparsity` of the checkpoint's run."


def left_out_warning(
    event: Mapping[str, Any], left_out: Mapping[str, str], final: float, structured: bool
) -> str:
    """The warning for chosen layers an event could no longer prune (``left_out``: name -> why): why, what it
    does to the sparsity, and the ways out."""
    reasons = "; ".join(f"{name}: {why}" for name, why in left_out.items())
    # structured counts every layer it cut; unstructured, the layers it masks now
    short = (
        f"the run ends short of `final_sparsity`={final} (this event: {event['sparsity']:.3f} for a target "
        f"of {event['target_sparsity']:.3f}; `ScheduledPrune.sparsity` gives the sparsity reached)"
        if structured
        else "the event's sparsity counts the other layers only"
    )
    return (
        f"ScheduledPrune: at the event of step {event['step']}, {len(left_out)} layer(s) chosen at fit "
        f"start could no longer be pruned, after a change to the model since ({reasons}). They keep the "
        "sparsity they have and are named in each event's `uncut_layers` and `left_out_layers`; "
        f"{short}. Way out: make that change before the fit (the fit-start check then leaves out what it "
        "blocks, or refuses the run naming a way out, and the layers left reach the target), or undo it "
        "before the next event."
    )


def short_warning(event: Mapping[str, Any], final: float) -> str | None:
    """At fit end, where the last ``event`` could no longer prune chosen layers and ended short of ``final``:
    the warning that says so; ``None`` otherwise."""
    left_out = event.get("left_out_layers") or []
    if not left_out or event["sparsity"] >= final - 1e-9:
        return None
    return (
        f"ScheduledPrune: the fit ended short of `final_sparsity`={final}, at sparsity "
        f"{event['sparsity']:.3f}: {first_names(left_out, 3)} could no longer be pruned (see the warning "
        "of the event that first found it)."
    )


def fit_end_line(event: Mapping[str, Any], step: int, kept: str = "") -> str:
    """The fit-end line: the fit's last optimizer ``step``, then the model as the last ``event`` left it
    (``kept``: :func:`~lightning_pulse.core.prune_setup.kept_above_target`'s opening, else ``""``). The
    sparsity and the non-zero parameters hold at the fit's end (nothing cuts after the last event); the step
    and the probe are the event's. The line used to read "at fit end, step 140: ... val_acc=0.58" for a fit
    that trained to step 200 after that event (a held-out sweep: step 367 of 524, its test accuracy 0.49
    against the probe's 0.45), the event's step and probe taken for the fit's end."""
    since = step - int(event["step"])
    probed = (
        f"; its probe is that event's, {since} steps before the fit's end" if event["probe_after"] else ""
    )
    return (
        f"ScheduledPrune: at fit end, step {step}; {kept or 'the last prune event, '}"
        f"{pruning.event_summary(event)}{probed if since > 0 else ''}."
    )


def reusable_probe(cycle: Any, maintain_entry: bool, probe: Any) -> dict[str, float] | None:
    """The probe metrics to reuse as those before an event: at a ``maintain_entry``, a copy of the probe a
    PulseCycle (``cycle``; ``None`` without one) has just run there (``maintain_eval='probe'``), rather than
    evaluate the model twice; else ``None``. Only where the event's own ``probe`` (the "after" figures') reads
    the very batches the cycle's did (``probe.shares_batches``): ``PulseCycle(probe_batches=1)`` next to
    ``ScheduledPrune(probe_batches=4)`` compared one batch before the cut with four after it, and an event
    reported +13.2% val_loss for a cut that changed it by 0.0% on the same four batches. Not where the cycle's
    probe is off (it raised here or earlier): its last figures are an older step's (a review found an event's
    "before" figures from four steps earlier)."""
    if maintain_entry and cycle is not None and cycle.maintain_eval == "probe" and cycle.last_probe:
        if cycle.probe.off:
            return None
        return dict(cycle.last_probe) if probe.shares_batches(cycle.probe) else None
    return None


#: what the fit-end warning adds where an event due still waited (:meth:`PruneEvents.waits`) at the run's end
WAITED_NOTE = (
    " An event due (a cut to {target:.3f}) waited for a step StabilityGuard did not flag (skipped or rolled "
    "back; its skips after a rollback do not hold an event back), and none came before the run's last step, "
    "where no cut is made: inspect the data and learning rate near the run's end."
)
