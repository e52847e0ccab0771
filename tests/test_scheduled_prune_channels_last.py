"""Structured pruning of a CNN in ``channels_last`` memory format: the fit-start trial cut silenced the
removed weights through ``weight.view(-1)``, which torch refuses on a channels_last weight, so every such
model was refused with a raw torch error and a way out that could not help; and the cut weights came back
contiguous (torch-pruning's ``index_select``)."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import ScheduledPrune
from tests.conftest import trainer_kwargs


def _is_channels_last(tensor: torch.Tensor) -> bool:
    return tensor.is_contiguous(memory_format=torch.channels_last) and not tensor.is_contiguous()


class _ChannelsLastCNN(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, 4),
        ).to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.contiguous(memory_format=torch.channels_last))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class _ComparesWithTheMaskedModel(pl.Callback):
    """Listed before ScheduledPrune: keeps the network as it was before each step's event, and when channels
    are cut, checks that the cut network computes what that copy computes with the removed weights zero."""

    def __init__(self, probe: torch.Tensor):
        self.probe, self.before, self.matched = probe, None, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.before = copy.deepcopy(pl_module.net)

    @torch.no_grad()
    def on_pulse_parameters_replaced(self, trainer, pl_module, remap):
        kept_of = {id(old): kept for old, _, kept in remap}
        masked = self.before.eval()
        for live, reference in zip(pl_module.net.parameters(), masked.parameters()):
            if id(live) in kept_of:
                silenced = torch.ones(reference.numel(), dtype=torch.bool)
                silenced[kept_of[id(live)]] = False
                reference.masked_fill_(silenced.view(reference.shape), 0)
        pl_module.net.eval()
        self.matched.append(torch.allclose(pl_module.net(self.probe), masked(self.probe), atol=1e-5))
        pl_module.net.train()


def test_structured_pruning_cuts_a_channels_last_cnn_like_its_masked_equivalent_and_keeps_the_layout():
    pl.seed_everything(0)
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 3, 8, 8, generator=generator), torch.randint(0, 4, (64,), generator=generator)
    model = _ChannelsLastCNN()
    compare = _ComparesWithTheMaskedModel(x[:8].contiguous(memory_format=torch.channels_last))
    prune = ScheduledPrune(final_sparsity=0.5, mode="structured", start=2, end=10, every=4, probe_batches=0)
    trainer = pl.Trainer(max_steps=14, callbacks=[compare, prune], **trainer_kwargs())
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16))

    assert trainer.global_step == 14 and len(prune.events) >= 2
    assert compare.matched and all(compare.matched)  # each cut equals the model with its removed weights zero
    assert sum(model.net[i].out_channels for i in (0, 3, 6)) < 40
    # the cut weights, and the momentum cut with them, keep the model's channels_last layout
    convs = [model.net[i].weight for i in (0, 3, 6)]
    assert all(_is_channels_last(weight) for weight in convs)
    assert all(_is_channels_last(trainer.optimizers[0].state[weight]["momentum_buffer"]) for weight in convs)
    assert torch.isfinite(model(x)).all()
