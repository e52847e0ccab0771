"""codecarbon's background start beside DataLoader workers, and a start that never finishes."""

from __future__ import annotations

import multiprocessing.context
import os
import threading
import time
import warnings

import lightning.pytorch as pl
import pytest
from torch.utils.data import DataLoader

from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
from lightning_pulse.callbacks.energy_logger import EnergyLogger
from lightning_pulse.energy import sampler as sampler_module
from lightning_pulse.energy.codecarbon_meter import START_THREAD_NAME
from lightning_pulse.energy.constant import ConstantPowerMeter, codecarbon_default_cpu_watts
from lightning_pulse.energy.ledger import EnergyLedger
from lightning_pulse.energy.meter import ESTIMATED, NONE, MeterChain
from lightning_pulse.energy.sampler import STARTING_GRACE_S, EnergySampler
from tests.conftest import RecordingLogger, trainer_kwargs


def train_loader(**loader_kwargs) -> DataLoader:
    data = MNIST1DDataModule(num_samples=1000, batch_size=64)
    data.prepare_data()
    data.setup()
    return DataLoader(data.train_set, batch_size=64, shuffle=True, **loader_kwargs)


def energy_warnings(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("EnergyLogger:")]


def start_thread() -> threading.Thread | None:
    return next((t for t in threading.enumerate() if t.name == START_THREAD_NAME), None)


def test_dataloader_workers_forked_while_codecarbon_starts_do_not_hang_its_start(tmp_path, monkeypatch):
    """Sweep 31: with the default meters and `num_workers=2, persistent_workers=True`, about half the fits
    waited 60 s and reported 0.0 kWh "estimated": the workers were forked while codecarbon's start thread was
    spawning a subprocess (`platform.processor()` -> `uname -p`), inherited the spawn's pipe, and its read
    returned only when they exited. Here the start holds such a pipe open exactly while the workers fork (a
    subprocess being spawned, made deterministic); the fork now waits for the start instead."""
    from codecarbon import OfflineEmissionsTracker

    about_to_fork, forked = threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    class WatchedForkProcess(multiprocessing.context.ForkProcess):
        def start(self) -> None:
            about_to_fork.set()
            super().start()
            forked.set()

    class WatchedFork(multiprocessing.context.ForkContext):
        Process = WatchedForkProcess

    original = OfflineEmissionsTracker.start

    def start_while_a_spawn_is_open(tracker):
        read_end, write_end = os.pipe()  # close-on-exec, like subprocess's pipes: only a plain fork keeps it
        try:
            about_to_fork.wait(timeout=20.0)
            forked.wait(timeout=1.0)  # a fork that does not wait for the start lands inside the spawn here
            seen["forked_inside_the_spawn"] = forked.is_set()
        finally:
            os.close(write_end)
        os.read(read_end, 1)  # like subprocess: EOF only once every copy of the write end is closed
        os.close(read_end)
        original(tracker)

    monkeypatch.setattr(OfflineEmissionsTracker, "start", start_while_a_spawn_is_open)
    loader = train_loader(num_workers=2, persistent_workers=True, multiprocessing_context=WatchedFork())
    energy = EnergyLogger(cpu="codecarbon")
    trainer = pl.Trainer(
        callbacks=[energy], **trainer_kwargs(max_epochs=2, limit_val_batches=0, default_root_dir=tmp_path)
    )
    began = time.perf_counter()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(MNIST1DClassifier(arch="mlp"), train_dataloaders=loader)
    wall = time.perf_counter() - began

    assert seen == {"forked_inside_the_spawn": False}  # the workers were forked once the start had ended
    assert wall < 15.0, wall  # not the 30 s epoch-end wait for a hung start, nor the 60 s release wait
    report = energy.report
    assert (
        report["meters"]["cpu"]["meter"] == "codecarbon" and report["meters"]["ram"]["meter"] == "codecarbon"
    )
    assert report["meters"]["cpu"]["fallbacks"] == [] and report["meters"]["ram"]["fallbacks"] == []
    assert report["total"]["energy_kwh"] > 0 and report["total"]["energy_method"] == ESTIMATED
    assert energy_warnings(record) == []
    assert start_thread() is None


