"""Step-saving replay: light phases train full batches chosen from wider windows, so the run takes fewer steps."""

from __future__ import annotations

import json
import logging
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
from lightning_pulse import HardSampleReplay, PulseCycle
from lightning_pulse.core.step_plan import (
    epoch_steps,
    plan_steps,
    plan_summary,
    replay_steps_for_budget,
    window_size,
)
from lightning_pulse.errors import PulseRefusal
from lightning_pulse.phase import PhaseClock
from tests.conftest import trainer_kwargs
from tests.ddp_workers import TwoGlooProcesses

CYCLE = dict(burst=6, replay=6, maintain=2, warmup=0.1, anneal=0.1, maintain_eval="none")


class OneCycleClassifier(MNIST1DClassifier):
    """A module whose LR schedule is planned for the run's steps, as users write it."""

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-3)
        self.planned_total = int(self.trainer.estimated_stepping_batches)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=5e-3, total_steps=self.planned_total)
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


class ShuffleFreeData(MNIST1DDataModule):
    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=False)


class BatchLog(Callback):
    """Per batch: epoch, global step, the size the loader fetched and the size trained; validation steps."""

    def __init__(self) -> None:
        self.fetched: list[tuple[int, int, int]] = []
        self.windows: list[int] = []
        self.trained: list[int] = []
        self.validated_at: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.fetched.append((trainer.current_epoch, trainer.global_step, int(batch[0].shape[0])))

    def on_before_backward(self, trainer, pl_module, loss):
        replay = next(c for c in trainer.callbacks if isinstance(c, HardSampleReplay))
        self.trained.append(int(replay.trained_indices.numel()))
        self.windows.append(replay.offered_count)

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.validated_at.append(trainer.current_epoch)


