"""Refusals at fit start: the sharded-strategy check names the callback, the strategy and the way out."""

from __future__ import annotations

import pytest
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, SingleDeviceStrategy

from lightning_pulse.errors import PulseRefusal, refuse_sharded_strategy, refusing, sharded_strategy_name
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
