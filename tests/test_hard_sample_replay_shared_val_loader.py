"""HardSampleReplay when validation iterates the training DataLoader object itself (``fit(model, loader,
loader)``, an overfit check, or a datamodule whose ``val_dataloader`` returns its train loader).

Forty-fourth pass: in steps mode (the default) the planned batch sampler was written into that DataLoader, so
every validation iterated the training plan and used up the pass's planned batches. With 64 samples and 4
epochs, validation saw 32 samples at steps 4 and 8 only and the run trained 8 of its 16 steps, without a word
(with PulseCycle, 12 of 24, and its end line blamed the user's sampler). Training now iterates a shallow copy
of the DataLoader carrying the plan; the user's object, which validation iterates, is left as built. Each test
compares a shared DataLoader with a separate one of the same data: the runs must be the same.
"""

from __future__ import annotations

import collections
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

from lightning_pulse import GradientCache, HardSampleReplay, PulseCycle
from lightning_pulse.core.sample_index import RecordingSampler
from tests.conftest import trainer_kwargs

X = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] + 0.5 * X[:, 1] > 0).long()


class Net(pl.LightningModule):
    """Records, per validation, the samples it validated, and whether the user's DataLoader (``watched``)
    still holds its own batch sampler and index sampler while validation iterates it."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 2)
        self.validated: collections.Counter[int] = collections.Counter()
        self.watched: tuple[DataLoader, BatchSampler] | None = None
        self.touched = False

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        if not self.trainer.sanity_checking:
            self.validated[self.trainer.global_step] += batch[0].shape[0]
        if self.watched is not None:
            loader, batches = self.watched
            self.touched |= loader.batch_sampler is not batches or isinstance(
                batches.sampler, RecordingSampler
            )
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SharedLoaderData(pl.LightningDataModule):
    """A datamodule whose ``val_dataloader`` returns the very DataLoader ``train_dataloader`` returns."""

    def __init__(self, loader: DataLoader) -> None:
        super().__init__()
        self.loader = loader

    def train_dataloader(self):
        return self.loader

    def val_dataloader(self):
        return self.loader


def _loader(**kwargs) -> DataLoader:
    return DataLoader(TensorDataset(X, Y), batch_size=8, **kwargs)


def _fit(shared: bool, callbacks, datamodule: bool = False, loader_kwargs=None, **overrides):
    torch.manual_seed(0)
    train = _loader(**(loader_kwargs or {}))
    model = Net()
    model.watched = (train, train.batch_sampler) if shared else None
    trainer = pl.Trainer(callbacks=callbacks(), **trainer_kwargs(**{"max_epochs": 4, **overrides}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if datamodule:
            assert shared
            trainer.fit(model, datamodule=SharedLoaderData(train))
        else:
            trainer.fit(model, train, train if shared else _loader(**(loader_kwargs or {})))
    assert not model.touched, "validation iterated a DataLoader that HardSampleReplay changed"
    # the user's DataLoader is as built after the fit too
    assert type(train.batch_sampler) is BatchSampler and isinstance(
        train.batch_sampler.sampler, SequentialSampler
    )
    return dict(model.validated), trainer.global_step, [p.detach().clone() for p in model.parameters()]


def _assert_same(shared, separate) -> None:
    assert shared[0] == separate[0]
    assert shared[1] == separate[1]
    for a, b in zip(shared[2], separate[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("sanity", [0, 2])
def test_steps_mode_with_validation_on_the_training_loader_trains_the_whole_plan(sanity):
    separate = _fit(False, lambda: [HardSampleReplay()], num_sanity_val_steps=sanity)
    assert separate[1] == 16 and separate[0] == {4: 64, 8: 64, 12: 64, 16: 64}
    _assert_same(_fit(True, lambda: [HardSampleReplay()], num_sanity_val_steps=sanity), separate)


@pytest.mark.parametrize("sanity", [0, 2])
def test_steps_mode_with_a_datamodule_validating_on_its_train_loader(sanity):
    separate = _fit(False, lambda: [HardSampleReplay()], num_sanity_val_steps=sanity)
    _assert_same(
        _fit(True, lambda: [HardSampleReplay()], datamodule=True, num_sanity_val_steps=sanity), separate
    )


def test_steps_mode_with_pulse_cycle_and_validation_on_the_training_loader():
    def callbacks():
        cycle = PulseCycle(burst=3, replay=3, maintain=1, warmup=0, anneal=0, probe_batches=1)
        return [cycle, HardSampleReplay()]

    separate = _fit(False, callbacks)
    assert separate[1] == 24
    _assert_same(_fit(True, callbacks), separate)


def test_steps_mode_shared_loader_with_persistent_workers():
    kwargs = dict(num_workers=1, persistent_workers=True)
    separate = _fit(False, lambda: [HardSampleReplay()], loader_kwargs=kwargs, max_epochs=2)
    _assert_same(_fit(True, lambda: [HardSampleReplay()], loader_kwargs=kwargs, max_epochs=2), separate)


def test_batch_mode_with_in_epoch_validation_on_the_training_loader():
    def callbacks():
        return [HardSampleReplay(mode="batch")]

    separate = _fit(False, callbacks, val_check_interval=0.5)
    _assert_same(_fit(True, callbacks, val_check_interval=0.5), separate)


class FrozenPrefixNet(pl.LightningModule):
    """GradientCache freezes ``pre`` at step 4 (threshold 2.0) and its activation cache replays it by index."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.pre(x)))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_gradient_cache_activation_cache_with_in_epoch_validation_on_the_training_loader():
    """The cache replays a frozen prefix's outputs by dataset index: an in-epoch validation on the training
    DataLoader must not restart its index recorder mid-pass. With the cache the fit trains as without it."""

    def fit(megabytes: float):
        train = _loader(shuffle=True, generator=torch.Generator().manual_seed(1))
        cache = GradientCache(threshold=2.0, check_every=4, freeze_for=400, activation_cache_mb=megabytes)
        trainer = pl.Trainer(callbacks=[cache], **trainer_kwargs(max_epochs=4, val_check_interval=0.5))
        model = FrozenPrefixNet()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, train, train)
        assert not isinstance(train.batch_sampler.sampler, RecordingSampler)
        return model, cache

    (cached, cache), (plain, _) = fit(4), fit(0)
    assert cache.events and cache.activations.disabled_reason is None
    assert cache.activations.hits > 0
    for (name, mine), theirs in zip(cached.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6, msg=name)