def test_a_codecarbon_start_that_never_finishes_falls_back_to_an_estimate_over_the_whole_fit(
    tmp_path, monkeypatch
):
    """Sweep 31: a codecarbon start that never finished made the first epoch end wait 30 s, the meters'
    release 60 s more, and the run reported 0.0 kWh labelled "estimated" (its zero point, read once the wait
    was over). The start is now given up after the wait: the CPU falls back to codecarbon's generic-CPU power
    from the start on (one warning), RAM has no figure (null, not 0), and the held thread, once it ends,
    stops the tracker it built."""
    from codecarbon import OfflineEmissionsTracker

    release = threading.Event()
    original = OfflineEmissionsTracker.start

    def never_starts(tracker):  # the one fake: a start stuck as it was beside forked workers
        release.wait(timeout=60.0)
        original(tracker)

    monkeypatch.setattr(OfflineEmissionsTracker, "start", never_starts)
    monkeypatch.setattr(sampler_module, "STARTING_WAIT_S", 0.5)
    logger = RecordingLogger()
    energy = EnergyLogger(cpu="codecarbon")
    options = trainer_kwargs(
        max_epochs=2, limit_train_batches=6, limit_val_batches=0, logger=logger, default_root_dir=tmp_path
    )
    trainer = pl.Trainer(callbacks=[energy], log_every_n_steps=1, **options)
    began = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer.fit(MNIST1DClassifier(arch="mlp"), train_dataloaders=train_loader())
        wall = time.perf_counter() - began
        held = start_thread()
        assert held is not None and held.is_alive()  # still stuck: nothing waited for it beyond 0.5 s
    finally:
        release.set()
    assert wall < 10.0, wall

    report = energy.report
    cpu = report["meters"]["cpu"]
    assert cpu["meter"] == "codecarbon-default"
    assert [event["failed"] for event in cpu["fallbacks"]] == ["codecarbon"]
    assert "did not finish within 0.5 s" in cpu["fallbacks"][0]["reason"]
    assert report["total"]["methods"] == {"gpu": NONE, "cpu": ESTIMATED, "ram": NONE}
    assert report["total"]["energy_method"] == ESTIMATED
    # the estimate covers the whole fit, the wait for the start included: 42.5 W over all of it
    watts = codecarbon_default_cpu_watts()[0]
    startup = report["meter_startup"]
    seconds = report["total"]["duration_s"] + startup["duration_s"]
    counted_kwh = (
        report["total"]["energy_kwh_by_component"]["cpu"] + startup["energy_kwh_by_component"]["cpu"]
    )
    assert counted_kwh == pytest.approx(watts * seconds / 3.6e6, rel=0.02)
    assert report["total"]["energy_kwh_by_component"]["ram"] is None
    first_epoch_total = next(row["energy/total_kwh"] for _, row in logger.rows if "energy/total_kwh" in row)
    assert first_epoch_total > 0  # was 0.0 "estimated"
    lines = energy_warnings(record)
    assert len(lines) == 1 and "'codecarbon' failed" in lines[0] and "'codecarbon-default'" in lines[0]

    held.join(timeout=30.0)
    assert not held.is_alive()
    assert not any(isinstance(t, threading.Timer) for t in threading.enumerate())  # its tracker was stopped


def test_the_sampler_gives_up_a_start_past_its_grace_and_counts_the_fallback_from_the_meters_start():
    """The sampling thread's side of the same: past :data:`STARTING_GRACE_S` with no epoch end (a long first
    epoch), the zero point of a meter still starting was recorded as an estimated 0; now its chain falls back
    to the next meter, counted from the starting meter's own start."""

    class NeverStarts(ConstantPowerMeter):
        given_up: list[str] = []

        @property
        def starting(self) -> bool:
            return True

        def read_joules(self, now: float) -> float:
            return 0.0  # its zero point, all it ever gives

        def give_up_start(self, reason: str) -> None:
            self.given_up.append(reason)

    now = [0.0]
    warned: list[str] = []
    never = NeverStarts("cpu", 99.0)
    factories = [("background", lambda: never), ("constant", lambda: ConstantPowerMeter("cpu", 30.0))]
    chain = MeterChain("cpu", factories, warn=warned.append)
    ledger = EnergyLedger()
    sampler = EnergySampler([chain], ledger, period=1.0, clock=lambda: now[0], wall_clock=lambda: now[0])
    sampler.start(thread=False)
    now[0] = STARTING_GRACE_S - 1.0
    sampler.sample()
    assert sampler.samples == 0  # within the grace: no reading
    now[0] = STARTING_GRACE_S + 1.0
    sampler.sample()
    assert ledger.totals_j["cpu"] == pytest.approx(30.0 * (STARTING_GRACE_S + 1.0))
    assert ledger.methods["cpu"] == ESTIMATED and chain.meter_name == "constant"
    assert never.given_up == [f"its background start did not finish within {STARTING_GRACE_S:g} s"]
    assert len(warned) == 1 and "falling back to 'constant'" in warned[0]
