"""The callbacks' metrics land at the step Lightning gives the user's own metrics of the same moment."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.stability_guard import FaultInjector
from lightning_pulse import (
    EnergyLogger,
    GradientCache,
    HardSampleReplay,
    HyperConnectionMonitor,
    PulseCycle,
    StabilityGuard,
    phase_of,
)
from lightning_pulse.callbacks.pulse_cycle import pulse_cycle_of
from lightning_pulse.energy.config import MeterConfig
from lightning_pulse.loggers import log_to_loggers
from tests.conftest import RecordingLogger, trainer_kwargs


class LogsAtBatchEnd(Callback):
    """Logs a marker through the library's logging path at every training batch's end."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        log_to_loggers(trainer, {"marker": float(trainer.global_step)})


def test_a_batch_end_metric_shares_the_step_of_the_loss_it_follows(mnist1d_small, tmp_path):
    model, data = mnist1d_small()
    logger = RecordingLogger()
    trainer = pl.Trainer(
        callbacks=[LogsAtBatchEnd()],
        **trainer_kwargs(logger=logger, max_steps=6, log_every_n_steps=1, default_root_dir=tmp_path),
    )
    trainer.fit(model, data)
    losses = [step for step, _ in logger.logged("train_loss")]
    markers = logger.logged("marker")
    assert losses == [0, 1, 2, 3, 4, 5]
    # the marker logged after optimizer step k (global_step k) sits where that step's loss sits: k - 1
    assert [step for step, _ in markers] == losses
    assert [value for _, value in markers] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def test_energy_and_phase_metrics_line_up_with_the_training_loss(mnist1d_small, tmp_path):
    model, data = mnist1d_small()
    logger = RecordingLogger()
    callbacks = [
        PulseCycle(burst=3, replay=2, maintain=1, warmup=0, anneal=0, maintain_eval="none"),
        EnergyLogger(country_iso_code="DEU"),
    ]
    trainer = pl.Trainer(
        callbacks=callbacks,
        **trainer_kwargs(logger=logger, max_steps=8, log_every_n_steps=1, default_root_dir=tmp_path),
    )
    trainer.fit(model, data)
    loss_steps = {step for step, _ in logger.logged("train_loss")}
    assert loss_steps == set(range(8))
    library = [
        step for step, metrics in logger.rows if any(key.startswith(("energy/", "pulse/")) for key in metrics)
    ]
    # the burst that ended with step 3, and the one in progress when the fit ended (its two steps so far)
    assert logger.logged("pulse/burst_steps") == [(2, 3.0), (7, 2.0)]
    # every figure lands on a step that has a loss, the epoch's and the run's summaries on the last one, where
    # Lightning writes an epoch's own metrics
    assert set(library) <= loss_steps
    assert [step for step, _ in logger.logged("energy/epoch_kwh")] == [7]
    assert [step for step, _ in logger.logged("energy/final_kwh")] == [7]


class LogsItsPhase(pl.LightningModule):
    """Keeps the phase and cycle each step trained in, whatever the logging cadence."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(16, 4)
        self.trained_in: list[tuple[float, float]] = []  # (phase code, cycle) by step

    def training_step(self, batch, batch_idx):
        cycle = pulse_cycle_of(self.trainer)
        self.trained_in.append((float(phase_of(self.trainer).code), float(cycle.cycle)))
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class HoldsLightAfter(Callback):
    """A scheduler listed before PulseCycle that holds light at a step's batch end, as GreenWindow does."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step + 1:  # after that step trained
            pulse_cycle_of(trainer).hold_light(trainer, pl_module, True)


class HoldsLightAtStart(Callback):
    """Holds light as the fit starts, as GreenWindow does for a fit resumed inside a dirty window."""

    def on_train_start(self, trainer, pl_module):
        pulse_cycle_of(trainer).hold_light(trainer, pl_module, True)


