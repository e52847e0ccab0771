"""HardSampleReplay on data pipelines a sweep found mishandled: steps whose ``training_step`` returns
``None``, a reloaded DataLoader under ``limit_train_batches``, an index sampler without ``__len__``, and two
DataLoaders a DataModule hook builds next to a Trainer setting steps mode refuses."""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_pulse.callbacks.hard_sample_replay import HardSampleReplay
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs

N = 96


class _Indexed(Dataset):
    """Sample ``i`` is ``(x_i, y_i)``: 8 features, 4 classes."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, 8, generator=generator)
        self.y = (self.x @ torch.randn(8, 4, generator=generator)).argmax(1)

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


class _Mlp(pl.LightningModule):
    """A 2-layer MLP; ``skip_every``: ``training_step`` returns ``None`` (Lightning skips the step) on the
    batches whose ``batch_idx % skip_every == 1``, noted in ``skipped``."""

    def __init__(self, skip_every: int = 0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.skip_every = skip_every
        self.skipped: set[tuple[int, int]] = set()
        self.steps_trained = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.skip_every and batch_idx % self.skip_every == 1:
            self.skipped.add((self.current_epoch, batch_idx))
            return None
        self.steps_trained += 1
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Batches(pl.Callback):
    """Listed after HardSampleReplay: what each batch trains, as the callback planned it."""

    def __init__(self, replay: HardSampleReplay) -> None:
        self.replay, self.rows = replay, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        replay = self.replay
        self.rows.append(
            (
                (trainer.current_epoch, batch_idx),
                replay.trained_indices.tolist(),
                replay.trained_origins,
                replay.offered_count,
            )
        )


@pytest.mark.filterwarnings("ignore:`training_step` returned `None`")
def test_steps_whose_training_step_returns_none_count_in_no_figure_and_mark_no_sample():
    # held-out sweep: every third step returned None (no backward, no update), and its samples were counted
    # as trained: replayed_distinct 58 for 51, replay_fraction 0.5885 for 0.5703, and marked as awaiting a
    # new measurement (learned_rate, came_back_rate)
    replay = HardSampleReplay(mode="batch", score_half_life=None)
    batches, model = _Batches(replay), _Mlp(skip_every=3)
    trainer = pl.Trainer(callbacks=[replay, batches], max_epochs=4, **trainer_kwargs())
    trainer.fit(model, DataLoader(_Indexed(), batch_size=8, shuffle=True))
    trained = [row for row in batches.rows if row[0] not in model.skipped]
    selected = {i for _, indices, origins, _ in trained for i, o in zip(indices, origins) if o == "selected"}
    only_skipped = {
        i
        for at, indices, origins, _ in batches.rows
        if at in model.skipped
        for i, o in zip(indices, origins)
        if o == "selected"
    } - selected
    assert only_skipped, "no sample was selected in a skipped step only: the test shows nothing"
    metrics, totals = replay.metrics(), replay.selector.totals
    assert set(np.flatnonzero(replay.table.replays > 0).tolist()) == selected
    assert metrics["replayed_distinct"] == len(selected)
    offered = sum(row[3] for row in trained)
    assert metrics["replay_fraction"] == pytest.approx(sum(len(row[1]) for row in trained) / offered)
    assert totals["steps"] == model.steps_trained == len(trained)


class _Reloading(_Mlp):
    """Builds its training DataLoader anew at every epoch, over one dataset object."""

    def __init__(self) -> None:
        super().__init__()
        self.data = _Indexed()

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=8, shuffle=True)


@pytest.mark.parametrize("limit", [5, 0.5], ids=["batches", "share"])
def test_a_half_life_in_epochs_stays_the_trainers_epoch_after_a_reload_under_limit_train_batches(limit):
    # held-out sweep: 25 steps (5 epochs of 5 batches) in the first epoch, then 60 (5 of the loader's 12) from
    # the first reload on, so scores faded 2.4x slower than configured
    replay = HardSampleReplay(mode="batch", score_half_life=5.0)
    half_lives = []

    class EpochStart(pl.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            half_lives.append((trainer.num_training_batches, replay.table.half_life))

    trainer = pl.Trainer(
        callbacks=[replay, EpochStart()],
        max_epochs=3,
        reload_dataloaders_every_n_epochs=1,
        limit_train_batches=limit,
        **trainer_kwargs(),
    )
    trainer.fit(_Reloading())
    batches = 5 if limit == 5 else 6
    assert half_lives == [(batches, 5.0 * batches)] * 3


class _NoLength(Sampler[int]):
    """An index sampler with ``__iter__`` only (a streaming sampler): the DataLoader has no length."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(torch.randperm(N, generator=torch.Generator().manual_seed(self.epoch)).tolist())


