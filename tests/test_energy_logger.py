"""EnergyLogger through real Trainers: phases, loggers, report, failures mid-run, resume, exceptions, DDP."""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import threading
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pynvml
import pytest
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader

from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
from lightning_pulse import PulseCycle, phase_of
from lightning_pulse.callbacks.energy_logger import EnergyLogger
from lightning_pulse.energy.config import AccountingConfig, MeterConfig
from lightning_pulse.energy.meter import ESTIMATED, MEASURED, NONE, PARTIAL
from lightning_pulse.energy.report import JSON_NAME, MARKDOWN_NAME, PNG_NAME, render_report
from lightning_pulse.energy.sampler import THREAD_NAME
from lightning_pulse.errors import PulseRefusal
from tests.conftest import RecordingLogger, trainer_kwargs
from tests.test_energy_meters import FakeGpu, fake_nvml, make_rapl_tree, set_energy  # noqa: F401

BATCH = 20


def data() -> MNIST1DDataModule:
    return MNIST1DDataModule(num_samples=1000, batch_size=BATCH)  # 720 train, 80 val


def trainer(callbacks, **kwargs) -> pl.Trainer:
    options = trainer_kwargs(max_epochs=2, limit_train_batches=12, limit_val_batches=2)
    options.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **options)


def leftover_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME or isinstance(t, threading.Timer)]


def energy_warnings(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("EnergyLogger:")]


class ReadEnergyEveryStep(Callback):
    """What StabilityGuard does: read `energy_so_far_kwh()` after every step."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        energy = next(c for c in trainer.callbacks if isinstance(c, EnergyLogger))
        self.values.append(energy.energy_so_far_kwh())


def test_fit_with_pulse_cycle_attributes_energy_to_every_phase(tmp_path, caplog, capfd):
    pl.seed_everything(0)
    cycle = PulseCycle(burst=3, replay=2, maintain=1, warmup=0.0, anneal=0.0, maintain_eval="none")
    energy = EnergyLogger(country_iso_code="DEU", price_per_kwh=0.3, meters=MeterConfig(sampling_period=0.05))
    reader = ReadEnergyEveryStep()
    fit = trainer(
        [cycle, energy, reader],
        accumulate_grad_batches=2,
        precision="bf16-mixed",
        logger=CSVLogger(tmp_path),
        log_every_n_steps=2,
        enable_progress_bar=True,
    )
    with caplog.at_level(logging.INFO):
        fit.fit(MNIST1DClassifier(arch="mlp"), data())

    assert fit.global_step == 12
    log_dir = Path(fit.logger.log_dir)
    assert {p.name for p in energy.report_paths} == {JSON_NAME, MARKDOWN_NAME}
    assert all(p.parent == log_dir for p in energy.report_paths)
    report = json.loads((log_dir / JSON_NAME).read_text())
    # the chart is drawn on demand, not inside the fit; the Markdown says how
    assert not (log_dir / PNG_NAME).exists()
    assert f"`lightning-pulse report DIR` draws {PNG_NAME}" in (log_dir / MARKDOWN_NAME).read_text()
    assert [p.name for p in render_report(log_dir)] == [MARKDOWN_NAME, PNG_NAME]
    assert (log_dir / PNG_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the same steps PulseCycle counted, with every micro-batch's samples
    for phase, steps in cycle.clock.steps_by_phase.items():
        assert report["phases"][phase]["steps"] == steps
        assert report["phases"][phase]["samples"] == steps * 2 * BATCH
    assert list(report["epochs"]) == ["0", "1"]
    # two full 6-step cycles; the third starts at the very last step
    assert [row["steps"] for row in report["cycles"].values()] == [6, 6, 0]
    total = report["total"]
    assert total["samples"] == 24 * BATCH and total["energy_kwh"] > 0
    assert total["methods"] == {"gpu": NONE, "cpu": ESTIMATED, "ram": ESTIMATED}
    assert total["co2_kg"] == pytest.approx(total["energy_kwh"] * 0.38095, rel=1e-3)
    assert total["cost"] == pytest.approx(total["energy_kwh"] * 0.3, rel=1e-6)
    assert sum(row["energy_kwh"] for row in report["phases"].values()) <= total["energy_kwh"] * (1 + 1e-9)
    assert 0 <= total["stall_share"] < 1

    # once, from the first epoch whose meters read energy; none if only the last one did (codecarbon's first
    # reading may come after this short first epoch): never a forecast of 0 kWh
    forecasts = [r for r in caplog.records if "EnergyLogger: forecast" in r.getMessage()]
    assert len(forecasts) == (report["prediction"] is not None)
    if report["prediction"] is not None:
        assert report["prediction"]["total_steps"] == 12 and report["prediction"]["energy_kwh"] > 0

    with open(log_dir / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    logged = {key for row in rows for key, value in row.items() if value}
    assert {
        "energy/total_kwh",
        "energy/epoch_kwh",
        "energy/kwh_so_far",
        "energy/final_kwh",
        "energy/cycle_kwh",
    } <= logged
    assert {"energy/burst_kwh", "energy/replay_stall_share"} <= logged
    assert ("energy/predicted_kwh" in logged) == (report["prediction"] is not None)
    assert "kWh" in fit.progress_bar_callback.get_metrics(fit, fit.lightning_module)

    # after the fit: the run's figure at the training loop's end; the report reads the meters a moment later,
    # so it may hold a little more (a loaded host once put 0.6% between them; the test asked for >=)
    final = energy.energy_so_far_kwh()
    assert total["energy_kwh"] / 2 < final <= total["energy_kwh"]  # not a per-rank or a stale figure
    # read every step and never decreasing; whether a reading of the sampling thread has landed before the
    # last step depends on how fast this tiny fit runs, so positivity is asserted on the final figure above
    # (mid-run growth between readings is tested on the ledger with a manual clock)
    assert len(reader.values) == 24 and reader.values == sorted(reader.values)
    assert leftover_threads() == []
    assert "[codecarbon" not in capfd.readouterr().err


class CodecarbonNeverMeasuresAgain(Callback):
    """From the first training batch on, codecarbon's tracker measures nothing more: a run shorter than
    codecarbon's measuring window (or a loaded machine where every reading lands inside it)."""

    def on_train_start(self, trainer, pl_module):
        energy = next(c for c in trainer.callbacks if isinstance(c, EnergyLogger))
        session = chain(energy, "cpu").meter.session
        assert session.wait_started(timeout=60.0)  # codecarbon starts in the background
        session.tracker._measure_power_and_energy_if_stale = lambda *args, **kwargs: None
        self.watts = session.receiver.cpu_watts + session.receiver.ram_watts


def test_a_run_shorter_than_codecarbons_measuring_window_reports_its_energy(tmp_path):
    # the sampling thread never reads within this run (a 60 s period): only the epoch-end and final
    # readings, all of which codecarbon answers with unchanged totals
    energy = EnergyLogger(cpu="codecarbon", meters=MeterConfig(sampling_period=60.0))
    frozen = CodecarbonNeverMeasuresAgain()
    fit = trainer([energy, frozen], max_epochs=1, limit_train_batches=2, default_root_dir=tmp_path)
    fit.fit(MNIST1DClassifier(arch="mlp"), data())

    total = energy.report["total"]
    assert total["methods"] == {"gpu": NONE, "cpu": ESTIMATED, "ram": ESTIMATED}
    # the run's figure at the training loop's end; the report reads a moment later and may hold a little more
    # (this test once asked for >= and failed on a loaded host: 5.75e-7 against 5.81e-7); in a two-batch run
    # that moment can be a large share of the whole, so no closeness is asked
    assert 0 < energy.energy_so_far_kwh() <= total["energy_kwh"]
    # the whole interval at codecarbon's latest power (the metered span starts a little before the label time)
    assert total["avg_power_w"] == pytest.approx(frozen.watts, rel=0.5)
    assert energy.report["stages"]["train"]["energy_kwh"] > 0
    assert leftover_threads() == []


