"""A callback's state across the runs of one script: a checkpoint evaluated by validate, test or predict is no
resume of the fit that follows; a GreenWindow is one run's, like the other schedulers; a PulseCycle checkpoint
resumes only into the cycle order it ran; the end line of a step-saving run that stopped early says so."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
from lightning_pulse import (
    EnergyLogger,
    GreenWindow,
    HardSampleReplay,
    HyperConnectionMonitor,
    PulseCycle,
    ScheduledPrune,
    SimulatedClock,
    StabilityGuard,
)
from lightning_pulse.callbacks.simulated_step_time import SimulatedStepTime
from lightning_pulse.errors import PulseRefusal
from lightning_pulse.phase import Phase, PhaseClock
from tests.conftest import trainer_kwargs
from tests.test_green_window import DE_JUNE, START, STEP_S
from tests.test_mhc_monitor import TwoLayerModule, TwoLayerNet

CYCLE = dict(burst=6, replay=4, maintain=2, warmup=0.1, anneal=0.1, probe_batches=1)


class Predicting(MNIST1DClassifier):
    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(1)


class PredictingData(MNIST1DDataModule):
    def predict_dataloader(self):
        return self.test_dataloader()


def _suite():
    return [
        PulseCycle(**CYCLE),
        HardSampleReplay(),
        ScheduledPrune(final_sparsity=0.5, every=5),
        StabilityGuard(warmup=5),
        EnergyLogger(
            country_iso_code="DEU", gpu="none", cpu="constant", ram="none", meters={"cpu_watts": 100.0}
        ),
    ]


def _data():
    return PredictingData(num_samples=600, batch_size=64)


def _figures(trainer, callbacks):
    cycle, replay, prune, _, energy = callbacks
    return {
        "global_step": trainer.global_step,
        "clock_steps": dict(cycle.clock.steps_by_phase),
        "reasons": [change.reason for change in cycle.history],
        "planned_steps": cycle.plan.total_steps,
        "replay_metrics": replay.metrics(),
        "prune_events": [(event["step"], round(event["sparsity"], 4)) for event in prune.events],
        "energy_steps": energy.report["total"]["steps"],
        "energy_samples": energy.report["total"]["samples"],
    }


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_a_checkpoint_evaluated_before_a_fresh_fit_is_not_resumed_by_that_fit(stage, tmp_path):
    """Lightning loads the callbacks' states at ``validate(ckpt_path=...)`` (test, predict) too; the fit that
    followed (no ckpt_path, step 0) resumed them: a clock 'resuming' at step 30 whose phases summed past the
    run, the checkpoint's prune events skipped, a replay plan of the rest of the old run, an energy report of
    both. It must train as a fit of fresh callbacks does."""
    # the energy reports go to tmp_path (a Trainer without a logger writes them in its default_root_dir)
    kwargs = trainer_kwargs(enable_checkpointing=True, limit_val_batches=2, default_root_dir=tmp_path)
    torch.manual_seed(0)
    saving = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=12, save_top_k=-1)
    pl.Trainer(callbacks=[*_suite(), saving], max_epochs=6, **kwargs).fit(Predicting(arch="mlp"), _data())
    (checkpoint,) = tmp_path.glob("*step=12.ckpt")

    figures = {}
    for evaluated in (False, True):
        callbacks = _suite()
        kwargs = trainer_kwargs(limit_val_batches=2, default_root_dir=tmp_path / str(evaluated))
        trainer = pl.Trainer(callbacks=callbacks, max_epochs=6, **kwargs)
        if evaluated:  # the checkpoint's weights (and callback states) are loaded for the evaluation
            evaluate = getattr(trainer, stage)
            evaluate(Predicting(arch="mlp"), _data(), ckpt_path=str(checkpoint))
        torch.manual_seed(1)
        trainer.fit(Predicting(arch="mlp"), _data())
        figures[evaluated] = _figures(trainer, callbacks)
    fresh = figures[False]
    assert sum(fresh["clock_steps"].values()) == fresh["global_step"] == fresh["energy_steps"]
    assert "resume" not in fresh["reasons"] and len(fresh["prune_events"]) >= 2
    assert figures[True] == fresh


def test_an_evaluated_checkpoint_does_not_let_a_second_fit_of_the_instances_through(tmp_path):
    """The one-run-per-instance refusal counted the evaluation's load as a resume of the next fit."""
    kwargs = trainer_kwargs(enable_checkpointing=True, limit_val_batches=2)
    cycle = PulseCycle(**CYCLE)
    trainer = pl.Trainer(
        callbacks=[cycle, ModelCheckpoint(dirpath=tmp_path, save_last=True)], max_epochs=1, **kwargs
    )
    trainer.fit(Predicting(arch="mlp"), _data())
    history = cycle.history
    trainer.validate(Predicting(arch="mlp"), _data(), ckpt_path=str(tmp_path / "last.ckpt"))
    assert cycle.history == history  # the evaluation left the finished run's state as it was
    trainer.fit_loop.max_epochs = 2  # more to train: the fit reaches its start
    with pytest.raises(PulseRefusal, match=r"^PulseCycle: this instance already trained a run"):
        trainer.fit(Predicting(arch="mlp"), _data())
    # a state loaded by hand, outside a running trainer, still applies (the caller means it)
    fresh = PulseCycle(**CYCLE)
    fresh.load_state_dict(
        torch.load(tmp_path / "last.ckpt", weights_only=False)["callbacks"][cycle.state_key]
    )
    assert fresh.history == history


