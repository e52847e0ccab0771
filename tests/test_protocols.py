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
    WeightsChangedListener,
    listeners,
    tell_weights_changed,
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
    assert isinstance(GradientCache(), WeightsChangedListener)  # drops the activations it recorded
    assert not isinstance(StabilityGuard(), WeightsChangedListener)


class _Told(Callback):
    """Records, in ``log``, the weight notifications it gets."""

    def __init__(self, log: list[tuple[str, object]]) -> None:
        self.log = log

    def on_pulse_parameters_replaced(self, trainer, pl_module, remap):
        self.log.append(("replaced", self))

    def on_pulse_weights_changed(self, trainer, pl_module):
        self.log.append(("changed", self))


def test_weights_changed_in_place_tell_only_that_and_a_replacement_tells_the_remap_first():
    log: list[tuple[str, object]] = []
    pruner, first, second = _Told(log), _Told(log), _Told(log)
    trainer = _Trainer([first, pruner, second])
    tell_weights_changed(trainer, None, [], exclude=pruner)  # an unstructured event: nothing replaced
    assert log == [("changed", first), ("changed", second)]
    log.clear()
    tell_weights_changed(trainer, None, [("old", "new", "kept")], exclude=pruner)
    assert log == [("replaced", first), ("replaced", second), ("changed", first), ("changed", second)]