def test_steps_mode_resumed_with_validation_on_the_training_loader(tmp_path):
    """A resume runs no sanity check: the validation DataLoaders are the ones given to ``fit``."""

    def run(shared: bool):
        torch.manual_seed(0)
        model, path = Net(), tmp_path / f"shared_{shared}.ckpt"
        for epochs, ckpt_path in ((2, None), (4, path)):
            train = _loader()
            model.watched = (train, train.batch_sampler) if shared else None
            trainer = pl.Trainer(callbacks=[HardSampleReplay()], **trainer_kwargs(max_epochs=epochs))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer.fit(model, train, train if shared else _loader(), ckpt_path=ckpt_path)
            trainer.save_checkpoint(path)
        assert not model.touched
        return dict(model.validated), trainer.global_step, [p.detach().clone() for p in model.parameters()]

    separate = run(False)
    assert separate[1] == 16
    _assert_same(run(True), separate)


class ReloadedSharedData(pl.LightningDataModule):
    """A new train DataLoader at every reload; ``val_dataloader`` returns the latest one (or its own)."""

    def __init__(self, shared: bool) -> None:
        super().__init__()
        self.shared, self.latest = shared, None
        self.loaders: list[DataLoader] = []

    def train_dataloader(self):
        self.latest = _loader()
        self.loaders.append(self.latest)
        return self.latest

    def val_dataloader(self):
        if not self.shared:
            return _loader()
        if self.latest is None:
            self.latest = _loader()
        return self.latest


