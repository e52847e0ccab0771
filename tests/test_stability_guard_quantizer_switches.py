"""A StabilityGuard rollback keeps the fake quantizers' on/off switches the user set since the snapshot.

The eager QAT recipe turns the observers (or fake quantization) off once, at a chosen step
(``model.apply(torch.ao.quantization.disable_observer)``). The switches are buffers: a rollback to a snapshot
taken before that step set them back to 1, and nothing calls the recipe again (the step counter does not go
back), so the observers kept moving the scales to the end of the run. The rest of each quantizer's state
(scale, zero point, the observer's range) still goes back to the snapshot.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import StabilityGuard
from lightning_pulse.core.snapshots import quantizer_switches, restore_snapshot, take_snapshot
from tests.conftest import trainer_kwargs

SWITCH_AT, SPIKE_AT = 32, 45


def _qat_net() -> nn.Module:
    from torch.ao.quantization import DeQuantStub, QuantStub, get_default_qat_qconfig, prepare_qat

    net = nn.Sequential(QuantStub(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4), DeQuantStub())
    net.train()
    net.qconfig = get_default_qat_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return prepare_qat(net)


class _QATRecipe(pl.LightningModule):
    def __init__(self, switch) -> None:
        super().__init__()
        self.net, self.switch, self.switched = _qat_net(), switch, False
        self.scales: list[float] = []  # the output quantizer's scale at each step's start

    def on_train_batch_start(self, batch, batch_idx):
        if self.trainer.global_step == SWITCH_AT and not self.switched:
            self.switched = True
            self.net.apply(self.switch)  # the recipe's one-shot call
        self.scales.append(float(self.net[1].activation_post_process.scale))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.trainer.global_step == SPIKE_AT and not getattr(self, "_spiked", False):
            self._spiked = True  # one bad batch
            return F.cross_entropy(self.net(x * 50), y) * 100
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit(switch) -> tuple[_QATRecipe, StabilityGuard]:
    torch.manual_seed(0)
    x = torch.randn(512, 16)
    y = (x @ torch.randn(16, 4)).argmax(1)
    guard = StabilityGuard(
        warmup=10, window=20, snapshot_every=20, max_snapshots=3, rollback_margin=10, rollback_after=1
    )
    model = _QATRecipe(switch)
    trainer = pl.Trainer(max_steps=80, callbacks=[guard], **trainer_kwargs())
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True))
    assert guard.metrics()["stability/rollbacks"] == 1  # to the snapshot of step 20, before the switch
    return model, guard


def test_a_rollback_to_before_disable_observer_keeps_the_observers_off():
    model, _ = _fit(torch.ao.quantization.disable_observer)
    switches = quantizer_switches(model)
    assert [name for name, flag in switches.items() if name.endswith("observer_enabled") and int(flag)] == []
    assert all(int(flag) for name, flag in switches.items() if name.endswith("fake_quant_enabled"))
    # the scale went back to the snapshot's at the rollback, and stayed there: no observer moved it since
    after_rollback = model.scales[-20:]
    assert len(set(after_rollback)) == 1
    assert after_rollback[0] != model.scales[SWITCH_AT]


def test_a_rollback_to_before_disable_fake_quant_keeps_fake_quantization_off():
    model, _ = _fit(torch.ao.quantization.disable_fake_quant)
    switches = quantizer_switches(model)
    assert [
        name for name, flag in switches.items() if name.endswith("fake_quant_enabled") and int(flag)
    ] == []
    assert all(int(flag) for name, flag in switches.items() if name.endswith("observer_enabled"))


def test_restore_keeps_a_learnable_quantizers_switches_and_restores_its_scale():
    from torch.ao.quantization import MovingAverageMinMaxObserver
    from torch.ao.quantization._learnable_fake_quantize import _LearnableFakeQuantize

    quantizer = _LearnableFakeQuantize(MovingAverageMinMaxObserver, quant_min=0, quant_max=255)
    model = nn.Sequential(nn.Linear(4, 4), quantizer)
    model(torch.randn(8, 4))  # static estimate: the observer writes the scale
    snapshot = take_snapshot(0, model)
    saved_scale = quantizer.scale.detach().clone()
    quantizer.enable_param_learning()  # LSQ's switch: learning on, the observer's estimate off
    with torch.no_grad():
        quantizer.scale.mul_(2.0)
    restore_snapshot(snapshot, model)
    assert (int(quantizer.learning_enabled), int(quantizer.static_enabled)) == (1, 0)
    assert quantizer.scale.requires_grad  # enable_param_learning's, consistent with learning_enabled
    assert torch.equal(quantizer.scale.detach(), saved_scale)
    assert set(quantizer_switches(model)) == {
        f"1.{name}"
        for name in ("fake_quant_enabled", "observer_enabled", "static_enabled", "learning_enabled")
    }


@pytest.mark.parametrize("shared", [False, True])
def test_quantizer_switches_name_every_state_dict_key_of_a_shared_quantizer(shared):
    model = _qat_net()
    if shared:
        model.extra = model[1].activation_post_process  # one quantizer under two names
    names = set(quantizer_switches(model))
    assert names <= set(model.state_dict())
    assert ("extra.observer_enabled" in names) == shared
