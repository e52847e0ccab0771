"""GreenWindow: run the bursts when the grid is clean (or power cheap); lighten, pause or suspend otherwise.

The policy, clocks, accounting and argument checks live in :mod:`lightning_pulse.core.green_window`, the
report in :mod:`lightning_pulse.core.green_report`, the forecasts in :mod:`lightning_pulse.energy.forecast`;
this file maps trainer hooks onto them, holds its state and logs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_pulse import _lightning_compat as compat
from lightning_pulse import errors
from lightning_pulse.callbacks._suspend_save import SUSPEND_CHECKPOINT as SUSPEND_CHECKPOINT  # re-exported
from lightning_pulse.callbacks._suspend_save import SuspendSave
from lightning_pulse.callbacks.pulse_cycle import pulse_cycle_of
from lightning_pulse.core.green_report import energy_source, report_record, saving_line, write_report_safely
from lightning_pulse.core.green_window import (
    FAST_DEV_RUN_LINE,
    NO_ENERGY_LINE,
    SMOKE_TEST,
    Decision,
    GreenWindowOptions,
    decision_line,
    end_run,
    fit_start_refusal,
    green_window_parts,
    pause_slot,
    restart_run,
    unknown_length_refusal,
)
from lightning_pulse.errors import OneRunPerInstance, PulseRefusal, refuse_unwritable_dir, refusing
from lightning_pulse.loggers import log_to_loggers, logger_run, refuse_logger_only_monitors, run_folder
from lightning_pulse.protocols import pausing

SYNC_EVERY_N_STEPS = 10  # under DDP, rank 0's clock is consulted (and its decision shared) this often


class GreenWindow(compat.PulseStateKey, Callback):
    r"""Runs training's bursts in the clean (or cheap) hours of a carbon-intensity or price signal.

    At every slot (default one hour of its clock) it compares the signal now with a forecast of the slots
    ahead and decides to run or to wait, within a delay budget and before an optional deadline. While
    waiting, ``when_dirty`` says what the run does:

    * ``"light"``: stays in PulseCycle's light phases (replay, maintain): lighter, never stopped;
    * ``"pause"``: sleeps in-process on its clock (machines you own whose idle power is low; SIGTERM ends it);
    * ``"suspend"``: saves ``last-green-window.ckpt`` in the ModelCheckpoint's folder, stops ``fit``, and
      writes when to come back to ``green_window.json`` next to it; ``lightning-pulse wait-for-window DIR``
      sleeps until then (or ``--print`` s it for cron or Slurm ``--begin``) and names the ``resume_command``
      (``--ckpt_path`` that checkpoint). A complete run marks the file finished: it then exits 3.

    Waiting never makes the run miss its deadline: it waits a slot only if the remaining work (with a 10%
    reserve) still fits before it. A deadline out of reach (or past) is warned, and the run trains without
    waiting (reason ``"deadline"``) until a later estimate fits again; the report records the outcome. Light
    mode holds light as without a deadline (holding light cannot move the run's end). Every decision is
    logged under ``green/`` (signal, forecast, level, run, seconds waited, budget left). At the end of fit,
    ``green_window_report.{json,md,png}`` compare the CO2 (or cost) with the same energy on a carbon-agnostic
    schedule started at the same moment. Energy comes from an attached :class:`~lightning_pulse.EnergyLogger`,
    else ``options.watts``. Under DDP, rank 0 decides and every rank follows; all of it is in the checkpoint.

    Args:
        signal: the series to follow: a CSV (``Time,Carbon Intensity`` or ``timestamp,value``) or JSON path,
            a list of ``(time, value)``, or a callable returning ``(unix_seconds, value)``. ``None``: the
            carbon-intensity series of the attached EnergyLogger.
        when_dirty: ``"light"``, ``"pause"`` or ``"suspend"``.
        threshold: what "clean" means. ``None`` (adaptive, the default): the slot now is among the cleanest
            slots the remaining work needs before the window closes; ``"30%"``: at or below the 30th
            percentile of the forecast over ``horizon``; a number: at or below that absolute level.
        horizon: how far a percentile ``threshold`` looks ("24h"; ``None``: the window); refused with another.
        max_delay: the delay budget: a float is a share of the run's expected compute time (``1.0``: as
            long again), a string a duration ("12h"). ``None``: ``1.0`` for pause and suspend; ``0.5`` for
            light, where it is the share of the run that may be held light (it takes as long either way).
        deadline: when the run must end by: a UTC time (``"2026-03-01 08:00:00"``), ``"+36h"`` after its
            start (quote ``"+3600"`` in YAML: unquoted it is a number).
        forecast: ``"seasonal"`` (the default, past data only), a forecast series path (.csv/.json), or an
            object with ``predict(series, now, starts, slot_s)``.
        expected_duration: the run's compute time ("20h", > 0) if known; else measured from its first steps.
        clock: an object with ``time()`` and ``sleep(seconds)``; the system clock by default, a
            :class:`~lightning_pulse.core.green_window.SimulatedClock` to replay days in seconds.
        options: :class:`GreenWindowOptions`.

    Raises:
        ValueError: at construction, naming the field, for a bad mode, threshold, duration, deadline, forecast
            (an oracle reads the future and is refused), signal file, or ``options.signal_start`` without a
            series ``signal``. At fit start (:class:`~lightning_pulse.PulseRefusal`): ``"light"`` without a
            PulseCycle with light phases or next to ``HardSampleReplay(mode="steps")`` (it plans its batches
            on the phase sequence), ``"suspend"`` without a ModelCheckpoint, no signal and no EnergyLogger
            series, a new run's ``deadline`` already past (a resumed run's warns and runs on), a second fit of
            this instance (one per fit; a checkpoint loaded into it resumes), a failed first live reading.

    Example::

        from lightning.pytorch import Trainer
        from lightning_pulse import GreenWindow, PulseCycle

        trainer = Trainer(max_steps=10_000, callbacks=[
            PulseCycle(burst="15min", replay="10min", maintain="5min"),
            # the dirtiest 30% held light; the series is one bundled in the repository (run from its root)
            GreenWindow(
                signal="examples/data/carbon/de_2020_june_excerpt.csv", when_dirty="light", max_delay=0.3
            ),
        ])

    The same in LightningCLI YAML: ``{class_path: lightning_pulse.GreenWindow, init_args: {signal: grid.csv,
    when_dirty: suspend, max_delay: 12h, deadline: "+36h"}}`` under ``trainer.callbacks``.
    """

    @errors.names_itself  # numpy numbers as Python's (the messages already name the callback)
    def __init__(
        self,
        signal: Any = None,
        when_dirty: str = "light",
        threshold: float | str | None = None,
        horizon: str | float | None = None,
        max_delay: float | str | None = None,
        deadline: str | None = None,  # a UTC time, or "+36h" after the run's start
        forecast: Any = "seasonal",
        expected_duration: str | float | None = None,
        clock: Any = None,
        options: GreenWindowOptions | None = None,
    ) -> None:
        super().__init__()
        self._one_run = OneRunPerInstance("GreenWindow")  # a second fit would spend the first's delay budget
        parts = green_window_parts(  # checked: a ValueError names the field
            signal=signal,
            when_dirty=when_dirty,
            threshold=threshold,
            horizon=horizon,
            max_delay=max_delay,
            deadline=deadline,
            forecast=forecast,
            expected_duration=expected_duration,
            clock=clock,
            options=options,
        )
        self.options, self.when_dirty, self.forecast = parts.options, parts.when_dirty, parts.forecast
        self.policy, self.signal, self.clock = parts.policy, parts.signal, parts.clock
        # run_clock: the clock, never earlier than a resumed checkpoint's save (see GreenWindowParts)
        self.run_clock, self.schedule, self.segment = parts.run_clock, parts.schedule, parts.segment
        self.suspended: dict[str, Any] | None = None
        self.resume_files: list[str] = []  # the run's green_window.json, one per folder it suspended into
        self.report: dict[str, Any] | None = None
        self.report_paths: list[Path] = []
        self._held, self._energy = compat.CollectiveHold(), None  # _energy: an EnergyLogger, at fit start
        self._suspend_save = SuspendSave()  # last in trainer.callbacks (see callbacks._suspend_save)
        self._open: dict[str, Any] | None = None  # the segment a checkpoint held, until training resumes
        self._carried_s = 0.0  # the run-time shift a checkpoint held (RunClock.restart)
        self._last_step, self._next_check, self._waiting = 0, -math.inf, False

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._one_run.setup(trainer, self)  # in every stage, before Lightning restores: see FitRestores
        if stage == "fit" and self.when_dirty == "suspend":
            self._suspend_save.attach(trainer)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_pulse.callbacks.energy_logger import EnergyLogger
        from lightning_pulse.callbacks.hard_sample_replay import HardSampleReplay

        self._energy = next((c for c in trainer.callbacks if isinstance(c, EnergyLogger)), None)
        cycle = pulse_cycle_of(trainer)
        planned = any(isinstance(c, HardSampleReplay) and c.mode == "steps" for c in trainer.callbacks)
        intensity = None if self._energy is None else self._energy.intensity
        refusal = fit_start_refusal(
            self.when_dirty,
            light_phases=None if cycle is None else bool(cycle.clock.light_phases),
            steps_replay=planned,
            checkpointing=isinstance(trainer.checkpoint_callback, ModelCheckpoint),
            signal=self.signal.known or (intensity is not None and intensity.series is not None),
            barebones=trainer.barebones,
        ) or unknown_length_refusal(
            compat.total_steps(trainer),
            self.schedule.expected_work_s,
            len(trainer.optimizers) if compat.steps_per_batch_unknown(trainer) else 0,
        )
        if refusal is not None:
            raise PulseRefusal(refusal)
        refuse_unwritable_dir("GreenWindow", "options.report_dir", self.options.report_dir, trainer)
        refuse_logger_only_monitors(trainer, "GreenWindow", "green/")  # a monitor on `green/signal`
        self.signal.follow(intensity)  # without a signal of its own: the EnergyLogger's series, on this clock
        if self.options.watts is None and self._energy is None:
            rank_zero_info(NO_ENERGY_LINE)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._one_run.start(trainer)  # before anything is planned from a state of another run
        # refused: a clock without Unix seconds; a new run's deadline already past on rank 0's clock
        with refusing("GreenWindow"):
            now, behind = self.run_clock.restart(self._open, self.suspended, self._carried_s)
            at = now if trainer.world_size == 1 else compat.broadcast_held(trainer.strategy, now, self._held)
            late = self.schedule.deadline_at_start(at)
        account, steps = getattr(self._energy, "account", None), compat.steps_left_at_run_pace(trainer)
        self._next_check, warn, tell = restart_run(
            now, account, (trainer.global_step, steps), self.signal, self.segment, self._open, self.suspended
        )
        for line in filter(None, (behind, late, *warn)):
            rank_zero_warn(line)
        for line in tell:
            rank_zero_info(line)
        self._suspend_save.ask_stop_again(trainer, self.suspended)  # before a decision that may suspend again
        self._open, self.suspended, self._last_step = None, None, trainer.global_step
        if trainer.fast_dev_run:  # a smoke test: `_check` takes no decision, so its batches run
            rank_zero_info(FAST_DEV_RUN_LINE)
        if self.when_dirty == "light":
            self._waiting = pulse_cycle_of(trainer).held  # type: ignore[union-attr]
        self._check(trainer, pl_module)
        self._mark_kind(trainer)
        compat.note_run_shares(trainer, "GreenWindow", self.schedule.shares, in_duration=True)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        compat.check_run_shares(trainer)  # a DataLoader rebuilt at another length moves a share's budget

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if (steps := trainer.global_step - self._last_step) <= 0:
            return
        self._last_step = trainer.global_step
        self.segment.stepped(steps)
        if trainer.world_size == 1 or trainer.global_step % SYNC_EVERY_N_STEPS == 0:
            self._check(trainer, pl_module)
        self._mark_kind(trainer)

    def on_pulse_phase_change(self, trainer: pl.Trainer, pl_module: pl.LightningModule, change: Any) -> None:
        if trainer.global_step == self._last_step:  # else this step's batch end here, still to come, marks it
            self._mark_kind(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._one_run.end()  # a state loaded during this run is no resume of the next
        now, status = self.run_clock.time(), compat.run_end_status(trainer, bool(self.suspended))
        end_run(now, status == "complete", self.segment, self._kwh)
        # the run's folder is a collective (a broadcast): read on every rank, though rank 0 alone writes
        folder = Path(run_folder(trainer, self.options.report_dir))
        if trainer.is_global_zero:
            self._write_report(None if trainer.fast_dev_run else folder, status, logger_run(trainer))
        self._suspend_save.run_ended(trainer, status, self.resume_files, now - self.run_clock.behind_s)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._held.wait()  # the rank may exit right after this (see compat.CollectiveHold)
        self._suspend_save.detach(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, error: BaseException) -> None:
        self._suspend_save.detach(trainer)  # no teardown follows an exception

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule.state_dict(),
            "suspended": self.suspended,
            "waiting": self._waiting,
            "signal": self.signal.state_dict(),
            "open": self.segment.state_dict(self.run_clock.time(), self._next_check),
            "behind_s": self.run_clock.behind_s,
            "resume_files": list(self.resume_files),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._one_run.restored():  # loaded by validate, test or predict: no resume
            return
        self.schedule.load_state_dict(state_dict["schedule"])
        self.suspended, self._waiting = state_dict.get("suspended"), bool(state_dict.get("waiting", False))
        self._open, self._carried_s = state_dict.get("open"), float(state_dict.get("behind_s", 0.0))
        self.signal.load_state_dict(state_dict.get("signal", {}))  # kept for a series followed at fit start
        self.resume_files = list(state_dict.get("resume_files", []))

    # ------------------------------------------------------------------ decisions
    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Decide if a slot has passed (rank 0's clock and decision, shared), and act on it."""
        while not trainer.fast_dev_run:
            decision = None
            if trainer.is_global_zero:
                now = self.run_clock.time()
                if now >= self._next_check:
                    self.segment.close(now, self._kwh)  # the compute since the last mark: a segment
                    decision = errors.result_or_refusal(self._decide, trainer, now)
                while self.schedule.news:  # a deadline out of reach or in reach again, a clock step
                    rank_zero_warn(self.schedule.news.pop(0))
            if trainer.world_size > 1:
                decision = compat.broadcast_held(trainer.strategy, decision, self._held)
            if isinstance(decision, PulseRefusal):  # a failed first live reading: raised on every rank alike
                raise decision
            if decision is None or not self._act(trainer, pl_module, decision):
                return

    def _decide(self, trainer: pl.Trainer, now: float) -> Decision | None:
        left = compat.max_time_left_s(trainer) if self.when_dirty == "pause" else None  # see within_max_time
        decision = self.schedule.decide_from(self.signal, now, compat.steps_left_at_run_pace(trainer), left)
        if decision is not None:
            self._next_check = now + self.options.slot_s
            log_to_loggers(trainer, self.schedule.metrics(decision))
        return decision

    def _act(self, trainer: pl.Trainer, pl_module: pl.LightningModule, decision: Decision) -> bool:
        """Apply a decision; ``True`` when another decision must follow at once (a pause ended)."""
        cycle = pulse_cycle_of(trainer) if self.when_dirty == "light" else None
        told = decision.run != (not self._waiting)  # a switch; a suspend's is told at its save (SuspendSave)
        if told and (decision.run or self.when_dirty != "suspend"):
            stage = "cycle" if cycle is None else cycle.clock.stage
            rank_zero_info(decision_line(decision, self.when_dirty, self.run_clock.time(), stage))
        self._waiting = not decision.run
        if cycle is not None:
            cycle.hold_light(trainer, pl_module, not decision.run)
            return False
        if decision.run:
            return False
        if self.when_dirty == "pause":  # an EnergyLogger books the pause to no training stage
            sigterm, account = (lambda: trainer.received_sigterm), getattr(self._energy, "account", None)
            with pausing(trainer, exclude=self):  # nor PulseCycle to its phases in seconds (PauseListener)
                stopped = pause_slot(self.run_clock, self.segment, decision.wait_s, sigterm, account)
            if stopped is not None:  # Lightning stops the fit at this batch's end, as without GreenWindow
                rank_zero_info(stopped)
            self._next_check = -math.inf if stopped is None else self._next_check
            return stopped is None
        # the checkpoint keeps the run's times; the resume file, the clock's (see RunClock.suspension)
        suspension = self.run_clock.suspension(self.run_clock.time(), decision)  # (record, now, resume_at)
        self._suspend_save.due(trainer, self, decision, suspension, told, self._energy)
        return False

    # ------------------------------------------------------------------ energy
    def _mark_kind(self, trainer: pl.Trainer) -> None:
        """Between two steps: a change of the next steps' kind (hold, warm-up, anneal) closes the segment."""
        cycle = pulse_cycle_of(trainer) if self.when_dirty == "light" else None
        held = cycle is not None and cycle.held and cycle.clock.in_cycle  # warm-up, anneal: not held
        self.segment.next_kind("light" if held else "run", self.run_clock.time(), self._kwh)

    def _kwh(self) -> float | None:
        """A fresh reading of the EnergyLogger's meters (kWh so far), or ``None`` without one. At each
        segment's end, so its energy is what the meters counted in it, not an extrapolation."""
        return None if self._energy is None else self._energy.account.kwh_now()

    # ------------------------------------------------------------------ report
    def _write_report(self, folder: Path | None, status: str, run: str | None = None) -> None:
        source, signal = energy_source(self._energy is not None, self.options.watts), self.signal.describe()
        self.report = report_record(status, self.when_dirty, self.schedule, signal, source, self.suspended)
        self.report["run"] = run  # tells a later run's report that it replaces this one
        # kept before the files are written (an interrupt there leaves it); folder None: fast_dev_run
        written, lines = write_report_safely(self.report, folder, self.signal, self.schedule, self.options)
        self.report_paths = self.report_paths if written is None else written
        for line in lines:  # another run's report replaced; a failure must not fail a finished run
            rank_zero_warn(line)
        if status != SMOKE_TEST:  # a fast_dev_run's batches make no saving (FAST_DEV_RUN_LINE said so)
            rank_zero_info(f"GreenWindow: {saving_line(self.report['summary'], self.options.unit)}")