def phase_rows(logger: RecordingLogger) -> dict[int, tuple[float, float]]:
    """The phase and cycle rows by step; two rows at one step (a stale one beside the real one) fail here,
    where the dict would keep one of them."""
    phases, cycles = logger.logged("pulse/phase"), logger.logged("pulse/cycle")
    for rows in (phases, cycles):
        assert len({step for step, _ in rows}) == len(rows)
    phases, cycles = dict(phases), dict(cycles)
    assert phases.keys() == cycles.keys()
    return {step: (phases[step], cycles[step]) for step in phases}


def switch_steps(trained_in: list[tuple[float, float]]) -> set[int]:
    """The first and last step of every phase."""
    edges = {0, len(trained_in) - 1}
    for step in range(1, len(trained_in)):
        if trained_in[step] != trained_in[step - 1]:
            edges |= {step - 1, step}
    return edges


def fit_logging_phases(
    every: int, tmp_path, callbacks=(), steps: int = 12, after=(), cycle=None, ckpt_path=None
) -> tuple[LogsItsPhase, dict]:
    """A fit of PulseCycle (3/2/1 steps, or ``cycle``) between ``callbacks`` and ``after``, and its phase
    rows; ``ckpt_path`` resumes it."""
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(192, 16, generator=generator), torch.randint(0, 4, (192,), generator=generator)
    )
    logger = RecordingLogger()
    if cycle is None:
        cycle = PulseCycle(burst=3, replay=2, maintain=1, warmup=0, anneal=0, maintain_eval="none")
    callbacks = [*callbacks, cycle, *after]
    checkpoints = any(isinstance(callback, ModelCheckpoint) for callback in callbacks)
    trainer = pl.Trainer(
        callbacks=callbacks,
        **trainer_kwargs(
            logger=logger,
            max_steps=steps,
            log_every_n_steps=every,
            default_root_dir=tmp_path,
            enable_checkpointing=checkpoints,
        ),
    )
    model = LogsItsPhase()
    trainer.fit(model, DataLoader(data, batch_size=16), ckpt_path=ckpt_path)
    return model, phase_rows(logger)


@pytest.mark.parametrize("every", [1, 2, 5])
def test_the_phase_row_at_a_step_is_the_phase_that_step_trained_in(every, tmp_path):
    # a sweep: the gauge was read after the clock moved on, so each row carried the next batch's phase (every
    # switch one step before the loss it belongs to; the fit's last step read a burst that never trained); a
    # review: a cadence longer than a phase left that phase out of the series (a 1-step maintain under 5)
    model, rows = fit_logging_phases(every, tmp_path)
    trained_in = model.trained_in
    assert [phase for phase, _ in trained_in] == [0, 0, 0, 1, 1, 2] * 2  # the reference itself
    assert all(rows[step] == trained_in[step] for step in rows)
    cadence = {step for step in range(12) if (step + 1) % every == 0}  # Lightning's: global_step % n
    assert set(rows) == cadence | switch_steps(trained_in)


def test_a_fit_ending_inside_a_phase_off_the_cadence_writes_its_last_step_row(tmp_path):
    # a review: the fit's last step got no row when it was off the cadence and ended no phase
    model, rows = fit_logging_phases(5, tmp_path, steps=8)
    assert [phase for phase, _ in model.trained_in] == [0, 0, 0, 1, 1, 2, 0, 0]  # ends inside a burst
    assert all(rows[step] == model.trained_in[step] for step in rows)
    assert set(rows) == {4} | switch_steps(model.trained_in)


def test_a_hold_from_a_scheduler_listed_first_does_not_relabel_the_step_it_follows(tmp_path):
    # a review: holding light at step 1's batch end, before PulseCycle's batch end read the clock, logged
    # that burst step as replay
    model, rows = fit_logging_phases(1, tmp_path, callbacks=[HoldsLightAfter(step=1)], steps=6)
    assert [phase for phase, _ in model.trained_in][:3] == [0, 0, 1]
    assert rows == dict(enumerate(model.trained_in))


