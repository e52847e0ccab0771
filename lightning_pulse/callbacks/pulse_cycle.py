"""PulseCycle: the conductor of pulse training.

It owns the one :class:`~lightning_pulse.phase.PhaseClock` of a run. Other callbacks never keep their own
notion of time: they call :func:`phase_of` and may implement ``on_pulse_phase_change``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_pulse import _lightning_compat as compat
from lightning_pulse.core.cycle_budget import fit_replay_to_budget, spent_report, start_without_plan
from lightning_pulse.core.step_plan import StepPlan
from lightning_pulse.core.step_plan import resumed_without_plan as plan_lost_warning
from lightning_pulse.core.uncounted_step import UncountedStep
from lightning_pulse.errors import OneRunPerInstance, PulseRefusal, names_itself, refusing
from lightning_pulse.loggers import log_to_loggers, refuse_logger_only_monitors
from lightning_pulse.phase import PHASE_NAMES, Phase, PhaseChange, StepTimer, cycle_clock, unreachable_phases
from lightning_pulse.probe import PROBE_COLLECTIVES, HeldOutProbe
from lightning_pulse.protocols import PhaseListener, PhaseStartListener, listeners


def pulse_cycle_of(trainer: pl.Trainer | None) -> PulseCycle | None:
    """The :class:`PulseCycle` attached to ``trainer``, or ``None``."""
    return next((c for c in getattr(trainer, "callbacks", ()) if isinstance(c, PulseCycle)), None)


def refuse_unreachable_phases(owner: str, phases: Sequence[Any], trainer: pl.Trainer) -> None:
    """Raise :class:`~lightning_pulse.errors.PulseRefusal` when ``owner`` acts only in ``phases`` and none of
    them ever comes: the attached :class:`PulseCycle` has none (left out of its ``order``, or of length zero), or
    none is attached and they leave out ``replay`` (every step counts as it): it would do nothing, silently."""
    if why := unreachable_phases(owner, phases, getattr(pulse_cycle_of(trainer), "clock", None)):
        raise PulseRefusal(why)


def phase_of(trainer: pl.Trainer | None, default: Phase = Phase.BURST) -> Phase:
    """The current pulse phase of ``trainer``.

    Args:
        trainer: the running Trainer (``None`` is allowed and gives ``default``).
        default: what to answer when no :class:`PulseCycle` is attached. ``Phase.BURST``, i.e. ordinary
            training, unless the caller has a better standalone behaviour (``HardSampleReplay`` passes
            ``Phase.REPLAY`` to select continuously when it runs alone).

    Example::

        from lightning_pulse import Phase, phase_of

        class SkipEvalInBurst(Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if phase_of(trainer) is Phase.BURST:
                    ...
    """
    cycle = pulse_cycle_of(trainer)
    return default if cycle is None else cycle.phase


class PulseCycle(compat.PulseStateKey, Callback):
    r"""Gives training a rhythm: bursts of ordinary training, then light replay and maintain phases.

    The cycle ``order`` (default burst -> replay -> maintain) repeats for the whole run, after a pure-burst
    warm-up and before a pure-burst anneal. PulseCycle alone changes no batch and no gradient: it decides
    the phase, logs it, runs the maintain-phase evaluation probe, and tells listeners. The light-phase work
    is done by the callbacks listening to it (``HardSampleReplay``, ``GradientCache``, ``ScheduledPrune``).

    Phases advance on optimizer steps, so an accumulation window is never split between two phases.
    Listeners are every callback in ``trainer.callbacks`` with a method
    ``on_pulse_phase_change(trainer, pl_module, change)``, plus functions given to :meth:`add_listener`.

    A :class:`~lightning_pulse.StabilityGuard` rollback does not rewind the clock: phase budgets measure
    the run's real progress (``trainer.global_step``, which never goes back, and seconds really spent),
    warm-up and anneal are shares of that step count, and the per-phase step and time totals account for
    work that was done (and paid for) even if its result was thrown away. Only the maintain probe's metrics,
    which describe the model, go back to the snapshot (:meth:`rollback_state_dict`). Every listener but the
    guard is told the current phase again with reason ``"resume"``.

    Args:
        burst: length of the burst phase. An ``int`` counts optimizer steps; a ``float`` counts epochs (so
            ``0.25`` is a quarter of an epoch); a string carries its unit: ``"200steps"``, ``"0.5epoch"``,
            ``"90s"``, ``"15min"``, ``"1h"``. Zero skips the phase.
        replay: length of the replay phase, same forms.
        maintain: length of the maintain phase, same forms.
        order: the phases of one cycle, each at most once. An option of a phase left out, set away from its
            default, is refused (it would do nothing).
        warmup: share of the run's optimizer steps, at the start, that is pure burst (InfoBatch-style), in
            ``[0, 1)``. Both it and ``anneal``: of the steps left, in a resume of a checkpoint without it.
        anneal: share of the run's optimizer steps, at the end, that is pure burst, in ``[0, 1)``.
        maintain_eval: ``"probe"`` evaluates the module's own ``validation_step`` on ``probe_batches`` held-out
            batches when a maintain phase starts and logs the means under ``pulse/probe/``; ``"none"``
            does not.
        probe_batches: how many validation batches the probe uses (taken once, from the start of the
            validation dataloader, so every probe sees the same data).
        budget: the share of the plain run's optimizer steps to spend, in ``(0, 1)``; ``None`` keeps the
            durations as given. With a :class:`~lightning_pulse.HardSampleReplay` in ``mode="steps"``, whose
            light-phase steps each stand for ``1 / replay_fraction`` batches of data, the replay phase's length
            is set at fit start so that the run's data takes that share of the plain run's steps; the log says
            the plan at fit start and what was spent at the end (``pulse/budget_spent``).
        time_source: seconds counter for wall-clock phases; ``time.monotonic`` by default (tests inject one).

    Raises:
        ValueError: at construction, naming the field, for an unparsable or negative duration, an unknown
            phase, all-zero durations, ``warmup + anneal >= 1``, an unknown ``maintain_eval`` or a
            non-positive ``probe_batches``, a ``budget`` outside ``(0, 1)``, an option of a phase ``order``
            leaves out, or a ``time_source`` that is not callable.
        PulseRefusal: at fit start (a ``MisconfigurationException``, not a ``ValueError``), for epoch-based
            durations on an infinite dataloader or, under DDP, on ranks whose epochs hold different numbers of
            batches, or warm-up/anneal on a run without a finite length; under
            manual optimization with several optimizers (``global_step`` counts each one's step), for
            epoch-based durations, and for warm-up/anneal unless ``max_steps`` alone bounds the run; for a
            ``budget`` with no step-saving HardSampleReplay attached, with wall-clock durations, or out of
            what the replay fraction can reach; for a ``time_source`` that returns no number; for a second run
            of this instance (another ``trainer.fit``) unless a checkpoint was restored into it; and for a
            checkpoint of a clock that ran another ``order``.

    Example::

        from lightning import Trainer
        from lightning_pulse import PulseCycle

        trainer = Trainer(max_epochs=20, callbacks=[PulseCycle(burst="15min", replay="10min", maintain="5min")])

    The same in LightningCLI YAML: ``{class_path: lightning_pulse.PulseCycle, init_args: {burst: 15min,
    replay: 10min, maintain: 5min}}`` under ``trainer.callbacks``.
    """

    # a StabilityGuard rollback restores `rollback_state_dict` (the probe), never the clock
    restore_on_rollback = True

    @names_itself
    def __init__(
        self,
        burst: int | float | str = 60,
        replay: int | float | str = 30,
        maintain: int | float | str = 10,
        order: Sequence[str] = PHASE_NAMES,
        warmup: float = 0.1,
        anneal: float = 0.1,
        maintain_eval: str = "probe",
        probe_batches: int = 4,
        budget: float | None = None,
        time_source: Callable[[], float] | None = None,
    ) -> None:
        super().__init__()
        self._one_run = OneRunPerInstance("PulseCycle")
        self.clock, self.budget = cycle_clock(
            burst, replay, maintain, order, warmup, anneal, maintain_eval, probe_batches, budget
        )
        self.plan: StepPlan | None = None  # set by a step-saving HardSampleReplay at fit start
        self._saved_plan_steps: int | None = None  # the checkpoint's plan's (see plan_lost_warning)
        self.maintain_eval, self.probe_batches = maintain_eval, probe_batches
        self._held = compat.CollectiveHold()
        self.timer = StepTimer(time_source)  # the optimizer steps and seconds the clock advances by
        self._uncounted = UncountedStep(self.timer)  # a checkpoint saved before our batch end: see state_dict
        self.added_listeners: list[Callable[[pl.Trainer, pl.LightningModule, PhaseChange], None]] = []
        self._total_steps = math.inf  # both refreshed every epoch: a callback can change the epoch's length
        self._epoch_steps: float | None = None  # read at the epoch's first batch (_epoch_steps_due)
        self._epoch_steps_due = False
        off = 'maintain_eval="none"'  # the probe's off switch, named in its warnings
        self.probe = HeldOutProbe("PulseCycle", probe_batches, "the maintain probe is off", off)
        self.last_probe: dict[str, float] = {}

    # ------------------------------------------------------------------ public API
    @property
    def phase(self) -> Phase:
        """The current phase (``Phase.BURST`` before training starts)."""
        return self.clock.phase

    @property
    def cycle(self) -> int:
        return self.clock.cycle

    @property
    def history(self) -> list[PhaseChange]:
        """The latest 1,000 phase changes (``records.RECENT_RECORDS``), resumed runs included."""
        return list(self.clock.history)

    @property
    def time_source(self) -> Callable[[], float]:
        """The seconds counter of wall-clock phases."""
        return self.timer.time_source

    @property
    def held(self) -> bool:
        """Whether another callback holds the cycle in its light phases (:meth:`hold_light`)."""
        return self.clock.holding

    def hold_light(self, trainer: pl.Trainer, pl_module: pl.LightningModule, held: bool) -> None:
        """Keep the run in its light phases (replay, maintain) while ``held``; ``False`` lets it go.

        For schedulers such as :class:`~lightning_pulse.GreenWindow`: holding ends a burst now, and no burst
        starts until the hold is let go, which starts one now (:meth:`PhaseClock.hold`). Listeners are told
        of every change. Call it on every rank with the same value at the same step (the hold is saved).
        """
        for change in self.clock.hold(held, trainer.global_step):
            self._announce(trainer, pl_module, change)
        log_to_loggers(trainer, self.clock.rows.take_late_row())  # the ended phase's last step, if unwritten

    def on_pulse_pause(self, trainer: pl.Trainer, paused: bool) -> None:  # a PauseListener: GreenWindow's
        self.timer.pause(paused)  # no step trains in a pause: phases in seconds leave it out

    def fit_budget(
        self, fraction: float, light_phases: Sequence[str], plain_epoch_steps: float | None
    ) -> None:
        """Set the replay phase's length (steps) so that the run spends :attr:`budget` of the plain run's steps,
        given that light-phase steps stand for ``1 / fraction`` batches of data. Called by a step-saving
        :class:`~lightning_pulse.HardSampleReplay` at fit start, before it plans the run."""
        fit_replay_to_budget(self.clock, self.budget, fraction, light_phases, plain_epoch_steps)

    def check_run_length(self, total_steps: float) -> None:
        """Refuse a run whose length warm-up or anneal (shares of it) cannot be planned on."""
        with refusing("PulseCycle"):
            self.clock.check_run_length(total_steps)

    def adopt_plan(self, plan: StepPlan) -> None:
        """Take the run's step plan (from a step-saving HardSampleReplay): epoch-based durations count plain
        epochs, and warm-up and anneal are shares of the span the plan placed them on (its total, or a step or
        two from it where no exact fixed point exists): the clock is pinned there, so it follows the plan."""
        self.plan = plan
        self.clock.pin_span(plan.span)

    def add_listener(self, listener: Callable[[pl.Trainer, pl.LightningModule, PhaseChange], None]) -> None:
        """Call ``listener(trainer, pl_module, change)`` at every change, on every rank (a PhaseListener)."""
        self.added_listeners.append(listener)

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._one_run.setup(trainer, self)  # in every stage, before Lightning restores: see FitRestores

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._one_run.start(trainer)  # before anything is planned from a state of another run
        refuse_logger_only_monitors(trainer, "PulseCycle", "pulse/")  # a monitor on `pulse/probe/val_loss`
        self._refresh_run_length(trainer)
        if self.plan is None:  # no plan this fit (a steps-mode checkpoint resumed in batch mode)
            start_without_plan(self.clock, self.budget)  # unpins the clock; refuses a `budget`
            configs, saved = trainer.lr_scheduler_configs, self._saved_plan_steps
            if warning := plan_lost_warning(configs, trainer.global_step, saved, self._total_steps):
                rank_zero_warn(warning)
        shares = {"warmup": self.clock.warmup, "anneal": self.clock.anneal}
        compat.note_run_shares(trainer, "PulseCycle", {} if self.plan else shares)  # a plan places its own
        stepped_itself = len(trainer.optimizers) if compat.steps_per_batch_unknown(trainer) else 0
        with refusing("PulseCycle"):  # warm-up and anneal of a run of unknown length: named together
            self.clock.check_fit(trainer.num_training_batches, self._total_steps, stepped_itself)
        if self.clock.uses_epochs:  # an epoch is each rank's own pass: a duration in epochs needs one length
            why = "phases counted in epochs would switch at other steps on each rank"
            out = "give the durations in steps or seconds"
            compat.refuse_uneven_epochs(trainer, "PulseCycle", why, self._held, out)
        with refusing("PulseCycle"):  # a time source that returns no number
            self.timer.start(trainer.global_step)
            change = self.clock.start_or_resume(self._total_steps, trainer.global_step)  # see begin_at
        self.probe.reset()
        compat.add_progress_bar_item(trainer, "phase", lambda: self.clock.label)
        if note := self.clock.start_note(change, self._total_steps):  # resumed, or added to a resumed run
            rank_zero_info(f"PulseCycle: {note}")
        self._uncounted.start(trainer, change, lambda told: self._announce(trainer, pl_module, told))

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._refresh_run_length(trainer)
        compat.check_run_shares(trainer)  # a DataLoader rebuilt at another length moves warm-up and anneal

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._one_run.end()
        self._uncounted.detach()
        log_to_loggers(trainer, self.clock.end_rows())  # at the last step: the phase in progress so far
        if self.plan is not None and self.plan.plain_steps:
            spent, message = spent_report(self.plan, compat.training_steps_taken(trainer), self.budget)
            log_to_loggers(trainer, {"pulse/budget_spent": spent})
            rank_zero_info(f"PulseCycle: {message}")

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int
    ) -> None:
        if self._epoch_steps_due:  # the epoch's first batch: after every callback's on_train_epoch_start
            self._epoch_steps_due, self._epoch_steps = False, compat.epoch_optimizer_steps(trainer)
        self.clock.rows.step_starts(self.clock)  # what the step trains in, for its row

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if compat.in_batch_norm_update_epoch(trainer):  # StochasticWeightAveraging's: no training step
            return
        if (lap := self._uncounted.lap(trainer.global_step)) is None:  # mid window, or a skipped step
            return
        steps, seconds = lap
        if self.clock.uses_wall_clock and trainer.world_size > 1:  # rank 0's clock: all switch at one step
            seconds = compat.rank_zero_number(trainer, pl_module.device, seconds, self._held)
        changes = self.clock.advance(steps, seconds, self._epoch_steps, self._total_steps)
        row = self.clock.rows.after_step(trainer.global_step, trainer.log_every_n_steps, bool(changes))
        log_to_loggers(trainer, row)  # where due: the phase and cycle the step trained in, read at its start
        for change in changes:
            self._announce(trainer, pl_module, change)
        if (due := self.clock.take_due_hold()) is not None:  # asked before this batch end: after its step
            self.hold_light(trainer, pl_module, due)

    @override
    def state_dict(self) -> dict[str, Any]:
        # saved before our batch end (by a callback listed first): the clock as it will be, the step counted
        clock, untold = self._uncounted.saved_state(self.clock, self._epoch_steps, self._total_steps)
        state = {"clock": clock, "untold": untold, "last_probe": dict(self.last_probe)}
        return {**state, "planned_steps": getattr(self.plan, "total_steps", None)}  # see plan_lost_warning

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Any) -> None:
        if trainer.state.fn == "fit":  # a resume: placed before a step plan copies the clock
            self.clock.begin_at(int(checkpoint.get("global_step", 0)))  # load_state_dict replaces a saved one

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._one_run.restored():  # not when loaded by validate, test or predict: no resume
            with refusing("PulseCycle"):  # a clock saved with another `order`
                self.clock.load_state_dict(state_dict["clock"])
            self.last_probe = dict(state_dict.get("last_probe", {}))
            self._saved_plan_steps = state_dict.get("planned_steps")
            self._uncounted.load(state_dict.get("untold", []))

    def rollback_state_dict(self) -> dict[str, Any]:
        """What a :class:`~lightning_pulse.StabilityGuard` rollback returns to: the last probe's metrics
        (they describe the model, which goes back). The clock keeps running: see the class docstring."""
        return {"last_probe": dict(self.last_probe)}

    def load_rollback_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_probe = dict(state_dict["last_probe"])

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._held.wait()  # the rank may exit right after this: no collective's thread may keep our tensors
        PROBE_COLLECTIVES.wait()

    # ------------------------------------------------------------------ internals
    def _announce(self, trainer: pl.Trainer, pl_module: pl.LightningModule, change: PhaseChange) -> None:
        log_to_loggers(trainer, change.metrics())  # nothing at the start of training: no phase ended
        for callback in listeners(trainer, PhaseStartListener, exclude=self):  # before the probe: its time
            callback.on_pulse_phase_begin(trainer, pl_module, change)  # belongs to the phase it runs for
        if change.current is Phase.MAINTAIN and change.reason != "resume" and self.maintain_eval == "probe":
            if (probe := self.probe.logged_run(trainer, pl_module, "pulse/probe/")) is not None:
                self.last_probe = probe
        for callback in listeners(trainer, PhaseListener, exclude=self):
            callback.on_pulse_phase_change(trainer, pl_module, change)
        for listener in self.added_listeners:
            listener(trainer, pl_module, change)

    def _refresh_run_length(self, trainer: pl.Trainer) -> None:
        if compat.in_batch_norm_update_epoch(trainer):  # its batches and accumulation are not the training's
            return
        self._epoch_steps_due = True  # its accumulation may not be set yet: see compat.epoch_optimizer_steps
        self._total_steps = compat.total_steps(trainer)
