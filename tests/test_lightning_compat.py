"""Fails loudly when a Lightning or torchmetrics upgrade moves something _lightning_compat relies on."""

from __future__ import annotations

import math
import time

import lightning.pytorch as pl
import pytest
import torch
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_pulse import _lightning_compat as compat
from tests.clients import BatchNormMLP
from tests.conftest import trainer_kwargs


def test_private_attributes_still_exist():
    assert compat.private_api_problems() == []


def test_frozen_metric_states_restores_accumulated_state():
    module = torch.nn.Module()
    module.acc = MulticlassAccuracy(num_classes=3, average="micro")
    module.acc.update(torch.tensor([0, 1]), torch.tensor([0, 1]))  # 2/2 correct
    with compat.frozen_metric_states(module):
        module.acc.update(torch.tensor([0, 0, 0]), torch.tensor([1, 1, 1]))  # 0/3 correct
        assert abs(module.acc.compute().item() - 0.4) < 1e-6
    assert module.acc.compute().item() == 1.0


def test_frozen_metric_states_updates_copies_and_gives_the_held_states_back_unwritten():
    # under ddp_spawn on CPU the held state tensors are memory both ranks share: a write into them (MeanMetric
    # updates in place) reached the other rank's metric (tests/test_probe_metrics_ddp.py)
    module = torch.nn.Module()
    module.mean = MeanMetric()
    module.mean.update(torch.tensor(2.0))
    held = module.mean.mean_value, module.mean.weight
    with compat.frozen_metric_states(module):
        module.mean.update(torch.tensor(4.0))
        assert module.mean.compute().item() == 3.0
    assert module.mean.mean_value is held[0] and module.mean.weight is held[1]
    assert (held[0].item(), held[1].item(), module.mean._update_count) == (2.0, 1.0, 1)


def test_progress_bar_item_is_added_to_the_bar_metrics(mnist1d_small):
    model, data = mnist1d_small()
    trainer = pl.Trainer(max_steps=1, **trainer_kwargs(enable_progress_bar=True))
    trainer.fit(model, data)
    compat.add_progress_bar_item(trainer, "answer", lambda: "42")
    compat.add_progress_bar_item(trainer, "hidden", lambda: None)
    shown = trainer.progress_bar_callback.get_metrics(trainer, model)
    assert shown["answer"] == "42" and "hidden" not in shown


def test_val_dataloader_found_before_validation_ran(mnist1d_small):
    model, data = mnist1d_small()
    trainer = pl.Trainer(max_steps=1, limit_val_batches=0, **trainer_kwargs())
    trainer.fit(model, data)
    loader = compat.val_dataloader_of(trainer, model)
    assert loader is not None and len(next(iter(loader))) == 2