@pytest.mark.parametrize("scheduler_first", [True, False])
def test_a_phase_a_hold_ends_gets_its_last_step_row_in_either_callback_order(scheduler_first, tmp_path):
    # a review: the rows at a phase's last step came only from the clock's own ends, so a burst a hold ended
    # (GreenWindow's light mode) had none under a long cadence, in both orders of the callbacks
    hold = [HoldsLightAfter(step=1)]
    before, after = (hold, ()) if scheduler_first else ((), hold)
    model, rows = fit_logging_phases(1000, tmp_path, callbacks=before, steps=6, after=after)
    assert [phase for phase, _ in model.trained_in][:3] == [0, 0, 1]  # the burst ended by the hold at step 1
    assert all(rows[step] == model.trained_in[step] for step in rows)
    assert set(rows) == switch_steps(model.trained_in)


def test_the_same_cycle_resumed_with_a_hold_at_the_fit_start_logs_no_stale_row_at_its_first_step(tmp_path):
    # a review of 18302e0: the first fit's last step, off the cadence and ending no phase, kept its row due,
    # and a hold at the resumed fit's start wrote it at that fit's first step: a burst row beside the replay
    # row of the step that trained there
    cycle = PulseCycle(burst=3, replay=2, maintain=1, warmup=0, anneal=0, maintain_eval="none")
    saves = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    first, _ = fit_logging_phases(50, tmp_path, steps=8, cycle=cycle, after=[saves])
    assert [phase for phase, _ in first.trained_in][-2:] == [0, 0]  # it ends inside the second burst
    model, rows = fit_logging_phases(
        50, tmp_path, steps=11, cycle=cycle, after=[HoldsLightAtStart()], ckpt_path=tmp_path / "last.ckpt"
    )
    assert model.trained_in == [(1, 1), (1, 1), (2, 1)]  # the hold ended the burst before step 8
    assert rows == dict(zip(range(8, 11), model.trained_in))


def test_a_skipped_step_is_counted_in_the_row_of_the_loss_it_skipped(mnist1d_small, tmp_path):
    # values, not only steps: the guard's row after a skipped step gives the count that step raised, where
    # Lightning writes the NaN loss of the batch it skipped (not one step early or late)
    model, data = mnist1d_small(arch="mlp")
    logger = RecordingLogger()
    guard = StabilityGuard()
    trainer = pl.Trainer(
        callbacks=[FaultInjector("nan", start=6), guard],
        **trainer_kwargs(logger=logger, max_steps=10, log_every_n_steps=1, limit_val_batches=0),
    )
    trainer.fit(model, data)
    assert [event["step"] for event in guard.events] == [6]
    nan_losses = [step for step, loss in logger.logged("train_loss") if math.isnan(loss)]
    skipped = logger.logged("stability/steps_skipped")
    assert nan_losses == [6]
    assert skipped[0] == (6, 1.0)  # the first row, at the skipped step; the fit's summary at the last
    assert skipped[-1] == (9, 1.0)


class TwoOptimizersHC(pl.LightningModule):
    """Manual optimization of two optimizers on a hyper-connection net: two optimizer steps a batch."""

    def __init__(self) -> None:
        from tests.test_mhc_monitor import TwoLayerNet

        super().__init__()
        self.net = TwoLayerNet()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        x, y = batch
        loss = (self.net(x) - y).pow(2).mean()
        self.log("train_loss", loss)
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.step()

    def configure_optimizers(self):
        parameters = list(self.net.parameters())
        half = len(parameters) // 2
        return [torch.optim.SGD(parameters[:half], lr=0.1), torch.optim.SGD(parameters[half:], lr=0.1)]


