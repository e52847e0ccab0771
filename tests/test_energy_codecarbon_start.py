"""codecarbon's background start beside DataLoader workers, and a start that never finishes."""

from __future__ import annotations

import multiprocessing.context
import os
import signal
import sys
import threading
import time
import warnings

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
from lightning_pulse import PulseCycle
from lightning_pulse.callbacks.energy_logger import EnergyLogger
from lightning_pulse.energy import sampler as sampler_module
from lightning_pulse.energy.codecarbon_meter import START_THREAD_NAME, CodecarbonSession
from lightning_pulse.energy.config import MeterConfig
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


def test_a_validation_inside_the_first_epoch_waits_for_codecarbons_start_so_the_monitored_total_exists(
    tmp_path, monkeypatch
):
    """Sweep 41: the running total published at a validation inside the first epoch (where EarlyStopping
    checks it under `val_check_interval`) waits for a meter still starting, as an epoch end does: codecarbon
    has no reading before its start ends, and a read-out that did not wait gave no figure (EarlyStopping: "not
    available"). Here the start ends only once something waits for it (made deterministic), so the figure at
    the first validation exists only through that wait, which is booked outside the run's total."""
    from codecarbon import OfflineEmissionsTracker
    from lightning.pytorch.callbacks import EarlyStopping

    release = threading.Event()
    original_start, original_settle = OfflineEmissionsTracker.start, EnergySampler.settle

    def held_start(tracker):
        release.wait(timeout=20.0)
        original_start(tracker)

    def settle_releases_the_start(sampler, timeout=None):
        release.set()
        original_settle(sampler, timeout)

    class TotalAtValidationEnds(Callback):  # listed first: its validation end runs before EarlyStopping's
        rows: list[tuple[int, float | None]] = []

        def on_validation_end(self, trainer, pl_module):
            value = trainer.callback_metrics.get("energy/total_kwh")
            self.rows.append((trainer.global_step, None if value is None else float(value)))

    monkeypatch.setattr(OfflineEmissionsTracker, "start", held_start)
    monkeypatch.setattr(EnergySampler, "settle", settle_releases_the_start)
    data = MNIST1DDataModule(num_samples=1000, batch_size=64)
    energy, recorder = EnergyLogger(cpu="codecarbon", ram="none"), TotalAtValidationEnds()
    stop = EarlyStopping(monitor="energy/total_kwh", mode="max", patience=100)
    options = trainer_kwargs(
        max_epochs=1, limit_train_batches=6, limit_val_batches=1, default_root_dir=tmp_path
    )
    trainer = pl.Trainer(callbacks=[recorder, stop, energy], val_check_interval=3, **options)
    try:
        trainer.fit(MNIST1DClassifier(arch="mlp"), data)
    finally:
        release.set()

    assert [step for step, _ in recorder.rows] == [3, 6]
    assert all(total is not None and total > 0 for _, total in recorder.rows)
    report = energy.report
    assert report["meters"]["cpu"]["meter"] == "codecarbon" and report["meters"]["cpu"]["fallbacks"] == []
    assert report["meter_startup"]["duration_s"] > 0  # the wait, outside the run's total


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


