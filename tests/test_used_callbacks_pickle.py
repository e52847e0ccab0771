"""EnergyLogger, ScheduledPrune and StabilityGuard after a fit: they pickle, deep-copy and keep no Trainer;
GreenWindow pickles and deep-copies after a fit whose last live reading timed out.

``ddp_spawn`` pickles the callbacks at every fit, and sweeps copy them. After one fit, EnergyLogger once held
its ledger's and sampler's locks, its sampler's event, its meters' closures and the Trainer; ScheduledPrune a
weak reference to the Trainer; a StabilityGuard fitted beside an EnergyLogger the logger's bound meter. A
reused EnergyLogger (allowed) then died under ``ddp_spawn`` with ``TypeError: cannot pickle
'_thread.RLock' object``, and a reused ScheduledPrune gave that raw error instead of its own refusal.
"""

from __future__ import annotations

import copy
import gc
import json
import pickle
import threading
import weakref

import lightning.pytorch as pl
import pytest

from lightning_pulse import (
    EnergyLogger,
    GreenWindow,
    MeterConfig,
    ScheduledPrune,
    SimulatedClock,
    StabilityGuard,
)
from lightning_pulse.callbacks.simulated_step_time import SimulatedStepTime
from lightning_pulse.energy.report import JSON_NAME
from tests.conftest import trainer_kwargs
from tests.ddp_workers import TwoGlooProcesses

BATCH = 64  # mnist1d_small's
# a short run's schedule: few, large cuts (said once, as a warning)
pytestmark = pytest.mark.filterwarnings("ignore:ScheduledPrune. with .every.")


def energy_logger(tmp_path) -> EnergyLogger:
    meters = MeterConfig(cpu_watts=10.0, sampling_period=0.05)
    return EnergyLogger(
        cpu="constant", gpu="none", ram="none", meters=meters, report_dir=str(tmp_path / "report")
    )


def test_used_callbacks_pickle_and_copy_with_their_figures_and_keep_no_trainer(mnist1d_small, tmp_path):
    energy = energy_logger(tmp_path)
    prune = ScheduledPrune(final_sparsity=0.5, start=1, end=3, every=1, probe_batches=0)
    guard = StabilityGuard(window=5, warmup=3, snapshot_every=2, rollback_margin=1)
    model, data = mnist1d_small(arch="mlp")
    callbacks = [energy, prune, guard]
    trainer = pl.Trainer(max_steps=4, callbacks=callbacks, **trainer_kwargs(default_root_dir=tmp_path))
    trainer.fit(model, data)
    assert energy.report is not None and prune.sparsity == 0.5
    for callback in callbacks:
        for restored in (pickle.loads(pickle.dumps(callback)), copy.deepcopy(callback)):
            assert type(restored) is type(callback)
    restored = pickle.loads(pickle.dumps(energy))
    assert restored.report == energy.report
    assert restored.energy_so_far_kwh() == energy.energy_so_far_kwh() > 0.0
    totals = [callback.state_dict()["snapshot"]["buckets"]["total"] for callback in (restored, energy)]
    assert totals[0]["cpu_j"] == totals[1]["cpu_j"] > 0.0 and totals[0]["samples"] == totals[1]["samples"]
    assert copy.deepcopy(prune).events == prune.events
    # the guard lets go of the logger's meter at the fit's end, but still reports that fit's wasted energy
    assert "stability/energy_wasted_kwh" in pickle.loads(pickle.dumps(guard)).metrics()
    # Lightning gives every callback the module's `log` and `log_dict` (they hold the module, and through it
    # the Trainer); nothing else of these callbacks may keep the finished Trainer, its model and data alive
    for callback in callbacks:
        del callback.log, callback.log_dict
    finished, logger = weakref.ref(trainer), weakref.ref(energy)
    del trainer, model, data, callbacks, restored, energy
    gc.collect()
    assert finished() is None
    assert logger() is None  # nor does the guard keep the EnergyLogger whose meter it read
    assert "stability/energy_wasted_kwh" in guard.metrics()


@pytest.mark.ddp
def test_a_used_energy_logger_fits_again_in_spawned_ranks_and_a_used_prune_refuses_by_name(
    mnist1d_small, tmp_path
):
    energy = energy_logger(tmp_path)
    prune = ScheduledPrune(final_sparsity=0.5, start=1, end=3, every=1, probe_batches=0)
    model, data = mnist1d_small(arch="mlp")
    kwargs = trainer_kwargs(default_root_dir=tmp_path / "first")
    pl.Trainer(max_steps=4, callbacks=[energy, prune], **kwargs).fit(model, data)

    # the launcher pickles the Trainer with its callbacks into each rank
    kwargs = trainer_kwargs(devices=2, strategy=TwoGlooProcesses(), default_root_dir=tmp_path / "second")
    model, data = mnist1d_small(arch="mlp")
    pl.Trainer(max_steps=3, callbacks=[energy], **kwargs).fit(model, data)
    report = json.loads((tmp_path / "report" / JSON_NAME).read_text())
    assert report["world_size"] == 2
    assert report["total"]["samples"] == 2 * 3 * BATCH  # the second fit only: two ranks, three steps each

    kwargs = trainer_kwargs(devices=2, strategy=TwoGlooProcesses(), default_root_dir=tmp_path / "third")
    model, data = mnist1d_small(arch="mlp")
    with pytest.raises(Exception, match="ScheduledPrune: this instance already trained a run"):
        pl.Trainer(max_steps=3, callbacks=[prune], **kwargs).fit(model, data)