def _parameters(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def test_onecycle_schedule_is_planned_for_the_saved_steps_and_never_stepped_past_its_total():
    pl.seed_everything(0)
    model, log = OneCycleClassifier(), BatchLog()
    trainer = pl.Trainer(
        callbacks=[PulseCycle(**CYCLE), HardSampleReplay(replay_fraction=0.5), log],
        max_epochs=4,
        **trainer_kwargs(),
    )
    trainer.fit(model, MNIST1DDataModule(num_samples=1000, batch_size=64))  # 12 batches of 64 per epoch
    plain_steps = 4 * 12
    # the schedule was told the planned total, which the run reached exactly (OneCycleLR raises past it)
    assert model.planned_total == trainer.global_step == trainer.max_steps < plain_steps
    schedule = trainer.lr_scheduler_configs[0].scheduler
    assert schedule.last_epoch == model.planned_total
    # every epoch is still one pass over the data, and validation ran at each epoch's end
    assert log.validated_at == [0, 1, 2, 3]
    assert [epoch for epoch, _, _ in log.fetched].count(0) < 12


def test_light_steps_train_full_batches_chosen_from_twice_as_many_samples():
    pl.seed_everything(0)
    log = BatchLog()
    trainer = pl.Trainer(
        callbacks=[
            log,
            PulseCycle(**CYCLE),
            HardSampleReplay(replay_fraction=0.5),
        ],  # log sees the fetched batch
        max_epochs=4,
        **trainer_kwargs(),
    )
    trainer.fit(MNIST1DClassifier(), MNIST1DDataModule(num_samples=1000, batch_size=64))
    cycle = next(c for c in trainer.callbacks if isinstance(c, PulseCycle))
    replay_steps = cycle.clock.steps_by_phase["replay"]
    assert replay_steps > 0
    fetched = [size for _, _, size in log.fetched]
    assert log.windows.count(128) >= replay_steps - 4  # an epoch's tail window may be short
    # a light step trains a full batch, never the whole window (never-scored samples included), and the
    # loader loads only that batch: the sampler cut the window before the samples were fetched
    assert max(log.trained) == max(fetched) == 64
    assert log.trained == fetched[: len(log.trained)]
    # the epochs' data is all offered: 4 passes over the 720 training samples
    assert sum(log.windows) == 4 * 720


@pytest.mark.parametrize("budget", [0.0, 1.0, 1.5, -0.2, True, "half"])
def test_a_budget_out_of_range_fails_at_construction_naming_the_field(budget):
    with pytest.raises(ValueError, match=r"^PulseCycle: `budget`="):
        PulseCycle(budget=budget)


def test_a_budget_sets_the_replay_length_and_the_run_spends_about_that_share(recwarn):
    pl.seed_everything(0)
    cycle = PulseCycle(**CYCLE, budget=0.7)
    trainer = pl.Trainer(
        callbacks=[cycle, HardSampleReplay(replay_fraction=0.5)], max_epochs=8, **trainer_kwargs()
    )
    trainer.fit(MNIST1DClassifier(), MNIST1DDataModule(num_samples=1000, batch_size=64))
    assert cycle.plan is not None and cycle.plan.plain_steps == 8 * 12
    spent = trainer.global_step / cycle.plan.plain_steps
    assert spent == pytest.approx(0.7, abs=0.05)
    assert cycle.clock.durations[cycle.clock.order[1]].amount != 6  # the replay length was derived
    assert not [w for w in recwarn if "is not met on this run" in str(w.message)]


def test_a_run_too_short_for_its_budget_says_so_at_fit_start(recwarn):
    # 12 plain steps: warm-up, the first burst and anneal train full batches, so 0.6 is out of reach
    trainer = pl.Trainer(
        callbacks=[PulseCycle(**CYCLE, budget=0.6), HardSampleReplay(replay_fraction=0.5)],
        max_epochs=1,
        **trainer_kwargs(),
    )
    trainer.fit(MNIST1DClassifier(), MNIST1DDataModule(num_samples=1000, batch_size=64))
    shortfall = [str(w.message) for w in recwarn if "is not met on this run" in str(w.message)]
    assert len(shortfall) == 1 and shortfall[0].startswith("PulseCycle: `budget`=0.6 is not met on this run")
    spent = trainer.global_step / 12
    assert f"({spent:.3f})" in shortfall[0] and spent > 0.65  # the figure it warned of is what the run spent
    assert "raise `budget` to at least" in shortfall[0]


def test_an_unreachable_budget_is_refused_before_the_first_step():
    trainer = pl.Trainer(
        callbacks=[PulseCycle(**CYCLE, budget=0.3), HardSampleReplay(replay_fraction=0.5)],
        max_epochs=2,
        **trainer_kwargs(),
    )
    with pytest.raises(
        PulseRefusal, match=r"^PulseCycle: `budget`=0.3 is below .* cannot spend less than 0.556"
    ):
        trainer.fit(MNIST1DClassifier(), MNIST1DDataModule(num_samples=1000, batch_size=64))
    assert trainer.global_step == 0


def test_a_budget_without_step_saving_replay_is_refused_before_the_first_step():
    trainer = pl.Trainer(
        callbacks=[PulseCycle(**CYCLE, budget=0.7), HardSampleReplay(mode="batch")],
        max_epochs=2,
        **trainer_kwargs(),
    )
    with pytest.raises(PulseRefusal, match=r"^PulseCycle: `budget`=0.7 .* HardSampleReplay in mode='steps'"):
        trainer.fit(MNIST1DClassifier(), MNIST1DDataModule(num_samples=1000, batch_size=64))
    assert trainer.global_step == 0


@pytest.mark.parametrize(
    ("cycle", "trainer_extra", "match"),
    [
        (dict(burst="5s", replay="3s", maintain=0), {}, "durations, which here are in seconds"),
        (CYCLE, {"limit_train_batches": 0.5}, "`limit_train_batches`=0.5"),
        (CYCLE, {"limit_train_batches": 1}, "`limit_train_batches`=1 cuts"),  # one batch, not all (1.0)
        # not the limit Lightning made of it; sweep-flags: the way out said "drop it"
        (CYCLE, {"overfit_batches": 2}, "`overfit_batches`=2 cuts short; drop `overfit_batches` or"),
        (CYCLE, {"fast_dev_run": True}, "`fast_dev_run`=True cuts short; drop `fast_dev_run` or use"),
        (
            CYCLE,
            {"reload_dataloaders_every_n_epochs": 1},
            "`reload_dataloaders_every_n_epochs`=1 .* mode='batch'",
        ),
    ],
)
def test_what_steps_mode_cannot_plan_is_refused_at_fit_start(cycle, trainer_extra, match):
    trainer = pl.Trainer(
        callbacks=[PulseCycle(**cycle), HardSampleReplay()],
        max_epochs=2,
        **trainer_kwargs(**trainer_extra),
    )
    with pytest.raises(PulseRefusal, match=rf"^HardSampleReplay: mode='steps' .*{match}"):
        trainer.fit(MNIST1DClassifier(), MNIST1DDataModule(num_samples=1000, batch_size=64))
    assert trainer.global_step == 0


class _EndlessStream(IterableDataset):
    """The dataset's samples drawn at random without end, as a streaming source gives them."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        while True:
            yield self.dataset[int(torch.randint(len(self.dataset), (1,), generator=generator))]


class _EndlessData(MNIST1DDataModule):
    def train_dataloader(self):
        return DataLoader(_EndlessStream(self.train_set), batch_size=64)


def _given_to_fit(data: MNIST1DDataModule, loaders: str):
    """``fit``'s data arguments: ``data`` itself (its hook builds the DataLoader at the data set-up), or its
    training DataLoader built beforehand and given to ``fit`` (``"one"``; ``"two"``: twice, as a dict)."""
    if loaders == "hook":
        return {"datamodule": data}
    data.prepare_data()
    data.setup("fit")
    train = data.train_dataloader()
    return {"train_dataloaders": train if loaders == "one" else {"a": train, "b": data.train_dataloader()}}


@pytest.mark.parametrize("setting", [{"limit_train_batches": 12}, {"reload_dataloaders_every_n_epochs": 1}])
@pytest.mark.parametrize(
    ("data", "loaders", "match"),
    [
        pytest.param(_EndlessData, "one", "needs the dataset index .* an IterableDataset", id="stream-given"),
        pytest.param(_EndlessData, "hook", "needs the dataset index .* an IterableDataset", id="stream-hook"),
        pytest.param(MNIST1DDataModule, "two", "needs one training DataLoader, .* several", id="two-given"),
    ],
)
def test_a_loader_no_mode_can_track_is_refused_before_a_setting_whose_way_out_is_mode_batch(
    setting, data, loaders, match
):
    # held-out sweep: an endless IterableDataset with limit_train_batches was refused for the limit, whose way
    # out (drop it or use mode='batch') only led to the IterableDataset's refusal, which no setting lifts
    trainer = pl.Trainer(callbacks=[HardSampleReplay()], max_steps=40, **trainer_kwargs(**setting))
    with pytest.raises(PulseRefusal, match=rf"^HardSampleReplay {match}"):
        trainer.fit(MNIST1DClassifier(), **_given_to_fit(data(num_samples=1000, batch_size=64), loaders))
    assert trainer.global_step == 0


@pytest.mark.parametrize("loaders", ["one", "hook"])
def test_a_map_style_dataset_with_limit_train_batches_keeps_its_refusal_and_the_way_out_trains(loaders):
    trainer = pl.Trainer(
        callbacks=[HardSampleReplay()], max_epochs=2, **trainer_kwargs(limit_train_batches=6)
    )
    with pytest.raises(PulseRefusal) as refused:
        trainer.fit(
            MNIST1DClassifier(), **_given_to_fit(MNIST1DDataModule(num_samples=1000, batch_size=64), loaders)
        )
    assert str(refused.value) == (
        "HardSampleReplay: mode='steps' plans whole epochs of the DataLoader, which `limit_train_batches`=6 "
        "cuts short; drop `limit_train_batches` or use mode='batch'."
    )
    assert trainer.global_step == 0
    trainer = pl.Trainer(
        callbacks=[HardSampleReplay(mode="batch")], max_epochs=2, **trainer_kwargs(limit_train_batches=6)
    )
    trainer.fit(
        MNIST1DClassifier(), **_given_to_fit(MNIST1DDataModule(num_samples=1000, batch_size=64), loaders)
    )
    assert trainer.global_step == 2 * 6  # the way out it names trains the limited epochs


def _fit_pulsed(callbacks, ckpt_path=None, **trainer_overrides):
    """A 4-epoch pulsed run with step-saving replay on a shuffle-free loader, from the start or a checkpoint."""
    pl.seed_everything(0)
    model = OneCycleClassifier()
    trainer = pl.Trainer(
        callbacks=[PulseCycle(**CYCLE), HardSampleReplay(rule="topk", replay_fraction=0.5), *callbacks],
        max_epochs=4,
        **trainer_kwargs(enable_checkpointing=bool(callbacks), **trainer_overrides),
    )
    trainer.fit(model, ShuffleFreeData(num_samples=1000, batch_size=64), ckpt_path=ckpt_path)
    return model, trainer


def test_resume_mid_replay_mid_epoch_reproduces_the_uninterrupted_run(tmp_path):
    log = BatchLog()
    every_step = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    full_model, full = _fit_pulsed([every_step, log])
    cycle = next(c for c in full.callbacks if isinstance(c, PulseCycle))
    # a step inside a replay phase, and not an epoch's first batch
    replay = [c for c in cycle.history if c.current.value == "replay"]
    resume_step = replay[1].step + 2
    epochs_at = {step: epoch for epoch, step, _ in log.fetched}
    assert epochs_at[resume_step] == epochs_at[resume_step - 1]
    checkpoint = next(tmp_path.glob(f"*step={resume_step}.ckpt"))

    resumed_model, resumed = _fit_pulsed([], ckpt_path=str(checkpoint))
    assert resumed.global_step == full.global_step
    assert torch.equal(_parameters(resumed_model), _parameters(full_model))
    tables = [next(c for c in t.callbacks if isinstance(c, HardSampleReplay)).table for t in (full, resumed)]
    assert tables[0].scores.tobytes() == tables[1].scores.tobytes()


def test_resume_from_a_checkpoint_saved_on_a_passs_last_batch_reproduces_the_uninterrupted_run(tmp_path):
    # held-out sweep: Lightning resets an epoch's batch counters only at the DataLoader's length, so the epoch
    # after a planned pass (shorter) began with the finished pass's count and ended after one batch (30 of 36
    # steps); and the finished epoch's end, where the next pass's choice reads every score, never ran
    log = BatchLog()
    every_step = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    full_model, full = _fit_pulsed([every_step, log])
    pass_ends = [
        step for (epoch, step, _), (after, _, _) in zip(log.fetched, log.fetched[1:]) if after != epoch
    ]
    assert len(pass_ends) == 3
    checkpoint = next(tmp_path.glob(f"*step={pass_ends[0] + 1}.ckpt"))  # saved after the pass's last step
    resumed_model, resumed = _fit_pulsed([], ckpt_path=str(checkpoint))
    assert resumed.global_step == full.global_step
    assert torch.equal(_parameters(resumed_model), _parameters(full_model))


@pytest.mark.parametrize("validation", [True, False], ids=["saved-after-validation", "no-validation"])
def test_resume_from_an_end_of_epoch_checkpoint_reproduces_the_uninterrupted_run(tmp_path, validation):
    # held-out sweeps: ModelCheckpoint(every_n_epochs=1) saves after the epoch's validation, where Lightning has
    # counted the epoch as processed. The resume closed the planned pass one batch short of the loader's
    # length, trained a batch of the next pass in it and counted the epoch twice: 78 of 88 steps, other weights.
    # With no validation it saves in the epoch's end hooks; a step-limited run restarts that epoch and waited for
    # a validation that never comes, training the next pass's first batch in the finished epoch.
    overrides = {} if validation else {"limit_val_batches": 0}
    every_epoch = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    full_model, full = _fit_pulsed([every_epoch], **overrides)
    resumed_model, resumed = _fit_pulsed([], ckpt_path=str(tmp_path / "epoch=1.ckpt"), **overrides)
    assert resumed.global_step == full.global_step
    assert torch.equal(_parameters(resumed_model), _parameters(full_model))


@pytest.mark.parametrize(
    ("saved_epochs", "resume_after", "epochs"), [(2, 1, 4), (4, 0, 3)], ids=["longer", "shorter"]
)
def test_a_run_resumed_to_another_length_plans_the_rest_for_the_new_length(
    tmp_path, caplog, saved_epochs, resume_after, epochs
):
    # held-out sweep: the checkpoint's plan and the span it pinned the clock to were kept, so a finished run
    # resumed to more epochs stayed in its anneal (the extension all burst) and a shorter one never annealed
    def fit(max_epochs, callbacks=(), ckpt_path=None):
        pl.seed_everything(0)
        cycle, replay = PulseCycle(**CYCLE), HardSampleReplay(rule="topk", replay_fraction=0.5)
        trainer = pl.Trainer(
            callbacks=[cycle, replay, *callbacks],
            max_epochs=max_epochs,
            **trainer_kwargs(enable_checkpointing=bool(callbacks)),
        )
        model = MNIST1DClassifier()
        trainer.fit(model, ShuffleFreeData(num_samples=1000, batch_size=64), ckpt_path=ckpt_path)
        return model, cycle, replay.steps.plan, trainer

    every_epoch = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    fit(saved_epochs, [every_epoch])
    saved = torch.load(tmp_path / f"epoch={resume_after}.ckpt", weights_only=False)["global_step"]
    again = ModelCheckpoint(dirpath=tmp_path / "resumed", every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    with caplog.at_level(logging.INFO):
        model, cycle, plan, trainer = fit(
            epochs, [again], ckpt_path=str(tmp_path / f"epoch={resume_after}.ckpt")
        )
    assert any("plan remade for this run's length" in record.getMessage() for record in caplog.records)
    assert plan.plain_steps == 12 * epochs and trainer.global_step == plan.total_steps
    # after the resume, the cycle runs until its anneal, placed on the new run's planned steps
    changes = [(change.step, change.current.value, change.reason) for change in cycle.history]
    after = [(phase, reason) for step, phase, reason in changes if step > saved]
    assert ("replay", "budget") in after and ("maintain", "budget") in after
    assert (
        changes[-1] == (round(0.9 * plan.span), "burst", "anneal") and abs(plan.span - plan.total_steps) <= 2
    )
    # the new plan is in its checkpoints: resumed again to the same length, the run is the same run
    model_again, _, _, again_trainer = fit(
        epochs, ckpt_path=str(tmp_path / "resumed" / f"epoch={epochs - 2}.ckpt")
    )
    assert again_trainer.global_step == trainer.global_step
    assert torch.equal(_parameters(model_again), _parameters(model))


def test_plan_without_a_cycle_selects_every_step_and_keeps_each_epoch_one_pass():
    plan = plan_steps(
        None, ["replay"], batch_size=10, fraction=0.25, samples_per_epoch=100, max_epochs=3, max_steps=None
    )
    assert window_size(10, 0.25) == 40
    assert plan.batch_sizes == [[40, 40, 20]] * 3
    assert plan.total_steps == 9 and plan.plain_steps == 30 and plan.light_steps == 9


def test_an_epochs_optimizer_steps_count_its_short_last_window_and_an_endless_epoch_has_none():
    assert [epoch_steps(batches, 3) for batches in (9, 10, 0)] == [3, 4, 0]
    assert epoch_steps(math.inf, 3) is None


def test_a_resumed_plan_says_its_light_steps_are_those_from_the_resume_on():
    # a held-out resume logged "45 in light phases" where the run had 71: the rest of the run, read as the whole
    run = dict(batch_size=10, fraction=0.25, samples_per_epoch=100, max_epochs=3, max_steps=None)
    whole = plan_steps(None, ["replay"], **run)
    rest = plan_steps(None, ["replay"], **run, start_epoch=1, start_step=3, total_steps=whole.total_steps)
    assert (whole.from_step, whole.light_steps, rest.from_step, rest.light_steps) == (0, 9, 3, 6)
    assert "(0.300x; 9 in light phases)" in plan_summary(whole, None)
    assert "(0.300x; 6 of the 6 from step 3 on in light phases)" in plan_summary(rest, None)


def test_plan_closes_an_accumulation_window_at_the_epoch_end_as_lightning_does():
    clock = PhaseClock({"burst": 2, "replay": 2}, order=["burst", "replay"])
    plan = plan_steps(
        clock,
        ["replay"],
        batch_size=10,
        fraction=0.5,
        samples_per_epoch=100,
        max_epochs=1,
        max_steps=None,
        accumulate=2,
    )
    # steps of two batches: two burst steps of 10+10, then replay 20+20 and 20 (the pass ends mid-window)
    assert plan.batch_sizes == [[10, 10, 10, 10, 20, 20, 20]]
    assert plan.total_steps == 4 and plan.plain_steps == 5
    assert clock.step == 0  # the run's clock was copied, not advanced


class EpochScheduledClassifier(MNIST1DClassifier):
    """An epoch-interval StepLR and a ReduceLROnPlateau on the training loss, as users write them."""

    def configure_optimizers(self):
        first = torch.optim.SGD(self.parameters(), lr=0.1)
        step = torch.optim.lr_scheduler.StepLR(first, step_size=1, gamma=0.5)
        return {"optimizer": first, "lr_scheduler": {"scheduler": step, "interval": "epoch"}}


class StepsAndLR(Callback):
    """Per epoch end: the global step and the learning rate; and micro-batches backpropagated but never stepped."""

    def __init__(self) -> None:
        self.epochs: list[tuple[int, float]] = []
        self.unstepped = 0
        self._pending = 0

    def on_after_backward(self, trainer, pl_module):
        self._pending += 1

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._pending = 0

    def on_train_epoch_end(self, trainer, pl_module):
        self.unstepped += self._pending
        self._pending = 0
        self.epochs.append((trainer.global_step, trainer.optimizers[0].param_groups[0]["lr"]))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_each_planned_pass_ends_as_an_epoch_epoch_schedulers_step_and_the_last_window_closes(num_workers):
    # Lightning marks an epoch's last batch by the loader's length; a planned pass has fewer batches, and the
    # one that ends it must still close a partial accumulation window and step epoch-interval schedulers
    data = MNIST1DDataModule(num_samples=1000, batch_size=50, num_workers=num_workers)
    log = StepsAndLR()
    trainer = pl.Trainer(
        **trainer_kwargs(max_epochs=4, accumulate_grad_batches=3, callbacks=[HardSampleReplay(), log])
    )
    trainer.fit(EpochScheduledClassifier(arch="mlp"), data)
    assert log.unstepped == 0
    assert trainer.global_step == trainer.max_steps  # the plan's steps, all taken
    assert [lr for _, lr in log.epochs] == pytest.approx([0.05, 0.025, 0.0125, 0.00625])


def test_plan_spends_the_data_of_a_max_steps_run_in_fewer_steps():
    plan = plan_steps(
        None, ["replay"], batch_size=10, fraction=0.5, samples_per_epoch=100, max_epochs=None, max_steps=25
    )
    assert plan.plain_steps == 25 and plan.total_steps == math.ceil(25 * 10 / 20)


def test_budget_solver_inverts_the_spent_share():
    replay = replay_steps_for_budget(0.7, 0.5, full_steps=10, other_light_steps=0, warmup=0.0, anneal=0.0)
    steps, data = 10 + replay, 10 + replay / 0.5
    assert steps / data == pytest.approx(0.7)
    with pytest.raises(ValueError, match=r"`budget`=0.95 is above"):
        replay_steps_for_budget(0.95, 0.5, full_steps=10, other_light_steps=10, warmup=0.0, anneal=0.0)


class StepsDump(Callback):
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.steps: list[list[int]] = []

    def on_before_backward(self, trainer, pl_module, loss):
        replay = next(c for c in trainer.callbacks if isinstance(c, HardSampleReplay))
        self.steps.append([trainer.current_epoch, trainer.global_step, replay.offered_count])

    def on_train_end(self, trainer, pl_module):
        path = f"{self.directory}/rank{trainer.global_rank}.json"
        with open(path, "w") as handle:
            json.dump({"steps": self.steps, "max_steps": trainer.max_steps}, handle)


@pytest.mark.ddp
def test_two_gloo_ranks_take_identical_steps(tmp_path):
    pl.seed_everything(0)
    trainer = pl.Trainer(
        # the dump records each step's window (the sampler loads only the cut batch)
        callbacks=[StepsDump(str(tmp_path)), PulseCycle(**CYCLE), HardSampleReplay(replay_fraction=0.5)],
        max_epochs=3,
        limit_val_batches=0,
        **trainer_kwargs(devices=2, strategy=TwoGlooProcesses()),
    )
    trainer.fit(MNIST1DClassifier(), MNIST1DDataModule(num_samples=1000, batch_size=32))
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0 == rank1
    sizes = [size for _, _, size in rank0["steps"]]
    assert 64 in sizes and rank0["max_steps"] < 3 * math.ceil(360 / 32)


def test_a_stability_guard_rollback_restores_the_scores_but_not_the_data_stream():
    from benchmarks.stability_guard import FaultInjector
    from lightning_pulse import StabilityGuard

    pl.seed_everything(0)
    log = BatchLog()
    replay = HardSampleReplay(replay_fraction=0.5)
    guard = StabilityGuard(
        loss_zscore=None, grad_norm_zscore=None, rollback_after=1, snapshot_every=5, max_snapshots=3
    )
    trainer = pl.Trainer(
        # NaN outputs at step 16, inside the first replay phase (steps 10-15 of this cycle and 1000 samples)
        callbacks=[log, PulseCycle(**CYCLE), replay, FaultInjector("nan_output", start=16, length=1), guard],
        max_epochs=3,
        **trainer_kwargs(),
    )
    trainer.fit(MNIST1DClassifier(), MNIST1DDataModule(num_samples=1000, batch_size=64))
    assert guard.rollbacks == 1
    # the data went on: every epoch is still one whole pass, and the run reaches the planned steps
    assert sum(log.windows) == 3 * 720 and trainer.global_step == trainer.max_steps


class _LinearDecay(pl.LightningModule):
    """A digits MLP whose learning rate falls linearly to 0 over ``estimated_stepping_batches``, per step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        self.total = 0

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        self.total = int(self.trainer.estimated_stepping_batches)
        decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / self.total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


def test_a_schedule_planned_from_estimated_stepping_batches_ends_with_the_run():
    # held-out sweep: with no exact fixed point for warm-up and anneal the plan said 70 steps and the data gave
    # 69 before max_epochs, so a linear decay ended at 1/70 of its peak. Warm-up and anneal are now pinned to
    # a span of 69 steps, on which the data gives the run's 70: every planned step is in the planned batches
    from sklearn.datasets import load_digits

    digits = load_digits()
    data = TensorDataset(
        torch.tensor(digits.data[:768] / 16, dtype=torch.float32), torch.tensor(digits.target[:768])
    )
    pl.seed_everything(0)
    module, replay = _LinearDecay(), HardSampleReplay()
    trainer = pl.Trainer(
        callbacks=[PulseCycle(burst=12, replay=24, maintain=4), replay], max_epochs=4, **trainer_kwargs()
    )
    trainer.fit(module, DataLoader(data, batch_size=32, shuffle=True))
    assert replay.steps.plan.span == 69 and replay.steps.plan.steps_past_data == 0  # no exact fixed point
    assert trainer.global_step == module.total == trainer.max_steps == 70 and trainer.max_epochs == 4
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.0


@pytest.mark.parametrize("resume_step", [40, 69])  # mid-run, and on the last step (past the pinned span)
def test_a_run_with_a_pinned_span_resumes_to_the_same_end(tmp_path, resume_step):
    from sklearn.datasets import load_digits

    digits = load_digits()
    data = TensorDataset(
        torch.tensor(digits.data[:768] / 16, dtype=torch.float32), torch.tensor(digits.target[:768])
    )

    def fit(callbacks, ckpt_path=None):
        pl.seed_everything(0)
        module = _LinearDecay()
        trainer = pl.Trainer(
            callbacks=[PulseCycle(burst=12, replay=24, maintain=4), HardSampleReplay(), *callbacks],
            max_epochs=4,
            **trainer_kwargs(enable_checkpointing=bool(callbacks)),
        )
        trainer.fit(module, DataLoader(data, batch_size=32), ckpt_path=ckpt_path)
        return module, trainer

    every_step = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    full_module, full = fit([every_step])
    resumed_module, resumed = fit([], ckpt_path=str(next(tmp_path.glob(f"*step={resume_step}.ckpt"))))
    assert full.global_step == resumed.global_step == 70
    assert torch.equal(_parameters(resumed_module), _parameters(full_module))


def test_a_run_of_unknown_length_is_refused_by_steps_mode_naming_the_way_out():
    trainer = pl.Trainer(callbacks=[HardSampleReplay()], max_epochs=-1, max_steps=-1, **trainer_kwargs())
    with pytest.raises(
        PulseRefusal, match=r"^HardSampleReplay: mode='steps' .* finite max_epochs .* mode='batch'"
    ):
        trainer.fit(MNIST1DClassifier(), MNIST1DDataModule(num_samples=1000, batch_size=64))
    assert trainer.global_step == 0


@pytest.mark.parametrize(
    "name", ["hf-gpt2", "hf-bert", "transformer-encoder", "manual-optimization", "onecycle-per-step"]
)
def test_client_models_take_the_planned_steps_on_full_batches(name):
    from tests.clients import CLIENTS

    pl.seed_everything(0, verbose=False)
    module, data = CLIENTS[name]()
    # max_epochs too: bounded by max_steps alone, a schedule built from estimated_stepping_batches is refused
    # (test_a_run_bounded_by_max_steps_alone_is_refused_when_its_lr_schedule_read_the_unplanned_length)
    trainer = pl.Trainer(
        callbacks=[PulseCycle(**CYCLE), HardSampleReplay(replay_fraction=0.5)],
        max_epochs=100,
        max_steps=60,
        limit_val_batches=0,
        **trainer_kwargs(),
    )
    trainer.fit(module, data)
    # the plain run's 60 steps of data, in the planned (fewer) steps, every one of them taken
    assert trainer.max_steps - 2 <= trainer.global_step <= trainer.max_steps < 60
    for config in trainer.lr_scheduler_configs:  # a schedule planned for the run ends with it
        assert getattr(config.scheduler, "total_steps", trainer.max_steps) == trainer.max_steps
    cycle = next(c for c in trainer.callbacks if isinstance(c, PulseCycle))
    assert cycle.clock.steps_by_phase["replay"] > 0


def test_past_the_plan_a_pass_yields_plain_batches_never_an_empty_epoch():
    from lightning_pulse.core.step_plan import StepSavingStream

    stream = StepSavingStream()
    plan = stream.make_plan(
        None,
        ["replay"],
        batch_size=10,
        fraction=0.5,
        samples_per_epoch=25,
        max_epochs=None,
        max_steps=4,
        accumulate=1,
        drop_last=False,
    )
    # the plain run's 4 steps of data (40 samples) in 3 steps; the last one fetches a whole window
    assert plan.batch_sizes == [[20, 5], [20]]
    assert stream.sizes_for_pass(0) == (0, [20, 5], 2)
    # an epoch the plan does not cover (a run that goes on to max_steps) trains plain batches
    assert stream.sizes_for_pass(5) == (0, [10, 10, 5], 3)


def _reference_cut(scores: list[float], keep: int) -> list[int]:
    """Never-scored first in window order, then the highest scores (ties: earlier), returned in window order."""
    unseen = [i for i, s in enumerate(scores) if math.isnan(s)]
    seen = sorted((i for i, s in enumerate(scores) if not math.isnan(s)), key=lambda i: (-scores[i], i))
    return sorted((unseen + seen)[:keep])


def test_a_pass_of_windows_is_cut_as_each_window_alone_would_be():
    import numpy as np

    from lightning_pulse.core.replay import SELECTED, UNSEEN, HardSampleSelector, ReplayConfig
    from lightning_pulse.core.sample_scores import SampleScoreTable

    generator = np.random.default_rng(0)
    table = SampleScoreTable(200)
    scored = generator.choice(200, size=150, replace=False)
    values = np.round(generator.random(150), 1)  # rounded: ties
    table.update(torch.from_numpy(scored), torch.from_numpy(values.astype(np.float32)), 0, math.nan)
    selector = HardSampleSelector(table, ReplayConfig("topk", 0.5, 0.5, 0))
    order = generator.permutation(200).tolist()
    windows = [order[0:20], order[20:40], order[40:52], order[52:70], order[70:71]]  # sizes 20, 20, 12, 18, 1
    cuts = selector.choose_windows(windows, keep=10, steps=[5] * 5, ordinals=list(range(5)), prior=math.nan)
    for window, cut in zip(windows, cuts):
        expected = _reference_cut([float(table.scores[i]) for i in window], 10)
        assert cut.positions.tolist() == expected
        assert cut.indices.tolist() == [window[p] for p in expected]
        unseen = [math.isnan(float(table.scores[window[p]])) for p in expected]
        assert cut.roles.tolist() == [UNSEEN if is_unseen else SELECTED for is_unseen in unseen]
    assert any(math.isnan(float(table.scores[i])) for i in windows[0])  # never-scored samples were in play


@pytest.mark.parametrize("rule", ["topk", "random"])  # random: each window's draw is seeded by its ordinal
def test_choosing_a_pass_in_blocks_trains_what_choosing_it_whole_does(monkeypatch, rule):
    from lightning_pulse.core.sample_index import PlannedBatchSampler

    def fit():
        pl.seed_everything(0)
        model = MNIST1DClassifier()
        trainer = pl.Trainer(
            callbacks=[PulseCycle(**CYCLE), HardSampleReplay(rule=rule, replay_fraction=0.5)],
            max_epochs=4,
            **trainer_kwargs(),
        )
        trainer.fit(model, ShuffleFreeData(num_samples=1000, batch_size=64))
        return _parameters(model), trainer.global_step

    whole, whole_steps = fit()  # a pass of 12 batches fits in one block
    monkeypatch.setattr(PlannedBatchSampler, "CHOOSE_BLOCK", 2)
    blocks, block_steps = fit()
    assert block_steps == whole_steps
    assert torch.equal(blocks, whole)


def test_tracker_gives_each_planned_batch_as_loaded_a_cut_not_its_window():
    """Under a planned pass the tracker reports the indices the DataLoader loaded: for a light step, the cut
    of its window (the activation cache and the fault tracer map a batch's rows through them)."""
    from types import SimpleNamespace

    from torch.utils.data import TensorDataset

    from lightning_pulse.core.sample_index import PlannedBatchSampler, SampleIndexTracker

    ids = torch.arange(40)
    plain = DataLoader(TensorDataset(ids), batch_size=4, shuffle=True)
    tracker = SampleIndexTracker.install(plain)
    sizes = [4, 8, 4, 8, 8, 4]  # two-batch windows for the light steps, cut to 4 below

    def choose(windows, ordinals):
        return [SimpleNamespace(indices=torch.tensor(window[1::2])) for window in windows]

    planned = PlannedBatchSampler(plain.batch_sampler, lambda: (0, sizes), len(plain.batch_sampler), choose)
    loader = DataLoader(plain.dataset, batch_sampler=planned)
    for _ in range(2):  # a second pass starts the records afresh
        seen = []
        for batch_idx, (batch,) in enumerate(loader):
            assert batch.numel() == 4
            assert torch.equal(tracker.batch_indices(batch_idx), batch)
            seen.extend(batch.tolist())
        assert len(set(seen)) == len(seen) == 24
        assert len(tracker.recorder.batches) == 0  # every batch released once asked for
    with pytest.raises(RuntimeError, match="asked for after a later batch"):
        tracker.batch_indices(0)


class _StepCounter(Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps += 1


def test_an_accumulation_schedule_is_refused_before_the_first_step():
    """The plan was made with accumulation 1; Lightning's GradientAccumulationScheduler raised it to 2 and 4, and
    the run ended at max_epochs after 36 of its 60 planned steps, OneCycleLR short of its end, with no word."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    counter = _StepCounter()
    trainer = pl.Trainer(
        max_epochs=4,
        callbacks=[HardSampleReplay(), GradientAccumulationScheduler({0: 1, 1: 2, 2: 4}), counter],
        **trainer_kwargs(),
    )
    with pytest.raises(PulseRefusal, match=r"GradientAccumulationScheduler changes it during the run"):
        trainer.fit(OneCycleClassifier(), ShuffleFreeData(num_samples=1000, batch_size=64))
    assert counter.steps == 0

    # review: the refusal named the Trainer's `accumulate_grad_batches`=1 as the run's, where the scheduler
    # sets 3 for epoch 0
    trainer = pl.Trainer(
        max_epochs=4,
        callbacks=[HardSampleReplay(), GradientAccumulationScheduler({0: 3, 2: 1})],
        **trainer_kwargs(),
    )
    with pytest.raises(PulseRefusal) as refusal:
        trainer.fit(OneCycleClassifier(), ShuffleFreeData(num_samples=1000, batch_size=64))
    assert str(refusal.value).startswith(
        "HardSampleReplay: mode='steps' plans the run's optimizer steps at fit start with "
        "`accumulate_grad_batches`=1 (the Trainer's; the scheduler sets 3 at epoch 0), and a "
        "GradientAccumulationScheduler changes it during the run"
    )


def test_a_run_bounded_by_max_steps_alone_is_refused_when_its_lr_schedule_read_the_unplanned_length():
    """With max_epochs=-1 Lightning builds the scheduler before the data, so OneCycleLR was built for
    max_steps=60 and the plan stopped the run at 30, the learning rate half-way through its course. With
    max_epochs set too, the plan comes first and the schedule ends where the run does."""
    counter = _StepCounter()
    trainer = pl.Trainer(
        max_epochs=-1, max_steps=60, callbacks=[HardSampleReplay(), counter], **trainer_kwargs()
    )
    with pytest.raises(
        PulseRefusal, match=r"max_epochs=-1.*built for max_steps=60 steps.*Set max_epochs too"
    ):
        trainer.fit(OneCycleClassifier(), ShuffleFreeData(num_samples=1000, batch_size=64))
    assert counter.steps == 0

    pl.seed_everything(0)
    model = OneCycleClassifier()
    trainer = pl.Trainer(max_epochs=4, max_steps=60, callbacks=[HardSampleReplay()], **trainer_kwargs())
    trainer.fit(model, ShuffleFreeData(num_samples=1000, batch_size=64))
    schedule = trainer.lr_scheduler_configs[0].scheduler
    assert model.planned_total == trainer.global_step == schedule.last_epoch < 60


class _CosineClassifier(MNIST1DClassifier):
    """A per-step cosine schedule over ``schedule_length`` steps, as a config gives it, or (``None``) over
    ``estimated_stepping_batches // frequency`` (undivided unless ``divide``), stepped every ``frequency``
    optimizer steps."""

    def __init__(self, schedule_length: int | None = None, frequency: int = 1, divide: bool = True) -> None:
        super().__init__()
        self.schedule_length, self.frequency, self.divide = schedule_length, frequency, divide

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        estimated = int(self.trainer.estimated_stepping_batches)
        length = self.schedule_length or (estimated // self.frequency if self.divide else estimated)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=length)
        config = {"scheduler": schedule, "interval": "step", "frequency": self.frequency}
        return {"optimizer": optimizer, "lr_scheduler": config}


def _cycle_of(budget: float | None) -> list[Callback]:
    return [] if budget is None else [PulseCycle(**CYCLE, budget=budget)]


@pytest.mark.parametrize(
    ("budget", "run", "length", "source", "planned"),
    [
        (None, dict(max_epochs=100, max_steps=120), 120, "max_steps=120", 60),
        (None, dict(max_epochs=4), 48, "max_epochs=4 of 12 optimizer steps", 24),  # the plain run's 4 x 12
        (0.6, dict(max_epochs=100, max_steps=120), 120, "max_steps=120", 75),  # the plan fitted to the budget
    ],
    ids=["max-steps", "max-epochs", "budget"],
)
def test_a_per_step_schedule_built_for_the_unplanned_run_length_is_refused_before_the_first_step(
    budget, run, length, source, planned
):
    """Held-out sweep: with max_epochs set, Lightning builds a scheduler of a literal length before the data,
    so CosineAnnealingLR(T_max=120) was never checked, and the run planned down to 60 steps stopped it half-way
    through its course (the learning rate still at half its peak) with no word."""
    replay, counter = HardSampleReplay(), _StepCounter()
    trainer = pl.Trainer(callbacks=[*_cycle_of(budget), replay, counter], **run, **trainer_kwargs())
    with pytest.raises(PulseRefusal) as refusal:
        trainer.fit(_CosineClassifier(length), ShuffleFreeData(num_samples=1000, batch_size=64))
    assert replay.steps.plan.total_steps == planned  # the final plan: under a budget, the one fitted to it
    assert str(refusal.value).startswith(
        f"HardSampleReplay: the per-step CosineAnnealingLR was built for {length} steps, the run's length "
        f"without step-saving replay ({source}), and mode='steps' plans {planned}: "
    )
    assert "`self.trainer.estimated_stepping_batches`" in str(refusal.value) and "mode='batch'" in str(
        refusal.value
    )
    assert trainer.global_step == 0 and counter.steps == 0


def test_a_schedule_stepped_every_other_step_built_for_the_unplanned_run_over_its_frequency_is_refused():
    """Held-out sweep: a schedule stepped with ``"frequency": 2`` counts its length in its own steps (the
    plain run's 48 optimizer steps / 2 = 24); the length was compared with the plain run's 48, so the run
    planned down to 24 steps was not refused and stopped the schedule at 12 of its 24 steps, with no word.
    (24 is also the planned steps undivided: see the next test.) Stepped every 4 steps: 48 / 4 = 12."""
    replay, counter = HardSampleReplay(), _StepCounter()
    trainer = pl.Trainer(callbacks=[replay, counter], max_epochs=4, **trainer_kwargs())
    with pytest.raises(PulseRefusal) as refusal:
        trainer.fit(_CosineClassifier(12, frequency=4), ShuffleFreeData(num_samples=1000, batch_size=64))
    assert replay.steps.plan.total_steps == 24
    assert str(refusal.value) == (
        "HardSampleReplay: the per-step CosineAnnealingLR was built for 12 steps, the run's length without "
        "step-saving replay (max_epochs=4 of 12 optimizer steps: 48 optimizer steps over the scheduler's "
        "`frequency`=4), and mode='steps' plans 24: the schedule would stop at 33% of its course. With "
        "`frequency`=4, Lightning steps it after each batch that steps the optimizer whose number in its "
        "epoch is a multiple of 4 (per epoch, in batches under gradient accumulation): 4 times over the 24 "
        "planned steps. Build its length as those 4 steps in configure_optimizers (not "
        "`estimated_stepping_batches`, the 24 optimizer steps), or use mode='batch'."
    )  # 4 passes of 6 batches: one step each (24 // 4 = 6 read the run's steps as one epoch: 50%)
    assert trainer.global_step == 0 and counter.steps == 0

    # bounded by max_steps alone the scheduler is built before the data: refused at setup, as without it
    trainer = pl.Trainer(callbacks=[HardSampleReplay()], max_epochs=-1, max_steps=60, **trainer_kwargs())
    with pytest.raises(PulseRefusal, match=r"built for max_steps=60 steps.*stop at 50%.*`frequency`=2\.\)$"):
        trainer.fit(_CosineClassifier(30, frequency=2), ShuffleFreeData(num_samples=1000, batch_size=64))
    assert trainer.global_step == 0


@pytest.mark.parametrize("length", [None, 24], ids=["estimated-undivided", "literal"])
def test_a_schedule_stepped_every_other_step_as_long_as_the_planned_run_is_refused_naming_both_readings(
    length,
):
    """Review: ``T_max=estimated_stepping_batches`` (24, the planned run) with ``"frequency": 2`` was refused
    as built for the run without step-saving replay (48 / 2). It may be either, and stops at 50% of its course
    either way: the refusal says both and that the planned steps are to be divided by the frequency."""
    replay, counter = HardSampleReplay(), _StepCounter()
    trainer = pl.Trainer(callbacks=[replay, counter], max_epochs=4, **trainer_kwargs())
    with pytest.raises(PulseRefusal) as refusal:
        model = _CosineClassifier(length, frequency=2, divide=False)
        trainer.fit(model, ShuffleFreeData(num_samples=1000, batch_size=64))
    assert replay.steps.plan.total_steps == 24
    assert str(refusal.value) == (
        "HardSampleReplay: the per-step CosineAnnealingLR, stepped every `frequency`=2 optimizer steps, was "
        "built for 24 steps: the run's 24 planned steps (`estimated_stepping_batches`) read without "
        "dividing by its frequency, or the run's length without step-saving replay over the frequency "
        "(max_epochs=4 of 12 optimizer steps: 48 optimizer steps over the scheduler's `frequency`=2). "
        "Either way the run steps it 12 times: the schedule would stop at 50% of its course. Build its "
        "length as those 12 steps in configure_optimizers (Lightning steps it after each batch that steps "
        "the optimizer whose number in its epoch is a multiple of 2: per epoch, in batches, so "
        "`estimated_stepping_batches // 2` holds them only where each planned epoch's batches are a multiple "
        "of 2 and no gradients accumulate), or use mode='batch'."
    )
    assert trainer.global_step == 0 and counter.steps == 0


def test_a_schedule_stepped_every_other_step_built_from_the_planned_steps_ends_with_the_run():
    """The way out the refusal above names: ``estimated_stepping_batches // 2`` holds the planned run's
    scheduler steps, and the cosine reaches its end (its minimum) on the run's last step."""
    pl.seed_everything(0)
    trainer = pl.Trainer(
        callbacks=[HardSampleReplay()], max_epochs=4, limit_val_batches=0, **trainer_kwargs()
    )
    trainer.fit(_CosineClassifier(frequency=2), ShuffleFreeData(num_samples=1000, batch_size=64))
    schedule = trainer.lr_scheduler_configs[0].scheduler
    assert trainer.global_step == 24 and schedule.T_max == schedule.last_epoch == 12
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-9)


class _Points(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 85  # batches of 8: 10 with drop_last, else 11

    def __getitem__(self, index):
        return torch.randn(8, generator=torch.Generator().manual_seed(index)), index % 3


class _OneCycleOfPoints(pl.LightningModule):
    """A OneCycleLR of ``length(estimated_stepping_batches)`` steps, stepped every ``frequency`` optimizer
    steps."""

    def __init__(self, length, frequency: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.length, self.frequency = torch.nn.Linear(8, 3), length, frequency

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        total = self.length(int(self.trainer.estimated_stepping_batches))
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
        config = {"scheduler": schedule, "interval": "step", "frequency": self.frequency}
        return {"optimizer": optimizer, "lr_scheduler": config}


def _fit_every(length, frequency: int, accumulate: int, drop_last: bool, cycle: bool = False) -> pl.Trainer:
    callbacks: list[Callback] = [HardSampleReplay(replay_fraction=0.5)]
    if cycle:
        callbacks.append(PulseCycle(burst=3, replay=3, maintain=2, warmup=0, anneal=0))
    trainer = pl.Trainer(
        max_epochs=3, accumulate_grad_batches=accumulate, callbacks=callbacks, **trainer_kwargs()
    )
    loader = DataLoader(_Points(), batch_size=8, drop_last=drop_last, shuffle=False)
    trainer.fit(_OneCycleOfPoints(length, frequency), loader)
    return trainer


def _ran_to_its_end(trainer: pl.Trainer) -> bool:
    schedule = trainer.lr_scheduler_configs[0].scheduler
    return trainer.global_step == trainer.max_steps and schedule.last_epoch == schedule.total_steps


@pytest.mark.parametrize(
    ("accumulate", "frequency", "length", "built", "planned"),
    [(3, 2, lambda estimated: estimated, 6, 6), (2, 3, lambda estimated: 15 // 3, 5, 9)],
    ids=["accumulate-3-every-2", "accumulate-2-every-3"],
)
def test_a_schedule_no_planned_batch_steps_is_refused_as_never_stepped_not_advised_a_length_of_0(
    accumulate, frequency, length, built, planned
):
    """Review: passes of 5 batches (10 planned half) step the optimizer at batches 3 and 5 (accumulation 3),
    neither a multiple of ``"frequency": 2``, so Lightning never steps the scheduler; the refusal said "Build
    its length as those 0 steps", and ``OneCycleLR(total_steps=0)`` raises. Its way out is ``frequency`` 1."""
    with pytest.raises(PulseRefusal) as refusal:
        _fit_every(length, frequency, accumulate, drop_last=True)
    assert str(refusal.value) == (
        f"HardSampleReplay: the per-step OneCycleLR, stepped every `frequency`={frequency} optimizer steps, "
        f"was built for {built} steps, and Lightning never steps it over the {planned} planned steps: it "
        "steps it after each batch that steps the optimizer whose number in its epoch is a multiple of "
        f"{frequency} (per epoch, in batches under gradient accumulation), and the plan's epochs have no such "
        "batch, so the schedule would stay at its start. Step it at `frequency`=1 (its length is then "
        f"`self.trainer.estimated_stepping_batches`, the {planned} planned steps), or use mode='batch'."
    )
    trainer = _fit_every(lambda estimated: estimated, 1, accumulate, drop_last=True)  # the way out
    assert trainer.global_step == planned and _ran_to_its_end(trainer)


def test_a_schedule_of_frequency_2_built_for_the_unplanned_run_is_refused_naming_one_length_to_build():
    """Review: the refusal's first way out said "Build its length from `estimated_stepping_batches` (it holds
    the 18 planned steps)" and an appended sentence said 9; built for 18, the run was not refused and ended
    the schedule at 9 of its 18 steps with no word. It names only the 9 now, which ends with the run."""
    with pytest.raises(PulseRefusal) as refusal:
        _fit_every(lambda estimated: 33 // 2, 2, 1, drop_last=False)  # 3 plain epochs of 11 batches
    assert str(refusal.value) == (
        "HardSampleReplay: the per-step OneCycleLR was built for 16 steps, the run's length without "
        "step-saving replay (max_epochs=3 of 11 optimizer steps: 33 optimizer steps over the scheduler's "
        "`frequency`=2), and mode='steps' plans 18: the schedule would stop at 56% of its course. With "
        "`frequency`=2, Lightning steps it after each batch that steps the optimizer whose number in its "
        "epoch is a multiple of 2 (per epoch, in batches under gradient accumulation): 9 times over the 18 "
        "planned steps. Build its length as those 9 steps in configure_optimizers (not "
        "`estimated_stepping_batches`, the 18 optimizer steps), or use mode='batch'."
    )
    assert "Build its length from" not in str(refusal.value)
    trainer = _fit_every(lambda estimated: 9, 2, 1, drop_last=False)
    assert trainer.global_step == 18 and _ran_to_its_end(trainer)


def test_a_onecycle_schedule_the_run_would_step_past_its_end_is_refused_at_fit_start():
    """Review: under ``accumulate_grad_batches=2``, ``"frequency": 2`` steps the scheduler at every optimizer
    step but an epoch's short last one: a OneCycleLR of the plain run's 18 // 2 = 9 steps is stepped 11 times
    over the 14 planned, and the fit crashed mid-run ("Tried to step 10 times"), where the count is known at
    fit start (the plain run overruns it too). Built for the 11 the refusal names, it ends with the run."""
    with pytest.raises(PulseRefusal) as refusal:
        _fit_every(lambda estimated: 18 // 2, 2, 2, drop_last=False, cycle=True)
    assert str(refusal.value) == (
        "HardSampleReplay: the per-step OneCycleLR was built for 9 steps, and the run steps it 11 times over "
        "its 14 planned steps (stepped every `frequency`=2 optimizer steps: Lightning steps it after each "
        "batch that steps the optimizer whose number in its epoch is a multiple of 2, per epoch, in batches "
        "under gradient accumulation): it would raise past its end mid-run. Build its length as those 11 "
        "steps in configure_optimizers, or use mode='batch'."
    )
    trainer = _fit_every(lambda estimated: 11, 2, 2, drop_last=False, cycle=True)
    assert trainer.global_step == 14 and _ran_to_its_end(trainer)


@pytest.mark.parametrize(("budget", "planned"), [(None, 60), (0.6, 75)], ids=["alone", "budget"])
def test_a_per_step_schedule_built_from_estimated_stepping_batches_ends_at_the_planned_steps(budget, planned):
    """The way out the refusal above names: with max_epochs set, the plan is made before the scheduler reads
    the run's length, so the cosine reaches its end (its minimum) on the run's last step."""
    pl.seed_everything(0)
    replay = HardSampleReplay()
    trainer = pl.Trainer(
        callbacks=[*_cycle_of(budget), replay],
        max_epochs=100,
        max_steps=120,
        limit_val_batches=0,
        **trainer_kwargs(),
    )
    trainer.fit(_CosineClassifier(), ShuffleFreeData(num_samples=1000, batch_size=64))
    schedule = trainer.lr_scheduler_configs[0].scheduler
    assert replay.steps.plan.total_steps == planned  # non-vacuous: fewer than the 120 steps it replaces
    assert schedule.T_max == schedule.last_epoch == trainer.global_step == planned
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-9)


def test_schedule_lengths_are_read_from_torch_and_hugging_face_schedulers():
    import functools

    from lightning_pulse.core.step_plan import schedule_lengths

    def optimizer():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    def linear_decay(step, num_warmup_steps, num_training_steps):  # as transformers' schedules are written
        return min(1.0, step / max(1, num_warmup_steps)) * max(0.0, 1 - step / num_training_steps)

    total = 120
    assert schedule_lengths(torch.optim.lr_scheduler.OneCycleLR(optimizer(), 0.1, total_steps=total)) == {
        total
    }
    assert total in schedule_lengths(torch.optim.lr_scheduler.CosineAnnealingLR(optimizer(), T_max=total))
    hf = functools.partial(linear_decay, num_warmup_steps=10, num_training_steps=total)
    assert total in schedule_lengths(torch.optim.lr_scheduler.LambdaLR(optimizer(), hf))
    assert total in schedule_lengths(torch.optim.lr_scheduler.LambdaLR(optimizer(), lambda s: 1 - s / total))
    warm_up = torch.optim.lr_scheduler.LambdaLR(optimizer(), lambda s: min(1.0, (s + 1) / 10))
    assert total not in schedule_lengths(warm_up)
    first = optimizer()
    chained = torch.optim.lr_scheduler.SequentialLR(
        first,
        [
            torch.optim.lr_scheduler.ConstantLR(first, total_iters=5),
            torch.optim.lr_scheduler.CosineAnnealingLR(first, T_max=total),
        ],
        milestones=[5],
    )
    assert total in schedule_lengths(chained)


class _WarmUpOnly(OneCycleClassifier):
    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-3)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


def test_a_max_steps_only_run_with_a_schedule_of_no_length_trains():
    """A fixed warm-up then a constant rate has no course to cut short: it was refused with every per-step
    scheduler (the message said it would stop half way)."""
    trainer = pl.Trainer(max_epochs=-1, max_steps=60, callbacks=[HardSampleReplay()], **trainer_kwargs())
    trainer.fit(_WarmUpOnly(), ShuffleFreeData(num_samples=1000, batch_size=64))
    assert 0 < trainer.global_step == trainer.max_steps < 60


class _ValidatedDecay(_LinearDecay):
    """``_LinearDecay`` with a validation loss, and the steps at which it was validated."""

    def __init__(self) -> None:
        super().__init__()
        self.validated_at: list[int] = []

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1]))

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            self.validated_at.append(self.trainer.global_step)


def _digits_data(first: int, last: int) -> TensorDataset:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data[first:last] / 16, dtype=torch.float32)
    return TensorDataset(x, torch.tensor(digits.target[first:last]))


def test_the_final_weights_of_a_run_with_a_pinned_span_are_validated_and_checkpointed(tmp_path):
    # held-out sweep: the step past the planned batches trained in an extra epoch that max_steps ended before
    # its loader did, so Lightning never validated it and a monitored checkpoint filed the final weights under
    # the previous step's val_loss. The run's last step now ends its last planned pass.
    pl.seed_everything(0)
    module, replay = _ValidatedDecay(), HardSampleReplay()
    best = ModelCheckpoint(
        dirpath=tmp_path, monitor="val_loss", save_top_k=-1, filename="{step}-{val_loss:.6f}"
    )
    trainer = pl.Trainer(
        callbacks=[PulseCycle(burst=12, replay=24, maintain=4), replay, best],
        max_epochs=4,
        **trainer_kwargs(enable_checkpointing=True, limit_val_batches=None),
    )
    trainer.fit(
        module,
        DataLoader(_digits_data(0, 768), batch_size=32, shuffle=True),
        DataLoader(_digits_data(768, 1024), batch_size=64),
    )
    assert replay.steps.plan.span == 69  # non-vacuous: no exact fixed point (the run's 70 steps came past it)
    assert trainer.global_step == 70 and module.validated_at[-1] == 70 and trainer.current_epoch == 4
    final = next(path for path in best.best_k_models if "step=70-" in path)
    validated = trainer.validate(module, DataLoader(_digits_data(768, 1024), batch_size=64), verbose=False)
    assert float(best.best_k_models[final]) == pytest.approx(validated[0]["val_loss"], rel=1e-5)


class _Interrupt(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 5:
            raise RuntimeError("stopped by the test")  # Lightning calls on_exception, and no teardown hook


@pytest.mark.parametrize("stop", ["end", "interrupted"])
def test_the_users_dataloader_is_given_back_as_it_was_built(stop):
    # held-out sweep: the planned batch sampler stayed in the user's DataLoader after the fit, so predicting
    # over it failed, and after a fit that stopped early iterating it called back into the finished callback
    loader = DataLoader(_digits_data(0, 512), batch_size=32, shuffle=True)
    batch_sampler, sampler = loader.batch_sampler, loader.batch_sampler.sampler
    pl.seed_everything(0)
    extra = [_Interrupt()] if stop == "interrupted" else []
    trainer = pl.Trainer(
        callbacks=[PulseCycle(burst=4, replay=8, maintain=2), HardSampleReplay(), *extra],
        max_epochs=2,
        **trainer_kwargs(),
    )
    if extra:
        with pytest.raises(RuntimeError, match="stopped by the test"):
            trainer.fit(_LinearDecay(), loader)
    else:
        trainer.fit(_LinearDecay(), loader)
    assert trainer.global_step == (5 if extra else trainer.max_steps)
    assert loader.batch_sampler is batch_sampler and loader.batch_sampler.sampler is sampler
    assert sum(len(x) for x, _ in loader) == 512  # a plain pass over every sample
    plain = pl.Trainer(max_epochs=1, **trainer_kwargs())
    plain.fit(_LinearDecay(), loader)
    assert plain.global_step == 16


def test_a_second_training_loader_is_refused_before_either_is_changed():
    # held-out sweep: the plan went into the first loader before the refusal, so the way out the refusal gives
    # (the same loaders without HardSampleReplay) then crashed inside the planned sampler
    loaders = {
        "a": DataLoader(_digits_data(0, 256), batch_size=32),
        "b": DataLoader(_digits_data(256, 384), batch_size=32),
    }
    kept = {name: (loader.batch_sampler, loader.batch_sampler.sampler) for name, loader in loaders.items()}

    class TwoLoaders(_LinearDecay):
        def training_step(self, batch, batch_idx):
            return sum(torch.nn.functional.cross_entropy(self.net(x), y) for x, y in batch.values())

    trainer = pl.Trainer(
        callbacks=[PulseCycle(burst=4, replay=8, maintain=2), HardSampleReplay()],
        max_epochs=2,
        **trainer_kwargs(),
    )
    with pytest.raises(
        PulseRefusal, match="HardSampleReplay needs one training DataLoader.*several DataLoaders"
    ):
        trainer.fit(TwoLoaders(), loaders)
    assert {
        name: (loader.batch_sampler, loader.batch_sampler.sampler) for name, loader in loaders.items()
    } == kept
    plain = pl.Trainer(
        callbacks=[PulseCycle(burst=4, replay=8, maintain=2)], max_epochs=2, **trainer_kwargs()
    )
    plain.fit(TwoLoaders(), loaders)
    assert plain.global_step == 16


class _Reloading(_LinearDecay):
    """Builds its training DataLoader at every epoch: over one dataset object (``"same"``), a new
    ``TensorDataset`` over the same tensors (``"rewrapped"``), a new one over copies of them (``"copied"``), or
    a new, growing one (``"growing"``)."""

    def __init__(self, reload: str) -> None:
        super().__init__()
        self.reload = reload
        self.dataset = _digits_data(0, 256)

    def train_dataloader(self):
        tensors = self.dataset.tensors
        dataset = {
            "same": lambda: self.dataset,
            "rewrapped": lambda: TensorDataset(*tensors),
            "copied": lambda: TensorDataset(*(t.clone() for t in tensors)),
            "growing": lambda: _digits_data(0, 256 + 64 * self.current_epoch),
        }[self.reload]()
        return DataLoader(dataset, batch_size=32, shuffle=True)


@pytest.mark.parametrize("reload", ["same", "rewrapped", "copied", "growing"])
def test_a_batch_mode_reload_keeps_the_scores_of_the_same_samples_and_says_what_it_assumes(reload):
    # held-out sweep: a reloaded dataset of another size silently got an empty table at every reload, so
    # nothing was ever selected. A review then found the first fix wiping the scores of a dataset built anew over
    # the same tensors at every reload: those are the same samples, and an unknown object of the same length
    # keeps its scores with a note of that assumption
    replay = HardSampleReplay(mode="batch")
    pl.seed_everything(0)
    trainer = pl.Trainer(
        callbacks=[PulseCycle(burst=4, replay=8, maintain=2), replay],
        max_epochs=4,
        reload_dataloaders_every_n_epochs=1,
        **trainer_kwargs(),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Reloading(reload))
    notes = [str(w.message) for w in caught if "HardSampleReplay: the reloaded" in str(w.message)]
    if reload == "growing":
        assert notes and all("another length" in note for note in notes)
        assert replay.table.num_samples == 256 + 64 * 3
        return
    assert replay.table.num_samples == 256 and replay.metrics()["replay_fraction"] < 1.0  # kept: selected
    if reload == "copied":
        assert notes and all("same length" in note for note in notes)
    else:
        assert not notes


def test_a_loader_with_persistent_workers_iterated_before_the_fit_trains_the_plan_and_comes_back_plain():
    # the pass's second review: such a loader keeps its iterator, built over its own batch sampler, so the planned
    # sampler never ran and the fit crashed at its first light step; after a fit, the kept iterator would have
    # run the planned sampler of a finished callback
    loader = DataLoader(
        _digits_data(0, 256), batch_size=32, shuffle=True, num_workers=1, persistent_workers=True
    )
    assert sum(len(x) for x, _ in loader) == 256  # the user looks at the data first: the iterator is kept
    pl.seed_everything(0)
    trainer = pl.Trainer(
        callbacks=[PulseCycle(burst=2, replay=4, maintain=1), HardSampleReplay()],
        max_epochs=3,
        **trainer_kwargs(),
    )
    trainer.fit(_LinearDecay(), loader)
    assert trainer.global_step == trainer.max_steps < 3 * 8  # the plan ran: fewer steps than plain
    assert sum(len(x) for x, _ in loader) == 256


def test_a_second_fit_of_the_same_trainer_plans_for_the_users_max_steps_again(tmp_path, caplog):
    # review: the plan's cap on trainer.max_steps stayed after the fit, and a second fit of the same Trainer
    # from a mid-run checkpoint read it as the user's max_steps: a shorter plain run, replanned shorter
    pl.seed_everything(0)
    every_epoch = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    cycle, replay = PulseCycle(**CYCLE), HardSampleReplay(rule="topk", replay_fraction=0.5)
    trainer = pl.Trainer(
        callbacks=[cycle, replay, every_epoch], max_epochs=3, **trainer_kwargs(enable_checkpointing=True)
    )
    trainer.fit(MNIST1DClassifier(), ShuffleFreeData(num_samples=1000, batch_size=64))
    planned, steps = replay.steps.plan.total_steps, trainer.global_step
    with caplog.at_level(logging.INFO):
        trainer.fit(
            MNIST1DClassifier(),
            ShuffleFreeData(num_samples=1000, batch_size=64),
            ckpt_path=str(tmp_path / "epoch=0.ckpt"),
        )
    assert replay.steps.plan.total_steps == planned and trainer.global_step == steps
    assert not any("remade for this run's length" in record.getMessage() for record in caplog.records)


class _TinyValidated(pl.LightningModule):
    """96 samples in batches of 8 (12 per epoch), validated at every epoch's end."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(96, 16, generator=generator)
        self.y = (self.x @ torch.randn(16, 4, generator=generator)).argmax(1)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=8)

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=32)


class _StaleValidationMark(Callback):
    """Sets the mark of a validation run at fit start, as an earlier fit of the Trainer left it before the fix:
    every epoch of the resumed fit then ends before drawing a batch."""

    def on_train_start(self, trainer, pl_module):
        trainer.fit_loop.epoch_loop.val_loop._has_run = True


def _fit_then_resume_on_the_same_trainer(tmp_path, extra_callbacks=()):
    pl.seed_everything(0)
    model = _TinyValidated()
    cycle = PulseCycle(burst=4, replay=3, maintain=1, warmup=0.1, anneal=0.1, probe_batches=1)
    callbacks = [cycle, HardSampleReplay(), *extra_callbacks]
    # max_epochs only as a safety net: max_steps ends both fits long before it, and a regression stops there
    trainer = pl.Trainer(callbacks=callbacks, max_steps=30, max_epochs=25, **trainer_kwargs())
    trainer.fit(model)
    checkpoint = str(tmp_path / "end.ckpt")
    trainer.save_checkpoint(checkpoint)
    first_steps = trainer.global_step
    trainer.fit_loop.epoch_loop.max_steps = 40  # the user asks for more steps
    return trainer, model, checkpoint, first_steps


def test_a_same_trainer_fit_resumed_from_its_final_checkpoint_trains_to_its_new_plan(tmp_path):
    # held-out sweep: the same Trainer and callbacks resumed from the checkpoint saved after a max_steps fit
    # (which the plan ends on a pass's end) replanned 34 steps, then every epoch trained no batch, forever: the
    # epoch restored done ended before the iteration that clears Lightning's restart, as the earlier fit's
    # validation still counted as run
    trainer, model, checkpoint, first_steps = _fit_then_resume_on_the_same_trainer(tmp_path)
    assert first_steps < 30  # the plan's steps
    trainer.fit(model, ckpt_path=checkpoint)
    assert first_steps < trainer.global_step == trainer.max_steps < 40
    assert trainer.current_epoch < 10

    # a new Trainer and new callbacks resuming the same checkpoint train the same steps
    cycle = PulseCycle(burst=4, replay=3, maintain=1, warmup=0.1, anneal=0.1, probe_batches=1)
    resumed = pl.Trainer(
        callbacks=[cycle, HardSampleReplay()], max_steps=40, max_epochs=25, **trainer_kwargs()
    )
    resumed.fit(_TinyValidated(), ckpt_path=checkpoint)
    assert resumed.global_step == trainer.global_step


def test_an_epoch_that_draws_no_batch_while_planned_steps_remain_is_refused_not_repeated(tmp_path):
    trainer, model, checkpoint, first_steps = _fit_then_resume_on_the_same_trainer(
        tmp_path, [_StaleValidationMark()]
    )
    with pytest.raises(PulseRefusal, match=r"HardSampleReplay: .*drew no batch .* new Trainer"):
        trainer.fit(model, ckpt_path=checkpoint)
    assert (
        trainer.global_step == first_steps and trainer.current_epoch < 10
    )  # refused at once, not at epoch 25


class _FullBatchRegression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("samples", [32, 64], ids=["one-batch-epochs", "two-batch-epochs"])
def test_full_batch_training_in_steps_mode_is_said_at_fit_start_and_its_end_names_why_nothing_was_selected(
    samples, tmp_path
):
    # held-out sweep (forty-first pass): a full-batch PINN under the default steps mode planned "1.000x" with no
    # reason, and its end said no sample "had a score yet" although every sample was scored at every step: a
    # window of B / replay_fraction indices cannot go beyond an epoch of one batch, so there was nothing to choose
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 4, generator=generator)
    data = TensorDataset(x, x[:, :1] * 2 + torch.randn(samples, 1, generator=generator))
    replay = HardSampleReplay(replay_fraction=0.5)
    trainer = pl.Trainer(**trainer_kwargs(max_epochs=3, callbacks=[replay], default_root_dir=tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_FullBatchRegression(), DataLoader(data, batch_size=32, shuffle=True))
    said = [str(w.message) for w in caught if "HardSampleReplay" in str(w.message)]
    at_start = [text for text in said if "can select nothing" in text]
    if samples == 64:  # a window of 64 out of two batches' epoch: selects
        assert not at_start and replay.metrics()["replay_fraction"] < 1
        return
    assert len(at_start) == 1 and "an epoch holds 32 samples (one batch" in at_start[0]
    assert "Use mode='batch'" in at_start[0] and "batch_size well below" in at_start[0]
    end = [text for text in said if "nothing was selected" in text]
    assert len(end) == 1 and "none had more samples to choose from than it trains" in end[0]
    assert "had a score yet" not in end[0] and (replay.table.steps >= 0).all()
    plan = plan_steps(None, ["replay"], 32, 0.5, 32, 3, None)
    assert "none of which can choose" in plan_summary(plan, None, batch_size=32)
    assert "none of which can choose" not in plan_summary(plan, None)
    # the way out it names selects
    replay = HardSampleReplay(replay_fraction=0.5, mode="batch")
    trainer = pl.Trainer(**trainer_kwargs(max_epochs=3, callbacks=[replay], default_root_dir=tmp_path))
    trainer.fit(_FullBatchRegression(), DataLoader(data, batch_size=32, shuffle=True))
    assert replay.metrics()["replay_fraction"] < 1


class _OneCycleEvery(MNIST1DClassifier):
    """A OneCycleLR of ``estimated_stepping_batches`` steps that Lightning steps with ``"frequency": 2``."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        steps = int(self.trainer.estimated_stepping_batches)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=5e-3, total_steps=steps)
        return [optimizer], [{"scheduler": schedule, "interval": "step", "frequency": 2}]


def test_a_schedule_of_frequency_2_under_accumulation_of_2_built_for_the_planned_steps_trains_to_its_end():
    # a review: with accumulate_grad_batches=2, "frequency": 2 counts batches, so Lightning steps the scheduler
    # at every optimizer step. The fit-start check read 12 // 2 = 6 steps of a OneCycleLR built for the 12
    # planned ones (also 24 // 2, the plain run's steps over the frequency) and refused it ("stop at 50%"),
    # saying to divide by 2: built so, it raised "Tried to step 7 times" at step 7
    pl.seed_everything(0)
    trainer = pl.Trainer(
        callbacks=[HardSampleReplay()],
        max_epochs=4,
        accumulate_grad_batches=2,
        **trainer_kwargs(limit_val_batches=0),
    )
    trainer.fit(_OneCycleEvery(), ShuffleFreeData(num_samples=1000, batch_size=64))
    schedule = trainer.lr_scheduler_configs[0].scheduler
    assert trainer.global_step == 12 and schedule.last_epoch == schedule.total_steps == 12
