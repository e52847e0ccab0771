"""EnergyLogger: measured and estimated energy, CO2 and cost, per phase, cycle and epoch.

The meters, the ledger and the report live in :mod:`lightning_pulse.energy`; this file is the Lightning glue.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.fabric.utilities.rank_zero import rank_prefixed_message
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_pulse import _lightning_compat as compat
from lightning_pulse.callbacks.pulse_cycle import phase_of, pulse_cycle_of
from lightning_pulse.energy.carbon import carbon_intensity_from, price_from
from lightning_pulse.energy.codecarbon_meter import TRACKING_MODES, CodecarbonMeter, CodecarbonSession
from lightning_pulse.energy.constant import ConstantPowerMeter
from lightning_pulse.energy.counting import count_batch
from lightning_pulse.energy.ledger import (
    BUCKET_FIELDS,
    J_PER_KWH,
    EnergyLedger,
    combine_ranks,
    flatten_buckets,
    grouped_figures,
    merge_snapshots,
    predict_run,
    timeline_edges,
)
from lightning_pulse.energy.meter import COMPONENTS, MeterChain, MeterFactory
from lightning_pulse.energy.nvml import NvmlCounterMeter, NvmlPowerMeter, nvml_devices_for_cuda
from lightning_pulse.energy.rapl import DEFAULT_POWERCAP_ROOT, RaplMeter
from lightning_pulse.energy.report import assemble_report, write_report
from lightning_pulse.energy.sampler import EnergySampler

GPU_MODES = ("auto", "none")
CPU_MODES = ("auto", "codecarbon", "constant", "none")
RAM_MODES = ("codecarbon", "none")
MONITORABLE = ("energy/total_kwh",)
COUNTING_NOTES = {
    "samples": "dimension 0 of the first tensor of each training batch (every micro-batch, so accumulation "
    "is counted in full), summed over ranks.",
    "tokens": "non-zero `attention_mask` entries, else `input_ids` elements, else B*T of an integer (B, T) "
    "first tensor; unknown otherwise. Summed over ranks.",
    "data-loader stall": "time from on_train_batch_end to the next on_train_batch_start (fetching the next "
    "batch, plus any hook work in between) over the time between consecutive batch starts; gaps that contain "
    "a validation run or a phase change are left out. Averaged over ranks.",
    "ddp": "GPU energy is metered on every rank and summed; CPU and RAM energy once per node (local rank 0).",
}


def _instrumentation(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Run a hook so that a bug in the metering warns once and never fails the training run."""

    def guarded(self: EnergyLogger, *args: Any, **kwargs: Any) -> Any:
        try:
            return hook(self, *args, **kwargs)
        except Exception as error:
            self._warn_once(
                hook.__name__, f"EnergyLogger: {hook.__name__} failed ({type(error).__name__}: {error})."
            )
            return None

    guarded.__name__ = hook.__name__
    guarded.__qualname__ = hook.__qualname__
    guarded.__doc__ = hook.__doc__
    return guarded


