"""The pieces EnergyLogger and GreenWindow handed to their cores, tested without a Trainer."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_pulse.core.green_window import (
    Decision,
    GreenSchedule,
    GreenWindowPolicy,
    RunClock,
    ScheduleLedger,
    SimulatedClock,
    clocks_apart,
)
from lightning_pulse.energy.account import (
    EnergyAccount,
    TensorCollective,
    gpu_devices_of,
    no_forecast_line,
    report_folder,
    trainer_chains,
)
from lightning_pulse.energy.carbon import Rate, TimeSeries
from lightning_pulse.energy.config import MeterConfig, naming_energy_logger
from lightning_pulse.energy.constant import ConstantPowerMeter
from lightning_pulse.energy.forecast import OracleForecast
from lightning_pulse.energy.meter import MeterChain
from lightning_pulse.energy.signal import GreenSignal
from lightning_pulse.phase import STEPS_BOUND_ONLY

H = 3600.0


class ManualClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def started_account(clock: ManualClock) -> EnergyAccount:
    account = EnergyAccount(None, None, sampling_period=3600.0, clock=clock, wall_clock=lambda: 1e9 + clock())
    chain = MeterChain("cpu", [("constant", lambda: ConstantPowerMeter("cpu", 10.0))], print)
    account.start([chain])
    return account


# ---------------------------------------------------------------------- EnergyLogger's pieces
def test_listed_gpus_are_the_nodes_metered_on_local_rank_zero_and_each_ranks_own_gpu_on_every_rank(
    monkeypatch,
):
    """Sweep 43: NVML indices and UUIDs name the node's devices, the same GPU in every process; a list in
    `meters.gpu_devices` was metered on every rank and summed (2x on two ranks)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    listed = MeterConfig(gpu_devices=[0, 1, 0])
    cpu = torch.device("cpu")
    assert gpu_devices_of(cpu, "auto", listed, local_rank=0) == [0, 1]  # each once
    assert gpu_devices_of(cpu, "auto", listed, local_rank=1) == []
    # unlisted: each rank its own CUDA device (no CUDA here: its index, the last fallback of the mapping)
    own = MeterConfig()
    assert gpu_devices_of(torch.device("cuda", 0), "auto", own, local_rank=0) == [0]
    assert gpu_devices_of(torch.device("cuda", 1), "auto", own, local_rank=1) == [1]
    assert gpu_devices_of(torch.device("cuda", 1), "none", own, local_rank=1) == []


def test_the_process_meters_its_own_gpus_and_only_local_rank_zero_the_host():
    settings = SimpleNamespace(
        meters=MeterConfig(gpu_devices=[3], cpu_watts=50.0),
        gpu="auto",
        cpu="constant",
        ram="none",
        country_iso_code=None,
    )
    said: list[str] = []
    on_cpu = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), local_rank=0)
    chains = trainer_chains(on_cpu, settings, said.append, said.append)
    # the GPUs named in the config are required, whatever the process's device; the CPU is the constant
    assert [(c.component, c.required) for c in chains] == [("gpu", True), ("cpu", False)]
    second = SimpleNamespace(strategy=on_cpu.strategy, local_rank=1)
    # the listed GPUs are the node's: local rank 0 meters them, as it does the host
    assert trainer_chains(second, settings, said.append, said.append) == []
    unnamed = SimpleNamespace(**{**vars(settings), "meters": MeterConfig(cpu_watts=50.0)})
    assert [c.component for c in trainer_chains(on_cpu, unnamed, said.append, said.append)] == ["cpu"]
    assert said == []  # nothing is built before the chains start


class ReportTrainer:
    """``log_dir`` is a collective under DDP: each read is recorded."""

    def __init__(self, world_size: int, log_dir: str | None = "logs/version_0") -> None:
        self.world_size, self._log_dir, self.default_root_dir, self.reads = world_size, log_dir, "root", 0

    @property
    def log_dir(self) -> str | None:
        self.reads += 1
        return self._log_dir


def test_the_report_folder_reads_the_log_dir_only_where_every_rank_reads_it():
    def read(trainer: ReportTrainer):
        return lambda: trainer.log_dir

    given = ReportTrainer(world_size=2)
    assert report_folder("mine", given, True, read(given)) == "mine" and given.reads == 0
    complete = ReportTrainer(world_size=2)
    assert report_folder(None, complete, True, read(complete)) == "logs/version_0" and complete.reads == 1
    interrupted = ReportTrainer(world_size=2)  # after an exception on one rank: no collective
    assert report_folder(None, interrupted, False, read(interrupted)) == "root" and interrupted.reads == 0
    alone = ReportTrainer(world_size=1)
    assert report_folder(None, alone, False, read(alone)) == "logs/version_0" and alone.reads == 1
    nowhere = ReportTrainer(world_size=1, log_dir=None)
    assert report_folder(None, nowhere, True, read(nowhere)) == "root"