def test_a_val_dataloader_given_to_fit_is_found_before_validation_ran(mnist1d_small):
    # held-out sweep: loaders given as fit(model, train, val) were not found before the first validation loop
    # (num_sanity_val_steps=0, and every resume), so the maintain and pruning probes switched off
    model, data = mnist1d_small()
    data.setup("fit")
    val_loader = data.val_dataloader()
    seen = []

    class Look(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            seen.append(compat.val_dataloader_of(trainer, pl_module))

    trainer = pl.Trainer(max_steps=1, callbacks=[Look()], check_val_every_n_epoch=100, **trainer_kwargs())
    trainer.fit(model, data.train_dataloader(), val_loader)
    assert seen == [val_loader]


def test_scheduled_prune_private_api_still_exists():
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher  # noqa: F401

    trainer = pl.Trainer(**trainer_kwargs())
    assert hasattr(trainer._checkpoint_connector, "_loaded_checkpoint")
    assert compat.loaded_checkpoint(trainer) is None
    assert hasattr(trainer._checkpoint_connector, "_ckpt_path")  # the finders' restore: no resume
    assert not compat.restoring_tuner_checkpoint(trainer)
    assert callable(DDPStrategy._setup_model) and callable(DDPStrategy._register_ddp_hooks)
    assert compat.spawns_worker_processes(pl.Trainer(**trainer_kwargs(devices=2, strategy="ddp_spawn")))
    assert not compat.rewrap_ddp(trainer)


def test_train_dataloader_hook_runs_before_the_first_pass(mnist1d_small):
    model, data = mnist1d_small()
    seen, first_batch = [], []

    class FirstBatch(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            first_batch.append(list(seen))

    trainer = pl.Trainer(max_steps=1, callbacks=[FirstBatch()], **trainer_kwargs())
    remove = compat.on_train_dataloader_ready(trainer, seen.append)
    trainer.fit(model, data)
    loaders = first_batch[0]
    assert len(loaders) == 1 and loaders[0] is trainer.train_dataloader
    remove()
    assert "process_dataloader" not in vars(trainer.strategy)


def test_train_dataloaders_built_hook_sees_a_hooks_loaders_before_any_is_set_up(mnist1d_small):
    model, data = mnist1d_small()
    built, ready = [], []
    trainer = pl.Trainer(max_steps=1, limit_train_batches=3, **trainer_kwargs())
    remove_ready = compat.on_train_dataloader_ready(trainer, lambda loader: ready.append(len(built)))
    remove = compat.on_train_dataloaders_built(trainer, built.append)
    trainer.fit(model, data)
    assert len(built) == 1 and len(built[0]) == 1 and ready == [1]  # the datamodule's one, before its set-up
    assert built[0][0].dataset is trainer.train_dataloader.dataset
    # an epoch's batches under limit_train_batches, as Lightning counts them: 3 of the loader's 12
    assert (
        compat.training_batches_taken(trainer, trainer.train_dataloader) == trainer.num_training_batches == 3
    )
    remove(), remove_ready()
    assert "dataloader" not in vars(trainer.fit_loop._data_source)


def test_training_step_output_hook_sees_the_output_before_the_steps_backward(mnist1d_small):
    model, data = mnist1d_small()
    seen, at_backward = [], []

    class AtBackward(pl.Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            at_backward.append(len(seen))

    trainer = pl.Trainer(max_steps=2, callbacks=[AtBackward()], **trainer_kwargs())
    remove = compat.on_training_step_output(trainer, seen.append)
    trainer.fit(model, data)
    assert at_backward == [1, 2] and all(isinstance(output, torch.Tensor) for output in seen)
    remove()
    assert "training_step" not in vars(trainer.strategy)


@pytest.mark.parametrize("removed_first", ["input", "output"])
def test_training_step_input_hook_sees_the_batch_after_every_batch_start_hook_beside_an_output_hook(
    mnist1d_small, removed_first
):
    """Both wrappers stack on the strategy, removed in either order: the input hook gets the batch a later
    batch-start hook rebound, before the step; after both removals the strategy's own method is back."""
    model, data = mnist1d_small()
    batches, outputs = [], []

    class Marks(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            batch.append("marked")  # the module's batch is a list: seen by the input hook

    trainer = pl.Trainer(max_steps=2, callbacks=[Marks()], **trainer_kwargs())
    remove_input = compat.on_training_step_input(trainer, lambda batch: batches.append(batch[-1]))
    remove_output = compat.on_training_step_output(trainer, outputs.append)
    model.training_step = lambda batch, batch_idx, step=model.training_step: step(batch[:-1], batch_idx)
    trainer.fit(model, data)
    assert batches == ["marked", "marked"] and len(outputs) == 2
    removals = [remove_input, remove_output] if removed_first == "input" else [remove_output, remove_input]
    for remove in removals:
        remove()
    model.training_step = lambda batch, batch_idx: torch.tensor(0.0)
    trainer.strategy.training_step(["batch"], 0)
    assert len(batches) == 2 and len(outputs) == 2  # both inactive, whichever wrapper stays in the chain


def test_set_sampler_epoch_sets_a_loaders_sampler_epoch_through_lightnings_own_call():
    from torch.utils.data import DataLoader

    class EpochSampler(torch.utils.data.Sampler):
        epoch = 0

        def set_epoch(self, epoch):
            self.epoch = epoch

        def __iter__(self):
            return iter(range(4))

        def __len__(self):
            return 4

    sampler = EpochSampler()
    compat.set_sampler_epoch(DataLoader(range(4), sampler=sampler, batch_size=2), 3)
    assert sampler.epoch == 3


def test_set_callback_metric_is_visible_through_the_public_callback_metrics():
    trainer = pl.Trainer(**trainer_kwargs())
    assert isinstance(trainer._logger_connector._callback_metrics, dict)
    compat.set_callback_metric(trainer, "energy/total_kwh", 0.25)
    assert float(trainer.callback_metrics["energy/total_kwh"]) == 0.25


def test_checkpoints_monitoring_a_key_give_their_step_intervals_and_time_intervals():
    from datetime import timedelta

    from lightning.pytorch.callbacks import ModelCheckpoint

    key = "energy/total_kwh"
    hourly = timedelta(hours=1)
    checkpoints = [
        ModelCheckpoint(monitor=key, every_n_train_steps=5),
        ModelCheckpoint(monitor=key, every_n_train_steps=3, save_top_k=-1),
        ModelCheckpoint(monitor=key, train_time_interval=hourly),
        ModelCheckpoint(monitor="val_loss", every_n_train_steps=2),
        ModelCheckpoint(monitor=key),  # at validation or epoch ends only
    ]
    trainer = pl.Trainer(callbacks=checkpoints, **trainer_kwargs(enable_checkpointing=True))
    assert compat.checkpoints_monitoring(trainer, key) == ((3, 5), [hourly])
    assert compat.checkpoints_monitoring(trainer, "train_loss") == ((), [])


class _TrainingKeyMonitors(pl.Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        self.found = compat.training_key_monitors(trainer)


def test_training_key_monitors_names_the_monitors_of_keys_logged_in_the_training_loop(
    mnist1d_small, tmp_path
):
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    model, data = (
        mnist1d_small()
    )  # logs `train_loss` in training_step, `val_loss` and `val_acc` in validation
    probe = _TrainingKeyMonitors()
    callbacks = [
        probe,
        EarlyStopping(monitor="train_loss", patience=9),
        EarlyStopping(monitor="val_loss", patience=9),
        ModelCheckpoint(dirpath=tmp_path, monitor="train_loss"),
    ]
    options = trainer_kwargs(enable_checkpointing=True, limit_train_batches=2, limit_val_batches=1)
    trainer = pl.Trainer(callbacks=callbacks, max_epochs=1, default_root_dir=tmp_path, **options)
    trainer.fit(model, data)
    assert probe.found == [
        ("EarlyStopping(monitor='train_loss')", "train_loss"),
        ("ModelCheckpoint(monitor='train_loss')", "train_loss"),
    ]


class _HookOrder(pl.Callback):
    def __init__(self, name: str, calls: list[str], appends: pl.Callback | None = None) -> None:
        self.name, self.calls, self.appends = name, calls, appends

    def setup(self, trainer, pl_module, stage) -> None:
        if self.appends is not None:
            compat.append_callback_for_fit(trainer, self.appends)
            compat.append_callback_for_fit(trainer, self.appends)  # once

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.calls.append(self.name)

    def teardown(self, trainer, pl_module, stage) -> None:
        if self.appends is not None:
            compat.remove_callback(trainer, self.appends)


def test_a_callback_appended_at_setup_runs_last_in_each_later_hook_after_a_model_checkpoint(
    mnist1d_small, tmp_path
):
    # GreenWindow's SuspendSave relies on it: hooks iterate trainer.callbacks itself, checkpoints moved first
    calls: list[str] = []

    class Checkpoint(pl.callbacks.ModelCheckpoint):
        def on_train_batch_end(self, trainer, *args) -> None:
            calls.append("checkpoint")
            super().on_train_batch_end(trainer, *args)

    last = _HookOrder("appended", calls)
    callbacks = [
        _HookOrder("first", calls, appends=last),
        Checkpoint(dirpath=tmp_path),
        _HookOrder("after", calls),
    ]
    trainer = pl.Trainer(max_steps=2, callbacks=callbacks, **trainer_kwargs(enable_checkpointing=True))
    trainer.fit(*mnist1d_small(arch="mlp"))
    assert calls == ["first", "after", "checkpoint", "appended"] * 2
    assert last not in trainer.callbacks


def test_the_exit_time_group_teardown_is_registered_only_in_a_distributed_run(monkeypatch):
    registered = []
    monkeypatch.setattr("atexit.register", registered.append)
    monkeypatch.setattr(compat, "_DESTROY_REGISTERED", False)
    compat.destroy_process_group_at_exit()  # no process group in this process: nothing to tear down
    assert registered == [] and compat._DESTROY_REGISTERED is False


def test_all_gather_held_stacks_one_process_without_a_collective():
    class OneProcess:
        world_size = 1

    hold = compat.CollectiveHold()
    tensor = torch.arange(3.0)
    gathered = compat.all_gather_held(OneProcess(), tensor, hold)
    assert gathered.shape == (1, 3) and torch.equal(gathered[0], tensor) and hold.tensors == []


def test_total_steps_counts_each_epoch_at_its_own_accumulation_under_a_scheduler(mnist1d_small):
    # held-out sweep: Lightning's estimate counts every epoch at the current accumulation (48 at the start of
    # this run, 12 from its second epoch on); GradientCache froze past `release_at` and ScheduledPrune's end
    # fell past the run's end. 12 batches an epoch: 12 steps, then 3 an epoch (the short window steps at the
    # end)
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    from lightning_pulse import GradientCache, PruneOptions, ScheduledPrune

    class TotalAtEachEpoch(pl.Callback):
        def __init__(self):
            self.totals = []

        def on_train_epoch_start(self, trainer, pl_module):
            self.totals.append(compat.total_steps(trainer))

    model, data = mnist1d_small()
    seen = TotalAtEachEpoch()
    cache = GradientCache(check_every=2, freeze_for=4, threshold=1.0, release_at=0.7)
    prune = ScheduledPrune(
        start=0.2, end=0.7, every=2, probe_batches=0, options=PruneOptions(cadence="steps")
    )
    scheduler = GradientAccumulationScheduler({0: 1, 1: 5})
    trainer = pl.Trainer(callbacks=[scheduler, seen, cache, prune], max_epochs=4, **trainer_kwargs())
    trainer.fit(model, data)
    assert trainer.global_step == 21 and seen.totals == [21.0] * 4
    assert cache._span == (None, 15) and (prune.schedule.start_step, prune.schedule.end_step) == (4, 15)
    assert prune.schedule.sparsity == pytest.approx(0.5)


def test_total_steps_under_an_accumulation_scheduler_is_capped_by_max_steps(mnist1d_small):
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    model, data = mnist1d_small()
    scheduler = GradientAccumulationScheduler({0: 1, 1: 5})
    trainer = pl.Trainer(callbacks=[scheduler], max_epochs=4, max_steps=14, **trainer_kwargs())
    trainer.fit(model, data)
    assert trainer.global_step == 14 and compat.total_steps(trainer) == 14.0


def _loader(samples: int = 80):
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(samples, 10, generator=generator), torch.randint(0, 3, (samples,), generator=generator)
    )
    return torch.utils.data.DataLoader(data, batch_size=8)  # 10 batches a pass


@pytest.mark.parametrize("swa_first", [False, True])
def test_run_length_leaves_out_the_batch_norm_epoch_of_stochastic_weight_averaging(swa_first):
    """Held-out sweep: SWA raises max_epochs by one on a model with BatchNorm for an epoch that only
    recomputes BatchNorm statistics (no backward); the run length read 60 steps where 50 train. Either side of
    SWA's hooks, and inside that epoch (one batch more, an accumulation spanning it), the length is 50."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    class Reader(pl.Callback):
        def __init__(self):
            self.read, self.taken_at_end = [], None

        def _read(self, trainer, hook):
            steps, batches = compat.run_length(trainer)
            self.read.append(
                (hook, trainer.current_epoch, steps, batches, compat.in_batch_norm_update_epoch(trainer))
            )

        def on_train_start(self, trainer, pl_module):
            self._read(trainer, "train_start")

        def on_train_epoch_start(self, trainer, pl_module):
            self._read(trainer, "epoch_start")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 9:
                self._read(trainer, "last_batch")

        def on_train_epoch_end(self, trainer, pl_module):
            self._read(trainer, "epoch_end")

        def on_train_end(self, trainer, pl_module):
            self.taken_at_end = compat.training_steps_taken(trainer)

    reader, swa = Reader(), StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=0.6)
    callbacks = [swa, reader] if swa_first else [reader, swa]
    trainer = pl.Trainer(callbacks=callbacks, max_epochs=5, **trainer_kwargs())
    trainer.fit(BatchNormMLP(), _loader())
    assert trainer.global_step == 51  # the BatchNorm epoch's window closes with a step, no backward
    assert {(steps, batches) for _, _, steps, batches, _ in reader.read} == {(50.0, 50.0)}
    in_update_epoch = {(hook, epoch) for hook, epoch, *_, inside in reader.read if inside}
    assert in_update_epoch == {("epoch_start", 5), ("last_batch", 5), ("epoch_end", 5)}
    assert reader.taken_at_end == 50 and compat.training_max_epochs(trainer) == trainer.max_epochs == 5


def test_a_training_cap_leaves_the_step_of_the_batch_norm_epoch_out_of_the_run_length():
    """A cap of 50 training steps before SWA's BatchNorm epoch sets max_steps=51 (that epoch's step counts)
    and the run length stays 50."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    class Cap(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            self.cap = compat.cap_training_steps(trainer, 50, batch_norm_step=True)
            self.total = compat.total_steps(trainer)

    cap = Cap()
    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=0.6)
    trainer = pl.Trainer(callbacks=[swa, cap], max_epochs=5, **trainer_kwargs())
    trainer.fit(BatchNormMLP(), _loader())
    # had it been capped at 50, the fit would have ended before the BatchNorm epoch
    assert (cap.cap, cap.total, trainer.global_step, trainer.current_epoch) == (51, 50.0, 51, 6)


def _read_run_length_at_train_start(trainer: pl.Trainer, module: pl.LightningModule) -> tuple[float, float]:
    class Reader(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            self.read = compat.run_length(trainer)

    reader = Reader()
    trainer.callbacks.append(reader)
    trainer.fit(module, _loader())
    return reader.read


def test_run_length_is_unknown_where_a_manual_module_steps_several_optimizers_a_batch():
    """Held-out sweep: a GAN-style module stepping two optimizers a batch takes 2 global steps a batch, and
    the run length was Lightning's one a batch (30 for 60). Only max_steps alone gives it in steps; with one
    optimizer, one step a batch stands."""
    from tests.test_pulse_cycle import ManualPlayers

    two = pl.Trainer(max_epochs=3, **trainer_kwargs())
    assert _read_run_length_at_train_start(two, ManualPlayers(players=2)) == (math.inf, math.inf)
    assert two.global_step == 60
    bounded = pl.Trainer(max_steps=50, **trainer_kwargs())
    assert _read_run_length_at_train_start(bounded, ManualPlayers(players=2)) == (50.0, math.inf)
    assert bounded.global_step == 50
    one = pl.Trainer(max_epochs=3, **trainer_kwargs())
    assert _read_run_length_at_train_start(one, ManualPlayers(players=1)) == (30.0, 30.0)
    assert one.global_step == 30


def test_readers_of_the_run_length_refuse_or_leave_out_shares_of_a_manual_run_of_two_optimizers(tmp_path):
    """ScheduledPrune refuses float start/end (pruning ended at 35% of the run), takes int steps past
    Lightning's one-a-batch estimate, HardSampleReplay's steps mode refuses on the same check, and
    EnergyLogger makes no forecast where it forecast half the run."""
    from lightning_pulse import EnergyLogger, HardSampleReplay, MeterConfig, PulseRefusal, ScheduledPrune
    from tests.test_pulse_cycle import ManualPlayers

    def fit(callbacks, **length):
        trainer = pl.Trainer(callbacks=callbacks, **(length or {"max_epochs": 3}), **trainer_kwargs())
        trainer.fit(ManualPlayers(players=2), _loader())
        return trainer

    shares = ScheduledPrune(final_sparsity=0.5, start=0.1, end=0.7, every=4)
    with pytest.raises(
        PulseRefusal, match=r"^ScheduledPrune: `start`=0.1 and `end`=0.7 are shares .* 2 optimizers"
    ):
        fit([shares])
    steps = ScheduledPrune(final_sparsity=0.5, start=32, end=52, every=4)  # past the estimate's 30 steps
    fit([steps])
    assert [event["step"] for event in steps.events] == [36, 40, 44, 48, 52]  # sparsity 0 at step 32
    with pytest.raises(
        PulseRefusal, match=r"^HardSampleReplay: mode='steps' .* steps 2 optimizers per batch"
    ):
        fit([HardSampleReplay(mode="steps")])

    def forecast(**length):
        energy = EnergyLogger(
            report_dir=str(tmp_path), cpu="constant", ram="none", meters=MeterConfig(cpu_watts=50)
        )
        trainer = fit([energy], **length)
        return energy.report["prediction"], energy.report["total"]["steps"], trainer.global_step

    assert forecast() == (None, 60, 60)
    prediction, steps_taken, _ = forecast(max_steps=60)  # max_steps alone: a length in steps, per step
    assert prediction["total_steps"] == steps_taken == 60
    basis_kwh = float(prediction["basis"].split(", ")[-1].removesuffix(" kWh"))  # an epoch of 20 steps
    assert prediction["energy_kwh"] == pytest.approx(3 * basis_kwh, rel=1e-4)


class _Doubler(torch.nn.Module):
    def forward(self, x):
        return 2 * x


@pytest.mark.parametrize("fullgraph", [True, False])
def test_a_part_compiled_in_place_is_found_and_watched_only_under_fullgraph(fullgraph):
    # Module.compile() leaves no wrapper, only the private _compiled_call_impl, and keeps its fullgraph only in
    # the closure of the function torch.compile returns: a torch upgrade that moves either fails here
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), _Doubler())
    model[1].compile(backend="eager", fullgraph=fullgraph)
    assert compat.compiled_part(model) == "1"
    assert compat._fullgraph(compat._in_place_dynamo_ctx(model[1]._compiled_call_impl)) is fullgraph
    compiled_call = model[1]._compiled_call_impl
    breaks = compat.FullgraphBreaks()
    breaks.watch(model, lambda part, message: None)
    assert (model[1]._compiled_call_impl is not compiled_call) is fullgraph  # a fallback part left alone
    assert torch.equal(model[1](torch.ones(1, 2)), torch.full((1, 2), 2.0))
    breaks.release()
    assert model[1]._compiled_call_impl is compiled_call


FORECAST_LINE = (
    "Read again at each epoch's end as `max_epochs` times that epoch's batches, so blind to the lengths of "
    "the epochs still to come: EnergyLogger (the forecast of the run's energy)."
)


def test_every_share_placed_on_a_run_whose_reloaded_epochs_change_length_is_named_in_one_warning(
    tmp_path, recwarn
):
    """Held-out sweep: a growing curriculum's run was read from its first epoch's length: ScheduledPrune ended
    its schedule at 36% of the run, GradientCache released at 43% where 0.8 was asked, EnergyLogger forecast
    16 of 28 steps, unsaid. Here 3 + 4 + 5 + 6 batches are read as 12 steps at fit start and 16 at the next
    epoch: one warning there names every share and the ways out."""
    from lightning_pulse import EnergyLogger, GradientCache, MeterConfig, ScheduledPrune
    from tests.clients import BatchNormMLP
    from tests.test_pulse_cycle import Curriculum

    prune = ScheduledPrune(final_sparsity=0.5, start=0.1, end=0.7, every=4)
    cache = GradientCache(check_every=2, freeze_for=4, threshold=1.0, release_at=0.8)
    energy = EnergyLogger(
        report_dir=str(tmp_path), cpu="constant", ram="none", meters=MeterConfig(cpu_watts=50)
    )
    trainer = pl.Trainer(
        callbacks=[prune, cache, energy],
        max_epochs=4,
        reload_dataloaders_every_n_epochs=1,
        **trainer_kwargs(),
    )
    trainer.fit(BatchNormMLP(), datamodule=Curriculum(grow=1))
    said = [str(w.message) for w in recwarn if "`reload_dataloaders_every_n_epochs`" in str(w.message)]
    assert len(said) == 1, said
    assert said[0].startswith(
        "ScheduledPrune, GradientCache, EnergyLogger: the training DataLoader rebuilt for "
    )
    assert "the run, read as 12 optimizer steps (16 now)" in said[0]
    placed = "ScheduledPrune (`start`=0.1, `end`=0.7), GradientCache (`release_at`=0.8)."
    assert "These were placed as shares of 12 steps and will not land where asked: " + placed in said[0]
    # the forecast is read again at each epoch's end: not placed once, only blind to the epochs to come
    assert FORECAST_LINE in said[0]
    assert said[0].endswith("or give ScheduledPrune's and GradientCache's settings as int optimizer steps.")


def test_an_energy_logger_alone_on_a_growing_curriculum_says_its_forecast_is_read_again_each_epoch(
    tmp_path, recwarn
):
    """Review of 15c67e8: EnergyLogger's forecast, read again at each epoch's end, was said to be "placed as
    shares of 12 steps" that "will not land where asked"; it only cannot see the lengths of the epochs to
    come. The way out (`max_steps`) stays."""
    from lightning_pulse import EnergyLogger, MeterConfig
    from tests.clients import BatchNormMLP
    from tests.test_pulse_cycle import Curriculum

    energy = EnergyLogger(
        report_dir=str(tmp_path), cpu="constant", ram="none", meters=MeterConfig(cpu_watts=50)
    )
    trainer = pl.Trainer(
        callbacks=[energy], max_epochs=3, reload_dataloaders_every_n_epochs=1, **trainer_kwargs()
    )
    trainer.fit(BatchNormMLP(), datamodule=Curriculum(grow=1))
    said = [str(w.message) for w in recwarn if "`reload_dataloaders_every_n_epochs`" in str(w.message)]
    assert len(said) == 1, said
    assert said[0].startswith("EnergyLogger: the training DataLoader rebuilt for epoch 1 ")
    assert "placed as shares" not in said[0] and "will not land" not in said[0]
    assert FORECAST_LINE in said[0]
    assert said[0].endswith(
        "Set Trainer(max_steps=N) and leave `max_epochs` unset, so that the run's length is known."
    )


@pytest.mark.parametrize("interval", [{"seconds": 0.3}, "00:00:00:01"])
def test_a_time_based_val_check_interval_leaves_a_step_saving_plan_to_lightning(interval):
    # Lightning 2.6 keeps a time interval in `_val_check_time_interval` and sets no `val_check_interval`:
    # reading the latter at each planned pass crashed the README's stack at train start
    from examples.digits.data import DigitsDataModule
    from lightning_pulse import HardSampleReplay, PulseCycle
    from tests.clients import EncoderClassifier

    class Slow(pl.Callback):  # 0.1 s a batch: a run of about 3 s validates by time, whatever the machine
        validated: list[int] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            time.sleep(0.1)

        def on_validation_end(self, trainer, pl_module):
            self.validated.append(trainer.global_step)

    pl.seed_everything(0)
    replay, slow = HardSampleReplay(), Slow()
    cycle = PulseCycle(burst=6, replay=4, maintain=2, maintain_eval="none")
    trainer = pl.Trainer(
        callbacks=[cycle, replay, slow], max_epochs=3, val_check_interval=interval, **trainer_kwargs()
    )
    trainer.fit(EncoderClassifier(), DigitsDataModule(batch_size=128))
    assert trainer.global_step == replay.steps.plan.total_steps < 3 * 11  # the plan ran, and saved steps
    assert trainer.current_epoch == 3
    assert slow.validated and any(0 < step < trainer.global_step for step in slow.validated)  # by time


class _StepsCounter(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        self.counter = compat.optimizer_steps_counter(trainer)
        assert self.counter() == 0


def test_the_steps_counter_reads_a_trainers_global_step_later_automatic_and_manual():
    """OneRunPerInstance reads, at an instance's next fit, the optimizer steps its earlier fit took, through
    this counter (the earlier Trainer may be gone): it must follow ``global_step``, not stay at its start."""
    from tests.test_pulse_cycle import ManualPlayers

    for module, steps in ((BatchNormMLP(), 20), (ManualPlayers(players=2), 40)):
        counting = _StepsCounter()
        trainer = pl.Trainer(callbacks=[counting], max_epochs=2, **trainer_kwargs())
        trainer.fit(module, _loader())
        assert counting.counter() == trainer.global_step == steps


class _ExceptionOrder(pl.Callback):
    """Records its ``on_exception`` and, from it, installs the hook that runs after every other one."""

    def __init__(self, calls: list[str], name: str, install: bool = False) -> None:
        self.calls, self.name, self.install = calls, name, install

    def on_exception(self, trainer, pl_module, exception):
        self.calls.append(self.name)
        if self.install:
            self.watch = compat.HookWatch(compat.after_exception_hooks)
            self.watch.once(trainer, lambda _: self.calls.append("after"))


class _SavesOnException(_ExceptionOrder, pl.callbacks.Checkpoint):
    pass


class _Fails(BatchNormMLP):
    def training_step(self, batch, batch_idx):
        raise RuntimeError("fails")


def test_the_hook_after_exception_runs_once_every_on_exception_ran_checkpoint_callbacks_last(tmp_path):
    """ScheduledPrune folds its masks there, so that a checkpoint saved on the exception keeps them."""
    calls: list[str] = []
    callbacks = [_SavesOnException(calls, "checkpoint"), _ExceptionOrder(calls, "first", install=True)]
    trainer = pl.Trainer(
        callbacks=callbacks,
        max_steps=2,
        **trainer_kwargs(default_root_dir=tmp_path, enable_checkpointing=True),
    )
    with pytest.raises(RuntimeError, match="fails"):
        trainer.fit(_Fails(), _loader())
    assert calls == ["first", "checkpoint", "after"]  # Lightning calls checkpoint callbacks last
    assert "on_exception" not in vars(trainer.strategy)  # a once-hook removes itself


class _UnfinishedAt(pl.Callback):
    """``compat.in_unfinished_step`` (and the watch's answer) at the first step's hooks, once."""

    def __init__(self) -> None:
        self.seen: dict[str, bool] = {}
        self.watch = compat.UnfinishedStepWatch()

    def _at(self, trainer, hook):
        if trainer.current_epoch == 0 and hook not in self.seen:
            self.seen[hook] = compat.in_unfinished_step(trainer)
            assert self.watch() == self.seen[hook]

    def on_train_start(self, trainer, pl_module):
        self.watch.watch(trainer)
        self._at(trainer, "on_train_start")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._at(trainer, "on_train_batch_start")

    def on_before_backward(self, trainer, pl_module, loss):
        self._at(trainer, "on_before_backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._at(trainer, "on_before_optimizer_step")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._at(trainer, "on_train_batch_end")

    def on_train_epoch_end(self, trainer, pl_module):
        self._at(trainer, "on_train_epoch_end")


def test_a_step_is_unfinished_from_its_batch_start_to_its_update_and_after_an_exception_in_it(tmp_path):
    """What a checkpoint saved in each hook resumes by training again: the batch fetched last while Lightning
    counts it ready and not processed (a resume trains it again, from the weights before its update)."""
    seen = _UnfinishedAt()
    trainer = pl.Trainer(callbacks=[seen], max_steps=2, **trainer_kwargs(default_root_dir=tmp_path))
    trainer.fit(BatchNormMLP(), _loader())
    inside = {"on_train_batch_start": True, "on_before_backward": True, "on_before_optimizer_step": True}
    assert seen.seen == {
        "on_train_start": False,
        **inside,
        "on_train_batch_end": False,
        "on_train_epoch_end": False,
    }
    assert not compat.in_unfinished_step(trainer)  # after the fit
    failed = pl.Trainer(max_steps=2, **trainer_kwargs(default_root_dir=tmp_path))
    with pytest.raises(RuntimeError, match="fails"):
        failed.fit(_Fails(), _loader())
    assert compat.in_unfinished_step(failed)  # a save after the exception: a resume trains that batch again


def test_training_copy_has_its_own_sampler_and_the_users_batch_size_and_drop_last():
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

    from lightning_pulse.energy.counting import loader_batch_size

    data = TensorDataset(torch.arange(20.0))
    for user in (
        DataLoader(data, batch_size=8),
        DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 8, False)),
    ):
        copied = compat.training_copy(user)
        assert copied.batch_sampler is not user.batch_sampler
        assert isinstance(copied.batch_sampler, BatchSampler) and loader_batch_size(copied) == 8
        copied.batch_sampler.sampler = SequentialSampler(range(4))  # an index recorder goes there
        assert len(user.batch_sampler.sampler) == 20
        # a curriculum's batch size or drop_last, set on either object, is the other's too
        user.batch_sampler.batch_size, user.batch_sampler.drop_last = 3, True
        assert [len(b) for b in copied.batch_sampler] == [3] and len(copied) == 1
        copied.batch_sampler.batch_size = 2
        assert user.batch_sampler.batch_size == 2 and len(user) == 10


def test_the_training_copy_pickles_and_lightning_rebuilds_it():
    # a review: the copy's class is made at run time; pickling it and Lightning's re-instantiation both failed
    import pickle

    from lightning.pytorch.utilities.data import _update_dataloader
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    data = TensorDataset(torch.arange(20.0))
    user = DataLoader(data, batch_size=8)
    copied = compat.training_copy(user)
    again = pickle.loads(pickle.dumps(copied.batch_sampler))
    assert again.batch_size == 8 and [len(batch) for batch in again] == [8, 8, 4]
    rebuilt = _update_dataloader(copied, DistributedSampler(data, num_replicas=2, rank=0))
    assert rebuilt.batch_sampler.batch_size == 8 and len(rebuilt) == 2
