"""EnergyLogger's sample count when a fit trains on several DataLoaders at once: Lightning combines them
(a `CombinedLoader`, or a dict or list of loaders given to `fit`) and each batch holds one batch per loader.
A sweep found only the first loader's samples counted, with no word (40 for 60 trained). Real Trainers fit a
small model on CPU."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import CombinedLoader
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse.callbacks.energy_logger import EnergyLogger
from lightning_pulse.energy.config import MeterConfig
from tests.conftest import trainer_kwargs


class TrainsOnEveryLoader(pl.LightningModule):
    """Sums the loss of every loader's batch and counts the samples it trained on."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 3)
        self.trained_samples = 0

    def training_step(self, batch, batch_idx):
        parts = batch.values() if isinstance(batch, dict) else batch
        loss = 0.0
        for part in parts:
            if part is None:  # a loader already exhausted (mode "max_size")
                continue
            if isinstance(part, dict):  # a loader of dict batches
                part = (part["x"], part["y"])
            x, y = part
            self.trained_samples += len(x)
            loss = loss + F.cross_entropy(self.net(x), y)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class DictItems(torch.utils.data.Dataset):
    def __init__(self, count: int) -> None:
        self.x, self.y = torch.randn(count, 4), torch.arange(count) % 3

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index):
        return {"x": self.x[index], "y": self.y[index]}


def loader(count: int, batch_size: int) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(count, 4), torch.arange(count) % 3), batch_size=batch_size)


LOADERS = {  # loader "a": 40 samples in batches of 8 (5 batches); "b": 16 in batches of 4 (4 batches)
    "max_size_cycle": lambda: CombinedLoader({"a": loader(40, 8), "b": loader(16, 4)}, "max_size_cycle"),
    "min_size": lambda: CombinedLoader({"a": loader(40, 8), "b": loader(16, 4)}, "min_size"),
    "max_size": lambda: CombinedLoader({"a": loader(40, 8), "b": loader(16, 4)}, "max_size"),
    "dict": lambda: {"a": loader(40, 8), "b": loader(16, 4)},
    "list": lambda: [loader(40, 8), loader(16, 4)],
    "dict batches": lambda: {"a": loader(40, 8), "b": DataLoader(DictItems(16), batch_size=4)},
}
TRAINED = {"max_size_cycle": 60, "min_size": 48, "max_size": 56, "dict": 60, "list": 60, "dict batches": 60}


@pytest.mark.parametrize("combined", list(LOADERS))
def test_several_training_loaders_count_the_samples_of_every_loader(tmp_path, combined, recwarn):
    torch.set_num_threads(1)
    energy = EnergyLogger(
        report_dir=tmp_path / "energy", cpu="constant", ram="none", meters=MeterConfig(cpu_watts=20.0)
    )
    module = TrainsOnEveryLoader()
    trainer = pl.Trainer(callbacks=[energy], **trainer_kwargs(max_epochs=1, default_root_dir=tmp_path))
    trainer.fit(module, LOADERS[combined]())
    assert module.trained_samples == TRAINED[combined]
    assert energy.report["total"]["samples"] == TRAINED[combined]
    assert "every training loader" in energy.report["counting"]["samples"]
    assert not [w for w in recwarn if str(w.message).startswith("EnergyLogger:")]


class MergesTheLoadersBatches(TrainsOnEveryLoader):
    """Joins the loaders' batches into one before the step: the batch no longer shows the loaders apart."""

    def on_after_batch_transfer(self, batch, dataloader_idx):
        xs, ys = zip(*batch.values())
        return torch.cat(xs), torch.cat(ys)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.trained_samples += len(x)
        return F.cross_entropy(self.net(x), y)


def test_a_combined_batch_that_does_not_show_its_loaders_is_counted_whole_and_said_once(tmp_path, recwarn):
    torch.set_num_threads(1)
    energy = EnergyLogger(
        report_dir=tmp_path / "energy", cpu="constant", ram="none", meters=MeterConfig(cpu_watts=20.0)
    )
    module = MergesTheLoadersBatches()
    trainer = pl.Trainer(callbacks=[energy], **trainer_kwargs(max_epochs=1, default_root_dir=tmp_path))
    trainer.fit(module, {"a": loader(40, 8), "b": loader(16, 4)})
    assert energy.report["total"]["samples"] == module.trained_samples == 60  # dimension 0 of the joined x
    said = [str(w.message) for w in recwarn if str(w.message).startswith("EnergyLogger:")]
    assert len(said) == 1 and "2 training loaders" in said[0] and "sample_counter" in said[0]
    assert "MAY BE WRONG" in energy.report["counting"]["samples"]


def test_tokens_of_several_loaders_are_known_when_every_loaders_batch_tells_them():
    from lightning_pulse.energy.counting import BatchCounter

    counter = BatchCounter({"a": loader(8, 2), "b": loader(9, 3)})
    doubts: list[str] = []

    def ids(rows: int) -> tuple[torch.Tensor, torch.Tensor]:  # (B, T) token ids, then labels
        return torch.ones(rows, 5, dtype=torch.long), torch.zeros(rows)

    def doubted(key, why):
        doubts.append(why)

    assert counter.count({"a": ids(2), "b": ids(3)}, doubted) == (5, 25)
    assert counter.count({"a": ids(2), "b": None}, doubted) == (2, 10)  # "b" exhausted
    assert counter.tokens({"a": ids(2), "b": ids(3)}) == 25  # with a `sample_counter` given
    assert counter.count({"a": ids(2), "b": (torch.zeros(3, 4), torch.zeros(3))}, doubted) == (5, None)
    assert not doubts


class TrainsOnOneLoader(TrainsOnEveryLoader):
    def training_step(self, batch, batch_idx):
        alone = isinstance(batch, list) and isinstance(batch[0], torch.Tensor)
        return super().training_step([batch] if alone else batch, batch_idx)


@pytest.mark.parametrize("wrapped", ["list", "dict"])
def test_one_training_loader_in_a_list_or_dict_is_described_as_one_loader(tmp_path, wrapped):
    # a review: `fit(model, [loader])` said "every training loader's batch, added up", of one loader
    torch.set_num_threads(1)
    notes = {}
    for given in ("alone", wrapped):
        energy = EnergyLogger(
            report_dir=tmp_path / given, cpu="constant", ram="none", meters=MeterConfig(cpu_watts=20.0)
        )
        trainer = pl.Trainer(callbacks=[energy], **trainer_kwargs(max_epochs=1, default_root_dir=tmp_path))
        one = loader(16, 4)
        trainer.fit(TrainsOnOneLoader(), {"alone": one, "list": [one], "dict": {"k": one}}[given])
        assert energy.report["total"]["samples"] == 16
        notes[given] = energy.report["counting"]["samples"]
    assert notes[wrapped] == notes["alone"] and "added up" not in notes[wrapped]
