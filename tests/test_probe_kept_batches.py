"""The probe keeps the first validation batches for the fit: every probe sees what one validation pass sees
(a module that transforms its batch in place changes no kept batch), and reading them leaves the run's
validation loader, and so its random stream, as a run without the probe has them."""

from __future__ import annotations

from dataclasses import dataclass

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, get_worker_info

from lightning_pulse import PulseCycle, ScheduledPrune
from tests.conftest import trainer_kwargs


class _Samples(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict:
        generator = torch.Generator().manual_seed(index)
        return {"x": torch.randn(8, generator=generator), "y": index % 3}


class _InPlace(pl.LightningModule):
    """Transforms its batch in place: Lightning's documented ``batch["x"] = transforms(batch["x"])`` in
    ``on_before_batch_transfer``, or an in-place op in ``validation_step`` (on CPU, the loader's tensor)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.where = nn.Linear(8, 3), where

    def on_before_batch_transfer(self, batch, dataloader_idx):
        if self.where == "hook":
            batch["x"] = batch["x"] * 2.0 + 1.0
        return batch

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch["x"]), batch["y"])

    def validation_step(self, batch, batch_idx):
        if self.where == "step":
            batch["x"].mul_(2.0).add_(1.0)
        self.log("x_mean", batch["x"].mean())
        self.log("val_loss", F.cross_entropy(self.net(batch["x"]), batch["y"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _Probes(Callback):
    def __init__(self, cycle: PulseCycle) -> None:
        self.cycle, self.seen = cycle, []

    def on_train_batch_end(self, trainer, pl_module, *args):
        if self.cycle.last_probe and (not self.seen or self.seen[-1] is not self.cycle.last_probe):
            self.seen.append(self.cycle.last_probe)


@pytest.mark.parametrize("where", ["hook", "step"])
def test_every_probe_sees_what_one_validation_pass_sees(tmp_path, where):
    """Sweep: the probe ran the batch hooks on the kept batches themselves, so an in-place transform
    (x -> 2x + 1) was applied once more at each probe: x_mean 0.919, 2.837, 6.674, 14.348 over four
    PulseCycle probes, and ScheduledPrune's probe after an event saw other data than its probe before it
    (x_mean 0.919 -> 2.837), the loss rise blamed on the prune."""
    cycle = PulseCycle(burst=3, replay=0, maintain=1, warmup=0, anneal=0, probe_batches=2)
    probes = _Probes(cycle)
    trainer = pl.Trainer(
        max_steps=16, callbacks=[cycle, probes], default_root_dir=tmp_path, **trainer_kwargs()
    )
    trainer.fit(
        _InPlace(where), DataLoader(_Samples(), batch_size=8, shuffle=True), DataLoader(_Samples(), 8)
    )
    validated = trainer.validate(trainer.lightning_module, DataLoader(_Samples(), 8), verbose=False)[0]
    means = [probe["x_mean"] for probe in probes.seen]
    assert len(means) >= 3
    assert means == pytest.approx([validated["x_mean"]] * len(means), rel=1e-6)

    prune = ScheduledPrune(final_sparsity=0.5, start=2, end=8, every=2, probe_batches=2)
    trainer = pl.Trainer(max_steps=12, callbacks=[prune], default_root_dir=tmp_path, **trainer_kwargs())
    trainer.fit(
        _InPlace(where), DataLoader(_Samples(), batch_size=8, shuffle=True), DataLoader(_Samples(), 8)
    )
    assert prune.events
    for event in prune.events:
        assert event["probe_before"]["x_mean"] == pytest.approx(validated["x_mean"], rel=1e-6)
        assert event["probe_after"]["x_mean"] == pytest.approx(validated["x_mean"], rel=1e-6)


class _Box:
    """A batch class that is no collection: Lightning moves it through its ``.to()`` as it is."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def to(self, *args, **kwargs):
        self.x, self.y = self.x.to(*args, **kwargs), self.y.to(*args, **kwargs)
        return self


def _collate_box(items: list[dict]) -> _Box:
    return _Box(torch.stack([item["x"] for item in items]), torch.tensor([item["y"] for item in items]))


class _InPlaceBox(_InPlace):
    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch.x), batch.y)

    def validation_step(self, batch, batch_idx):
        batch.x.mul_(2.0).add_(1.0)
        self.log("x_mean", batch.x.mean(), batch_size=len(batch.y))


def test_every_probe_sees_the_same_batch_of_a_custom_batch_class(tmp_path):
    """A review: the copy cloned the tensors of lists, tuples and mappings only, so a batch class with
    ``.to()`` (no collection) was kept as is and an in-place change in ``validation_step`` compounded again:
    x_mean 0.919, 2.837, 6.674, 14.348. Such a batch is now deep-copied for each probe."""
    cycle = PulseCycle(burst=3, replay=0, maintain=1, warmup=0, anneal=0, probe_batches=2)
    probes = _Probes(cycle)
    trainer = pl.Trainer(
        max_steps=16, callbacks=[cycle, probes], default_root_dir=tmp_path, **trainer_kwargs()
    )
    loaders = [
        DataLoader(_Samples(), batch_size=8, shuffle=shuffle, collate_fn=_collate_box)
        for shuffle in (True, False)
    ]
    trainer.fit(_InPlaceBox("step"), *loaders)
    means = [probe["x_mean"] for probe in probes.seen]
    assert len(means) >= 3
    assert means == pytest.approx([means[0]] * len(means), rel=1e-6)


@dataclass(slots=True)
class _SlotBox:
    """A batch class with ``__slots__`` (``dataclass(slots=True)``, attrs' ``@define``): no ``__dict__``."""

    x: torch.Tensor
    y: torch.Tensor

    def to(self, *args, **kwargs):
        self.x, self.y = self.x.to(*args, **kwargs), self.y.to(*args, **kwargs)
        return self


