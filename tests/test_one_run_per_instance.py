"""One callback instance, one training run: a second fit of an instance is refused before its first step,
a resume into it is not, and neither is a Tuner search."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder, ModelCheckpoint
from lightning.pytorch.tuner import Tuner

from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
from lightning_pulse import GradientCache, HardSampleReplay, PulseCycle, ScheduledPrune, StabilityGuard
from lightning_pulse.errors import PulseRefusal
from tests.conftest import stop_after_epochs, trainer_kwargs

CYCLE = dict(burst=6, replay=6, maintain=2, warmup=0.1, anneal=0.1, maintain_eval="none")


def _data():
    return MNIST1DDataModule(num_samples=600, batch_size=64)


def _each_callback():
    return {
        "PulseCycle": lambda: [PulseCycle(**CYCLE)],
        "HardSampleReplay": lambda: [PulseCycle(**CYCLE), HardSampleReplay()],
        "GradientCache": lambda: [GradientCache()],
        "StabilityGuard": lambda: [StabilityGuard()],
        "ScheduledPrune": lambda: [ScheduledPrune(final_sparsity=0.5, every=5)],
    }


@pytest.mark.parametrize("name", list(_each_callback()))
def test_a_second_fit_of_an_instance_is_refused_on_the_same_trainer_and_on_a_new_one(name):
    callbacks = _each_callback()[name]()
    trainer = pl.Trainer(callbacks=callbacks, max_epochs=1, **trainer_kwargs())
    trainer.fit(MNIST1DClassifier(), _data())
    first = trainer.global_step
    assert first > 0
    # the same Trainer asked for more epochs: it used to continue a clock planned for the first run (or, with
    # step-saving replay, to read the first plan's max_steps back and train nothing)
    trainer.fit_loop.max_epochs = 2
    with pytest.raises(PulseRefusal, match=rf"^{name}: this instance already trained a run .*ckpt_path"):
        trainer.fit(MNIST1DClassifier(), _data())
    assert trainer.global_step == first
    # a loop over folds that reuses the instances: refused too, before the first step
    fold = pl.Trainer(callbacks=callbacks, max_epochs=1, **trainer_kwargs())
    with pytest.raises(PulseRefusal, match=rf"^{name}: this instance already trained a run"):
        fold.fit(MNIST1DClassifier(), _data())
    assert fold.global_step == 0


def test_a_resume_into_the_same_instances_is_not_a_second_run(tmp_path):
    callbacks = [PulseCycle(**CYCLE), HardSampleReplay(), StabilityGuard()]
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    kwargs = trainer_kwargs(enable_checkpointing=True)
    trainer = pl.Trainer(callbacks=[*callbacks, checkpoint], max_epochs=1, **kwargs)
    trainer.fit(MNIST1DClassifier(), _data())
    resumed = pl.Trainer(callbacks=[*callbacks, ModelCheckpoint(dirpath=tmp_path)], max_epochs=2, **kwargs)
    resumed.fit(MNIST1DClassifier(), _data(), ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.global_step > trainer.global_step


def test_a_tuner_search_is_refused_by_hard_sample_replay_and_not_counted_as_a_run_by_the_others(tmp_path):
    torch.manual_seed(0)
    # the search saves (and removes) a checkpoint in `default_root_dir`: the working directory by default,
    # which another pytest-xdist worker's test sees written into it
    with_replay = pl.Trainer(
        callbacks=[PulseCycle(**CYCLE), HardSampleReplay()],
        max_epochs=2,
        **trainer_kwargs(default_root_dir=tmp_path),
    )
    with pytest.raises(
        PulseRefusal, match=r"^HardSampleReplay does not take part in a Tuner search: .*LearningRate"
    ):
        Tuner(with_replay).lr_find(
            MNIST1DClassifier(), datamodule=_data(), num_training=10, update_attr=False
        )
    # the others go through the search (it restores their state from before its trials) and then train
    cycle, guard = PulseCycle(**CYCLE), StabilityGuard()
    trainer = pl.Trainer(callbacks=[cycle, guard], max_epochs=2, **trainer_kwargs(default_root_dir=tmp_path))
    model = MNIST1DClassifier()
    Tuner(trainer).lr_find(model, datamodule=_data(), num_training=10, update_attr=False)
    trainer.fit(model, _data())
    plain = pl.Trainer(max_epochs=2, **trainer_kwargs())
    plain.fit(MNIST1DClassifier(), _data())
    assert trainer.global_step == plain.global_step  # the trials left no step behind
    assert sum(cycle.clock.steps_by_phase.values()) == plain.global_step  # the clock counts this run only
    assert cycle.clock.steps_by_phase["replay"] > 0


def _energy_logger(report_dir):
    from lightning_pulse import EnergyLogger, MeterConfig

    return EnergyLogger(
        report_dir=str(report_dir), cpu="constant", ram="none", meters=MeterConfig(cpu_watts=50)
    )


def test_energy_logger_forecasts_the_steps_its_report_counts_on_a_second_fit_and_on_a_resume(tmp_path):
    """Held-out sweep: EnergyLogger may train a second fit of the same Trainer (more max_epochs); its report
    counts that fit only (a new run) but forecast the global run's steps (64 for 32: a 1.9x error on identical
    epochs). A resume carries the ledger, so there the whole run is forecast, as the report counts it."""
    energy = _energy_logger(tmp_path / "again")
    trainer = pl.Trainer(callbacks=[energy], max_epochs=2, **trainer_kwargs())
    trainer.fit(MNIST1DClassifier(), _data())
    first = energy.report["total"]["steps"]
    assert energy.report["prediction"]["total_steps"] == first == trainer.global_step
    trainer.fit_loop.max_epochs = 4
    trainer.fit(trainer.lightning_module, _data())
    assert energy.report["total"]["steps"] == trainer.global_step - first == first
    assert energy.report["prediction"]["total_steps"] == first
    # the energy too: this fit's two epochs, scaled from its first (on batches: a review found a forecast of
    # the steps alone passing while the kWh was scaled over the whole run's batches)
    prediction = energy.report["prediction"]
    basis_kwh = float(prediction["basis"].split(", ")[-1].removesuffix(" kWh"))
    assert prediction["energy_kwh"] == pytest.approx(2 * basis_kwh, rel=1e-4), prediction

    # a checkpoint from before the first forecast: the resumed fit forecasts, on the carried ledger
    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    kwargs = trainer_kwargs(enable_checkpointing=True, default_root_dir=str(tmp_path))
    run = pl.Trainer(callbacks=[_energy_logger(tmp_path / "run"), every], max_epochs=2, **kwargs)
    run.fit(MNIST1DClassifier(), _data())
    assert run.callbacks[0].report["prediction"]["total_steps"] == run.global_step
    resumed_energy = _energy_logger(tmp_path / "resumed")
    resumed = pl.Trainer(callbacks=[resumed_energy], max_epochs=2, **kwargs)
    resumed.fit(MNIST1DClassifier(), _data(), ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt"))
    report = resumed_energy.report
    assert report["prediction"]["total_steps"] == report["total"]["steps"] == resumed.global_step


class _FailsFirstStep(MNIST1DClassifier):
    """A ``training_step`` with a bug in it until ``fixed`` (a notebook: fix the cell, fit again)."""

    fixed = False

    def training_step(self, batch, batch_idx):
        if not self.fixed:
            raise RuntimeError("a typo in training_step")
        return super().training_step(batch, batch_idx)


def test_a_fit_refused_at_train_start_is_named_as_one_that_trained_nothing_on_a_new_trainer():
    """Held-out sweep: PulseCycle refused a run bounded by max_time alone at train start, after StabilityGuard
    and GradientCache had started; the user took its way out (max_epochs) with the same callbacks and was
    refused again: "already trained a run ... or continue a saved run with ckpt_path", of a fit that took no
    step and saved nothing."""
    callbacks = [StabilityGuard(), GradientCache(), PulseCycle(**CYCLE)]
    unbounded = pl.Trainer(callbacks=callbacks, max_epochs=-1, max_time={"seconds": 60}, **trainer_kwargs())
    with pytest.raises(
        PulseRefusal, match=r"^PulseCycle: `warmup`=0.1 and `anneal`=0.1 are shares of the run"
    ):
        unbounded.fit(MNIST1DClassifier(arch="mlp"), _data())
    assert unbounded.global_step == 0
    del unbounded  # the earlier Trainer may be gone by the next fit
    bounded = pl.Trainer(callbacks=callbacks, max_epochs=1, **trainer_kwargs())
    with pytest.raises(PulseRefusal) as refused:
        bounded.fit(MNIST1DClassifier(arch="mlp"), _data())
    message = str(refused.value)
    assert message.startswith(
        "StabilityGuard: this instance's earlier trainer.fit stopped before its first optimizer step"
    )
    assert (
        "Create new callbacks" in message and "ckpt_path" not in message and "already trained" not in message
    )
    assert bounded.global_step == 0


def test_a_fit_that_raised_in_its_first_training_step_is_named_as_one_that_trained_nothing_on_the_same_trainer():
    cycle = PulseCycle(**CYCLE)
    trainer = pl.Trainer(callbacks=[cycle], max_epochs=1, **trainer_kwargs())
    model = _FailsFirstStep(arch="mlp")
    with pytest.raises(RuntimeError, match="a typo"):
        trainer.fit(model, _data())
    model.fixed = True
    with pytest.raises(
        PulseRefusal, match=r"^PulseCycle: this instance's earlier trainer.fit stopped before"
    ) as refused:
        trainer.fit(model, _data())
    assert "ckpt_path" not in str(refused.value)
    # a fit that took steps before it raised trained a run: that refusal is unchanged
    stepped = PulseCycle(**CYCLE)
    trainer = pl.Trainer(callbacks=[stepped, _RaisesAtStep(3)], max_epochs=1, **trainer_kwargs())
    with pytest.raises(RuntimeError, match="at step 3"):
        trainer.fit(MNIST1DClassifier(arch="mlp"), _data())
    again = pl.Trainer(callbacks=[stepped], max_epochs=1, **trainer_kwargs())
    with pytest.raises(PulseRefusal, match=r"^PulseCycle: this instance already trained a run .*ckpt_path"):
        again.fit(MNIST1DClassifier(arch="mlp"), _data())


class _RaisesAtStep(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError(f"at step {self.step}")


def test_a_fast_dev_run_before_the_real_fit_is_named_in_the_refusal():
    callbacks = [PulseCycle(**CYCLE), GradientCache(), StabilityGuard()]
    smoke = pl.Trainer(callbacks=callbacks, fast_dev_run=True, **trainer_kwargs())
    smoke.fit(MNIST1DClassifier(arch="mlp"), _data())
    assert smoke.global_step == 1
    real = pl.Trainer(callbacks=callbacks, max_epochs=1, **trainer_kwargs())
    with pytest.raises(
        PulseRefusal, match=r"^PulseCycle: this instance ran a fast_dev_run smoke test"
    ) as refused:
        real.fit(MNIST1DClassifier(arch="mlp"), _data())
    assert "the real fit needs new callbacks" in str(refused.value) and "ckpt_path" not in str(refused.value)


def _finder(name):
    if name == "BatchSizeFinder":
        return BatchSizeFinder(init_val=32, max_trials=1, steps_per_trial=2)
    return LearningRateFinder(num_training_steps=4, update_attr=False)


def _mlp():
    return MNIST1DClassifier(arch="mlp", width=32)


def _zero_share(model):
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return sum(int((w == 0).sum()) for w in weights) / sum(w.numel() for w in weights)


@pytest.mark.parametrize("finder", ["BatchSizeFinder", "LearningRateFinder"])
def test_a_finder_callback_does_not_let_an_instance_train_a_second_fold(finder, tmp_path):
    """Held-out sweep: with a finder in Trainer(callbacks=...), a reused instance trained a second fold
    silently (ScheduledPrune left fold 2's model unpruned while reporting sparsity 0.500, PulseCycle's clock
    carried on from fold 1). The finder's restore of the checkpoint it saved before its trials is no resume:
    a second fit is refused as without the finder, and a fresh instance per fold trains and prunes."""
    prune, cycle, cache, guard = (
        ScheduledPrune(final_sparsity=0.5, every=2),
        PulseCycle(**CYCLE),
        GradientCache(),
        StabilityGuard(),
    )

    def trainer(callbacks):
        return pl.Trainer(
            callbacks=[_finder(finder), *callbacks], max_steps=16, **trainer_kwargs(default_root_dir=tmp_path)
        )

    first, model = trainer([prune, cycle, cache, guard]), _mlp()
    first.fit(model, _data())
    assert first.global_step == 16 and _zero_share(model) > 0.45
    for reused in (prune, cycle, cache, guard):  # a loop over folds: a new Trainer and model each time
        fold = trainer([reused])
        with pytest.raises(
            PulseRefusal, match=rf"^{type(reused).__name__}: this instance already trained a run"
        ):
            fold.fit(_mlp(), _data())
        assert fold.global_step == 0
    first.fit_loop.epoch_loop.max_steps = 24  # the same Trainer asked for more steps
    with pytest.raises(
        PulseRefusal, match=r"^ScheduledPrune: this instance already trained a run .*ckpt_path"
    ):
        first.fit(_mlp(), _data())
    assert first.global_step == 16
    for _ in range(2):  # new callbacks for each fold: each trains and prunes its own model
        fold, model = trainer([ScheduledPrune(final_sparsity=0.5, every=2), PulseCycle(**CYCLE)]), _mlp()
        fold.fit(model, _data())
        assert fold.global_step == 16 and _zero_share(model) > 0.45


@pytest.mark.parametrize("finder", ["BatchSizeFinder", "LearningRateFinder"])
def test_a_resume_with_a_finder_attached_is_still_a_resume(finder, tmp_path):
    """A resume with a finder attached loads the saved run's state, then the finder's own pre-trial state: the
    first makes it a resume, on a new Trainer (ckpt_path=PATH) and on the same one (ckpt_path="last")."""
    callbacks = [ScheduledPrune(final_sparsity=0.5, every=2), PulseCycle(**CYCLE)]
    kwargs = trainer_kwargs(enable_checkpointing=True, default_root_dir=tmp_path)

    def trainer(epochs, *extra):
        saving = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True)
        return pl.Trainer(
            callbacks=[_finder(finder), *callbacks, saving, *extra], max_epochs=epochs, **kwargs
        )

    first = trainer(2, stop_after_epochs(1))
    first.fit(_mlp(), _data())
    assert first.global_step > 0
    # a new Trainer resuming the saved run (the finder runs again before it)
    resumed, model = trainer(2), _mlp()
    resumed.fit(model, _data(), ckpt_path=str(tmp_path / "checkpoints" / "last.ckpt"))
    assert resumed.global_step == 2 * first.global_step and _zero_share(model) > 0.45
    # a second fit of the same Trainer from its last checkpoint
    resumed.fit_loop.max_epochs = 3
    resumed.fit(model, _data(), ckpt_path="last")
    assert resumed.global_step == 3 * first.global_step
