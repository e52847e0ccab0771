"""EnergyLogger under two-process DDP: the monitored total at every epoch end while codecarbon is still
starting, and codecarbon's process mode, which one tracker on local rank 0 counts only for its own process
tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint

from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
from lightning_pulse.callbacks.energy_logger import EnergyLogger
from lightning_pulse.energy.config import MeterConfig
from lightning_pulse.energy.meter import ESTIMATED
from tests.conftest import trainer_kwargs
from tests.ddp_workers import TwoGlooProcesses

REPO = Path(__file__).resolve().parents[1]


def ddp_trainer(tmp_path, callbacks, **kwargs) -> pl.Trainer:
    options = trainer_kwargs(
        devices=2, strategy=TwoGlooProcesses(), default_root_dir=str(tmp_path), limit_val_batches=0
    )
    options.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **options)


class HoldCodecarbonStartInRank(Callback):
    """In each rank: codecarbon's tracker start (on EnergyLogger's start thread) waits until the first
    training epoch has ended, so that epoch ends while the meter is still starting, whatever the machine's
    speed. The real start runs then. Listed before the EnergyLogger: its epoch end releases it first."""

    def setup(self, trainer, pl_module, stage):
        from codecarbon import OfflineEmissionsTracker

        self.release = threading.Event()
        original, release = OfflineEmissionsTracker.start, self.release

        def held_start(tracker):
            release.wait(timeout=20.0)
            original(tracker)

        OfflineEmissionsTracker.start = held_start  # this rank's process only; it ends with the fit

    def on_train_epoch_end(self, trainer, pl_module):
        self.release.set()


class TotalAtEpochEnds(Callback):
    """Writes ``[(epoch, energy/total_kwh or None)]`` of each epoch end to ``<directory>/rank<r>.json``, read
    after the EnergyLogger's epoch end and before EarlyStopping's."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.rows: list[tuple[int, float | None]] = []

    def on_train_epoch_end(self, trainer, pl_module):
        value = trainer.callback_metrics.get("energy/total_kwh")
        self.rows.append((trainer.current_epoch, None if value is None else float(value)))
        Path(self.directory, f"rank{trainer.global_rank}.json").write_text(json.dumps(self.rows))


@pytest.mark.ddp
def test_monitored_total_exists_at_every_epoch_end_under_ddp_while_codecarbon_starts(tmp_path):
    """Sweep C: under DDP `energy/total_kwh` was missing until codecarbon's first reading (the epoch end
    waited for a starting meter in one process only), so EarlyStopping on it raised at the first epoch end.
    Now every rank waits for it together, outside the run's figures, as one process does."""
    energy = EnergyLogger(country_iso_code="DEU", cpu="codecarbon", ram="none", report_dir=str(tmp_path))
    stop = EarlyStopping(monitor="energy/total_kwh", mode="max", patience=100, check_on_train_epoch_end=True)
    recorder = TotalAtEpochEnds(str(tmp_path))
    fit = ddp_trainer(
        tmp_path, [HoldCodecarbonStartInRank(), energy, recorder, stop], max_epochs=2, limit_train_batches=2
    )
    fit.fit(MNIST1DClassifier(arch="mlp"), MNIST1DDataModule(num_samples=1000, batch_size=20))
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert [epoch for epoch, _ in rank0] == [0, 1]
    assert all(total is not None and total > 0 for _, total in rank0)  # from the first epoch end on
    assert rank1 == rank0  # the same figure on every rank: combined over ranks
    report = json.loads((tmp_path / "energy_report.json").read_text())
    assert report["total"]["methods"]["cpu"] == ESTIMATED
    assert report["meter_startup"]["duration_s"] > 0  # the wait is booked outside the run's total
    assert report["meters"]["cpu"]["counted_on"] == "local rank 0 of each node"  # machine mode: not refused


class HoldCodecarbonUntilWaitedFor(Callback):
    """In each rank: codecarbon's tracker start waits until EnergyLogger waits for it (its sampler's
    ``settle``), at the latest until the first training epoch's end, so a read-out that does not wait for a
    starting meter finds no reading, whatever the machine's speed."""

    def setup(self, trainer, pl_module, stage):
        from codecarbon import OfflineEmissionsTracker

        from lightning_pulse.energy.sampler import EnergySampler

        release = self.release = threading.Event()
        start, settle = OfflineEmissionsTracker.start, EnergySampler.settle

        def held_start(tracker):
            release.wait(timeout=20.0)
            start(tracker)

        def settle_releasing_the_start(sampler, timeout=None):
            release.set()
            settle(sampler, timeout)

        OfflineEmissionsTracker.start = held_start  # this rank's process only; it ends with the fit
        EnergySampler.settle = settle_releasing_the_start

    def on_train_epoch_end(self, trainer, pl_module):
        self.release.set()


