"""HardSampleReplay with time-major batches whose time length equals the batch size at the first batch."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

from lightning_pulse.callbacks.hard_sample_replay import HardSampleReplay
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs

BATCH, VOCAB, CLASSES = 8, 20, 4


class _Sequences(Dataset):
    """32 token sequences; the longest of the first batch (unshuffled) is 8 long, as long as the batch, and
    those of the second at most 6."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        lengths = [8, 5, 3, 6, 4, 7, 2, 5] + [6, 3, 4, 5, 2, 6, 3, 4] + [8, 7, 6, 5, 4, 3, 2, 8] * 2
        self.tokens = [torch.randint(1, VOCAB, (n,), generator=generator) for n in lengths]
        self.labels = torch.randint(0, CLASSES, (len(lengths),), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index):
        return self.tokens[index], self.labels[index]


def _time_major_with_a_padding_mask(samples):
    tokens, labels = zip(*samples)
    x = pad_sequence(list(tokens))  # (T, B): batch_first=False
    return [x, x.t() == 0, torch.stack(labels)]  # the mask is (B, T), as nn.MultiheadAttention reads it


class _TimeMajorAttention(pl.LightningModule):
    """nn.MultiheadAttention(batch_first=False) over (T, B) tokens with a (B, T) key_padding_mask."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.attention = torch.nn.MultiheadAttention(16, 2)
        self.head = torch.nn.Linear(16, CLASSES)
        self.shapes: list[tuple[int, ...]] = []

    def training_step(self, batch, batch_idx):
        x, mask, y = batch
        self.shapes.append(tuple(x.shape))
        h = self.embed(x)
        attended, _ = self.attention(h, h, h, key_padding_mask=mask)
        kept = (~mask).t().unsqueeze(-1)
        pooled = (attended * kept).sum(0) / kept.sum(0)
        return F.cross_entropy(self.head(pooled), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(mode: str, module: _TimeMajorAttention) -> None:
    trainer = pl.Trainer(
        callbacks=[HardSampleReplay(mode=mode, replay_fraction=0.5)], max_epochs=3, **trainer_kwargs()
    )
    trainer.fit(
        module, DataLoader(_Sequences(), batch_size=BATCH, collate_fn=_time_major_with_a_padding_mask)
    )


def test_batch_mode_refuses_a_time_major_batch_at_the_first_batch_whose_time_length_is_not_the_batch():
    # held-out sweep: the first batch, (8, 8) tokens, told neither layout; a later replay batch was cut along
    # time (x to (4, 8), the mask and labels to 4 samples) and nn.MultiheadAttention failed on the shapes
    module = _TimeMajorAttention()
    with pytest.raises(
        PulseRefusal,
        match=r"^HardSampleReplay cannot cut .*\(6, 8\).*batch\[0\] was \(8, 8\).*time-major.*mode='steps'",
    ):
        _fit("batch", module)
    assert module.shapes == [(8, 8)]  # refused at the second batch, before any cut


def test_steps_mode_trains_the_same_time_major_batches_whole():
    module = _TimeMajorAttention()
    _fit("steps", module)
    assert module.shapes and all(shape[1] == BATCH for shape in module.shapes)
