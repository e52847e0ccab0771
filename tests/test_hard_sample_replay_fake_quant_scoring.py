"""HardSampleReplay's ForwardLossScorer gives back what its scoring forward writes into the module's buffers.

Its forward runs in eval mode, but a torch.ao fake quantizer observes in eval mode too (it checks
``observer_enabled``, not ``training``): every scored batch was observed a second time, and the observers'
``min_val``/``max_val``, the ``scale`` and ``zero_point`` moved at each scoring call. The scorer now gives every
buffer back as it was (:func:`~lightning_pulse.core.carried_state.kept_buffers`).
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import HardSampleReplay
from lightning_pulse.core.per_sample_loss import ForwardLossScorer
from tests.conftest import trainer_kwargs


class _WatchedScorer(ForwardLossScorer):
    def __init__(self) -> None:
        super().__init__()
        self.changed: list[list[str]] = []

    def __call__(self, pl_module, batch, outputs, batch_size):
        before = {key: value.clone() for key, value in pl_module.state_dict().items()}
        scores = super().__call__(pl_module, batch, outputs, batch_size)
        after = pl_module.state_dict()
        self.changed.append(
            [
                key
                for key in before
                if before[key].shape != after[key].shape or not torch.equal(before[key], after[key])
            ]
        )
        return scores


class _QAT(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from torch.ao.quantization import DeQuantStub, QuantStub, get_default_qat_qconfig, prepare_qat

        net = nn.Sequential(QuantStub(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4), DeQuantStub())
        net.train()
        net.qconfig = get_default_qat_qconfig("x86")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.net = prepare_qat(net)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def test_scoring_a_fake_quantized_model_leaves_its_observers_and_scales_alone():
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    y = (x @ torch.randn(16, 4)).argmax(1)
    scorer = _WatchedScorer()
    trainer = pl.Trainer(max_steps=12, callbacks=[HardSampleReplay(scorer=scorer)], **trainer_kwargs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_QAT(), DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True))
    assert len(scorer.changed) >= 6
    assert [names for names in scorer.changed if names] == []