class _Slotted(_Box):
    """A subclass adding slots to a ``__dict__`` class, and a tensor one level further down."""

    __slots__ = ("__extra",)

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        super().__init__(x, y)
        self.__extra = {"scale": torch.ones(())}

    def to(self, *args, **kwargs):
        self.__extra = {"scale": self.__extra["scale"].to(*args, **kwargs)}
        return super().to(*args, **kwargs)


class _Holder:
    """An object holding a tensor only through another object (``self.inner.x``)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.inner = _Box(x, y)

    @property
    def y(self) -> torch.Tensor:
        return self.inner.y

    def to(self, *args, **kwargs):
        self.inner.to(*args, **kwargs)
        return self


@pytest.mark.parametrize("box", [_SlotBox, _Slotted, _Holder])
def test_every_probe_sees_the_same_batch_of_a_slotted_batch_class(tmp_path, box):
    """Sweep: the probe's copy looked for tensors in an object's ``__dict__`` only, so a batch class with
    ``__slots__`` (``@dataclass(slots=True)``, attrs classes) was kept as is and an in-place change in
    ``validation_step`` compounded: x_mean 0.919, 2.837, 6.674, 14.348 over four probes. The copy now finds
    the tensors in slots and in objects held by the batch too."""

    def collate(items: list[dict]):
        return box(torch.stack([item["x"] for item in items]), torch.tensor([item["y"] for item in items]))

    class Module(_InPlaceBox):
        def training_step(self, batch, batch_idx):
            inner = getattr(batch, "inner", batch)
            return F.cross_entropy(self.net(inner.x), batch.y)

        def validation_step(self, batch, batch_idx):
            inner = getattr(batch, "inner", batch)
            inner.x.mul_(2.0).add_(1.0)
            self.log("x_mean", inner.x.mean(), batch_size=len(batch.y))

    cycle = PulseCycle(burst=3, replay=0, maintain=1, warmup=0, anneal=0, probe_batches=2)
    probes = _Probes(cycle)
    trainer = pl.Trainer(
        max_steps=16, callbacks=[cycle, probes], default_root_dir=tmp_path, **trainer_kwargs()
    )
    loaders = [
        DataLoader(_Samples(), batch_size=8, shuffle=shuffle, collate_fn=collate) for shuffle in (True, False)
    ]
    trainer.fit(Module("step"), *loaders)
    means = [probe["x_mean"] for probe in probes.seen]
    assert len(means) >= 3
    assert means == pytest.approx([0.919] * len(means), abs=5e-4)


class _Linear(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 3)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]))
        self.log("x_mean", batch[0].mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_with_workers(tmp_path, probe: bool, val_data: Dataset, **trainer_overrides):
    generator = torch.Generator().manual_seed(0)
    train = TensorDataset(
        torch.randn(96, 8, generator=generator), torch.randint(0, 3, (96,), generator=generator)
    )
    torch.manual_seed(0)
    module = _Linear()
    cycle = PulseCycle(
        burst=3,
        replay=0,
        maintain=1,
        warmup=0,
        anneal=0,
        **({"probe_batches": 2} if probe else {"maintain_eval": "none"}),
    )
    probes = _Probes(cycle)
    trainer = pl.Trainer(
        max_epochs=3,
        callbacks=[cycle, probes],
        default_root_dir=tmp_path,
        **trainer_kwargs(**trainer_overrides),
    )
    val = DataLoader(val_data, batch_size=8, num_workers=2, persistent_workers=True)
    trainer.fit(module, DataLoader(train, batch_size=8, shuffle=True), val)
    weights = torch.cat([parameter.detach().flatten() for parameter in module.parameters()])
    return weights, trainer, probes.seen


def test_a_probe_on_a_persistent_workers_loader_leaves_the_run_as_without_it(tmp_path):
    """Sweep: the probe built the validation loader's persistent iterator inside isolate_rng (its seed draw
    undone); Lightning's first validation then only reset it, without the draw a run without the probe makes,
    so every later epoch shuffled otherwise: weights 0.0198 apart from maintain_eval="none" (docs promise the
    same figures)."""
    generator = torch.Generator().manual_seed(1)
    val = TensorDataset(
        torch.randn(48, 8, generator=generator), torch.randint(0, 3, (48,), generator=generator)
    )
    probed, trainer, seen = _fit_with_workers(tmp_path, True, val)
    plain, plain_trainer, _ = _fit_with_workers(tmp_path, False, val)
    assert seen
    assert torch.equal(probed, plain)
    assert float(trainer.callback_metrics["val_loss"]) == float(plain_trainer.callback_metrics["val_loss"])


class _Sharded(IterableDataset):
    """Each worker yields its own block of samples: the batches depend on the loader's workers (two give
    samples 0-7 and 16-23 first, one gives 0-15)."""

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for index in range(worker * 32 // workers, (worker + 1) * 32 // workers):
            yield torch.full((8,), float(index)), torch.tensor(index % 3)


def test_the_probe_reads_a_persistent_workers_loader_as_its_validation_does(tmp_path):
    """The probe's copy of a persistent-workers loader keeps its workers: the batches of an IterableDataset
    sharded over them are the first validation batches Lightning's validation takes."""
    _, trainer, seen = _fit_with_workers(tmp_path, True, _Sharded(), limit_val_batches=2)
    assert seen
    assert seen[0]["x_mean"] == pytest.approx(float(trainer.callback_metrics["x_mean"]))
    assert seen[0]["x_mean"] == pytest.approx(11.5)  # samples 0-7 and 16-23 (no workers: 0-15, 7.5)
