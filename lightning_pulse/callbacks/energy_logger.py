"""EnergyLogger: measured and estimated energy, CO2 and cost, per phase, cycle and epoch.

The accounting lives in :class:`lightning_pulse.energy.account.EnergyAccount`; this file is the Lightning
glue: hooks onto the account, the report's location, and logging.
"""

from __future__ import annotations

import warnings
import weakref
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.rank_zero import rank_prefixed_message
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_pulse import _lightning_compat as compat
from lightning_pulse.callbacks._monitored_total import MonitoredTotal
from lightning_pulse.callbacks.pulse_cycle import phase_of, pulse_cycle_of
from lightning_pulse.energy.account import (
    EnergyAccount,
    TensorCollective,
    final_metrics,
    forecast_message,
    guarded_hook,
    no_forecast_line,
    refuse_uncounted_processes,
    report_folder,
    trainer_chains,
    write_fit_report,
)
from lightning_pulse.energy.carbon import carbon_intensity_from, price_from
from lightning_pulse.energy.compare import final_metric_fields, refuse_overwriting_baseline
from lightning_pulse.energy.config import (
    DEFAULT_CURRENCY,
    AccountingConfig,
    MeterConfig,
    checked_arguments,
    checked_configs,
    naming_energy_logger,
)
from lightning_pulse.errors import FitRestores, names_itself, refuse_unwritable_dir, tell_no_report
from lightning_pulse.loggers import log_closed_epoch, log_to_loggers, logger_run, run_folder


