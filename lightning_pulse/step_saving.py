"""Step-saving replay on a Lightning Trainer: the adapter between a run and :mod:`lightning_pulse.core.step_plan`.

:class:`StepSavingLoader` plans the run when the training DataLoader is ready (inside Lightning's data set-up,
before ``configure_optimizers`` reads ``estimated_stepping_batches``), caps ``trainer.max_steps`` at the plan,
puts a :class:`~lightning_pulse.core.sample_index.PlannedBatchSampler` into the loader, and moves each epoch's
validation batch to the pass's real end. :class:`~lightning_pulse.HardSampleReplay` owns one in
``mode="steps"``; the PulseCycle it follows gets the plan (and fits its budget first).
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_pulse import _lightning_compat as compat
from lightning_pulse.callbacks.pulse_cycle import pulse_cycle_of
from lightning_pulse.core.replay import (
    CUT_EPOCH_WAY_OUT_BY_EPOCHS,
    CUT_EPOCH_WAY_OUT_BY_STEPS,
    SCHEDULE_FREQUENCY_COUNT,
    SCHEDULE_FREQUENCY_WAY_OUT,
    SCHEDULE_LENGTH_WAY_OUT,
    SEQUENTIAL_SCHEDULE_WAY_OUT,
    STEPS_MODE_ACCUMULATION_SCHEDULE_REFUSAL,
    STEPS_MODE_CLOCK_REFUSAL,
    STEPS_MODE_CUT_EPOCH_SCHEDULE_REFUSAL,
    STEPS_MODE_EMPTY_EPOCH_REFUSAL,
    STEPS_MODE_JOINED_MID_EPOCH_REFUSAL,
    STEPS_MODE_LENGTH_REFUSAL,
    STEPS_MODE_LIMIT_REFUSAL,
    STEPS_MODE_OPTIMIZERS_REFUSAL,
    STEPS_MODE_RELOAD_REFUSAL,
    STEPS_MODE_RESUMED_SCHEDULE_REFUSAL,
    STEPS_MODE_SAMPLER_LENGTH_REFUSAL,
    STEPS_MODE_SCHEDULE_FREQUENCY_REFUSAL,
    STEPS_MODE_SCHEDULE_LENGTH_REFUSAL,
    STEPS_MODE_SCHEDULE_NEVER_STEPPED_REFUSAL,
    STEPS_MODE_SCHEDULE_OUTRUN_REFUSAL,
    STEPS_MODE_SEQUENTIAL_MILESTONE_REFUSAL,
    STEPS_MODE_STEP_BOUND_REFUSAL,
    STEPS_MODE_WORLD_SIZE_REFUSAL,
    Composition,
    HardSampleSelector,
    given_loaders_refusal,
)
from lightning_pulse.core.replay_batch import refuse
from lightning_pulse.core.sample_index import (
    PlannedBatchSampler,
    RanksReadAhead,
    SampleIndexTracker,
    draws_each_index_once,
    read_ahead_of_rank,
)
from lightning_pulse.core.step_plan import (
    DROPPED_PASS_REST,
    StepPlan,
    StepSavingStream,
    budget_shortfall,
    nothing_to_choose_note,
    plan_settings,
    plan_summary,
    resumed_plan_change,
    run_scheduler_steps,
    schedule_course,
    schedule_lengths,
    schedule_position,
    scheduler_end,
    scheduler_outrun,
    scheduler_overrun,
    scheduler_past_end,
    sequential_part,
)
from lightning_pulse.errors import PulseRefusal


@dataclass(frozen=True)
class UnplannedLengths:
    """The lengths a per-step LR schedule built for the run without the plan has: ``max_steps``, and, where
    ``max_epochs`` ends the plain run, its ``plain_steps`` (``max_epochs`` epochs of ``epoch_steps``) as the
    usual formulas count them. Lightning's ``estimated_stepping_batches`` rounds each epoch's steps up;
    Hugging Face's example scripts' ``len(loader) // accumulate * epochs`` rounds them down, and
    ``len(loader) * epochs // accumulate`` rounds the run's. Nothing else is read as the run's length: a
    warm-up count or a Noam schedule's ``d_model`` is no length of the run (a range of lengths around
    ``plain_steps`` refused such a schedule, a review found). A scheduler Lightning steps every ``frequency``
    optimizer steps (its config's ``"frequency"``) was built for these lengths divided by its frequency."""

    plain_steps: int
    max_epochs: int | None
    batches: int  # the plain epoch's batches
    accumulate: int
    max_steps: int | None

    def source_of(self, length: int, frequency: int = 1) -> tuple[str, int] | None:
        """Where a schedule of ``length`` scheduler steps comes from (for the refusal) and the unplanned run
        length in optimizer steps it was built for, or ``None`` for no unplanned length of the run. A
        scheduler Lightning steps every ``frequency`` optimizer steps spans ``length * frequency`` of them:
        built for a run of ``n`` steps, its length is ``n // frequency`` or that rounded up (or ``n``, the
        frequency left out of the count)."""
        for steps, source in self._lengths():
            if length == steps:
                return source, steps
            if frequency > 1 and length in (steps // frequency, -(-steps // frequency)):
                return (
                    f"{source}: {steps} optimizer steps over the scheduler's `frequency`={frequency}",
                    steps,
                )
        return None

    def _lengths(self) -> list[tuple[int, str]]:
        """The unplanned run lengths in optimizer steps, each with where it comes from."""
        lengths = [] if self.max_steps is None else [(self.max_steps, f"max_steps={self.max_steps}")]
        epoch_steps = max(1, math.ceil(self.batches / self.accumulate))
        if self.max_epochs is None or self.plain_steps != self.max_epochs * epoch_steps:
            return lengths  # max_steps ends the plain run: its length is max_steps
        source = f"max_epochs={self.max_epochs} of {epoch_steps} optimizer steps"
        lengths.append((self.plain_steps, source))
        rounded_down = {
            self.max_epochs * (self.batches // self.accumulate),
            self.max_epochs * self.batches // self.accumulate,
        } - {self.plain_steps}
        rounded = f"{source}, {self.plain_steps} in all, counted with the epochs' steps rounded down"
        return lengths + [(steps, rounded) for steps in sorted(rounded_down)]

    def cut_short(
        self, config: Any, planned: int, steps: Callable[[int], int] | None = None
    ) -> ScheduleCut | None:
        """The cut of the LR scheduler ``config``'s course when it is a per-step schedule built for an
        unplanned length that the ``planned`` steps fall short of, else ``None`` (an epoch-interval one keeps
        its epochs). The planned run steps it its steps so far plus ``steps(frequency)``, the steps Lightning
        gives it over the plan's rest (:meth:`~lightning_pulse.core.step_plan.StepSavingStream.
        scheduler_steps`: per epoch, in batches under accumulation; ``None``: ``planned // frequency`` in all,
        a plan whose epochs are not known here). A length of the unplanned run over the frequency that the
        planned steps still reach (48 planned of a plain 50, ``T_max=50 // 4``, stepped 12 times) is its whole
        course, not a cut, and one the unplanned run stops short of as well (``T_max=13``, stepped 12 times in
        either run; ``T_max=100 // 4`` over two plain epochs of 50 batches, stepped 12 times in each) is no
        cut of the plan's."""
        if config.interval != "step":
            return None
        frequency = max(1, int(config.frequency))
        if steps is None:
            stepped = planned // frequency
        else:
            stepped = schedule_position(config.scheduler) + steps(frequency)
        course = schedule_course(config.scheduler)
        for length in sorted(schedule_lengths(config.scheduler)):
            found = self.source_of(length, frequency)
            # cut only where the plan steps it fewer times than the unplanned run would have: a length
            # rounded up (T_max=13 for 50 // 4) that the plain run stops short of too is not the plan's doing
            if found is not None and stepped < min(length, self.scheduler_steps(frequency, found[1])):
                divided = frequency if length != found[1] else 1
                # the share of its whole course: a SequentialLR's cosine of T_max=64 after a warm-up of 5 ends
                # at 69
                whole = max(length, course[0]) if course is not None else length
                return ScheduleCut(length, found[0], stepped / whole, divided, stepped)
        return None

    def scheduler_steps(self, frequency: int, steps: int) -> int:
        """The steps Lightning gives a per-step scheduler of ``frequency`` over ``steps`` optimizer steps of
        the unplanned run's plain epochs (:func:`~lightning_pulse.core.step_plan.run_scheduler_steps`)."""
        return run_scheduler_steps((), self.batches, frequency, self.accumulate, steps)


@dataclass(frozen=True)
class ScheduleCut:
    """A per-step schedule the plan would stop part-way: its ``length`` in scheduler steps, where that comes
    from (``source``), the ``share`` of its course the planned run reaches, and the ``frequency`` its length
    was divided by (1: none), and the times the planned run steps it (``stepped``)."""

    length: int
    source: str
    share: float
    frequency: int
    stepped: int = 0


class StepSavingLoader:
    """One fit's step-saving plan on one training DataLoader, and where the run stands in it."""

    def __init__(self) -> None:
        self.stream = StepSavingStream()
        self.epoch_batches = 0  # the batches of the pass under way
        self.loader: Any = None  # the training DataLoader tracked in this fit (either mode), until released
        self._drawn_at: int | None = None  # Lightning's count of batches fetched when the latest was drawn
        self._latest_cut: Any = None  # the latest batch's cut (None: a plain batch)
        self._trainer: pl.Trainer | None = None
        self._sampler: PlannedBatchSampler | None = None
        self._choose: Callable[[list[list[int]], list[int], list[int], float], list[Any]] | None = None
        self._selector: HardSampleSelector | None = None  # its table's running prior is the passes' prior
        # the index sampler may draw a sample twice in a pass: each pass keeps the scores it began with
        self._repeats = False
        # the lengths the run had without the plan: a per-step schedule built for one of them stops part-way
        # through its course (see refuse_schedules_cut_short)
        self._unplanned: UnplannedLengths | None = None
        # (trainer, its max_steps as the user set it, the plan's cap): see uncap
        self._capped: tuple[weakref.ReferenceType[pl.Trainer], int, int] | None = None
        self._batches_drawn = 0  # this fit's, all epochs
        # under DDP, every rank's cuts of the batches drawn ahead of a rollback, for rank 0's checkpoint
        self._ranks_read_ahead = RanksReadAhead()
        # a restored fit: Lightning's restart read past the batches a -1 skipped (see install), until it ran
        self._remove_restart_hook: Callable[[], None] | None = None
        self._drawn_before_epoch = 0  # by the end of the previous epoch (see on_train_epoch_end)
        self._restored_epoch_open = False  # the fit's first epoch goes on from a checkpoint: it may draw none
        self._training_started = False  # on_train_start ran: Lightning sets each pass's sampler epoch first
        self._deferred: pl.Trainer | None = None  # check_trainer waits for the data set-up (check_at_setup)
        # what install planned with (light phases, make_plan's run, the SWA step): an epoch cut short plans
        # the rest of the run again with them (see follow_cut_epoch)
        self._planned_with: tuple[tuple[str, ...], dict[str, Any], bool] | None = None
        self._scores_kept = False  # the plan joins the run for another number of processes (plan_summary)

    @property
    def plan(self) -> StepPlan | None:
        return self.stream.plan

    def check_at_setup(self, trainer: pl.Trainer, loaders: list[Any] | None) -> None:
        """At setup: the training DataLoaders' own refusal
        (:func:`~lightning_pulse.core.replay.loader_refusal`), then :meth:`check_trainer`, whose ways out
        (``mode='batch'``, dropping the setting) leave that refusal standing. ``loaders``: the ones given to
        ``fit``; built by a hook (``None``), they come at the data set-up, where :meth:`check_deferred` checks
        the settings after the DataLoaders' own refusal."""
        # nothing reaches a data set-up that trains no batch (limit_train_batches=0): checked here then
        self._deferred = trainer if loaders is None and trainer.limit_train_batches != 0 else None
        refuse(None if loaders is None else given_loaders_refusal(loaders))
        if self._deferred is None:
            self.check_trainer(trainer)

    def check_deferred(self, loaders: list[Any] | None = None) -> None:
        """At the data set-up, where :meth:`check_at_setup` left the checks to it: the DataLoaders' own
        refusal (``loaders``: all that the hook built, before any is set up, so that the refusal of a second
        one comes before the settings', whose way out it refuses too; ``None``: each one's, at its own set-up,
        already passed), then :meth:`check_trainer`; nothing otherwise."""
        trainer, self._deferred = self._deferred, None
        if trainer is not None:
            refuse(None if loaders is None else given_loaders_refusal(loaders))
            self.check_trainer(trainer)

    @staticmethod
    def check_trainer(trainer: pl.Trainer) -> None:
        """Refuse Trainer settings under which the plan would not drive the run's batches (see
        :meth:`check_at_setup` for when).

        Raises:
            PulseRefusal: for ``fast_dev_run``, ``overfit_batches``, ``limit_train_batches`` or
                ``reload_dataloaders_every_n_epochs``.
        """
        # Lightning turns both into limit_train_batches: the refusal names the flag the user set
        for flag in ("fast_dev_run", "overfit_batches"):
            if value := getattr(trainer, flag, 0):
                raise PulseRefusal(STEPS_MODE_LIMIT_REFUSAL.format(flag=flag, value=value))
        limit = getattr(trainer, "limit_train_batches", 1.0)
        # an int counts batches (1: one batch), a float is a share (1.0: all of them)
        if limit is not None and not (isinstance(limit, float) and limit == 1.0):
            raise PulseRefusal(STEPS_MODE_LIMIT_REFUSAL.format(flag="limit_train_batches", value=limit))
        if reload := getattr(trainer, "reload_dataloaders_every_n_epochs", 0):
            raise PulseRefusal(STEPS_MODE_RELOAD_REFUSAL.format(every=reload))

    def install(
        self,
        trainer: pl.Trainer,
        loader: Any,
        tracker: SampleIndexTracker,
        selector: HardSampleSelector,
        light_phases: Sequence[str],
        choose: Callable[[list[list[int]], list[int], list[int], float], list[Any]],
    ) -> StepPlan:
        """Plan the run, cap ``max_steps`` and put the planned batch sampler into ``loader``.

        A light step's batch is cut from a window of ``batch_size / fraction`` samples, ``fraction`` being the
        ``selector``'s replay fraction. ``choose(windows, ordinals, steps, prior)`` cuts a pass's light-phase
        windows to the batches that train, before they are loaded: ``ordinals`` are the batches' places in their
        epoch and ``steps`` the optimizer steps they train at.

        Raises:
            PulseRefusal: for a PulseCycle with wall-clock durations or a budget it cannot meet, for a
                run of unknown length, and for a sampler without a length.
        """
        self._trainer = trainer
        self._selector = selector
        fraction = selector.config.replay_fraction
        if compat.steps_per_batch_unknown(trainer):
            raise PulseRefusal(STEPS_MODE_OPTIMIZERS_REFUSAL.format(count=len(trainer.optimizers)))
        cycle = pulse_cycle_of(trainer)
        if cycle is not None and cycle.clock.uses_wall_clock:
            raise PulseRefusal(STEPS_MODE_CLOCK_REFUSAL)
        # a StochasticWeightAveraging's BatchNorm-update epoch trains nothing: it is no epoch of the plain run
        training_epochs = compat.training_max_epochs(trainer)
        max_epochs = training_epochs if training_epochs not in (None, -1) else None
        max_steps = trainer.max_steps if trainer.max_steps != -1 else None
        if max_epochs is None and max_steps is None:
            if cycle is not None:
                cycle.check_run_length(math.inf)  # its warm-up or anneal speaks first
            raise PulseRefusal(STEPS_MODE_LENGTH_REFUSAL)
        batches, sampler = loader.batch_sampler, tracker.recorder.sampler
        try:  # a sampler without __len__ (one streaming indices) has no pass to plan; batch mode needs none
            plain_batches = len(batches)
        except TypeError:
            raise PulseRefusal(
                STEPS_MODE_SAMPLER_LENGTH_REFUSAL.format(sampler=type(sampler).__name__)
            ) from None
        accumulate = trainer.accumulate_grad_batches
        scheduled = next((c for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)), None)
        if scheduled is not None:
            raise PulseRefusal(
                STEPS_MODE_ACCUMULATION_SCHEDULE_REFUSAL.format(
                    accumulate=accumulate, scheduled=scheduled.get_accumulate_grad_batches(0)
                )
            )
        if cycle is not None:
            cycle.fit_budget(fraction, light_phases, math.ceil(plain_batches / accumulate))
        resaved_from = self.follow_world_size(trainer)
        self._scores_kept = resaved_from is not None
        self._join_run_under_way(trainer, plain_batches)
        clock, budget = (None, None) if cycle is None else (cycle.clock, cycle.budget)
        restored = self.stream.has_restored_state and trainer.global_step > 0
        run: dict[str, Any] = dict(
            batch_size=batches.batch_size,
            fraction=fraction,
            samples_per_epoch=len(sampler),
            max_epochs=max_epochs,
            max_steps=max_steps,
            accumulate=accumulate,
            drop_last=batches.drop_last,
        )
        plan = self.stream.make_plan(
            clock,
            light_phases,
            plan_settings(clock, budget, fraction, light_phases),
            lightning_epoch=compat.restored_position(trainer, plain_batches)[0] if restored else None,
            **run,
        )
        unplanned = UnplannedLengths(plan.plain_steps, max_epochs, plain_batches, accumulate, max_steps)
        # a per-step schedule whose length is the unplanned max_steps (over its `frequency`, if any)
        configs, steps = trainer.lr_scheduler_configs, self.planned_scheduler_steps(trainer, max_epochs)
        cuts = [
            cut
            for config in configs
            if (cut := unplanned.cut_short(config, plan.total_steps, steps)) is not None
        ]
        if max_epochs is None and cuts:
            refusal = STEPS_MODE_STEP_BOUND_REFUSAL.format(
                max_epochs=trainer.max_epochs,
                max_steps=max_steps,
                planned=plan.total_steps,
                share=min(cut.share for cut in cuts),
                epochs=math.ceil(max_steps / max(1, math.ceil(plain_batches / accumulate))),
            )
            if (every := max(cut.frequency for cut in cuts)) > 1:
                refusal += f" (Its length is max_steps over the scheduler's `frequency`={every}.)"
            raise PulseRefusal(refusal)
        # a resume that dropped a stopped epoch's rest plans the rest anew: its own warm-up and anneal
        changed = bool(self.stream.changed_settings) or self.stream.dropped_pass_rest is not None
        shortfall = None if cycle is None else budget_shortfall(plan, cycle.budget, changed)
        if shortfall is not None:  # a warning, not a refusal: a smoke run of a shipped YAML must still train
            rank_zero_warn(f"PulseCycle: {shortfall}")
        self._unplanned = unplanned
        # the plan's data gives exactly its total (warm-up and anneal are pinned where no exact fixed point
        # exists, see plan_steps), so max_epochs is left as the user set it: epoch-interval schedulers,
        # EarlyStopping's patience and epoch checkpoints count the epochs they were given
        # that epoch runs after the plain run's last epoch (not after a max_steps that ends it sooner) and
        # takes a step of its own, which max_steps counts
        # (a plan that joined the run counts the steps before it in this fit's epochs: max_steps too)
        batch_norm_step = compat.adds_batch_norm_epoch(trainer) and (
            max_epochs is not None
            and (max_steps is None or max_steps - plan.steps_before + plan.plain_before > plan.plain_steps)
        )
        user_max_steps = trainer.max_steps
        cap = compat.cap_training_steps(trainer, plan.total_steps, batch_norm_step)
        self._planned_with = (tuple(light_phases), run, batch_norm_step)
        self._capped = (
            weakref.ref(trainer),
            user_max_steps,
            cap,
        )  # weak: kept after the fit, not the Trainer
        self._choose = choose
        self._repeats = not draws_each_index_once(sampler)
        self._sampler = PlannedBatchSampler(batches, self._sizes_for_pass, plain_batches, self._cut)
        compat.replace_batch_sampler(loader, self._sampler)
        if compat.epoch_restarting(trainer):  # the plan goes on after the batch saved at, as Lightning would
            self._remove_restart_hook = compat.restart_past_skipped_batches(trainer)  # without earlier skips
        if cycle is not None:
            cycle.adopt_plan(plan)
        replanned = self.stream.replanned_for_another_length
        if dropped := self.stream.dropped_pass_rest:
            rest = DROPPED_PASS_REST.format(epoch=dropped[0], batches=dropped[1], next_epoch=dropped[0] + 1)
            remade = f" ({rest}; the checkpoint's plan remade from step {plan.from_step} on)."
        elif settings_changed := self.stream.changed_settings:
            remade = f" (the checkpoint's plan remade from step {plan.from_step} on for {settings_changed})."
        elif resaved_from is not None:
            remade = (
                f" (the checkpoint's plan, made on {resaved_from} process(es), remade from epoch "
                f"{plan.first_epoch} on for {trainer.world_size})."
            )
        else:
            remade = " (the checkpoint's plan remade for this run's length)." if replanned else "."
        # past a plan's data the run trains plain batches while its epochs allow: max_epochs ends it there
        run_steps = plan.run_steps(max_epochs is not None)
        ends_sooner = (
            f", but max_epochs={trainer.max_epochs} ends the run at step {run_steps}, where its data ends"
            if run_steps < plan.total_steps
            else ""
        )
        rank_zero_info(
            f"HardSampleReplay: "
            f"{plan_summary(plan, budget, run_steps, batches.batch_size, self._scores_kept)}; "
            f"trainer.max_steps={cap}{ends_sooner}"
            + (
                " (one more for StochasticWeightAveraging's BatchNorm-update epoch)"
                if batch_norm_step
                else ""
            )
            + remade
        )
        if note := nothing_to_choose_note(plan, batches.batch_size, fraction, len(sampler)):
            rank_zero_warn(f"HardSampleReplay: {note}")
        return plan

    def follow_world_size(self, trainer: pl.Trainer) -> int | None:
        """Note the processes this fit plans for (saved with the stream's state). A restored state of another
        number of processes counts rank 0's share of the data then, which this fit's shares split otherwise:
        at an epoch's start it is dropped and the rest of the run is planned as a plan joining the run there
        (:meth:`_join_run_under_way`); returns the saved number then, else ``None``. A state saved before the
        number was recorded is taken as this fit's.

        Raises:
            PulseRefusal: for a fit that goes on inside an epoch on another number of processes.
        """
        self.stream.world_size = now = trainer.world_size
        saved = self.stream.saved_world_size
        if saved is None or saved == now:
            return None
        if trainer.global_step > 0 and not compat.restored_at_epoch_start(trainer):
            raise PulseRefusal(
                STEPS_MODE_WORLD_SIZE_REFUSAL.format(
                    saved=saved, now=now, step=trainer.global_step, epoch=trainer.current_epoch
                )
            )
        self.stream.forget_restored()
        return saved

    def _join_run_under_way(self, trainer: pl.Trainer, plain_batches: int) -> None:
        """A fit that goes on at ``global_step`` > 0 with no stream state restored (a HardSampleReplay added
        on a resume, or to a second fit of the Trainer): plan from the next epoch Lightning trains, as a fresh
        run would plan those epochs, not the whole run from epoch 0 (capped at that plan, the resumed fit
        stopped after a few steps).

        Raises:
            PulseRefusal: for a fit that goes on mid-epoch, whose trained samples are not known.
        """
        if self.stream.has_restored_state or trainer.global_step <= 0:
            return
        epoch, batches = compat.restored_position(trainer, plain_batches)
        if batches:
            raise PulseRefusal(
                STEPS_MODE_JOINED_MID_EPOCH_REFUSAL.format(
                    step=trainer.global_step, batches=batches, epoch=epoch, next_epoch=epoch + 1
                )
            )
        self.stream.join_at(epoch, trainer.global_step)

    def __getstate__(self) -> dict[str, Any]:  # pickled (``ddp_spawn``, a sweep's copy) without the Trainer
        unpicklable = dict(_trainer=None, _deferred=None, _capped=None, _remove_restart_hook=None)
        return {**self.__dict__, **unpicklable}

    def uncap(self, trainer: pl.Trainer) -> None:
        """Set ``trainer.max_steps`` back as the user set it before a new fit of ``trainer``, unless changed
        since this fit capped it. The cap stays after the fit (it is the run's length), but read as the user's
        at a second fit from a checkpoint it made the plain run shorter, and the run was replanned shorter."""
        if self._capped is not None and self._capped[0]() is trainer and trainer.max_steps == self._capped[2]:
            compat.set_max_steps(trainer, self._capped[1])
        self._capped = None

    def release(self, fit_ended: bool = False) -> None:
        """Give :attr:`loader` back as the user built it (at the fit's end, when it stopped early, at a reload):
        its own batch sampler and index sampler, so it iterates as before outside this fit (predict, a plain
        Trainer). With ``fit_ended``, let go of the fit's Trainer too (its model and data: a used callback
        keeps none of them alive, and pickles)."""
        if fit_ended:
            self._trainer = self._deferred = None
        remove, self._remove_restart_hook = self._remove_restart_hook, None
        if remove is not None:  # a fit that never reached its loops' reset (nothing left to train)
            remove()
        loader, self.loader = self.loader, None
        if loader is None:
            return
        if self._sampler is not None and loader.batch_sampler is self._sampler:
            compat.replace_batch_sampler(loader, self._sampler.original)
        SampleIndexTracker.uninstall(loader)

    def _sizes_for_pass(self) -> tuple[int, list[int]]:
        trainer = self._trainer
        assert trainer is not None and self._sampler is not None
        accumulate = trainer.accumulate_grad_batches
        # a loader with workers begins the fit's first pass inside Lightning's data set-up, before
        # on_train_start and before Lightning sets the sampler's epoch: what both do first happens here, else
        # a resume into a later epoch drew its pass in epoch 0's order, and one from a pass's end chose it
        # before the finished pass's scores were applied
        early = not self._training_started
        if early and self.stream.resumed_after_pass and self._selector is not None:
            self._selector.apply()
        skip, sizes, self.epoch_batches = self.stream.sizes_for_pass(
            trainer.current_epoch,
            trainer.global_step,
            self._prior(),
            accumulate,
        )
        if early and self.loader is not None:  # the pass's epoch, which Lightning sets only after the draw
            compat.set_sampler_epoch(self.loader, self.stream.epoch)
        self._sampler.start_pass_at(self.stream.batches)
        if self._repeats and self._selector is not None:  # before the pass chooses, and trains, any window
            self._selector.table.begin_pass(self.stream.pass_step, self.stream.given_pass_scores)
        elif self._selector is not None:  # a loader rebuilt with a sampler drawing each sample once
            self._selector.table.pass_start = None  # no earlier pass's kept scores read in this one
        given, of_ranks, note = read_ahead_of_rank(
            self.stream.given_cuts_of_ranks, self.stream.given_cuts, trainer.global_rank, trainer.world_size
        )
        if note is not None:
            rank_zero_warn(note)
        self._ranks_read_ahead.set(of_ranks, self._batches_drawn)
        self._sampler.given = deque(None if cut is None else Composition.from_state(cut) for cut in given)
        compat.set_epoch_batches(trainer, self.epoch_batches)
        return skip, sizes

    def _prior(self) -> float:
        return math.nan if self._selector is None else self._selector.table.prior

    def _cut(self, windows: list[list[int]], ordinals: list[int]) -> list[Any]:
        assert self._trainer is not None and self._choose is not None
        accumulate = self._trainer.accumulate_grad_batches
        steps = [self.stream.pass_step + ordinal // accumulate for ordinal in ordinals]
        return self._choose(windows, ordinals, steps, self.stream.pass_prior)

    def next_batch(self) -> tuple[int, Any]:
        """``(raw window size, cut or None)`` of the batch about to train, counted as drawn (a checkpoint
        counts it once its step ran through: :meth:`checkpoint`)."""
        assert self._sampler is not None and self._trainer is not None
        window, cut = self._sampler.take_window()
        self._latest_cut = cut
        self.stream.drawn(window)
        self._batches_drawn += 1
        self._drawn_at = compat.batches_fetched(self._trainer)
        compat.mark_last_batch_of(self._trainer, self.epoch_batches)  # this batch may end the pass
        return window, cut

    def checkpoint(self, global_step: int | None) -> dict[str, Any] | None:
        """What a checkpoint saves of the stream (see :meth:`StepSavingStream.checkpoint`), counting only the
        batches whose step ran through; with the cuts of the batches drawn ahead before a rollback (see
        :meth:`choose_again`), which the resume trains as they are. Normally there are none: a resume chooses
        the rest of the pass again, from the scores of the samples it has not drawn, which no step changed."""
        untrained = self._latest_batch_untrained()
        state = self.stream.checkpoint(global_step, untrained)
        if state is None or state is self.stream.held or self._sampler is None:
            return state
        fixed = self._sampler.fixed_cuts()
        if untrained and self._sampler.taken_fixed:  # the resume draws it again
            fixed.insert(0, self._latest_cut)
        # a few batches' indices (the DataLoader's read-ahead), never a list per sample
        own = [None if cut is None else cut.state_dict() for cut in fixed]
        rank = 0 if self._trainer is None else self._trainer.global_rank
        of_ranks = self._ranks_read_ahead.of_ranks(rank, own, self._batches_drawn, untrained)
        if of_ranks is not None and any(of_ranks):  # DDP: Lightning writes rank 0's checkpoint only
            state["fixed_cuts_of_ranks"] = of_ranks
        elif own and of_ranks is None:
            state["fixed_cuts"] = own
        # a sampler that may draw a sample twice in a pass: the pass-start scores of those trained in it so
        # far (the same on every rank), which the rest of the pass chooses from. Its trained samples only
        if self._repeats and self._selector is not None and state["batches"] < self.epoch_batches:
            if (kept := self._selector.table.pass_start_state()) is not None:
                state["pass_scores"] = kept
        return state

    def choose_again(self) -> None:
        """A :class:`~lightning_pulse.StabilityGuard` rollback restored older scores mid-pass: the windows the
        sampler has not yielded yet are cut again from them, as choosing each window just before it trains
        would, after the steps measured before the pass began are applied (the epoch end applied them before
        the pass chose). The batches drawn ahead keep their cuts, and a checkpoint carries them."""
        if self._sampler is None or self._selector is None:  # batch mode: nothing chosen ahead
            return
        self._selector.apply_measured_before(self.stream.pass_step)
        self._sampler.choose_again()
        trainer = self._trainer
        if trainer is not None and trainer.world_size > 1:  # every rank rolls back at this step
            mine = [None if cut is None else cut.state_dict() for cut in self._sampler.fixed_cuts()]
            self._ranks_read_ahead.set(compat.all_gather_objects(trainer, mine), self._batches_drawn)

    def _latest_batch_untrained(self) -> bool:
        """Whether the batch drawn last is still in flight, its step not run through: Lightning's batch
        progress counts it fetched (``ready``) but not ``processed``, as after an exception inside
        ``training_step`` saved by ``OnExceptionCheckpoint``, and its resume starts at the processed batches.
        Within ``on_train_batch_end`` (``ModelCheckpoint``) the batch is processed: it trained. One the
        module's ``on_train_batch_start`` returned -1 for ended the epoch untrained (its rest is dropped: see
        :meth:`follow_cut_epoch`)."""
        if self._trainer is None or self._drawn_at is None:
            return False
        trainer, fetched = self._trainer, self._drawn_at
        return compat.batch_in_flight(trainer, fetched) or compat.batch_skipped(trainer, fetched)

    def refuse_schedules_cut_short(self, trainer: pl.Trainer) -> None:
        """Refuse, before the first step, a per-step LR scheduler built for the run's unplanned length (its
        ``max_steps``, or ``max_epochs`` of plain epochs, however rounded, divided by the scheduler's
        ``frequency``: see :class:`UnplannedLengths`) when the plan takes fewer steps.

        With ``max_epochs`` set, Lightning builds the schedulers before the data unless ``configure_optimizers``
        reads ``estimated_stepping_batches``, so a literal length (or one from a config) was never checked at
        :meth:`install`. On a resume the schedulers' lengths come from the checkpoint, whose plan may differ
        from this run's: :meth:`check_resumed_plan`.

        Raises:
            PulseRefusal: naming the scheduler, its length and the planned steps.
        """
        plan, unplanned = self.plan, self._unplanned
        if plan is None or unplanned is None:
            return
        steps = self.planned_scheduler_steps(trainer, unplanned.max_epochs)
        # a fresh fit's (a restored scheduler's length is the checkpoint's: check_resumed_plan)
        over = scheduler_overrun(trainer.lr_scheduler_configs, steps) if trainer.global_step == 0 else None
        if over is not None:
            name, length, stepped, every = over
            raise PulseRefusal(
                STEPS_MODE_SCHEDULE_OUTRUN_REFUSAL.format(
                    scheduler=name,
                    length=length,
                    stepped=stepped,
                    planned=plan.total_steps,
                    how=SCHEDULE_FREQUENCY_COUNT.format(frequency=every) if every > 1 else "",
                )
            )
        for config in trainer.lr_scheduler_configs:
            cut = unplanned.cut_short(config, plan.total_steps, steps)
            if cut is None:
                continue
            every = max(1, int(config.frequency))
            if every > 1 and cut.stepped == 0:  # no length ends with the run (0 raises in OneCycleLR)
                raise PulseRefusal(
                    STEPS_MODE_SCHEDULE_NEVER_STEPPED_REFUSAL.format(
                        scheduler=type(config.scheduler).__name__,
                        frequency=every,
                        length=cut.length,
                        planned=plan.total_steps,
                    )
                )
            if cut.frequency > 1 and cut.length == plan.total_steps:  # estimated_stepping_batches, undivided?
                raise PulseRefusal(
                    STEPS_MODE_SCHEDULE_FREQUENCY_REFUSAL.format(
                        scheduler=type(config.scheduler).__name__,
                        frequency=cut.frequency,
                        length=cut.length,
                        planned=plan.total_steps,
                        source=cut.source,
                        stepped=cut.stepped,
                        share=cut.share,
                    )
                )
            part = sequential_part(config.scheduler, cut.length)  # the scheduler whose course ends there
            if part is not None and cut.frequency == 1 and part[1] and part[2] == plan.total_steps:
                raise PulseRefusal(  # the decay built for the planned steps, from its milestone on
                    STEPS_MODE_SEQUENTIAL_MILESTONE_REFUSAL.format(
                        scheduler=part[0],
                        start=part[1],
                        planned=plan.total_steps,
                        length=cut.length,
                        source=cut.source,
                        share=cut.share,
                    )
                )
            # stepped fewer times than the optimizer: its count is the one length (replacing, not added to,
            # the planned steps' way out)
            way_out = (
                SCHEDULE_FREQUENCY_WAY_OUT.format(
                    frequency=every, stepped=cut.stepped, planned=plan.total_steps
                )
                if every > 1 and cut.stepped != plan.total_steps
                else SCHEDULE_LENGTH_WAY_OUT.format(planned=plan.total_steps)
            )
            refusal = STEPS_MODE_SCHEDULE_LENGTH_REFUSAL.format(
                scheduler=type(config.scheduler).__name__,
                length=cut.length,
                source=cut.source,
                planned=plan.total_steps,
                share=cut.share,
                way_out=way_out,
            )
            if part is not None:
                refusal += SEQUENTIAL_SCHEDULE_WAY_OUT.format(
                    scheduler=part[0], start=part[1], length=sum(part[1:])
                )
            raise PulseRefusal(refusal)

    def planned_scheduler_steps(self, trainer: pl.Trainer, max_epochs: int | None) -> Callable[[int], int]:
        """The steps Lightning gives a per-step scheduler of a ``frequency`` over the plan's steps from the
        fit's on (:meth:`StepSavingStream.scheduler_steps`), where ``max_epochs`` (``None``: unbounded) ends
        the run when its planned data does."""
        plan, step = self.plan, trainer.global_step
        assert plan is not None
        left, accumulate = (
            plan.run_steps(max_epochs is not None) - step,
            max(1, trainer.accumulate_grad_batches),
        )
        return lambda frequency: self.stream.scheduler_steps(frequency, accumulate, left)

    def check_resumed_plan(self, trainer: pl.Trainer) -> None:
        """On a resume whose plan differs in length from the checkpoint's (a PulseCycle added or removed, or
        another run length): refuse where a restored per-step scheduler would be stepped past its end, else
        warn once naming both lengths and the cause (a run length changed by the user is announced already).

        Raises:
            PulseRefusal: naming the scheduler, its length, both plans and the way out.
        """
        plan, stream, unplanned = self.plan, self.stream, self._unplanned
        if plan is None or stream.saved_total_steps is None:
            return
        # past a plan's data the run trains plain batches while its epochs allow: max_epochs ends it there
        bounded = unplanned is not None and unplanned.max_epochs is not None
        run_steps = plan.run_steps(bounded)
        change = resumed_plan_change(stream, run_steps)
        if change is None:
            return
        saved, step = stream.saved_total_steps, trainer.global_step
        accumulate = max(1, int(trainer.accumulate_grad_batches))

        def scheduler_steps(frequency: int, steps: int) -> int:  # as Lightning counts them, per epoch
            return stream.scheduler_steps(frequency, accumulate, steps)

        configs = trainer.lr_scheduler_configs
        if past := scheduler_past_end(configs, step, saved, run_steps, scheduler_steps):
            raise PulseRefusal(
                STEPS_MODE_RESUMED_SCHEDULE_REFUSAL.format(scheduler=past[0], length=past[1], change=change)
            )
        cycle_changed = stream.saved_with_cycle not in (None, stream.with_cycle)
        if cycle_changed or stream.changed_settings or not stream.replanned_for_another_length:
            rank_zero_warn(
                f"HardSampleReplay: {change}; the resumed run is not the one the checkpoint saved."
            )

    def on_train_start(self, trainer: pl.Trainer) -> None:
        if self._sampler is None:  # not installed: batch mode
            return
        self._training_started = True
        self.refuse_schedules_cut_short(trainer)
        self.check_resumed_plan(trainer)
        # a second fit of this Trainer from a checkpoint saved at a pass's end (each planned run ends on one)
        # otherwise trained no batch in any epoch, forever: see forget_earlier_fit_validation
        compat.forget_earlier_fit_validation(trainer)
        self._drawn_before_epoch = self._batches_drawn
        self._restored_epoch_open = compat.epoch_restarting(trainer)
        # Lightning set the first epoch's validation batch from the plain length after the first pass began
        compat.set_epoch_batches(trainer, self.epoch_batches)
        if self.stream.resumed_after_pass:  # what the finished epoch's end did in the run that saved it
            compat.close_restored_epoch(trainer, self.stream.resumed_after_cut)
            if self._selector is not None:
                self._selector.apply()  # the next pass selects from every score of the finished one

    def on_train_epoch_end(self, trainer: pl.Trainer) -> None:
        """Refuse to go on after an epoch that drew no batch while planned steps remain: Lightning would start
        the next epoch the same way, without end (the first epoch of a resumed fit may end with none, its last
        batch trained before the checkpoint).

        Raises:
            PulseRefusal: naming the epoch, the steps left and the way out.
        """
        if self._sampler is None:  # not installed: batch mode
            return
        drew_none, restored = self._batches_drawn == self._drawn_before_epoch, self._restored_epoch_open
        self._drawn_before_epoch, self._restored_epoch_open = self._batches_drawn, False
        # a stop Lightning honours (Trainer min_epochs/min_steps met) ends the fit here anyway
        stopping = compat.stop_takes_effect(trainer)
        if drew_none and not restored and not stopping and 0 <= trainer.global_step < trainer.max_steps:
            raise PulseRefusal(
                STEPS_MODE_EMPTY_EPOCH_REFUSAL.format(
                    epoch=trainer.current_epoch, step=trainer.global_step, max_steps=trainer.max_steps
                )
            )
        # an epoch of a resumed fit that drew none ended in the fit that saved it, which followed any cut
        if not drew_none and not stopping and 0 <= trainer.global_step < trainer.max_steps:
            self.follow_cut_epoch(trainer)

    def follow_cut_epoch(self, trainer: pl.Trainer) -> None:
        """At the end of an epoch that trained fewer batches than its planned pass holds (the module's
        ``on_train_batch_start`` returned -1) while the fit goes on: the next pass was planned to start at
        another step, so its replay windows would train in bursts and its plain batches in the replay phase.
        Plan the rest of the run again from the step it starts at (:meth:`StepSavingStream.cut_pass`, as a
        resume from a stop inside an epoch plans it), cap ``max_steps`` there and hand the plan to the
        PulseCycle, whose clock it was played on. Where the plan solved again would outrun a per-step LR
        scheduler, as Lightning counts its steps (see :func:`~lightning_pulse.core.step_plan.scheduler_end`),
        it keeps the old total, and warm-up and anneal where they were placed.

        Raises:
            PulseRefusal: where even that plan would step a per-step LR scheduler past its end.
        """
        skipped = self._drawn_at is not None and compat.batch_skipped(trainer, self._drawn_at)
        trained, planned, old = self.stream.batches - int(skipped), self.epoch_batches, self.plan
        if self._planned_with is None or old is None or trained >= planned:
            return
        if compat.in_batch_norm_update_epoch(trainer):  # SWA's last epoch: nothing planned follows
            return
        # where no batch was skipped, the sampler ran out short of the samples its length promised
        ran_out = f"its sampler ran out after {self.stream.samples} of the {self.stream.pass_samples} samples"
        light_phases, run, batch_norm_step = self._planned_with
        cycle, epoch, step = pulse_cycle_of(trainer), self.stream.epoch, trainer.global_step
        bounded, stream, drawn = run["max_epochs"] is not None, self.stream, self.stream.batches
        accumulate = max(1, int(trainer.accumulate_grad_batches))

        def kept(every: int) -> int:  # the old plan's scheduler steps from here (the skipped batch's given)
            rest = stream.pass_scheduler_steps(
                old, trained, planned, every, accumulate, old.run_steps(bounded) - step
            )
            return rest - int(skipped and drawn % every == 0)

        ends = scheduler_end(trainer.lr_scheduler_configs, kept)

        def outrun(plan: StepPlan) -> tuple[str, int, int, int, int] | None:  # as Lightning counts, per epoch
            return scheduler_outrun(
                ends, lambda every: stream.scheduler_steps(every, accumulate, plan.run_steps(bounded) - step)
            )

        outran: list[tuple[str, int, int, int, int]] = []  # by the plan solved again (see cut_pass)

        def too_long(plan: StepPlan) -> bool:
            outran[:] = [past] if (past := outrun(plan)) is not None else []
            return bool(outran)

        clock = None if cycle is None else cycle.clock
        plan, kept_total = stream.cut_pass(
            clock, light_phases, step, skipped, too_long if ends else None, **run
        )
        run_steps = plan.run_steps(bounded)
        why = (
            " (the module's `on_train_batch_start` returned -1)"
            if skipped
            else f" ({ran_out} planned from its length)"
        )
        cut = f"epoch {epoch} ended after {trained} of its {planned} planned batches{why}"
        if ends and (past := outrun(plan)) is not None:
            name, length, left, every, given = past
            given_text = (
                f" (Lightning steps it {given} times over them at `frequency`={every})" if every > 1 else ""
            )
            refusal = STEPS_MODE_CUT_EPOCH_SCHEDULE_REFUSAL.format(
                cut=cut,
                step=step,
                more=run_steps - step,
                given=given_text,
                scheduler=name,
                length=length,
                left=left,
            )
            raise PulseRefusal(
                refusal + (CUT_EPOCH_WAY_OUT_BY_EPOCHS if bounded else CUT_EPOCH_WAY_OUT_BY_STEPS)
            )
        cap = compat.cap_training_steps(trainer, plan.total_steps, batch_norm_step)
        if self._capped is not None:
            self._capped = (self._capped[0], self._capped[1], cap)
        if cycle is not None:
            cycle.adopt_plan(plan)
        if run_steps <= step:  # the run ends here anyway (its last epoch): nothing to say
            return
        kept = (
            f" (warm-up and anneal kept where they were placed: solved again, the plan would outrun the "
            f"per-step {outran[0][0]}, which has {outran[0][2]} steps left)"
            if kept_total and outran
            else ""
        )
        budget = None if cycle is None else cycle.budget
        rank_zero_info(
            f"HardSampleReplay: {cut}, so the next epoch starts at step {step}, not where the plan placed "
            f"it; the rest of the run is planned again from there{kept}: "
            f"{plan_summary(plan, budget, run_steps, scores_kept=self._scores_kept)}; "
            f"trainer.max_steps={cap}."
        )