class Evaluated(TwoLayerModule):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", (self.net(x) - y).pow(2).mean())


def test_a_monitor_evaluating_a_checkpoint_before_a_fresh_fit_keeps_only_that_fit_s_history(tmp_path):
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(48, 5, 16, generator=generator), torch.randn(48, 5, 16, generator=generator)
    )
    kwargs = trainer_kwargs(limit_val_batches=1)
    torch.manual_seed(0)
    first = pl.Trainer(callbacks=[HyperConnectionMonitor(every_n_steps=2)], max_steps=6, **kwargs)
    first.fit(Evaluated(TwoLayerNet("hc")), DataLoader(data, batch_size=8))
    first.save_checkpoint(tmp_path / "six.ckpt")
    monitor = HyperConnectionMonitor(every_n_steps=2)
    trainer = pl.Trainer(callbacks=[monitor], max_steps=4, **kwargs)
    trainer.validate(
        Evaluated(TwoLayerNet("hc")), DataLoader(data, batch_size=8), ckpt_path=tmp_path / "six.ckpt"
    )
    trainer.fit(Evaluated(TwoLayerNet("hc")), DataLoader(data, batch_size=8))
    assert [entry["step"] for entry in monitor.history] == [0, 2]  # not the checkpoint's 0, 2, 4 first


def _green(clock):
    return GreenWindow(signal=DE_JUNE, when_dirty="pause", max_delay=1.0, expected_duration="8h", clock=clock)


def test_a_green_window_reused_for_a_second_fit_is_refused_and_a_resume_into_it_is_not(tmp_path):
    """Reused for a second fold, it carried the first fold's spent delay budget (the second never waited) and
    reported both folds' compute as the second's, beside an EnergyLogger that reported the second alone."""
    clock = SimulatedClock(START)
    green = _green(clock)
    x = torch.randn(320, 40, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=32)
    kwargs = trainer_kwargs(limit_val_batches=0, default_root_dir=tmp_path, enable_checkpointing=True)

    def trainer(steps, *extra):
        return pl.Trainer(
            callbacks=[SimulatedStepTime(clock, STEP_S), green, *extra], max_steps=steps, **kwargs
        )

    first = trainer(24, ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True))
    first.fit(MNIST1DClassifier(arch="mlp"), data)
    assert green.report["summary"]["waited_s"] > 0  # the first fold waited for a cleaner hour
    fold = trainer(24)
    with pytest.raises(PulseRefusal, match=r"^GreenWindow: this instance already trained a run .*folds"):
        fold.fit(MNIST1DClassifier(arch="mlp"), data)
    assert fold.global_step == 0
    resumed = trainer(48, _LoadsItsOwnStateMidRun(green))
    resumed.fit(MNIST1DClassifier(arch="mlp"), data, ckpt_path=str(tmp_path / "ck" / "last.ckpt"))
    assert resumed.global_step == 48
    # a review: a state loaded during a fit (as a rollback loads one) let the next fit of the instance through
    with pytest.raises(PulseRefusal, match=r"^GreenWindow: this instance already trained a run"):
        trainer(60).fit(MNIST1DClassifier(arch="mlp"), data)