def test_hyper_connection_figures_sit_with_the_loss_of_the_batch_they_measured_with_two_optimizers(tmp_path):
    # a review: the monitor logged at global_step, which counts both optimizers' steps (0, 4, 8 for batches 0,
    # 2, 4), where the loss sits at the batch count
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(48, 5, 16, generator=generator), torch.randn(48, 5, 16, generator=generator)
    )
    logger = RecordingLogger()
    trainer = pl.Trainer(
        callbacks=[HyperConnectionMonitor(every_n_steps=4)],
        **trainer_kwargs(logger=logger, max_epochs=1, log_every_n_steps=1, default_root_dir=tmp_path),
    )
    trainer.fit(TwoOptimizersHC(), DataLoader(data, batch_size=8))
    measured = [step for step, metrics in logger.rows if any(key.startswith("mhc/") for key in metrics)]
    assert measured == [0, 2, 4]  # global_step 0, 4, 8: batches 0, 2 and 4
    assert set(measured) <= {step for step, _ in logger.logged("train_loss")}


def test_gradient_cache_rows_share_the_steps_lightning_logs_at(mnist1d_small, tmp_path):
    # a review: its regular rows were due on global_step % n before the step (0, 5, 10), the loss's after it
    model, data = mnist1d_small()
    logger = RecordingLogger()
    trainer = pl.Trainer(
        callbacks=[GradientCache()],
        **trainer_kwargs(logger=logger, max_steps=12, log_every_n_steps=5, default_root_dir=tmp_path),
    )
    trainer.fit(model, data)
    rows = [
        step for step, metrics in logger.rows if any(key.startswith("gradient_cache/") for key in metrics)
    ]
    assert [step for step, _ in logger.logged("train_loss")] == [4, 9]
    assert rows and set(rows) <= {4, 9, 11}  # 11: the epoch's last window, closed where its rates are due


class StopsAtTrainStart(Callback):
    """Stops the fit before its first batch (GreenWindow's suspend loop does when a resume is still dirty)."""

    def on_train_start(self, trainer, pl_module):
        trainer.should_stop = True


def test_a_resumed_fit_that_trains_nothing_logs_its_summary_at_the_last_step_not_before_it(
    mnist1d_small, tmp_path
):
    # a review: Lightning's count still held the checkpoint's value, so taking one off put the resumed fit's
    # summary a step behind the first fit's
    def fit(max_steps: int, ckpt_path=None, extra=()) -> RecordingLogger:
        model, data = mnist1d_small(arch="mlp")
        logger = RecordingLogger()
        checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=9, save_top_k=-1)
        callbacks = [
            EnergyLogger(country_iso_code="DEU", report_dir=str(tmp_path / "energy")),
            checkpoint,
            *extra,
        ]
        kwargs = trainer_kwargs(
            logger=logger, max_steps=max_steps, log_every_n_steps=1, enable_checkpointing=True
        )
        pl.Trainer(callbacks=callbacks, limit_val_batches=0, default_root_dir=tmp_path, **kwargs).fit(
            model, data, ckpt_path=ckpt_path
        )
        return logger

    first = fit(9)
    saved = next((tmp_path / "ckpt").glob("*.ckpt"))
    resumed = fit(24, saved, [StopsAtTrainStart()])
    last_loss = first.logged("train_loss")[-1][0]
    assert [step for step, _ in first.logged("energy/final_kwh")] == [last_loss]
    assert [step for step, _ in resumed.logged("energy/final_kwh")] == [last_loss]


def fit_with_every_logging_callback(every: int, mnist1d_small, tmp_path) -> RecordingLogger:
    """Two 12-step epochs of PulseCycle, HardSampleReplay, GradientCache and EnergyLogger (a constant meter:
    the same rows in every fit) under ``Trainer(log_every_n_steps=every)``."""
    pl.seed_everything(0)
    model, data = mnist1d_small(arch="mlp")
    logger = RecordingLogger()
    callbacks = [
        PulseCycle(burst=3, replay=2, maintain=1, warmup=0, anneal=0, maintain_eval="none"),
        HardSampleReplay(mode="batch", replay_fraction=0.5),
        GradientCache(threshold=2.0, check_every=5, freeze_for=20),
        EnergyLogger(cpu="constant", ram="none", gpu="none", meters=MeterConfig(cpu_watts=20.0)),
    ]
    options = trainer_kwargs(logger=logger, max_epochs=2, log_every_n_steps=every, default_root_dir=tmp_path)
    pl.Trainer(callbacks=callbacks, limit_train_batches=12, limit_val_batches=1, **options).fit(model, data)
    return logger