class EnergyLogger(Callback):
    r"""Meters the energy of training and reports it per phase, cycle, epoch and in total.

    Every figure says how it was obtained: *measured* (NVML energy counter or power sensor for GPUs, RAPL
    for CPUs), *estimated* (codecarbon's offline model, a configured constant, a carbon intensity) or
    *none*. Meters fall back, with a one-line warning, when they fail: NVML counter -> NVML power sampling;
    RAPL -> codecarbon -> ``cpu_watts``. Nothing here ever stops training.

    Figures go to every attached logger under ``energy/``: per epoch (``energy/epoch_kwh``,
    ``energy/total_kwh``, ``energy/<phase>_kwh``, CO2, cost, J per sample/token, data-loader stall share),
    per completed pulse cycle (``energy/cycle_kwh``) and every ``log_every_n_steps`` (``energy/power_w``,
    ``energy/kwh_so_far``). After the first epoch, a forecast of the whole run's energy, time and CO2 is
    logged and printed once. The progress bar shows ``kWh``. At the end of fit, ``energy_report.json``,
    ``energy_report.md`` and ``energy_report.png`` are written atomically to ``report_dir`` or the logger's
    log dir (rank 0 only); ``lightning-pulse report DIR`` re-renders the last two from the JSON.

    Under DDP, GPU energy is metered by each rank and summed; CPU and RAM energy are metered once per node
    by local rank 0. Checkpoints carry the whole run's totals, so a resumed run reports all of it (a
    checkpoint must be saved on every rank, as Lightning requires anyway).

    Args:
        sampling_period: seconds between meter readings on the background thread.
        country_iso_code: 3-letter ISO code (``"DEU"``, ``"BRA"``); gives the carbon intensity from
            codecarbon's offline data when ``carbon_intensity`` is not set, and the country of codecarbon's
            tracker.
        carbon_intensity: gCO2eq/kWh as a number, or the path of a CSV series (``Time,Carbon Intensity`` or
            ``timestamp,value``, UTC). ``None`` and no country: CO2 is not reported.
        carbon_intensity_start: read the series as if the run had started at this UTC time (e.g.
            ``"2020-06-01 12:00:00"``); by default the run's own dates are used, or the same time of year
            when they are outside the series.
        price_per_kwh: electricity price per kWh as a number or a CSV series path; ``None``: no cost.
        price_start: like ``carbon_intensity_start``, for the price series.
        currency: the price's currency, for labels.
        gpu: ``"auto"`` (NVML on this rank's CUDA devices, or on ``gpu_devices``) or ``"none"``.
        gpu_devices: NVML indices or UUIDs to meter instead of the rank's own device.
        cpu: ``"auto"`` (RAPL, then codecarbon, then ``cpu_watts``), ``"codecarbon"`` (then ``cpu_watts``),
            ``"constant"`` (``cpu_watts`` only) or ``"none"``.
        cpu_watts: constant CPU power, the last fallback (required by ``cpu="constant"``).
        ram: ``"codecarbon"`` (codecarbon's estimate) or ``"none"``.
        codecarbon_tracking_mode: codecarbon's ``"machine"`` (the whole node) or ``"process"``.
        rapl_root: the powercap sysfs directory.
        report_dir: where to write the report; default the logger's log dir (``trainer.log_dir``).
        sample_counter: ``batch -> int`` replacing the default sample count.
        token_counter: ``batch -> int | None`` replacing the default token count.
        log_every_n_steps: step-level logging interval; default the Trainer's.
        progress_bar: show total kWh in the progress bar.

    Raises:
        ValueError: on a bad argument, naming it, its value and what is allowed (including an unknown
            country or an unreadable or malformed CSV series).

    Example::

        from lightning.pytorch import Trainer
        from lightning_pulse import EnergyLogger, PulseCycle

        trainer = Trainer(max_epochs=10, callbacks=[PulseCycle(), EnergyLogger(country_iso_code="DEU")])

    The same in LightningCLI YAML::

        trainer:
          callbacks:
            - class_path: lightning_pulse.EnergyLogger
              init_args: {country_iso_code: DEU, price_per_kwh: 0.3}
    """

    def __init__(
        self,
        sampling_period: float = 1.0,
        country_iso_code: str | None = None,
        carbon_intensity: float | str | None = None,
        carbon_intensity_start: str | None = None,
        price_per_kwh: float | str | None = None,
        price_start: str | None = None,
        currency: str = "EUR",
        gpu: str = "auto",
        gpu_devices: Sequence[int | str] | None = None,
        cpu: str = "auto",
        cpu_watts: float | None = None,
        ram: str = "codecarbon",
        codecarbon_tracking_mode: str = "machine",
        rapl_root: str = DEFAULT_POWERCAP_ROOT,
        report_dir: str | None = None,
        sample_counter: Callable[[Any], int] | None = None,
        token_counter: Callable[[Any], int | None] | None = None,
        log_every_n_steps: int | None = None,
        progress_bar: bool = True,
    ) -> None:
        super().__init__()
        if (
            isinstance(sampling_period, bool)
            or not isinstance(sampling_period, (int, float))
            or not math.isfinite(sampling_period)
            or sampling_period <= 0
        ):
            raise ValueError(f"`sampling_period`={sampling_period!r} must be a positive number of seconds.")
        for field, value, allowed in (
            ("gpu", gpu, GPU_MODES),
            ("cpu", cpu, CPU_MODES),
            ("ram", ram, RAM_MODES),
        ):
            if value not in allowed:
                raise ValueError(f"`{field}`={value!r} is not one of {list(allowed)}.")
        if codecarbon_tracking_mode not in TRACKING_MODES:
            raise ValueError(
                f"`codecarbon_tracking_mode`={codecarbon_tracking_mode!r} is not one of {list(TRACKING_MODES)}."
            )
        if cpu_watts is not None:
            if not _is_number(cpu_watts) or cpu_watts < 0:
                raise ValueError(f"`cpu_watts`={cpu_watts!r} must be a finite number of watts >= 0.")
        if cpu == "constant" and cpu_watts is None:
            raise ValueError("`cpu`='constant' needs `cpu_watts`, the constant CPU power in watts.")
        if gpu_devices is not None:
            if isinstance(gpu_devices, (str, int)) or not all(
                (isinstance(d, int) and not isinstance(d, bool) and d >= 0) or (isinstance(d, str) and d)
                for d in gpu_devices
            ):
                raise ValueError(
                    f"`gpu_devices`={gpu_devices!r} must be a list of NVML indices (int >= 0) or GPU UUIDs (str)."
                )
        if not isinstance(currency, str) or not currency.strip():
            raise ValueError(f"`currency`={currency!r} must be a non-empty string such as 'EUR'.")
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool)
            or not isinstance(log_every_n_steps, int)
            or log_every_n_steps < 1
        ):
            raise ValueError(f"`log_every_n_steps`={log_every_n_steps!r} must be a positive int or None.")
        for field, value in (("sample_counter", sample_counter), ("token_counter", token_counter)):
            if value is not None and not callable(value):
                raise ValueError(f"`{field}`={value!r} must be a callable taking a batch, or None.")
        if report_dir is not None and not isinstance(report_dir, (str, Path)):
            raise ValueError(f"`report_dir`={report_dir!r} must be a directory path or None.")
        if country_iso_code is not None:
            from lightning_pulse.energy.codecarbon_meter import validate_country

            country_iso_code = validate_country(country_iso_code)
        self.intensity = carbon_intensity_from(
            carbon_intensity, country_iso_code, carbon_intensity_start, rank_zero_info
        )
        self.price = price_from(price_per_kwh, currency.strip(), price_start, rank_zero_info)
        self.sampling_period = float(sampling_period)
        self.country_iso_code = country_iso_code
        self.currency = currency.strip()
        self.gpu = gpu
        self.gpu_devices = None if gpu_devices is None else list(gpu_devices)
        self.cpu = cpu
        self.cpu_watts = None if cpu_watts is None else float(cpu_watts)
        self.ram = ram
        self.codecarbon_tracking_mode = codecarbon_tracking_mode
        self.rapl_root = str(rapl_root)
        self.report_dir = None if report_dir is None else str(report_dir)
        self.sample_counter = sample_counter
        self.token_counter = token_counter
        self._custom_counting = sample_counter is not None or token_counter is not None
        self.log_every_n_steps = log_every_n_steps
        self.progress_bar = progress_bar
        # injectable clocks (tests); monotonic for durations, wall for intensity and price
        self.clock: Callable[[], float] = time.monotonic
        self.wall_clock: Callable[[], float] = time.time

        self.carried: dict[str, Any] | None = None  # the whole run before this fit (from a checkpoint)
        self.resumed_runs = 0
        self.prediction: dict[str, Any] | None = None
        self.report: dict[str, Any] | None = None
        self.report_paths: list[Path] = []
        self.ledger: EnergyLedger | None = None
        self.sampler: EnergySampler | None = None
        self.chains: list[MeterChain] = []
        self._trainer: pl.Trainer | None = None
        self._disabled_reason: str | None = None
        self._reset_loop_state()

    # ------------------------------------------------------------------ public API
    def energy_so_far_kwh(self) -> float:
        """Energy metered by this process so far, all meters, in kWh (plus, on rank 0 of a resumed run, the
        whole run's energy before the resume).

        Between two readings of the sampling thread the figure grows with the latest average power, so
        consecutive calls (e.g. once per step, as ``StabilityGuard`` does) see a smooth, never decreasing
        value. Costs no meter reading while the sampling thread runs; never raises.
        """
        try:
            sampler = self.sampler
            if sampler is not None and not sampler.running:  # no thread: read here, at most once a period
                last = sampler.last_sample_time
                if last is None or self.clock() - last >= self.sampling_period:
                    sampler.sample()
            if self.ledger is None:
                joules = 0.0
            elif self._metering:
                joules = self.ledger.estimate_joules(self.clock())
            else:  # metering has ended: the final figure, no extrapolation
                joules = self.ledger.total_joules
        except Exception as error:
            self._disable(error)
            joules = self.ledger.total_joules if self.ledger is not None else 0.0
        value = max(joules / J_PER_KWH + self._carried_kwh(), self._last_so_far_kwh)
        self._last_so_far_kwh = value
        return value

    # ------------------------------------------------------------------ hooks
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trainer = trainer
        self._reset_loop_state()
        self._in_fit = True
        self.report, self.report_paths = None, []
        self._disabled_reason = None
        self.ledger = EnergyLedger(self.intensity, self.price)
        try:
            wall = self.wall_clock()
            for rate in (self.intensity, self.price):
                if rate is not None:
                    rate.anchor(wall)
            self.chains = self._build_chains(trainer)
            self.sampler = EnergySampler(
                self.chains,
                self.ledger,
                self.sampling_period,
                clock=self.clock,
                wall_clock=self.wall_clock,
                warn=self._warn_rank,
            )
            self.sampler.start()
            self._metering = True
        except Exception as error:
            self._disable(error)
        if self.progress_bar:
            compat.add_progress_bar_item(trainer, "kWh", self._progress_value)

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark(stage="validation")

    @override
    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark(stage="other")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._in_train_loop = True
        self._last_global_step = self._counted_step = trainer.global_step
        self._log_every = self.log_every_n_steps or max(trainer.log_every_n_steps, 1)
        self._log_steps = trainer.is_global_zero and bool(trainer.loggers)
        cycle = pulse_cycle_of(trainer)
        self._last_cycle = None if cycle is None else cycle.cycle
        self._mark(stage="train", phase=phase_of(trainer).value, cycle=self._last_cycle)

    def on_pulse_phase_change(self, trainer: pl.Trainer, pl_module: pl.LightningModule, change: Any) -> None:
        """Listener of :class:`~lightning_pulse.PulseCycle`: the energy from now on belongs to the new phase."""
        self._mark(phase=change.current.value, cycle=change.cycle)
        self._last_batch_end = None  # the gap holds the phase change (maybe a probe), not a data wait
        finished = self._last_cycle
        self._last_cycle = change.cycle
        if change.previous is not None and finished is not None and change.cycle > finished:
            self._log_cycle(trainer, finished)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark(epoch=trainer.current_epoch)
        self._last_batch_end = self._last_batch_start = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # runs on every batch: plain-number tallies only, folded into the ledger at the next label change
        # or read-out (see `_fold_counts`); the batch belongs to the label in force now
        now = self.clock()
        last_end = self._last_batch_end
        if last_end is not None:
            stall, loop = now - last_end, now - self._last_batch_start
            if stall > 0:
                self._stall_s += stall
            if loop > 0:
                self._loop_s += loop
        self._last_batch_start = now
        self._batches += 1
        try:
            if self._custom_counting:
                samples = int(self.sample_counter(batch)) if self.sample_counter else count_batch(batch)[0]
                tokens = self.token_counter(batch) if self.token_counter else count_batch(batch)[1]
            else:
                samples, tokens = count_batch(batch)
        except Exception as error:  # a counter that cannot read a batch must not stop training
            self._warn_once(
                "counter", f"EnergyLogger: could not count the batch ({type(error).__name__}: {error})."
            )
            return
        self._samples += samples
        if tokens is None:
            return
        if type(tokens) is int:
            self._tokens += tokens
        elif isinstance(tokens, torch.Tensor):
            # keep a device count pending: reading it now would synchronise a GPU every step
            pending = self._pending_tokens_now
            self._pending_tokens_now = tokens.detach() if pending is None else pending + tokens.detach()
        else:
            self._tokens += int(tokens)
        self._token_batches += 1

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._last_batch_end = self.clock()
        # optimizer steps are counted from `trainer.global_step` when the counts are folded; here only
        # the step-level logging needs the step, and only with a logger on rank 0
        if self._log_steps:
            global_step = trainer.global_step
            if global_step > self._last_global_step:
                self._last_global_step = global_step
                if global_step % self._log_every == 0:
                    self._log_step(trainer)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_batch_end = None
        if not trainer.sanity_checking:
            self._mark(stage="validation")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._mark(stage="train" if self._in_train_loop else "other")

    @override
    @_instrumentation
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # only the buckets logged here: the total, this epoch, and the phases
        epoch_key = f"epoch/{trainer.current_epoch}"
        snapshot = self._run_snapshot(
            trainer, keys=lambda key: key == "total" or key == epoch_key or key.startswith("phase/")
        )
        wanted = snapshot["buckets"]
        wanted.setdefault("total", {})
        groups = grouped_figures(wanted, self.intensity is not None, self.price is not None)
        epoch = groups["epochs"].get(str(trainer.current_epoch))
        metrics: dict[str, float | None] = {}
        if epoch is not None:
            metrics.update(
                {
                    "energy/epoch_kwh": epoch["energy_kwh"],
                    "energy/epoch_avg_power_w": epoch["avg_power_w"],
                    "energy/epoch_co2_kg": epoch["co2_kg"],
                    "energy/epoch_cost": epoch["cost"],
                    "energy/epoch_stall_share": epoch["stall_share"],
                }
            )
        total = groups["total"]
        metrics.update(
            {
                "energy/total_kwh": total["energy_kwh"],
                "energy/total_co2_kg": total["co2_kg"],
                "energy/total_cost": total["cost"],
                "energy/j_per_sample": total["energy_per_sample_j"],
                "energy/j_per_token": total["energy_per_token_j"],
            }
        )
        for phase, row in groups["phases"].items():
            metrics[f"energy/{phase}_kwh"] = row["energy_kwh"]
            metrics[f"energy/{phase}_stall_share"] = row["stall_share"]
        if self.prediction is None and epoch is not None:
            self.prediction = predict_run(
                snapshot["buckets"][f"epoch/{trainer.current_epoch}"],
                float(trainer.estimated_stepping_batches),
                self.intensity is not None,
                self.price is not None,
            )
            if self.prediction is not None:
                self._announce_prediction(self.prediction)
                metrics.update(
                    {
                        "energy/predicted_kwh": self.prediction["energy_kwh"],
                        "energy/predicted_duration_s": self.prediction["duration_s"],
                        "energy/predicted_co2_kg": self.prediction["co2_kg"],
                    }
                )
        # the total into `trainer.callback_metrics`, so ModelCheckpoint / EarlyStopping can monitor it (the
        # figure is the same on every rank: the snapshot is combined over ranks); everything to the loggers.
        # Not `pl_module.log`: it costs about 0.5 ms, a tenth of a small training step, per call.
        for name in MONITORABLE:
            value = metrics.get(name)
            if value is not None:
                compat.set_callback_metric(trainer, name, value)
        if trainer.is_global_zero:
            values = {name: float(value) for name, value in metrics.items() if value is not None}
            for logger in trainer.loggers:
                logger.log_metrics(values, step=trainer.global_step)

    @override
    @_instrumentation
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._in_train_loop = False
        self._mark(stage="other", phase=None, cycle=None, epoch=None)
        report = self._finish(trainer, status="complete")
        total = report["total"]
        metrics = {
            "energy/final_kwh": total["energy_kwh"],
            "energy/final_co2_kg": total["co2_kg"],
            "energy/final_cost": total["cost"],
            "energy/final_duration_s": total["duration_s"],
        }
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(
                    {k: float(v) for k, v in metrics.items() if v is not None}, step=trainer.global_step
                )

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_sampler()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._stop_sampler()
        # collectives are not safe after an exception on one rank, so only a single process reports
        if self.ledger is not None and trainer.world_size == 1 and self.report is None:
            try:
                self._finish(trainer, status="interrupted")
            except Exception as error:
                rank_zero_warn(f"EnergyLogger: could not write the report of the interrupted run ({error}).")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_sampler()

    @override
    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        snapshot = (
            self._run_snapshot(trainer) if trainer is not None and self.ledger is not None else self.carried
        )
        return {
            "version": 1,
            "snapshot": snapshot,
            "resumed_runs": self.resumed_runs,
            "prediction": self.prediction,
            "intensity": None if self.intensity is None else self.intensity.state_dict(),
            "price": None if self.price is None else self.price.state_dict(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.carried = state_dict.get("snapshot")
        self.resumed_runs = int(state_dict.get("resumed_runs", 0)) + 1
        self.prediction = state_dict.get("prediction")
        for rate, key in ((self.intensity, "intensity"), (self.price, "price")):
            if rate is not None and state_dict.get(key):
                rate.load_state_dict(state_dict[key])

    # ------------------------------------------------------------------ meters
    def _build_chains(self, trainer: pl.Trainer) -> list[MeterChain]:
        chains: list[MeterChain] = []
        info = rank_zero_info
        gpu_devices = self._gpu_devices(trainer)
        if gpu_devices:
            chains.append(
                MeterChain(
                    "gpu",
                    [
                        ("nvml-counter", lambda: NvmlCounterMeter(gpu_devices)),
                        ("nvml-power", lambda: NvmlPowerMeter(gpu_devices)),
                    ],
                    self._warn_rank,
                    info,
                )
            )
        if trainer.local_rank != 0:  # CPU and RAM are counted once per node
            return chains
        session: CodecarbonSession | None = None

        def codecarbon(component: str) -> MeterFactory:
            def build() -> CodecarbonMeter:
                nonlocal session
                if session is None:
                    session = CodecarbonSession(
                        self.country_iso_code,
                        self.codecarbon_tracking_mode,
                        min_flush_interval=0.9 * self.sampling_period,
                    )
                return CodecarbonMeter(component, session)

            return build

        cpu_factories: list[tuple[str, MeterFactory]] = []
        if self.cpu == "auto":
            cpu_factories.append(("rapl", lambda: RaplMeter(self.rapl_root)))
        if self.cpu in ("auto", "codecarbon"):
            cpu_factories.append(("codecarbon", codecarbon("cpu")))
        if self.cpu != "none" and self.cpu_watts is not None:
            watts = self.cpu_watts
            cpu_factories.append(("constant", lambda: ConstantPowerMeter("cpu", watts)))
        if cpu_factories:
            chains.append(MeterChain("cpu", cpu_factories, self._warn_rank, info))
        if self.ram == "codecarbon":
            chains.append(MeterChain("ram", [("codecarbon", codecarbon("ram"))], self._warn_rank, info))
        return chains

    def _gpu_devices(self, trainer: pl.Trainer) -> list[int | str]:
        if self.gpu == "none":
            return []
        if self.gpu_devices is not None:
            return list(self.gpu_devices)
        device = trainer.strategy.root_device
        if device.type != "cuda":
            return []
        index = device.index if device.index is not None else torch.cuda.current_device()
        return nvml_devices_for_cuda([index])

    def _meter_descriptions(self) -> dict[str, Any]:
        described = {}
        chains = {chain.component: chain for chain in self.chains}
        for component in COMPONENTS:
            chain = chains.get(component)
            described[component] = (
                chain.describe() if chain is not None else {"meter": "none", "method": "none"}
            )
            described[component]["counted_on"] = (
                "every rank, summed" if component == "gpu" else "local rank 0 of each node"
            )
        return described

    # ------------------------------------------------------------------ snapshots and DDP
    def _local_snapshot(
        self,
        edges: np.ndarray | None = None,
        timeline: bool = True,
        keys: Callable[[str], bool] | None = None,
    ) -> dict[str, Any]:
        ledger = self.ledger
        if ledger is None:
            return {"buckets": {}, "timeline": {}, "phase_segments": []} if timeline else {"buckets": {}}
        self._fold_counts()
        self._flush_pending_tokens()
        return ledger.snapshot(self.clock(), edges=edges, timeline=timeline, keys=keys)

    def _run_snapshot(
        self, trainer: pl.Trainer | None, timeline: bool = True, keys: Callable[[str], bool] | None = None
    ) -> dict[str, Any]:
        """The whole run so far, all ranks: carried state + this fit (collective under DDP).

        ``timeline=False`` gives the figures only (what per-epoch logging needs), which is much cheaper;
        ``keys`` keeps only the buckets whose key passes it (figures only).
        """
        if self.sampler is not None:
            try:
                self.sampler.sample()
            except Exception as error:
                self._disable(error)
        if keys is not None:
            timeline = False
        if trainer is None or trainer.world_size <= 1:
            current = self._local_snapshot(timeline=timeline, keys=keys)
        else:
            current = self._world_snapshot(trainer, timeline, keys)
        carried = self.carried
        if not timeline:
            earlier = None
            if carried:
                earlier = {
                    "buckets": {
                        key: row for key, row in carried["buckets"].items() if keys is None or keys(key)
                    }
                }
            return merge_snapshots(earlier, current)
        events = sorted((event for chain in self.chains for event in chain.events), key=lambda e: e.elapsed_s)
        current["events"] = [event.to_dict() for event in events]
        return merge_snapshots(carried, current)

    def _world_snapshot(
        self, trainer: pl.Trainer, timeline: bool, wanted: Callable[[str], bool] | None = None
    ) -> dict[str, Any]:
        """Every rank's ledger combined; every rank makes the same two collective calls."""
        strategy = trainer.strategy
        layout = None
        if trainer.is_global_zero:
            ledger = self.ledger
            keys = sorted(self._local_snapshot(timeline=False, keys=wanted)["buckets"])
            edges = timeline_edges(ledger.timeline_wall if ledger is not None and timeline else [])
            layout = (keys, edges.tolist())
        keys, edge_list = strategy.broadcast(layout, src=0)
        edges = np.asarray(edge_list, dtype=np.float64)
        bins = max(len(edges) - 1, 0)
        local = self._local_snapshot(edges if timeline else None, timeline=timeline, keys=wanted)
        buckets = flatten_buckets(local["buckets"], keys).ravel()
        series = local.get("timeline", {})
        binned = np.array([series.get(f"{c}_j") or [0.0] * bins for c in COMPONENTS], dtype=np.float64)
        vector = torch.tensor(
            np.concatenate([buckets, binned.ravel()]), dtype=torch.float64, device=strategy.root_device
        )
        gathered = strategy.all_gather(vector).detach().cpu().numpy().reshape(trainer.world_size, -1)
        size = len(keys) * len(BUCKET_FIELDS)
        combined = {
            "buckets": combine_ranks(gathered[:, :size].reshape(trainer.world_size, len(keys), -1), keys)
        }
        if timeline:
            summed = gathered[:, size:].sum(axis=0).reshape(len(COMPONENTS), bins)
            combined["timeline"] = {
                "start_wall": edges[:-1].tolist(),
                "end_wall": edges[1:].tolist(),
                **{f"{c}_j": summed[i].tolist() for i, c in enumerate(COMPONENTS)},
            }
            combined["phase_segments"] = local["phase_segments"]
        return combined

    def _flush_pending_tokens(self) -> None:
        if self.ledger is None or not self._pending_tokens:
            return
        pending, self._pending_tokens = self._pending_tokens, {}
        for keys, tokens in pending.items():
            self.ledger.add_tokens(keys, int(tokens.item()))

    # ------------------------------------------------------------------ report
    def _finish(self, trainer: pl.Trainer, status: str) -> dict[str, Any]:
        snapshot = self._run_snapshot(trainer)
        directory = self.report_dir
        if directory is None:
            directory = trainer.log_dir if status == "complete" or trainer.world_size == 1 else None
        directory = directory or trainer.default_root_dir
        report = self._build_report(trainer, snapshot, status)
        self.report = report
        if trainer.is_global_zero:
            try:
                self.report_paths = write_report(report, directory)
            except Exception as error:  # a report that cannot be written must not fail a finished run
                rank_zero_warn(f"EnergyLogger: could not write the energy report to {directory} ({error}).")
        return report

    def _build_report(self, trainer: pl.Trainer, snapshot: dict[str, Any], status: str) -> dict[str, Any]:
        return assemble_report(
            snapshot,
            status=status,
            world_size=trainer.world_size,
            num_nodes=trainer.num_nodes,
            sampling_period_s=self.sampling_period,
            resumed_runs=self.resumed_runs,
            meters=self._meter_descriptions(),
            intensity=self.intensity,
            price=self.price,
            currency=self.currency,
            prediction=self.prediction,
            counting=COUNTING_NOTES,
            disabled=self._disabled_reason,
        )

    # ------------------------------------------------------------------ logging
    def _log_step(self, trainer: pl.Trainer) -> None:
        ledger = self.ledger
        at = None if ledger is None else ledger.last_reading_time
        if ledger is None or at is None:
            return
        joules = ledger.total_joules
        metrics = {"energy/kwh_so_far": self._kwh_so_far()}
        previous = self._last_step_log
        if previous is not None and at > previous[1]:
            metrics["energy/power_w"] = (joules - previous[0]) / (at - previous[1])
        self._last_step_log = (joules, at)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    @_instrumentation
    def _log_cycle(self, trainer: pl.Trainer, cycle: int) -> None:
        key = f"cycle/{cycle}"
        snapshot = self._run_snapshot(trainer, keys=lambda name: name == key)
        bucket = snapshot["buckets"].get(key)
        if bucket is None or not trainer.is_global_zero:
            return
        row = grouped_figures({f"cycle/{cycle}": bucket}, self.intensity is not None, self.price is not None)
        figures = row["cycles"][str(cycle)]
        metrics = {
            "energy/cycle_kwh": figures["energy_kwh"],
            "energy/cycle_avg_power_w": figures["avg_power_w"],
            "energy/cycle_co2_kg": figures["co2_kg"],
            "energy/cycle_cost": figures["cost"],
            "energy/cycle": float(cycle),
        }
        for logger in trainer.loggers:
            logger.log_metrics(
                {k: float(v) for k, v in metrics.items() if v is not None}, step=trainer.global_step
            )

    def _announce_prediction(self, prediction: dict[str, Any]) -> None:
        co2 = prediction["co2_kg"]
        co2_text = f", {co2:.4g} kg CO2" if co2 is not None else ""
        rank_zero_info(
            f"EnergyLogger: forecast from {prediction['basis']}: the whole run ({int(prediction['total_steps'])} "
            f"steps) needs about {prediction['energy_kwh']:.4g} kWh, {prediction['duration_s'] / 60:.1f} min{co2_text}."
        )

    # ------------------------------------------------------------------ internals
    def _reset_loop_state(self) -> None:
        self._in_train_loop = False
        self._last_global_step = 0
        self._log_every = 1
        self._last_cycle: int | None = None
        self._last_batch_start: float | None = None
        self._last_batch_end: float | None = None
        self._log_steps = False
        self._progress_at: float | None = None
        self._progress_text = ""
        # per-batch tallies since the last fold into the ledger (see `_fold_counts`)
        self._counted_step: int | None = None
        self._batches = self._samples = self._tokens = self._token_batches = 0
        self._stall_s = self._loop_s = 0.0
        self._pending_tokens_now: torch.Tensor | None = None
        self._pending_tokens: dict[tuple[str, ...], torch.Tensor] = {}
        self._last_step_log: tuple[float, float] | None = None
        self._last_so_far_kwh = 0.0
        self._metering = False
        self._in_fit = False
        self._warned: set[str] = set()

    def _mark(self, **changes: Any) -> None:
        # only inside fit: a later trainer.validate() must not add to a finished run's ledger
        if self.ledger is not None and self._in_fit:
            self._fold_counts()  # what was tallied so far belongs to the label that ends here
            self.ledger.mark(self.clock(), self.wall_clock(), **changes)

    def _fold_counts(self) -> None:
        """Move the per-batch tallies into the ledger, under the current label.

        Every label change and every read-out folds first, so the tallies always belong to the current
        label. Optimizer steps are the growth of ``trainer.global_step`` since the last fold (never
        negative: a step that a callback takes back is not counted).
        """
        ledger, trainer = self.ledger, self._trainer
        if ledger is None:
            return
        steps = 0
        if self._counted_step is not None and trainer is not None:
            global_step = trainer.global_step
            if global_step > self._counted_step:
                steps, self._counted_step = global_step - self._counted_step, global_step
        pending = self._pending_tokens_now
        if not (self._batches or steps):
            return
        keys = ledger.current_keys()
        ledger.add_counts(
            keys,
            batches=self._batches,
            samples=self._samples,
            tokens=self._tokens,
            token_batches=self._token_batches,
            stall_s=self._stall_s,
            loop_s=self._loop_s,
            steps=steps,
        )
        if pending is not None:
            earlier = self._pending_tokens.get(keys)
            self._pending_tokens[keys] = pending if earlier is None else earlier + pending
        self._batches = self._samples = self._tokens = self._token_batches = 0
        self._stall_s = self._loop_s = 0.0
        self._pending_tokens_now = None

    def _kwh_so_far(self) -> float:
        joules = self.ledger.total_joules if self.ledger is not None else 0.0
        return joules / J_PER_KWH + self._carried_kwh()

    def _carried_kwh(self) -> float:
        trainer = self._trainer
        if not self.carried or (trainer is not None and not trainer.is_global_zero):
            return 0.0
        total = self.carried.get("buckets", {}).get("total", {})
        return sum(float(total.get(f"{c}_j", 0.0)) for c in COMPONENTS) / J_PER_KWH

    def _progress_value(self) -> str:
        # the bar asks on every refresh (each batch by default); the figure only changes with a reading
        ledger = self.ledger
        at = None if ledger is None else ledger.last_reading_time
        if at is None or at != self._progress_at:
            self._progress_at, self._progress_text = at, f"{self._kwh_so_far():.3g}"
        return self._progress_text

    def _stop_sampler(self) -> None:
        self._metering = False
        self._in_fit = False
        sampler = self.sampler
        if sampler is not None:
            try:
                sampler.stop()
            except Exception as error:
                self._warn_once("stop", f"EnergyLogger: stopping the meters failed ({error}).")

    def _disable(self, error: BaseException) -> None:
        """An unexpected error in our own machinery: stop metering, keep training."""
        self._metering = False
        self._disabled_reason = f"{type(error).__name__}: {error}"
        self._warn_once(
            "disabled", f"EnergyLogger: energy metering stopped ({self._disabled_reason}); training goes on."
        )
        sampler, self.sampler = self.sampler, None
        if sampler is not None:
            try:
                sampler.stop(final_sample=False)
            except Exception:
                pass

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self._warn_rank(message)

    def _warn_rank(self, message: str) -> None:
        # a meter can fail on one rank only (its own GPU), so under DDP every rank may warn, with its rank
        trainer = self._trainer
        if trainer is None or trainer.world_size <= 1:
            rank_zero_warn(message)
        else:
            warnings.warn(rank_prefixed_message(message, trainer.global_rank), UserWarning, stacklevel=2)


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
