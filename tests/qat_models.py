"""A small eager-mode quantization-aware classifier (``torch.ao.quantization.prepare_qat``), shared by tests.

Its per-channel fake-quant observers are buffers updated at every training forward, and their ``min_val`` /
``max_val`` have shape ``(0,)`` until the first forward, one element per channel after it.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn


class EagerQATClassifier(pl.LightningModule):
    """``QuantStub``, Linear layers of ``widths`` with ReLUs between, ``DeQuantStub``; Adam at 3e-3."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 2)) -> None:
        super().__init__()
        from torch.ao.quantization import DeQuantStub, QuantStub, get_default_qat_qconfig, prepare_qat

        layers: list[nn.Module] = [QuantStub()]
        for index, (width_in, width_out) in enumerate(zip(widths, widths[1:])):
            layers += [nn.Linear(width_in, width_out)] + ([nn.ReLU()] if index < len(widths) - 2 else [])
        net = nn.Sequential(*layers, DeQuantStub())
        net.train()
        net.qconfig = get_default_qat_qconfig("x86")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.net = prepare_qat(net)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)