class ProcessModeStartSeesNoTick(Callback):
    """Holds codecarbon's tracker start until ``release_at`` batches have trained, then holds training
    until it has started (so the start-up gap holds training, and so do the intervals after it), and makes
    codecarbon's start-up measurement see no tick of the process's CPU time, as it does intermittently on its
    own: in ``"process"`` mode it reads the process's CPU times (10 ms ticks) at its start and measures a
    millisecond or two later, then reads exactly 0 W. The one fake: that measurement's CPU times repeat the
    start's."""

    def __init__(self, monkeypatch, release_at: int) -> None:
        from codecarbon import OfflineEmissionsTracker
        from codecarbon.external.hardware import CPU

        self.release, self.started = threading.Event(), threading.Event()
        self.release_at = release_at
        self.requested_at = self.started_at = 0.0
        self.session = None
        self.powers: list[float] = []  # codecarbon's CPU powers (W), as it measured them
        start, cpu_start = OfflineEmissionsTracker.start, CPU.start
        cpu_times, cpu_power = CPU._get_process_cpu_times, CPU._get_power_from_cpu_load

        def held_start(tracker):
            self.release.wait(timeout=20.0)
            start(tracker)
            self.started_at = time.perf_counter()
            self.started.set()

        def primed_start(cpu):
            cpu_start(cpu)
            cpu.no_tick_next = True

        def times_without_a_tick(cpu):
            if getattr(cpu, "no_tick_next", False):
                cpu.no_tick_next = False
                return dict(cpu._last_cpu_times)  # the start's own reading
            return cpu_times(cpu)

        def recorded_power(cpu):
            power = cpu_power(cpu)
            self.powers.append(power.W)
            return power

        monkeypatch.setattr(OfflineEmissionsTracker, "start", held_start)
        monkeypatch.setattr(CPU, "start", primed_start)
        monkeypatch.setattr(CPU, "_get_process_cpu_times", times_without_a_tick)
        monkeypatch.setattr(CPU, "_get_power_from_cpu_load", recorded_power)

    def on_fit_start(self, trainer, pl_module):  # listed before EnergyLogger: just before its request
        self.requested_at = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx + 1 == self.release_at:
            self.release.set()
            self.started.wait(timeout=30.0)
            energy = next(c for c in trainer.callbacks if isinstance(c, EnergyLogger))
            self.session = next(c for c in energy.account.chains if c.component == "cpu").meter.session


def test_a_process_mode_start_reading_0_w_counts_its_start_up_gap_at_codecarbons_first_measured_power(
    tmp_path, monkeypatch
):
    """Thirty-ninth pass, left open: in `tracking_mode="process"` codecarbon's start-up measurement can read
    exactly 0 W (it saw no tick of the process's CPU time), and EnergyLogger counted the start-up gap (the
    1.5-3 s of its hardware detection, here training) at that power: 0 J. That power is now taken as not
    measured: the start thread measures again before the tracker is published, and counts the gap at that."""
    held = ProcessModeStartSeesNoTick(monkeypatch, release_at=3)
    energy = EnergyLogger(
        cpu="codecarbon", meters=MeterConfig(sampling_period=0.05, codecarbon_tracking_mode="process")
    )
    options = trainer_kwargs(
        max_epochs=1, limit_train_batches=12, limit_val_batches=0, default_root_dir=tmp_path
    )
    trainer = pl.Trainer(callbacks=[held, energy], **options)
    trainer.fit(MNIST1DClassifier(arch="mlp"), train_dataloaders=train_loader())

    session = held.session
    if not held.powers:
        pytest.skip("codecarbon reads this machine's CPU from RAPL, not from the process's CPU load")
    measured = [watts for watts in held.powers[1:] if watts > 0]
    assert held.powers[0] == 0.0 and measured  # the start read 0 W; the working process read more later
    report = energy.report
    assert report["meters"]["cpu"]["meter"] == "codecarbon"
    assert report["total"]["methods"]["cpu"] == ESTIMATED
    gap_cpu_kwh = session._gap_kwh[0]
    gap_watts = gap_cpu_kwh * 3.6e6 / (held.started_at - held.requested_at)  # over a bound on the gap
    assert min(measured) / 3 <= gap_watts <= max(measured) * 3  # was 0 W
    counted_kwh = report["total"]["energy_kwh_by_component"]["cpu"]
    if report.get("meter_startup"):
        counted_kwh += report["meter_startup"]["energy_kwh_by_component"]["cpu"] or 0.0
    assert counted_kwh >= gap_cpu_kwh


@pytest.fixture(scope="module")
def codecarbon_ran_before() -> None:
    """A process-mode tracker started and stopped before the fit, as an earlier fit of a sweep does: a later
    start's hardware detection is quick, and its tracker is published a fraction of a millisecond after its
    start-up measurement (about 100 ms after it in a process's first start), inside the 50 ms in which
    codecarbon does not measure again."""
    earlier = CodecarbonSession(tracking_mode="process")
    earlier.acquire(time.monotonic(), "cpu")
    earlier.read(time.monotonic())
    earlier.release("cpu")


