"""Refusals at fit start: the sharded-strategy check names the callback, the strategy and the way out."""

from __future__ import annotations

import pytest
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, SingleDeviceStrategy

from lightning_pulse.errors import PulseRefusal, refuse_sharded_strategy, sharded_strategy_name
from tests.conftest import StandInTrainer


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