@pytest.mark.parametrize("sanity", [0, 2])
def test_batch_mode_reloading_each_epoch_with_validation_on_the_latest_training_loader(sanity):
    # a review: from epoch 1 on the reloaded loader was not known as validation's, and its recorder was
    # restarted by every in-epoch validation (final weights -1.324 against -1.109 summed)
    runs = []
    for shared in (False, True):
        torch.manual_seed(0)
        model, data = Net(), ReloadedSharedData(shared)
        settings = dict(max_epochs=3, reload_dataloaders_every_n_epochs=1, val_check_interval=0.5)
        trainer = pl.Trainer(
            callbacks=[HardSampleReplay(mode="batch")],
            **trainer_kwargs(**settings, num_sanity_val_steps=sanity),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, datamodule=data)
        assert all(not isinstance(loader.batch_sampler.sampler, RecordingSampler) for loader in data.loaders)
        runs.append(
            (dict(model.validated), trainer.global_step, [p.detach().clone() for p in model.parameters()])
        )
    _assert_same(runs[1], runs[0])


class UnhashableLoader(DataLoader):
    """A DataLoader subclass that defines ``__eq__`` (as a dataclass does), so it cannot be hashed."""

    __hash__ = None

    def __eq__(self, other):
        return self is other


def test_an_unhashable_training_loader_shared_with_validation_is_copied():
    # a review: the copies were cached in a WeakKeyDictionary, which raised "unhashable type" at fit start
    runs = []
    for shared in (False, True):
        torch.manual_seed(0)
        train, model = UnhashableLoader(TensorDataset(X, Y), batch_size=8), Net()
        trainer = pl.Trainer(callbacks=[HardSampleReplay()], **trainer_kwargs(max_epochs=2))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, train, train if shared else _loader())
        runs.append(
            (dict(model.validated), trainer.global_step, [p.detach().clone() for p in model.parameters()])
        )
    _assert_same(runs[1], runs[0])


class CurriculumData(pl.LightningDataModule):
    """A train DataLoader, and for validation that one (``shared``) or another one of the same data."""

    def __init__(self, shared: bool) -> None:
        super().__init__()
        self.loader = _loader()
        self.other = self.loader if shared else _loader()

    def train_dataloader(self):
        return self.loader

    def val_dataloader(self):
        return self.other


class Curriculum(pl.Callback):
    """From epoch 1 on, batches of 24 with the short last one dropped, set on the user's DataLoader (or on
    ``trainer.train_dataloader``)."""

    def __init__(self, data: CurriculumData, via_trainer: bool) -> None:
        self.data, self.via_trainer = data, via_trainer
        self.trained: collections.Counter[tuple[int, int]] = collections.Counter()

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            loader = trainer.train_dataloader if self.via_trainer else self.data.loader
            loader.batch_sampler.batch_size, loader.batch_sampler.drop_last = 24, True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.trained[(trainer.current_epoch, len(batch[0]))] += 1


@pytest.mark.parametrize(
    "replay, shared, via_trainer",
    [("cache", False, False), ("batch", False, False), ("batch", True, False), ("batch", True, True)],
)
def test_a_batch_size_curriculum_on_the_users_loader_reaches_training(replay, shared, via_trainer):
    # a sweep (pass 45): with num_sanity_val_steps=0 the validation loaders were not known yet, training
    # iterated a copy with a BatchSampler of its own, and a curriculum's batch size set on the user's
    # DataLoader never reached it: epoch 1 trained 8 batches of 8 instead of 2 of 24
    def sizes(callbacks):
        torch.manual_seed(0)
        data = CurriculumData(shared)
        curriculum = Curriculum(data, via_trainer)
        trainer = pl.Trainer(callbacks=[*callbacks, curriculum], **trainer_kwargs(max_epochs=2))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Net(), datamodule=data)
        # the user's DataLoader keeps its own index sampler (no recorder went in)
        assert isinstance(data.loader.batch_sampler.sampler, SequentialSampler)
        return dict(curriculum.trained)

    plain = sizes([])
    assert plain == {(0, 8): 8, (1, 24): 2}
    callback = (
        GradientCache(activation_cache_mb=4)
        if replay == "cache"
        else HardSampleReplay(mode="batch", replay_fraction=1.0)
    )
    assert sizes([callback]) == plain