class _LoadsItsOwnStateMidRun(Callback):
    def __init__(self, callback) -> None:
        self.callback = callback

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 30:
            self.callback.load_state_dict(self.callback.state_dict())


def _order_checkpoint(tmp_path, steps):
    saved = PulseCycle(burst=6, replay=4, maintain=3, warmup=0, anneal=0, maintain_eval="none")
    trainer = pl.Trainer(callbacks=[saved], max_steps=steps, **trainer_kwargs(limit_val_batches=0))
    trainer.fit(MNIST1DClassifier(arch="mlp"), MNIST1DDataModule(num_samples=600, batch_size=64))
    trainer.save_checkpoint(tmp_path / "saved.ckpt")
    return saved


@pytest.mark.parametrize(
    ("steps", "order", "phase"),
    [(12, ["burst", "replay"], Phase.MAINTAIN), (8, ["burst", "maintain", "replay"], Phase.REPLAY)],
    ids=["phase-dropped", "reshuffled"],
)
def test_a_resume_into_another_cycle_order_is_refused_before_the_first_step(tmp_path, steps, order, phase):
    """Saved in maintain and resumed with maintain left out: KeyError a step into the resume. Saved in replay
    and resumed with the order reshuffled: replay ran twice in a row and that cycle's maintain was skipped."""
    saved = _order_checkpoint(tmp_path, steps)
    assert saved.phase is phase
    cycle = PulseCycle(
        burst=6, replay=4, maintain=3 if "maintain" in order else 0, order=order, warmup=0, anneal=0
    )
    trainer = pl.Trainer(callbacks=[cycle], max_steps=30, **trainer_kwargs(limit_val_batches=0))
    with pytest.raises(
        PulseRefusal,
        match=rf"^PulseCycle: the checkpoint's clock ran `order`=\['burst', 'replay', 'maintain'\], and this "
        rf"one's `order` is \[{', '.join(repr(name) for name in order)}\].*Resume with `order`=.*ckpt_path",
    ):
        trainer.fit(
            MNIST1DClassifier(arch="mlp"),
            MNIST1DDataModule(num_samples=600, batch_size=64),
            ckpt_path=str(tmp_path / "saved.ckpt"),
        )
    assert trainer.global_step == 0


def test_a_clock_state_saved_before_the_order_was_is_checked_on_its_phase_s_place():
    saved = PhaseClock({"burst": 2, "replay": 2, "maintain": 2})
    for _ in range(5):  # two steps of burst, two of replay, one of maintain
        saved.advance(1, total_steps=100)
    assert saved.phase is Phase.MAINTAIN
    state = saved.state_dict()
    del state["order"]
    reshuffled = PhaseClock({"burst": 2, "replay": 2, "maintain": 2}, order=["burst", "maintain", "replay"])
    with pytest.raises(ValueError, match=r"ran a cycle with 'maintain' at place 3, and this one's `order`"):
        reshuffled.load_state_dict(state)
    same = PhaseClock({"burst": 2, "replay": 2, "maintain": 2})
    same.load_state_dict(state)
    assert same.phase is Phase.MAINTAIN and same.step == 5


def test_the_end_line_of_a_step_saving_run_stopped_early_says_it_stopped_before_its_plan(caplog):
    """With EarlyStopping (after min_steps) the line gave the share of the plain run's steps as if the run
    had been the planned one."""
    stop = EarlyStopping("val_loss", patience=0, min_delta=10.0)  # stops at its first check past min_steps
    callbacks = [PulseCycle(**CYCLE), HardSampleReplay(), stop]
    trainer = pl.Trainer(
        callbacks=callbacks, max_epochs=6, min_steps=20, **trainer_kwargs(limit_val_batches=2)
    )
    with caplog.at_level(logging.INFO):
        trainer.fit(MNIST1DClassifier(arch="mlp"), MNIST1DDataModule(num_samples=600, batch_size=64))
    plan = callbacks[0].plan
    assert trainer.global_step < plan.total_steps
    line = next(
        record.getMessage() for record in caplog.records if "optimizer steps, " in record.getMessage()
    )
    assert line.endswith(f"It stopped early: {plan.total_steps} steps ({plan.spent:.3f}) were planned.")
