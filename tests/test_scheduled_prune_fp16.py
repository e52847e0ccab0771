"""ScheduledPrune's distillation under a float16 GradScaler (``16-mixed``). The term is added to the logits'
gradient inside the backward of the loss, which the precision plugin has multiplied by the scaler's scale;
``unscale_`` then divides every gradient by it before the step. The term was added unscaled, so it reached
the step divided by the scale (65536: a gradient norm of 1.1e-07 for 32-true's 7.3e-03; pass 43). Lightning
runs ``Trainer(precision="16-mixed")`` on a CPU as ``bf16-mixed`` (no scaler); its ``MixedPrecision("16-mixed",
"cpu")`` plugin runs float16 autocast with torch's CPU GradScaler, the path a GPU's ``16-mixed`` takes.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import ScheduledPrune
from lightning_pulse.core.distillation import DistillConfig
from tests.conftest import trainer_kwargs


def _digits() -> TensorDataset:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data[:256] / 16, dtype=torch.float32)
    return TensorDataset(x, torch.tensor(digits.target[:256]))


class _OnlyDistilled(pl.LightningModule):
    """A digits MLP whose own loss is multiplied by 0: every gradient it gets is the distillation term's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return 0.0 * F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _GradientNorms(Callback):
    """The gradient norm each optimizer step applies (after the scaler's ``unscale_``), by step."""

    def __init__(self) -> None:
        self.norms: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad.float().flatten() for p in pl_module.parameters() if p.grad is not None]
        self.norms[trainer.global_step] = float(torch.cat(grads).norm())


def _fit(**precision) -> tuple[dict[int, float], ScheduledPrune]:
    pl.seed_everything(0, verbose=False)
    prune = ScheduledPrune(final_sparsity=0.6, start=0, end=8, every=4, distill=DistillConfig(steps=3))
    norms = _GradientNorms()
    trainer = pl.Trainer(max_steps=12, callbacks=[prune, norms], **trainer_kwargs(**precision))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_OnlyDistilled(), DataLoader(_digits(), batch_size=32))
    return norms.norms, prune


def test_the_distillation_gradient_reaches_the_step_under_a_float16_grad_scaler_as_under_32_true():
    full, _ = _fit()
    scaled, prune = _fit(plugins=[MixedPrecision("16-mixed", "cpu")])
    assert [event["step"] for event in prune.events] == [1, 5, 8]
    assert all(event["distill_calls"] == 3 for event in prune.events)
    distilled = [step for step, norm in full.items() if norm > 0]
    assert distilled == [
        1,
        2,
        3,
        5,
        6,
        7,
        8,
        9,
        10,
    ]  # each window's three steps; the module's own loss gives none
    for step in distilled:  # float16 forwards: within 1%
        assert abs(scaled[step] / full[step] - 1) < 0.01, (step, scaled[step], full[step])
