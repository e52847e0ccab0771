"""The ledger attributes metered energy to labels by time, combines ranks and resumed runs, and predicts."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from lightning_pulse.energy.account import EnergyAccount, build_chains
from lightning_pulse.energy.carbon import Rate, TimeSeries
from lightning_pulse.energy.config import MeterConfig
from lightning_pulse.energy.constant import ConstantPowerMeter
from lightning_pulse.energy.counting import count_batch, count_samples, count_tokens, doubtful_sample_count
from lightning_pulse.energy.ledger import (
    BUCKET_FIELDS,
    EnergyLedger,
    combine_ranks,
    figures,
    flatten_buckets,
    grouped_figures,
    merge_snapshots,
    predict_run,
)
from lightning_pulse.energy.meter import ESTIMATED, MEASURED, NONE, MeterChain
from lightning_pulse.energy.sampler import THREAD_NAME, EnergySampler


def reading(gpu=0.0, cpu=0.0, ram=0.0, gpu_method=MEASURED, cpu_method=ESTIMATED, ram_method=ESTIMATED):
    return {"gpu": (gpu, gpu_method), "cpu": (cpu, cpu_method), "ram": (ram, ram_method)}


def test_energy_of_an_interval_is_split_over_labels_by_time():
    ledger = EnergyLedger()
    ledger.begin(0.0, 1000.0, reading())
    ledger.mark(0.0, 1000.0, stage="train", phase="burst", cycle=0, epoch=0)
    ledger.mark(1.0, 1001.0, phase="replay")
    ledger.mark(3.0, 1003.0, phase="maintain")
    ledger.record(4.0, 1004.0, reading(gpu=400.0, cpu=40.0))
    snapshot = ledger.snapshot(4.0)
    buckets = snapshot["buckets"]
    assert buckets["phase/burst"]["gpu_j"] == pytest.approx(100.0)
    assert buckets["phase/replay"]["gpu_j"] == pytest.approx(200.0)
    assert buckets["phase/maintain"]["cpu_j"] == pytest.approx(10.0)
    assert buckets["phase/replay"]["seconds"] == pytest.approx(2.0)
    assert buckets["total"]["gpu_j"] == pytest.approx(400.0) and buckets["epoch/0"]["cpu_j"] == pytest.approx(
        40.0
    )
    assert [s["phase"] for s in snapshot["phase_segments"]] == ["burst", "replay", "maintain"]


def test_energy_outside_the_training_loop_counts_only_in_total_and_stage():
    ledger = EnergyLedger()
    ledger.begin(0.0, 0.0, reading())
    ledger.record(2.0, 2.0, reading(cpu=20.0))  # setup / sanity check
    ledger.mark(2.0, 2.0, stage="train", phase="burst", epoch=0)
    ledger.record(4.0, 4.0, reading(cpu=60.0))
    buckets = ledger.snapshot(4.0)["buckets"]
    assert buckets["total"]["cpu_j"] == pytest.approx(60.0)
    assert buckets["stage/other"]["cpu_j"] == pytest.approx(20.0)
    assert buckets["phase/burst"]["cpu_j"] == pytest.approx(40.0)


def test_a_phase_announced_before_the_training_stage_starts_is_in_no_phase():
    # PulseCycle announces its first phase in its own `on_train_start`, before EnergyLogger's marks the stage
    # `train` (PulseCycle is listed first): for that moment the label had a phase with stage `other`, and its
    # energy went to the phase but to no in-loop stage. On a busy machine the moment took 1% of a short run's
    # energy, so the phases summed to 1.01x train + validation (tests/test_real_models_energy_logger.py)
    ledger = EnergyLedger()
    ledger.begin(0.0, 0.0, reading())
    ledger.mark(1.0, 1.0, phase="burst", cycle=0)  # PulseCycle.on_train_start -> on_pulse_phase_begin
    ledger.mark(2.0, 2.0, stage="train", phase="burst", cycle=0, epoch=0)  # EnergyLogger.on_train_start
    ledger.mark(6.0, 6.0, stage="validation")  # a validation inside the loop keeps its phase
    ledger.mark(7.0, 7.0, stage="train", phase="replay", cycle=0)
    ledger.mark(9.0, 9.0, stage="other", phase=None, cycle=None, epoch=None)  # end_training
    ledger.record(10.0, 10.0, reading(cpu=100.0))  # 10 W all along
    buckets = ledger.snapshot(10.0)["buckets"]
    phases = sum(buckets[key]["cpu_j"] for key in buckets if key.startswith("phase/"))
    in_loop = buckets["stage/train"]["cpu_j"] + buckets["stage/validation"]["cpu_j"]
    assert in_loop == pytest.approx(70.0) and phases == pytest.approx(in_loop, rel=1e-12)
    assert buckets["phase/burst"]["cpu_j"] == pytest.approx(50.0)  # [2, 7): train and validation
    assert buckets["phase/burst"]["seconds"] == pytest.approx(5.0)
    assert buckets["cycle/0"]["cpu_j"] == buckets["epoch/0"]["cpu_j"] == pytest.approx(70.0)
    assert buckets["stage/other"]["cpu_j"] == pytest.approx(30.0)  # set-up, the announcement, the end


def test_co2_integrates_energy_times_a_varying_intensity():
    # 100 g/kWh for the first 10 s, 500 g/kWh after
    series = TimeSeries(np.array([0.0, 10.0, 20.0]), np.array([100.0, 500.0, 500.0]))
    ledger = EnergyLedger(intensity=Rate("series:test", "gCO2eq/kWh", series=series, series_start=0.0))
    ledger.intensity.anchor(0.0)
    ledger.begin(0.0, 0.0, reading())
    ledger.record(20.0, 20.0, reading(cpu=3.6e6))  # 1 kWh over 20 s at constant power
    total = ledger.snapshot(20.0)["buckets"]["total"]
    assert total["co2_kg"] == pytest.approx((0.5 * 100 + 0.5 * 500) / 1000)


def test_price_gives_cost_and_figures_carry_methods():
    ledger = EnergyLedger(price=Rate("constant", "EUR/kWh", constant=0.25))
    ledger.begin(0.0, 0.0, reading())
    ledger.mark(0.0, 0.0, stage="train", phase="burst", epoch=0)
    ledger.count_batch(ledger.current_keys(), samples=100, tokens=None)
    ledger.record(10.0, 10.0, reading(gpu=3.6e6, cpu=3.6e6))
    row = figures(ledger.snapshot(10.0)["buckets"]["phase/burst"], has_intensity=False, has_price=True)
    assert row["energy_kwh"] == pytest.approx(2.0) and row["avg_power_w"] == pytest.approx(7.2e5)
    assert row["cost"] == pytest.approx(0.5) and row["cost_method"] == ESTIMATED
    assert row["methods"] == {"gpu": MEASURED, "cpu": ESTIMATED, "ram": ESTIMATED}
    assert row["energy_method"] == ESTIMATED  # a sum with an estimated part is an estimate
    assert row["co2_kg"] is None and row["co2_method"] == NONE
    assert row["energy_per_sample_j"] == pytest.approx(7.2e6 / 100)
    assert row["energy_per_token_j"] is None and row["tokens"] is None


def test_counts_tokens_steps_and_stall_share():
    ledger = EnergyLedger()
    ledger.begin(0.0, 0.0, reading())
    ledger.mark(0.0, 0.0, stage="train", phase="replay", epoch=0)
    keys = ledger.current_keys()
    ledger.count_batch(keys, samples=8, tokens=8 * 16)  # the first batch of an epoch: no loop time yet
    ledger.count_batch(keys, samples=8, tokens=8 * 16, stall_s=0.1, loop_s=1.0)
    ledger.count_step(keys, 1)
    ledger.count_batch(keys, samples=8, tokens=8 * 16, stall_s=0.3, loop_s=1.0)
    ledger.count_batch(keys, samples=8, tokens=8 * 16, stall_s=-1e-9, loop_s=0.0)  # clock jitter is clipped
    ledger.count_step(keys, 1)
    ledger.record(2.0, 2.0, reading(cpu=512.0))
    row = figures(ledger.snapshot(2.0)["buckets"]["phase/replay"], False, False)
    assert (row["samples"], row["tokens"], row["steps"]) == (32, 512, 2)
    assert row["energy_per_token_j"] == pytest.approx(1.0)
    assert row["stall_share"] == pytest.approx(0.2)


def test_estimate_between_readings_grows_with_the_latest_power():
    ledger = EnergyLedger()
    ledger.begin(0.0, 0.0, reading())
    assert ledger.estimate_joules(5.0) == 0.0
    ledger.record(2.0, 2.0, reading(cpu=40.0))  # 20 W
    assert ledger.estimate_joules(2.5) == pytest.approx(50.0)
    assert ledger.estimate_joules(100.0) == pytest.approx(40.0 + 20.0 * 10.0)  # extrapolates 10 s at most


def test_thinning_the_timeline_never_loses_energy():
    ledger = EnergyLedger(max_points=16)
    ledger.begin(0.0, 0.0, reading())
    for second in range(1, 101):
        ledger.record(float(second), float(second), reading(cpu=5.0 * second))
    assert len(ledger.timeline_wall) <= 16
    timeline = ledger.snapshot(100.0)["timeline"]
    assert sum(timeline["cpu_j"]) == pytest.approx(500.0)


def test_the_timeline_and_phase_bands_leave_out_the_meter_start_up_as_every_figure_does():
    # a held-out sweep: the report's timeline (the PNG's power panel) held codecarbon's start-up wait, which
    # the report keeps out of every figure: 4x the total on a short first fit, drawn as a "burst"
    from lightning_pulse.energy.ledger import STARTUP_KEY, STARTUP_STAGE

    ledger = EnergyLedger()
    ledger.begin(0.0, 0.0, reading())
    ledger.mark(0.0, 0.0, stage="train", phase="burst", cycle=0, epoch=0)
    ledger.mark(1.0, 1.0, stage=STARTUP_STAGE)  # the wait, at the first epoch end
    ledger.record(5.0, 5.0, reading(cpu=50.0))  # 10 W: 10 J of training, 40 J of the wait
    ledger.mark(5.0, 5.0, stage="train")
    ledger.record(6.0, 6.0, reading(cpu=60.0))
    snapshot = ledger.snapshot(6.0)
    buckets = snapshot["buckets"]
    assert buckets["total"]["cpu_j"] == pytest.approx(20.0) and buckets[STARTUP_KEY][
        "cpu_j"
    ] == pytest.approx(40.0)
    assert sum(snapshot["timeline"]["cpu_j"]) == pytest.approx(buckets["total"]["cpu_j"])
    spans = [(s["phase"], s["start_wall"], s["end_wall"]) for s in snapshot["phase_segments"]]
    assert spans == [("burst", 0.0, 1.0), ("burst", 5.0, None)]  # no band over the wait


def test_ranks_combine_energy_by_sum_time_by_max_and_methods_by_or():
    keys = ["total", "phase/burst"]
    rank0 = {
        "total": {
            "gpu_j": 100.0,
            "cpu_j": 50.0,
            "seconds": 10.0,
            "gpu_flags": 1,
            "cpu_flags": 2,
            "samples": 8,
        }
    }
    rank1 = {
        "total": {"gpu_j": 80.0, "seconds": 10.5, "gpu_flags": 1, "samples": 8, "stall_s": 2.0, "loop_s": 4.0}
    }
    stacked = np.stack([flatten_buckets(rank0, keys), flatten_buckets(rank1, keys)])
    assert stacked.shape == (2, 2, len(BUCKET_FIELDS))
    combined = combine_ranks(stacked, keys)
    total = combined["total"]
    assert (total["gpu_j"], total["cpu_j"], total["seconds"], total["samples"]) == (180.0, 50.0, 10.5, 16.0)
    assert total["stall_s"] == pytest.approx(1.0) and total["loop_s"] == pytest.approx(2.0)
    assert figures(total, False, False)["methods"] == {"gpu": MEASURED, "cpu": ESTIMATED, "ram": NONE}
    assert combined["phase/burst"]["gpu_j"] == 0.0


def test_a_resumed_run_adds_up_with_the_carried_part():
    first = {
        "buckets": {
            "total": {"cpu_j": 10.0, "cpu_flags": 2, "seconds": 5.0, "samples": 100},
            "epoch/0": {"cpu_j": 10.0, "cpu_flags": 2},
        },
        "timeline": {"start_wall": [0.0], "end_wall": [5.0], "gpu_j": [0.0], "cpu_j": [10.0], "ram_j": [0.0]},
        "phase_segments": [{"phase": "burst", "cycle": 0, "start_wall": 0.0, "end_wall": 5.0}],
        "events": [{"component": "cpu", "failed": "rapl"}],
    }
    second = {
        "buckets": {
            "total": {"cpu_j": 30.0, "cpu_flags": 2, "seconds": 7.0, "samples": 100},
            "epoch/1": {"cpu_j": 30.0, "cpu_flags": 2},
        },
        "timeline": {
            "start_wall": [9.0],
            "end_wall": [16.0],
            "gpu_j": [0.0],
            "cpu_j": [30.0],
            "ram_j": [0.0],
        },
        "phase_segments": [],
        "events": [],
    }
    merged = merge_snapshots(first, second)
    groups = grouped_figures(merged["buckets"], False, False)
    assert groups["total"]["energy_kwh"] == pytest.approx(40.0 / 3.6e6)
    assert groups["total"]["duration_s"] == 12.0 and groups["total"]["samples"] == 200
    assert list(groups["epochs"]) == ["0", "1"]
    assert merged["timeline"]["cpu_j"] == [10.0, 30.0] and len(merged["events"]) == 1
    assert merge_snapshots(None, second)["buckets"] == second["buckets"]


def test_prediction_scales_the_first_epoch_to_the_whole_run():
    epoch = {"cpu_j": 3.6e6, "seconds": 60.0, "steps": 10, "co2_kg": 0.4, "cost": 0.2}
    forecast = predict_run(epoch, total_steps=100, intensity_known=True, price_known=False)
    assert forecast["energy_kwh"] == pytest.approx(10.0) and forecast["duration_s"] == pytest.approx(600.0)
    assert forecast["co2_kg"] == pytest.approx(4.0) and forecast["cost"] is None
    assert predict_run(epoch, total_steps=float("inf"), intensity_known=False, price_known=False) is None
    assert predict_run({"seconds": 1.0}, total_steps=10, intensity_known=False, price_known=False) is None
    # an epoch its meters have not read yet forecasts nothing (not 0 kWh): a later epoch does, and says which
    unread = {**epoch, "cpu_j": 0.0}
    assert predict_run(unread, total_steps=100, intensity_known=True, price_known=False) is None
    assert predict_run(epoch, 100, True, False, epoch=2)["basis"].startswith("epoch 2: 10 optimizer steps")
    assert predict_run(epoch, 100, True, False, epoch=9, steps_done=100) is None  # nothing left to forecast
    # given the run's batches, per batch: later steps may cover more of them (an accumulation scheduler)
    counted = {**epoch, "batches": 10}
    assert predict_run(counted, 100, True, False, total_batches=400)["energy_kwh"] == pytest.approx(40.0)


def test_batches_tell_samples_and_tokens():
    assert count_samples((torch.zeros(7, 40), torch.zeros(7, dtype=torch.long))) == 7
    assert count_samples({"x": [torch.zeros(3, 2)]}) == 3
    assert count_samples("no tensor") == 1
    assert count_tokens((torch.zeros(4, 64, dtype=torch.long), torch.zeros(4, 64, dtype=torch.long))) == 256
    assert (
        count_tokens((torch.zeros(4, 40), torch.zeros(4, dtype=torch.long))) is None
    )  # features, not tokens
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert int(count_tokens({"input_ids": torch.zeros(2, 3), "attention_mask": mask})) == 3
    assert count_tokens({"input_ids": torch.zeros(2, 5, dtype=torch.long)}) == 10


def test_a_per_batch_value_leading_the_batch_is_not_taken_for_its_sample_count():
    # held-out sweep 19: a packing collator's 0-dim `num_tokens` first in a dict batch counted every batch as
    # 1 sample (8 for 64 trained), and nothing was said
    ids = torch.zeros(8, 10, dtype=torch.long)
    packed = {"num_tokens": torch.tensor(80), "input_ids": ids, "attention_mask": torch.ones(8, 10)}
    assert count_samples(packed) == 8 and count_batch(packed) == (8, packed["attention_mask"].sum())
    assert count_samples((torch.tensor(80), ids)) == 8 and count_batch((torch.tensor(80), ids))[0] == 8
    assert doubtful_sample_count(packed) is None  # nothing to doubt once the per-batch value is passed over


@pytest.mark.parametrize(
    "batch",
    [
        (torch.zeros(7, 40), torch.zeros(7, dtype=torch.long)),
        [torch.zeros(4, 64, dtype=torch.long), torch.zeros(4, 64, dtype=torch.long)],
        (torch.zeros(2, 3, dtype=torch.uint8),),
        (torch.zeros(3, 2, dtype=torch.bool),),
        (torch.zeros(2, 3, dtype=torch.complex64),),
        (torch.tensor(3.0),),
        (torch.tensor(3.0), torch.zeros(5, 2)),
        {"input_ids": torch.zeros(2, 5, dtype=torch.long)},
        [],
        "no tensor",
    ],
)
def test_the_per_batch_count_follows_the_same_rules(batch):
    assert count_batch(batch) == (count_samples(batch), count_tokens(batch))


def test_counts_added_in_bulk_and_a_snapshot_of_some_buckets():
    ledger = EnergyLedger()
    ledger.record(0.0, 1000.0, reading())
    ledger.mark(0.0, 1000.0, phase="burst", epoch=0, stage="train")
    ledger.add_counts(
        ledger.current_keys(), batches=3, samples=24, tokens=0, stall_s=0.5, loop_s=2.0, steps=3
    )
    ledger.mark(4.0, 1004.0, epoch=1)
    ledger.add_counts(ledger.current_keys(), batches=1, samples=8, steps=1)
    snapshot = ledger.snapshot(5.0, keys=lambda key: key == "total" or key.startswith("epoch/"))
    assert set(snapshot["buckets"]) == {"total", "epoch/0", "epoch/1"} and "timeline" in snapshot
    epoch0, total = snapshot["buckets"]["epoch/0"], snapshot["buckets"]["total"]
    assert (epoch0["batches"], epoch0["samples"], epoch0["steps"], epoch0["seconds"]) == (3, 24, 3, 4.0)
    assert (total["batches"], total["samples"], total["steps"], total["stall_s"]) == (4, 32, 4, 0.5)
    assert ledger.snapshot(5.0)["buckets"]["phase/burst"]["samples"] == 32


# ---------------------------------------------------------------------- sampler thread
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_sampler_records_on_demand_with_an_injected_clock():
    clock = FakeClock()
    ledger = EnergyLedger()
    chain = MeterChain("cpu", [("constant", lambda: ConstantPowerMeter("cpu", 30.0))], warn=print)
    sampler = EnergySampler([chain], ledger, period=1.0, clock=clock, wall_clock=clock)
    sampler.start(thread=False)
    clock.now = 2.0
    sampler.sample()
    clock.now = 5.0
    sampler.stop()  # takes a final reading
    assert ledger.totals_j["cpu"] == pytest.approx(150.0)
    assert ledger.methods["cpu"] == ESTIMATED


def test_a_meter_still_starting_defers_the_readings_so_its_backlog_spreads_over_the_phases():
    # held-out sweep: codecarbon starts in the background; its zero-point readings were recorded, so a short
    # fit's whole energy came with the fit-end reading and went to stage "other" (434 W), every phase 0 kWh.
    # A stand-in for the background start: 30 W, read as the zero point until the start finishes
    class StartsInTheBackground(ConstantPowerMeter):
        started = False

        @property
        def starting(self) -> bool:
            return not self.started

        def read_joules(self, now: float) -> float:
            return super().read_joules(now) if self.started else 0.0

    clock = FakeClock()
    ledger = EnergyLedger()
    meter = StartsInTheBackground("cpu", 30.0)
    chain = MeterChain("cpu", [("background", lambda: meter)], warn=print)
    sampler = EnergySampler([chain], ledger, period=1.0, clock=clock, wall_clock=clock)
    sampler.start(thread=False)
    ledger.mark(0.0, 0.0, phase="burst", stage="train")
    for now, phase in ((1.0, None), (2.0, "replay"), (3.0, None)):
        clock.now = now
        if phase is not None:
            ledger.mark(now, now, phase=phase)
        sampler.sample()  # still starting: nothing recorded
    assert sampler.samples == 0 and ledger.totals_j["cpu"] == 0.0
    meter.started = True
    clock.now = 4.0
    sampler.sample()  # the first real reading: 120 J over [0, 4], half of it in each phase
    buckets = ledger.snapshot(4.0)["buckets"]
    assert buckets["phase/burst"]["cpu_j"] == pytest.approx(60.0)
    assert buckets["phase/replay"]["cpu_j"] == pytest.approx(60.0)


def test_sampler_thread_stops_cleanly_when_a_reading_raises():
    class BrokenLedger(EnergyLedger):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def record(self, now, wall, totals):
            self.calls += 1
            raise RuntimeError("ledger bug")

    warnings_seen: list[str] = []
    done = threading.Event()

    def warn(message: str) -> None:
        warnings_seen.append(message)
        done.set()

    chain = MeterChain("cpu", [("constant", lambda: ConstantPowerMeter("cpu", 1.0))], warn=print)
    ledger = BrokenLedger()
    sampler = EnergySampler([chain], ledger, period=0.005, warn=warn)
    sampler.start()
    assert done.wait(timeout=30)
    sampler._thread.join(timeout=30)
    assert not sampler.running and isinstance(sampler.error, RuntimeError)
    assert len(warnings_seen) == 1 and "ledger bug" in warnings_seen[0]
    sampler.stop(final_sample=False)
    assert not [t for t in threading.enumerate() if t.name == THREAD_NAME]


def test_sampler_thread_is_joined_on_stop():
    chain = MeterChain("cpu", [("constant", lambda: ConstantPowerMeter("cpu", 1.0))], warn=print)
    sampler = EnergySampler([chain], EnergyLedger(), period=0.01)
    sampler.start()
    assert sampler.running
    sampler.stop()
    sampler.stop()  # twice is harmless
    assert not sampler.running and not [t for t in threading.enumerate() if t.name == THREAD_NAME]
    with pytest.raises(ValueError, match="`period`=0"):
        EnergySampler([], EnergyLedger(), period=0)


# ---------------------------------------------------------------------- the account (no Trainer)
class ManualClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def constant_chain(component: str, watts: float) -> MeterChain:
    return MeterChain(component, [("constant", lambda: ConstantPowerMeter(component, watts))], print)


def account_with(clock: ManualClock, **kwargs) -> EnergyAccount:
    # a one-hour period: the sampling thread never reads here, every reading is a read-out's own
    return EnergyAccount(
        None, None, sampling_period=3600.0, clock=clock, wall_clock=lambda: 1e9 + clock(), **kwargs
    )


def test_account_attributes_energy_counts_and_steps_to_phases_without_a_trainer():
    clock, steps = ManualClock(), [0]
    account = account_with(clock)
    account.start([constant_chain("cpu", 10.0)])
    account.begin_training(lambda: steps[0])
    account.mark(stage="train", phase="burst", cycle=0, epoch=0)
    for _ in range(2):  # two burst batches of 4 samples, 1 s each, one optimizer step each
        account.batch_started(torch.zeros(4, 3))
        clock.now += 1.0
        steps[0] += 1
        account.batch_ended()
    account.mark(phase="replay")
    account.batch_started(torch.zeros(2, 3))
    clock.now += 3.0
    steps[0] += 1
    account.end_training()
    buckets = account.snapshot()["buckets"]
    account.stop()

    assert buckets["phase/burst"]["cpu_j"] == pytest.approx(20.0)
    assert buckets["phase/replay"]["cpu_j"] == pytest.approx(30.0)
    assert (buckets["phase/burst"]["samples"], buckets["phase/burst"]["steps"]) == (8, 2)
    assert (buckets["phase/replay"]["samples"], buckets["phase/replay"]["steps"]) == (2, 1)
    assert buckets["total"]["cpu_j"] == pytest.approx(50.0) and buckets["total"]["seconds"] == pytest.approx(
        5.0
    )
    assert account.energy_so_far_kwh() == pytest.approx(50.0 / 3.6e6)
    assert account.report("complete", "EUR")["total"]["methods"]["cpu"] == ESTIMATED


def test_a_batch_whose_first_tensor_is_not_the_sample_count_is_said_once():
    # held-out sweep: a graph-style dict batch led by a (2, E) edge index counted 2 samples a batch, not 32
    # (energy per sample 16x too high), with no word
    graph = {
        "edge_index": torch.zeros(2, 96, dtype=torch.long),
        "x": torch.zeros(32, 8),
        "y": torch.zeros(32),
    }
    assert "leading sizes are [2, 32, 32], the first being 2" in doubtful_sample_count(graph)
    for agreeing in (
        (torch.zeros(7, 40), torch.zeros(7)),
        {"input_ids": torch.zeros(4, 9), "attention_mask": torch.ones(4, 9), "labels": torch.zeros(4, 9)},
        (torch.zeros(5, 3), torch.zeros(2, 2)),  # no majority against the first: not doubted
        [torch.zeros(3)],
    ):
        assert doubtful_sample_count(agreeing) is None
    clock, said = ManualClock(), []
    account = account_with(clock, warn=said.append)
    account.start([constant_chain("cpu", 10.0)])
    account.begin_training(lambda: 0)
    account.mark(stage="train", phase="burst", cycle=0, epoch=0)
    for _ in range(3):
        account.batch_started(graph)
        clock.now += 1.0
        account.batch_ended()
    account.end_training()
    assert account.snapshot()["buckets"]["total"]["samples"] == 6  # the documented rule, kept
    account.stop()
    assert len(said) == 1 and "counts 2 samples per training batch" in said[0] and "sample_counter" in said[0]


def test_account_epoch_metrics_and_a_single_forecast():
    clock = ManualClock()
    account = account_with(clock)
    account.start([constant_chain("cpu", 36.0)])
    steps = [0]
    account.begin_training(lambda: steps[0])
    account.mark_training("burst", None, 0)
    account.batch_started(torch.zeros(5, 1))
    clock.now += 100.0
    steps[0] = 4  # four optimizer steps in the epoch, of a 40-step run
    metrics, forecast = account.epoch_metrics(0, total_steps=40)
    again, second = account.epoch_metrics(0, total_steps=40)
    # the epoch's own figures once it has closed (the next epoch's start): final, as the report's
    assert "energy/epoch_kwh" not in metrics
    closed = account.start_epoch(1)
    account.stop()
    assert closed["energy/epoch_kwh"] == pytest.approx(3600.0 / 3.6e6)
    assert metrics["energy/burst_kwh"] == metrics["energy/total_kwh"] == closed["energy/epoch_kwh"]
    assert forecast is not None and metrics["energy/predicted_kwh"] == pytest.approx(10 * 3600.0 / 3.6e6)
    assert second is None and "energy/predicted_kwh" not in again


def test_account_resumed_from_a_state_dict_reports_the_whole_run():
    clock = ManualClock()
    first = account_with(clock)
    first.start([constant_chain("cpu", 10.0)])
    clock.now += 2.0
    state = first.state_dict()
    first.stop()

    resumed = account_with(clock)
    resumed.load_state_dict(state)
    resumed.start([constant_chain("cpu", 10.0)])
    clock.now += 3.0
    total = resumed.snapshot()["buckets"]["total"]
    assert total["cpu_j"] == pytest.approx(50.0) and resumed.resumed_runs == 1
    assert resumed.energy_so_far_kwh() == pytest.approx(50.0 / 3.6e6)
    resumed.stop()


class ThreadCollective:
    """Two accounts in two threads of one process, combined like two DDP ranks."""

    def __init__(self, shared: dict, barrier: threading.Barrier, rank: int, world_size: int) -> None:
        self.shared, self.barrier, self.rank, self.world_size = shared, barrier, rank, world_size

    def broadcast(self, value):
        if self.rank == 0:
            self.shared["broadcast"] = value
        self.barrier.wait()
        value = self.shared["broadcast"]
        self.barrier.wait()
        return value

    def all_gather(self, vector):
        self.shared[self.rank] = np.asarray(vector)
        self.barrier.wait()
        gathered = np.stack([self.shared[r] for r in range(self.world_size)])
        self.barrier.wait()
        return gathered


def test_account_sums_gpu_over_ranks_and_counts_cpu_once():
    shared, barrier, results = {}, threading.Barrier(2), {}

    def rank(index: int) -> None:
        clock = ManualClock()
        account = account_with(clock)
        chains = [constant_chain("gpu", 100.0 if index == 0 else 50.0)]
        if index == 0:  # local rank 0: CPU once per node
            chains.append(constant_chain("cpu", 10.0))
        account.start(chains, global_zero=index == 0)
        account.begin_training(lambda: 0)
        account.mark(stage="train", phase="burst", epoch=0)
        account.batch_started(torch.zeros(3, 1))
        clock.now += 2.0
        results[index] = account.snapshot(ThreadCollective(shared, barrier, index, 2))
        account.stop()

    threads = [threading.Thread(target=rank, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results[0]["buckets"] == results[1]["buckets"]
    total = results[0]["buckets"]["total"]
    assert total["gpu_j"] == pytest.approx(300.0)  # (100 W + 50 W) x 2 s
    assert total["cpu_j"] == pytest.approx(20.0)  # 10 W x 2 s, once
    assert total["samples"] == 6 and total["seconds"] == pytest.approx(2.0)
    assert sum(results[0]["timeline"]["gpu_j"]) == pytest.approx(300.0)


def test_build_chains_follows_the_modes_and_counts_the_host_once():
    config = MeterConfig(cpu_watts=5.0)
    host = build_chains(
        config, [], cpu="constant", ram="none", country_iso_code=None, count_host=True, warn=print, info=print
    )
    other = build_chains(
        config,
        [0],
        cpu="auto",
        ram="codecarbon",
        country_iso_code=None,
        count_host=False,
        warn=print,
        info=print,
    )
    assert [chain.component for chain in host] == ["cpu"]
    assert [chain.component for chain in other] == ["gpu"]  # not local rank 0: no CPU, no RAM
    host[0].start(0.0)
    assert host[0].meter_name == "constant" and host[0].read(2.0) == (10.0, ESTIMATED)


def test_account_whose_meters_cannot_be_built_warns_once_and_keeps_counting():
    messages: list[str] = []
    clock = ManualClock()
    account = account_with(clock, warn=messages.append)
    account.start(lambda: [][0])  # a bug building the chains
    account.begin_training(lambda: 0)
    account.mark(stage="train", phase="burst", epoch=0)
    account.batch_started(torch.zeros(7, 1))
    clock.now += 1.0
    report = account.report("complete", "EUR")
    account.stop()
    assert len(messages) == 1 and "energy metering stopped (IndexError" in messages[0]
    assert report["disabled"].startswith("IndexError") and report["total"]["samples"] == 7
    # nothing was metered: null, not a 0 that reads as a measurement
    assert report["total"]["energy_kwh"] is None and report["total"]["energy_method"] == NONE
    assert account.energy_so_far_kwh() == 0.0


def test_a_long_run_keeps_its_latest_cycles_and_epochs_and_every_joule_in_its_totals():
    # held-out sweep: one bucket per cycle and per epoch, and one segment per phase change, all in every
    # checkpoint and report (about 3.5 MB of state and a 12 MB report per million steps of the shipped suite)
    from lightning_pulse.records import RECENT_RECORDS

    ledger = EnergyLedger()
    ledger.begin(0.0, 1000.0, reading())
    cycles = RECENT_RECORDS + 200
    for cycle in range(cycles):
        for offset, phase in enumerate(("burst", "replay")):
            t = 2.0 * cycle + offset
            ledger.mark(t, 1000.0 + t, stage="train", phase=phase, cycle=cycle, epoch=cycle // 2)
    end = 2.0 * cycles
    ledger.record(end, 1000.0 + end, reading(cpu=end))  # 1 W for every second of the run
    snapshot = ledger.snapshot(end)
    buckets = snapshot["buckets"]
    kept_cycles = sorted(int(key.split("/")[1]) for key in buckets if key.startswith("cycle/"))
    assert kept_cycles == list(range(cycles - RECENT_RECORDS, cycles))  # the latest ones
    assert sum(key.startswith("epoch/") for key in buckets) == (cycles + 1) // 2  # fewer than the limit: all
    assert len(snapshot["phase_segments"]) == RECENT_RECORDS
    assert buckets["total"]["cpu_j"] == pytest.approx(end)  # nothing dropped from the totals
    assert buckets["phase/burst"]["cpu_j"] + buckets["phase/replay"]["cpu_j"] == pytest.approx(end)
    merged = merge_snapshots(snapshot, snapshot)  # a resumed run's report: the same bounds
    assert sum(key.startswith("cycle/") for key in merged["buckets"]) == RECENT_RECORDS
    assert len(merged["phase_segments"]) == RECENT_RECORDS


def test_a_fresh_fit_of_the_same_account_drops_the_earlier_fits_forecast_and_carried_run():
    # sweep B: a second fit of one EnergyLogger reused the first fit's forecast, and after a resumed fit,
    # added the resumed run to a fresh one
    clock = ManualClock()
    account = account_with(clock)
    account.start([constant_chain("cpu", 10.0)])
    account.begin_training(lambda: 0)
    account.mark(stage="train", phase="burst", epoch=0)
    clock.now += 1.0
    state = account.state_dict()
    account.prediction = {"total_steps": 32.0}
    account.stop()
    account.load_state_dict(state)  # before a fit: that fit is a resume
    account.start([constant_chain("cpu", 10.0)])
    assert account.resumed_runs == 1 and account.carried is not None and account.prediction is None
    assert account.metered_kwh() == pytest.approx(10.0 / 3.6e6)
    account.stop()
    account.start([constant_chain("cpu", 10.0)])  # no checkpoint loaded: a new run
    assert account.resumed_runs == 0 and account.carried is None and account.prediction is None
    assert account.metered_kwh() == 0.0
    account.load_state_dict(state)  # during a fit (strategies that restore after set-up): applies to it
    assert account.carried is not None
    account.stop()
    account.start([constant_chain("cpu", 10.0)])
    assert account.carried is None and account.resumed_runs == 0
    account.stop()


def test_a_run_no_meter_counted_has_null_energy_and_logs_no_energy_figure_with_one_warning():
    # sweep B: with no working meter the loggers got energy/total_kwh 0.0 and the JSON "energy_kwh": 0.0
    import json

    messages: list[str] = []
    clock = ManualClock()
    account = account_with(clock, warn=messages.append)
    account.start([])  # nothing metered on this machine (cpu="none", ram="none", no GPU)
    account.begin_training(lambda: 1)
    account.mark(stage="train", phase="burst", epoch=0)
    account.batch_started(torch.zeros(4, 3))
    clock.now += 2.0
    metrics, forecast = account.epoch_metrics(0, 10.0)
    assert forecast is None and not any(name.endswith(("_kwh", "_co2_kg", "_cost")) for name in metrics)
    assert account.step_metrics() is None and account.progress_text() == "n/a"
    report = account.report("complete", "EUR")
    total = json.loads(json.dumps(report))["total"]
    assert total["energy_kwh"] is None and total["avg_power_w"] is None and total["energy_method"] == NONE
    assert total["energy_kwh_by_component"] == {"gpu": None, "cpu": None, "ram": None}
    assert total["duration_s"] == 2.0 and total["samples"] == 4
    assert len(messages) == 1 and "no meter counted any energy" in messages[0]
    account.stop()


def test_the_meter_startup_stage_is_kept_out_of_the_run():
    from lightning_pulse.energy.ledger import STARTUP_KEY, STARTUP_STAGE

    ledger = EnergyLedger()
    ledger.begin(0.0, 1000.0, reading())
    ledger.mark(0.0, 1000.0, stage="train", phase="burst", epoch=0)
    ledger.mark(1.0, 1001.0, stage=STARTUP_STAGE)
    ledger.mark(4.0, 1004.0, stage="other", phase=None, epoch=None)
    ledger.record(5.0, 1005.0, reading(cpu=50.0))  # 10 W throughout
    buckets = ledger.snapshot(5.0)["buckets"]
    assert buckets["total"]["seconds"] == 2.0 and buckets["total"]["cpu_j"] == pytest.approx(20.0)
    assert buckets[STARTUP_KEY]["seconds"] == 3.0 and buckets[STARTUP_KEY]["cpu_j"] == pytest.approx(30.0)
    assert buckets["phase/burst"]["seconds"] == 1.0 and buckets["epoch/0"]["cpu_j"] == pytest.approx(10.0)


def test_the_runs_reading_leaves_out_the_meter_startup_energy_and_seconds():
    # sweep 20d: the step read-outs used every joule the meters counted, the start-up wait's too
    from lightning_pulse.energy.ledger import STARTUP_STAGE

    ledger = EnergyLedger()
    ledger.begin(0.0, 0.0, reading(cpu=5.0))  # a meter's zero point is no energy of the run
    ledger.mark(0.0, 0.0, stage="train")
    ledger.record(2.0, 2.0, reading(cpu=45.0))  # 20 W
    ledger.mark(2.0, 2.0, stage=STARTUP_STAGE)
    ledger.mark(5.0, 5.0, stage="train")
    ledger.record(6.0, 6.0, reading(cpu=245.0))  # 50 W: 150 J in the 3 s start-up, 50 J in the run's 1 s
    joules, seconds = ledger.run_reading
    assert (joules, seconds) == (pytest.approx(90.0), pytest.approx(3.0))  # a run's power: 30 W, not 40 W
    assert joules == pytest.approx(ledger.snapshot(6.0)["buckets"]["total"]["cpu_j"])  # the report's total
    assert ledger.estimate_joules(7.0) == pytest.approx(90.0 + 50.0)  # grows from the run's figure


class SlowToStart(ConstantPowerMeter):
    """codecarbon's background start in miniature: its zero point until :meth:`settle`, which takes
    ``startup_s`` seconds of ``clock``; then it counts from its own start."""

    def __init__(self, watts: float, clock: ManualClock, startup_s: float) -> None:
        super().__init__("cpu", watts)
        self.clock, self.startup_s, self.started = clock, startup_s, False

    @property
    def starting(self) -> bool:
        return not self.started

    def settle(self, timeout: float) -> None:
        if not self.started:
            self.clock.now += self.startup_s
            self.started = True

    def read_joules(self, now: float) -> float:
        return super().read_joules(now) if self.started else 0.0


def test_step_figures_wait_for_a_starting_meter_and_leave_its_startup_out_of_the_run():
    # sweep 20d: kwh_so_far was logged as 0.0 while codecarbon started, then held the start-up wait's energy
    # (meter_startup, outside the report's total): 25x the total on a first fit
    clock, steps = ManualClock(), [0]
    meter = SlowToStart(30.0, clock, startup_s=6.0)
    account = account_with(clock)
    account.start([MeterChain("cpu", [("slow", lambda: meter)], print)])
    account.begin_training(lambda: steps[0])
    account.mark(stage="train", phase="burst", cycle=0, epoch=0)
    logged = []
    for _ in range(4):
        if steps[0] == 2:  # the first epoch ends: it waits 6 s for the start; 240 J over 8 s, 60 J the run's
            account.epoch_metrics(0, total_steps=4)
            account.mark(epoch=1)
        account.batch_started(torch.zeros(4, 3))
        clock.now += 1.0
        steps[0] += 1
        account.batch_ended()
        if steps[0] == 4:
            account.kwh_now()  # a reading after the last step: 60 J more
        logged.append(account.step_metrics())
    assert logged[:2] == [None, None]  # nothing counted yet: no 0 kWh that reads as measured
    assert logged[2] == {"energy/kwh_so_far": pytest.approx(60.0 / 3.6e6)}
    assert logged[3] == {
        "energy/kwh_so_far": pytest.approx(120.0 / 3.6e6),
        "energy/power_w": pytest.approx(30.0),
    }

    account.end_training()
    report = account.report("complete", "EUR")
    clock.now += 5.0  # the fit's shut-down after the report
    account.stop()
    assert report["total"]["energy_kwh"] == pytest.approx(120.0 / 3.6e6)
    assert report["meter_startup"]["energy_kwh"] == pytest.approx(180.0 / 3.6e6)
    assert account.energy_so_far_kwh() == pytest.approx(report["total"]["energy_kwh"])
