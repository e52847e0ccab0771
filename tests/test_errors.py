"""Refusals at fit start: the sharded-strategy and lazy-module checks name the callback, the reason and the way
out."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, SingleDeviceStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import GradientCache, StabilityGuard
from lightning_pulse.errors import (
    PulseRefusal,
    refuse_sharded_strategy,
    refuse_uninitialized_parameters,
    refusing,
    sharded_strategy_name,
)
from tests.conftest import StandInTrainer, trainer_kwargs


@pytest.mark.parametrize("strategy_class", [FSDPStrategy, DeepSpeedStrategy])
def test_a_sharded_strategy_is_refused_naming_callback_strategy_and_way_out(strategy_class):
    trainer = StandInTrainer(strategy_class)
    assert sharded_strategy_name(trainer) == strategy_class.__name__
    with pytest.raises(
        PulseRefusal, match=rf"^GradientCache does not support {strategy_class.__name__}: .*ddp"
    ):
        refuse_sharded_strategy(trainer, "GradientCache", "a rank holds a shard of each parameter")


@pytest.mark.parametrize("strategy_class", [DDPStrategy, SingleDeviceStrategy])
def test_replicated_strategies_pass(strategy_class):
    trainer = StandInTrainer(strategy_class)
    assert sharded_strategy_name(trainer) is None
    refuse_sharded_strategy(trainer, "GradientCache", "unused")


def test_refusing_turns_a_plain_checks_value_error_into_a_refusal_naming_the_callback():
    with pytest.raises(PulseRefusal, match=r"^PulseCycle: `warmup`=0.1 is a share of the run\.$") as caught:
        with refusing("PulseCycle"):
            raise ValueError("`warmup`=0.1 is a share of the run.")
    assert caught.value.__suppress_context__  # one message, not the ValueError's traceback too
    with pytest.raises(KeyError):  # anything but a ValueError passes through
        with refusing("PulseCycle"):
            raise KeyError("step")
    with refusing("PulseCycle"):
        pass


def test_a_lazy_module_before_its_first_forward_is_refused_naming_its_tensors_and_the_way_out():
    model = torch.nn.Sequential(
        torch.nn.LazyLinear(8),
        torch.nn.LazyBatchNorm1d(affine=False),
        torch.nn.LazyLinear(4),
        torch.nn.Linear(4, 2),
    )
    with pytest.raises(PulseRefusal) as caught:
        refuse_uninitialized_parameters(model, "StabilityGuard")
    message = str(caught.value)
    # parameters first, then the buffers a lazy norm without parameters creates; the rest counted
    assert message.startswith(
        "StabilityGuard: the model's 0.weight, 0.bias, 2.weight and 3 more do not exist yet"
    )
    assert "nn.LazyLinear" in message and "`setup` or `configure_model`" in message
    # the way out says which validation loader helps, and what to do with a lazy module the forward never
    # calls
    assert "validation loader whose `validation_step` runs the forward (num_sanity_val_steps > 0)" in message
    assert "a lazy module the forward never calls (an auxiliary head) must be created" in message
    model(torch.randn(3, 5))  # the first forward creates them
    refuse_uninitialized_parameters(model, "StabilityGuard")


class _LazyClassifier(pl.LightningModule):
    """An MLP whose first layer is ``nn.LazyLinear``: its weight exists only after the first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("make", [GradientCache, StabilityGuard], ids=lambda make: make.__name__)
def test_a_lazy_model_is_refused_before_the_first_step_unless_a_sanity_check_created_its_weights(make):
    """Held-out sweep 19: without a validation loader, GradientCache and StabilityGuard crashed at fit start
    with torch's "Attempted to use an uninitialized parameter", naming neither themselves nor the way out."""
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(64, 6, generator=generator), torch.randint(0, 3, (64,), generator=generator)
    )
    loader = DataLoader(data, batch_size=16)
    with pytest.raises(
        PulseRefusal, match=rf"^{make.__name__}: the model's net.0.weight, net.0.bias"
    ) as caught:
        pl.Trainer(max_steps=4, callbacks=[make()], **trainer_kwargs()).fit(_LazyClassifier(), loader)
    assert "whose `validation_step` runs the forward (num_sanity_val_steps > 0)" in str(caught.value)
    trainer = pl.Trainer(
        max_steps=4, callbacks=[make()], **trainer_kwargs(num_sanity_val_steps=1, limit_val_batches=1)
    )
    trainer.fit(_LazyClassifier(), loader, loader)  # the sanity check's forward created them: it trains
    assert trainer.global_step == 4