class ManualClock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class SlowToFetch(MNIST1DDataModule):
    """Every training batch takes `fetch` seconds of the injected clock to come out of the DataLoader."""

    def __init__(self, clock: ManualClock, fetch: float) -> None:
        super().__init__(num_samples=1000, batch_size=BATCH)
        self.clock, self.fetch = clock, fetch

    def train_dataloader(self) -> DataLoader:
        loader = super().train_dataloader()

        def slow_collate(items):
            self.clock.now += self.fetch
            return loader.collate_fn(items)

        return DataLoader(loader.dataset, batch_size=BATCH, shuffle=True, collate_fn=slow_collate)


class StepTakes(Callback):
    """Each training step takes a phase-dependent time of the injected clock."""

    def __init__(self, clock: ManualClock, seconds: dict[str, float]) -> None:
        self.clock, self.seconds = clock, seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.clock.now += self.seconds[phase_of(trainer).value]


def test_data_loader_stall_share_is_measured_per_phase(tmp_path):
    clock = ManualClock()
    energy = EnergyLogger(
        cpu="constant", ram="none", meters=MeterConfig(sampling_period=0.05, cpu_watts=10.0)
    )
    energy.account.clock = clock
    step = {"burst": 0.75, "replay": 0.25, "maintain": 0.5}
    cycle = PulseCycle(burst=3, replay=2, maintain=2, warmup=0.0, anneal=0.0, maintain_eval="none")
    fit = trainer([energy, cycle, StepTakes(clock, step)], default_root_dir=tmp_path)
    fit.fit(MNIST1DClassifier(arch="mlp"), SlowToFetch(clock, fetch=0.25))

    phases = energy.report["phases"]
    # every batch waits for its own fetch, a phase's first and an epoch's first too: stall / (stall + step)
    for phase, seconds in step.items():
        assert phases[phase]["stall_share"] == pytest.approx(0.25 / (0.25 + seconds))
        assert phases[phase]["stall_s"] == pytest.approx(0.25 * phases[phase]["steps"])
    assert phases["burst"]["steps"] + phases["replay"]["steps"] + phases["maintain"]["steps"] == 24


class SlowBatches(SlowToFetch):
    """As SlowToFetch (in order), plus `epoch_wait` seconds before each epoch's first batch (the loader's
    iterator: workers starting, a cold cache) and `extra` more for the batches of each epoch in `slow`."""

    def __init__(self, clock: ManualClock, fetch: float, epoch_wait: float, slow: set[int], extra: float):
        super().__init__(clock, fetch)
        self.epoch_wait, self.slow, self.extra, self.index = epoch_wait, slow, extra, 0

    def train_dataloader(self) -> DataLoader:
        loader, data = super().train_dataloader(), self

        class Sampler(torch.utils.data.SequentialSampler):
            def __iter__(self):
                data.clock.now += data.epoch_wait
                data.index = 0
                return super().__iter__()

        def slow_collate(items):
            data.clock.now += data.extra if data.index in data.slow else 0.0
            data.index += 1
            return loader.collate_fn(items)

        return DataLoader(
            loader.dataset, batch_size=BATCH, sampler=Sampler(loader.dataset), collate_fn=slow_collate
        )


class Evaluates(Callback):
    """A maintain probe of `probe` seconds (after EnergyLogger's phase label) and `val` seconds a val batch."""

    def __init__(self, clock: ManualClock, probe: float, val: float) -> None:
        self.clock, self.probe, self.val = clock, probe, val

    def on_pulse_phase_begin(self, trainer, pl_module, change):
        self.clock.now += self.probe

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.clock.now += self.val


@pytest.mark.parametrize("energy_first", [True, False])
def test_every_data_loader_wait_counts_after_phase_changes_validation_and_epoch_starts(
    tmp_path, energy_first
):
    # phases of 1-2 steps, a validation every 4 batches: each batch's fetch (0.25 s), each epoch's first wait
    # (1 s) and the extra 1 s of batches 2 and 7 count, in the phase of the batch that waited; the probes
    # (5 s) and the validations (3 s a batch) do not. The loop is the waits plus each batch's own time.
    clock = ManualClock()
    energy = EnergyLogger(
        cpu="constant", ram="none", meters=MeterConfig(sampling_period=0.05, cpu_watts=10.0)
    )
    energy.account.clock = clock
    step = {"burst": 0.75, "replay": 0.25, "maintain": 0.5}
    cycle = PulseCycle(burst=2, replay=1, maintain=1, warmup=0.0, anneal=0.0, maintain_eval="none")
    order = (
        [energy, cycle] if energy_first else [cycle, energy]
    )  # a phase change before or after our batch end
    callbacks = [*order, Evaluates(clock, probe=5.0, val=3.0), StepTakes(clock, step)]
    fit = trainer(callbacks, default_root_dir=tmp_path, val_check_interval=4)
    fit.fit(
        MNIST1DClassifier(arch="mlp"), SlowBatches(clock, fetch=0.25, epoch_wait=1.0, slow={2, 7}, extra=1.0)
    )

    report = energy.report
    phases = {name: report["phases"][name] for name in step}
    assert {name: row["steps"] for name, row in phases.items()} == {"burst": 12, "replay": 6, "maintain": 6}
    # batches 2 and 7 of an epoch train in replay and maintain (4-step cycles); every epoch starts in burst
    expected = {"burst": 12 * 0.25 + 2 * 1.0, "replay": 6 * 0.25 + 2 * 1.0, "maintain": 6 * 0.25 + 2 * 1.0}
    for name, row in phases.items():
        assert row["stall_s"] == pytest.approx(expected[name])
        own = row["steps"] * step[name]
        assert row["loop_s"] == pytest.approx(expected[name] + own)
        assert row["stall_share"] == pytest.approx(expected[name] / (expected[name] + own))
    assert report["total"]["stall_s"] == pytest.approx(sum(expected.values()))
    assert [row["stall_s"] for row in report["epochs"].values()] == pytest.approx([6.0, 6.0])


def test_total_kwh_is_monitorable_and_logged_without_lightning_module_log(tmp_path):
    energy = EnergyLogger(
        cpu="constant", ram="none", meters=MeterConfig(sampling_period=0.05, cpu_watts=10.0)
    )
    stop = EarlyStopping(monitor="energy/total_kwh", mode="min", patience=0, check_on_train_epoch_end=True)
    best = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", monitor="energy/total_kwh", mode="min", save_on_train_epoch_end=True
    )
    fit = trainer(
        [energy, stop, best],
        max_epochs=5,
        enable_checkpointing=True,
        logger=CSVLogger(tmp_path),
        default_root_dir=tmp_path,
    )
    fit.fit(MNIST1DClassifier(arch="mlp"), data())

    assert fit.current_epoch == 2  # the total only grows: epoch 1 is no better than epoch 0, so it stops
    with open(Path(fit.logger.log_dir) / "metrics.csv") as handle:
        logged = [float(row["energy/total_kwh"]) for row in csv.DictReader(handle) if row["energy/total_kwh"]]
    assert len(logged) == 2 and 0 < logged[0] < logged[1]
    assert float(best.best_model_score) == pytest.approx(logged[0])
    assert float(fit.callback_metrics["energy/total_kwh"]) == pytest.approx(logged[1])
    assert "energy/total_kwh" not in fit.logged_metrics  # not through `LightningModule.log`