def test_an_energy_logger_of_a_fit_that_raised_pickles_and_keeps_no_trainer(mnist1d_small, tmp_path):
    """Review of the 39th pass: its account's step reader was ``lambda: trainer.global_step``, kept after a
    fit that raised (no teardown follows): it did not pickle and held the Trainer, its model and data."""

    class _Fails(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 2:
                raise RuntimeError("trial failed")

    energy = energy_logger(tmp_path)
    model, data = mnist1d_small(arch="mlp")
    trainer = pl.Trainer(
        max_steps=6, callbacks=[energy, _Fails()], **trainer_kwargs(default_root_dir=tmp_path)
    )
    with pytest.raises(RuntimeError, match="trial failed"):
        trainer.fit(model, data)
    assert pickle.loads(pickle.dumps(energy)).report["status"] == "interrupted"
    del energy.log, energy.log_dict  # Lightning's, holding the module (see above)
    finished = weakref.ref(trainer)
    del trainer, model, data
    gc.collect()
    assert finished() is None


def test_the_shipped_suites_guard_and_replay_pickle_after_a_fit_and_keep_no_trainer(mnist1d_small, tmp_path):
    """A regression sweep of the 39th pass: beside PulseCycle and HardSampleReplay (steps mode), the guard's
    step record holds the HardSampleReplay, whose step-saving part kept the Trainer (and a weak reference to
    it, which does not pickle) and whose batch part kept the module: neither pickled after the fit, and the
    finished Trainer stayed alive."""
    from lightning_pulse import HardSampleReplay, PulseCycle

    model, data = mnist1d_small(arch="mlp")
    cycle = PulseCycle(burst=4, replay=3, maintain=2, warmup=0, anneal=0, maintain_eval="none")
    guard, replay = StabilityGuard(window=10, warmup=3), HardSampleReplay()
    callbacks = [cycle, guard, replay]
    trainer = pl.Trainer(max_steps=12, callbacks=callbacks, **trainer_kwargs(default_root_dir=tmp_path))
    trainer.fit(model, data)
    for callback in (guard, replay):
        assert type(pickle.loads(pickle.dumps(callback))) is type(callback)
    for callback in callbacks:
        del callback.log, callback.log_dict  # Lightning's, holding the module (see above)
    finished = weakref.ref(trainer)
    del trainer, model, data
    gc.collect()
    assert finished() is None


RELEASE = threading.Event()  # lets the hanging reading below return (a module's: the callable pickles)


class HangsAtItsSecondCall:
    """A live signal (picklable, as ``ddp_spawn`` needs) whose second call hangs until :data:`RELEASE`."""

    def __init__(self, clock: SimulatedClock) -> None:
        self.clock, self.calls = clock, 0

    def __call__(self) -> tuple[float, float]:
        self.calls += 1
        if self.calls == 2:
            RELEASE.wait(60.0)
        return self.clock.time(), 100.0 + self.calls


def test_a_green_window_whose_last_live_reading_timed_out_pickles_and_copies(mnist1d_small, tmp_path):
    """Review of the 41st pass: the call still out after a reading that timed out held a threading.Event, so
    after such a fit the GreenWindow no longer pickled nor deep-copied (``TypeError: cannot pickle
    '_thread.lock' object``). A copy's live signal has no call out: it asks its source again."""
    RELEASE.clear()
    clock = SimulatedClock("2020-06-15 00:00:00")
    green = GreenWindow(
        signal=HangsAtItsSecondCall(clock),
        when_dirty="pause",
        threshold=500.0,  # clean: a decision every hour (6 steps of 10 simulated minutes), at steps 0 and 6
        expected_duration="2h",
        clock=clock,
        options={"watts": 100.0, "report_dir": str(tmp_path), "signal_timeout": 5.0},
    )
    callbacks = [SimulatedStepTime(clock, 600.0), green]
    trainer = pl.Trainer(max_steps=12, callbacks=callbacks, **trainer_kwargs(default_root_dir=tmp_path))
    try:
        with pytest.warns(UserWarning, match="did not return within 5 s"):
            trainer.fit(*mnist1d_small(arch="mlp"))
        assert green.signal.live._late is not None and not green.signal.live._late.done.is_set()
        for restored in (pickle.loads(pickle.dumps(green)), copy.deepcopy(green)):
            live = restored.signal.live
            assert live._late is None and live.timeout_s == 5.0  # the bound reaches spawned ranks
            assert (live.times, live.values, live.failed) == (green.signal.live.times, [101.0], 1)
            assert live.observe(clock.time()) == (clock.time(), 103.0)  # asked again (its source's 3rd call)
    finally:
        RELEASE.set()