def callback_rows(logger: RecordingLogger, prefixes: tuple[str, ...]) -> set[tuple[int, str]]:
    return {(step, key) for step, row in logger.rows for key in row if key.startswith(prefixes)}


def test_log_every_n_steps_zero_gives_no_step_level_rows_and_keeps_the_event_rows(mnist1d_small, tmp_path):
    # sweep-loggers 4: Lightning's `log_every_n_steps=0` (no step-level logging) was read as 1: PulseCycle,
    # HardSampleReplay, GradientCache and EnergyLogger logged at each of the 24 steps
    off = fit_with_every_logging_callback(0, mnist1d_small, tmp_path / "off")
    assert off.logged("train_loss") == []  # Lightning's own: none
    # the rows that are not on the cadence (phase boundaries, the checks, the epochs', cycles' and fit's ends)
    # are those of a cadence longer than the run
    beyond = fit_with_every_logging_callback(1000, mnist1d_small, tmp_path / "beyond")
    prefixes = ("pulse/", "gradient_cache/", "energy/")
    assert callback_rows(off, prefixes) == callback_rows(beyond, prefixes)
    pulse_steps = {step for step, _ in callback_rows(off, ("pulse/",))}
    assert pulse_steps == {0, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 14, 15, 16, 17, 18, 20, 21, 22, 23}
    keys = {key for _, key in callback_rows(off, prefixes)}
    assert {"energy/epoch_kwh", "energy/cycle_kwh", "gradient_cache/frozen_share"} <= keys  # events: kept
    assert not keys & {"energy/power_w", "energy/kwh_so_far"}  # step figures only
    # HardSampleReplay's window, logged every `log_every_n_steps` applied steps, comes at the epochs' ends
    replay = {step for step, _ in callback_rows(off, ("hard_sample_replay/",))}
    assert replay == {11, 23}


def test_the_phase_and_cycle_in_progress_at_the_fits_end_are_logged_at_its_last_step(tmp_path):
    # sweep-loggers 6: the phase in progress when training ended never reached the logger (the logged
    # `pulse/<phase>_steps` summed to 22 of 26 steps), nor did that cycle's `energy/cycle_*`
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(256, 16, generator=generator), torch.randint(0, 4, (256,), generator=generator)
    )
    logger = RecordingLogger()
    cycle = PulseCycle(burst=6, replay=3, maintain=2, warmup=0, anneal=0, maintain_eval="none")
    energy = EnergyLogger(cpu="constant", ram="none", gpu="none", meters=MeterConfig(cpu_watts=20.0))
    options = trainer_kwargs(logger=logger, max_steps=26, log_every_n_steps=5, default_root_dir=tmp_path)
    pl.Trainer(callbacks=[cycle, energy], **options).fit(LogsItsPhase(), DataLoader(data, batch_size=16))

    logged = {phase: 0.0 for phase in cycle.clock.steps_by_phase}
    for _, row in logger.rows:
        for phase in logged:
            logged[phase] += row.get(f"pulse/{phase}_steps", 0.0)
    assert logged == {"burst": 16, "replay": 6, "maintain": 4} == cycle.clock.steps_by_phase
    assert logger.logged("pulse/burst_steps")[-1] == (25, 4.0)  # the third burst's 4 steps, at the last step
    # every cycle of the report, the one training ended in too (steps 22-25), at its last step
    cycles = {int(value): step for step, value in logger.logged("energy/cycle")}
    assert cycles == {0: 10, 1: 21, 2: 25}
    report = energy.report["cycles"]
    assert [row["steps"] for row in report.values()] == [11, 11, 4]
    for (_, kwh), row in zip(logger.logged("energy/cycle_kwh"), report.values(), strict=True):
        assert kwh == pytest.approx(row["energy_kwh"], rel=1e-9)