class TotalWhereMonitorsRead(Callback):
    """Records ``(global_step, where, energy/total_kwh or None)`` at each validation's end (listed before the
    EnergyLogger: its ``on_validation_end`` runs first, as an EarlyStopping listed there does) and at each
    training epoch's end (after the EnergyLogger's)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, str, float | None]] = []

    def _record(self, trainer, where: str) -> None:
        value = trainer.callback_metrics.get("energy/total_kwh")
        self.rows.append((trainer.global_step, where, None if value is None else float(value)))

    def on_validation_end(self, trainer, pl_module):
        self._record(trainer, "validation")

    def on_train_epoch_end(self, trainer, pl_module):
        self._record(trainer, "epoch end")


def test_total_kwh_exists_at_every_validation_inside_an_epoch_where_monitors_check_it(tmp_path):
    """Sweep 41: with validation inside the epoch (`val_check_interval=0.5`, or an int), EarlyStopping and
    ModelCheckpoint check at the validation's end, before the first training epoch's end, where EnergyLogger
    used to put the total: `EarlyStopping(monitor="energy/total_kwh")` crashed the fit at the first validation
    ("not available"), as did ModelCheckpoint ("could not find the monitored key"). The running total is now
    published at every fit-time validation, before any monitor checks (an EarlyStopping listed before the
    EnergyLogger included)."""
    energy = EnergyLogger(
        cpu="constant", ram="none", meters=MeterConfig(sampling_period=0.05, cpu_watts=10.0)
    )
    recorder = TotalWhereMonitorsRead()
    stop = EarlyStopping(monitor="energy/total_kwh", mode="max", patience=100)
    best = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="energy/total_kwh", mode="min")
    fit = trainer(
        [recorder, stop, energy, best],
        val_check_interval=0.5,
        enable_checkpointing=True,
        default_root_dir=tmp_path,
    )
    fit.fit(MNIST1DClassifier(arch="mlp"), data())

    assert fit.global_step == 24  # trained to the end: no monitor crashed
    assert (
        not stop._check_on_train_epoch_end and not best._save_on_train_epoch_end
    )  # both check at validation
    steps = [(step, where) for step, where, _ in recorder.rows]
    assert steps == [(6, "validation"), (12, "validation"), (12, "epoch end")] + [
        (18, "validation"),
        (24, "validation"),
        (24, "epoch end"),
    ]
    values = [value for _, _, value in recorder.rows]
    assert all(value is not None and value > 0 for value in values)
    assert values == sorted(values) and values[0] < values[1] < values[3] < values[4]  # the running total
    assert float(best.best_model_score) == pytest.approx(values[0])  # checked at the first validation


def test_a_step_saving_checkpoint_monitoring_total_kwh_saves_at_its_steps_in_the_first_epoch(tmp_path):
    """Sweep 41: `ModelCheckpoint(monitor="energy/total_kwh", every_n_train_steps=n)` found no key at the
    steps before the first epoch end: Lightning warned and put those saves off to a validation's end (none
    here), so they never came. The total is now published at the steps such a checkpoint saves at (once a
    step, under gradient accumulation too), the figure an epoch end would give there."""
    energy = EnergyLogger(
        cpu="constant", ram="none", meters=MeterConfig(sampling_period=0.05, cpu_watts=10.0)
    )
    saves = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", monitor="energy/total_kwh", every_n_train_steps=2, save_top_k=-1
    )
    fit = trainer(
        [energy, saves],
        limit_val_batches=0,
        accumulate_grad_batches=2,  # 6 optimizer steps an epoch
        enable_checkpointing=True,
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit.fit(MNIST1DClassifier(arch="mlp"), data())

    assert fit.global_step == 12
    saved = sorted((float(score), Path(path).name) for path, score in saves.best_k_models.items())
    assert [name for _, name in saved] == [
        f"epoch={(s - 1) // 6}-step={s}.ckpt" for s in (2, 4, 6, 8, 10, 12)
    ]
    assert all(score > 0 for score, _ in saved)
    assert not [w for w in record if "could not find the monitored key" in str(w.message)]


def test_a_time_saving_checkpoint_monitoring_total_kwh_is_warned_at_fit_start(tmp_path):
    """Its saves come at times rank 0's clock picks, which EnergyLogger cannot foresee without a collective
    at every step: the warning says when the key exists and the ways out."""
    from datetime import timedelta

    energy = EnergyLogger(cpu="constant", ram="none", meters=MeterConfig(cpu_watts=10.0))
    saves = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", monitor="energy/total_kwh", train_time_interval=timedelta(hours=1)
    )
    fit = trainer([energy, saves], max_epochs=1, enable_checkpointing=True, default_root_dir=tmp_path)
    with pytest.warns(UserWarning) as record:
        fit.fit(MNIST1DClassifier(arch="mlp"), data())
    lines = energy_warnings(record)
    assert len(lines) == 1 and "train_time_interval=1:00:00" in lines[0] and "every_n_train_steps" in lines[0]


class InjectFailures(Callback):
    """Breaks the meters one after the other in the middle of training."""

    def __init__(self, rapl_root: Path, gpu: FakeGpu, monkeypatch) -> None:
        self.rapl_root, self.gpu, self.monkeypatch = rapl_root, gpu, monkeypatch
        self.energy_uj = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        energy = next(c for c in trainer.callbacks if isinstance(c, EnergyLogger))
        step = trainer.global_step
        self.gpu.energy_mj += 5_000
        if step < 3:
            self.energy_uj += 2_000_000
            set_energy(self.rapl_root, 0, self.energy_uj)
        elif step == 3:
            wait_for(lambda: chain(energy, "cpu").last_total_j >= 4.0)  # RAPL has read its 4 J
            counter = self.rapl_root / "intel-rapl:0" / "energy_uj"
            counter.unlink()
            counter.mkdir()  # RAPL counter unreadable from here on
            wait_for(lambda: chain(energy, "cpu").meter_name == "codecarbon")
        elif step == 5:
            self.gpu.fail_counter = True  # NVMLError: GPU is lost
            wait_for(lambda: chain(energy, "gpu").meter_name == "nvml-power")
        elif step == 7:
            import codecarbon.external.ram as codecarbon_ram

            def broken(self):
                raise RuntimeError("injected codecarbon failure")

            self.monkeypatch.setattr(codecarbon_ram.RAM, "total_power", broken)
            wait_for(lambda: chain(energy, "ram").meter_name == "none")


class LoseGpuAtStep(Callback):
    """Each step, waits for a fresh meter reading (so every logged interval holds one); at ``step`` both NVML
    meters fail with ``NVMLError_GPUIsLost``."""

    def __init__(self, gpu: FakeGpu, monkeypatch, step: int) -> None:
        self.gpu, self.monkeypatch, self.step = gpu, monkeypatch, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        energy = next(c for c in trainer.callbacks if isinstance(c, EnergyLogger))
        self.gpu.energy_mj += 50_000
        if trainer.global_step == self.step:
            self.gpu.fail_counter = True

            def lost(handle):
                raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

            self.monkeypatch.setattr(pynvml, "nvmlDeviceGetPowerUsage", lost)
            wait_for(lambda: chain(energy, "gpu").meter_name == "none")
        ledger = energy.account.ledger
        readings = ledger.readings
        wait_for(lambda: ledger.readings > readings)


def test_step_power_is_not_logged_for_an_interval_whose_gpu_was_lost(tmp_path, fake_nvml, monkeypatch):  # noqa: F811
    """Sweep 43: after the GPU's meters were lost, `energy/power_w` went on as the CPU's 10 W alone, a plain
    number (the GPU read as idle, not lost), where the report gives a partial figure no average power."""
    energy = EnergyLogger(
        cpu="constant",
        ram="none",
        meters=MeterConfig(sampling_period=0.02, gpu_devices=[0], cpu_watts=10.0),
        accounting=AccountingConfig(log_every_n_steps=1),
    )
    logger = RecordingLogger()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = trainer(
            [LoseGpuAtStep(fake_nvml, monkeypatch, step=4), energy],
            max_epochs=1,
            logger=logger,
            default_root_dir=tmp_path,
        )
        fit.fit(MNIST1DClassifier(arch="mlp"), data())
    assert energy.report["total"]["methods"]["gpu"] == PARTIAL
    power = dict(logger.logged("energy/power_w"))
    so_far = dict(logger.logged("energy/kwh_so_far"))
    # logged at `global_step - 1`; the loss comes at global step 4 (logged as 3): a power for each interval
    # before it (the first log has no interval), none from the interval holding it on
    assert sorted(power) == [1, 2]
    assert all(watts > 10.0 for watts in power.values())  # the GPU's share is in each
    assert sorted(so_far) == list(range(12))  # the energy counted so far is still logged, as is


def chain(energy: EnergyLogger, component: str):
    return next(c for c in energy.account.chains if c.component == component)


def wait_for(condition, timeout: float = 30.0) -> None:
    """Wait for the sampling thread to notice an injected failure (a condition, not a fixed delay)."""
    event = threading.Event()
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the sampler never noticed the injected failure"
        event.wait(0.01)


def test_meter_failures_mid_run_never_stop_training(tmp_path, fake_nvml, monkeypatch, recwarn):  # noqa: F811
    rapl_root = make_rapl_tree(tmp_path / "powercap", {0: 0})
    energy = EnergyLogger(
        country_iso_code="BRA",
        meters=MeterConfig(sampling_period=0.02, rapl_root=str(rapl_root), gpu_devices=[0], cpu_watts=15.0),
    )
    fit = trainer(
        [InjectFailures(rapl_root, fake_nvml, monkeypatch), energy], max_epochs=1, default_root_dir=tmp_path
    )
    fit.fit(MNIST1DClassifier(arch="mlp"), data())

    assert fit.global_step == 12  # training finished
    messages = energy_warnings(recwarn)
    # RAM's codecarbon failure is the CPU's (one shared tracker): an info line, not a second warning
    assert len(messages) == 3 and all("\n" not in m for m in messages)
    report = energy.report
    assert [(e["component"], e["failed"], e["next"]) for e in report["events"]] == [
        ("cpu", "rapl", "codecarbon"),
        ("gpu", "nvml-counter", "nvml-power"),
        ("cpu", "codecarbon", "constant"),
        ("ram", "codecarbon", "none"),
    ]
    total = report["total"]
    # RAM lost its only meter part-way: partial, and so is the total (an undercount, not a measurement)
    assert total["methods"] == {"gpu": MEASURED, "cpu": ESTIMATED, "ram": PARTIAL}
    assert total["energy_method"] == PARTIAL and total["avg_power_w"] is None
    by_component = total["energy_kwh_by_component"]
    assert by_component["cpu"] >= 4.0 / 3.6e6  # at least the 4 J RAPL measured before it broke
    assert by_component["gpu"] > 0 and by_component["ram"] > 0
    assert report["meters"]["cpu"]["meter"] == "constant" and report["meters"]["gpu"]["meter"] == "nvml-power"
    assert leftover_threads() == []


def test_resumed_run_reports_the_whole_run_like_an_uninterrupted_one(tmp_path, caplog):
    def run(max_epochs, ckpt_path=None, root="full"):
        pl.seed_everything(0)
        cycle = PulseCycle(burst=4, replay=2, maintain=2, warmup=0.0, anneal=0.0, maintain_eval="none")
        energy = EnergyLogger(
            cpu="constant",
            ram="none",
            carbon_intensity=200.0,
            meters=MeterConfig(sampling_period=0.05, cpu_watts=10.0),
        )
        checkpoint = ModelCheckpoint(dirpath=tmp_path / root, save_last=True, save_top_k=0)
        fit = trainer(
            [cycle, energy, checkpoint],
            max_epochs=max_epochs,
            enable_checkpointing=True,
            default_root_dir=tmp_path / root,
        )
        fit.fit(MNIST1DClassifier(arch="mlp"), data(), ckpt_path=ckpt_path)
        return energy.report

    full = run(4)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        first = run(2, root="part")
        resumed = run(4, ckpt_path=str(tmp_path / "part" / "last.ckpt"), root="part")
    assert resumed["resumed_runs"] == 1 and first["resumed_runs"] == 0
    assert list(resumed["epochs"]) == ["0", "1", "2", "3"]
    for name in ("phases", "cycles", "epochs"):
        assert {k: (v["steps"], v["samples"]) for k, v in resumed[name].items()} == {
            k: (v["steps"], v["samples"]) for k, v in full[name].items()
        }
    assert resumed["total"]["energy_kwh"] > first["total"]["energy_kwh"]
    assert resumed["total"]["duration_s"] > first["total"]["duration_s"]
    # a constant 10 W over the metered time, before and after the resume
    assert resumed["total"]["avg_power_w"] == pytest.approx(10.0, rel=0.05)
    assert resumed["prediction"] == first["prediction"]
    assert len([r for r in caplog.records if "EnergyLogger: forecast" in r.getMessage()]) == 1


class CrashAtStep(Callback):
    """A process that dies mid-epoch (after the checkpoint of an earlier step was written)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError("killed")