@pytest.mark.parametrize("case", ["batch_steps_half_life", "steps", "batch_epochs_half_life"])
def test_an_index_sampler_without_length_trains_in_batch_mode_and_is_refused_otherwise_naming_why(case):
    # held-out sweep: each failed at the data set-up with a bare TypeError ("object of type 'NoLen' has no
    # len()")
    replay = {
        "batch_steps_half_life": HardSampleReplay(mode="batch", score_half_life=20),
        "steps": HardSampleReplay(mode="steps", score_half_life=20),
        "batch_epochs_half_life": HardSampleReplay(mode="batch", score_half_life=5.0),
    }[case]
    model = _Mlp()
    trainer = pl.Trainer(callbacks=[replay], max_steps=30, max_epochs=-1, **trainer_kwargs())
    loader = DataLoader(_Indexed(), batch_size=8, sampler=_NoLength())
    if case == "batch_steps_half_life":
        trainer.fit(model, loader)
        assert trainer.global_step == model.steps_trained == 30
        assert replay.table.half_life == 20 and replay.metrics()["replayed_distinct"] > 0
        return
    if case == "steps":
        expected = (
            PulseRefusal,
            r"^HardSampleReplay: mode='steps' .* \(_NoLength\) has no `__len__`.*mode='batch'",
        )
    else:
        expected = ValueError, r"`score_half_life`=5epochs is in epochs .* no length; give it in steps"
    with pytest.raises(expected[0], match=expected[1]):
        trainer.fit(model, loader)
    assert model.steps_trained == 0


class _TwoLoaders(pl.LightningDataModule):
    def train_dataloader(self):
        return {"a": DataLoader(_Indexed(), batch_size=8), "b": DataLoader(_Indexed(), batch_size=8)}


@pytest.mark.parametrize(
    "setting",
    [{"limit_train_batches": 3}, {"reload_dataloaders_every_n_epochs": 1}],
    ids=["limit_train_batches", "reload"],
)
def test_two_loaders_of_a_datamodule_hook_are_refused_before_a_setting_whose_way_out_they_refuse(setting):
    # held-out sweep: steps mode refused the setting first, naming mode='batch', which then refused the two
    # DataLoaders; given to fit(), the same loaders were refused first, as the docs say
    model = _Mlp()
    trainer = pl.Trainer(
        callbacks=[HardSampleReplay(mode="steps")], max_epochs=2, **setting, **trainer_kwargs()
    )
    with pytest.raises(
        PulseRefusal, match="^HardSampleReplay needs one training DataLoader, .* several DataLoaders"
    ):
        trainer.fit(model, datamodule=_TwoLoaders())
    assert model.steps_trained == 0


def test_the_rank_gather_of_a_step_where_no_rank_trained_a_row_gives_no_rows():
    # a review: under DDP, the BatchNorm-update epoch of StochasticWeightAveraging runs no backward, so
    # every rank records no row; the gather reshaped its zero rows to (-1, 0, 3) and raised on both ranks
    import numpy as np

    from lightning_pulse.core.replay import gather_rows_and_codes

    def all_gather_of_two_ranks(tensor):  # two ranks sending the same tensor, stacked as all_gather does
        return torch.stack([tensor, tensor])

    indices, losses = torch.zeros(0, dtype=torch.long), torch.zeros(0)
    gathered = gather_rows_and_codes(
        all_gather_of_two_ranks, indices, losses, np.zeros(0, dtype=np.int64), offered=8.0, code=1
    )
    merged_indices, merged_losses, roles, offered, codes = gathered
    assert merged_indices.numel() == merged_losses.numel() == roles.size == 0
    assert offered == 16.0 and codes == [1, 1]