def test_no_forecast_is_said_only_for_a_run_of_unknown_length():
    assert no_forecast_line(40.0, 2) is None
    line = no_forecast_line(float("inf"), 3)
    assert line is not None and line.startswith("EnergyLogger: no forecast of the run's energy: ")
    assert "3" in line and line.endswith(f"; to get one, {STEPS_BOUND_ONLY}.")


def test_a_new_run_forecasts_this_fits_steps_and_every_ranks_batches_a_resumed_one_the_whole_run():
    clock = ManualClock()
    account = started_account(clock)
    account.begin_training(lambda: 30, progress=(30, 60))  # a second fit of the same Trainer
    assert account.forecast_length((100.0, 200.0), world_size=4) == (70.0, 560.0)
    account.stop()
    resumed = EnergyAccount(None, None, sampling_period=3600.0, clock=clock)
    resumed.load_state_dict({"snapshot": {"buckets": {}}, "resumed_runs": 0})
    resumed.start([])
    resumed.begin_training(lambda: 30, progress=(30, 60))
    assert resumed.forecast_length((100.0, 200.0), world_size=2) == (100.0, 400.0)
    resumed.stop()


def test_the_tensor_collective_gathers_float64_rows_and_broadcasts_rank_zeros_value():
    sent: list[torch.Tensor] = []

    def gather(tensor: torch.Tensor) -> torch.Tensor:
        sent.append(tensor)
        return torch.stack([tensor, 10 * tensor])

    collective = TensorCollective(2, lambda value: ("from rank 0", value), gather)
    rows = collective.all_gather(np.array([1.5, 2.0]))
    assert sent[0].dtype == torch.float64 and isinstance(rows, np.ndarray)
    assert rows.tolist() == [[1.5, 2.0], [15.0, 20.0]] and rows.shape == (2, 2)
    assert collective.broadcast(7) == ("from rank 0", 7) and collective.world_size == 2


def test_the_batches_of_a_fit_are_counted_kept_past_the_stop_and_a_new_fit_starts_from_none():
    clock = ManualClock()
    account = started_account(clock)
    account.begin_training(lambda: 0)
    for _ in range(3):
        account.batch_started(torch.zeros(2, 1))
        account.batch_ended()
    account.batch_started(torch.zeros(2, 1))  # started, never ended (a crash in the step)
    assert account.batches_this_fit == 3
    account.stop()
    assert account.batches_this_fit == 3  # on_exception reads it after stopping the account
    account.start([])
    assert account.batches_this_fit == 0
    account.stop()


def test_a_pause_is_booked_to_stage_other_and_the_label_comes_back_the_wait_after_it_counts():
    clock = ManualClock()
    account = started_account(clock)
    account.begin_training(lambda: 0)
    account.mark(stage="train", phase="burst", cycle=0, epoch=0)
    account.batch_started(torch.zeros(2, 1))
    clock.now += 1.0
    account.batch_ended()
    with account.not_training():
        assert account.ledger.label.stage == "other" and account.ledger.label.phase is None
        clock.now += 10.0
    label = account.ledger.label
    assert (label.stage, label.phase, label.cycle, label.epoch) == ("train", "burst", 0, 0)
    clock.now += 0.5  # the fetch after the pause is a data-loader stall; the pause is not
    account.batch_started(torch.zeros(2, 1))
    clock.now += 1.0
    account.batch_ended()
    account.end_training()
    buckets = account.snapshot()["buckets"]
    account.stop()
    assert buckets["stage/other"]["seconds"] == pytest.approx(10.0)
    assert buckets["phase/burst"]["seconds"] == pytest.approx(2.5)
    assert buckets["phase/burst"]["stall_s"] == pytest.approx(0.5)
    assert buckets["phase/burst"]["loop_s"] == pytest.approx(2.5)  # the wait plus both batches' own time
    idle = EnergyAccount(None, None)  # no fit: nothing to book, the block runs all the same
    with idle.not_training():
        ran = True
    assert ran and idle.ledger is None


def test_a_construction_error_names_energy_logger_once():
    with pytest.raises(ValueError, match=r"^EnergyLogger: `gpu`='x' is bad\.$") as caught:
        with naming_energy_logger():
            raise ValueError("`gpu`='x' is bad.")
    assert caught.value.__suppress_context__
    with pytest.raises(ValueError, match=r"^EnergyLogger: named already$"):
        with naming_energy_logger():
            raise ValueError("EnergyLogger: named already")
    with pytest.raises(TypeError, match=r"^not a value error$"):
        with naming_energy_logger():
            raise TypeError("not a value error")


