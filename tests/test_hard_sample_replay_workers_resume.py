"""HardSampleReplay(mode="steps") resumed with DataLoader workers: the resumed run trains what the
uninterrupted one did, from the resumed step on."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Sampler, TensorDataset

from lightning_pulse import HardSampleReplay
from tests.conftest import trainer_kwargs

SAMPLES, BATCH, EPOCHS = 320, 32, 3  # 10 plain batches an epoch: 5 planned steps of 64-sample windows


class EpochSeededSampler(Sampler[int]):
    """A shuffle seeded per epoch through ``set_epoch`` (as ``DistributedSampler`` is), so a resume can draw
    the uninterrupted run's order."""

    def __init__(self, size: int) -> None:
        self.size, self.epoch = size, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        generator = torch.Generator().manual_seed(100 + self.epoch)
        return iter(torch.randperm(self.size, generator=generator).tolist())


class IndexedMLP(pl.LightningModule):
    """Records, per optimizer step, the dataset indices it trained on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
        self.trained: dict[int, list[int]] = {}

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.trained[self.trainer.global_step] = sorted(index.tolist())
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _digits() -> TensorDataset:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data[:SAMPLES] / 16, dtype=torch.float32)
    return TensorDataset(x, torch.tensor(digits.target[:SAMPLES]), torch.arange(SAMPLES))


def _fit(persistent: bool, callbacks=(), ckpt_path=None) -> IndexedMLP:
    pl.seed_everything(0)
    model = IndexedMLP()
    loader = DataLoader(
        _digits(),
        batch_size=BATCH,
        sampler=EpochSeededSampler(SAMPLES),
        num_workers=2,
        persistent_workers=persistent,
    )
    trainer = pl.Trainer(
        callbacks=[HardSampleReplay(mode="steps"), *callbacks],
        max_epochs=EPOCHS,
        **trainer_kwargs(enable_checkpointing=bool(callbacks), limit_val_batches=0),
    )
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    assert trainer.global_step == 15
    return model


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent-workers", "workers"])
@pytest.mark.parametrize("resume_step", [7, 5], ids=["mid-second-pass", "on-the-first-passs-last-batch"])
def test_a_resume_with_dataloader_workers_trains_the_uninterrupted_runs_batches(
    tmp_path, persistent, resume_step
):
    # held-out sweep: Lightning creates the fit's first iterator before it sets the sampler's epoch, and a
    # loader with workers draws its first indices right then. A resume into the second pass drew epoch 0's
    # order (every later step trained other samples, final weights off by 0.18); one from a pass's last batch
    # also chose the next pass before the finished pass's scores were applied
    every_step = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    full = _fit(persistent, [every_step])
    checkpoint = next(tmp_path.glob(f"*step={resume_step}.ckpt"))
    resumed = _fit(persistent, ckpt_path=str(checkpoint))

    assert sorted(resumed.trained) == list(range(resume_step, 15))
    assert {step: full.trained[step] for step in resumed.trained} == resumed.trained
    for full_weight, resumed_weight in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(full_weight, resumed_weight)
