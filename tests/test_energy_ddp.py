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
from lightning.pytorch.callbacks import Callback, EarlyStopping

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
