"""``pytorch_lightning``'s Trainer (the older package namespace, the same code under other classes) is refused
before the first step by every callback, naming the callback and the way out (``lightning.pytorch``). Before,
the callbacks' checks against ``lightning.pytorch``'s classes missed: StabilityGuard crashed at train start
("Expected a parent") and ScheduledPrune refused one CPU as an unsupported strategy."""

from __future__ import annotations

import pytest
import pytorch_lightning
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs
from tests.test_shared_checkpoint_key import MAKE


class _OlderPackageModule(pytorch_lightning.LightningModule):
    """A small MLP on the ``pytorch_lightning`` namespace, as many tutorials still write it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
        self.steps_run = 0

    def training_step(self, batch, batch_idx):
        self.steps_run += 1
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Trainer(pytorch_lightning.Trainer):
    """A project's own wrapper, named like its base: the first class called ``Trainer`` in its MRO is the
    user's, which the first refusal took for the package's."""


@pytest.mark.parametrize("trainer_class", [pytorch_lightning.Trainer, Trainer], ids=["package", "subclass"])
@pytest.mark.parametrize("name", list(MAKE))
def test_the_pytorch_lightning_trainer_is_refused_before_the_first_step(name, trainer_class, tmp_path):
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)
    model = _OlderPackageModule()
    trainer = trainer_class(
        **trainer_kwargs(max_steps=4, default_root_dir=tmp_path, callbacks=[MAKE[name](tmp_path, 0)])
    )
    with pytest.raises(PulseRefusal) as refused:
        trainer.fit(model, loader)
    message = str(refused.value)
    assert message.startswith(f"{name}: this Trainer is pytorch_lightning.Trainer (or a subclass"), message
    assert "import lightning.pytorch as pl" in message
    assert model.steps_run == 0
