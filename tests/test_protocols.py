"""The cross-callback contracts: which callbacks each contract finds."""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback

from lightning_pulse import (
    EnergyLogger,
    GradientCache,
    HardSampleReplay,
    PulseCycle,
    ScheduledPrune,
    StabilityGuard,
)
from lightning_pulse.protocols import (
    ParametersReplacedListener,
    PhaseListener,
    PhaseStartListener,
    RollbackAware,
    listeners,
)


class _Trainer:
    def __init__(self, callbacks):
        self.callbacks = callbacks


class _OptsOutOfRollback(Callback):
    restore_on_rollback = False


def test_listeners_find_each_contract_in_callback_order_and_skip_the_caller():
    guard, replay, cycle = StabilityGuard(), HardSampleReplay(), PulseCycle(burst=5, replay=3, maintain=2)
    trainer = _Trainer([cycle, replay, _OptsOutOfRollback(), guard])

    assert list(listeners(trainer, PhaseListener, exclude=cycle)) == [guard]  # replay keeps no phase hook
    # opting in takes a true restore_on_rollback; the attribute set to False is not enough
    rollback = list(listeners(trainer, RollbackAware, exclude=guard))
    assert cycle in rollback and replay in rollback
    assert all(c.restore_on_rollback is True for c in rollback)
    assert not any(isinstance(c, _OptsOutOfRollback) for c in rollback)
    assert guard in list(listeners(trainer, ParametersReplacedListener))
    assert replay not in list(listeners(trainer, ParametersReplacedListener))


def test_the_shipped_callbacks_declare_the_contracts_they_take_part_in():
    assert isinstance(GradientCache(), PhaseListener) and isinstance(GradientCache(), RollbackAware)
    assert isinstance(ScheduledPrune(), PhaseListener) and isinstance(ScheduledPrune(), RollbackAware)
    assert isinstance(EnergyLogger(country_iso_code="DEU"), PhaseListener)
    assert isinstance(EnergyLogger(country_iso_code="DEU"), PhaseStartListener)  # books the probe to maintain
    assert not isinstance(StabilityGuard(), PhaseStartListener)  # it reads the probe: told after it
    assert isinstance(StabilityGuard(), ParametersReplacedListener)
