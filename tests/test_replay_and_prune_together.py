"""HardSampleReplay and a structured ScheduledPrune on a module whose forward computes its own loss."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_pulse import HardSampleReplay, ScheduledPrune
from tests.conftest import trainer_kwargs


class _Rows(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 8, 12, generator=generator)  # 8 tokens of 12 features
        self.labels = (self.x[..., 0] > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "labels": self.labels[index]}


class _LossInForward(pl.LightningModule):
    """As a Hugging Face model: ``forward(x, labels)`` returns the token-level loss, and the batch is a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.head(self.body(x))
        return logits if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    def training_step(self, batch, batch_idx):
        return self(**batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("replay_first", [True, False])
def test_replay_listed_before_a_structured_prune_does_not_capture_its_trial_cut(replay_first):
    # held-out sweep (T5, BART from configs): listed first, HardSampleReplay's capture of the first step was
    # open when ScheduledPrune's trial cut ran the model on two rows with its labels, and the replay refused
    # the run ("found no per-sample loss"), blaming the user's loss; listed second it trained
    pl.seed_everything(0)
    replay = HardSampleReplay(replay_fraction=0.5)
    prune = ScheduledPrune(final_sparsity=0.5, mode="structured", start=2, end=8, every=2, probe_batches=0)
    callbacks = [replay, prune] if replay_first else [prune, replay]
    trainer = pl.Trainer(max_steps=24, callbacks=callbacks, **trainer_kwargs())
    trainer.fit(_LossInForward(), DataLoader(_Rows(), batch_size=8))
    assert trainer.global_step == trainer.max_steps == 12  # the step-saving replay's plan: half the steps
    assert prune.events[-1]["sparsity"] > 0.3
    assert replay.metrics()["table_seen"] > 0
