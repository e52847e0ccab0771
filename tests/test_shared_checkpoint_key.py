"""One instance per checkpoint key: two callbacks of one kind returned by
``LightningModule.configure_callbacks`` (which Lightning merges after its own unique-``state_key`` check) are
refused before the first step, naming the callback, the shared key and the way out; one instance returned
there still trains."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import (
    EnergyLogger,
    GradientCache,
    GreenWindow,
    HardSampleReplay,
    HyperConnectionMonitor,
    MeterConfig,
    PulseCycle,
    ScheduledPrune,
    StabilityGuard,
)
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs


class _ModelWithCallbacks(pl.LightningModule):
    """A small MLP whose ``configure_callbacks`` returns the given callbacks; it counts its training steps."""

    def __init__(self, callbacks) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
        self.given = callbacks
        self.steps_run = 0

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        self.steps_run += 1
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def configure_callbacks(self):
        return self.given


def _loader():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 16, generator=generator)
    return DataLoader(TensorDataset(x, (x[:, :4].sum(1) > 0).long()), batch_size=16)


def _energy_logger(tmp_path, watts):
    folder, meters = str(tmp_path / f"energy_{watts}"), MeterConfig(cpu_watts=watts)
    return EnergyLogger(report_dir=folder, cpu="constant", gpu="none", ram="none", meters=meters)


MAKE = {
    "EnergyLogger": lambda tmp_path, i: _energy_logger(tmp_path, 100.0 if i == 0 else 1.0),
    "PulseCycle": lambda tmp_path, i: PulseCycle(burst=4 - 2 * i, replay=2, maintain=2, maintain_eval="none"),
    "HardSampleReplay": lambda tmp_path, i: HardSampleReplay(mode="batch", replay_fraction=0.5 - 0.25 * i),
    "GradientCache": lambda tmp_path, i: GradientCache(),
    "StabilityGuard": lambda tmp_path, i: StabilityGuard(),
    "ScheduledPrune": lambda tmp_path, i: ScheduledPrune(final_sparsity=0.5, every=2),
    "GreenWindow": lambda tmp_path, i: GreenWindow(),
    "HyperConnectionMonitor": lambda tmp_path, i: HyperConnectionMonitor(prefix="mhc"),
}


@pytest.mark.parametrize("name", list(MAKE))
def test_two_instances_from_configure_callbacks_are_refused_before_the_first_step(name, tmp_path):
    """Held-out sweep 39: such a pair trained with one checkpoint entry for both (a resumed EnergyLogger
    reported the other's power and carbon), two PulseCycles ran two clocks, and two HardSampleReplays were
    refused for a per-sample loss their training_step has."""
    model = _ModelWithCallbacks([MAKE[name](tmp_path, 0), MAKE[name](tmp_path, 1)])
    trainer = pl.Trainer(max_steps=8, **trainer_kwargs(default_root_dir=str(tmp_path)))
    key = model.given[0].state_key
    with pytest.raises(PulseRefusal, match=rf"^{name}: 2 callbacks share the checkpoint key ") as caught:
        trainer.fit(model, _loader())
    message = str(caught.value)
    assert (
        f"share the checkpoint key {key!r} (e.g. returned by LightningModule.configure_callbacks" in message
    )
    assert f"Keep one {name}" in message
    assert ("give each a distinct `prefix`" in message) == (name == "HyperConnectionMonitor")
    assert model.steps_run == 0 and trainer.global_step == 0


@pytest.mark.parametrize("name", ["EnergyLogger", "PulseCycle", "HardSampleReplay", "StabilityGuard"])
def test_one_instance_from_configure_callbacks_still_trains(name, tmp_path):
    model = _ModelWithCallbacks([MAKE[name](tmp_path, 0)])
    trainer = pl.Trainer(max_steps=16, **trainer_kwargs(default_root_dir=str(tmp_path)))  # two epochs
    trainer.fit(model, _loader())
    assert model.steps_run == trainer.global_step == 16


def test_hyper_connection_monitors_with_distinct_prefixes_from_configure_callbacks_train(tmp_path):
    monitors = [HyperConnectionMonitor(prefix="a"), HyperConnectionMonitor(prefix="b")]
    model = _ModelWithCallbacks(monitors)
    trainer = pl.Trainer(max_steps=4, **trainer_kwargs(default_root_dir=str(tmp_path)))
    with pytest.warns(UserWarning, match="found no HyperConnection"):  # this MLP has none: nothing logged
        trainer.fit(model, _loader())
    assert trainer.global_step == 4


class StabilityGuardNamedAlike(pl.Callback):
    """A user's callback that saves nothing, of the same class name as a lightning-pulse one."""


StabilityGuardNamedAlike.__qualname__ = "StabilityGuard"


def test_a_callback_that_saves_nothing_under_the_same_key_is_not_counted(tmp_path):
    """Review of sweep 39's fix: Lightning's own check counts only callbacks with a ``state_dict``; a user's
    stateless callback whose key is the same trained before the check and still does."""
    guard = StabilityGuard()
    model = _ModelWithCallbacks([StabilityGuardNamedAlike()])
    trainer = pl.Trainer(max_steps=4, callbacks=[guard], **trainer_kwargs(default_root_dir=str(tmp_path)))
    trainer.fit(model, _loader())
    assert trainer.global_step == 4