def test_resume_mid_epoch_keeps_the_interrupted_epoch_whole(tmp_path):
    """Issue 18: Lightning calls no `on_train_epoch_start` for the epoch a fit resumes in mid-way, so the
    part after the resume was booked to no epoch and the per-epoch table lost it."""

    def run(root, ckpt_path=None, crash_at=None):
        pl.seed_everything(0)
        energy = EnergyLogger(
            cpu="constant", ram="none", meters=MeterConfig(sampling_period=0.05, cpu_watts=10.0)
        )
        callbacks = [energy, ModelCheckpoint(dirpath=tmp_path / root, every_n_train_steps=18, save_top_k=-1)]
        if crash_at is not None:
            callbacks.append(CrashAtStep(crash_at))
        fit = trainer(callbacks, max_epochs=3, enable_checkpointing=True, default_root_dir=tmp_path / root)
        fit.fit(MNIST1DClassifier(arch="mlp"), data(), ckpt_path=ckpt_path)
        return energy.report

    full = run("full")
    with pytest.raises(RuntimeError, match="killed"):
        run("part", crash_at=20)
    checkpoint = tmp_path / "part" / "epoch=1-step=18.ckpt"  # 12 batches an epoch: 6 steps into epoch 1
    assert checkpoint.exists()
    resumed = run("part", ckpt_path=str(checkpoint))

    def rows(report):
        return {k: (v["steps"], v["samples"]) for k, v in report["epochs"].items()}

    assert rows(resumed) == rows(full) == {str(e): (12, 240) for e in range(3)}
    assert resumed["total"]["steps"] == 36
    # every joule of the training loop (its validation runs included) belongs to an epoch; a constant meter
    # makes energy exactly watts x seconds
    loop = [resumed["stages"][stage] for stage in ("train", "validation")]
    for figure in ("energy_kwh", "duration_s"):
        in_epochs = sum(row[figure] for row in resumed["epochs"].values())
        assert in_epochs == pytest.approx(sum(row[figure] for row in loop), rel=1e-9)