# ---------------------------------------------------------------------- GreenWindow's pieces
def series_rate() -> Rate:
    series = TimeSeries(np.array([0.0, H, 2 * H]), np.array([100.0, 200.0, 300.0]))
    return Rate("series:test", "gCO2eq/kWh", series=series, series_start=0.0)


def test_a_signal_without_a_source_follows_the_energy_loggers_series_on_its_own_clock():
    energy = series_rate()
    energy.anchor(1.7e9)  # the EnergyLogger's run start, on the system clock
    signal = GreenSignal(None)
    signal.load_state_dict({"rate": {"run_start": 5.0e8, "held": {}}, "live": None})  # a checkpoint's
    signal.follow(energy)
    assert signal.follows is energy and signal.rate is not energy and signal.rate.series is energy.series
    assert signal.rate.run_start == 5.0e8  # the checkpoint's state, loaded onto the fork
    fresh = GreenSignal(None)
    fresh.follow(energy)
    fresh.anchor(1.5e9 + 10.0, 1.7e9 + 10.0)  # the same moment on a simulated clock and the system one
    assert fresh.rate.run_start == 1.5e9 and energy.run_start == 1.7e9
    again = series_rate()
    fresh.follow(again)  # a later fit follows the EnergyLogger it has then, on a new fork
    assert fresh.follows is again and fresh.rate.run_start is None


def test_a_signal_of_its_own_is_kept_and_anchored_at_its_own_start():
    own = GreenSignal([(0.0, 100.0), (H, 200.0)])
    rate = own.rate
    own.follow(series_rate())
    assert own.rate is rate and own.follows is None
    own.anchor(1.5e9, 1.7e9)  # the EnergyLogger's clock does not move a signal of its own
    assert own.rate.run_start == 1.5e9


class CountingSignal:
    def __init__(self, series: TimeSeries) -> None:
        self.series, self.reads = series, 0

    def now(self, at=None):
        self.reads += 1
        return self.series, lambda wall: wall


def test_a_schedule_decides_from_a_signal_only_while_steps_are_left():
    values = [100.0 + 10.0 * (h % 24) for h in range(24 * 4)]
    series = TimeSeries(H * np.arange(len(values)), np.asarray(values))
    schedule = GreenSchedule(
        GreenWindowPolicy(OracleForecast()), 1.0, True, 10 * H, None, ScheduleLedger(series.mean)
    )
    signal = CountingSignal(series)
    assert schedule.decide_from(signal, 48 * H, steps_left=0) is None and signal.reads == 0
    decision = schedule.decide_from(signal, 48 * H, steps_left=10)
    assert signal.reads == 1 and decision is not None and decision.run  # hour 0 is the cleanest of the day
    twin = GreenSchedule(
        GreenWindowPolicy(OracleForecast()), 1.0, True, 10 * H, None, ScheduleLedger(series.mean)
    )
    assert twin.decide(series, lambda wall: wall, 48 * H, 10) == decision


def test_a_schedule_keeps_the_run_start_of_a_resumed_run():
    schedule = GreenSchedule(
        GreenWindowPolicy(OracleForecast()), 1.0, True, H, None, ScheduleLedger(lambda t0, t1: 0.0)
    )
    schedule.begin(500.0)
    schedule.begin(900.0)
    assert schedule.run_start == 500.0


def decision(at: float, resume_at: float | None) -> Decision:
    return Decision(at, False, "dirty", 300.0, 300.0, 100.0, H, resume_at, 2 * H, 5 * H)


def test_a_suspend_keeps_the_runs_times_and_gives_the_resume_file_the_clocks():
    run_clock = RunClock(SimulatedClock(0.0))
    run_clock.behind_s = 100.0  # the run's time is 100 s ahead of its clock (a resume on a clock behind)
    record, now, resume_at = run_clock.suspension(1000.0, decision(at=900.0, resume_at=4000.0))
    assert record == {"at": 1000.0, "resume_at": 4100.0}  # the resume moved by the 100 s since the decision
    assert (now, resume_at) == (900.0, 4000.0)
    record, _, _ = run_clock.suspension(1000.0, decision(at=1000.0, resume_at=None))
    assert record["resume_at"] == 1000.0


def test_clocks_are_never_apart_without_an_energy_loggers_clock():
    assert clocks_apart(1.5e9, None, H) is None
    assert clocks_apart(1.5e9, 1.5e9 + 10.0, H) is None
    assert "SimulatedClock" in clocks_apart(1.5e9, 1.7e9, H)