class BusyBatches(Callback):
    """Training that keeps the CPU busy (the MLP's batches take a millisecond), so that the start-up gap
    holds CPU work on the process's own CPU time."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        began = time.perf_counter()
        while time.perf_counter() - began < self.seconds:
            pass


def cpu_kwh(figures: dict) -> float:
    return figures["energy_kwh_by_component"]["cpu"] or 0.0


def test_a_later_process_mode_start_reading_0_w_spreads_its_start_up_gap_over_the_phases_it_spans(
    tmp_path, monkeypatch, codecarbon_ran_before
):
    """Review of the thirty-ninth pass's fix: that gap waited for codecarbon's first power measured over an
    interval of ours, but in a later start in a process the sampling thread's first reading came within
    codecarbon's 50 ms and booked the whole run so far at 0 W CPU; the gap then landed in the next reading,
    one interval of one phase (0 J over 1.38 s of training, then 0.94 J in 0.044 s, all `replay`). The start
    thread now measures again before it publishes the tracker: the first reading holds the gap, and the ledger
    spreads it by time over the burst and replay phases it spans (without that: replay 0.008-0.02 W, burst
    1.9-5.8 W; with it, about equal)."""
    held = ProcessModeStartSeesNoTick(monkeypatch, release_at=8)
    energy = EnergyLogger(
        gpu="none",
        cpu="codecarbon",
        ram="none",
        meters=MeterConfig(sampling_period=0.02, codecarbon_tracking_mode="process"),
    )
    cycle = PulseCycle(burst=2, replay=2, maintain=0, warmup=0.0, anneal=0.0, maintain_eval="none")
    options = trainer_kwargs(
        max_epochs=1, limit_train_batches=10, limit_val_batches=0, default_root_dir=tmp_path
    )
    trainer = pl.Trainer(callbacks=[held, BusyBatches(0.04), cycle, energy], **options)
    trainer.fit(MNIST1DClassifier(arch="mlp"), train_dataloaders=train_loader())

    if not held.powers:
        pytest.skip("codecarbon reads this machine's CPU from RAPL, not from the process's CPU load")
    assert held.powers[0] == 0.0 and held.session._gap_kwh[0] > 0  # the 0 W start; its gap counted
    report = energy.report
    assert report["meters"]["cpu"]["meter"] == "codecarbon"
    # the start usually ends mid-epoch; on a loaded machine its re-measures may outlast the last batches, and
    # the epoch end waits for it (`meter_startup`): either way the backlog is spread by time over the phases
    watts = {
        phase: cpu_kwh(figures) * 3.6e6 / figures["duration_s"] for phase, figures in report["phases"].items()
    }
    assert set(watts) == {"burst", "replay"}
    # both phases trained the same busy batches, in turns, all through the gap (batches 0-7; 8-9 are burst
    # after it): the gap booked to one interval of one phase left the other's gap seconds at 0 W
    assert watts["burst"] / 2 <= watts["replay"] <= watts["burst"] * 2, watts


def test_a_fit_that_ends_before_a_later_0_w_process_mode_start_keeps_its_training_cpu_in_the_run_total(
    tmp_path, monkeypatch, codecarbon_ran_before
):
    """The same race at the epoch end that waits for the start (`meter_startup`): every one of 5 such fits
    lost the training's CPU from the run's total, either booked at 0 J ("estimated", the settle's 60 ms wait
    re-read 0 W of a process idle in the wait) or landed in the one interval after the wait, all
    `meter_startup` (total 0.006 J, meter_startup 0.536 J; here 0.00003-0.001 W against 4.9-5.1 W, or 0 J).
    The start's thread now re-measures before it publishes; the backlog is spread by time over the training
    and the wait, both at its power."""
    held = ProcessModeStartSeesNoTick(monkeypatch, release_at=10**6)

    class ReleaseAtTheEpochEnd(Callback):
        def on_train_epoch_end(self, trainer, pl_module):  # listed before EnergyLogger: just before its wait
            held.release.set()

    energy = EnergyLogger(
        gpu="none",
        cpu="codecarbon",
        ram="none",
        meters=MeterConfig(sampling_period=0.02, codecarbon_tracking_mode="process"),
    )
    options = trainer_kwargs(
        max_epochs=1, limit_train_batches=16, limit_val_batches=0, default_root_dir=tmp_path
    )
    callbacks = [held, BusyBatches(0.05), ReleaseAtTheEpochEnd(), energy]
    pl.Trainer(callbacks=callbacks, **options).fit(
        MNIST1DClassifier(arch="mlp"), train_dataloaders=train_loader()
    )

    if not held.powers:
        pytest.skip("codecarbon reads this machine's CPU from RAPL, not from the process's CPU load")
    report = energy.report
    assert held.powers[0] == 0.0 and report["meters"]["cpu"]["meter"] == "codecarbon"
    startup = report["meter_startup"]
    total_watts = cpu_kwh(report["total"]) * 3.6e6 / report["total"]["duration_s"]
    startup_watts = cpu_kwh(startup) * 3.6e6 / startup["duration_s"]
    assert total_watts > 0  # was 0 J, "estimated"
    # one reading spans the training and the wait, spread by time: both at its power (not all in the wait)
    assert startup_watts <= total_watts * 2, (total_watts, startup_watts)


class CtrlCDuringTheStartWait(Callback):
    """Listed before EnergyLogger: at the first epoch end, a Ctrl-C (SIGINT) once the training thread waits
    in ``Thread.join`` for codecarbon's start, as a user's Ctrl-C lands there."""

    def on_train_epoch_end(self, trainer, pl_module):
        threading.Thread(target=self._interrupt_the_wait, daemon=True).start()

    @staticmethod
    def _interrupt_the_wait() -> None:
        main = threading.main_thread().ident
        for _ in range(3000):  # at most ~30 s
            frame, names = sys._current_frames().get(main), []
            while frame is not None:
                names.append(frame.f_code.co_name)
                frame = frame.f_back
            if names[:1] == ["_wait_for_tstate_lock"] and "wait_started" in names:
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.01)


@pytest.mark.skipif(
    not hasattr(threading.Thread, "_wait_for_tstate_lock"),
    reason="no _wait_for_tstate_lock in this Python's Thread.join: the one an interrupt breaks",
)
def test_a_ctrl_c_during_the_wait_for_codecarbons_start_says_the_fit_was_interrupted_not_a_30_s_wait(
    tmp_path, monkeypatch
):
    """Fortieth pass: a Ctrl-C while EnergyLogger waited for codecarbon's start (a process's first epoch end)
    warned that the start "did not finish within 30 s", in a fit that ended 0.3 s later. Python 3.11's
    interrupted ``Thread.join`` marks the thread stopped, so the wait at the fit's end returned at once and
    the message was built from the timeout, not from the wait."""
    from codecarbon import OfflineEmissionsTracker

    release = threading.Event()
    original = OfflineEmissionsTracker.start

    def held_start(tracker):  # still starting when the Ctrl-C comes
        release.wait(timeout=60.0)
        original(tracker)

    monkeypatch.setattr(OfflineEmissionsTracker, "start", held_start)
    energy = EnergyLogger(cpu="codecarbon")
    options = trainer_kwargs(
        max_epochs=3, limit_train_batches=2, limit_val_batches=0, default_root_dir=tmp_path
    )
    trainer = pl.Trainer(callbacks=[CtrlCDuringTheStartWait(), energy], **options)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with warnings.catch_warnings(record=True) as record, pytest.raises(SystemExit):
            warnings.simplefilter("always")
            trainer.fit(MNIST1DClassifier(arch="mlp"), train_dataloaders=train_loader())
        held = start_thread()
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT once it has caught one
        release.set()

    assert trainer.current_epoch == 0 and trainer.global_step == 2  # stopped in the first epoch end's wait
    lines = energy_warnings(record)
    assert (
        len(lines) == 1 and "cpu meter 'codecarbon' failed (MeterError: the fit was interrupted" in lines[0]
    )
    assert "did not finish within" not in lines[0]  # was "... within 30 s", in a wait of well under 1 s
    for component in ("cpu", "ram"):  # the RAM meter's line is an info: it has no fallback
        reason = energy.report["meters"][component]["fallbacks"][0]["reason"]
        assert reason.startswith("MeterError: the fit was interrupted during its background start, "), reason
    if held is not None:
        held.join(timeout=30.0)
        assert not held.is_alive()