class TotalWhereMonitorsRead(Callback):
    """Writes ``[(global_step, where, energy/total_kwh or None)]`` of each validation end (listed before the
    EnergyLogger and an EarlyStopping) and of each batch end at a step a checkpoint saving every 3 steps saves
    at (after the EnergyLogger's, before the checkpoint's) to ``<directory>/rank<r>.json``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.rows: list[tuple[int, str, float | None]] = []

    def _record(self, trainer, where: str) -> None:
        value = trainer.callback_metrics.get("energy/total_kwh")
        self.rows.append((trainer.global_step, where, None if value is None else float(value)))
        Path(self.directory, f"rank{trainer.global_rank}.json").write_text(json.dumps(self.rows))

    def on_validation_end(self, trainer, pl_module):
        self._record(trainer, "validation")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % 3 == 0:
            self._record(trainer, "step")


@pytest.mark.ddp
def test_monitored_total_exists_at_validations_and_step_saves_inside_the_first_epoch_under_ddp(tmp_path):
    """Sweep 41: EarlyStopping / ModelCheckpoint checking `energy/total_kwh` at a validation inside the first
    epoch crashed the fit (the total came at epoch ends only), and a step-saving ModelCheckpoint skipped its
    saves. Under DDP the running total is read on every rank at the same points (it gathers), after every
    rank waited, together, for a meter still starting (codecarbon, here until something waits for it)."""
    energy = EnergyLogger(country_iso_code="DEU", cpu="codecarbon", ram="none", report_dir=str(tmp_path))
    stop = EarlyStopping(monitor="energy/total_kwh", mode="max", patience=100)
    saves = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", monitor="energy/total_kwh", every_n_train_steps=3, save_top_k=-1
    )
    recorder = TotalWhereMonitorsRead(str(tmp_path))
    fit = ddp_trainer(
        tmp_path,
        [HoldCodecarbonUntilWaitedFor(), recorder, stop, energy, saves],
        max_epochs=2,
        limit_train_batches=4,
        val_check_interval=2,
        limit_val_batches=1,
        enable_checkpointing=True,
    )
    fit.fit(MNIST1DClassifier(arch="mlp"), MNIST1DDataModule(num_samples=1000, batch_size=20))
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    where = [(step, kind) for step, kind, _ in rank0]
    assert where == [(2, "validation"), (3, "step"), (4, "validation"), (6, "step"), (6, "validation")] + [
        (8, "validation")
    ]
    totals = [total for _, _, total in rank0]
    assert all(total is not None and total > 0 for total in totals)  # from the first validation on
    assert totals == sorted(totals)
    assert rank1 == rank0  # the same figure on every rank: combined over ranks
    assert sorted(path.name for path in (tmp_path / "ckpt").iterdir()) == [
        "epoch=0-step=3.ckpt",
        "epoch=1-step=6.ckpt",
    ]
    report = json.loads((tmp_path / "energy_report.json").read_text())
    assert report["meter_startup"]["duration_s"] > 0  # the wait, at the first validation, outside the total
    assert report["meters"]["cpu"]["fallbacks"] == []


@pytest.mark.ddp
def test_process_tracking_is_refused_where_a_rank_runs_outside_local_rank_zeros_processes(tmp_path):
    """Sweep C: with `codecarbon_tracking_mode="process"` under DDP, CPU and RAM were metered by local rank
    0's tracker, which follows its own process and its children only: ranks launched as its siblings
    (ddp_spawn, torchrun, here a fork server) were silently missing, about half the CPU energy. Refused at fit
    start."""
    energy = EnergyLogger(
        country_iso_code="DEU", ram="none", meters=MeterConfig(codecarbon_tracking_mode="process")
    )
    fit = ddp_trainer(tmp_path, [energy], max_epochs=1, limit_train_batches=2)
    with pytest.raises(
        Exception, match=r"EnergyLogger: `meters.codecarbon_tracking_mode`='process' under DDP"
    ) as info:
        fit.fit(MNIST1DClassifier(arch="mlp"), MNIST1DDataModule(num_samples=1000, batch_size=20))
    message = str(info.value)
    assert "PulseRefusal" in message and "rank(s) [1]" in message
    assert "'machine'" in message  # the way out
    assert not (tmp_path / "energy_report.json").exists()


def test_ranks_outside_local_rank_zeros_process_tree_are_found():
    from lightning_pulse.energy.account import ANCESTRY_DEPTH, ranks_outside_local_zero

    def row(node, local, pid, *parents):
        return [node, local, pid, *parents, *[-1] * (ANCESTRY_DEPTH - len(parents))]

    # Lightning's strategy="ddp" from a script: rank 1 is rank 0's child (its data-loader workers below it)
    assert ranks_outside_local_zero(np.array([row(0, 0, 100, 1), row(0, 1, 200, 100, 1)], float)) == []
    # ddp_spawn, torchrun: siblings under a launcher
    assert ranks_outside_local_zero(np.array([row(0, 0, 100, 50, 1), row(0, 1, 101, 50, 1)], float)) == [1]
    # two nodes, each rank 1 a child of its own node's rank 0 (pids repeat across nodes)
    rows = [row(0, 0, 100, 1), row(0, 1, 200, 100), row(1, 0, 100, 1), row(1, 1, 300, 7)]
    assert ranks_outside_local_zero(np.array(rows, float)) == [3]
    # a rank whose parents are unknown reads as outside (refused, not guessed)
    assert ranks_outside_local_zero(np.array([row(0, 0, 100, 1), row(0, 1, 200)], float)) == [1]


def test_a_child_process_names_its_parent_in_its_process_row():
    """The ancestry the check reads, from a real child process (as `strategy="ddp"` starts rank 1)."""
    from lightning_pulse.energy.account import process_row, ranks_outside_local_zero

    code = "from lightning_pulse.energy.account import process_row; print(process_row(0, 1).tolist())"
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    output = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=environment, cwd=REPO
    ).stdout
    child = json.loads(output.strip().splitlines()[-1])
    parent = process_row(0, 0).tolist()
    assert child[2] != os.getpid() and child[3] == os.getpid()
    assert ranks_outside_local_zero(np.array([parent, child])) == []
