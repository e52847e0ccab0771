"""The cross-callback contracts: which callbacks each contract finds."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_pulse import (
    EnergyLogger,
    GradientCache,
    HardSampleReplay,
    PulseCycle,
    ScheduledPrune,
    StabilityGuard,
)
from lightning_pulse import _lightning_compat as compat
from lightning_pulse.protocols import (
    ParametersReplacedListener,
    PhaseListener,
    PhaseStartListener,
    RollbackAware,
    TemporaryFreezer,
    WeightsChangedListener,
    listeners,
    tell_weights_changed,
)
from tests.conftest import trainer_kwargs


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


class _HoldsFrozen(Callback):
    """A TemporaryFreezer holding ``names`` frozen (and naming one the model no longer has)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def temporarily_frozen(self, pl_module):
        return self.names


class _RecordingDDP(DDPStrategy):
    """Records which parameters require grad while a DDP wrapper is built, instead of building one."""

    def _setup_model(self, model):
        self.trainable_at_wrap = {name for name, p in model.named_parameters() if p.requires_grad}
        return self.model

    def _register_ddp_hooks(self) -> None:
        pass


def test_a_ddp_rewrap_registers_what_a_temporary_freezer_holds_and_leaves_the_users_frozen_parameters_out():
    module = pl.LightningModule()
    module.net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    for param in [*module.net[0].parameters(), *module.net[1].parameters()]:
        param.requires_grad_(False)  # net.0: the user's frozen backbone; net.1: held by the freezer
    strategy = _RecordingDDP()
    strategy.connect(module)
    strategy.model = DistributedDataParallel.__new__(DistributedDataParallel)  # the wrapper to replace
    trainer = _Trainer([_HoldsFrozen(["net.1.weight", "net.1.bias", "net.9.weight"])])
    trainer.strategy = strategy

    assert compat.rewrap_ddp(trainer)
    assert strategy.trainable_at_wrap == {"net.1.weight", "net.1.bias", "net.2.weight", "net.2.bias"}
    # the flags are the freezer's and the user's again once the wrapper is built
    assert [p.requires_grad for p in module.parameters()] == [False] * 4 + [True] * 2


def test_gradient_cache_names_the_parameters_it_holds_frozen_and_not_those_the_user_froze(mnist1d_small):
    model, data = mnist1d_small()
    model.net[1].bias.requires_grad_(False)  # the user's: it stays frozen when GradientCache releases net.1
    cache = GradientCache(threshold=10.0, check_every=2, freeze_for=4, max_frozen_share=1.0)
    told: list[tuple[set[str], set[str]]] = []

    class Look(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            frozen = {name for name, p in pl_module.named_parameters() if not p.requires_grad}
            told.append((set(cache.temporarily_frozen(pl_module)), frozen - {"net.1.bias"}))

    trainer = pl.Trainer(max_steps=8, callbacks=[cache, Look()], **trainer_kwargs())
    trainer.fit(model, data)
    assert isinstance(cache, TemporaryFreezer)
    assert any(held for held, _ in told), "nothing was frozen"
    assert all(held == frozen for held, frozen in told)
    assert cache.temporarily_frozen(model) == []  # the fit ended: every unit trains again
