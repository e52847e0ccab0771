"""What the callbacks send to the Trainer's loggers: a failing logger never ends the run, no name is a path
prefix of another, and what the module keeps out of the loggers stays out."""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import (
    EnergyLogger,
    GradientCache,
    GreenWindow,
    GreenWindowOptions,
    HardSampleReplay,
    HyperConnectionMonitor,
    PulseCycle,
    ScheduledPrune,
    SimulatedClock,
    StabilityGuard,
    StabilityGuardError,
)
from lightning_pulse.callbacks.simulated_step_time import SimulatedStepTime
from lightning_pulse.energy import MeterConfig
from lightning_pulse.nn import ManifoldHyperConnection, collapse_streams, expand_streams
from tests.conftest import RecordingLogger, trainer_kwargs

DE_JUNE = str(
    Path(__file__).resolve().parents[1] / "examples" / "data" / "carbon" / "de_2020_june_excerpt.csv"
)


class FailingLogger(Logger):
    """A logger whose tracking server is out of reach: every ``log_metrics`` raises."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    @property
    def name(self) -> str:
        return "failing"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        self.calls += 1
        raise ConnectionError("tracking server unreachable")

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


class StreamsClassifier(pl.LightningModule):
    """Two mHC residual layers (``lightning_pulse.nn``) over one token; logs nothing in training (so Lightning
    itself never calls a logger), and in validation (here only the probes' ) a loss, and figures kept out of
    the loggers."""

    def __init__(self, nan_from: int | None = None) -> None:
        super().__init__()
        self.nan_from = nan_from
        self.inp, self.out = nn.Linear(16, 16), nn.Linear(16, 4)
        branch = [nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2)]
        self.blocks = nn.ModuleList([ManifoldHyperConnection(b, 16, n_streams=4) for b in branch])
        generator = torch.Generator().manual_seed(0)
        self.data = TensorDataset(
            torch.randn(384, 16, generator=generator), torch.randint(0, 4, (384,), generator=generator)
        )

    def forward(self, x):
        streams = expand_streams(self.inp(x).unsqueeze(1), 4)  # (B, 1, 4, C)
        for block in self.blocks:
            streams = block(streams)
        return self.out(collapse_streams(streams).squeeze(1))

    def training_step(self, batch, batch_idx):
        loss = nn.functional.cross_entropy(self(batch[0]), batch[1])
        if self.nan_from is not None and self.global_step >= self.nan_from:
            return loss * float("nan")
        return loss

    def validation_step(self, batch, batch_idx):
        loss = nn.functional.cross_entropy(self(batch[0]), batch[1])
        self.log("val_loss", loss)
        self.log("val_private", loss * 0 + 42.0, logger=False, prog_bar=True)
        self.log_dict({"val_bar_only": loss * 0 + 7.0}, logger=False)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=96)


def every_logging_callback():
    """One of each callback that logs, HyperConnectionMonitor with its per-layer figures."""
    clock = SimulatedClock("2020-06-19 00:00:00")
    green = GreenWindow(
        signal=DE_JUNE,
        when_dirty="pause",
        max_delay=1.0,
        expected_duration="8h",
        clock=clock,
        options=GreenWindowOptions(watts=300.0),
    )
    meters = MeterConfig(cpu_watts=20.0, sampling_period=0.05)
    return [
        SimulatedStepTime(clock, 600.0),
        green,
        PulseCycle(burst=4, replay=2, maintain=2, warmup=0, anneal=0, probe_batches=1),
        HardSampleReplay(replay_fraction=0.5),
        GradientCache(check_every=4, freeze_for=8, threshold=1.0),
        ScheduledPrune(final_sparsity=0.5, start=2, end=14, probe_batches=1),
        StabilityGuard(warmup=5),
        EnergyLogger(cpu="constant", ram="none", gpu="none", meters=meters, country_iso_code="DEU"),
        HyperConnectionMonitor(every_n_steps=3, per_layer=True),
    ]


@pytest.fixture(scope="module")
def suite_run(tmp_path_factory):
    """One fit of every logging callback, a failing logger listed before a recording one."""
    pl.seed_everything(0, verbose=False)
    failing, recording = FailingLogger(), RecordingLogger()
    callbacks = every_logging_callback()
    trainer = pl.Trainer(
        callbacks=callbacks,
        **trainer_kwargs(
            logger=[failing, recording],
            max_steps=24,
            log_every_n_steps=2,
            limit_val_batches=1,
            check_val_every_n_epoch=100,  # the probes validate; Lightning's validation would log itself
            default_root_dir=tmp_path_factory.mktemp("suite"),
        ),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(StreamsClassifier())
    return trainer, callbacks, failing, recording, [str(warning.message) for warning in caught]


def test_a_logger_that_raises_warns_once_and_every_callback_s_fit_runs_to_its_end(suite_run):
    # a sweep: a logger raising in log_metrics ended the fit through whichever callback logged first (at step
    # 0 to 22), though Lightning itself never called it for a module that logs nothing
    trainer, callbacks, failing, recording, messages = suite_run
    assert trainer.state.status == "finished" and trainer.global_step > 0
    energy = next(callback for callback in callbacks if isinstance(callback, EnergyLogger))
    assert energy.report["status"] == "complete"
    assert failing.calls > 10  # every callback kept trying it
    said = [message for message in messages if "FailingLogger.log_metrics failed" in message]
    assert len(said) == 1
    assert "ConnectionError: tracking server unreachable" in said[0] and "dropped" in said[0]
    # the logger after the failing one still got every callback's figures
    prefixes = {name.split("/")[0] for metrics in recording.metrics for name in metrics if "/" in name}
    assert {"pulse", "energy", "prune", "mhc", "green", "hard_sample_replay"} <= prefixes


def test_no_logged_name_is_a_path_prefix_of_another(suite_run):
    # a sweep: `mhc/off_diagonal_mass` beside `mhc/off_diagonal_mass/layer_00` killed MLflow's file store,
    # which keeps each metric in a file at its name
    names = {name for metrics in suite_run[3].metrics for name in metrics}
    assert sorted((a, b) for a in names for b in names if b.startswith(f"{a}/")) == []
    assert {
        "mhc/off_diagonal_mass",
        "mhc/layer_00/off_diagonal_mass",
        "mhc/layer_01/off_diagonal_mass",
    } <= names


def test_a_value_logged_with_logger_false_stays_out_of_the_loggers_and_in_the_probes(suite_run):
    # a sweep: the probes sent `pulse/probe/val_private` and `prune/val_private_before` to the loggers
    _, callbacks, _, recording, _ = suite_run
    names = {name for metrics in recording.metrics for name in metrics}
    assert "pulse/probe/val_loss" in names and "prune/val_loss_after" in names
    assert not [name for name in names if "val_private" in name or "val_bar_only" in name]
    cycle = next(callback for callback in callbacks if isinstance(callback, PulseCycle))
    prune = next(callback for callback in callbacks if isinstance(callback, ScheduledPrune))
    assert cycle.last_probe["val_private"] == pytest.approx(42.0)
    assert prune.events[0]["probe_after"]["val_bar_only"] == pytest.approx(7.0)


def test_a_stability_guard_stop_with_a_failing_logger_writes_its_checkpoint_and_raises_its_error(tmp_path):
    # a sweep: the stop logged before it saved, so a failing logger's error replaced StabilityGuardError and
    # no checkpoint was written
    pl.seed_everything(0, verbose=False)
    guard = StabilityGuard(
        warmup=5,
        rollback_after=1,
        max_rollbacks=1,
        snapshot_every=5,
        rollback_margin=5,
        skip_after_rollback=0,
    )
    trainer = pl.Trainer(
        callbacks=[guard],
        **trainer_kwargs(
            logger=FailingLogger(), max_steps=30, limit_val_batches=0, default_root_dir=tmp_path
        ),
    )
    with pytest.warns(UserWarning, match="FailingLogger.log_metrics failed"):
        with pytest.raises(StabilityGuardError, match="StabilityGuard stopped training") as stopped:
            trainer.fit(StreamsClassifier(nan_from=12))
    assert stopped.value.checkpoint_path is not None and Path(stopped.value.checkpoint_path).is_file()


class _Interrupted(BaseException):
    """Not an ``Exception``: a logger raising it is not skipped, it propagates (as a Ctrl-C would)."""


class _InterruptsAtTheStop(FailingLogger):
    """Works until the guard's stop is logged (a call from its rollback, which logs only at a stop), then
    raises."""

    def log_metrics(self, metrics, step=None) -> None:
        if any(frame.function == "_roll_back" for frame in inspect.stack()):
            raise _Interrupted("the stop's log call")


def test_a_stability_guard_stop_writes_its_checkpoint_before_it_logs(tmp_path):
    """Review of the 39th pass: the order alone, with a logger whose failure is not skipped."""
    pl.seed_everything(0, verbose=False)
    guard = StabilityGuard(
        warmup=5,
        rollback_after=1,
        max_rollbacks=1,
        snapshot_every=5,
        rollback_margin=5,
        skip_after_rollback=0,
    )
    kwargs = trainer_kwargs(logger=_InterruptsAtTheStop(), max_steps=30, limit_val_batches=0)
    trainer = pl.Trainer(callbacks=[guard], **{**kwargs, "default_root_dir": tmp_path})
    with pytest.raises(_Interrupted):
        trainer.fit(StreamsClassifier(nan_from=12))
    assert len(list(Path(tmp_path).rglob("stopped-step=*.ckpt"))) == 1
