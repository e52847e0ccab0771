"""Ordinary LightningModules for MNIST-1D. Nothing pulse-specific lives here."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

ARCHITECTURES = ("mlp", "cnn")


def build_mnist1d_network(arch: str = "cnn", width: int = 100, channels: int = 25) -> nn.Module:
    """The networks of the MNIST-1D paper: an MLP, and a 3-layer 1-D CNN with stride-2 convolutions.

    Input ``(B, 40)``, output logits ``(B, 10)``.
    """
    if arch == "mlp":
        return nn.Sequential(
            nn.Linear(40, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
        )
    if arch == "cnn":
        return nn.Sequential(
            nn.Unflatten(1, (1, 40)),
            nn.Conv1d(1, channels, 5, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(channels * 5, 10),
        )
    raise ValueError(f"`arch`={arch!r} is not one of {list(ARCHITECTURES)}.")


class MNIST1DClassifier(pl.LightningModule):
    """Cross-entropy classifier on MNIST-1D.

    Args:
        arch: ``"mlp"`` or ``"cnn"``.
        lr: Adam learning rate.
        weight_decay: Adam weight decay.
        width: hidden width of the MLP.
        channels: channels of every CNN layer.
        scheduler: ``"none"`` or ``"onecycle"`` (stepped per optimizer step, so it must survive any change
            of epoch length a callback makes).
    """

    def __init__(
        self,
        arch: str = "cnn",
        lr: float = 1e-2,
        weight_decay: float = 0.0,
        width: int = 100,
        channels: int = 25,
        scheduler: str = "none",
    ) -> None:
        super().__init__()
        if scheduler not in ("none", "onecycle"):
            raise ValueError(f"`scheduler`={scheduler!r} is not one of ['none', 'onecycle'].")
        self.save_hyperparameters()
        self.net = build_mnist1d_network(arch, width, channels)
        self.val_acc = MulticlassAccuracy(num_classes=10, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=10, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("test_loss", F.cross_entropy(logits, y))
        self.test_acc(logits, y)
        self.log("test_acc", self.test_acc)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )
        if self.hparams.scheduler == "none":
            return optimizer
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.hparams.lr, total_steps=int(self.trainer.estimated_stepping_batches)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