class ExplodingClassifier(MNIST1DClassifier):
    def training_step(self, batch, batch_idx):
        if self.global_step == 4:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_an_exception_in_training_stops_the_thread_and_reports_the_interrupted_run(tmp_path):
    energy = EnergyLogger(cpu="constant", ram="none", meters=MeterConfig(sampling_period=0.02, cpu_watts=5.0))
    fit = trainer([energy], default_root_dir=tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        fit.fit(ExplodingClassifier(arch="mlp"), data())
    assert leftover_threads() == []
    report = json.loads((tmp_path / JSON_NAME).read_text())
    assert report["status"] == "interrupted" and report["total"]["steps"] == 4
    # sweep: the batch that raised before its backward trained nothing, and was counted (5 batches' samples)
    assert report["total"]["samples"] == 4 * BATCH
    assert report["total"]["methods"]["cpu"] == ESTIMATED
    # the meters were closed before the report was built: it still names the one that counted
    assert report["meters"]["cpu"]["meter"] == "constant", report["meters"]["cpu"]


def test_an_interrupted_token_run_counts_the_tokens_of_the_batches_that_trained(tmp_path):
    # review: leaving out the batch that raised left the batch count one above the batches whose tokens were
    # counted, and the report's tokens became unknown
    from examples.charlm import CharLMDataModule, CharTransformerLM

    class RaisesAtTheThirdStep(CharTransformerLM):
        def training_step(self, batch, batch_idx):
            if self.global_step == 2:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    energy = EnergyLogger(
        cpu="constant", ram="none", meters=MeterConfig(sampling_period=0.05, cpu_watts=20.0)
    )
    fit = trainer(
        [energy], max_epochs=1, limit_train_batches=5, limit_val_batches=1, default_root_dir=tmp_path
    )
    with pytest.raises(RuntimeError, match="boom"):
        fit.fit(
            RaisesAtTheThirdStep(d_model=16, n_layers=1, n_heads=2, seq_len=16),
            CharLMDataModule(20_000, 16, 8),
        )
    total = json.loads((tmp_path / JSON_NAME).read_text())["total"]
    assert (total["samples"], total["tokens"]) == (16, 2 * 8 * 16)


def test_a_fit_refused_before_its_first_batch_writes_no_report(tmp_path):
    from lightning.pytorch.callbacks import Callback

    from lightning_pulse import PulseRefusal

    class Refuses(Callback):
        def on_train_start(self, trainer, pl_module):
            raise PulseRefusal("Refuses: this model is not handled; remove Refuses.")

    energy = EnergyLogger(cpu="constant", ram="none", meters=MeterConfig(sampling_period=0.02, cpu_watts=5.0))
    fit = trainer([energy, Refuses()], default_root_dir=tmp_path)
    with pytest.raises(PulseRefusal):
        fit.fit(MNIST1DClassifier(arch="mlp"), data())
    assert leftover_threads() == []
    assert not list(tmp_path.rglob("energy_report*"))
    assert energy.report is None


class FailsAtTheFirstBatch(Callback):
    """Listed before the EnergyLogger, it raises in the first batch: at its start (before the EnergyLogger
    sees it), in its forward, or at its end (after its optimizer step)."""

    def __init__(self, where: str) -> None:
        self.where = where

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.where == "batch start":
            raise ValueError("fails at the first batch's start")

    def on_before_backward(self, trainer, pl_module, loss):
        if self.where == "forward":  # the EnergyLogger counts a batch at its own `on_before_backward`
            raise ValueError("fails before the first backward")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.where == "batch end":
            raise ValueError("fails after the first step")


@pytest.mark.parametrize("where", ["batch start", "forward", "batch end"])
def test_a_fit_that_fails_in_its_first_batch_says_whether_it_trained(tmp_path, where, caplog):
    # a sweep: a hook failing at the end of the first batch (one optimizer step taken) was told "the fit
    # stopped before its first training batch; no energy report"
    energy = EnergyLogger(cpu="constant", ram="none", meters=MeterConfig(sampling_period=0.02, cpu_watts=5.0))
    fit = trainer([FailsAtTheFirstBatch(where), energy], default_root_dir=tmp_path)
    with caplog.at_level(logging.INFO), pytest.raises(ValueError, match="fails"):
        fit.fit(MNIST1DClassifier(arch="mlp"), data())
    said = [record.getMessage() for record in caplog.records if "EnergyLogger:" in record.getMessage()]
    if where == "batch end":  # the step trained: the interrupted run is reported, as any later crash is
        assert fit.global_step == 1 and not said
        report = json.loads((tmp_path / JSON_NAME).read_text())
        assert report["status"] == "interrupted"
        assert (report["total"]["steps"], report["total"]["samples"]) == (1, BATCH)
        return
    assert fit.global_step == 0 and energy.report is None and not list(tmp_path.rglob("energy_report*"))
    if where == "batch start":
        assert said == ["EnergyLogger: the fit stopped before its first training batch; no energy report."]
    else:
        assert said == [
            "EnergyLogger: the fit stopped in its first training batch, before its backward (nothing "
            "trained); no energy report."
        ]


class FailsAtFitStart(Callback):
    """Listed after the EnergyLogger, it stops the fit before the training loop: a refusal (a PulseRefusal, a
    bad Trainer setting), a ValueError in its setup, or a crash of another kind."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def on_fit_start(self, trainer, pl_module):
        raise self.error


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (PulseRefusal("Other: refuses this model; use another."), False),
        (MisconfigurationException("a bad Trainer setting"), False),
        (ValueError("`units` entry 'net.99' is no module"), False),
        (TypeError("an option of the wrong type"), False),
        (RuntimeError("CUDA error: out of memory"), True),
    ],
    ids=["pulse-refusal", "misconfiguration", "value-error", "type-error", "crash"],
)
def test_a_refusal_at_fit_start_is_not_preceded_by_the_no_report_line(tmp_path, caplog, error, said):
    # sweep D: every fit-start refusal next to an EnergyLogger (as in every shipped pulse.yaml) was preceded
    # by "EnergyLogger: the fit stopped before its first training batch; no energy report.", pushing the
    # refusal off the first line and saying nothing it does not; a crash before the first batch keeps it
    energy = EnergyLogger(cpu="constant", ram="none", meters=MeterConfig(sampling_period=0.02, cpu_watts=5.0))
    fit = trainer([energy, FailsAtFitStart(error)], default_root_dir=tmp_path)
    with caplog.at_level(logging.INFO), pytest.raises(type(error)):
        fit.fit(MNIST1DClassifier(arch="mlp"), data())
    lines = [record.getMessage() for record in caplog.records if "EnergyLogger:" in record.getMessage()]
    stopped = ["EnergyLogger: the fit stopped before its first training batch; no energy report."]
    assert lines == (stopped if said else [])
    assert energy.report is None and not list(tmp_path.rglob("energy_report*"))


def test_a_failed_predict_says_nothing_about_a_fit(tmp_path, caplog):
    # sweep-cli-yaml: `lightning-pulse predict` on a data module without predict_dataloader printed
    # "EnergyLogger: the fit stopped before its first training batch" before the error; there was no fit
    energy = EnergyLogger(cpu="constant", ram="none", meters=MeterConfig(sampling_period=0.02, cpu_watts=5.0))
    predictor = trainer([energy], default_root_dir=tmp_path)
    with caplog.at_level(logging.INFO), pytest.raises(Exception, match="predict_dataloader"):
        predictor.predict(MNIST1DClassifier(arch="mlp"), data())
    assert [record.getMessage() for record in caplog.records if "EnergyLogger" in record.getMessage()] == []
    assert energy.report is None and not list(tmp_path.rglob("energy_report*"))


def test_a_bug_in_the_epoch_figures_warns_once_and_training_goes_on(tmp_path, monkeypatch, recwarn):
    import lightning_pulse.energy.account as account_module

    def broken(*args, **kwargs):
        raise KeyError("figures bug")

    monkeypatch.setattr(account_module, "grouped_figures", broken)
    energy = EnergyLogger(cpu="constant", ram="none", meters=MeterConfig(sampling_period=0.05, cpu_watts=5.0))
    fit = trainer([energy], max_epochs=3, default_root_dir=tmp_path)
    fit.fit(MNIST1DClassifier(arch="mlp"), data())
    assert fit.current_epoch == 3
    messages = energy_warnings(recwarn)
    assert messages == [  # each once in 3 epochs: the read-out at each validation, the epoch end's figures
        "EnergyLogger: reading the running total failed (KeyError: 'figures bug').",
        "EnergyLogger: on_train_epoch_end failed (KeyError: 'figures bug').",
    ]
    assert energy.report["total"]["steps"] == 36 and leftover_threads() == []


def test_charlm_batches_give_energy_per_token(tmp_path):
    from examples.charlm import CharLMDataModule, CharTransformerLM

    energy = EnergyLogger(
        cpu="constant", ram="none", meters=MeterConfig(sampling_period=0.05, cpu_watts=20.0)
    )
    fit = trainer(
        [energy], max_epochs=1, limit_train_batches=3, limit_val_batches=1, default_root_dir=tmp_path
    )
    fit.fit(CharTransformerLM(d_model=16, n_layers=1, n_heads=2, seq_len=16), CharLMDataModule(20_000, 16, 8))
    total = energy.report["total"]
    assert (total["samples"], total["tokens"]) == (24, 24 * 16)
    assert total["energy_per_token_j"] == pytest.approx(total["energy_per_sample_j"] / 16)


@dataclasses.dataclass
class FeaturesAndLabels:  # a batch as a dataclass, as some users collate
    features: torch.Tensor
    labels: torch.Tensor


class Opaque:  # a batch type the default counter cannot look into
    def __init__(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        self.features, self.labels = features, labels


class CollatedAs(MNIST1DDataModule):
    def __init__(self, batch_type: type) -> None:
        super().__init__(num_samples=1000, batch_size=BATCH)
        self.batch_type = batch_type

    def train_dataloader(self):
        loader = super().train_dataloader()
        default = loader.collate_fn
        return DataLoader(
            loader.dataset, batch_size=BATCH, collate_fn=lambda rows: self.batch_type(*default(rows))
        )


class ReadsAttributes(MNIST1DClassifier):
    def training_step(self, batch, batch_idx):
        return super().training_step((batch.features, batch.labels), batch_idx)


@pytest.mark.parametrize("batch_type", [FeaturesAndLabels, Opaque])
def test_a_dataclass_batch_counts_its_rows_and_one_it_cannot_read_warns(tmp_path, batch_type, recwarn):
    energy = EnergyLogger(cpu="constant", ram="none", meters=MeterConfig(cpu_watts=20.0))
    fit = trainer(
        [energy], max_epochs=1, limit_train_batches=3, limit_val_batches=1, default_root_dir=tmp_path
    )
    fit.fit(ReadsAttributes(arch="mlp"), CollatedAs(batch_type))
    uncounted = [text for text in energy_warnings(recwarn) if "found no tensor" in text]
    if batch_type is FeaturesAndLabels:
        assert energy.report["total"]["samples"] == 3 * BATCH and not uncounted
    else:  # counted as one sample per batch, and said so once, with the way out
        assert energy.report["total"]["samples"] == 3
        assert len(uncounted) == 1 and "of type Opaque" in uncounted[0] and "sample_counter" in uncounted[0]


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: MeterConfig(sampling_period=0), "`meters.sampling_period`=0"),
        (lambda: EnergyLogger(cpu="rapl-only"), "`cpu`='rapl-only' is not one of"),
        (lambda: EnergyLogger(gpu="nvml"), "`gpu`='nvml'"),
        (lambda: EnergyLogger(cpu="constant"), "`cpu`='constant' needs `meters.cpu_watts`"),
        (lambda: MeterConfig(cpu_watts=-3), "`meters.cpu_watts`=-3"),
        (lambda: EnergyLogger(country_iso_code="Germany"), "`country_iso_code`='Germany'"),
        (lambda: EnergyLogger(carbon_intensity="nowhere.csv"), "`carbon_intensity`='nowhere.csv'"),
        (lambda: EnergyLogger(price_per_kwh=-0.1), "`price_per_kwh`=-0.1"),
        (lambda: MeterConfig(gpu_devices=[0, -1]), "`meters.gpu_devices`="),
        (lambda: AccountingConfig(log_every_n_steps=0), "`accounting.log_every_n_steps`=0"),
        (lambda: MeterConfig(codecarbon_tracking_mode="node"), "`meters.codecarbon_tracking_mode`='node'"),
        (lambda: EnergyLogger(meters="fast"), "`meters`=.* must be a MeterConfig"),
        (lambda: EnergyLogger(currency=" "), "`currency`=' '"),
    ],
)
def test_bad_arguments_fail_at_construction(build, match):
    with pytest.raises(ValueError, match=match) as raised:
        build()
    assert str(raised.value).startswith("EnergyLogger: `")  # the callback first, then the field


def test_constructor_takes_at_most_ten_arguments():
    import inspect

    assert len(inspect.signature(EnergyLogger.__init__).parameters) - 1 <= 10


# ---------------------------------------------------------------------- DDP
class NodeFakeGpu(Callback):
    """In each DDP worker, NVML device 0 as NVML names it: one physical GPU of the node, the same device in
    every process (NVML indices and UUIDs ignore ``CUDA_VISIBLE_DEVICES``). Its counter grows at 100 W on the
    node's monotonic clock, which every process shares, as a real GPU's counter does."""

    def setup(self, trainer, pl_module, stage):
        pynvml.nvmlInit = lambda: None
        pynvml.nvmlShutdown = lambda: None
        pynvml.nvmlDeviceGetHandleByIndex = lambda index: index
        pynvml.nvmlDeviceGetName = lambda handle: b"Injected GPU"
        pynvml.nvmlDeviceGetTotalEnergyConsumption = lambda handle: int(100.0 * time.monotonic() * 1000)


class WriteRankResult(Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_fit_end(self, trainer, pl_module):
        energy = next(c for c in trainer.callbacks if isinstance(c, EnergyLogger))
        result = {
            "rank": trainer.global_rank,
            "report_paths": [str(p) for p in energy.report_paths],
            "local_components": sorted(c.component for c in energy.account.chains),
            "local_cpu_j": energy.account.ledger.totals_j["cpu"],
            "report": energy.report,
        }
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


@pytest.mark.ddp
@pytest.mark.slow
def test_ddp_meters_the_listed_gpus_and_the_cpu_once_per_node(tmp_path):
    """Sweep 43: `meters.gpu_devices` was metered on every rank and summed, 2x the GPU on two ranks (191.9 W
    for one GPU drawing 100 W). The listed devices are the node's: metered on local rank 0, like the CPU.
    (Each rank's own CUDA device, the default, is still metered on every rank and summed:
    `tests/test_energy_ledger.py::test_account_sums_gpu_over_ranks_and_counts_cpu_once`.)"""
    energy = EnergyLogger(
        cpu="constant", ram="none", meters=MeterConfig(sampling_period=0.05, gpu_devices=[0], cpu_watts=10.0)
    )
    fit = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_epochs=2,
        limit_train_batches=6,
        limit_val_batches=1,
        callbacks=[NodeFakeGpu(), energy, WriteRankResult(str(tmp_path))],
        default_root_dir=tmp_path,
        enable_checkpointing=True,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        logger=False,
    )
    fit.fit(MNIST1DClassifier(arch="mlp"), data())
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert rank1["report_paths"] == [] and len(rank0["report_paths"]) == 2  # JSON and Markdown
    assert rank0["local_components"] == ["cpu", "gpu"] and rank1["local_components"] == []
    report = json.loads((tmp_path / JSON_NAME).read_text())
    assert report["world_size"] == 2 and report == rank0["report"]
    assert rank1["report"]["total"] == report["total"]  # every rank computed the same figures
    total = report["total"]
    seconds = total["duration_s"]
    by_component = total["energy_kwh_by_component"]
    assert by_component["gpu"] * 3.6e6 / seconds == pytest.approx(100.0, rel=0.15)  # once, not twice
    assert by_component["cpu"] * 3.6e6 / seconds == pytest.approx(10.0, rel=0.15)  # once, not twice
    assert total["samples"] == 2 * 2 * 6 * BATCH  # two ranks, two epochs, six batches each
    assert total["methods"] == {"gpu": MEASURED, "cpu": ESTIMATED, "ram": NONE}
    assert report["meters"]["gpu"]["counted_on"] == "local rank 0 of each node"


# ---------------------------------------------------------------------- start-up off the training loop
class HeldCodecarbonStart(Callback):
    """Holds codecarbon's tracker start (its hardware detection, 1.5-3 s on a first fit) until the training
    epoch's batches have trained (at the epoch-end validation, whose monitored total waits for the start, or
    at the epoch's end), and records what the loop saw meanwhile. ``startup_s``: how long the start then takes
    (the hardware detection of a process's first fit; a later one is quicker). ``released``: whether the hold
    ended by the fit's release, not by the wait's 20 s bound."""

    def __init__(self, monkeypatch, startup_s: float = 0.0) -> None:
        from codecarbon import OfflineEmissionsTracker

        self.release, self.returned = threading.Event(), threading.Event()
        self.start_threads: list[str] = []
        self.pending_at_first_batch: bool | None = None
        self.session, self.released = None, None
        original = OfflineEmissionsTracker.start

        def held_start(tracker):
            self.start_threads.append(threading.current_thread().name)
            # a start on the training thread would stall the fit this long
            self.released = self.release.wait(timeout=20.0)
            time.sleep(startup_s)
            original(tracker)
            self.returned.set()

        monkeypatch.setattr(OfflineEmissionsTracker, "start", held_start)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.pending_at_first_batch is None:
            self.pending_at_first_batch = not self.returned.is_set()
            energy = next(c for c in trainer.callbacks if isinstance(c, EnergyLogger))
            self.session = chain(energy, "cpu").meter.session

    def on_validation_epoch_end(self, trainer, pl_module):  # an epoch-end validation's total waits for it
        if not trainer.sanity_checking:
            self.release.set()

    def on_train_epoch_end(self, trainer, pl_module):  # runs before EnergyLogger's (listed first)
        self.release.set()


def test_codecarbon_starts_off_the_training_thread_and_the_first_batch_does_not_wait(tmp_path, monkeypatch):
    """Issue 19: EnergyLogger's start-up blocked each fit for 1.5-3 s (codecarbon's tracker start). Now the
    tracker starts on its own thread; training runs meanwhile; its energy from the request on still counts."""
    held = HeldCodecarbonStart(monkeypatch)
    energy = EnergyLogger(cpu="codecarbon", meters=MeterConfig(sampling_period=0.05))
    fit = trainer([held, energy], max_epochs=1, limit_train_batches=4, default_root_dir=tmp_path)
    fit.fit(MNIST1DClassifier(arch="mlp"), data())

    from lightning_pulse.energy.codecarbon_meter import START_THREAD_NAME

    assert held.start_threads == [START_THREAD_NAME]  # once, and not on the training thread
    assert held.pending_at_first_batch is True  # the whole epoch trained while the start was held
    assert held.released is True  # by the epoch-end validation, not after the 20 s bound
    assert fit.global_step == 4
    # the report waited for it: CPU and RAM energy from the start request on (codecarbon's first power over
    # the gap before its own start, which here spans the whole training loop)
    report = energy.report
    assert (
        report["meters"]["cpu"]["meter"] == "codecarbon" and report["meters"]["ram"]["meter"] == "codecarbon"
    )
    assert report["total"]["methods"] == {"gpu": NONE, "cpu": ESTIMATED, "ram": ESTIMATED}
    gap_cpu_kwh, gap_ram_kwh = held.session._gap_kwh
    assert gap_cpu_kwh > 0 and gap_ram_kwh > 0
    # sweep B: the epoch-end wait for the start is the instrumentation's, not the run's: it is reported on its
    # own and kept out of the total (before, it was stage "other" of the run, so a process's first short fit
    # compared 13x worse than an identical second one); run + wait hold every joule of the backlog
    startup = report["meter_startup"]
    assert startup["duration_s"] > 0 and startup["energy_method"] == ESTIMATED
    stages = report["stages"].values()
    assert sum(row["duration_s"] for row in stages) == pytest.approx(report["total"]["duration_s"])
    assert sum(row["energy_kwh"] for row in stages) == pytest.approx(report["total"]["energy_kwh"])
    by_component = report["total"]["energy_kwh_by_component"]
    at_startup = startup["energy_kwh_by_component"]
    assert by_component["cpu"] + at_startup["cpu"] >= gap_cpu_kwh
    assert by_component["ram"] + at_startup["ram"] >= gap_ram_kwh
    startup_line = next(
        line for line in Path(energy.report_paths[1]).read_text().splitlines() if "Meter start-up" in line
    )
    assert "not counted" in startup_line and "kWh" in startup_line and "{" not in startup_line  # rendered
    assert leftover_threads() == [] and not any(t.name == START_THREAD_NAME for t in threading.enumerate())


def test_step_figures_leave_out_codecarbons_start_up_and_end_at_the_reports_total(tmp_path, monkeypatch):
    """Sweep 20d: `energy/kwh_so_far` and `energy_so_far_kwh()` held the wait for codecarbon's start
    (`meter_startup`, outside the report's total): 25x the total on a process's first fit; and while
    codecarbon was starting, `kwh_so_far` was logged as 0.0."""
    held = HeldCodecarbonStart(monkeypatch, startup_s=0.5)  # the first epoch's end waits 0.5 s for it
    energy = EnergyLogger(
        cpu="codecarbon",
        meters=MeterConfig(sampling_period=0.05),
        accounting=AccountingConfig(log_every_n_steps=1),
    )
    fit = trainer(
        [held, energy],
        limit_train_batches=6,
        limit_val_batches=0,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
    )
    fit.fit(MNIST1DClassifier(arch="mlp"), data())

    report = energy.report
    total = report["total"]["energy_kwh"]
    assert total > 0 and report["meter_startup"]["energy_kwh"] > 0
    with open(Path(fit.logger.log_dir) / "metrics.csv") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("energy/kwh_so_far")]
    # none while codecarbon was held (the whole first epoch: steps 0-5), rather than a 0 nobody measured
    assert rows and min(int(row["step"]) for row in rows) >= 6
    so_far = [float(row["energy/kwh_so_far"]) for row in rows]
    assert so_far == sorted(so_far) and 0 < so_far[-1] <= total
    assert all(float(row["energy/power_w"]) > 0 for row in rows if row.get("energy/power_w"))
    # after the fit: the run's figure at its end, which the report counts (the report's reading comes a moment
    # later, after the fit's shut-down, so it may hold more: on this 6-step run under a loaded machine, a
    # quarter more once; the bug this guards against was 25x the total), and no less than the last logged
    final = energy.energy_so_far_kwh()
    assert so_far[-1] <= final <= total


def test_cycles_that_end_before_codecarbons_first_reading_are_logged_with_their_energy_once_it_comes(
    tmp_path, monkeypatch
):
    """Sweep-loggers 5: the cycles that ended while codecarbon was still starting reached the logger as a lone
    `energy/cycle`, with no kWh, though the report later gave them their energy. They now wait for the first
    reading (here the first epoch's end, which waits for the held start) and are logged at their own last
    step, with the report's figures."""
    held = HeldCodecarbonStart(monkeypatch)  # held for the whole first epoch: cycles 0 and 1 end in it
    cycle = PulseCycle(burst=3, replay=2, maintain=1, warmup=0.0, anneal=0.0, maintain_eval="none")
    energy = EnergyLogger(cpu="codecarbon", meters=MeterConfig(sampling_period=0.05))
    logger = RecordingLogger()
    fit = trainer([held, cycle, energy], limit_val_batches=0, logger=logger, default_root_dir=tmp_path)
    fit.fit(MNIST1DClassifier(arch="mlp"), data())

    assert held.pending_at_first_batch is True and fit.global_step == 24
    rows = [(step, row) for step, row in logger.rows if "energy/cycle" in row]
    assert all("energy/cycle_kwh" in row for _, row in rows)  # never a lone `energy/cycle`
    # each at its last step (6 steps a cycle); the fourth ends at the fit's last step, where the clock enters
    # a fifth that trains no step and gets no row
    assert {int(row["energy/cycle"]): step for step, row in rows} == {0: 5, 1: 11, 2: 17, 3: 23}
    report = energy.report["cycles"]
    for _, row in rows:
        assert row["energy/cycle_kwh"] == pytest.approx(report[str(int(row["energy/cycle"]))]["energy_kwh"])


def test_a_codecarbon_start_that_fails_in_the_background_falls_back(tmp_path, monkeypatch, recwarn):
    from codecarbon import OfflineEmissionsTracker

    def broken(tracker):
        raise RuntimeError("injected start failure")

    monkeypatch.setattr(OfflineEmissionsTracker, "start", broken)
    energy = EnergyLogger(
        cpu="codecarbon", ram="none", meters=MeterConfig(sampling_period=0.05, cpu_watts=7.0)
    )
    fit = trainer([energy], max_epochs=1, limit_train_batches=4, default_root_dir=tmp_path)
    fit.fit(MNIST1DClassifier(arch="mlp"), data())
    assert energy.report["meters"]["cpu"]["meter"] == "constant"
    assert [e["failed"] for e in energy.report["meters"]["cpu"]["fallbacks"]] == ["codecarbon"]
    assert any("cpu meter 'codecarbon' failed" in w for w in energy_warnings(recwarn))
    assert leftover_threads() == []


def test_nested_configs_take_a_mapping_as_yaml_gives_them():
    logger = EnergyLogger(
        meters={"sampling_period": 0.5, "cpu_watts": 7.0}, accounting={"log_every_n_steps": 3}
    )
    assert logger.meters == MeterConfig(sampling_period=0.5, cpu_watts=7.0)
    assert logger.accounting.log_every_n_steps == 3
    with pytest.raises(ValueError, match=r"^EnergyLogger: `meters`=7 must be a MeterConfig"):
        EnergyLogger(meters=7)


def test_fast_dev_run_writes_no_report(tmp_path, caplog):
    # Lightning suppresses logging and checkpointing under fast_dev_run; the report was still written
    energy = EnergyLogger(cpu="constant", ram="none", meters=MeterConfig(cpu_watts=5.0))
    fit = trainer([energy], fast_dev_run=True, default_root_dir=tmp_path)
    with caplog.at_level(logging.INFO):
        fit.fit(MNIST1DClassifier(arch="mlp"), data())
    assert energy.report is not None and energy.report["total"]["energy_kwh"] > 0  # kept in memory
    # sweep-flags: the 1-batch smoke test's report said "complete", as a whole run's does
    assert energy.report["status"] == "smoke_test" and energy.report["total"]["steps"] == 1
    assert energy.report_paths == [] and not list(tmp_path.rglob(JSON_NAME))
    assert any("fast_dev_run: the energy report is not written" in r.getMessage() for r in caplog.records)


class SlowProbe(MNIST1DClassifier):
    """Every validation batch sleeps: a maintain phase's probe (two of them) takes a known, long time."""

    PROBE_BATCH_S = 0.5

    def validation_step(self, batch, batch_idx):
        time.sleep(self.PROBE_BATCH_S)
        return super().validation_step(batch, batch_idx)


def test_the_maintain_probe_is_booked_to_the_maintain_phase_it_runs_for(tmp_path):
    # PulseCycle runs the probe when maintain starts; EnergyLogger hears of the phase before it (the
    # PhaseStartListener contract), else the probe's seconds and joules went to the phase that had just ended
    cycle = PulseCycle(
        burst=4, replay=4, maintain=4, warmup=0.0, anneal=0.0, maintain_eval="probe", probe_batches=2
    )
    energy = EnergyLogger(
        cpu="constant", ram="none", meters=MeterConfig(sampling_period=0.05, cpu_watts=10.0)
    )
    fit = trainer(
        [cycle, energy],
        max_epochs=1,
        max_steps=24,
        limit_train_batches=24,
        limit_val_batches=2,  # the probe takes at most what validation does (0 would switch it off)
        check_val_every_n_epoch=2,  # no validation of its own in this one-epoch run
        default_root_dir=tmp_path,  # the report goes there, not into the working directory
    )
    fit.fit(SlowProbe(arch="mlp"), data())

    probes_s = 2 * 2 * SlowProbe.PROBE_BATCH_S  # two maintain phases of two probe batches
    phases = energy.report["phases"]
    assert phases["maintain"]["duration_s"] >= probes_s
    assert phases["replay"]["duration_s"] < probes_s / 2  # 8 steps of a small MLP
    seconds = cycle.clock.state_dict()["seconds_by_phase"]  # PulseCycle's own clock agrees
    assert phases["maintain"]["duration_s"] == pytest.approx(seconds["maintain"], abs=0.25)


class EveryBatchTakes(Callback):
    """Each training batch takes `seconds` of the injected clock."""

    def __init__(self, clock: ManualClock, seconds: float) -> None:
        self.clock, self.seconds = clock, seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.clock.now += self.seconds


def test_the_forecast_counts_batches_under_an_accumulation_scheduler(tmp_path, caplog):
    # review: under a GradientAccumulationScheduler the forecast scaled the first epoch's energy per optimizer
    # step; its 12 steps of one batch each were scaled to the run's 21 steps, the last 9 of which take 5
    # batches each: about 40% of the run. Every batch takes 1 s here, so the run takes 48 s, 4 times the first
    # epoch
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    clock = ManualClock()
    energy = EnergyLogger(
        cpu="constant", ram="none", meters=MeterConfig(sampling_period=0.05, cpu_watts=10.0)
    )
    energy.account.clock = clock
    schedule = GradientAccumulationScheduler({0: 1, 1: 5})
    fit = trainer([schedule, energy, EveryBatchTakes(clock, 1.0)], max_epochs=4, default_root_dir=tmp_path)
    with caplog.at_level(logging.INFO):
        fit.fit(MNIST1DClassifier(arch="mlp"), data())

    prediction, total = energy.report["prediction"], energy.report["total"]
    assert fit.global_step == 21 and prediction["total_steps"] == 21
    assert prediction["duration_s"] == pytest.approx(total["duration_s"], rel=0.05)
    assert prediction["energy_kwh"] == pytest.approx(total["energy_kwh"], rel=0.05)