class EnergyLogger(compat.PulseStateKey, Callback):
    r"""Meters the energy of training and reports it per phase, cycle, epoch and in total.

    Every figure says how it was obtained: *measured* (NVML energy counter or power sensor for GPUs, RAPL
    for CPUs), *estimated* (codecarbon's offline model, a configured constant, a carbon intensity) or
    *none*. Meters fall back, with a one-line warning, when they fail: NVML counter -> NVML power sampling;
    RAPL -> codecarbon -> ``meters.cpu_watts``. Nothing here ever stops training.

    Figures go to every attached logger under ``energy/``: per epoch (``energy/epoch_kwh``,
    ``energy/total_kwh``, ``energy/<phase>_kwh``, CO2, cost, J per sample/token, data-loader stall share),
    per completed pulse cycle (``energy/cycle_kwh``) and every ``log_every_n_steps`` (``energy/power_w``,
    ``energy/kwh_so_far``). After the first epoch, a forecast of the whole run's energy, time and CO2 is
    logged and printed once. The progress bar shows ``kWh``. At the end of fit, ``energy_report.json`` and
    ``energy_report.md`` are written atomically to ``report_dir`` or the run's own folder (rank 0 only; not
    under ``fast_dev_run``, which suppresses logging); a figure no meter counted is null there and not logged;
    ``lightning-pulse report DIR`` draws ``energy_report.png`` from the JSON (not at fit end: it took longer
    than a short run's training).

    Under DDP, GPU energy is metered by each rank and summed; CPU and RAM energy are metered once per node
    by local rank 0. Checkpoints carry the whole run's totals, so a resumed run reports all of it (a
    checkpoint must be saved on every rank, as Lightning requires anyway).

    Args:
        country_iso_code: 3-letter ISO code (``"DEU"``, ``"BRA"``); gives the carbon intensity from
            codecarbon's offline data when ``carbon_intensity`` is not set, and the country of its tracker.
        carbon_intensity: gCO2eq/kWh as a number, or the path of a CSV series (``Time,Carbon Intensity`` or
            ``timestamp,value``, UTC). ``None`` and no country: CO2 is not reported.
        price_per_kwh: electricity price per kWh as a number or a CSV series path; ``None``: no cost.
        currency: the price's currency, for labels.
        gpu: ``"auto"`` (NVML on this rank's CUDA device, or the node's ``meters.gpu_devices``) or ``"none"``.
        cpu: ``"auto"`` (RAPL, then codecarbon, then ``meters.cpu_watts``, or without it codecarbon's power
            for a generic CPU, 42.5 W, estimated), ``"codecarbon"`` (then the same last fallback),
            ``"constant"`` (``meters.cpu_watts`` only) or ``"none"``.
        ram: ``"codecarbon"`` (codecarbon's estimate) or ``"none"``.
        report_dir: where to write the report; default the run's folder of the first logger (see docs).
        meters: how the meters are read (:class:`~lightning_pulse.energy.config.MeterConfig`: sampling
            period, GPU devices, constant CPU watts, RAPL root, codecarbon's tracking mode).
        accounting: how figures are dated, counted and shown
            (:class:`~lightning_pulse.energy.config.AccountingConfig`: series start times, sample and token
            counters, step-logging interval, progress bar, a baseline run to compare against).

    Raises:
        ValueError: on a bad argument, naming it, its value and what is allowed (including an unknown
            country or an unreadable or malformed CSV series).

    Example::

        from lightning.pytorch import Trainer
        from lightning_pulse import EnergyLogger, PulseCycle

        trainer = Trainer(max_epochs=10, callbacks=[PulseCycle(), EnergyLogger(country_iso_code="DEU")])

    The same in LightningCLI YAML: ``{class_path: lightning_pulse.EnergyLogger, init_args: {country_iso_code:
    DEU, price_per_kwh: 0.3, meters: {codecarbon_tracking_mode: process}}}`` under ``trainer.callbacks``.
    """

    @names_itself  # numpy numbers as Python's (the messages already name the callback)
    def __init__(
        self,
        country_iso_code: str | None = None,
        carbon_intensity: float | str | None = None,
        price_per_kwh: float | str | None = None,
        currency: str = DEFAULT_CURRENCY,
        gpu: str = "auto",
        cpu: str = "auto",
        ram: str = "codecarbon",
        report_dir: str | None = None,
        meters: MeterConfig | None = None,
        accounting: AccountingConfig | None = None,
    ) -> None:
        super().__init__()
        with naming_energy_logger():  # the first line a user reads names the callback (the CLI prints it)
            self.meters, self.accounting = checked_configs(meters, accounting)
            country_iso_code = checked_arguments(
                gpu, cpu, ram, currency, report_dir, country_iso_code, self.meters, price_per_kwh
            )
            self.country_iso_code = country_iso_code
            self.currency = currency.strip()
            self.gpu, self.cpu, self.ram = gpu, cpu, ram
            self.report_dir = None if report_dir is None else str(report_dir)
            self.intensity = carbon_intensity_from(
                carbon_intensity, country_iso_code, self.accounting.carbon_intensity_start, rank_zero_info
            )
            self.price = price_from(price_per_kwh, self.currency, self.accounting.price_start, rank_zero_info)
            self.account = EnergyAccount(
                self.intensity, self.price, self.meters.sampling_period, self.accounting, warn=self._warn_rank
            )
            self.report: dict[str, Any] | None = None
            self.report_paths: list[Path] = []
            self._trainer: weakref.ReferenceType[pl.Trainer] | None = None  # weak: not its model and data
            self._fit_restores = FitRestores()
            self._held = compat.CollectiveHold()  # gathered figures, until gloo's worker lets go of them
            self._in_train_loop = self._log_steps = False
            self._monitored = MonitoredTotal()  # `energy/total_kwh` where monitors read it between epoch ends

    # ------------------------------------------------------------------ public API
    def energy_so_far_kwh(self) -> float:
        """Energy metered by this process so far, all meters, in kWh (plus, on rank 0 of a resumed run, the
        whole run's energy before the resume). Smooth and never decreasing between readings; costs no meter
        reading while the sampling thread runs; never raises."""
        return self.account.energy_so_far_kwh()

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._fit_restores.setup(trainer, self)  # in every stage, before Lightning restores: see FitRestores

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        refuse_unwritable_dir("EnergyLogger", "report_dir", self.report_dir, trainer)
        refuse_overwriting_baseline(self.accounting.baseline, self.report_dir, lambda: run_folder(trainer))
        self._trainer, self._in_train_loop = weakref.ref(trainer), False
        self.report, self.report_paths = None, []
        # every rank, outside the meters' start (an error there disables one rank, which misses the gather)
        meters, rank = (self.meters, self.cpu, self.ram), (trainer.node_rank, trainer.local_rank)
        refuse_uncounted_processes(*meters, self._collective(trainer), *rank)
        self.account.refuse_changed_currency()  # a cost in EUR and one in USD do not add up
        self.account.extend_carried(trainer.ckpt_path, rank_zero_info)  # a suspended fit's end, next to it
        self.account.start(
            lambda: trainer_chains(trainer, self, self._warn_rank, rank_zero_info),
            global_zero=trainer.is_global_zero,
        )
        if self.accounting.progress_bar:
            compat.add_progress_bar_item(trainer, "kWh", self.account.progress_text)

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.account.mark(stage="validation")

    @override
    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.account.mark(stage="other")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        why = "it combines the ranks' figures at every epoch end, which the ranks would reach at other steps"
        compat.refuse_uneven_epochs(trainer, "EnergyLogger", why, self._held, only_if_an_epoch_ends=True)
        self._in_train_loop = True
        progress = compat.run_progress(trainer)  # the loader's batch size tells a time-major batch's samples
        # `global_step`, not holding the Trainer (the account outlives it); a fit loop of another shape: held
        steps = compat.optimizer_steps_counter(trainer) or (lambda: trainer.global_step)
        self.account.begin_training(steps, progress, trainer.train_dataloader)
        resumed = trainer.ckpt_path is not None  # added on a resume, or a later fit; rates changed
        self.account.join_run(trainer.global_step, resumed, rank_zero_info, rank_zero_warn)
        compat.note_run_shares(trainer, "EnergyLogger", "the forecast of the run's energy", rereads=True)
        if compat.steps_per_batch_unknown(trainer):  # manual optimization, several optimizers
            if (line := no_forecast_line(compat.total_steps(trainer), len(trainer.optimizers))) is not None:
                rank_zero_info(line)
        self.account.log_steps_every(self.accounting.log_every_n_steps, trainer.log_every_n_steps)
        self._monitored.fit_starts(trainer)  # the steps a ModelCheckpoint(every_n_train_steps) reads it at
        self._log_steps = trainer.is_global_zero and bool(trainer.loggers)
        cycle = getattr(pulse_cycle_of(trainer), "cycle", None)
        self.account.mark_training(phase_of(trainer).value, cycle, trainer.current_epoch)  # the epoch too

    def on_pulse_phase_begin(self, trainer: pl.Trainer, pl_module: pl.LightningModule, change: Any) -> None:
        """Listener of :class:`~lightning_pulse.PulseCycle`, called (once PulseCycle calls it) before the new
        phase's maintain probe: the probe's time and energy then belong to the phase it runs for."""
        self.account.mark(phase=change.current.value, cycle=change.cycle)

    def on_pulse_phase_change(self, trainer: pl.Trainer, pl_module: pl.LightningModule, change: Any) -> None:
        """Listener of :class:`~lightning_pulse.PulseCycle`: the energy from now on belongs to the new phase."""
        finished = self.account.change_phase(change.current.value, change.cycle, change.previous is not None)
        if finished is not None:  # the change entered a later cycle: the one it left is complete
            self._log_cycles(trainer, finished)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        log_closed_epoch(trainer, self.account.start_epoch(trainer.current_epoch, self._collective(trainer)))
        compat.check_run_shares(trainer)  # the forecast's run length moves with a reload of another length

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.account.batch_started(batch, batch_idx)

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        self.account.count_batch()  # after every callback's batch start: a batch cut in place counts as cut

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.account.batch_ended()
        if self._log_steps and (metrics := self.account.due_step_metrics(trainer.global_step)) is not None:
            log_to_loggers(trainer, metrics)
        if self._monitored.steps and self._monitored.due_at(trainer.global_step):  # ModelCheckpoint's after
            self._monitored.read_out(trainer, self.account, self._collective(trainer))

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.account.skip_gap()  # until its end: validation is no data-loader wait
        if not trainer.sanity_checking:
            self.account.mark(stage="validation")

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._in_train_loop:  # a fit's validation (not its sanity check), before any monitor's check
            self._monitored.read_out(trainer, self.account, self._collective(trainer))

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.account.end_validation(self._in_train_loop)  # the next batch's fetch is a data wait

    @override
    @guarded_hook
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        steps, batches = self.account.forecast_length(compat.run_length(trainer), trainer.world_size)
        metrics, forecast = self.account.epoch_metrics(
            trainer.current_epoch, steps, self._collective(trainer), total_batches=batches
        )
        if forecast is not None:
            rank_zero_info(forecast_message(forecast))
        self._monitored.publish(trainer, metrics.get("energy/total_kwh"))  # for monitors: combined over ranks
        log_to_loggers(trainer, metrics)
        self._log_cycles(trainer, None, settled=True)  # cycles that waited for a first reading: it is taken

    @override
    @guarded_hook
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._in_train_loop = False
        collective = self._collective(trainer)
        self.account.end_training(collective)
        # suspended (GreenWindow tells the account) or stopped with steps left: unfinished work, not a saving
        status = compat.run_end_status(trainer, self.account.suspended)
        report = self._finish(trainer, status=status)
        self.account.carry_past_checkpoint(collective, trainer.is_global_zero, rank_zero_warn)
        self._log_cycles(trainer, self.account.close_cycle(), settled=True)  # the cycle training ended in
        log_to_loggers(trainer, {**self.account.close_last_epoch(collective), **final_metrics(report)})

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.account.stop()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, error: BaseException) -> None:
        if trainer.state.fn != "fit":  # a failed validate, test or predict: EnergyLogger meters fits only
            return
        if (where := self.account.interrupted()) is not None:  # no run to report on (a refusal says why)
            return tell_no_report(error, where, self._in_train_loop)
        # collectives are not safe after an exception on one rank, so only a single process reports
        if self.account.ledger is not None and trainer.world_size == 1 and self.report is None:
            try:
                self._finish(trainer, status="interrupted")
            except Exception as error:
                rank_zero_warn(f"EnergyLogger: could not write the report of the interrupted run ({error}).")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.account.stop()
        self._held.wait()  # the rank may exit right after this (see compat.CollectiveHold)

    @override
    def state_dict(self) -> dict[str, Any]:  # saved inside a step its resume trains again: without its batch
        if (trainer := None if self._trainer is None else self._trainer()) is None:
            return self.account.state_dict()
        return self.account.state_dict(self._collective(trainer), compat.in_unfinished_step(trainer))

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._fit_restores.restored():  # not when loaded by validate, test or predict: no resume
            self.account.load_state_dict(state_dict)

    def __getstate__(self) -> dict[str, Any]:  # pickled by ``ddp_spawn`` after a fit too: no weak reference
        return {**self.__dict__, "_trainer": None}

    # ------------------------------------------------------------------ internals
    def _finish(self, trainer: pl.Trainer, status: str) -> dict[str, Any]:
        ended = status != "interrupted"  # every rank reaches a train end: collectives are safe
        directory = report_folder(self.report_dir, trainer, ended, lambda: run_folder(trainer))
        collective = self._collective(trainer) if ended else None
        self.report = self.account.report(status, self.currency, collective, num_nodes=trainer.num_nodes)
        self.report.update(final_metric_fields(trainer), run=logger_run(trainer))
        self.report_paths = write_fit_report(  # rank 0 only, and not under fast_dev_run (a smoke test)
            self.report,
            directory,
            self.accounting.baseline,
            smoke_test=bool(trainer.fast_dev_run),
            writes=trainer.is_global_zero,
            info=rank_zero_info,
            warn=rank_zero_warn,
        )
        return self.report

    def _collective(self, trainer: pl.Trainer) -> TensorCollective:
        """The account's collectives on the Trainer's strategy, its tensors held (compat.CollectiveHold)."""
        strategy, hold = trainer.strategy, self._held
        return TensorCollective(
            trainer.world_size,
            lambda value: compat.broadcast_held(strategy, value, hold),
            lambda tensor: compat.all_gather_held(strategy, tensor, hold),
        )

    @guarded_hook
    def _log_cycles(self, trainer: pl.Trainer, completed: int | None, settled: bool = False) -> None:
        collective, step = self._collective(trainer), compat.logging_step(trainer)  # the cycle's last step
        for metrics, at in self.account.due_cycle_rows(completed, step, collective, settled):
            log_to_loggers(trainer, metrics, at)

    def _warn_rank(self, message: str) -> None:
        # a meter can fail on one rank only (its own GPU), so under DDP every rank may warn, with its rank
        if (trainer := None if self._trainer is None else self._trainer()) is None or trainer.world_size <= 1:
            rank_zero_warn(message)
        else:
            warnings.warn(rank_prefixed_message(message, trainer.global_rank), UserWarning, stacklevel=2)
